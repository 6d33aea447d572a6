"""The one OS thread that builds the engine and then runs its loop (`AsyncLLMEngine`).

Why one thread for both: libgomp (torch's and oneDNN's OpenMP on CPU) keeps a thread team
per calling thread. Building the engine on one thread (its warm-up step runs parallel
regions there) and stepping it on another leaves two teams, more OpenMP threads than a
small machine has cores, and libgomp then cuts its spin-wait to 1,000 spins (its
GOMP_SPINCOUNT rule when OMP_WAIT_POLICY is unset), so every parallel region pays a futex
wake-up: one float32 decode step took 59-66 ms instead of 40-56 ms on a 2-core AVX2 EPYC
(section 10 of the throughput notebook, `git show
bbe6366:benchmarks/results/throughput/README.md`). A daemon thread, so a server that
exits without a clean shutdown is not held open by it.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any


class EngineThread(threading.Thread):
    """A daemon thread that runs submitted callables one after another, in order."""

    def __init__(self, name: str = "engine-loop") -> None:
        super().__init__(name=name, daemon=True)
        self._jobs: queue.SimpleQueue[tuple[concurrent.futures.Future, Callable[..., Any], tuple]] = \
            queue.SimpleQueue()
        self.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Queues fn(*args) for this thread; the future holds its result or exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, fn, args))
        return future

    def run(self) -> None:
        """Thread body: runs queued jobs forever, each into its future (result or exception)."""
        while True:
            future, fn, args = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)
