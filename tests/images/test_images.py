"""The images `make images` builds, run as pods on a real node (tests/kube/node.py: the kubelet,
containerd, runc, a CNI bridge, kube-proxy): the CPU engine with the Deployment, ConfigMap,
Secret and Service the operator renders for examples/inferenceservice-smollm2.yaml asking for a
whole CPU (uid 1000, read-only root, no capabilities, only the pod's volumes, its CPU and memory
limits; Guaranteed, so the kubelet's static CPU manager gives the engine a CPU of its own), the
in-cluster tuner's load built against it in a pod from the operator image, and the operator
with the chart's Deployment, installed by `helm install`."""
from __future__ import annotations

import json
import os
import pathlib
import re
import runpy
import time
from decimal import Decimal

import httpx
import pytest
import yaml
from kube.cluster import Cluster
from kube.node import RESERVED_CPUS, describe
from kube.pods import (POD_START_TIMEOUT_S, RESTRICTED_CONTAINER, RESTRICTED_POD, process_one,
                       run_to_completion, wait_rolled_out)
from kube.release import Release
from kube.tools import ROOT, Kubectl, wait_for
from openai import OpenAI
from kube.podman import VERSION, podman
from kubernetes.utils.quantity import parse_quantity

from kvpilot.operator.render.builders import build_admin_secret, build_configmap, build_deployment, build_service
from kvpilot.api.spec import InferenceServiceSpec
from kvpilot.kernels.cpu.loader import selected_variant
from kvpilot.tuner.search.settings import EngineSettings

pytestmark = pytest.mark.slow
EXAMPLE = ROOT / "examples" / "inferenceservice-smollm2.yaml"


