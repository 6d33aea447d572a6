"""One trial's measurement window, shared by the local and the cluster runner: drive the load
(or wait out the live traffic), read the measurement source at both ends, and join the
client's per-request view with the server's metrics (`combine`); a window that already
breaks an SLO beyond doubt is cut short (`TrialCutShort`, `clearly_violates`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import httpx

from kvpilot.loadgen.metrics import RequestResult
from kvpilot.tuner.failures import TRANSIENT, TrialCutShort, TrialFailed
from kvpilot.tuner.measure.scrape import ScrapeSource
from kvpilot.tuner.measure.window import EmptySeries, Snapshot, config_mismatches
from kvpilot.tuner.measure.workload import Load, Workload, client_measurement, drive
from kvpilot.tuner.search.objective import SLO, Measurement, violations
from kvpilot.tuner.search.settings import EngineSettings


logger = logging.getLogger("kvpilot.tuner")

ROUTE_WAIT_S = 30.0  # how long warm-up requests that cannot connect are sent again (LocalRunner.warm_up)


class Source(Protocol):
    """Where a window's server-side figures come from: ScrapeSource (the engine's /metrics) or
    PrometheusSource (PromQL over the same vLLM series). name: recorded as Measurement.source."""

    name: str

    def begin(self) -> Snapshot:
        """Opens a window: the counters and histograms at its start."""
        ...

    def measure(self, start: Snapshot, slo: SLO) -> Measurement:
        """The window from `start` to now, judged against `slo`."""
        ...


def combine(client: Measurement, server: Measurement) -> Measurement:
    """The trial's measurement: counts, throughput and goodput from the client (it knows
    each request), p95s and preemptions from the server's metrics (the client's p95s
    stand in where the server had no samples). Rates are over the load's duration."""
    def pick(a: float, b: float) -> float:
        return a if not math.isnan(a) else b

    return Measurement(
        duration_s=client.duration_s, completed=client.completed, failed=max(client.failed, server.failed),
        throughput_rps=client.throughput_rps, goodput_rps=client.goodput_rps,
        output_tokens_per_s=client.output_tokens_per_s,
        ttft_p95_s=pick(server.ttft_p95_s, client.ttft_p95_s), itl_p95_s=pick(server.itl_p95_s, client.itl_p95_s),
        tpot_p95_s=pick(server.tpot_p95_s, client.tpot_p95_s), e2e_p95_s=pick(server.e2e_p95_s, client.e2e_p95_s),
        preemptions=server.preemptions, source=server.source,
        extra={"client": client.as_dict(), "server": server.as_dict()},
    )


def clearly_violates(m: Measurement, slo: SLO, min_requests: int = 10, margin: float = 1.5) -> bool:
    """Whether a partial window already decides the trial: enough requests, and a p95
    over `margin` x its limit, or more preemptions than the whole window may have."""
    if m.completed < min_requests:
        return False
    limits = [(m.ttft_p95_s, slo.ttft_p95_ms), (m.itl_p95_s, slo.itl_p95_ms), (m.e2e_p95_s, slo.e2e_p95_ms)]
    if any(limit > 0 and not math.isnan(v) and v * 1000 > margin * limit for v, limit in limits):
        return True
    return m.preemptions_per_min > margin * slo.max_preemptions_per_min and m.preemptions > 0


@dataclass
class DrivenWindow:
    """One driven window as measured: every request's client-side result (TTFT, each
    inter-token gap, latency), the window's duration (s), the server's view of the same
    window (p95s from its histograms, preemptions) and the config the engine reported."""

    results: list[RequestResult]
    duration_s: float
    server: Measurement
    reported_config: dict[str, str]


