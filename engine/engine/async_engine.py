"""The engine loop behind the server: `LLMEngine.step()` runs on one background thread;
request handlers on the asyncio event loop talk to it only through a command queue (add,
abort, config changes) and get their outputs through per-request asyncio queues, so a
step never blocks the event loop and the engine is only ever touched by its own thread.

    event loop                          engine thread
    generate() ── add ──> commands ──>  drain commands, step(), metrics
    RequestStream.queue <── call_soon_threadsafe(outputs of the step)

A request that fails on its own (finish_reason "error", `LLMEngine`) raises RequestError in
its stream only. An exception out of `step()` leaves the engine's shared state unknown: the
loop stops, every stream raises EngineDeadError and `on_dead(exc)` is called on the event
loop (the server exits then, as vLLM's does on EngineDeadError). So does a rank of a
multi-process engine found gone between steps (`LLMEngine.check_health`, at least every
0.5 s while idle).
Source: vLLM `AsyncLLMEngine` (v0) / `AsyncLLM` output handler (v1)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvpilot.engine.config import SchedulerConfig
from kvpilot.engine.engine.engine_thread import EngineThread
from kvpilot.engine.metrics.engine_metrics import EngineMetrics
from kvpilot.engine.metrics.loggers import SchedulerState, StatLoggerBase, StatLoggerManager
from kvpilot.engine.engine.llm_engine import LLMEngine
from kvpilot.engine.outputs import RequestError, RequestOutput
from kvpilot.engine.sampling_params import SamplingParams

logger = logging.getLogger("kvpilot.engine.async")

_IDLE_POLL_S = 0.5


class RequestAborted(Exception):
    """The request was aborted (client gone, drain grace period over) before it finished."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an error; no request can be served."""


class RequestStream:
    """The event-loop side of one request: outputs, then None or an exception."""

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False


