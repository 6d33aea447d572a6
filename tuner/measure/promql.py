"""`PrometheusSource`: measures a window through PromQL, as the dashboards do, with
`prometheus-api-client`'s `PrometheusConnect.custom_query` (the HTTP API /api/v1/query).

Window edges are real scrapes: `begin()` waits for the first sample taken after it was
called (the engine is idle then, so nothing changes until the load starts) and `measure()`
waits for the first sample after the load ended. Each quantity is then the difference of
the cumulative series at the two edges, with PromQL's `@` modifier:

    histogram_quantile(0.95, sum by (le) (vllm:time_to_first_token_seconds_bucket{sel})
                             - (sum by (le) (vllm:time_to_first_token_seconds_bucket{sel} @ START)
                                or sum by (le) (vllm:time_to_first_token_seconds_bucket{sel}) * 0))
    sum(vllm:num_preemptions_total{sel}) - (sum(vllm:num_preemptions_total{sel} @ START) or vector(0))

evaluated at END. Unlike `increase(...[W])` this neither extrapolates to the window's
edges nor depends on the window lining up with the scrape interval, so it equals what
`ScrapeSource` computes from the same two scrapes. `sel` scopes the series to one trial's
engine (its job or pod labels, or the operator's config-hash label).

A counter with no series under `sel` raises EmptySeries (a wrong selector is not "0
preemptions"). Failed requests are the engine's aborts
(`vllm:request_success_total{finished_reason="abort"}`) plus, when the server exports
prometheus-fastapi-instrumentator's `http_requests_total{handler,method,status}` (vLLM's
server does), the 4xx/5xx answers of its /v1 routes, matched without the engine-only
labels (model_name, engine); without that series, aborts alone.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable

import requests
from prometheus_api_client import PrometheusConnect

from kvpilot.tuner.failures import TRANSIENT, TrialFailed
from kvpilot.tuner.search.objective import SLO, Measurement
from kvpilot.tuner.measure.shape import SHAPE_HISTOGRAMS, WorkloadShape, shape_between
from kvpilot.tuner.measure.window import (ABORTS, COUNTERS, E2E, HISTOGRAMS, HTTP_ERRORS, HTTP_REQUESTS, REQUESTS, RUNNING,
                                  TPOT, TTFT, Buckets, EmptySeries, Snapshot, window_metrics)

# label matchers that only the engine's own series carry: dropped for the HTTP metrics
_ENGINE_LABELS = re.compile(r'\s*(model_name|engine)\s*(=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"\s*,?')


class PrometheusSource:
    """url: the Prometheus server; selector: PromQL label matchers without braces, e.g.
    'job="engine",model_name="smollm2-135m-instruct"'; scrape_timeout_s: how long to wait
    for a fresh sample at a window edge."""

    name = "prometheus"

    def __init__(self, url: str, selector: str = "", scrape_timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.time):
        self.client = PrometheusConnect(url=url, disable_ssl=True)
        self.selector = selector
        self.scrape_timeout_s = scrape_timeout_s
        self.clock = clock

    def _sel(self, name: str) -> str:
        if name == HTTP_ERRORS:
            return self._http_sel(errors=True)
        extra = {REQUESTS: 'finished_reason!="abort"', ABORTS: 'finished_reason="abort"'}.get(name, "")
        metric = REQUESTS if name == ABORTS else name
        return f"{metric}{{{','.join(m for m in (self.selector, extra) if m)}}}"

    def _http_sel(self, errors: bool) -> str:
        """`http_requests_total` of the /v1 routes (4xx/5xx only when `errors`), matched by
        the selector's target labels (job, pod): the HTTP series carry no model label."""
        target = _ENGINE_LABELS.sub("", self.selector).strip().rstrip(",")
        matchers = [m for m in (target, 'handler=~"/v1/.*"', 'status=~"4xx|5xx"' if errors else "") if m]
        return f"{HTTP_REQUESTS}{{{','.join(matchers)}}}"

    def query(self, promql: str, at: float) -> list[dict]:
        """The instant vector of `promql` at time `at` (s since the epoch). Raises TrialFailed
        (transient: the trial is retried once, then hidden from the study) when Prometheus does
        not answer: an unreachable or restarting Prometheus says nothing about the settings and
        must not end a tuning session."""
        try:
            return self.client.custom_query(promql, params={"time": f"{at:.3f}"})
        except requests.RequestException as e:
            raise TrialFailed(TRANSIENT, f"Prometheus at {self.client.url} did not answer: {e}") from e

    def scalar(self, promql: str, at: float) -> float:
        """The single value of `promql` at `at`. Raises EmptySeries for an empty vector:
        no series matched (a wrong selector, nothing scraped), which is not a 0."""
        result = self.query(promql, at)
        if not result:
            raise EmptySeries(f"Prometheus at {self.client.url} returned no series for {promql} "
                              f"(selector {self.selector!r}): check the selector and that the engine is scraped")
        return float(result[0]["value"][1])

    def has_series(self, selector: str, at: float) -> bool:
        """Whether any series matches `selector` at `at` (s since the epoch). Raises TrialFailed as query."""
        return bool(self.query(f"count({selector})", at))

    def latest_sample_time(self) -> float:
        """Timestamp of the newest scrape of the engine (s), or 0 when there is none."""
        result = self.query(f"max(timestamp({self._sel(RUNNING)}))", self.clock())
        return float(result[0]["value"][1]) if result else 0.0

    def wait_for_scrape_after(self, t: float) -> float:
        """Blocks until Prometheus holds a sample taken at or after `t`; returns its time.
        Raises TimeoutError after scrape_timeout_s."""
        deadline = time.monotonic() + self.scrape_timeout_s
        while time.monotonic() < deadline:
            latest = self.latest_sample_time()
            if latest >= t:
                return latest
            time.sleep(0.25)
        if latest == 0:
            raise EmptySeries(f"Prometheus at {self.client.url} has no {self._sel(RUNNING)} series: "
                              f"check the selector and that the engine is scraped")
        raise TimeoutError(f"no scrape of {self._sel(RUNNING)} after t={t:.3f} within {self.scrape_timeout_s} s")

    def begin(self) -> Snapshot:
        """Marks the window's start at the next scrape."""
        return Snapshot(time_s=self.wait_for_scrape_after(self.clock()))

    def counter_delta(self, name: str, start: float, end: float, missing_ok: bool = False) -> float:
        """The counter's increase over the window. Raises EmptySeries when the series does
        not exist at the end, unless missing_ok (a 4xx/5xx series appears with the first error)."""
        sel = self._sel(name)
        promql = f"sum({sel}) - (sum({sel} @ {start:.3f}) or vector(0))"
        if missing_ok:
            result = self.query(promql, end)
            return float(result[0]["value"][1]) if result else 0.0
        return self.scalar(promql, end)

    def bucket_delta_query(self, histogram: str, start: float) -> str:
        """PromQL for each `le` bucket's increase of `histogram` (e.g. vllm:time_to_first_token_seconds)
        since `start` (s since the epoch), 0 for buckets that did not exist then."""
        sel = self._sel(histogram + "_bucket")
        return f"sum by (le) ({sel}) - (sum by (le) ({sel} @ {start:.3f}) or sum by (le) ({sel}) * 0)"

    def bucket_delta(self, histogram: str, start: float, end: float) -> Buckets:
        """{le: increase} of `histogram`'s cumulative buckets from `start` to `end` (s); {} without series."""
        return {float(r["metric"]["le"]): float(r["value"][1])
                for r in self.query(self.bucket_delta_query(histogram, start), end)}

    def quantile(self, q: float, histogram: str, start: float, end: float) -> float:
        """PromQL's histogram_quantile over the window's bucket increases; NaN when empty."""
        result = self.query(f"histogram_quantile({q}, {self.bucket_delta_query(histogram, start)})", end)
        return float(result[0]["value"][1]) if result else math.nan

    def measure(self, start: Snapshot, slo: SLO) -> Measurement:
        """The window from `start` to the first scrape after now."""
        return self.observe_window(start, slo)[0]

    def observe_window(self, start: Snapshot, slo: SLO) -> tuple[Measurement, WorkloadShape]:
        """The window from `start` to the first scrape after now, with one end time for both:
        the measurement (latency p95s by PromQL's histogram_quantile) and the workload's shape
        (`shape_between` over the window's bucket increases of SHAPE_HISTOGRAMS and the
        request counter). Raises EmptySeries, TimeoutError and TrialFailed as the queries do;
        length histograms without series give NaN quantiles, not an error."""
        end = self.wait_for_scrape_after(self.clock())
        deltas = Snapshot(time_s=end)  # the window's increases, against an empty start
        deltas.counters = {name: self.counter_delta(name, start.time_s, end) for name in (*COUNTERS, ABORTS)}
        if self.has_series(self._http_sel(errors=False), end):  # else the server has no HTTP metrics: aborts only
            deltas.counters[HTTP_ERRORS] = self.counter_delta(HTTP_ERRORS, start.time_s, end, missing_ok=True)
        for name in (TTFT, TPOT, E2E, *SHAPE_HISTOGRAMS):  # for the goodput estimate and the shape
            deltas.buckets[name] = self.bucket_delta(name, start.time_s, end)
        origin = Snapshot(time_s=start.time_s)
        m = window_metrics(origin, deltas, slo, self.name)
        names = dict(zip(("ttft_p95_s", "itl_p95_s", "tpot_p95_s", "e2e_p95_s"), HISTOGRAMS))
        for attr, histogram in names.items():
            setattr(m, attr, self.quantile(0.95, histogram, start.time_s, end))
        return m, shape_between(origin, deltas)
