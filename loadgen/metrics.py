"""Serving-benchmark metric arithmetic, with vLLM's `benchmark_serving` definitions.

Pure functions over per-request timings; no I/O. Source: vLLM `vllm/benchmarks/serve.py`
(`calculate_metrics`, `check_goodput_args`, the result dict of `benchmark`):

- TTFT: time from sending a request to its first streamed token chunk.
- ITL: the gaps between consecutive token chunks of a request, pooled over requests.
- TPOT: (E2E latency - TTFT) / (output tokens - 1), for requests with > 1 output token.
- E2EL: time from sending a request to its last token chunk.
- Goodput: completed requests per second that meet every given SLO (value <= SLO);
  a request with <= 1 output token has TPOT 0 for this purpose.
Only successful requests enter the statistics; failed ones count in `failed` and add
0 output tokens. Statistics of an empty set are 0, as vLLM reports them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
METRIC_TITLES = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


@dataclass
class RequestResult:
    """What one benchmark request measured; times in seconds (time.perf_counter clock).

    ttft: send -> first token chunk; itl: gaps between later chunks; latency: send -> last
    token chunk; output_tokens: the server's usage.completion_tokens, or None when it sent
    none (then the metrics count tokens of generated_text). error_kind is a short class
    for counting failures ("http_503", "timeout", "connect", ...); error the full text."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int | None = None
    generated_text: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    client_queue_time: float = 0.0
    error: str = ""
    error_kind: str = ""

    @property
    def token_times(self) -> list[float]:
        """Arrival time of each token chunk, on the start_time clock (s)."""
        if not self.success:
            return []
        return (self.start_time + self.ttft + np.cumsum([0.0, *self.itl])).tolist()