class AsyncLLMEngine:
    """`metrics` (the vllm:* series) and, unless `log_stats` is off, the throughput line
    every `stats_interval_s` are fed by stat loggers (`metrics/loggers.py`); pass
    `stat_loggers` to choose them yourself."""

    def __init__(self, engine: LLMEngine, metrics: EngineMetrics | None = None, *, log_stats: bool = True,
                 stats_interval_s: float = 10.0, stat_loggers: StatLoggerBase | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.stat_loggers = (StatLoggerManager.for_server(metrics, log_stats, stats_interval_s)
                             if stat_loggers is None else stat_loggers)
        self.state = SchedulerState(num_free_blocks=engine.block_manager.num_free_blocks)
        self.errored: BaseException | None = None
        self.on_dead: Callable[[BaseException], None] | None = None  # called on the event loop
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._pending_adds = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._job: concurrent.futures.Future | None = None
        self._profiler = None

    # ------------------------------------------------------------ lifecycle
    def start(self, loop: asyncio.AbstractEventLoop, thread: EngineThread | None = None) -> None:
        """Runs the engine loop on `thread` (the thread that built the engine: one OpenMP
        team, engine_thread.py) or on a new one."""
        self._loop = loop
        self._job = (thread or EngineThread()).submit(self._run)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stops the engine loop after its current step; waits up to timeout_s (seconds) for it."""
        self._stop.set()
        self._commands.put(lambda: None)
        if self._job is not None:
            concurrent.futures.wait([self._job], timeout_s)

    @property
    def is_running(self) -> bool:
        """True while the loop runs: started, not ended, and no step has failed (`errored`)."""
        return self._job is not None and not self._job.done() and self.errored is None

    @property
    def num_waiting(self) -> int:
        """Requests queued in the scheduler plus those not yet handed to it."""
        with self._lock:
            return self.state.num_waiting + self._pending_adds

    # ---------------------------------------------------------- event loop API
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       arrival_s: float | None = None) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs; the last one has `finished` set. Raises ValueError
        when the engine refuses the request, RequestError when it failed on its own,
        RequestAborted when it is aborted, and EngineDeadError when the engine loop failed.
        Leaving early aborts the request."""
        if self.errored is not None:
            raise EngineDeadError(f"the engine loop failed: {self.errored}")
        stream = RequestStream(request_id, params)
        arrival = time.monotonic() if arrival_s is None else arrival_s
        with self._lock:
            self._pending_adds += 1
        self._commands.put(lambda: self._add(stream, prompt_token_ids, arrival))
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    stream.finished = True
                    raise item
                if item.finished:
                    stream.finished = True
                yield item
                if stream.finished:
                    return
        finally:
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """Aborts a request from any thread; its KV blocks are freed before the next step. Its
        stream (if still open) raises RequestAborted with `reason`."""
        self._commands.put(lambda: self._abort(request_id, reason))

    async def abort_all(self, reason: str) -> int:
        """Aborts every request in the engine; their streams raise RequestAborted(reason).
        Returns how many there were."""

        def abort_all(_: LLMEngine) -> int:
            request_ids = list(self._streams)
            for request_id in request_ids:
                self._abort(request_id, reason)
            return len(request_ids)

        return await self.run_on_engine(abort_all)

    async def run_on_engine(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Runs fn(engine) on the engine thread between steps; returns or raises its result."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        future: concurrent.futures.Future = concurrent.futures.Future()

        def call() -> None:
            try:
                future.set_result(fn(self.engine))
            except BaseException as exc:  # handed to the awaiting handler
                future.set_exception(exc)

        self._commands.put(call)
        return await asyncio.wrap_future(future)

    async def update_scheduler_config(self, **changes) -> SchedulerConfig:
        """Live change of scheduler limits between steps; ValueError (nothing changed) when
        invalid. Updates `vllm:cache_config_info` to the new values."""

        def apply(engine: LLMEngine) -> SchedulerConfig:
            new = engine.update_scheduler_config(**changes)
            if self.metrics is not None:
                self.metrics.set_config(engine.config)
            logger.info("scheduler config changed: %s", changes)
            return new

        return await self.run_on_engine(apply)

    async def start_profile(self, trace_dir: str) -> None:
        """Starts a torch.profiler trace (CPU, and CUDA when present) into trace_dir.
        Raises ValueError when one already runs."""
        def start(_: LLMEngine) -> None:
            import torch

            if self._profiler is not None:
                raise ValueError("the profiler is already running")
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(
                activities=activities, record_shapes=True, with_stack=True,
                on_trace_ready=torch.profiler.tensorboard_trace_handler(trace_dir, use_gzip=False))
            self._profiler.start()

        await self.run_on_engine(start)

    async def stop_profile(self) -> None:
        """Stops the trace, written in TensorBoard format. Raises ValueError when none runs."""
        def stop(_: LLMEngine) -> None:
            if self._profiler is None:
                raise ValueError("the profiler is not running; POST /start_profile first")
            profiler, self._profiler = self._profiler, None
            profiler.stop()

        await self.run_on_engine(stop)

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands(block=not self.engine.has_unfinished_requests())
                self.engine.check_health()  # a rank gone while idle ends the loop as a failed step would
                if self._stop.is_set():
                    break
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._dispatch(outputs)
                self._publish_state()
                self.stat_loggers.log(time.monotonic())
        except BaseException as exc:
            logger.exception("the engine loop failed; failing every request")
            self.errored = exc
            self._fail_all(EngineDeadError(f"the engine loop failed: {type(exc).__name__}: {exc}"))
            if self.on_dead is not None and self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self.on_dead, exc)

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            command()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, stream: RequestStream, prompt_token_ids: list[int], arrival_s: float) -> None:
        try:
            self.engine.add_request(stream.request_id, prompt_token_ids, stream.params, arrival_s=arrival_s)
        except Exception as exc:  # ValueError (bad input) or RequestError: nothing of it is in the engine
            with self._lock:
                self._pending_adds -= 1
            self._deliver_threadsafe([(stream, exc)])
            return
        with self._lock:  # from pending to waiting in one step: num_waiting never misses it
            self._pending_adds -= 1
            self.state.num_waiting += 1
        self._streams[stream.request_id] = stream

    def _abort(self, request_id: str, reason: str = "aborted") -> None:
        stream = self._streams.pop(request_id, None)
        if self.engine.abort_request(request_id):
            self.stat_loggers.record_aborted(request_id)
        if stream is not None:
            self._deliver_threadsafe([(stream, RequestAborted(f"request {request_id} was {reason}"))])

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        self.stat_loggers.record_step(self.engine.last_step, outputs, time.monotonic())
        batch = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
                self.stat_loggers.record_finished(out, stream.params.max_tokens if stream else None)
            if stream is not None:
                failed = out.finished and out.error is not None
                batch.append((stream, RequestError(f"request {out.request_id} failed: {out.error}")
                              if failed else out))
        if batch:
            self._deliver_threadsafe(batch)

    def _deliver_threadsafe(self, batch: list[tuple[RequestStream, Any]]) -> None:
        def deliver() -> None:
            for stream, item in batch:
                stream.queue.put_nowait(item)

        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(deliver)

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = list(self._streams.values()), {}
        self._deliver_threadsafe([(s, exc) for s in streams])

    def _publish_state(self) -> None:
        sched, bm = self.engine.scheduler, self.engine.block_manager
        state = SchedulerState(len(sched.running), len(sched.waiting), len(sched.swapped), bm.usage,
                               bm.num_free_blocks, bm.prefix_queries, bm.prefix_hits)
        with self._lock:
            self.state = state
        self.stat_loggers.record_scheduler_state(state)