def test_engine_image_serves_a_chat_completion_as_the_operators_pod_would(node, images, tmp_path, capsys):
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["spec"]["resources"]["cpu"] = "1"  # a whole CPU: Guaranteed, a CPU of its own (the example's 500m shares)
    name, spec = manifest["metadata"]["name"], InferenceServiceSpec.from_dict(manifest["spec"])
    with Cluster(node, "engine-image", tmp_path) as cluster:
        kubectl, namespace = Kubectl(cluster.kubeconfig), cluster.namespace
        deployment = build_deployment(name, namespace, spec)
        pod = deployment["spec"]["template"]["spec"]
        assert pod["containers"][0]["image"] == images["engine-cpu"], "the operator's default engine image is what make images tags"
        objects = [build_admin_secret(name, namespace, spec), build_configmap(name, namespace, spec), deployment,
                   build_service(name, namespace, spec)]
        kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
        wait_rolled_out(kubectl, name, POD_START_TIMEOUT_S)
        base_url = f"http://{kubectl.json('get', 'service', name)['spec']['clusterIP']}:{spec.engine.port}"
        client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model=spec.model.display_name, max_tokens=16,
                                               messages=[{"role": "user", "content": "Say hello."}])
        answer = reply.choices[0].message.content
        start = time.monotonic()  # a decode figure: one request of up to 64 new tokens, alone
        timed = client.completions.create(model=spec.model.display_name, prompt="Once upon a time", max_tokens=64,
                                          temperature=0)
        decode_tok_s = timed.usage.completion_tokens / (time.monotonic() - start)
        load = operator_image_builds_the_tuners_load(kubectl, images["operator"], base_url, spec.model.display_name,
                                                     EngineSettings.from_engine_spec(manifest["spec"]["engine"]))
        counted = [client.completions.create(model=spec.model.display_name, prompt=prompt, max_tokens=1)
                   .usage.prompt_tokens for prompt, _, _ in load["requests"]]
        target = f"deployment/{name}"
        uid, root_options = process_one(kubectl, target)
        write = kubectl("exec", target, "--", "touch", "/opt/kvpilot/probe", check=False)
        converted = kubectl("exec", target, "--", "ls", "/home/kvpilot/.cache/kvpilot/models", check=False)
        log = kubectl("logs", target).stdout
        pod_object = kubectl.json("get", "pods", "-l", f"app.kubernetes.io/instance={name}")["items"][0]
        limits, qos = pod_object["spec"]["containers"][0]["resources"]["limits"], pod_object["status"]["qosClass"]
        # a process entering the container's cgroup takes its cpuset as its affinity (cgroup v1 cpuset_attach)
        cpuset = json.loads(kubectl("exec", target, "--", "python3", "-c",
                                    "import os; print(sorted(os.sched_getaffinity(0)))").stdout)
    assert answer and answer.strip()
    assert uid.split()[1:] == ["1000"] * 4, uid
    assert "ro" in root_options.split(","), root_options
    assert write.returncode != 0 and "Read-only file system" in write.stderr
    assert converted.returncode != 0, "the pod converted the builtin model instead of using the baked one"
    assert "converting" not in log
    # the C kernels built at install time run inside the image (no compiler there), in the variant
    # this CPU runs best (the node's CPU is the container's), with as many threads as the pod's CPU limit
    variant = selected_variant()
    path_line = next((line for line in log.splitlines() if "decode steps run" in line), "")
    assert f"runs the {variant} kernel build" in path_line, log[-4000:]
    assert "the torch path" not in path_line and "C " in path_line, path_line
    # the builtin GGUF serves with its blocks by default (vLLM's rule for a GGUF file)
    assert "--quantization gguf:" in log and "read the GGUF blocks" in path_line, log[-4000:]
    # Guaranteed with one whole CPU: the static CPU manager gave the container one CPU outside the
    # reserved ones, and the engine runs one thread bound to it; every other container (the tuner's
    # load pod, beside it) shares the rest; the reservation took 100m off allocatable, not a CPU
    assert qos == "Guaranteed" and parse_quantity(limits["cpu"]) == 1, (qos, limits)
    assert len(cpuset) == 1 and not RESERVED_CPUS & set(cpuset), cpuset
    assert set(load["cpus"]) == online_cpus() - set(cpuset), (load["cpus"], cpuset)
    threads_lines = [line for line in log.splitlines() if "CPU threads:" in line]
    assert len(threads_lines) == 1, log[-4000:]
    threads_line = threads_lines[0]
    assert f"CPU threads: 1 per rank, bound to CPUs {cpuset} (" in threads_line, threads_line
    node_status = json.loads(node.get("/api/v1/nodes"))["items"][0]["status"]
    allocatable, capacity = (parse_quantity(node_status[k]["cpu"]) for k in ("allocatable", "capacity"))
    assert allocatable == capacity - Decimal("0.1"), node_status["allocatable"]
    assert timed.usage.completion_tokens >= 1
    assert load["missing"] == ["torch", "transformers"]  # the load came without a local tokenizer or model
    assert len(load["requests"]) == 3 and all(prompt.strip() for prompt, _, _ in load["requests"])
    assert [n for _, n, _ in load["requests"]] == counted  # ShareGPT prompts with the engine's own token counts
    assert all(4 <= n <= 200 and 1 <= out <= 16 for _, n, out in load["requests"])
    with capsys.disabled():
        print(f"\n[engine image {images['engine-cpu']}] a pod of the operator's Deployment on {describe_node(node)}, "
              f"limits {limits}, QoS {qos}, cpuset {cpuset} (the load pod's {load['cpus']}), behind Service {base_url}"
              f"\n[engine image] process {uid.replace(chr(9), ' ')}; root filesystem mounted {root_options}"
              f"\n[engine image] chat completion from {spec.model.display_name}: {answer!r}"
              f"\n[engine image] {path_line.strip()}"
              f"\n[engine image] {threads_line.strip()}"
              f"\n[engine image] one request: {timed.usage.completion_tokens} tokens at {decode_tok_s:.1f} tok/s "
              f"(prefill included; load average {os.getloadavg()[0]:.2f})"
              f"\n[operator image] the tuner's ShareGPT load through the engine's /tokenize in {load['seconds']} s: "
              f"prompt tokens {counted}")


def online_cpus() -> set[int]:
    """The machine's online CPUs (/sys/devices/system/cpu/online, e.g. "0-1" or "0,2-3"): the node's."""
    cpus: set[int] = set()
    for part in pathlib.Path("/sys/devices/system/cpu/online").read_text().strip().split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def describe_node(control_plane) -> str:
    return describe(json.loads(control_plane.get("/api/v1/nodes"))["items"][0])


