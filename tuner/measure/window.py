"""Engine metrics over a measurement window, from two snapshots of vLLM's counters and
histograms: the arithmetic both measurement sources share.

A window is `end - start` of every cumulative counter and histogram bucket; quantiles come
from the bucket deltas by Prometheus's own `histogram_quantile` rule (linear interpolation
inside the bucket holding the rank; the +Inf bucket answers the highest finite bound), so
`ScrapeSource` and `PrometheusSource` agree to the bucket resolution.
Metric names are vLLM v1's (`vllm/v1/metrics/loggers.py`), which kvpilot's server keeps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvpilot.engine.settings import AUTO_MAX_MODEL_LEN
from kvpilot.tuner.search.objective import SLO, Measurement

TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
TPOT = "vllm:request_time_per_output_token_seconds"
E2E = "vllm:e2e_request_latency_seconds"
HISTOGRAMS = (TTFT, ITL, TPOT, E2E)
# Request lengths in tokens, one observation per finished request (vLLM v1's
# `vllm:request_prompt_tokens` / `vllm:request_generation_tokens`, 1-2-5 buckets up to
# max_model_len): the workload's shape (`kvpilot.tuner.measure.shape`). Snapshots keep their buckets
# too (SNAPSHOT_HISTOGRAMS); the measurement (`window_metrics`) reads HISTOGRAMS only.
PROMPT_TOKENS = "vllm:request_prompt_tokens"
OUTPUT_TOKENS = "vllm:request_generation_tokens"
SHAPE_HISTOGRAMS = (PROMPT_TOKENS, OUTPUT_TOKENS)
SNAPSHOT_HISTOGRAMS = HISTOGRAMS + SHAPE_HISTOGRAMS
PREEMPTIONS = "vllm:num_preemptions_total"
REQUESTS = "vllm:request_success_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
COUNTERS = (PREEMPTIONS, REQUESTS, GENERATION_TOKENS)
# Failed requests, as server counters. ABORTS: requests the engine gave up on
# (`vllm:request_success_total{finished_reason="abort"}`); HTTP_ERRORS: 4xx/5xx answers of
# the OpenAI routes (prometheus-fastapi-instrumentator's `http_requests_total{handler,
# method,status="4xx"|"5xx"}`, which vLLM's server exports), e.g. 503s under overload
# that never reach the engine. When a server exports no HTTP metrics, aborts are the count.
ABORTS = 'vllm:request_success_total{finished_reason="abort"}'
HTTP_REQUESTS = "http_requests_total"
HTTP_ERRORS = 'http_requests_total{status=~"4xx|5xx"}'
FAILURE_COUNTERS = (ABORTS, HTTP_ERRORS)


class EmptySeries(LookupError):
    """A metric the window needs has no series under the source's selector (a wrong
    selector or label, an engine not scraped yet): the measurement is void, never 0."""
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
CONFIG_INFO = "vllm:cache_config_info"  # vLLM's cache settings (and kvpilot's, spelled as vLLM's)
ENGINE_CONFIG_INFO = "kvpilot:engine_config_info"  # kvpilot's scheduler limits, parallel sizes, dtype
CONFIG_INFOS = (CONFIG_INFO, ENGINE_CONFIG_INFO)  # a snapshot's config_info merges both

Buckets = dict[float, float]  # upper bound (le) -> cumulative count


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float:
    """Prometheus's `histogram_quantile(q, ...)` over cumulative bucket counts keyed by
    their upper bound (math.inf for +Inf). NaN when there are no observations, fewer than
    two buckets or no +Inf bucket. Source: prometheus/promql/quantile.go `bucketQuantile`."""
    if math.isnan(q):
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    bounds = sorted(buckets)
    if len(bounds) < 2 or bounds[-1] != math.inf:
        return math.nan
    counts = [float(buckets[b]) for b in bounds]
    for i in range(1, len(counts)):  # non-monotonic counts (scrape races) are flattened
        counts[i] = max(counts[i], counts[i - 1])
    total = counts[-1]
    if total <= 0:
        return math.nan
    rank = q * total
    b = next(i for i, c in enumerate(counts) if c >= rank)
    if b == len(bounds) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start = 0.0 if b == 0 else bounds[b - 1]
    count_below = 0.0 if b == 0 else counts[b - 1]
    in_bucket = counts[b] - count_below
    return start + (bounds[b] - start) * ((rank - count_below) / in_bucket if in_bucket else 0.0)


def fraction_at_most(limit: float, buckets: Mapping[float, float]) -> float:
    """Estimated share of observations <= limit, interpolating linearly inside the bucket
    holding `limit` (the inverse of `histogram_quantile`). NaN without observations."""
    bounds = sorted(buckets)
    total = float(buckets[bounds[-1]]) if bounds else 0.0
    if total <= 0:
        return math.nan
    lower, below = 0.0, 0.0
    for b in bounds:
        count = float(buckets[b])
        if limit <= b:
            if b == math.inf:
                return below / total
            share = (limit - lower) / (b - lower) if b > lower else 1.0
            return (below + (count - below) * max(0.0, share)) / total
        lower, below = b, count
    return 1.0


@dataclass
class Snapshot:
    """The engine's cumulative metrics at one instant (seconds since the epoch), summed
    over the series that the source's selector matched; buckets of SNAPSHOT_HISTOGRAMS."""

    time_s: float
    counters: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, Buckets] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    config_info: dict[str, str] = field(default_factory=dict)

    @property
    def in_flight(self) -> float:
        """Requests running or waiting; 0 means the engine is idle."""
        return self.gauges.get(RUNNING, 0.0) + self.gauges.get(WAITING, 0.0)


