"""Kopf handlers: thin wrappers that call the reconciler. Load with `kopf run -m
kvpilot.operator.handlers` or `kvpilot operator`.

No finalizer: Kopf puts its finalizer on every object that has a timer or a daemon
(kopf/on.py declares both with requires_finalizer=True; nolar/kopf#1074), so that it can
stop them before the object goes. Ours need no cleanup (the children carry ownerReferences
and the garbage collector removes them), and a finalizer would make `kubectl delete isvc`
hang once the operator is uninstalled. So the drift-repair resync is one operator-wide loop
over the resources the watch has seen, not a per-object `@kopf.timer`. (The tuner daemon,
when loaded, still holds Kopf's finalizer while a resource is being tuned: see
kvpilot.tuner.cluster.daemon.) With leader election (`kvpilot operator --leader-elect`, the chart's
two replicas) Kopf, and so this loop, runs only in the replica that holds the Lease
(kvpilot.operator.runtime.leader). Under Kopf peering instead, Kopf pauses its own handlers in a
replica that is not the active one, but not this loop; it only re-applies the same desired
state, so that is safe but may post a DriftRepaired event twice.

Every reconcile is timed into kvpilot.operator.runtime.metrics by handler, and every watch event
sets the resource's condition, rollout and tuning series there.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import kopf

from kvpilot.api.crd import GROUP, PLURAL, VERSION
from kvpilot.api.kube import AsyncKubeClient, isvc_path

from kvpilot.operator import child_watch  # noqa: F401  (kopf_session: registers Kopf's login)
from kvpilot.operator.runtime import kopf_session
from kvpilot.operator.runtime import metrics
from kvpilot.operator.render.builders import HASH_ANNOTATION, ISVC_LABEL, ROLE_LABEL
from kvpilot.operator.reconcile import Context, OperatorConfig, reconcile, refresh_status

CONFIG = OperatorConfig.from_env()
MANAGED = {"app.kubernetes.io/managed-by": "kvpilot-operator"}
MANAGED_SELECTOR = ",".join(f"{k}={v}" for k, v in MANAGED.items())
# Children whose own watch repairs drift (operator/child_watch.py; the Deployment's is
# deployment_changed). The NetworkPolicy only when the operator makes them (else the chart
# grants no list/watch on them).
WATCHED_CHILDREN = (("v1", "configmaps"), ("v1", "services"),
                    *((("networking.k8s.io/v1", "networkpolicies"),) if CONFIG.network.enabled else ()))


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Kopf startup handler (kopf.on.startup): tunes Kopf's settings (persistence in annotations,
    watch timeouts in s, server-side label selectors for our children) and puts the shared Context
    in the memo, starting the resync loop. Source: Kopf docs, "Configuration" and "Startup"."""
    # Keep Kopf's bookkeeping in annotations: the CRD's structural schema would prune
    # anything Kopf wrote under status.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    # Events come from explicit kopf.event/warn calls; logs post only warnings.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = CONFIG.watch_timeout_seconds
    settings.watching.client_timeout = CONFIG.watch_timeout_seconds + 30
    settings.execution.max_workers = 16
    # After its own PATCH, Kopf holds a resource's change handlers until the watch shows that
    # resourceVersion, for at most this long, then runs them on the older body it has: with the
    # default 5 s a loaded API server's watch lagged past it and 472 of 1,000 create handlers ran
    # twice (issue 42's benchmark). A newer event still wakes the wait at once.
    settings.persistence.consistency_timeout = 60
    # The Deployment watch (deployment_changed) asks the API server for our children only: the
    # handler's labels= filters on the client, after Kopf has listed and streamed every Deployment
    # of the watched namespaces; this labelSelector on the list and the watch means the operator
    # never receives the others (issue 42: memory follows InferenceServices, not the cluster).
    settings.watching.label_selectors["apps", "v1", "deployments"] = MANAGED_SELECTOR
    # The pods of multi-pod groups (group_pod_changed), likewise: only ours, and only group members.
    settings.watching.label_selectors["v1", "pods"] = f"{MANAGED_SELECTOR},{ROLE_LABEL}"
    for group_version, plural in WATCHED_CHILDREN:  # child_changed: ours only
        settings.watching.label_selectors[(*group_version.split("/"), plural)] = MANAGED_SELECTOR
    memo.ctx = Context(kube=AsyncKubeClient.from_environment(user_agent="kvpilot-operator"), config=CONFIG)
    memo.resync_task = asyncio.create_task(resync_forever(memo.ctx, logging.getLogger("kvpilot.operator")))


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    """Kopf cleanup handler (kopf.on.cleanup, on operator exit): stops the resync loop and closes the
    API client."""
    if "resync_task" in memo:
        memo.resync_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await memo.resync_task
    if "ctx" in memo:
        await memo.ctx.kube.close()


