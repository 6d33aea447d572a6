"""The SLO and tuning series of an InferenceService, which the kvpilot dashboard charts,
labelled by `namespace` and `inferenceservice` (a local run uses namespace "local"). The
tuner writes them for its trials, the operator process for every resource's spec.slo
(kvpilot.tuner.cluster.slo_metrics), `kvpilot bench dashboard` for the trials it plays; so they live
in api/, which all three may import:

    kvpilot_slo_ttft_p95_seconds, kvpilot_slo_itl_p95_seconds, kvpilot_slo_e2e_p95_seconds
                                       spec.slo's limits (0: no limit), drawn as SLO lines
    kvpilot_slo_max_preemptions_per_minute
    kvpilot_tuning_trial               the trial number now finished last
    kvpilot_tuning_best_goodput_rps    goodput (req/s within the SLOs) of the best measured trial
    kvpilot_tuning_best_objective      that trial's objective value (= goodput by default)
    kvpilot_tuning_trials_total        trials finished, by verdict (measured, violates, pruned, ...)
    kvpilot_tuning_settings_info       1, with the engine settings of the last trial as labels

Continuous tuning (spec.tuning.mode: continuous): after its study the tuner watches live traffic
window by window and writes, for the last watch window,

    kvpilot_tuning_slo_attainment      share (0..1) of the window's requests that met every SLO
    kvpilot_tuning_slo_breached_windows  consecutive watch windows breaking an SLO (0: within)
    kvpilot_workload_arrival_rate_rps  requests/s finished in the window
    kvpilot_workload_prompt_tokens     prompt length quantiles, label quantile ("0.5", "0.9")
    kvpilot_workload_output_tokens     output length quantiles, label quantile ("0.5", "0.9")
    kvpilot_tuning_retunes_total       studies the watcher started, by reason (SLOBreached, WorkloadShifted)
    kvpilot_tuning_watching            1 while it watches after a study, 0 during a study or when done

A figure the window cannot give (no request finished: no quantile, no attainment) is exported as
NaN, not left at the last window's value; the dashboard's queries drop NaN samples (`>= 0`), so
Grafana draws a gap there rather than a stale line or a false zero.

One registry per process (the operator's Kopf process runs one tuning session per
InferenceService on threads), served once by `serve(port)`."""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
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

ATTAINMENT = Gauge("kvpilot_tuning_slo_attainment", "Share (0..1) of the last watch window's requests that "
                   "met every SLO (NaN: none finished).", LABELS, registry=REGISTRY)
BREACHED_WINDOWS = Gauge("kvpilot_tuning_slo_breached_windows", "Consecutive watch windows breaking an SLO.",
                         LABELS, registry=REGISTRY)
ARRIVAL_RATE = Gauge("kvpilot_workload_arrival_rate_rps", "Requests/s finished in the last watch window.",
                     LABELS, registry=REGISTRY)
PROMPT_TOKENS = Gauge("kvpilot_workload_prompt_tokens", "Prompt length quantiles (tokens) of the last watch "
                      "window (NaN: none finished).", [*LABELS, "quantile"], registry=REGISTRY)
OUTPUT_TOKENS = Gauge("kvpilot_workload_output_tokens", "Output length quantiles (tokens) of the last watch "
                      "window (NaN: none finished).", [*LABELS, "quantile"], registry=REGISTRY)
RETUNES = Counter("kvpilot_tuning_retunes", "Studies started by the watcher, by reason.", [*LABELS, "reason"],
                  registry=REGISTRY)
WATCHING = Gauge("kvpilot_tuning_watching", "1 while the tuner watches live traffic after a study (continuous "
                 "mode), 0 during a study or when done.", LABELS, registry=REGISTRY)
RETUNE_REASONS = ("SLOBreached", "WorkloadShifted")
# WorkloadShape.as_dict() key -> (gauge, quantile label)
SHAPE_QUANTILES = {"prompt_tokens_p50": (PROMPT_TOKENS, "0.5"), "prompt_tokens_p90": (PROMPT_TOKENS, "0.9"),
                   "output_tokens_p50": (OUTPUT_TOKENS, "0.5"), "output_tokens_p90": (OUTPUT_TOKENS, "0.9")}

_served: set[int] = set()
_lock = threading.Lock()


def _figure(value: float | None) -> float:
    return math.nan if value is None else float(value)


def _label(value: Any) -> str:
    return "" if value is None else str(value)


class TunerMetrics:
    """The metrics of one InferenceService's tuning session."""

    def __init__(self, namespace: str, name: str) -> None:
        self.registry = REGISTRY
        self._labels = {"namespace": namespace, "inferenceservice": name}
        self._settings: dict[str, str] | None = None

    def set_slo(self, slo: Any) -> None:
        """`slo`: a kvpilot.tuner.search.objective.SLO (milliseconds; per minute)."""
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
        settings, measurement); `best`: kvpilot.tuner.search.loop.best_measured(study)."""
        attrs = trial.user_attrs
        top = best[0] if best else None
        goodput = ((top.user_attrs.get("measurement") or {}).get("goodput_rps") if top is not None else None)
        self.record(trial.number, attrs.get("verdict", "?"), top.values[0] if top is not None else None,
                    attrs.get("settings"), goodput)

    def record_window(self, attainment: float, breached_windows: int, shape: Mapping[str, float]) -> None:
        """One watch window: SLO attainment (0..1), consecutive windows breaking an SLO, and the
        workload's shape (kvpilot.tuner.measure.shape.WorkloadShape.as_dict(): arrival_rps and
        prompt/output_tokens_p50/p90; other keys ignored). A NaN, None (as_dict's NaN) or missing
        figure is exported as NaN (a gap on the dashboard), never as the previous window's value."""
        ATTAINMENT.labels(**self._labels).set(_figure(attainment))
        BREACHED_WINDOWS.labels(**self._labels).set(int(breached_windows))
        ARRIVAL_RATE.labels(**self._labels).set(_figure(shape.get("arrival_rps")))
        for key, (gauge, quantile) in SHAPE_QUANTILES.items():
            gauge.labels(**self._labels, quantile=quantile).set(_figure(shape.get(key)))
        self._retunes_from_zero()

    def record_retune(self, reason: str) -> None:
        """The watcher started a study; `reason`: "SLOBreached" or "WorkloadShifted".
        Raises ValueError on any other reason (a typo would split the dashboard's series)."""
        if reason not in RETUNE_REASONS:
            raise ValueError(f"retune reason {reason!r}: use one of {', '.join(RETUNE_REASONS)}")
        self._retunes_from_zero()
        RETUNES.labels(**self._labels, reason=reason).inc()

    def set_watching(self, watching: bool) -> None:
        """1 while the tuner watches live traffic after a study, 0 during a study or when done."""
        WATCHING.labels(**self._labels).set(1 if watching else 0)
        if watching:
            self._retunes_from_zero()

    def _retunes_from_zero(self) -> None:
        # Exported at 0 from the first window on: increase() needs a sample before the first
        # re-tune, or the dashboard would never show it.
        for reason in RETUNE_REASONS:
            RETUNES.labels(**self._labels, reason=reason)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Exposes the tuner metrics at http://addr:port/metrics (module-level serve: once per port)."""
        serve(port, addr)


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Exposes the process's tuner and SLO metrics at http://addr:port/metrics (a background
    thread), once per port however many sessions ask."""
    with _lock:
        if port not in _served:
            start_http_server(port, addr=addr, registry=REGISTRY)
            _served.add(port)
