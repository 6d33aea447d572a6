"""Level-based reconciliation of one InferenceService: make the children match the spec and
write what is observed into status. Every entry point (create, update, resume, the resync
timer, a Deployment event) calls the same idempotent functions, so a retried or duplicated
call, or a restarted operator, converges on the same state without duplicates.
"""
from __future__ import annotations

import asyncio
import datetime
import os
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from kvpilot.api.kube import ApiError, AsyncKubeClient, isvc_path, manifest_path, object_path
from kvpilot.api.spec import InferenceServiceSpec, service_url

from .builders import (HASH_ANNOTATION, Images, admin_secret_name, build_admin_secret, build_configmap,
                       build_deployment, build_podmonitor, build_service, configmap_name, selector_string)
from .engine_args import engine_command
from .drift import covers, merge_patch
from .events import announce
from .group_builders import build_group_children, group_hash
from .groups import OLD_CONFIGURATION, delete_group_children, sync_groups
from .network import NetworkPolicyConfig, build_networkpolicy
from .policy import Policy
from .status import deployment_conditions, failed_conditions, group_conditions, merge_conditions
from .validation import InvalidSpec, validate


@dataclass
class OperatorConfig:
    """What the operator is told by its environment (the Helm chart sets these)."""

    images: Images = field(default_factory=Images)
    resync_seconds: float = 30.0
    watch_timeout_seconds: int = 300  # the API server's ?timeoutSeconds= takes an integer only
    podmonitor_check_seconds: float = 300.0
    network: NetworkPolicyConfig = field(default_factory=NetworkPolicyConfig)
    policy: Policy = field(default_factory=Policy)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "OperatorConfig":
        images = Images(kvpilot=env.get("KVPILOT_ENGINE_IMAGE", Images.kvpilot),
                        vllm=env.get("KVPILOT_VLLM_IMAGE", Images.vllm))
        return cls(images=images,
                   resync_seconds=float(env.get("KVPILOT_RESYNC_SECONDS", 30)),
                   watch_timeout_seconds=int(env.get("KVPILOT_WATCH_TIMEOUT_SECONDS", 300)),
                   network=NetworkPolicyConfig.from_env(env), policy=Policy.from_env(env))


@dataclass
class Context:
    """Per-process state shared by the handlers (kept in Kopf's memo)."""

    kube: AsyncKubeClient
    config: OperatorConfig
    # (namespace, name) -> the resource as the watch last delivered it: the resync loop's
    # scope, and the owner a child Deployment's event refreshes, without a GET of each
    known: dict[tuple[str, str], Mapping[str, Any]] = field(default_factory=dict)
    # (namespace, name) -> time.monotonic() of its last complete reconcile (the resync skips
    # a resource reconciled within its interval)
    reconciled_at: dict[tuple[str, str], float] = field(default_factory=dict)
    # (namespace, name) -> the child Deployment as its watch last delivered it: the freshest
    # state the status can be computed from (a reconcile's own read or write of it may be
    # overtaken by the rollout while the reconcile's other requests wait)
    deployments: dict[tuple[str, str], Mapping[str, Any]] = field(default_factory=dict)
    # one status computation and write at a time per resource: the last writer then computes
    # from the freshest state, instead of an older computation landing after a newer one
    status_locks: defaultdict[tuple[str, str], asyncio.Lock] = field(default_factory=lambda: defaultdict(asyncio.Lock))
    _podmonitors: bool | None = None
    _podmonitors_at: float = 0.0

    async def podmonitors_available(self) -> bool:
        """Whether the monitoring.coreos.com PodMonitor CRD exists (re-checked now and then)."""
        now = time.monotonic()
        if self._podmonitors is None or now - self._podmonitors_at > self.config.podmonitor_check_seconds:
            self._podmonitors = await self.kube.has_resource("monitoring.coreos.com", "v1", "podmonitors")
            self._podmonitors_at = now
        return self._podmonitors


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def desired_children(body: Mapping[str, Any], spec: InferenceServiceSpec, config: OperatorConfig,
                     podmonitor: bool) -> list[dict[str, Any]]:
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


async def reconcile(ctx: Context, body: Mapping[str, Any], cause: str, logger: Any) -> None:
    """Bring one InferenceService's children and status in line with its spec.

    Raises kopf.PermanentError for a spec that cannot run (after recording it in status
    and removing any children), kopf.TemporaryError when it should be retried soon."""
    meta = body["metadata"]
    name, namespace, generation = meta["name"], meta["namespace"], int(meta.get("generation") or 1)
    old_status = body.get("status") or {}
    try:
        spec = InferenceServiceSpec.from_dict(body.get("spec") or {})
        validate(spec)
        ctx.config.policy.check(spec)
    except (InvalidSpec, ValueError, TypeError) as e:
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

    create_first = cause == "create"  # a new resource: its children most likely do not exist yet
    if spec.engine.runtime == "kvpilot" and await ensure_admin_secret(ctx.kube, body, spec, create_first):
        await announce(ctx.kube, body, cause != "resync", "Normal", "Created", f"created Secret {admin_secret_name(name)}")
    podmonitor = await ctx.podmonitors_available()
    deployment = None
    for child in desired_children(body, spec, ctx.config, podmonitor):
        action, actual = await ensure_child(ctx.kube, child, create_first)
        if child["kind"] == "Deployment":
            deployment = actual
        if action != "unchanged":
            kind, child_name = child["kind"], child["metadata"]["name"]
            reason = "Created" if action == "created" else ("DriftRepaired" if cause == "resync" else "Updated")
            message = f"{action} {kind} {child_name}"
            if kind == "Deployment":
                message += f" with configuration {child['metadata']['annotations'][HASH_ANNOTATION]}"
            await announce(ctx.kube, body, cause != "resync", "Normal", reason, message)
            logger.info(message)
    if spec.nnodes > 1 or (old_status.get("groupSize") or 1) > 1:  # groups now, or before: remove the other shape
        stale = await delete_group_children(ctx.kube, namespace, name, spec.replicas if spec.nnodes > 1 else None)
        if spec.nnodes > 1 and await ctx.kube.delete(object_path("apps/v1", "deployments", namespace, name)):
            stale.append(f"deployments/{name}")
        for child in stale:
            await announce(ctx.kube, body, cause != "resync", "Normal", "Deleted", f"deleted {child}")
    await refresh_status(ctx, body, spec, deployment)
    ctx.reconciled_at[(namespace, name)] = time.monotonic()


async def refresh_status(ctx: Context, body: Mapping[str, Any], spec: InferenceServiceSpec | None = None,
                         deployment: Mapping[str, Any] | None = None) -> None:
    """_refresh_status under the resource's status lock (Context.status_locks)."""
    async with ctx.status_locks[(body["metadata"]["namespace"], body["metadata"]["name"])]:
        await _refresh_status(ctx, body, spec, deployment)


async def _refresh_status(ctx: Context, body: Mapping[str, Any], spec: InferenceServiceSpec | None,
                          deployment: Mapping[str, Any] | None) -> None:
    """Write observedGeneration, replicas, url, applied args and conditions from the Deployment,
    or with parallelism.nnodes > 1 from the groups' pods (recreating a group that lost a member
    and replacing outdated groups one at a time: operator/groups.py)."""
    meta = body["metadata"]
    name, namespace, generation = meta["name"], meta["namespace"], int(meta.get("generation") or 1)
    if spec is None:
        try:
            spec = InferenceServiceSpec.from_dict(body.get("spec") or {})
            validate(spec)
            ctx.config.policy.check(spec)
        except (InvalidSpec, ValueError, TypeError):
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