@kopf.on.event(GROUP, VERSION, PLURAL)
async def seen(type: str | None, namespace: str, name: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Keep the resources the resync loop visits (the watch's view, so its scope), each as the
    watch last delivered it, and their metrics."""
    if "ctx" in memo:
        if type == "DELETED":
            memo.ctx.known.pop((namespace, name), None)
            memo.ctx.status_locks.pop((namespace, name), None)
            memo.ctx.reconciled_at.pop((namespace, name), None)
            memo.ctx.reconciled_generation.pop((namespace, name), None)
            memo.ctx.status_waiting.pop((namespace, name), None)
        else:
            memo.ctx.known[(namespace, name)] = reconciled_fields(body)
    metrics.observe(namespace, name, None if type == "DELETED" else body)


KEPT_METADATA = ("name", "namespace", "uid", "generation", "labels", "deletionTimestamp", "resourceVersion")


def reconciled_fields(body: kopf.Body) -> dict[str, Any]:
    """What the reconciler reads of a resource (identity, spec, status), without what the
    watch event also carries: managedFields and Kopf's last-handled-configuration annotation
    (a second copy of the spec) would make the copy per resource several times larger."""
    metadata = body.get("metadata") or {}
    return {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
            "metadata": {k: metadata[k] for k in KEPT_METADATA if k in metadata},
            "spec": body.get("spec") or {}, "status": body.get("status") or {}}


def status_fields(deployment: kopf.Body) -> dict[str, Any]:
    """What an InferenceService's status is computed from (operator.status.deployment_conditions):
    the Deployment's generation, its template's configuration hash, its status."""
    template = (deployment.get("spec") or {}).get("template") or {}
    annotations = (template.get("metadata") or {}).get("annotations") or {}
    return {"metadata": {"generation": (deployment.get("metadata") or {}).get("generation")},
            "spec": {"template": {"metadata": {"annotations": {
                k: v for k, v in annotations.items() if k == HASH_ANNOTATION}}}},
            "status": deployment.get("status") or {}}


async def resync_forever(ctx: Context, logger: logging.Logger) -> None:
    """Level-based repair, each resource once per resync interval, spread evenly over it (a
    burst of every resource's GETs at once would compete with the creates: issue 42):
    recreate deleted children, restore hand-edited ones, refresh status. The net under the
    children's own watches (operator/child_watch.py), and the only repair of what no watch
    shows (the admin-token Secret, the PodMonitor). Each resource as the watch last delivered
    it (no GET: the watch sends every change), and only one not reconciled within the interval
    (a create, update, resume or drift repair just did the same work), so a child deleted by
    hand comes back within two intervals at most. Errors are logged and retried on the next pass."""
    while True:
        keys = sorted(ctx.known)
        if not keys:
            await asyncio.sleep(ctx.config.resync_seconds)
            continue
        pause_s = ctx.config.resync_seconds / len(keys)
        for key in keys:
            await asyncio.sleep(pause_s)
            body, last = ctx.known.get(key), ctx.reconciled_at.get(key)
            if body is None or (last is not None and time.monotonic() - last < ctx.config.resync_seconds):
                continue
            try:
                if not body["metadata"].get("deletionTimestamp"):
                    with metrics.reconcile_timer("resync"):
                        await reconcile(ctx, body, "resync", logger)
            except kopf.PermanentError:
                pass  # recorded in status already; the next pass checks again
            except Exception as e:  # noqa: BLE001  (one resource's trouble must not stop the loop)
                logger.warning(f"resync of {key[0]}/{key[1]} failed: {e}")


@kopf.on.create(GROUP, VERSION, PLURAL)
async def created(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """A new InferenceService: creates its children (POST first) and status. Raises what reconcile
    raises: kopf.PermanentError for a spec that cannot run, kopf.TemporaryError to retry soon."""
    with metrics.reconcile_timer("create"):
        await reconcile(memo.ctx, body, "create", logger)


@kopf.on.update(GROUP, VERSION, PLURAL)
async def updated(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """The spec (or labels/annotations) changed: re-renders and patches the children. Raises as
    `created`."""
    with metrics.reconcile_timer("update"):
        await reconcile(memo.ctx, body, "update", logger)


@kopf.on.resume(GROUP, VERSION, PLURAL)
async def resumed(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Kopf saw an existing InferenceService at operator start (kopf.on.resume): reconciles it once,
    so what changed while the operator was down is repaired. Raises as `created`."""
    with metrics.reconcile_timer("resume"):
        await reconcile(memo.ctx, body, "resume", logger)


async def _owner(body: kopf.Body, memo: kopf.Memo) -> dict[str, Any] | None:
    """The InferenceService that owns a child (its label), as its watch last delivered it (a
    GET only before the watch has shown it); None when gone or being deleted."""
    owner = body.metadata.labels.get(ISVC_LABEL)
    if not owner:
        return None
    namespace = body.metadata.namespace
    isvc = memo.ctx.known.get((namespace, owner)) or await memo.ctx.kube.get(isvc_path(namespace, owner))
    return None if isvc is None or isvc["metadata"].get("deletionTimestamp") else isvc


def _register_child_watches() -> None:
    for group_version, plural in WATCHED_CHILDREN:
        kopf.on.event(*group_version.split("/"), plural, labels=MANAGED)(child_changed)


async def child_changed(event: kopf.RawEvent, type: str | None, memo: kopf.Memo, logger: kopf.Logger,
                        **_: Any) -> None:
    """A ConfigMap, Service or NetworkPolicy of ours was edited or deleted: its owner is
    reconciled at once if it drifted (operator/child_watch.py)."""
    await _repair(memo.ctx, type, event["object"], logger)


async def _repair(ctx: Context, type_: str | None, child: dict[str, Any], logger: Any) -> bool:
    """Reconciles the child's owner if the child drifted or was deleted; True when it did."""
    isvc = await child_watch.owner_to_repair(ctx, type_, child)
    if isvc is None:
        return False
    with metrics.reconcile_timer("drift"):
        await reconcile(ctx, isvc, "drift", logger)
    return True


_register_child_watches()


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
async def deployment_changed(body: kopf.Body, event: kopf.RawEvent, type: str | None, memo: kopf.Memo,
                             logger: kopf.Logger, **_: Any) -> None:
    """A child Deployment changed: carry its readiness into the owner's status at once, keep
    what the status is computed from for the reconciles (Context.deployments), and repair it
    if it was edited away from the spec or deleted (operator/child_watch.py)."""
    key = (body.metadata.namespace, body.metadata.labels.get(ISVC_LABEL))
    if type == "DELETED":
        memo.ctx.deployments.pop(key, None)
    elif key[1]:
        memo.ctx.deployments[key] = status_fields(body)
    if await _repair(memo.ctx, type, event["object"], logger):
        return  # the reconcile refreshed the status too
    isvc = None if type == "DELETED" else await _owner(body, memo)
    if isvc is not None:
        with metrics.reconcile_timer("deployment"):
            await refresh_status(memo.ctx, isvc, deployment=body)


@kopf.on.event("v1", "pods", labels={**MANAGED, ROLE_LABEL: kopf.PRESENT})
async def group_pod_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A pod of a multi-pod group changed, restarted or went: refresh the owner's status, which
    recreates a group that lost a member (operator/groups.py). Pods rather than the
    StatefulSets: a container restart and a pod's readiness show only on the pod."""
    isvc = await _owner(body, memo)
    if isvc is not None:
        with metrics.reconcile_timer("group"):
            await refresh_status(memo.ctx, isvc)
