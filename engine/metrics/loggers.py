"""What the engine loop reports after each step, and to whom: the periodic throughput log
line and the Prometheus metrics. The loop hands each step's stats to a `StatLoggerManager`
and knows nothing of either; a logger records on the engine thread and may only read what
it is given. Source: vLLM v1 `vllm/v1/metrics/loggers.py` (`StatLoggerBase`,
`LoggingStatLogger`, `PrometheusStatLogger`, `StatLoggerManager`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvpilot.engine.metrics.engine_metrics import EngineMetrics
from kvpilot.engine.outputs import RequestOutput

logger = logging.getLogger("kvpilot.engine.async")


@dataclass
class SchedulerState:
    """What the scheduler held after the last step, published for the API thread. Prefix
    counts are cumulative since the engine started."""

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0


class StatLoggerBase:
    """One consumer of the engine loop's stats. Every hook is optional."""

    def record_step(self, step, outputs: list[RequestOutput], now_s: float) -> None:
        """After a step: its `StepStats` (None when the engine kept none) and its outputs."""

    def record_finished(self, out: RequestOutput, max_tokens: int | None) -> None:
        """An engine request finished (its final output, its max_tokens)."""

    def record_aborted(self, request_id: str) -> None:
        """An engine request was aborted before it finished."""

    def record_scheduler_state(self, state: SchedulerState) -> None:
        """After every loop turn, with or without a step."""

    def log(self, now_s: float) -> None:
        """Called after every loop turn; a logger decides itself when to write."""


class LoggingStatLogger(StatLoggerBase):
    """Every `interval_s`, vLLM's line "Engine 000: Avg prompt throughput: ... tokens/s, Avg
    generation throughput: ..., Running: ..., GPU KV cache usage: ...%, Prefix cache hit
    rate: ...%". An idle server stays quiet after one line saying it went idle."""

    def __init__(self, interval_s: float = 10.0, now_s: float | None = None) -> None:
        self.interval_s = interval_s
        self._interval_start_s = time.monotonic() if now_s is None else now_s
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._state = SchedulerState()
        self._last_logged_busy = False

    def record_step(self, step, outputs: list[RequestOutput], now_s: float) -> None:
        """Adds the step's tokens: each request's prompt at its first token, and every new token."""
        for out in outputs:
            if out.metrics is not None and out.metrics.first_token_s == out.metrics.last_token_s:
                self._num_prompt_tokens += len(out.prompt_token_ids)  # once, at the first token
            self._num_generation_tokens += len(out.new_token_ids)

    def record_scheduler_state(self, state: SchedulerState) -> None:
        """Keeps the latest state for the next line."""
        self._state = state

    def log(self, now_s: float) -> None:
        """Writes the throughput line (tokens/s over the interval) once interval_s (seconds) has
        passed; the first idle interval after a busy one is logged, later idle ones are not."""
        elapsed_s = now_s - self._interval_start_s
        if elapsed_s < self.interval_s:
            return
        prompt_tps = self._num_prompt_tokens / elapsed_s
        gen_tps = self._num_generation_tokens / elapsed_s
        self._interval_start_s, self._num_prompt_tokens, self._num_generation_tokens = now_s, 0, 0
        s = self._state
        busy = bool(prompt_tps or gen_tps or s.num_running or s.num_waiting)
        if busy or self._last_logged_busy:
            hit_rate = s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0
            logger.info(
                "Engine 000: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, Swapped: %d reqs, GPU KV cache usage: %.1f%%, "
                "Prefix cache hit rate: %.1f%%",
                prompt_tps, gen_tps, s.num_running, s.num_waiting, s.num_swapped, s.kv_usage * 100,
                hit_rate * 100,
            )
        self._last_logged_busy = busy


class PrometheusStatLogger(StatLoggerBase):
    """Feeds `EngineMetrics` (the vllm:* series served on /metrics)."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self.metrics = metrics

    def record_step(self, step, outputs: list[RequestOutput], now_s: float) -> None:
        """Passes the step's stats and outputs to EngineMetrics.record_step (nothing when None)."""
        if step is not None:
            self.metrics.record_step(step, outputs, now_s)

    def record_finished(self, out: RequestOutput, max_tokens: int | None) -> None:
        """Passes a finished request to EngineMetrics.record_finished."""
        self.metrics.record_finished(out, max_tokens)

    def record_aborted(self, request_id: str) -> None:
        """Passes an aborted request to EngineMetrics.record_aborted."""
        self.metrics.record_aborted(request_id)

    def record_scheduler_state(self, state: SchedulerState) -> None:
        """Sets the scheduler gauges and prefix-cache counters from the state."""
        self.metrics.record_scheduler_state(state.num_running, state.num_waiting, state.num_swapped,
                                            state.kv_usage, state.prefix_queries, state.prefix_hits)


class StatLoggerManager(StatLoggerBase):
    """Hands every hook to each logger in turn."""

    def __init__(self, loggers: list[StatLoggerBase]) -> None:
        self.loggers = loggers

    @classmethod
    def for_server(cls, metrics: EngineMetrics | None, log_stats: bool, interval_s: float) -> StatLoggerManager:
        """The server's loggers: Prometheus when it has metrics, the log line unless
        --disable-log-stats."""
        loggers: list[StatLoggerBase] = []
        if log_stats:
            loggers.append(LoggingStatLogger(interval_s))
        if metrics is not None:
            loggers.append(PrometheusStatLogger(metrics))
        return cls(loggers)

    def record_step(self, step, outputs: list[RequestOutput], now_s: float) -> None:
        """Hands the step to each logger."""
        for stat_logger in self.loggers:
            stat_logger.record_step(step, outputs, now_s)

    def record_finished(self, out: RequestOutput, max_tokens: int | None) -> None:
        """Hands the finished request to each logger."""
        for stat_logger in self.loggers:
            stat_logger.record_finished(out, max_tokens)

    def record_aborted(self, request_id: str) -> None:
        """Hands the aborted request to each logger."""
        for stat_logger in self.loggers:
            stat_logger.record_aborted(request_id)

    def record_scheduler_state(self, state: SchedulerState) -> None:
        """Hands the scheduler state to each logger."""
        for stat_logger in self.loggers:
            stat_logger.record_scheduler_state(state)

    def log(self, now_s: float) -> None:
        """Lets each logger write if its interval has passed."""
        for stat_logger in self.loggers:
            stat_logger.log(now_s)
