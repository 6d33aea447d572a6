"""The metric flags of `kvpilot serve`, checked as vLLM checks them, and the histogram buckets
they choose.

- `--custom-histogram-buckets JSON`: {family: [upper bounds]}; a listed family's bounds replace
  its defaults in every histogram of the family. Unknown families, empty lists, bounds that
  are not finite and > 0, or not strictly increasing, booleans: refused with vLLM's messages.
- `--kv-cache-metrics` (`--kv-cache-metrics-sample` in (0, 1], default 0.01): the
  `vllm:kv_block_*` residency histograms of a sampled share of KV blocks.
- `--enable-mfu-metrics`: the `vllm:estimated_*_per_gpu_total` counters count (always registered).
- `--show-hidden-metrics-for-version` (hidden.py) and `--tool-call-parser` (its
  counter is registered only with a parser, as in vLLM).
Source: vLLM `vllm/config/observability.py` (`ObservabilityConfig`), `vllm/v1/metrics/buckets.py`."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field

from kvpilot.engine.metrics.families import (
    ITERATION_TOKEN_BUCKETS,
    KV_CACHE_RESIDENCY_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    REQUEST_NUM_PREEMPTIONS_BUCKETS,
    REQUEST_PARAMS_N_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    build_1_2_5_buckets,
)
from kvpilot.engine.metrics.hidden import check_version

_STATIC_DEFAULTS: dict[str, list] = {
    "request_latency": REQUEST_LATENCY_BUCKETS,
    "time_to_first_token": TTFT_BUCKETS,
    "inter_token_latency": TOKEN_LATENCY_BUCKETS,
    "iteration_tokens": ITERATION_TOKEN_BUCKETS,
    "request_params_n": REQUEST_PARAMS_N_BUCKETS,
    "request_num_preemptions": REQUEST_NUM_PREEMPTIONS_BUCKETS,
    "kv_cache_residency": KV_CACHE_RESIDENCY_BUCKETS,
}
BUCKET_FAMILY_KEYS = frozenset([*_STATIC_DEFAULTS, "request_tokens"])  # vLLM's BucketFamilyKey


def check_custom_histogram_buckets(value: object) -> dict[str, list[float]] | None:
    """The parsed `--custom-histogram-buckets` value, or None. Raises ValueError with vLLM's
    message (ObservabilityConfig's validators) for a bad family or bound."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"custom_histogram_buckets must be a JSON object of bucket family to bounds, got {value!r}")
    for family, buckets in value.items():
        for bound in buckets if isinstance(buckets, list) else ():
            if isinstance(bound, bool):
                raise ValueError(f"custom_histogram_buckets[{family!r}]: bound {bound!r} must be a number, "
                                 "not a boolean")
    out: dict[str, list[float]] = {}
    for family, buckets in value.items():
        if family not in BUCKET_FAMILY_KEYS:
            raise ValueError(f"custom_histogram_buckets: unknown bucket family {family!r}; known families: "
                             f"{sorted(BUCKET_FAMILY_KEYS)}")
        if not isinstance(buckets, list) or not all(isinstance(b, (int, float)) for b in buckets):
            raise ValueError(f"custom_histogram_buckets[{family!r}]: must be a list of numbers, got {buckets!r}")
        if not buckets:
            raise ValueError(f"custom_histogram_buckets[{family!r}]: bucket list must not be empty")
        for bound in buckets:
            if not math.isfinite(bound) or bound <= 0:
                raise ValueError(f"custom_histogram_buckets[{family!r}]: bound {float(bound)!r} must be finite "
                                 "and greater than 0")
        if any(a >= b for a, b in zip(buckets, buckets[1:])):
            raise ValueError(f"custom_histogram_buckets[{family!r}]: bounds {[float(b) for b in buckets]} "
                             "must be strictly increasing")
        out[family] = [float(b) for b in buckets]
    return out


@dataclass(frozen=True)
class MetricOptions:
    """What the metric flags ask for (defaults: vLLM's)."""

    show_hidden_for: str | None = None
    enable_mfu_metrics: bool = False
    kv_cache_metrics: bool = False
    kv_cache_metrics_sample: float = 0.01
    custom_histogram_buckets: dict[str, list[float]] = field(default_factory=dict)
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if not 0 < self.kv_cache_metrics_sample <= 1:
            raise ValueError(f"kv_cache_metrics_sample must be in (0, 1] (vLLM: greater than 0 and less than or "
                             f"equal to 1), got {self.kv_cache_metrics_sample}")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "MetricOptions":
        """From `kvpilot serve`'s parsed flags. Raises ValueError saying what is wrong (the
        server exits 2 with it)."""
        check_version(ns.show_hidden_metrics_for_version)
        text = ns.custom_histogram_buckets
        try:
            raw = json.loads(text) if text is not None else None
        except ValueError as exc:
            raise ValueError(f"--custom-histogram-buckets is not JSON: {exc}") from None
        return cls(show_hidden_for=ns.show_hidden_metrics_for_version, enable_mfu_metrics=ns.enable_mfu_metrics,
                   kv_cache_metrics=ns.kv_cache_metrics, kv_cache_metrics_sample=ns.kv_cache_metrics_sample,
                   custom_histogram_buckets=check_custom_histogram_buckets(raw) or {},
                   tool_call_parser=ns.tool_call_parser)

    def buckets(self, family: str, max_model_len: int | None = None) -> list[float]:
        """The bucket bounds of a histogram family: the flag's, else vLLM's defaults
        (request_tokens: 1, 2, 5, 10, ... up to max_model_len). Raises KeyError for an unknown family."""
        custom = self.custom_histogram_buckets.get(family)
        if custom is not None:
            return list(custom)
        if family == "request_tokens":
            return build_1_2_5_buckets(max_model_len)
        return list(_STATIC_DEFAULTS[family])
