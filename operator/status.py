"""Computes an InferenceService's status from its Deployment (pure; no cluster access).

Conditions follow the Kubernetes convention: one entry per type with status "True"/"False",
a CamelCase reason and a message; lastTransitionTime changes only when status changes.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpilot.operator.render.builders import HASH_ANNOTATION
from kvpilot.operator.groups import OLD_CONFIGURATION, GroupPlan

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "Failed")


def _cond(type_: str, status: bool, reason: str, message: str, generation: int) -> dict[str, Any]:
    return {"type": type_, "status": "True" if status else "False", "reason": reason,
            "message": message, "observedGeneration": generation}


def merge_conditions(old: list[Mapping[str, Any]] | None, new: list[dict[str, Any]],
                     now: str) -> list[dict[str, Any]]:
    """new conditions with lastTransitionTime kept from old where status did not change;
    condition types not in new (e.g. the tuner's Tuning) are kept as they were."""
    previous = {c.get("type"): c for c in old or ()}
    merged = []
    for cond in new:
        before = previous.get(cond["type"])
        same = before is not None and before.get("status") == cond["status"]
        stamp = before.get("lastTransitionTime") if same and before else None
        merged.append({**cond, "lastTransitionTime": stamp or now})
    ours = {c["type"] for c in new}
    merged += [dict(c) for t, c in previous.items() if t not in ours]
    return merged


def failed_conditions(reason: str, message: str, generation: int) -> list[dict[str, Any]]:
    """The conditions of a spec that cannot run."""
    return [
        _cond("Ready", False, reason, "the spec cannot run; see Failed", generation),
        _cond("Progressing", False, reason, "no rollout until the spec is fixed", generation),
        _cond("Degraded", False, reason, "no children exist", generation),
        _cond("Failed", True, reason, message, generation),
    ]


def deployment_conditions(deployment: Mapping[str, Any] | None, desired_replicas: int,
                          desired_hash: str, generation: int) -> tuple[list[dict[str, Any]], int, int]:
    """(conditions, replicas, readyReplicas) for the Deployment as it is now."""
    if deployment is None:
        return [
            _cond("Ready", False, "DeploymentMissing", "the engine Deployment does not exist yet", generation),
            _cond("Progressing", True, "Creating", "creating the engine Deployment", generation),
            _cond("Degraded", False, "AsExpected", "nothing has failed", generation),
            _cond("Failed", False, "Valid", "the spec is valid", generation),
        ], 0, 0
    status = deployment.get("status") or {}
    meta = deployment.get("metadata") or {}
    template_meta = (deployment.get("spec") or {}).get("template", {}).get("metadata") or {}
    replicas = int(status.get("replicas") or 0)
    ready = int(status.get("readyReplicas") or 0)
    updated = int(status.get("updatedReplicas") or 0)
    observed = int(status.get("observedGeneration") or 0) >= int(meta.get("generation") or 0)
    hash_ok = (template_meta.get("annotations") or {}).get(HASH_ANNOTATION) == desired_hash
    rolled_out = (observed and hash_ok and updated >= desired_replicas
                  and replicas == desired_replicas and ready >= desired_replicas)
    deadline = any(c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"
                   for c in status.get("conditions") or ())
    summary = f"{ready}/{desired_replicas} replicas ready"

    if desired_replicas == 0:
        ready_cond = _cond("Ready", False, "ScaledToZero", "spec.replicas is 0", generation)
    elif rolled_out:
        ready_cond = _cond("Ready", True, "AllReplicasReady", summary, generation)
    else:  # ready counts old pods too: say how far the new configuration has come
        ready_cond = _cond("Ready", False, "ReplicasNotReady",
                           f"{summary}; {updated}/{desired_replicas} pods of the current configuration, "
                           f"{replicas} pods in all (while it stays so, `kubectl describe pod` says why a "
                           f"new one is not Ready)", generation)
    # updatedReplicas counts pods created from the current template, running or not
    rollout = f"{updated}/{desired_replicas} pods have configuration {desired_hash}"
    if rolled_out or deadline:
        progressing = _cond("Progressing", False, "ProgressDeadlineExceeded" if deadline else "RolloutComplete",
                            rollout, generation)
    else:
        progressing = _cond("Progressing", True, "RollingOut", rollout, generation)
    if deadline:
        degraded = _cond("Degraded", True, "ProgressDeadlineExceeded",
                         f"the rollout made no progress in time; {summary}", generation)
    elif hash_ok and observed and updated >= desired_replicas and ready < desired_replicas:
        degraded = _cond("Degraded", True, "ReplicasUnavailable", summary, generation)
    else:
        degraded = _cond("Degraded", False, "AsExpected", "nothing has failed", generation)
    failed = _cond("Failed", False, "Valid", "the spec is valid", generation)
    return [ready_cond, progressing, degraded, failed], replicas, ready


def group_conditions(plan: GroupPlan, nnodes: int, desired_hash: str,
                     generation: int) -> tuple[list[dict[str, Any]], int, int]:
    """(conditions, replicas, readyReplicas) of a multi-pod InferenceService, where one replica
    is one group of nnodes pods (operator/groups.py's plan: groups ready on the current
    configuration, groups being replaced and why)."""
    summary = f"{plan.ready}/{plan.groups} groups of {nnodes} pods ready"
    if plan.groups == 0:
        ready_cond = _cond("Ready", False, "ScaledToZero", "spec.replicas is 0", generation)
    elif plan.ready == plan.groups:
        ready_cond = _cond("Ready", True, "AllGroupsReady", summary, generation)
    else:
        ready_cond = _cond("Ready", False, "GroupsNotReady",
                           f"{summary} (node 0 of a group is Ready once every node joined it)", generation)
    done = plan.ready == plan.groups
    progressing = _cond("Progressing", not done, "RolloutComplete" if done else "RollingOut",
                        f"{plan.ready}/{plan.groups} groups run configuration {desired_hash}", generation)
    broken = {g: why for g, why in plan.restart.items() if not why.endswith(OLD_CONFIGURATION)}
    if broken:
        degraded = _cond("Degraded", True, "GroupRestarting", "; ".join(
            f"group {g}: {why}, so all its pods are recreated" for g, why in sorted(broken.items())), generation)
    else:
        degraded = _cond("Degraded", False, "AsExpected", "nothing has failed", generation)
    failed = _cond("Failed", False, "Valid", "the spec is valid", generation)
    return [ready_cond, progressing, degraded, failed], plan.existing, plan.ready
