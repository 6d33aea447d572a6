"""Level-based reconciliation of one InferenceService: make the children match the spec and
write what is observed into status. Every entry point (create, update, resume, the resync
timer, a Deployment event) calls the same idempotent functions, so a retried or duplicated
call, or a restarted operator, converges on the same state without duplicates.
"""
from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import kopf

from kvpilot.api.kube import ApiError, AsyncKubeClient, manifest_path, object_path
from kvpilot.api.spec import InferenceServiceSpec

from kvpilot.operator.render.builders import (HASH_ANNOTATION, admin_secret_name, build_admin_secret, build_configmap, build_deployment,
                       build_podmonitor, build_service, configmap_name)
from kvpilot.operator.context import Context, OperatorConfig
from kvpilot.operator.drift import covers, merge_patch
from kvpilot.operator.events import announce
from kvpilot.operator.render.group_builders import build_group_children
from kvpilot.operator.groups import delete_group_children
from kvpilot.operator.render.network import build_networkpolicy
from kvpilot.operator.status import failed_conditions, merge_conditions
from kvpilot.operator.status_refresh import now_iso, refresh_status, write_status
from kvpilot.operator.validation import SPEC_ERRORS, InvalidSpec, runnable_spec

DRIFT_CAUSES = ("resync", "drift")  # the resync loop; a child's own watch (operator/child_watch.py)

__all__ = ["Context", "OperatorConfig", "desired_children", "ensure_child", "reconcile", "refresh_status"]


def desired_children(body: Mapping[str, Any], spec: InferenceServiceSpec, config: OperatorConfig,
                     podmonitor: bool) -> list[dict[str, Any]]:
    """Every child manifest the spec wants, with an ownerReference to `body` (kopf.append_owner_reference,
    so the garbage collector removes them with it): ConfigMap, the Deployment (or with nnodes > 1 the
    group StatefulSets and headless Service), Service, NetworkPolicy when enabled, PodMonitor when
    `podmonitor` (its CRD exists). Pure: no cluster access."""
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    engine = (build_group_children(name, namespace, spec, config.images) if spec.nnodes > 1
              else [build_deployment(name, namespace, spec, config.images)])
    children = [build_configmap(name, namespace, spec), *engine, build_service(name, namespace, spec)]
    if config.network.enabled:
        children.append(build_networkpolicy(name, namespace, spec, config.network))
    if podmonitor:
        children.append(build_podmonitor(name, namespace, spec))
    kopf.append_owner_reference(children, owner=body)
    return children


async def ensure_child(kube: AsyncKubeClient, desired: dict[str, Any],
                       create_first: bool = False) -> tuple[str, dict[str, Any]]:
    """Create the child, or restore the values it should have. Returns (created / updated /
    unchanged, the child as the API server answered). create_first (a new resource, whose
    children most likely do not exist): POST without a GET first, and compare only on 409."""
    path = manifest_path(desired)
    actual = None if create_first else await kube.get(path)
    if actual is None:
        try:
            return "created", await kube.create(desired)
        except ApiError as e:
            if e.status != 409:  # 409: a concurrent call created it; compare with that one
                raise
            actual = await kube.get(path)
    if actual is None or actual["metadata"].get("deletionTimestamp"):
        raise kopf.TemporaryError(f"{desired['kind']} {desired['metadata']['name']} is being deleted", delay=2)
    if covers(actual, desired):
        return "unchanged", actual
    patch = merge_patch(actual, {k: v for k, v in desired.items() if k not in ("apiVersion", "kind")})
    return "updated", await kube.patch(path, patch)


async def ensure_admin_secret(kube: AsyncKubeClient, body: Mapping[str, Any], spec: InferenceServiceSpec,
                              create_first: bool = False) -> bool:
    """Creates the admin-token Secret once (owned by the InferenceService); an existing one is
    never rewritten, so the token stays what the engine and the tuner hold. True when created.
    create_first: POST without a GET first (409 keeps the existing one). The token is never
    logged: only the Secret's name is."""
    meta = body["metadata"]
    path = object_path("v1", "secrets", meta["namespace"], admin_secret_name(meta["name"]))
    if not create_first and await kube.get(path) is not None:
        return False
    secret = build_admin_secret(meta["name"], meta["namespace"], spec)
    kopf.append_owner_reference(secret, owner=body)
    try:
        await kube.create(secret)
    except ApiError as e:
        if e.status != 409:  # a concurrent call created it first: keep that one
            raise
        return False
    return True


async def delete_children(kube: AsyncKubeClient, namespace: str, name: str) -> list[str]:
    """Delete whatever children exist (for a spec that cannot run). Returns what was deleted."""
    deleted = []
    for api_version, plural, child in (("v1", "configmaps", configmap_name(name)),
                                       ("apps/v1", "deployments", name), ("v1", "services", name),
                                       ("networking.k8s.io/v1", "networkpolicies", name),
                                       ("monitoring.coreos.com/v1", "podmonitors", name)):
        try:
            if await kube.delete(object_path(api_version, plural, namespace, child)):
                deleted.append(f"{plural}/{child}")
        except ApiError as e:
            if e.status != 404 and plural != "podmonitors":
                raise
    return deleted + await delete_group_children(kube, namespace, name)