@dataclass
class Stats:
    """mean / median / std and the selected percentiles of one metric, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: dict[float, float]


@dataclass
class BenchmarkMetrics:
    """Aggregates of a run (vLLM's BenchmarkMetrics). Throughputs per second of `duration_s`."""

    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    stats: dict[str, Stats]
    max_output_tokens_per_s: float
    max_concurrent_requests: int


def summarize(values_s: Sequence[float], percentiles: Sequence[float]) -> Stats:
    """Stats in ms of values in seconds; numpy's linear-interpolation percentiles; an
    empty list gives zeros."""
    arr = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1000.0
    return Stats(
        mean=float(np.mean(arr)),
        median=float(np.median(arr)),
        std=float(np.std(arr)),
        percentiles={float(p): float(np.percentile(arr, p)) for p in percentiles},
    )


def parse_goodput(pairs: Sequence[str]) -> dict[str, float]:
    """Parse `["ttft:500", "tpot:50"]` into {"ttft": 500.0, ...} (SLOs in milliseconds).

    Raises ValueError when a pair is not KEY:VALUE, the key is not one of ttft, tpot,
    e2el, or the value is negative."""
    slos: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        try:
            if not sep:
                raise ValueError
            number = float(value)
        except ValueError:
            raise ValueError(
                f"invalid goodput SLO {pair!r}: write KEY:VALUE with the value in milliseconds, e.g. ttft:500"
            ) from None
        if name not in GOODPUT_METRICS:
            raise ValueError(f"invalid goodput metric {name!r}: use one of {', '.join(GOODPUT_METRICS)}")
        if number < 0:
            raise ValueError(f"invalid goodput SLO {pair!r}: the value must be non-negative")
        slos[name] = number
    return slos


@dataclass
class _Samples:
    """Per-request values of a run, gathered in one pass (seconds; output lengths in tokens)."""

    output_lens: list[int] = field(default_factory=list)  # one per request, 0 for failures
    ttfts: list[float] = field(default_factory=list)
    tpots: list[float] = field(default_factory=list)  # requests with more than one token
    all_tpots: list[float] = field(default_factory=list)  # every success, 0.0 for one token
    itls: list[float] = field(default_factory=list)
    e2els: list[float] = field(default_factory=list)
    total_input: int = 0
    completed: int = 0

    def add(self, r: RequestResult, count_tokens: Callable[[str], int] | None) -> None:
        if not r.success:
            self.output_lens.append(0)
            return
        n = r.output_tokens
        if not n:
            n = count_tokens(r.generated_text) if count_tokens is not None else 1 + len(r.itl)
        self.output_lens.append(n)
        self.total_input += r.prompt_len
        tpot = 0.0
        if n > 1:
            tpot = (r.latency - r.ttft) / (n - 1)
            self.tpots.append(tpot)
        self.all_tpots.append(tpot)
        self.itls.extend(r.itl)
        self.ttfts.append(r.ttft)
        self.e2els.append(r.latency)
        self.completed += 1

    def count_good(self, goodput_slos_ms: dict[str, float] | None) -> int:
        """Successful requests that meet every SLO (milliseconds, by GOODPUT_METRICS name)."""
        if not goodput_slos_ms:
            return 0
        per_metric = {"ttft": self.ttfts, "tpot": self.all_tpots, "e2el": self.e2els}
        checks = [(per_metric[name], slo / 1000.0) for name, slo in goodput_slos_ms.items()]
        return sum(all(values[i] <= slo for values, slo in checks) for i in range(self.completed))


def calculate_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    *,
    percentiles: Sequence[float] = (90, 95, 99),
    goodput_slos_ms: dict[str, float] | None = None,
    count_tokens: Callable[[str], int] | None = None,
) -> tuple[BenchmarkMetrics, list[int]]:
    """Aggregate per-request results of a run lasting `duration_s` seconds.

    A successful request's output length is its server-reported token count; when the
    server reported none (or 0), `count_tokens(generated_text)`, or failing that the
    number of token chunks. Returns the metrics and each request's output length (0 for
    failures). Raises ValueError if duration_s <= 0."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    samples = _Samples()
    for r in results:
        samples.add(r, count_tokens)
    good = samples.count_good(goodput_slos_ms)
    completed, total_input = samples.completed, samples.total_input
    total_output = sum(samples.output_lens)
    peak_tokens, peak_concurrency = _peaks([r for r in results if r.success])
    metrics = BenchmarkMetrics(
        completed=completed,
        failed=len(results) - completed,
        total_input=total_input,
        total_output=total_output,
        request_throughput=completed / duration_s,
        request_goodput=good / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        stats={
            "ttft": summarize(samples.ttfts, percentiles),
            "tpot": summarize(samples.tpots, percentiles),
            "itl": summarize(samples.itls, percentiles),
            "e2el": summarize(samples.e2els, percentiles),
        },
        max_output_tokens_per_s=peak_tokens,
        max_concurrent_requests=peak_concurrency,
    )
    return metrics, samples.output_lens


def _peaks(ok: Sequence[RequestResult]) -> tuple[float, int]:
    """Most token chunks in one whole second from the first send, and the most requests
    in flight at once (half-open [start, end) intervals), as vLLM computes them."""
    if not ok:
        return 0.0, 0
    t0 = min(r.start_time for r in ok)
    t_end = max(r.start_time + r.latency for r in ok)
    buckets = np.zeros(int(np.ceil(t_end - t0)) + 1)
    for r in ok:
        for t in r.token_times:
            b = int(t - t0)
            if 0 <= b < len(buckets):
                buckets[b] += 1
    events = sorted([(r.start_time, 1) for r in ok] + [(r.start_time + r.latency, -1) for r in ok])
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return float(buckets.max()), peak


def percentile_key(p: float) -> str:
    """vLLM's key fragment for a percentile: 99 -> "p99", 99.9 -> "p99.9"."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


def result_dict(
    metrics: BenchmarkMetrics,
    results: Sequence[RequestResult],
    output_lens: Sequence[int],
    duration_s: float,
    *,
    selected_metrics: Sequence[str] = PERCENTILE_METRICS,
    goodput_slos_ms: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The run's part of a vLLM result file: the keys `vllm bench serve` writes
    (duration, completed, failed, ..., mean_ttft_ms, median_ttft_ms, std_ttft_ms,
    p99_ttft_ms, ...), per-request lists included; times in the lists are seconds."""
    out: dict[str, Any] = {
        "duration": duration_s,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput if goodput_slos_ms else None,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": list(output_lens),
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results],
        "start_times": [r.start_time for r in results],
        "queue_times": [r.client_queue_time for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
        "rtfx": 0.0,
    }
    for name in selected_metrics:
        s = metrics.stats[name]
        out[f"mean_{name}_ms"] = s.mean
        out[f"median_{name}_ms"] = s.median
        out[f"std_{name}_ms"] = s.std
        for p, value in s.percentiles.items():
            out[f"{percentile_key(p)}_{name}_ms"] = value
    return out
