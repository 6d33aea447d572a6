"""The workload's shape over a window, and when it has moved: arrival rate and the request
length quantiles, from the same vLLM series the tuner measures on.

Shape. Per window: finished requests per second (`vllm:request_success_total`, aborts
excluded; over a window of a minute or more, in steady state, the arrival rate) and the
p50/p90 of the prompt and output lengths in tokens from the window's bucket increases of
vLLM v1's `vllm:request_prompt_tokens` / `vllm:request_generation_tokens` histograms
(one observation per finished request; `vllm/v1/metrics/loggers.py`, buckets
`build_1_2_5_buckets(max_model_len)`), by Prometheus's `histogram_quantile` rule
(`kvpilot.tuner.measure.window.histogram_quantile`, after prometheus/promql/quantile.go).

Shift test: a ratio on the quantiles and the rate, not a two-sample test on the buckets.
A figure has moved when now/reference or reference/now exceeds `ratio` (2 by default).
This is what the field's control loops do: the Kubernetes HorizontalPodAutoscaler acts
only when the ratio of the current to the desired metric leaves 1.0 by more than its
tolerance (`--horizontal-pod-autoscaler-tolerance`, 0.1 by default; per HPA since
Kubernetes 1.33, KEP-4951, `spec.behavior.scaleUp.tolerance`) and damps flapping with a
stabilization window; KEDA scalers compare a metric with a threshold. A two-sample
Kolmogorov-Smirnov or chi-square test on the bucket counts answers another question
(could the two windows come from the same distribution?): with hundreds of requests per
window it flags moves of a few percent that change no engine limit, and vLLM's 1-2-5
buckets are coarse (a prompt of 210 tokens and one of 480 share the bucket 200-500), so its
statistic moves in steps set by the bucket edges, not by the workload. A ratio says how far
the workload moved in the units the engine limits are set in (tokens, requests/s); the
watcher (`kvpilot.tuner.watch`) asks for it over consecutive windows, as the HPA's
stabilization window does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from kvpilot.tuner.measure.window import (OUTPUT_TOKENS, PROMPT_TOKENS, REQUESTS, SHAPE_HISTOGRAMS, Snapshot, delta_buckets,
                                  histogram_quantile, increase)

__all__ = ["FIGURES", "OUTPUT_TOKENS", "PROMPT_TOKENS", "SHAPE_HISTOGRAMS", "WorkloadShape", "distance",
           "shape_between", "shifted"]

# The figures a shift is judged on (WorkloadShape field names); `requests` and `duration_s` are not.
FIGURES = ("arrival_rps", "prompt_tokens_p50", "prompt_tokens_p90", "output_tokens_p50", "output_tokens_p90")


@dataclass(frozen=True)
class WorkloadShape:
    """The traffic of one window: its length (s), the requests that finished in it (aborts
    excluded), their rate (requests/s) and the p50/p90 of their prompt and output lengths
    (tokens; NaN when the window observed none)."""

    duration_s: float
    requests: float
    arrival_rps: float
    prompt_tokens_p50: float = math.nan
    prompt_tokens_p90: float = math.nan
    output_tokens_p50: float = math.nan
    output_tokens_p90: float = math.nan

    def as_dict(self) -> dict[str, float | None]:
        """The fields by name, JSON-able: NaN is written None (as `Measurement.as_dict` does)."""
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> WorkloadShape:
        """Reads `as_dict`'s form back; a missing or None field is NaN, unknown keys are ignored."""
        def number(key: str) -> float:
            value = d.get(key)
            return math.nan if value is None else float(value)  # type: ignore[arg-type]

        return cls(**{name: number(name) for name in cls.__dataclass_fields__})

    def describe(self) -> str:
        """One line for people, e.g. '0.42 req/s, prompt p50/p90 210/640 tokens, output
        p50/p90 120/128 tokens' ('?' where a quantile is NaN)."""
        def tokens(v: float) -> str:
            return "?" if math.isnan(v) else f"{v:.0f}"

        return (f"{self.arrival_rps:.2f} req/s, prompt p50/p90 {tokens(self.prompt_tokens_p50)}/"
                f"{tokens(self.prompt_tokens_p90)} tokens, output p50/p90 {tokens(self.output_tokens_p50)}/"
                f"{tokens(self.output_tokens_p90)} tokens")


def shape_between(start: Snapshot, end: Snapshot) -> WorkloadShape:
    """The workload between two snapshots of the same engine (`ScrapeSource`'s, or
    `PrometheusSource`'s window deltas against an empty start). Counters and buckets that
    went down (an engine restart) count from 0, as in `window_metrics`."""
    duration = max(end.time_s - start.time_s, 1e-9)
    requests = increase(start, end, REQUESTS)
    prompt, output = (delta_buckets(end.buckets.get(name, {}), start.buckets.get(name, {}))
                      for name in (PROMPT_TOKENS, OUTPUT_TOKENS))
    return WorkloadShape(
        duration_s=duration, requests=requests, arrival_rps=requests / duration,
        prompt_tokens_p50=histogram_quantile(0.5, prompt), prompt_tokens_p90=histogram_quantile(0.9, prompt),
        output_tokens_p50=histogram_quantile(0.5, output), output_tokens_p90=histogram_quantile(0.9, output),
    )


def _comparable(a: float, b: float) -> bool:
    return math.isfinite(a) and math.isfinite(b) and a > 0 and b > 0


def shifted(reference: WorkloadShape, now: WorkloadShape, ratio: float = 2.0) -> dict[str, tuple[float, float]]:
    """{figure: (reference value, value now)} for every FIGURE that moved by more than
    `ratio` either way (now/reference > ratio or reference/now > ratio). Figures that are
    NaN, infinite or 0 on either side are skipped (nothing to compare). Raises ValueError
    unless ratio > 1."""
    if not ratio > 1:
        raise ValueError(f"ratio must be > 1 (a factor the figures must move by), got {ratio}")
    out = {}
    for name in FIGURES:
        a, b = getattr(reference, name), getattr(now, name)
        if _comparable(a, b) and max(b / a, a / b) > ratio:
            out[name] = (a, b)
    return out


def distance(a: WorkloadShape, b: WorkloadShape) -> float:
    """How far apart two workloads are: the sum over FIGURES of |ln(a / b)| (0 for equal
    shapes, ln 2 = 0.69 for one figure twice the other), skipping figures that are NaN or
    0 on either side; inf when no figure compares. For picking the nearest earlier workload."""
    terms = [abs(math.log(getattr(a, n) / getattr(b, n))) for n in FIGURES
             if _comparable(getattr(a, n), getattr(b, n))]
    return sum(terms) if terms else math.inf