def operator_image_builds_the_tuners_load(kubectl: Kubectl, image: str, base_url: str, model: str,
                                          settings: EngineSettings) -> dict:
    """What the in-cluster tuner does before its first window (kvpilot.tuner.cluster.session),
    in a pod from the operator image against the engine's Service: ShareGPT requests tokenized
    by the engine's /tokenize. Returns {"missing": modules absent from the image, "requests":
    [[prompt, prompt_len, output_len], ...], "seconds": how long the load took, "cpus": the CPUs
    the pod may run on}."""
    script = (
        "import importlib.util as u, json, os, time\n"
        "from kvpilot.tuner.cluster.remote_tokenizer import RemoteTokenizer\n"
        "from kvpilot.tuner.measure.workload import Workload, load_requests\n"
        "t0 = time.monotonic()\n"
        f"tok = RemoteTokenizer({base_url!r}, {model!r})\n"
        "w = Workload(num_requests=3, warmup_requests=0, max_prompt_len=200, max_output_len=16)\n"
        f"load = load_requests(tok, w, {settings.max_model_len})\n"
        "print(json.dumps({'missing': [m for m in ('torch', 'transformers') if u.find_spec(m) is None],\n"
        "                  'requests': [[r.prompt, r.prompt_len, r.expected_output_len] for r in load.requests],\n"
        "                  'seconds': round(time.monotonic() - t0, 1), 'cpus': sorted(os.sched_getaffinity(0))}))\n")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "tuner-load"},
           "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False, "enableServiceLinks": False,
                    "securityContext": RESTRICTED_POD,
                    "containers": [{"name": "load", "image": image, "imagePullPolicy": "IfNotPresent",
                                    "command": ["python3", "-c", script], "securityContext": RESTRICTED_CONTAINER}]}}
    return json.loads(run_to_completion(kubectl, pod, 300).strip().splitlines()[-1])


def test_operator_image_runs_the_charts_operator_and_answers_its_liveness_probe(node, images, tmp_path, capsys):
    with Cluster(node, "operator-image", tmp_path) as cluster:
        kubectl = Kubectl(cluster.kubeconfig)
        release = Release(cluster, "kv").install()  # the CRD, RBAC, the operator's Deployment, watching this namespace
        try:
            name = release.service_account  # the chart's full name, also its Deployment's
            deployment = wait_rolled_out(kubectl, name, POD_START_TIMEOUT_S)
            container = deployment["spec"]["template"]["spec"]["containers"][0]
            assert container["image"] == images["operator"], "the chart's operator image is what make images tags"
            pod = kubectl.json("get", "pods", "-l", "app.kubernetes.io/instance=kv")["items"][0]
            probe = container["livenessProbe"]["httpGet"]
            port = next(p["containerPort"] for p in container["ports"] if p["name"] == probe["port"])
            url = f"http://{pod['status']['podIP']}:{port}{probe['path']}"  # what the kubelet probes

            def answered() -> httpx.Response | None:
                try:
                    return response if (response := httpx.get(url, timeout=5)).status_code == 200 else None
                except httpx.TransportError:
                    return None  # Kopf serves it once its startup is done
            healthz = wait_for(answered, 120, what=f"the operator pod's {probe['path']}")
            kubectl.apply(EXAMPLE)
            engine_image = next(e["value"] for e in container["env"] if e["name"] == "KVPILOT_ENGINE_IMAGE")
            created = wait_for(lambda: kubectl.json("get", "deployment", "smollm2")["spec"]["template"]["spec"]
                               ["containers"][0]["image"], timeout=120, what="the engine Deployment")
            uid, root_options = process_one(kubectl, f"deployment/{name}")
            restarts = kubectl.json("get", "pod", pod["metadata"]["name"])["status"]["containerStatuses"][0]["restartCount"]
            kubectl("delete", "isvc", "smollm2", "--wait=true")
        finally:
            release.uninstall()
    assert healthz.status_code == 200 and restarts == 0  # the kubelet's liveness probe never failed
    assert created == engine_image
    assert uid.split()[1:] == ["1000"] * 4, uid
    assert "ro" in root_options.split(",")
    with capsys.disabled():
        print(f"\n[operator image {images['operator']}] {' '.join(container['command'] + container['args'])}: "
              f"a pod on {describe_node(node)}, {probe['path']} answered {healthz.status_code}, created Deployment "
              f"smollm2 ({created}); process {uid.replace(chr(9), ' ')}, root filesystem {root_options}")


