"""Kopf handlers: thin wrappers that call the reconciler. Load with `kopf run -m
kvpilot.operator.handlers` or `kvpilot operator`.

The resync interval is read from KVPILOT_RESYNC_SECONDS when this module is imported,
since Kopf fixes a timer's interval when it is declared.
"""
from __future__ import annotations

import logging
from typing import Any

import kopf

from .builders import ISVC_LABEL
from .kube import Kube
from .reconcile import Context, OperatorConfig, isvc_path, reconcile, refresh_status
from .spec import GROUP, PLURAL, VERSION

CONFIG = OperatorConfig.from_env()
MANAGED = {"app.kubernetes.io/managed-by": "kvpilot-operator"}


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
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
    memo.ctx = Context(kube=Kube.from_environment(), config=CONFIG)


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    if "ctx" in memo:
        await memo.ctx.kube.close()


@kopf.on.create(GROUP, VERSION, PLURAL)
async def created(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    await reconcile(memo.ctx, body, "create", logger)


@kopf.on.update(GROUP, VERSION, PLURAL)
async def updated(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    await reconcile(memo.ctx, body, "update", logger)


@kopf.on.resume(GROUP, VERSION, PLURAL)
async def resumed(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    await reconcile(memo.ctx, body, "resume", logger)


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
async def deleted(name: str, logger: kopf.Logger, **_: Any) -> None:
    # No finalizer: the children carry ownerReferences and the garbage collector removes them.
    logger.info(f"InferenceService {name} deleted; its children go with it")


@kopf.timer(GROUP, VERSION, PLURAL, interval=CONFIG.resync_seconds, initial_delay=CONFIG.resync_seconds)
async def resync(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Level-based repair: recreate deleted children, restore hand-edited ones."""
    try:
        await reconcile(memo.ctx, body, "resync", logger)
    except kopf.PermanentError:
        pass  # recorded in status already; the timer keeps checking


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
async def deployment_changed(body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any) -> None:
    """A child Deployment changed: carry its readiness into the owner's status at once."""
    owner = body.metadata.labels.get(ISVC_LABEL)
    if not owner or type == "DELETED":
        return
    isvc = await memo.ctx.kube.get(isvc_path(body.metadata.namespace, owner))
    if isvc is not None and not isvc["metadata"].get("deletionTimestamp"):
        await refresh_status(memo.ctx, isvc, deployment=body)
