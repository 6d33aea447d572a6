"""Keeps the groups of a multi-pod InferenceService (spec.parallelism.nnodes > 1) whole, and
says how many are ready.

A group is one engine over nnodes pods (operator/render/group_builders.py): node 0 (the leader pod
NAME-i) and the workers NAME-i-1 .. NAME-i-(nnodes-1). An engine cannot take a node back once
it lost it (torch's process group is fixed at rendezvous), so:

- one member restarted (a container restartCount > 0: the engine exits 5 when it loses a node,
  kvpilot.engine's exit codes) or failed (phase Failed): the operator deletes every pod of the
  group; the StatefulSets create them again and they rendezvous afresh. This is LWS's
  RecreateGroupOnPodRestart. A member deleted by hand needs no rule of its own: node 0 loses it
  within KVPILOT_NODE_TIMEOUT_S and exits, the others lose node 0 and exit, and the restarts
  bring the group here.
- a new configuration (the config-hash annotation of a pod differs from the spec's): the
  StatefulSets use updateStrategy OnDelete, and the operator deletes the pods of one outdated
  group at a time, and only while every other group is ready (a LeaderWorkerSet's rolling
  update with maxUnavailable 1 group, maxSurge 0). An outdated group that is not ready anyway
  is replaced at once.
- ready: every member exists, is not being deleted, runs the current configuration and is Ready
  (node 0's readiness probe is /health, which answers 200 only once every node joined; the
  workers have no probe and are Ready once running).

Sources: LeaderWorkerSet v0.10 (restartPolicy RecreateGroupOnPodRestart, rolloutStrategy
maxUnavailable / maxSurge in groups); Kubernetes StatefulSet updateStrategy OnDelete.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpilot.api.kube import AsyncKubeClient, object_path

from kvpilot.operator.render.builders import HASH_ANNOTATION, ISVC_LABEL, ROLE_LABEL
from kvpilot.operator.render.group_builders import GROUP_LABEL, POD_INDEX_LABEL, headless_service_name, worker_statefulset_name


OLD_CONFIGURATION = "run an old configuration"  # the end of a rollout's restart reason
# A broken group's pods get this termination grace instead of their 30 s: its engine cannot
# serve without the lost node, so there is nothing to drain, and node 0, which may not have
# noticed the loss yet, need not wait out its grace draining into a dead peer. Not 0: the kubelet
# still stops the containers before the StatefulSet creates a pod of the same name (at most one
# pod per identity). A rollout's groups keep their grace (they drain). On the real node it did
# not shorten a SIGKILLed worker's group restart (33.1 s median with 30 s, 33.3 s with 1 s; the
# operator's deletion 2 s after the kill; benchmarks/results/groups/README.md).
BROKEN_GROUP_GRACE_S = 1


@dataclass(frozen=True)
class GroupPlan:
    """What the groups look like now and which to replace. groups: spec.replicas; existing:
    groups with at least one pod; ready: groups whose every member is Ready on the current
    configuration; restart: group index -> why its pods are deleted."""

    groups: int
    existing: int
    ready: int
    restart: dict[int, str] = field(default_factory=dict)


def group_index(pod: Mapping[str, Any]) -> int | None:
    """The group a pod belongs to: a leader's StatefulSet ordinal, a worker's group label."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    text = labels.get(POD_INDEX_LABEL) if labels.get(ROLE_LABEL) == "leader" else labels.get(GROUP_LABEL)
    return int(text) if text is not None and text.isdigit() else None