class WindowMeasurer:
    """Measures one trial's window on an engine at base_url: confirm the config it reports,
    warm up, wait for idle, open the window, drive the load (or, for live traffic, just
    wait `live_seconds`), wait for idle, close the window. load: the requests, or a function
    called after the engine has answered that builds them (e.g. with the engine's /tokenize;
    cache it). source_for builds the measurement source for an engine URL (default:
    ScrapeSource of its /metrics)."""

    def __init__(self, workload: Workload, load: Load | Callable[[], Load] | None, slo: SLO, model_name: str,
                 source_for: Callable[[str], Source] | None = None, idle_timeout_s: float = 120.0,
                 confirm_timeout_s: float = 0.0, live_seconds: float = 0.0):
        self.workload, self.load, self.slo, self.model_name = workload, load, slo, model_name
        self.source_for = source_for or (lambda url: ScrapeSource(url, {"model_name": model_name}))
        self.idle_timeout_s, self.confirm_timeout_s, self.live_seconds = idle_timeout_s, confirm_timeout_s, live_seconds

    def scrape(self, base_url: str) -> ScrapeSource:
        """A direct /metrics reader for the engine at `base_url` (config check, idle wait: whatever the source)."""
        return ScrapeSource(base_url, {"model_name": self.model_name})

    def confirm(self, base_url: str, settings: EngineSettings) -> dict[str, str]:
        """The engine's reported config (the labels of `vllm:cache_config_info` and, from
        kvpilot, `kvpilot:engine_config_info`), polled up to
        confirm_timeout_s. Raises TrialFailed(transient) when it does not show `settings`."""
        deadline = time.monotonic() + self.confirm_timeout_s
        while True:
            try:
                info = self.scrape(base_url).snapshot().config_info
                wrong = config_mismatches(info, settings.as_dict())
                if not info:  # a server still loading its model serves no metrics yet
                    wrong = {"vllm:cache_config_info": ("the trial's settings", "not reported")}
            except (httpx.HTTPError, EmptySeries) as e:  # a pod still starting, or still loading
                if time.monotonic() >= deadline:
                    raise
                info, wrong = {}, {"unreachable": (str(settings), repr(e))}
            if not wrong:
                return info
            if time.monotonic() >= deadline:
                raise TrialFailed(TRANSIENT, f"the engine reports other settings than the trial's: {wrong}")
            time.sleep(0.5)

    def warm_up(self, requests: list, base_url: str, headers: dict[str, str], timed: bool) -> None:
        """Sends the warm-up requests at once. Where none could connect, sends them again for up to
        ROUTE_WAIT_S: a pod that answers its readiness probe (and `confirm`) may not be reachable
        through its Service for new connections yet, while the node's proxy rules catch up with the
        EndpointSlice after the rollout (Kubernetes programs them asynchronously; seen on the test
        node right after a trial's rollout). Raises TrialFailed (transient) when no request succeeds."""
        deadline = time.monotonic() + ROUTE_WAIT_S
        while True:
            results, _ = drive(requests, self.workload, base_url, self.model_name, headers,
                               offsets=[0.0] * len(requests) if timed else None)
            if any(r.success for r in results):
                return
            if not all(r.error_kind == "connect" for r in results) or time.monotonic() >= deadline:
                raise TrialFailed(TRANSIENT, f"warm-up requests failed: {results[0].error[:500]}")
            logger.info("warm-up: %s; waiting for the Service to route to the engine", results[0].error[:200])
            time.sleep(1.0)

    def wait_idle(self, base_url: str) -> None:
        """Blocks until no request is running or waiting (measurement hygiene)."""
        deadline = time.monotonic() + self.idle_timeout_s
        while time.monotonic() < deadline:
            if self.scrape(base_url).snapshot().in_flight == 0:
                return
            time.sleep(0.2)
        raise TrialFailed(TRANSIENT, f"the engine did not become idle within {self.idle_timeout_s} s")

    def observe(self, source: Source, checks: int = 4) -> Measurement:
        """A live-traffic window of live_seconds, looked at `checks` times on the way: when
        the SLO violation is already clear (`clearly_violates`), raises TrialCutShort with
        the partial window instead of serving users bad settings any longer."""
        start = source.begin()
        for i in range(1, checks + 1):
            time.sleep(self.live_seconds / checks)
            m = source.measure(start, self.slo)
            if i < checks and clearly_violates(m, self.slo):
                raise TrialCutShort(m, f"SLO violation clear after {m.duration_s:.0f} s of {self.live_seconds:.0f} s: "
                                       f"{violations(m, self.slo)}")
        return m

    def measure(self, base_url: str, headers: dict[str, str], settings: EngineSettings,
                request_rate: float | None = None) -> Measurement:
        """The trial's Measurement (at `request_rate` when given, else the workload's).
        Raises TrialFailed (transient) when the engine stops answering or a metric the
        window needs has no series (EmptySeries: the loop measures once more, then fails
        the trial with the reason)."""
        if self.load is None:  # live traffic: observe a window of the real load
            with _transient_errors():
                info = self.confirm(base_url, settings)
                m = self.observe(self.source_for(base_url))
            m.extra.update(reported_config=info)
            return m
        window = self.drive_window(base_url, headers, settings, request_rate)
        m = combine(client_measurement(window.results, window.duration_s, self.slo), window.server)
        m.extra.update(reported_config=window.reported_config)
        return m

    def drive_window(self, base_url: str, headers: dict[str, str], settings: EngineSettings,
                     request_rate: float | None = None) -> DrivenWindow:
        """One window of the workload's load, as `measure` takes it: confirm the engine runs
        `settings`, warm up, wait for idle, drive the requests, wait for idle, read the
        server's window. Errors as `measure`."""
        with _transient_errors():
            info = self.confirm(base_url, settings)
            load = self.load() if callable(self.load) else self.load  # a builder: once the engine answers
            warm = self.workload.warmup_requests
            requests, offsets = load.requests, load.offsets
            if warm:
                self.warm_up(requests[:warm], base_url, headers, bool(offsets))
            self.wait_idle(base_url)
            source = self.source_for(base_url)
            start = source.begin()
            results, duration = drive(requests[warm:], self.workload, base_url, self.model_name, headers,
                                      offsets=offsets[warm:] if offsets else None, request_rate=request_rate)
            self.wait_idle(base_url)  # the last request's metrics are recorded after its stream ends
            server = source.measure(start, self.slo)
        return DrivenWindow(results, duration, server, info)


@contextlib.contextmanager
def _transient_errors() -> Iterator[None]:
    """An engine that stops answering, or a window metric without a series, fails the trial as
    transient (the loop measures once more, then fails it with the reason)."""
    try:
        yield
    except httpx.HTTPError as e:
        raise TrialFailed(TRANSIENT, f"engine unreachable during the trial: {e!r}") from e
    except EmptySeries as e:
        raise TrialFailed(TRANSIENT, f"measurement void, a metric has no series: {e}") from e
