"""Runs the emulated cluster (API server + controllers) on a background thread with its own
event loop, so tests, `kubectl` and a `kopf run` subprocess can all talk to it over HTTP."""
from __future__ import annotations

import asyncio
import concurrent.futures
import pathlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import kmock
import yaml

from .apiserver import ApiServer
from .controllers import Controllers
from .store import Store

T = TypeVar("T")


class TestCluster:
    """`with TestCluster() as cluster:` serves http://127.0.0.1:<port>; `cluster.kubeconfig`
    is a kubeconfig file for it; `cluster.call(fn)` runs fn(store) on the cluster's loop."""

    __test__ = False  # not a pytest test class

    def __init__(self, workdir: pathlib.Path, pod_ready_seconds: float = 0.2):
        self.workdir = pathlib.Path(workdir)
        self.pod_ready_seconds = pod_ready_seconds
        self.server: ApiServer | None = None
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-cluster", daemon=True)
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def store(self) -> Store:
        assert self.server is not None
        return self.server.store

    def __enter__(self) -> "TestCluster":
        self._thread.start()
        if not self._ready.wait(30) or self._error:
            raise RuntimeError(f"the test cluster did not start: {self._error!r}")
        self.kubeconfig = self.workdir / "kubeconfig"
        self.kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.url}}],
            "users": [{"name": "test", "user": {"token": "test-token"}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test", "namespace": "default"}}],
        }))
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:  # noqa: BLE001  (reported to the starting thread)
            self._error = e
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.server = ApiServer()
        controllers = Controllers(self.server.store, self.pod_ready_seconds)
        async with self.server, kmock.Server(self.server) as http:
            self.port = http.port
            task = asyncio.create_task(controllers.run())
            self._ready.set()
            await self._stop.wait()
            task.cancel()

    def call(self, fn: Callable[[Store], T], timeout: float = 10) -> T:
        """Run fn(store) on the cluster's loop (the store is not thread-safe) and return its result."""
        assert self._loop is not None

        async def run() -> T:
            return fn(self.store)
        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(run(), self._loop)
        return future.result(timeout)

    def objects(self, group: str, version: str, plural: str, namespace: str | None = "default",
                labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """A list of objects, read straight from the store."""
        def read(store: Store) -> list[dict[str, Any]]:
            rtype = store.type_of(group, version, plural)
            assert rtype is not None, f"unknown resource {group}/{version}/{plural}"
            wanted = labels or {}
            items, _ = store.list(rtype, namespace, lambda o: all(
                (o["metadata"].get("labels") or {}).get(k) == v for k, v in wanted.items()))
            return items
        return self.call(read)
