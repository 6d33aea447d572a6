"""The SLO and tuning series (kvpilot.api.tuning_metrics): kvpilot_slo_* from spec.slo or the
tuner's SLO (seconds), kvpilot_tuning_* from the trials (settings info replaced, not
accumulated), one registry however many sessions; the watch windows of continuous tuning
(attainment, workload shape, re-tunes by reason, watching)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from kvpilot.api.spec import SLOSpec
from kvpilot.api.tuning_metrics import REGISTRY, TunerMetrics
from kvpilot.tuner.search.objective import SLO


def sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_slo_gauges_carry_spec_slo_in_seconds_per_inferenceservice():
    TunerMetrics("prod", "a").set_slo(SLO(ttft_p95_ms=1500, itl_p95_ms=50, e2e_p95_ms=0, max_preemptions_per_min=2))
    TunerMetrics("prod", "b").set_slo(SLO(ttft_p95_ms=900))
    assert sample("kvpilot_slo_ttft_p95_seconds", namespace="prod", inferenceservice="a") == 1.5
    assert sample("kvpilot_slo_itl_p95_seconds", namespace="prod", inferenceservice="a") == 0.05
    assert sample("kvpilot_slo_e2e_p95_seconds", namespace="prod", inferenceservice="a") == 0
    assert sample("kvpilot_slo_max_preemptions_per_minute", namespace="prod", inferenceservice="a") == 2
    assert sample("kvpilot_slo_ttft_p95_seconds", namespace="prod", inferenceservice="b") == 0.9


def test_spec_slo_in_the_crds_field_names_sets_the_same_gauges():
    TunerMetrics("prod", "d").set_spec_slo(SLOSpec(ttftP95Ms=1500, itlP95Ms=50, e2eP95Ms=3000, maxPreemptionsPerMin=2))
    assert sample("kvpilot_slo_ttft_p95_seconds", namespace="prod", inferenceservice="d") == 1.5
    assert sample("kvpilot_slo_itl_p95_seconds", namespace="prod", inferenceservice="d") == 0.05
    assert sample("kvpilot_slo_e2e_p95_seconds", namespace="prod", inferenceservice="d") == 3
    assert sample("kvpilot_slo_max_preemptions_per_minute", namespace="prod", inferenceservice="d") == 2


def test_a_trial_sets_number_verdicts_best_goodput_and_replaces_the_settings_info():
    metrics = TunerMetrics("prod", "c")

    def trial(number, verdict, seqs, goodput):
        return SimpleNamespace(number=number, values=[goodput],
                               user_attrs={"verdict": verdict, "settings": {"max_num_seqs": seqs},
                                           "measurement": {"goodput_rps": goodput}})

    first = trial(0, "measured", 8, 1.5)
    metrics.record_trial(first, [first])
    metrics.record_trial(trial(1, "violates", 16, 0.2), [first])
    labels = {"namespace": "prod", "inferenceservice": "c"}
    assert sample("kvpilot_tuning_trial", **labels) == 1
    assert sample("kvpilot_tuning_best_goodput_rps", **labels) == 1.5
    assert sample("kvpilot_tuning_trials_total", **labels, verdict="measured") == 1
    assert sample("kvpilot_tuning_trials_total", **labels, verdict="violates") == 1
    text = generate_latest(REGISTRY).decode()
    infos = [line for line in text.splitlines()
             if line.startswith("kvpilot_tuning_settings_info{") and 'inferenceservice="c"' in line]
    assert len(infos) == 1 and 'max_num_seqs="16"' in infos[0]


SHAPE = {"arrival_rps": 2.5, "prompt_tokens_p50": 120.0, "prompt_tokens_p90": 480.0,
         "output_tokens_p50": 64.0, "output_tokens_p90": 200.0}


def test_a_watch_window_sets_attainment_breached_windows_and_the_workload_shape():
    metrics = TunerMetrics("prod", "w")
    metrics.record_window(0.875, 2, SHAPE)
    labels = {"namespace": "prod", "inferenceservice": "w"}
    assert sample("kvpilot_tuning_slo_attainment", **labels) == 0.875
    assert sample("kvpilot_tuning_slo_breached_windows", **labels) == 2
    assert sample("kvpilot_workload_arrival_rate_rps", **labels) == 2.5
    assert sample("kvpilot_workload_prompt_tokens", **labels, quantile="0.5") == 120
    assert sample("kvpilot_workload_prompt_tokens", **labels, quantile="0.9") == 480
    assert sample("kvpilot_workload_output_tokens", **labels, quantile="0.5") == 64
    assert sample("kvpilot_workload_output_tokens", **labels, quantile="0.9") == 200
    # the re-tune counters exist from the first window at 0, so that increase() sees the first re-tune
    assert sample("kvpilot_tuning_retunes_total", **labels, reason="SLOBreached") == 0
    assert sample("kvpilot_tuning_retunes_total", **labels, reason="WorkloadShifted") == 0


def test_a_window_without_finished_requests_exports_nan_not_the_last_windows_figures():
    metrics = TunerMetrics("prod", "n")
    metrics.record_window(0.9, 0, SHAPE)
    # WorkloadShape.as_dict() writes NaN as None
    metrics.record_window(math.nan, 0, {"duration_s": 60.0, "requests": 0.0, "arrival_rps": 0.0,
                                        "prompt_tokens_p50": math.nan, "prompt_tokens_p90": None})
    labels = {"namespace": "prod", "inferenceservice": "n"}
    assert math.isnan(sample("kvpilot_tuning_slo_attainment", **labels))
    assert sample("kvpilot_workload_arrival_rate_rps", **labels) == 0
    assert math.isnan(sample("kvpilot_workload_prompt_tokens", **labels, quantile="0.5"))
    assert math.isnan(sample("kvpilot_workload_prompt_tokens", **labels, quantile="0.9"))
    assert math.isnan(sample("kvpilot_workload_output_tokens", **labels, quantile="0.9"))  # missing key
    assert 'kvpilot_workload_prompt_tokens{inferenceservice="n",namespace="prod",quantile="0.5"} NaN' in \
        generate_latest(REGISTRY).decode()


def test_retunes_count_by_reason_and_watching_flips():
    metrics = TunerMetrics("prod", "r")
    labels = {"namespace": "prod", "inferenceservice": "r"}
    metrics.set_watching(True)
    assert sample("kvpilot_tuning_watching", **labels) == 1
    assert sample("kvpilot_tuning_retunes_total", **labels, reason="WorkloadShifted") == 0
    metrics.record_retune("WorkloadShifted")
    metrics.set_watching(False)
    metrics.record_retune("SLOBreached")
    metrics.record_retune("SLOBreached")
    assert sample("kvpilot_tuning_watching", **labels) == 0
    assert sample("kvpilot_tuning_retunes_total", **labels, reason="WorkloadShifted") == 1
    assert sample("kvpilot_tuning_retunes_total", **labels, reason="SLOBreached") == 2


def test_an_unknown_retune_reason_is_refused():
    with pytest.raises(ValueError, match="SLOBreached, WorkloadShifted"):
        TunerMetrics("prod", "x").record_retune("Shifted")
    assert sample("kvpilot_tuning_retunes_total", namespace="prod", inferenceservice="x", reason="Shifted") is None
