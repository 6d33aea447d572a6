"""Drift repair from the children's own watches: a child the operator made (Deployment,
ConfigMap, Service, NetworkPolicy) that someone edits or deletes brings its InferenceService
back through the reconciler at once, as controller-runtime's Owns() watches do, instead of
waiting for the resync loop to read every child of every resource (at 1,000 InferenceServices
that loop's GETs were half of the operator's requests: issue 42). The event carries the child
as it now is, so a change that still covers what the operator wants (a status update, a
default the API server filled in) costs no request.

The resync loop stays as the net for what no watch shows here: the admin-token Secret (a
watch would need list/watch on every Secret of the namespace, which RBAC cannot narrow to
ours) and the PodMonitor.

Source: controller-runtime's builder (For/Owns: owned objects enqueue their owner);
Kubernetes API conventions (level-based reconciliation)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpilot.api.kube import isvc_path

from kvpilot.operator.render.builders import ISVC_LABEL
from kvpilot.operator.context import Context
from kvpilot.operator.drift import covers
from kvpilot.operator.reconcile import desired_children
from kvpilot.operator.validation import SPEC_ERRORS, runnable_spec


def owner_if_settled(ctx: Context, child: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The InferenceService that owns `child` (its label and ownerReference), as its watch last
    delivered it, when its current generation has been reconciled; else None (not ours, being
    deleted, or a create or update handler still to run, whose own reconcile will see the child)."""
    meta = child.get("metadata") or {}
    key = (meta.get("namespace"), (meta.get("labels") or {}).get(ISVC_LABEL))
    isvc = ctx.known.get(key) if key[1] else None
    if isvc is None or isvc["metadata"].get("deletionTimestamp"):
        return None
    if not any(ref.get("uid") == isvc["metadata"].get("uid") for ref in meta.get("ownerReferences") or ()):
        return None
    if ctx.reconciled_generation.get(key) != isvc["metadata"].get("generation"):
        return None
    return isvc


def drifted(ctx: Context, isvc: Mapping[str, Any], child: Mapping[str, Any]) -> bool:
    """Whether `child` no longer covers what the reconciler wants for it (operator.drift.covers).
    A spec that cannot run has no children to compare with (its Failed status says why)."""
    try:
        spec = runnable_spec(isvc, ctx.config.policy)
    except SPEC_ERRORS:
        return False
    kind, name = child.get("kind"), child["metadata"]["name"]
    for desired in desired_children(isvc, spec, ctx.config, podmonitor=False):
        if desired["kind"] == kind and desired["metadata"]["name"] == name:
            return not covers(child, desired)
    return False  # not a child this spec wants (a group's StatefulSet, say): the reconciler removes those


async def owner_to_repair(ctx: Context, event_type: str | None, child: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The InferenceService to reconcile because `child` was edited away from its desired state
    or deleted, else None. An ADDED event (the operator's own create, or a watch's relisting)
    and a child that still covers the spec ask for nothing. A deleted child whose owner is
    gone or going too (the garbage collector at work; the owner's own watch event may come
    later) is left alone: one GET of the owner, for deletions only.

    Raises ApiError when that GET fails."""
    if event_type not in ("MODIFIED", "DELETED"):
        return None
    isvc = owner_if_settled(ctx, child)
    if isvc is None:
        return None
    if event_type == "MODIFIED":
        return isvc if drifted(ctx, isvc, child) else None
    current = await ctx.kube.get(isvc_path(isvc["metadata"]["namespace"], isvc["metadata"]["name"]))
    return None if current is None or current["metadata"].get("deletionTimestamp") else isvc
