"""The SLO and tuning series of an InferenceService, which the kvpilot dashboard charts,
labelled by `namespace` and `inferenceservice` (a local run uses namespace "local"). The
tuner writes them for its trials, the operator process for every resource's spec.slo
(kvpilot.tuner.slo_metrics), `kvpilot bench dashboard` for the trials it plays; so they live
in api/, which all three may import:

    kvpilot_slo_ttft_p95_seconds, kvpilot_slo_itl_p95_seconds, kvpilot_slo_e2e_p95_seconds
                                       spec.slo's limits (0: no limit), drawn as SLO lines
    kvpilot_slo_max_preemptions_per_minute
    kvpilot_tuning_trial               the trial number now finished last
    kvpilot_tuning_best_goodput_rps    goodput (req/s within the SLOs) of the best measured trial
    kvpilot_tuning_best_objective      that trial's objective value (= goodput by default)
    kvpilot_tuning_trials_total        trials finished, by verdict (measured, violates, pruned, ...)
    kvpilot_tuning_settings_info       1, with the engine settings of the last trial as labels

One registry per process (the operator's Kopf process runs one tuning session per
InferenceService on threads), served once by `serve(port)`."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from kvpilot.api.spec import SLOSpec

REGISTRY = CollectorRegistry()
LABELS = ["namespace", "inferenceservice"]
SETTINGS_LABELS = ["max_model_len", "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization",
                   "enable_chunked_prefill", "enable_prefix_caching", "block_size", "preemption_mode", "swap_space",
                   "tensor_parallel_size", "pipeline_parallel_size"]

SLO_GAUGES = {
    "ttft_p95_ms": Gauge("kvpilot_slo_ttft_p95_seconds", "spec.slo.ttftP95Ms in seconds (0: no limit).",
                         LABELS, registry=REGISTRY),
    "itl_p95_ms": Gauge("kvpilot_slo_itl_p95_seconds", "spec.slo.itlP95Ms in seconds (0: no limit).",
                        LABELS, registry=REGISTRY),
    "e2e_p95_ms": Gauge("kvpilot_slo_e2e_p95_seconds", "spec.slo.e2eP95Ms in seconds (0: no limit).",
                        LABELS, registry=REGISTRY),
}
SLO_PREEMPTIONS = Gauge("kvpilot_slo_max_preemptions_per_minute", "spec.slo.maxPreemptionsPerMin.",
                        LABELS, registry=REGISTRY)
TRIAL = Gauge("kvpilot_tuning_trial", "The number of the trial that finished last.", LABELS, registry=REGISTRY)
BEST_GOODPUT = Gauge("kvpilot_tuning_best_goodput_rps", "Goodput (requests/s within the SLOs) of the best "
                     "measured trial.", LABELS, registry=REGISTRY)
BEST_OBJECTIVE = Gauge("kvpilot_tuning_best_objective", "The best measured trial's objective value.",
                       LABELS, registry=REGISTRY)
TRIALS = Counter("kvpilot_tuning_trials", "Trials finished, by verdict.", [*LABELS, "verdict"], registry=REGISTRY)
SETTINGS = Gauge("kvpilot_tuning_settings_info", "1, with the engine settings of the last trial as labels.",
                 [*LABELS, *SETTINGS_LABELS], registry=REGISTRY)

_served: set[int] = set()
_lock = threading.Lock()


def _label(value: Any) -> str:
    return "" if value is None else str(value)


class TunerMetrics:
    """The metrics of one InferenceService's tuning session."""

    def __init__(self, namespace: str, name: str) -> None:
        self.registry = REGISTRY
        self._labels = {"namespace": namespace, "inferenceservice": name}
        self._settings: dict[str, str] | None = None

    def set_slo(self, slo: Any) -> None:
        """`slo`: a kvpilot.tuner.objective.SLO (milliseconds; per minute)."""
        self._set_slo(slo.ttft_p95_ms, slo.itl_p95_ms, slo.e2e_p95_ms, slo.max_preemptions_per_min)

    def set_spec_slo(self, slo: SLOSpec) -> None:
        """`slo`: spec.slo in the CRD's field names (milliseconds; per minute)."""
        self._set_slo(slo.ttftP95Ms, slo.itlP95Ms, slo.e2eP95Ms, slo.maxPreemptionsPerMin)

    def _set_slo(self, ttft_p95_ms: float, itl_p95_ms: float, e2e_p95_ms: float,
                 max_preemptions_per_min: float) -> None:
        for gauge, ms in zip(SLO_GAUGES.values(), (ttft_p95_ms, itl_p95_ms, e2e_p95_ms)):
            gauge.labels(**self._labels).set(float(ms) / 1000.0)
        SLO_PREEMPTIONS.labels(**self._labels).set(float(max_preemptions_per_min))

    def forget_slo(self) -> None:
        """Removes this InferenceService's SLO series (it was deleted)."""
        for gauge in (*SLO_GAUGES.values(), SLO_PREEMPTIONS):
            try:
                gauge.remove(*self._labels.values())
            except KeyError:
                pass

    def record(self, number: int, verdict: str, best: float | None, settings: dict[str, Any] | None = None,
               best_goodput_rps: float | None = None) -> None:
        """One finished trial: its number, verdict and settings, and the best so far."""
        TRIAL.labels(**self._labels).set(number)
        TRIALS.labels(**self._labels, verdict=verdict).inc()
        if best is not None:
            BEST_OBJECTIVE.labels(**self._labels).set(best)
        if best_goodput_rps is not None:
            BEST_GOODPUT.labels(**self._labels).set(best_goodput_rps)
        if settings:
            new = {**self._labels, **{k: _label(settings.get(k)) for k in SETTINGS_LABELS}}
            SETTINGS.labels(**new).set(1)
            if self._settings is not None and self._settings != new:
                SETTINGS.remove(*(self._settings[k] for k in [*LABELS, *SETTINGS_LABELS]))
            self._settings = new

    def record_trial(self, trial: Any, best: Sequence[Any]) -> None:
        """`trial`: an optuna FrozenTrial as the tuning loop leaves it (user_attrs verdict,
        settings, measurement); `best`: kvpilot.tuner.loop.best_measured(study)."""
        attrs = trial.user_attrs
        top = best[0] if best else None
        goodput = ((top.user_attrs.get("measurement") or {}).get("goodput_rps") if top is not None else None)
        self.record(trial.number, attrs.get("verdict", "?"), top.values[0] if top is not None else None,
                    attrs.get("settings"), goodput)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        serve(port, addr)


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Exposes the process's tuner and SLO metrics at http://addr:port/metrics (a background
    thread), once per port however many sessions ask."""
    with _lock:
        if port not in _served:
            start_http_server(port, addr=addr, registry=REGISTRY)
            _served.add(port)