async def ensure_children(ctx: Context, body: Mapping[str, Any], spec: InferenceServiceSpec, cause: str,
                          done: dict[str, list[str]], logger: Any) -> tuple[Mapping[str, Any] | None, bool]:
    """Create or restore every child the spec wants and remove the other shape's (groups vs one
    Deployment), appending what it did to `done` by Event reason as it goes. Returns the
    Deployment as the API server answered (None for groups) and whether it was just POSTed.
    Raises what ensure_child raises."""
    meta = body["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    old_status = body.get("status") or {}
    create_first = cause == "create"  # a new resource: its children most likely do not exist yet
    if spec.engine.runtime == "kvpilot" and await ensure_admin_secret(ctx.kube, body, spec, create_first):
        done["Created"].append(f"created Secret {admin_secret_name(name)}")
    podmonitor = await ctx.podmonitors_available()
    deployment, deployment_posted = None, False
    for child in desired_children(body, spec, ctx.config, podmonitor):
        action, actual = await ensure_child(ctx.kube, child, create_first)
        if child["kind"] == "Deployment":
            deployment, deployment_posted = actual, action == "created"
        if action != "unchanged":
            kind, child_name = child["kind"], child["metadata"]["name"]
            reason = "Created" if action == "created" else ("DriftRepaired" if cause in DRIFT_CAUSES else "Updated")
            message = f"{action} {kind} {child_name}"
            if kind == "Deployment":
                message += f" with configuration {child['metadata']['annotations'][HASH_ANNOTATION]}"
            done[reason].append(message)
            logger.info(message)
    if spec.nnodes > 1 or (old_status.get("groupSize") or 1) > 1:  # groups now, or before: remove the other shape
        stale = await delete_group_children(ctx.kube, namespace, name, spec.replicas if spec.nnodes > 1 else None)
        if spec.nnodes > 1 and await ctx.kube.delete(object_path("apps/v1", "deployments", namespace, name)):
            stale.append(f"deployments/{name}")
        done["Deleted"].extend(f"deleted {child}" for child in stale)
    return deployment, deployment_posted


async def reconcile(ctx: Context, body: Mapping[str, Any], cause: str, logger: Any) -> None:
    """Bring one InferenceService's children and status in line with its spec, once one of
    the Context's reconcile slots is free.

    Raises kopf.PermanentError for a spec that cannot run (after recording it in status
    and removing any children), kopf.TemporaryError when it should be retried soon."""
    async with ctx.reconcile_slots:
        await _reconcile(ctx, body, cause, logger)


async def _reconcile(ctx: Context, body: Mapping[str, Any], cause: str, logger: Any) -> None:
    meta = body["metadata"]
    name, namespace, generation = meta["name"], meta["namespace"], int(meta.get("generation") or 1)
    old_status = body.get("status") or {}
    try:
        spec = runnable_spec(body, ctx.config.policy)
    except SPEC_ERRORS as e:
        reason = e.reason if isinstance(e, InvalidSpec) else "InvalidSpec"
        deleted = await delete_children(ctx.kube, namespace, name)
        was_failed = any(c.get("type") == "Failed" and c.get("status") == "True" and c.get("reason") == reason
                         and c.get("message") == str(e) for c in old_status.get("conditions") or ())
        status = {"observedGeneration": generation, "replicas": 0, "readyReplicas": 0,
                  "replicaSummary": f"0/{(body.get('spec') or {}).get('replicas', 0)}",
                  "conditions": merge_conditions(old_status.get("conditions"),
                                                 failed_conditions(reason, str(e), generation), now_iso())}
        await write_status(ctx.kube, body, status)
        if not was_failed or deleted:
            await announce(ctx.kube, body, cause != "resync", "Warning", reason, str(e))
        raise kopf.PermanentError(f"{reason}: {e}")

    done: dict[str, list[str]] = defaultdict(list)  # Event reason -> what this reconcile did
    try:
        deployment, deployment_posted = await ensure_children(ctx, body, spec, cause, done, logger)
    finally:  # one Event per reason, not per child (a create is one POST, not five), said even
        # when a later step failed: its retry finds those children done and says nothing of them
        for reason, messages in done.items():
            await announce(ctx.kube, body, cause != "resync", "Normal", reason, "; ".join(messages))
    if not deployment_posted:
        await refresh_status(ctx, body, spec, deployment)
    # else the Deployment was just POSTed: its watch's ADDED event refreshes the status
    # (deployment_changed), from a state at least as fresh as this one; one write, not two
    ctx.reconciled_at[(namespace, name)] = time.monotonic()
    ctx.reconciled_generation[(namespace, name)] = meta.get("generation")
