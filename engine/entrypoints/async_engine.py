"""The engine loop behind the server: `LLMEngine.step()` runs on one background thread;
request handlers on the asyncio event loop talk to it only through a command queue (add,
abort, config changes) and get their outputs through per-request asyncio queues, so a
step never blocks the event loop and the engine is only ever touched by its own thread.

    event loop                          engine thread
    generate() ── add ──> commands ──>  drain commands, step(), metrics
    RequestStream.queue <── call_soon_threadsafe(outputs of the step)
Source: vLLM `AsyncLLMEngine` (v0) / `AsyncLLM` output handler (v1)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from kvpilot.engine.config import SchedulerConfig
from kvpilot.engine.entrypoints.metrics import EngineMetrics
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.sampling_params import SamplingParams

logger = logging.getLogger("kvpilot.engine.async")

_IDLE_POLL_S = 0.5


class RequestAborted(Exception):
    """The request was aborted (client gone, drain grace period over) before it finished."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an error; no request can be served."""


@dataclass
class SchedulerState:
    """What the scheduler held after the last step, published for the API thread."""

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = 0


class RequestStream:
    """The event-loop side of one request: outputs, then None or an exception."""

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, metrics: EngineMetrics | None = None, *, log_stats: bool = True,
                 stats_interval_s: float = 10.0) -> None:
        self.engine = engine
        self.metrics = metrics
        self.log_stats = log_stats
        self.stats_interval_s = stats_interval_s
        self.state = SchedulerState(num_free_blocks=engine.block_manager.num_free_blocks)
        self.errored: BaseException | None = None
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._pending_adds = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._profiler = None
        self._interval_start = time.monotonic()
        self._interval_tokens = [0, 0]  # prompt, generation
        self._last_logged_busy = False

    # ------------------------------------------------------------ lifecycle
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(lambda: None)
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.errored is None

    @property
    def num_waiting(self) -> int:
        """Requests queued in the scheduler plus those not yet handed to it."""
        with self._lock:
            return self.state.num_waiting + self._pending_adds

    # ---------------------------------------------------------- event loop API
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       arrival_s: float | None = None) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs; the last one has `finished` set. Raises ValueError
        when the engine refuses the request, RequestAborted when it is aborted, and
        EngineDeadError when the engine loop failed. Leaving early aborts the request."""
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
                if self._stop.is_set():
                    break
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._dispatch(outputs)
                self._publish_state()
                self._maybe_log_stats()
        except BaseException as exc:
            logger.exception("the engine loop failed; failing every request")
            self.errored = exc
            self._fail_all(EngineDeadError(f"the engine loop failed: {exc}"))

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
        except ValueError as exc:
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
        if self.engine.abort_request(request_id) and self.metrics is not None:
            self.metrics.record_aborted(request_id)
        if stream is not None:
            self._deliver_threadsafe([(stream, RequestAborted(f"request {request_id} was {reason}"))])

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        step = self.engine.last_step
        now = time.monotonic()
        if self.metrics is not None and step is not None:
            self.metrics.record_step(step, outputs, now)
        batch = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
                if self.metrics is not None:
                    self.metrics.record_finished(out, stream.params.max_tokens if stream else None)
            if out.metrics is not None and out.metrics.first_token_s == out.metrics.last_token_s:
                self._interval_tokens[0] += len(out.prompt_token_ids)
            self._interval_tokens[1] += len(out.new_token_ids)
            if stream is not None:
                batch.append((stream, out))
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
                               bm.num_free_blocks)
        with self._lock:
            self.state = state
        if self.metrics is not None:
            self.metrics.record_scheduler_state(state.num_running, state.num_waiting, state.num_swapped,
                                                state.kv_usage, bm.prefix_queries, bm.prefix_hits)

    def _maybe_log_stats(self) -> None:
        now = time.monotonic()
        elapsed = now - self._interval_start
        if elapsed < self.stats_interval_s:
            return
        prompt_tps, gen_tps = (n / elapsed for n in self._interval_tokens)
        self._interval_start, self._interval_tokens = now, [0, 0]
        busy = bool(prompt_tps or gen_tps or self.state.num_running or self.state.num_waiting)
        if self.log_stats and (busy or self._last_logged_busy):  # an idle server stays quiet
            bm = self.engine.block_manager
            hit_rate = bm.prefix_hits / bm.prefix_queries if bm.prefix_queries else 0.0
            logger.info(
                "Engine 000: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, Swapped: %d reqs, GPU KV cache usage: %.1f%%, "
                "Prefix cache hit rate: %.1f%%",
                prompt_tps, gen_tps, self.state.num_running, self.state.num_waiting, self.state.num_swapped,
                self.state.kv_usage * 100, hit_rate * 100,
            )
        self._last_logged_busy = busy
