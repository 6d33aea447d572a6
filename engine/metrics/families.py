"""The vLLM metric families' fixed parts: label values, histogram buckets (vLLM 0.33's
defaults; `--custom-histogram-buckets` replaces them, options.py), and a factory that
declares a family with the `model_name` / `engine` labels every kvpilot metric carries.
Source: vLLM `vllm/v1/metrics/loggers.py`, `vllm/v1/metrics/buckets.py`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TOKEN_LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                         10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
REQUEST_PARAMS_N_BUCKETS = [1, 2, 5, 10, 20]
REQUEST_NUM_PREEMPTIONS_BUCKETS = [1, 2, 3, 4, 5, 10, 20]
KV_CACHE_RESIDENCY_BUCKETS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120,
                              300, 600, 1200, 1800]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


class MetricFactory:
    """Declares metric families in `registry`, each bound to the common `labels`."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.registry = registry
        self.labels = labels
        self.names = list(labels)

    def gauge(self, name: str, doc: str) -> Gauge:
        """A prometheus_client Gauge `name` in the registry, already bound to the common labels."""
        return Gauge(name, doc, self.names, registry=self.registry).labels(**self.labels)

    def counter(self, name: str, doc: str) -> Counter:
        """A Counter `name` (exposed as name_total) bound to the common labels."""
        return Counter(name, doc, self.names, registry=self.registry).labels(**self.labels)

    def histogram(self, name: str, doc: str, buckets: list[float]) -> Histogram:
        """A Histogram `name` with `buckets` (upper bounds, ascending) bound to the common labels."""
        return Histogram(name, doc, self.names, buckets=buckets, registry=self.registry).labels(**self.labels)

    def by_label(self, cls, name: str, doc: str, label: str, values: tuple[str, ...],
                 base: list[str] | None = None) -> dict:
        """One child per value of `label`, on the common labels (or only those in `base`)."""
        base = self.names if base is None else base
        family = cls(name, doc, base + [label], registry=self.registry)
        return {v: family.labels(**{k: self.labels[k] for k in base}, **{label: v}) for v in values}
