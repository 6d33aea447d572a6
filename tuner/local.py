"""`LocalRunner`: runs trials on a local engine process.

Per trial: apply the settings (live through the admin endpoint when only scheduler limits
change, else restart the server with the new flags), confirm through
`vllm:cache_config_info` that the engine runs them, send warm-up requests, wait until the
engine is idle (no running or waiting requests), open the measurement window, drive the
workload, close the window. The result joins the client's per-request view (goodput,
failures) with the server's metrics (p95s from the histograms, preemptions), which the
SLO constraints are judged on.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Protocol

import httpx

from kvpilot.tuner.engine_process import EngineProcess
from kvpilot.tuner.failures import TRANSIENT, TrialFailed
from kvpilot.tuner.objective import SLO, Measurement
from kvpilot.tuner.scrape import ScrapeSource
from kvpilot.tuner.settings import EngineSettings
from kvpilot.tuner.window import Snapshot, config_mismatches
from kvpilot.tuner.workload import Load, Workload, client_measurement, drive

logger = logging.getLogger("kvpilot.tuner")


class Source(Protocol):
    name: str

    def begin(self) -> Snapshot: ...

    def measure(self, start: Snapshot, slo: SLO) -> Measurement: ...


def combine(client: Measurement, server: Measurement) -> Measurement:
    """The trial's measurement: counts, throughput and goodput from the client (it knows
    each request), p95s and preemptions from the server's metrics (the client's p95s
    stand in where the server had no samples). Rates are over the load's duration."""
    def pick(a: float, b: float) -> float:
        return a if not math.isnan(a) else b

    return Measurement(
        duration_s=client.duration_s, completed=client.completed, failed=client.failed,
        throughput_rps=client.throughput_rps, goodput_rps=client.goodput_rps,
        output_tokens_per_s=client.output_tokens_per_s,
        ttft_p95_s=pick(server.ttft_p95_s, client.ttft_p95_s), itl_p95_s=pick(server.itl_p95_s, client.itl_p95_s),
        tpot_p95_s=pick(server.tpot_p95_s, client.tpot_p95_s), e2e_p95_s=pick(server.e2e_p95_s, client.e2e_p95_s),
        preemptions=server.preemptions, source=server.source,
        extra={"client": client.as_dict(), "server": server.as_dict()},
    )


class LocalRunner:
    """engine: the process to (re)start; load: the requests (warm-up first); source_for:
    builds the measurement source for the running engine (default: ScrapeSource);
    live: apply scheduler-only changes without a restart."""

    def __init__(self, engine: EngineProcess, workload: Workload, load: Load, slo: SLO, model_name: str,
                 source_for: Callable[[EngineProcess], Source] | None = None, live: bool = True,
                 idle_timeout_s: float = 120.0):
        self.engine, self.workload, self.load, self.slo = engine, workload, load, slo
        self.model_name = model_name
        self.source_for = source_for or (lambda e: ScrapeSource(e.base_url, {"model_name": model_name}))
        self.live = live
        self.idle_timeout_s = idle_timeout_s
        self.applied: list[str] = []  # per trial: 'live', 'restart' or 'unchanged'

    def scrape(self) -> ScrapeSource:
        return ScrapeSource(self.engine.base_url, {"model_name": self.model_name})

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

    def confirm(self, settings: EngineSettings) -> dict[str, str]:
        """The engine's reported config (`vllm:cache_config_info` labels). Raises
        TrialFailed(transient) when it does not show the trial's settings."""
        info = self.scrape().snapshot().config_info
        wrong = config_mismatches(info, settings.as_dict())
        if wrong:
            raise TrialFailed(TRANSIENT, f"the engine reports other settings than the trial's: {wrong}")
        return info

    def wait_idle(self) -> None:
        """Blocks until no request is running or waiting (measurement hygiene)."""
        deadline = time.monotonic() + self.idle_timeout_s
        while time.monotonic() < deadline:
            if self.scrape().snapshot().in_flight == 0:
                return
            time.sleep(0.2)
        raise TrialFailed(TRANSIENT, f"the engine did not become idle within {self.idle_timeout_s} s")

    def run_trial(self, number: int, settings: EngineSettings) -> Measurement:
        try:
            how = self.apply(settings)
            self.applied.append(how)
            info = self.confirm(settings)
            warm = self.workload.warmup_requests
            requests, offsets = self.load.requests, self.load.offsets
            if warm:
                results, _ = drive(requests[:warm], self.workload, self.engine.base_url, self.model_name,
                                   self.engine.headers, offsets=[0.0] * warm if offsets else None)
                if not any(r.success for r in results):
                    raise TrialFailed(TRANSIENT, f"warm-up requests failed: {results[0].error[:500]}")
            self.wait_idle()
            source = self.source_for(self.engine)
            start = source.begin()
            results, duration = drive(requests[warm:], self.workload, self.engine.base_url, self.model_name,
                                      self.engine.headers, offsets=offsets[warm:] if offsets else None)
            self.wait_idle()  # the last request's metrics are recorded after its stream ends
            server = source.measure(start, self.slo)
        except httpx.HTTPError as e:
            tail = self.engine.log_tail(1500)
            if not self.engine.running:
                self.engine.stop()
            raise TrialFailed(TRANSIENT, f"engine unreachable during the trial: {e!r}; log: {tail}") from e
        m = combine(client_measurement(results, duration, self.slo), server)
        m.extra.update(applied=how, reported_config=info)
        logger.info("trial %d (%s, %s): goodput %.3f req/s, p95 ttft %.0f ms, itl %.0f ms, %d preemptions",
                    number, settings.describe(), how, m.goodput_rps, m.ttft_p95_s * 1000, m.itl_p95_s * 1000,
                    m.preemptions)
        return m

    def close(self) -> None:
        self.engine.stop()
