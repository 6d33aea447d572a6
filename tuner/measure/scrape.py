"""`ScrapeSource`: the embedded measurement source, for runs without Prometheus. It reads the
engine's `/metrics` (Prometheus text format, parsed by `prometheus_client.parser`) at the
window's start and end and takes the differences (`kvpilot.tuner.measure.window`)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.tuner.search.objective import SLO, Measurement
from kvpilot.tuner.measure.shape import WorkloadShape, shape_between
from kvpilot.tuner.measure.window import (ABORTS, CONFIG_INFOS, COUNTERS, HTTP_ERRORS, HTTP_REQUESTS, REQUESTS, RUNNING,
                                  SNAPSHOT_HISTOGRAMS, WAITING, EmptySeries, Snapshot, window_metrics)


def parse_metrics(text: str, labels: Mapping[str, str] | None = None, time_s: float | None = None) -> Snapshot:
    """A Snapshot of the vLLM metrics in a `/metrics` page, summing the series whose labels
    include `labels` (e.g. {"model_name": "smollm2"}); other metrics are ignored. Buckets are
    kept for SNAPSHOT_HISTOGRAMS (latencies and request lengths). Counters
    are keyed by their sample name (`vllm:num_preemptions_total`). `vllm:cache_config_info`
    (read also when it lacks the filter's labels: vLLM labels it by config only) and kvpilot's
    `kvpilot:engine_config_info` (scheduler limits, parallel sizes, dtype) merge into config_info.
    Aborted requests are counted apart (`ABORTS`), and 4xx/5xx answers of the /v1 routes
    from `http_requests_total` (no model label) as `HTTP_ERRORS`."""
    wanted = dict(labels or {})
    snap = Snapshot(time_s=time.time() if time_s is None else time_s)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name == HTTP_REQUESTS:  # server-wide: no model label
                labels = sample.labels
                if labels.get("handler", "").startswith("/v1/") and labels.get("status") in ("4xx", "5xx"):
                    snap.counters[HTTP_ERRORS] = snap.counters.get(HTTP_ERRORS, 0.0) + sample.value
                continue
            info = family.name in CONFIG_INFOS or sample.name in CONFIG_INFOS
            if any(sample.labels.get(k, v if info else None) != v for k, v in wanted.items()):
                continue
            if name.endswith("_bucket") and name[: -len("_bucket")] in SNAPSHOT_HISTOGRAMS:
                le = sample.labels.get("le", "+Inf")
                bound = math.inf if le in ("+Inf", "Inf", "inf") else float(le)
                hist = snap.buckets.setdefault(name[: -len("_bucket")], {})
                hist[bound] = hist.get(bound, 0.0) + sample.value
            elif name in COUNTERS:
                key = ABORTS if name == REQUESTS and sample.labels.get("finished_reason") == "abort" else name
                snap.counters[key] = snap.counters.get(key, 0.0) + sample.value  # aborts did not succeed
            elif name in (RUNNING, WAITING):
                snap.gauges[name] = snap.gauges.get(name, 0.0) + sample.value
            elif info:
                snap.config_info.update(sample.labels)
    return snap


class ScrapeSource:
    """Reads one engine's `/metrics` directly. base_url: the engine's root
    (http://127.0.0.1:8000); labels narrow the series (e.g. model_name)."""

    name = "scrape"

    def __init__(self, base_url: str, labels: Mapping[str, str] | None = None, timeout_s: float = 10.0,
                 headers: Mapping[str, str] | None = None):
        self.base_url = base_url.rstrip("/")
        self.labels = dict(labels or {})
        self.timeout_s = timeout_s
        self.headers = dict(headers or {})

    def snapshot(self) -> Snapshot:
        """The metrics now. Raises httpx.HTTPError when the engine does not answer and
        EmptySeries when no request counter matches the labels (never a silent 0)."""
        resp = httpx.get(f"{self.base_url}/metrics", timeout=self.timeout_s, headers=self.headers)
        resp.raise_for_status()
        snap = parse_metrics(resp.text, self.labels)
        if REQUESTS not in snap.counters:  # the engine creates it at start: nothing matched
            raise EmptySeries(f"{self.base_url}/metrics has no {REQUESTS} series with labels {self.labels}: "
                              f"a wrong label filter or not a vLLM-style server")
        return snap

    def begin(self) -> Snapshot:
        """Opens a window: the metrics now. Raises as `snapshot` does."""
        return self.snapshot()

    def measure(self, start: Snapshot, slo: SLO) -> Measurement:
        """The window from `start` to now."""
        return self.observe_window(start, slo)[0]

    def observe_window(self, start: Snapshot, slo: SLO) -> tuple[Measurement, WorkloadShape]:
        """The window from `start` to now, from one reading at its end: the measurement
        (as `measure` gives it) and the workload's shape (`shape_between`). Raises as
        `snapshot` does."""
        end = self.snapshot()
        return window_metrics(start, end, slo, self.name), shape_between(start, end)
