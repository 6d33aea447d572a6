"""An InferenceService's status, written from what its children show: the Deployment (or a
group's pods) against the spec, one computation and write at a time per resource.
Sources: Kubernetes API conventions (status subresource, observedGeneration, conditions)."""
from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

import kopf

from kvpilot.api.kube import ApiError, AsyncKubeClient, isvc_path, object_path
from kvpilot.api.spec import InferenceServiceSpec, service_url

from kvpilot.operator.render.builders import HASH_ANNOTATION, build_deployment, selector_string
from kvpilot.operator.context import Context
from kvpilot.operator.render.engine_args import engine_command
from kvpilot.operator.events import announce
from kvpilot.operator.render.group_builders import group_hash
from kvpilot.operator.groups import OLD_CONFIGURATION, sync_groups
from kvpilot.operator.status import deployment_conditions, group_conditions, merge_conditions
from kvpilot.operator.validation import SPEC_ERRORS, runnable_spec


def now_iso() -> str:
    """Now in UTC as a condition's lastTransitionTime wants it: RFC 3339 to the second (metav1.Time)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


async def refresh_status(ctx: Context, body: Mapping[str, Any], spec: InferenceServiceSpec | None = None,
                         deployment: Mapping[str, Any] | None = None) -> None:
    """_refresh_status under the resource's status lock (Context.status_locks), coalesced: a
    call that finds another of the same generation or newer already waiting for the lock
    returns at once, since that one computes from the freshest state when it gets the lock
    (the Deployment and the status as their watches last delivered them; same generation,
    same spec). Under load a rollout's several Deployment events then cost one status write,
    not one each. Not for a group (nnodes > 1): its refresh also acts on the pods
    (operator/groups.py), so each call runs."""
    key = (body["metadata"]["namespace"], body["metadata"]["name"])
    generation = int(body["metadata"].get("generation") or 1)
    group = ((body.get("spec") or {}).get("parallelism") or {}).get("nnodes", 1) != 1
    if not group and ctx.status_waiting.get(key, 0) >= generation:
        return
    lock = ctx.status_locks[key]
    if not group:
        ctx.status_waiting[key] = max(generation, ctx.status_waiting.get(key, 0))
    try:
        await lock.acquire()
    finally:
        if not group and ctx.status_waiting.get(key) == generation:
            del ctx.status_waiting[key]
    try:
        await _refresh_status(ctx, body, spec, deployment)
    finally:
        lock.release()


async def _refresh_status(ctx: Context, body: Mapping[str, Any], spec: InferenceServiceSpec | None,
                          deployment: Mapping[str, Any] | None) -> None:
    """Write observedGeneration, replicas, url, applied args and conditions from the Deployment,
    or with parallelism.nnodes > 1 from the groups' pods (recreating a group that lost a member
    and replacing outdated groups one at a time: operator/groups.py)."""
    meta = body["metadata"]
    name, namespace, generation = meta["name"], meta["namespace"], int(meta.get("generation") or 1)
    if spec is None:
        try:
            spec = runnable_spec(body, ctx.config.policy)
        except SPEC_ERRORS:
            return  # the Failed status is the reconciler's to write
    if spec.nnodes > 1:
        desired_hash = group_hash(name, namespace, spec, ctx.config.images)
        plan = await sync_groups(ctx.kube, namespace, name, spec.replicas, spec.nnodes, desired_hash)
        for group, why in sorted(plan.restart.items()):
            await announce(ctx.kube, body, True, "Warning" if not why.endswith(OLD_CONFIGURATION) else "Normal",
                           "RecreatingGroup", f"group {group}: {why}; deleting all its pods")
        conditions, replicas, ready = group_conditions(plan, spec.nnodes, desired_hash, generation)
    else:
        desired = build_deployment(name, namespace, spec, ctx.config.images)
        desired_hash = desired["metadata"]["annotations"][HASH_ANNOTATION]
        deployment = ctx.deployments.get((namespace, name)) or deployment  # the watch's is the freshest
        if deployment is None:
            deployment = await ctx.kube.get(object_path("apps/v1", "deployments", namespace, name))
        conditions, replicas, ready = deployment_conditions(deployment, spec.replicas, desired_hash, generation)
    body = ctx.known.get((namespace, name)) or body  # the status as the watch last showed it
    old = body.get("status") or {}
    status = {
        "observedGeneration": generation, "replicas": replicas, "readyReplicas": ready,
        "replicaSummary": f"{ready}/{spec.replicas}", "selector": selector_string(name),
        "url": service_url(name, namespace, spec), "configHash": desired_hash,
        "appliedEngineArgs": engine_command(spec),
        "conditions": merge_conditions(old.get("conditions"), conditions, now_iso()),
        "groupSize": spec.nnodes if spec.nnodes > 1 else None,  # None: removed by the merge patch
    }
    await write_status(ctx.kube, body, status)


async def write_status(kube: AsyncKubeClient, body: Mapping[str, Any], status: dict[str, Any]) -> None:
    """Patch status through the status subresource, only when something changed."""
    old = body.get("status") or {}
    if all(old.get(k) == v for k, v in status.items()):
        return
    meta = body["metadata"]
    try:
        await kube.patch(isvc_path(meta["namespace"], meta["name"], "status"), {"status": status})
    except ApiError as e:
        if e.status == 404:
            return  # deleted meanwhile
        raise kopf.TemporaryError(f"status update failed: {e}", delay=2)
