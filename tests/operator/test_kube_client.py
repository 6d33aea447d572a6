"""kvpilot.api.kube, the one Kubernetes client of the operator and the tuner, against the real
API server (tests/kube) over HTTPS with a kubeconfig and a client certificate. Behaviour checked is the Kubernetes API's: POST answers
201 with the object, a second POST of the same name 409 AlreadyExists, a missing object 404,
a merge patch (RFC 7386) changes only the given keys, DELETE of a gone object 404."""
from __future__ import annotations

import asyncio

import pytest

from kvpilot.api.kube import WORKERS, ApiError, AsyncKubeClient, KubeClient, object_path


NAMESPACE = "kube-client"  # this module's namespace (tests/kube/cluster.py)


def configmap(name: str, data: dict[str, str]) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": NAMESPACE},
            "data": data}


def test_sync_client_creates_patches_and_deletes_plain_dicts(cluster):
    kube = KubeClient.from_environment(str(cluster.kubeconfig), user_agent="kvpilot-test")
    path = object_path("v1", "configmaps", NAMESPACE, "kube-client")
    try:
        assert kube.get(path) is None
        created = kube.create(configmap("kube-client", {"a": "1", "b": "2"}))
        assert created["metadata"]["uid"] and created["data"] == {"a": "1", "b": "2"}
        with pytest.raises(ApiError) as e:
            kube.create(configmap("kube-client", {}))
        assert (e.value.status, e.value.reason) == (409, "AlreadyExists")
        patched = kube.patch(path, {"data": {"b": None, "c": "3"}})
        assert patched["data"] == {"a": "1", "c": "3"}
        assert kube.delete(path) is True
        assert kube.delete(path) is False
        with pytest.raises(ApiError) as e:
            kube.request("GET", path)
        assert e.value.status == 404 and "kube-client" in e.value.message
    finally:
        kube.close()
    assert ("kvpilot-test", "create", f"/api/v1/namespaces/{NAMESPACE}/configmaps") in [
        (e["userAgent"], e["verb"], e["requestURI"].split("?")[0]) for e in cluster.requests()]


def test_async_client_runs_the_same_calls_off_the_event_loop(cluster):
    async def run() -> tuple:
        kube = AsyncKubeClient.from_environment(str(cluster.kubeconfig))
        try:
            await kube.create(configmap("kube-client-async", {"x": "1"}))
            got = await kube.get(object_path("v1", "configmaps", NAMESPACE, "kube-client-async"))
            gone = await kube.delete(object_path("v1", "configmaps", NAMESPACE, "kube-client-async"))
            served = await kube.has_resource("apps", "v1", "deployments")
            missing = await kube.has_resource("monitoring.example.com", "v1", "widgets")
            return got["data"], gone, served, missing
        finally:
            await kube.close()

    assert asyncio.run(run()) == ({"x": "1"}, True, True, False)


def test_an_own_executor_keeps_calls_out_of_the_reconcilers_queue():
    """The leader's Lease client runs on its own thread: with the reconcilers' client busy
    (every one of its threads blocked, more calls queued, as under 1,000 reconciles), its call
    still returns at once; a call on the busy client waits its turn."""
    import concurrent.futures
    import threading
    import time

    release = threading.Event()

    class Blocking:
        def get(self, path: str) -> str:
            if path == "slow":
                release.wait(10)
            return threading.current_thread().name

    async def main() -> tuple[str, float, bool]:
        busy = AsyncKubeClient(Blocking())
        queued = [asyncio.create_task(busy.get("slow")) for _ in range(WORKERS + 8)]  # more than its threads
        await asyncio.sleep(0.1)
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lease") as own:
            start = time.monotonic()
            name = await AsyncKubeClient(Blocking(), own).get("lease")
            took = time.monotonic() - start
        behind = asyncio.create_task(busy.get("fast"))
        await asyncio.sleep(0.2)
        waiting = not behind.done()
        release.set()
        await asyncio.gather(*queued, behind)
        return name, took, waiting

    name, took, waiting = asyncio.run(main())
    assert name.startswith("lease") and took < 1.0
    assert waiting


def test_the_reconcilers_client_runs_its_workers_calls_at_once_not_the_default_executors_few():
    """Issue 42: asyncio's default executor ran 6 calls at a time on 2 cores and 1,000
    reconciles queued behind each other; the client's own pool runs WORKERS blocking calls
    together (each waits on the API server, not on the CPU), whatever the core count."""
    import threading

    started, release = threading.Semaphore(0), threading.Event()

    class Blocking:
        def get(self, path: str) -> str:
            started.release()
            release.wait(10)
            return path

    async def main() -> int:
        kube = AsyncKubeClient(Blocking())
        calls = [asyncio.create_task(kube.get(str(i))) for i in range(WORKERS)]
        await asyncio.sleep(0.3)
        running = sum(started.acquire(blocking=False) for _ in range(WORKERS))
        release.set()
        await asyncio.gather(*calls)
        kube.executor.shutdown()
        return running

    assert WORKERS >= 16 and asyncio.run(main()) == WORKERS
