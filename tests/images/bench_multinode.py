"""Benchmark (not a test): one model over several pods on the real node (tests/kube/node.py:
kubelet, containerd, the CNI bridge, kube-proxy, CoreDNS, kube-network-policies), run by the
chart's operator from the images `make images` built (build them first).

Each round: the example InferenceService on one pod (`cpu: 900m`: limit 1 CPU, one engine
thread), from `kubectl apply` to Ready (the engine's /health: model loaded, KV cache sized),
deleted; then the same model with pipeline parallel 2 over a group of two such pods
(spec.parallelism.nnodes 2), from `kubectl apply` to Ready (both nodes joined and loaded their
stage); then the group's worker pod SIGKILLed (every process of its engine container), from the
kill to node 0's pod deleted (the operator saw the restart and recreates the whole group) and to
the group Ready again with both pods new.
Prints a table, writes JSON with the CPU model and the load average.

    .venv/bin/python tests/images/bench_multinode.py [--rounds 3] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from kube.cluster import Cluster  # noqa: E402
from kube.controlplane import ControlPlane  # noqa: E402
from kube.multinode import kill_container, manifest, pod_uids, ready, recreated  # noqa: E402
from kube.node import Node, bridge, machine_lock  # noqa: E402
from kube.node import install as install_node  # noqa: E402
from kube.podman import VERSION  # noqa: E402
from kube.release import Release  # noqa: E402
from kube.tools import ROOT, Kubectl, wait_for  # noqa: E402

from kvpilot.loadgen.machine import loadavg, machine_info  # noqa: E402

TIMEOUT_S = 900


def timed_ready(kubectl: Kubectl, name: str, doc: str) -> float:
    start = time.monotonic()
    kubectl.apply(doc)
    wait_for(lambda: ready(kubectl, name), TIMEOUT_S, what=f"{name} Ready")
    return time.monotonic() - start


def one_round(kubectl: Kubectl) -> dict[str, float]:
    one_pod_s = timed_ready(kubectl, "solo", manifest("solo", 1, "900m"))
    kubectl("delete", "isvc", "solo", "--wait=true", timeout=120)
    wait_for(lambda: not pod_uids(kubectl, "solo"), 120, what="solo's pod gone")
    group_s = timed_ready(kubectl, "pp", manifest("pp", 2, "900m", pipelineParallelSize=2))
    before = pod_uids(kubectl, "pp")
    killed_at = time.monotonic()
    if not kill_container(kubectl, "pp-0-1"):
        raise SystemExit("found no process of pp-0-1's container")
    # the operator's part: node 0, whose container did not restart, is deleted with the worker
    wait_for(lambda: pod_uids(kubectl, "pp").get("pp-0") != before["pp-0"], TIMEOUT_S,
             what="node 0 of the pp group deleted")
    deleted_s = time.monotonic() - killed_at
    wait_for(lambda: recreated(kubectl, "pp", before), TIMEOUT_S, what="the pp group recreated and Ready")
    restart_s = time.monotonic() - killed_at
    kubectl("delete", "isvc", "pp", "--wait=true", timeout=120)
    wait_for(lambda: not pod_uids(kubectl, "pp"), 120, what="pp's pods gone")
    return {"one_pod_ready_s": round(one_pod_s, 1), "group_ready_s": round(group_s, 1),
            "group_deleted_s": round(deleted_s, 1), "group_restart_s": round(restart_s, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=pathlib.Path,
                        default=ROOT / "benchmarks" / "results" / "groups" / "groups.json")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("the real node needs root")
    install_node()
    names = {f"localhost/kvpilot/{t}:{VERSION}": (f"docker.io/kvpilot/{t}:{VERSION}",) for t in ("engine-cpu", "operator")}
    rounds, load = [], [loadavg()]
    with tempfile.TemporaryDirectory() as tmp, machine_lock(), bridge() as address:
        workdir = pathlib.Path(tmp)
        with ControlPlane(workdir / "controlplane", kwok=False, address=address) as plane, \
                Node(plane, workdir / "node", names), Cluster(plane, "bench-multinode", workdir) as cluster:
            kubectl = Kubectl(cluster.kubeconfig)
            release = Release(cluster, "mn").install()
            try:
                for i in range(args.rounds):
                    rounds.append(one_round(kubectl))
                    load.append(loadavg())
                    print(f"round {i + 1}: {rounds[-1]}", flush=True)
            finally:
                release.uninstall()
    medians = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    result = {"command": " ".join([".venv/bin/python", "tests/images/bench_multinode.py", *sys.argv[1:]]),
              "commit": commit, "machine": machine_info(loadavg_before=load[0]), "loadavg_after_rounds": load[1:],
              "model": "smollm2-135m-instruct (builtin)", "pod": "cpu 900m (limit 1, one engine thread), memory 3Gi",
              "rounds": rounds, "median": medians}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{result['machine']['cpu']}, {result['machine']['cores']} CPUs, load average {load[0]} -> {load[-1]}, commit {commit}")
    print(f"{'':48}{'median':>8}  rounds")
    for key, label in (("one_pod_ready_s", "1 pod: apply -> Ready (s)"),
                       ("group_ready_s", "2-pod group (PP 2): apply -> Ready (s)"),
                       ("group_deleted_s", "worker SIGKILL -> node 0 deleted (s)"),
                       ("group_restart_s", "worker SIGKILL -> group Ready again (s)")):
        print(f"{label:48}{medians[key]:>8.1f}  {', '.join(str(r[key]) for r in rounds)}")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
