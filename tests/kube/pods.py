"""Reading real pods (tests/kube/node.py) the way a user would with kubectl: wait for a
Deployment's rollout, look inside a running container, run a one-off pod to completion."""
from __future__ import annotations

import json
from typing import Any

from .tools import Kubectl, wait_for

POD_START_TIMEOUT_S = 600  # a pod's first start from a 6 GB image, then the model's load, on a busy 2-core node
# the chart's and the operator's pod security settings, for the tests' one-off pods
RESTRICTED_POD = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "seccompProfile": {"type": "RuntimeDefault"}}
RESTRICTED_CONTAINER = {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]}}


def wait_rolled_out(kubectl: Kubectl, name: str, timeout: float) -> dict[str, Any]:
    """Until Deployment `name` has spec.replicas pods, every one of the current template, Ready
    and none terminating (what `kubectl rollout status` waits for, and no old pod left for a
    port-forward to pick); returns the Deployment."""
    def done() -> dict[str, Any] | None:
        deployment = kubectl.json("get", "deployment", name)
        spec, status = deployment["spec"], deployment.get("status", {})
        if status.get("observedGeneration", 0) < deployment["metadata"]["generation"]:
            return None
        want = spec["replicas"]
        if not (status.get("updatedReplicas") == status.get("readyReplicas") == status.get("replicas") == want):
            return None
        selector = ",".join(f"{k}={v}" for k, v in spec["selector"]["matchLabels"].items())
        pods = kubectl.json("get", "pods", "-l", selector)["items"]
        ready = len(pods) == want and not any(p["metadata"].get("deletionTimestamp") for p in pods)
        return deployment if ready else None
    return wait_for(done, timeout, what=f"deployment {name} rolled out, its pods Ready")


def process_one(kubectl: Kubectl, target: str, namespace: str | None = None) -> tuple[str, str]:
    """(the `Uid:` line of the container's PID 1, the mount options of its root filesystem),
    read inside the running container `target` (e.g. deployment/NAME) with kubectl exec."""
    where = ["-n", namespace] if namespace else []
    status = kubectl("exec", *where, target, "--", "cat", "/proc/1/status").stdout
    mountinfo = kubectl("exec", *where, target, "--", "cat", "/proc/1/mountinfo").stdout
    root = next(line.split() for line in mountinfo.splitlines() if line.split()[4] == "/")
    return next(line for line in status.splitlines() if line.startswith("Uid:")), root[5]


def run_to_completion(kubectl: Kubectl, pod: dict[str, Any], timeout: float) -> str:
    """Creates `pod` (restartPolicy Never), waits until it Succeeded and returns its log;
    fails with the log and the pod's status when it Failed."""
    name = pod["metadata"]["name"]
    kubectl("apply", "-f", "-", stdin=json.dumps(pod))

    def finished() -> str | None:
        phase = kubectl.json("get", "pod", name).get("status", {}).get("phase")
        return phase if phase in ("Succeeded", "Failed") else None
    phase = wait_for(finished, timeout, what=f"pod {name} to finish")
    log = kubectl("logs", name).stdout
    assert phase == "Succeeded", f"pod {name} {phase}:\n{log[-4000:]}\n{kubectl('describe', 'pod', name).stdout[-3000:]}"
    return log
