"""Operator replicas under leader election, as the takeover test and the kill benchmark drive
them: who holds the Lease, whether a process has reconciled yet (its
kvpilot_operator_reconciles_total), the time from killing the leader to the new leader's
first reconcile, and the children of an InferenceService counted by its label."""
from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from .cluster import Cluster
from .tools import Operator

CHILDREN = (("apps", "v1", "deployments"), ("", "v1", "services"), ("", "v1", "configmaps"),
            ("", "v1", "secrets"), ("networking.k8s.io", "v1", "networkpolicies"))
OWNER_LABEL = "kvpilot.dev/inferenceservice"  # every child carries it


def lease(cluster: Cluster, name: str) -> dict[str, Any]:
    import json

    return json.loads(cluster.control_plane.api(
        "GET", f"/apis/coordination.k8s.io/v1/namespaces/{cluster.namespace}/leases/{name}"))


def lease_name(operator: Operator) -> str:
    return next(a.split("=", 1)[1] for a in operator.args if a.startswith("--leader-election-lease="))


def reconciles(operator: Operator) -> float:
    """How many reconciles the process has finished (0 when its metrics do not answer)."""
    for family in text_string_to_metric_families(operator.metrics()):
        if family.name == "kvpilot_operator_reconciles":
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    return 0.0


def is_leader(operator: Operator) -> bool:
    return operator.probe("/readyz/leader")[0] == 200


def kill(operator: Operator) -> float:
    """SIGKILL, as the OOM killer or a lost node would; returns when (monotonic) it was sent."""
    assert operator.proc is not None
    at = time.monotonic()
    operator.proc.send_signal(signal.SIGKILL)
    operator.proc.wait()
    operator.proc = None
    return at


def first_reconcile(candidates: Sequence[Operator], since: float, timeout: float = 60) -> tuple[Operator, float]:
    """The candidate that reconciles first after `since` (each starts at 0 reconciles: a standby
    runs no handler), and the seconds from `since`. Polled every 0.1 s."""
    deadline = since + timeout
    while time.monotonic() < deadline:
        for candidate in candidates:
            if reconciles(candidate) > 0:
                return candidate, time.monotonic() - since
        time.sleep(0.1)
    raise AssertionError(f"no standby reconciled within {timeout} s")


def children(cluster: Cluster, isvc: str) -> dict[str, int]:
    """How many of each kind of child carry the resource's label."""
    return {plural: len(cluster.objects(group, version, plural, labels={OWNER_LABEL: isvc}))
            for group, version, plural in CHILDREN}


def converged(obj: dict[str, Any], seed: int) -> bool:
    """Ready at its latest generation, with spec.engine.seed `seed` applied."""
    status = obj.get("status") or {}
    args = status.get("appliedEngineArgs") or []
    return (status.get("observedGeneration") == obj["metadata"]["generation"]
            and any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", ()))
            and "--seed" in args and args[args.index("--seed") + 1] == str(seed))