def broken(pod: Mapping[str, Any]) -> str | None:
    """Why this member breaks its group (a restarted container, a failed pod), or None."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return None  # already going: its group is being replaced
    status = pod.get("status") or {}
    name = pod["metadata"]["name"]
    if status.get("phase") == "Failed":
        return f"pod {name} failed"
    restarts = sum(int(c.get("restartCount") or 0) for c in status.get("containerStatuses") or ())
    return f"pod {name} restarted ({restarts} container restarts)" if restarts else None


def _serving(pod: Mapping[str, Any]) -> bool:
    meta = pod.get("metadata") or {}
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return not meta.get("deletionTimestamp") and any(c.get("type") == "Ready" and c.get("status") == "True"
                                                     for c in conditions)


def _current(pod: Mapping[str, Any], digest: str) -> bool:
    return ((pod.get("metadata") or {}).get("annotations") or {}).get(HASH_ANNOTATION) == digest


def plan_groups(pods: Iterable[Mapping[str, Any]], replicas: int, nnodes: int, digest: str) -> GroupPlan:
    """The plan for groups 0 .. replicas-1 of nnodes pods each, from the InferenceService's pods
    and the configuration hash they should run (group_builders.group_hash)."""
    members: dict[int, list[Mapping[str, Any]]] = {g: [] for g in range(replicas)}
    for pod in pods:
        group = group_index(pod)
        if group in members:
            members[group].append(pod)
    up = {g for g, m in members.items() if len(m) == nnodes and all(map(_serving, m))}
    ready = {g for g in up if all(_current(p, digest) for p in members[g])}
    restart: dict[int, str] = {}
    for group, member in members.items():
        why = next((w for w in map(broken, member) if w), None)
        if why:
            restart[group] = why
    for group, member in members.items():
        outdated = sorted(p["metadata"]["name"] for p in member
                          if not p["metadata"].get("deletionTimestamp") and not _current(p, digest))
        if not outdated or group in restart:
            continue
        # down anyway, or (one group out at a time) no other group is out or being replaced
        if group not in up or (not restart and up >= set(members)):
            restart[group] = f"{', '.join(outdated)} {OLD_CONFIGURATION}"
    return GroupPlan(groups=replicas, existing=sum(1 for m in members.values() if m), ready=len(ready),
                     restart=restart)


def pods_path(namespace: str) -> str:
    """The API path of the Pod collection in `namespace` (/api/v1/namespaces/NS/pods)."""
    return object_path("v1", "pods", namespace)


async def sync_groups(kube: AsyncKubeClient, namespace: str, name: str, replicas: int, nnodes: int,
                      digest: str) -> GroupPlan:
    """Read the InferenceService's pods, delete those of every group the plan replaces, and
    return the plan (its ready count is from before the deletions)."""
    pods = await kube.list_objects(pods_path(namespace), f"{ISVC_LABEL}={name},{ROLE_LABEL}")
    plan = plan_groups(pods, replicas, nnodes, digest)
    for pod in pods:
        group = group_index(pod)
        if group in plan.restart and not pod["metadata"].get("deletionTimestamp"):
            grace = None if plan.restart[group].endswith(OLD_CONFIGURATION) else BROKEN_GROUP_GRACE_S
            await kube.delete(object_path("v1", "pods", namespace, pod["metadata"]["name"]), grace_period_s=grace)
    return plan


async def delete_group_children(kube: AsyncKubeClient, namespace: str, name: str,
                                keep_groups: int | None = None) -> list[str]:
    """Delete the worker StatefulSets of groups keep_groups and above (spec.replicas went down);
    with keep_groups None, every group object: the leader and worker StatefulSets and the
    headless Service (nnodes went back to 1, or the spec cannot run). Their pods go with them
    (background propagation). Returns what was deleted, as plural/name."""
    keep = {name, *(worker_statefulset_name(name, g) for g in range(keep_groups))} if keep_groups is not None else set()
    doomed = [object_path("apps/v1", "statefulsets", namespace, s["metadata"]["name"])
              for s in await kube.list_objects(object_path("apps/v1", "statefulsets", namespace), f"{ISVC_LABEL}={name}")
              if s["metadata"]["name"] not in keep]
    if keep_groups is None:
        doomed.append(object_path("v1", "services", namespace, headless_service_name(name)))
    return ["/".join(path.split("/")[-2:]) for path in doomed if await kube.delete(path)]
