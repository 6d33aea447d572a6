"""How many API requests the operator's reconcile sends, against the real API server (issue 42:
at 1,000 InferenceServices it sent 72 per resource, and the resync's reads of every resource
every 30 s competed with the creates). The reconciler runs in this process with a client that
records each request: an unchanged resource costs one GET per child and no write; the resync
loop reads no resource (the watch delivered it) and skips one reconciled within its interval.
And a status written late (a create handler queued behind its requests) is computed from the
Deployment as its watch last delivered it, not from the older copy the handler read."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import pytest
import yaml
from kube.tools import ROOT, Kubectl, wait_for

from kvpilot.api.kube import AsyncKubeClient, KubeClient, load_configuration
from kvpilot.operator import handlers
from kvpilot.operator.reconcile import Context, OperatorConfig, reconcile, refresh_status

LOGGER = logging.getLogger("test")
CHILD_KINDS = ("secrets", "configmaps", "deployments", "services", "networkpolicies")


class Recording(KubeClient):
    """KubeClient that keeps (method, path) of every request it sends."""

    def __init__(self, kubeconfig: str):
        super().__init__(load_configuration(kubeconfig), "kvpilot-test")
        self.sent: list[tuple[str, str]] = []

    def request(self, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        self.sent.append((method, path))
        return super().request(method, path, *args, **kwargs)


@pytest.fixture(scope="module")
def isvc(cluster) -> dict:
    """An InferenceService (the example, its CRD applied) whose children a first reconcile made."""
    Kubectl(cluster.kubeconfig)("apply", "--server-side", "-f", str(ROOT / "crds" / "inferenceservices.kvpilot.dev.yaml"))
    path = f"/apis/kvpilot.dev/v1alpha1/namespaces/{cluster.namespace}/inferenceservices"
    wait_for(lambda: cluster.control_plane.get(path, quiet=True), what="the CRD served")
    doc = yaml.safe_load((ROOT / "examples" / "inferenceservice-smollm2.yaml").read_text())
    doc["metadata"] = {"name": "counted", "namespace": cluster.namespace}
    return json.loads(cluster.control_plane.api("POST", path, doc))


def run(cluster, steps) -> list[tuple[str, str]]:
    """Runs `steps(ctx)` (a coroutine function) with a recording client; its requests."""
    recording = Recording(str(cluster.kubeconfig))

    async def main() -> None:
        kube = AsyncKubeClient(recording)
        try:
            await steps(Context(kube=kube, config=OperatorConfig.from_env({"KVPILOT_RESYNC_SECONDS": "0.2"})))
        finally:
            await kube.close()
    asyncio.run(main())
    return recording.sent


def steady(cluster, name: str) -> dict:
    """The resource once a reconcile has nothing left to write (its Deployment rolled out)."""
    path = f"/apis/kvpilot.dev/v1alpha1/namespaces/{cluster.namespace}/inferenceservices/{name}"

    def settled() -> dict | None:
        body = json.loads(cluster.control_plane.get(path))
        sent = run(cluster, lambda ctx: reconcile(ctx, body, "resync", LOGGER))
        return body if all(method == "GET" for method, _ in sent) else None
    return wait_for(settled, timeout=60, what="a reconcile with nothing to write")


def test_an_unchanged_resource_costs_one_get_per_child_and_no_write(cluster, isvc):
    body = steady(cluster, isvc["metadata"]["name"])
    sent = run(cluster, lambda ctx: reconcile(ctx, body, "resync", LOGGER))
    # the first reconcile of a process also asks once whether PodMonitors are served
    children = [(m, p) for m, p in sent if not p.startswith("/apis/monitoring.coreos.com")]
    assert sorted(p.split("/")[-2] for m, p in children) == sorted(CHILD_KINDS), sent
    assert {m for m, _ in sent} == {"GET"}
    assert not any("inferenceservices" in p for _, p in sent), "the body came with the call; no GET of it"


def test_the_resync_reads_no_resource_and_skips_one_reconciled_within_its_interval(cluster, isvc):
    body = steady(cluster, isvc["metadata"]["name"])
    key = (cluster.namespace, body["metadata"]["name"])

    async def one_pass(ctx: Context, reconciled_meanwhile: bool) -> None:
        ctx.known[key] = body
        ctx.reconciled_at[key] = time.monotonic() - 60  # long ago
        loop = asyncio.create_task(handlers.resync_forever(ctx, LOGGER))
        await asyncio.sleep(0.1)
        if reconciled_meanwhile:  # e.g. an update handler, while the loop slept
            ctx.reconciled_at[key] = time.monotonic()
        await asyncio.sleep(0.2)  # one pass (interval 0.2 s)
        loop.cancel()

    assert run(cluster, lambda ctx: one_pass(ctx, True)) == []
    sent = run(cluster, lambda ctx: one_pass(ctx, False))
    assert sent and {m for m, _ in sent} == {"GET"} and not any("inferenceservices" in p for _, p in sent)


def test_a_late_status_write_takes_the_deployment_from_the_watch_not_the_handlers_older_copy(cluster, isvc):
    """The create handler's Deployment is the one it POSTed (no status yet); if the rollout
    finished meanwhile and a Deployment event wrote Ready, the handler's last write must not
    undo it (at 200 InferenceServices it did, until the next resync)."""
    name = isvc["metadata"]["name"]
    path = f"/apis/apps/v1/namespaces/{cluster.namespace}/deployments/{name}"
    deployment = wait_for(lambda: (d := json.loads(cluster.control_plane.get(path)))["status"].get("readyReplicas")
                          and d, timeout=60, what="the Deployment rolled out (kwok)")
    body = steady(cluster, name)

    async def late_write(ctx: Context) -> None:
        ctx.deployments[(cluster.namespace, name)] = handlers.status_fields(deployment)  # the watch's
        await refresh_status(ctx, {**body, "status": {}}, None, {**deployment, "status": {}})
    run(cluster, late_write)
    after = json.loads(cluster.control_plane.get(
        f"/apis/kvpilot.dev/v1alpha1/namespaces/{cluster.namespace}/inferenceservices/{name}"))
    assert {c["type"]: c["status"] for c in after["status"]["conditions"]}["Ready"] == "True"
