"""One model over several pods on the real node (tests/kube/node.py: kubelet, containerd, the
CNI bridge, kube-proxy, CoreDNS, NetworkPolicies enforced by kube-network-policies), run by the
chart's operator from the images `make images` built: spec.parallelism.nnodes 2 with pipeline
parallel 2 (a stage per pod) and nnodes 3 with tensor parallel 3 (SmolLM2's 9 heads and 3 KV
heads split in 3, not in 2) give the same greedy text as one pod; a worker killed with SIGKILL
has its whole group recreated by the operator, which then serves the same text again.

Each engine pod asks for 900 m CPU (600 m for three), so its limit is one CPU and the engine
runs one thread: the node's 2 CPUs less its 100 m reserved and the operator's 2 x 50 m leave
1.8 CPUs, which two requests of a whole CPU would not fit."""
from __future__ import annotations

import contextlib
import json
import pathlib
import subprocess
from collections.abc import Iterator

import httpx
import pytest
from kube.cluster import Cluster
from kube.multinode import kill_container, manifest, pod_uids, ready, recreated
from kube.pods import POD_START_TIMEOUT_S
from kube.release import Release
from kube.tools import Kubectl, free_port, tool, wait_for

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 12


@contextlib.contextmanager
def forwarded(kubectl: Kubectl, pod: str, log: pathlib.Path) -> Iterator[str]:
    """`kubectl port-forward pod/POD` to its port 8000 (through the kubelet, so not subject to
    the engine's NetworkPolicy); yields the local base URL once /health answers 200."""
    port = free_port()
    process = subprocess.Popen([tool("kubectl"), "port-forward", f"pod/{pod}", f"{port}:8000"], env=kubectl.env,
                               stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert process.poll() is None, log.read_text()
        try:
            return httpx.get(f"{url}/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False
    try:
        wait_for(healthy, 120, what=f"port-forward to pod/{pod}")
        yield url
    finally:
        process.terminate()
        process.wait(30)


def greedy(kubectl: Kubectl, pod: str, log: pathlib.Path) -> list[str]:
    """The texts of PROMPTS, greedy, MAX_TOKENS each, from the engine behind pod POD."""
    with forwarded(kubectl, pod, log) as url:
        texts = []
        for prompt in PROMPTS:
            r = httpx.post(f"{url}/v1/completions", timeout=300, json={
                "model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        return texts


def serve(kubectl: Kubectl, name: str, nnodes: int, cpu: str, **engine: int) -> dict:
    kubectl.apply(manifest(name, nnodes, cpu, **engine))
    return wait_for(lambda: ready(kubectl, name), POD_START_TIMEOUT_S, what=f"{name} Ready")


def test_one_model_over_pods_serves_as_one_pod_and_a_killed_worker_restarts_its_group(node, images, tmp_path,
                                                                                       capsys):
    with Cluster(node, "multinode", tmp_path) as cluster:
        kubectl = Kubectl(cluster.kubeconfig)
        release = Release(cluster, "mn").install()
        try:
            serve(kubectl, "solo", 1, "900m")
            solo_pod = next(iter(pod_uids(kubectl, "solo")))
            reference = greedy(kubectl, solo_pod, tmp_path / "solo.log")
            kubectl("delete", "isvc", "solo", "--wait=true", timeout=120)

            obj = serve(kubectl, "pp", 2, "900m", pipelineParallelSize=2)
            assert obj["status"]["groupSize"] == 2 and set(pod_uids(kubectl, "pp")) == {"pp-0", "pp-0-1"}
            pipeline = greedy(kubectl, "pp-0", tmp_path / "pp.log")
            policy = kubectl.json("get", "networkpolicy", "pp")["spec"]["ingress"]

            before = pod_uids(kubectl, "pp")
            assert kill_container(kubectl, "pp-0-1") >= 1
            wait_for(lambda: recreated(kubectl, "pp", before), POD_START_TIMEOUT_S,
                     what="the pp group recreated (both pods new) and Ready")
            events = kubectl.json("get", "events", "--field-selector", "involvedObject.name=pp")["items"]
            restarted = [e["message"] for e in events if e["reason"] == "RecreatingGroup"]
            after_kill = greedy(kubectl, "pp-0", tmp_path / "pp-again.log")
            kubectl("delete", "isvc", "pp", "--wait=true", timeout=120)

            serve(kubectl, "tp", 3, "600m", tensorParallelSize=3)
            assert set(pod_uids(kubectl, "tp")) == {"tp-0", "tp-0-1", "tp-0-2"}
            tensor = greedy(kubectl, "tp-0", tmp_path / "tp.log")
            kubectl("delete", "isvc", "tp", "--wait=true", timeout=120)
        finally:
            release.uninstall()
    assert all(len(text) > 0 for text in reference), reference
    assert pipeline == reference and tensor == reference and after_kill == reference, \
        (reference, pipeline, tensor, after_kill)
    assert restarted and "pod pp-0" in restarted[0], restarted  # the worker, or node 0 that lost it
    assert {"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvpilot-engine",
                                                      "app.kubernetes.io/instance": "pp"}}}]} in policy
    with capsys.disabled():
        print(f"\n[multinode] greedy texts (one pod = pp2 over 2 pods = tp3 over 3 pods = pp2 after a "
              f"killed worker): {json.dumps(reference)}; group restart: {restarted[0]}")