@pytest.mark.parametrize("target", ["engine-cpu", "engine-vllm-cpu", "operator"])
def test_images_carry_no_compiler_and_the_operator_no_torch(images, target):
    probe = podman("run", "--rm", "--entrypoint", "python3", images[target], "-c",
                   "import importlib.util as u, shutil; print([t for t in ('cc', 'gcc', 'g++', 'make', 'pip') "
                   "if shutil.which(t)], u.find_spec('torch') is not None)")
    tools, has_torch = probe.stdout.strip().rsplit(" ", 1)
    # vLLM compiles its model with torch.compile (inductor), which builds C++ at run time
    assert tools == ("['cc', 'gcc', 'g++']" if target == "engine-vllm-cpu" else "[]")
    assert has_torch == ("False" if target == "operator" else "True")
    if target == "engine-vllm-cpu":  # one torch, engine-cpu's; `vllm` finds its distribution as the CPU build
        pin = runpy.run_path(str(ROOT / "api" / "vllm.py"))
        found = podman("run", "--rm", "--entrypoint", "python3", images[target], "-c",
                       "import importlib.metadata as m, shutil, torch; print(torch.__file__, shutil.which('vllm'), "
                       "m.version('vllm'), m.version('vllm-cpu'))")
        torch_file, vllm, version, cpu_version = found.stdout.split()
        assert torch_file.startswith("/opt/kvpilot/venv/"), torch_file
        assert (vllm, version, cpu_version) == ("/opt/vllm/venv/bin/vllm", f"{pin['VLLM_VERSION']}+cpu",
                                                pin["VLLM_VERSION"])
    if target == "engine-cpu":  # the CPU kernels, built in the build stage for every x86 level
        built = podman("run", "--rm", "--entrypoint", "python3", images[target], "-c",
                       "from kvpilot.kernels.cpu import build, loader; m = loader.manifest(); "
                       "print(sorted(m['variants']) == sorted(v.name for v in build.variants()) "
                       "and all(build.library_path(loader.LIB_DIR, v, n).exists() for v in m['variants'] "
                       "for n in build.LIBRARIES))")
        assert built.stdout.strip() == "True", built.stdout + built.stderr


def test_image_tags_follow_the_project_version(images):
    chart = yaml.safe_load((ROOT / "charts" / "kvpilot" / "Chart.yaml").read_text())
    assert chart["appVersion"] == VERSION
    assert all(tag.endswith(f":{VERSION}") for tag in images.values())


def test_make_images_leaves_no_untagged_image_or_build_container_behind(images):
    """Each build would otherwise add GBs of orphaned layers (the engine's venv) to the store until
    the disk fills: images/build.sh tags its cache stages and prunes the rest."""
    dangling = podman("images", "--filter", "dangling=true", "--format", "{{.ID}}").stdout.split()
    assert dangling == []
    statuses = podman("ps", "-a", "--external", "--format", "{{.Status}}").stdout.split("\n")
    assert "Storage" not in [s.strip() for s in statuses]
    cache = podman("images", "--format", "{{.Repository}}", "--filter", "reference=localhost/kvpilot-cache/*").stdout.split()
    stages = set(re.findall(r"^FROM \S+ AS (\S+)$", (ROOT / "images" / "Containerfile").read_text(), re.M))
    expected = {f"{t}-{s}" for t in images for s in ("deps", "build")} & stages  # engine-vllm-cpu: a build stage only
    assert {stage.rsplit('-', 1)[0] for stage in expected} == set(images), expected  # each target has one at least
    assert {f"localhost/kvpilot-cache/{stage}" for stage in expected} <= set(cache)
