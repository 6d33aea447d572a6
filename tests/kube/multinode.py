"""Multi-pod InferenceServices (spec.parallelism.nnodes > 1) on the real node, for the test
(tests/images/test_multinode.py) and the benchmark (tests/images/bench_multinode.py): the
manifest, readiness as the operator reports it, the pods of an InferenceService, and a SIGKILL
of a pod's engine container from this machine (the node's containers are its processes)."""
from __future__ import annotations

import contextlib
import os
import pathlib
import signal
from typing import Any

import yaml

from .tools import ROOT, Kubectl

EXAMPLE = ROOT / "examples" / "inferenceservice-smollm2.yaml"


def manifest(name: str, nnodes: int, cpu: str, **engine: int) -> str:
    """The example InferenceService as NAME over nnodes pods of `cpu` and 3 GiB each, with these
    spec.engine fields."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["engine"].update(engine)
    doc["spec"]["parallelism"] = {"nnodes": nnodes}
    doc["spec"]["resources"].update({"cpu": cpu, "memory": "3Gi"})
    return yaml.safe_dump(doc)


def ready(kubectl: Kubectl, name: str) -> dict[str, Any] | None:
    """The InferenceService when its status is of its generation and Ready is True, else None."""
    obj = kubectl.json("get", "isvc", name)
    status = obj.get("status", {})
    fresh = status.get("observedGeneration") == obj["metadata"]["generation"]
    return obj if fresh and any(c["type"] == "Ready" and c["status"] == "True"
                                for c in status.get("conditions", [])) else None


def pod_uids(kubectl: Kubectl, name: str) -> dict[str, str]:
    """Pod name -> uid of the InferenceService's pods that are not being deleted."""
    items = kubectl.json("get", "pods", "-l", f"kvpilot.dev/inferenceservice={name}")["items"]
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in items if not p["metadata"].get("deletionTimestamp")}


def recreated(kubectl: Kubectl, name: str, before: dict[str, str]) -> bool:
    """Whether every pod of `before` exists again under a new uid and the InferenceService is Ready."""
    now = pod_uids(kubectl, name)
    return now.keys() == before.keys() and not set(now.values()) & set(before.values()) \
        and ready(kubectl, name) is not None


def kill_container(kubectl: Kubectl, pod: str) -> int:
    """SIGKILL every process of the pod's first container, found by its containerd ID in
    /proc/PID/cgroup. Returns how many were killed (0: none found)."""
    status = kubectl.json("get", "pod", pod)["status"]["containerStatuses"][0]
    container_id = status["containerID"].split("://", 1)[1]
    killed = 0
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if container_id in (entry / "cgroup").read_text():
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
    return killed