def delta_buckets(end: Buckets, start: Buckets) -> Buckets:
    """Per-bucket increase; a bucket missing at the start counts from 0, and a counter that
    went down (an engine restart) counts from 0 as Prometheus's `increase` does."""
    out = {}
    for le, value in end.items():
        before = start.get(le, 0.0)
        out[le] = value - before if value >= before else value
    return out


def increase(start: Snapshot, end: Snapshot, name: str) -> float:
    """The counter's increase from `start` to `end` (0 when absent from both); a counter that
    went down (an engine restart) counts from 0, as Prometheus's `increase` does."""
    e, s = end.counters.get(name, 0.0), start.counters.get(name, 0.0)
    return e - s if e >= s else e


def window_metrics(start: Snapshot, end: Snapshot, slo: SLO, source: str) -> Measurement:
    """The server-side measurement of the window between two snapshots; failed counts
    aborted requests and 4xx/5xx answers (FAILURE_COUNTERS). Goodput is
    estimated as requests/s x the smaller of the shares meeting the TTFT and TPOT limits
    (exact when the requests that miss one limit also miss the other; an upper bound
    otherwise). Latencies in seconds."""
    duration = max(end.time_s - start.time_s, 1e-9)

    def counter(name: str) -> float:
        return increase(start, end, name)

    hist = {name: delta_buckets(end.buckets.get(name, {}), start.buckets.get(name, {})) for name in HISTOGRAMS}
    requests = counter(REQUESTS)
    failed = sum(counter(name) for name in FAILURE_COUNTERS)
    shares = []
    for name, limit_ms in ((TTFT, slo.ttft_p95_ms), (TPOT, slo.itl_p95_ms), (E2E, slo.e2e_p95_ms)):
        if limit_ms > 0 and hist[name]:
            share = fraction_at_most(limit_ms / 1000.0, hist[name])
            shares.append(0.0 if math.isnan(share) else share)
    good = requests * (min(shares) if shares else 1.0)
    return Measurement(
        duration_s=duration, completed=int(round(requests)), failed=int(round(failed)),
        throughput_rps=requests / duration, goodput_rps=good / duration,
        output_tokens_per_s=counter(GENERATION_TOKENS) / duration,
        ttft_p95_s=histogram_quantile(0.95, hist[TTFT]) if hist[TTFT] else math.nan,
        itl_p95_s=histogram_quantile(0.95, hist[ITL]) if hist[ITL] else math.nan,
        tpot_p95_s=histogram_quantile(0.95, hist[TPOT]) if hist[TPOT] else math.nan,
        e2e_p95_s=histogram_quantile(0.95, hist[E2E]) if hist[E2E] else math.nan,
        preemptions=counter(PREEMPTIONS), source=source,
    )


def config_mismatches(info: Mapping[str, str], expected: Mapping[str, object]) -> dict[str, tuple[str, str]]:
    """Settings whose value in the config info labels (`vllm:cache_config_info` and, from
    kvpilot, `kvpilot:engine_config_info`) differs from what the
    trial asked for: {name: (expected, reported)}. Labels the engine does not report are
    skipped, and so are settings the trial leaves unset (None: the engine chooses, e.g. vLLM's
    kv_cache_memory_bytes from VLLM_CPU_KVCACHE_SPACE) and max_model_len -1 (vLLM's auto: the
    engine reports what it chose);
    booleans and numbers compare by value ('True' == 'true', '0.90' == '0.9')."""
    def norm(value: object) -> str:
        text = str(value).strip().lower()
        try:
            number = float(text)
        except ValueError:
            return text
        return repr(number)

    auto = {"max_model_len": norm(AUTO_MAX_MODEL_LEN)}
    return {k: (str(v), info[k]) for k, v in expected.items()
            if v is not None and k in info and norm(v) != norm(info[k]) and auto.get(k) != norm(v)}
