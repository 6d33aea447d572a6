"""The engine's own thread (engine/engine/engine_thread.py): the server builds the
engine and runs its loop on one OS thread, so torch's OpenMP keeps one thread team (two
teams on a 2-core machine throttle libgomp's spin-wait and slow every decode step)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from kvpilot.engine.engine.async_engine import AsyncLLMEngine
from kvpilot.engine.engine.engine_thread import EngineThread
from kvpilot.engine.metrics.loggers import StatLoggerManager


def test_jobs_run_in_order_on_the_one_thread_with_results_and_exceptions():
    thread = EngineThread(name="engine-test")
    seen = []
    first = thread.submit(lambda: seen.append(threading.current_thread()) or 1)
    failing = thread.submit(lambda: 1 / 0)
    last = thread.submit(lambda x: seen.append(threading.current_thread()) or x * 2, 21)
    assert (first.result(5), last.result(5)) == (1, 42)
    with pytest.raises(ZeroDivisionError):
        failing.result(5)
    assert seen == [thread, thread] and thread.daemon and thread.name == "engine-test"


def _idle_engine():
    """What the engine loop reads between steps, for an engine with nothing to do."""
    scheduler = SimpleNamespace(running=[], waiting=[], swapped=[])
    block_manager = SimpleNamespace(usage=0.0, num_free_blocks=8, prefix_queries=0, prefix_hits=0)
    return SimpleNamespace(scheduler=scheduler, block_manager=block_manager, has_unfinished_requests=lambda: False,
                           check_health=lambda: None)


def test_the_engine_loop_runs_on_the_thread_that_built_the_engine():
    async def scenario():
        thread = EngineThread()
        engine = await asyncio.wrap_future(thread.submit(_idle_engine))  # "built" on `thread`
        loop_engine = AsyncLLMEngine(engine, stat_loggers=StatLoggerManager([]))
        loop_engine.start(asyncio.get_running_loop(), thread)
        assert loop_engine.is_running
        ran_on = await loop_engine.run_on_engine(lambda _: threading.current_thread())
        loop_engine.shutdown(5)
        return thread, ran_on, loop_engine.is_running

    thread, ran_on, running_after = asyncio.run(scenario())
    assert ran_on is thread
    assert not running_after
