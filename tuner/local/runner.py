"""`LocalRunner`: runs trials on a local engine process.

Per trial: apply the settings (live through the admin endpoint when only scheduler limits
change, else restart the server with the new flags), confirm through
`vllm:cache_config_info` and `kvpilot:engine_config_info` that the engine runs them, send
warm-up requests, wait until the engine is idle (no running or waiting requests), open the measurement window, drive the
workload, close the window. The result joins the client's per-request view (goodput,
failures) with the server's metrics (p95s from the histograms, preemptions), which the
SLO constraints are judged on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable


from kvpilot.tuner.search.capacity import find_capacity
from kvpilot.tuner.local.engine_process import EngineProcess
from kvpilot.tuner.failures import TrialFailed
from kvpilot.tuner.search.objective import SLO, Measurement
from kvpilot.tuner.search.settings import EngineSettings
from kvpilot.tuner.measure.trial_window import Source, WindowMeasurer
from kvpilot.tuner.measure.workload import Load, Workload

logger = logging.getLogger("kvpilot.tuner")



class LocalRunner:
    """engine: the process to (re)start; load: the requests (warm-up first), or a function
    that builds them once the engine answers (`WindowMeasurer`), or None to observe the
    live traffic others send for `live_seconds` per trial; source_for:
    builds the measurement source for the running engine's URL (default: ScrapeSource);
    live: apply scheduler-only changes without a restart; capacity: (low, high, steps) to
    measure each trial's capacity (`find_capacity`) instead of one window."""

    def __init__(self, engine: EngineProcess, workload: Workload, load: Load | Callable[[], Load] | None, slo: SLO,
                 model_name: str, source_for: Callable[[str], Source] | None = None, live: bool = True,
                 idle_timeout_s: float = 120.0, capacity: tuple[float, float, int] | None = None,
                 live_seconds: float = 0.0):
        self.engine = engine
        self.slo, self.capacity = slo, capacity  # (low req/s, high req/s, bisection steps)
        self.measurer = WindowMeasurer(workload, load, slo, model_name, source_for, idle_timeout_s,
                                       confirm_timeout_s=30.0 if load is None else 0.0, live_seconds=live_seconds)
        self.live = live
        self.applied: list[str] = []  # per trial: 'live', 'restart' or 'unchanged'

    def apply(self, settings: EngineSettings) -> str:
        """Brings the engine to `settings`; returns how ('unchanged', 'live', 'restart')."""
        if self.engine.running and self.engine.settings is not None and self.live:
            changes = self.engine.settings.live_changes(settings)
            if changes == {}:
                return "unchanged"
            if changes is not None and self.engine.apply_live(changes):
                return "live"
        self.engine.start(settings)
        return "restart"

    def run_trial(self, number: int, settings: EngineSettings) -> Measurement:
        """Runner.run_trial: applies `settings` (live or by restart), then measures one window (or the
        capacity, in req/s, by bisection). Raises TrialFailed (classified; with the engine's log tail
        when the engine died) and TrialCutShort from a live-traffic window."""
        how = self.apply(settings)
        self.applied.append(how)
        try:
            if self.capacity:
                low, high, steps = self.capacity
                m = find_capacity(lambda rate: self.measurer.measure(self.engine.base_url, self.engine.headers,
                                                                     settings, request_rate=rate),
                                  self.slo, low, high, steps)
            else:
                m = self.measurer.measure(self.engine.base_url, self.engine.headers, settings)
        except TrialFailed as e:
            if not self.engine.running:
                self.engine.stop()
                raise TrialFailed(e.kind, f"{e.message}; engine log: {self.engine.log_tail(1500)}") from e
            raise
        m.extra.update(applied=how)
        logger.info("trial %d (%s, %s): goodput %.3f req/s, p95 ttft %.0f ms, itl %.0f ms, %d preemptions",
                    number, settings.describe(), how, m.goodput_rps, m.ttft_p95_s * 1000, m.itl_p95_s * 1000,
                    m.preemptions)
        return m

    def close(self) -> None:
        """Stops the engine process."""
        self.engine.stop()
