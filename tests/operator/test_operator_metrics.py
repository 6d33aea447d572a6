"""kvpilot.operator.runtime.metrics from a resource's status as the watch delivers it (no cluster; the
running operator's /metrics is checked in test_operator_e2e.py and the dashboard's queries
over them in tests/server/test_server_dashboard.py)."""
from __future__ import annotations

import time

import kopf
import pytest
from prometheus_client import generate_latest

from kvpilot.operator.runtime import metrics


def sample(name: str, **labels: str) -> float | None:
    return metrics.REGISTRY.get_sample_value(name, labels)


def status(progressing: str = "False", reason: str = "RollingOut", since: float | None = None,
           tuning: dict | None = None) -> dict:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since if since is not None else time.time()))
    body = {"status": {"conditions": [
        {"type": "Ready", "status": "False"},
        {"type": "Progressing", "status": progressing, "reason": reason, "lastTransitionTime": stamp}]}}
    if tuning is not None:
        body["status"]["tuning"] = tuning
    return body


def test_conditions_are_one_on_the_current_status_and_zero_on_the_others():
    metrics.observe("ns", "a", status(progressing="True"))
    labels = {"namespace": "ns", "inferenceservice": "a"}
    name = "kvpilot_operator_inferenceservice_condition"
    assert [sample(name, **labels, condition="Ready", status=s) for s in ("true", "false", "unknown")] == [0, 1, 0]
    assert sample(name, **labels, condition="Progressing", status="true") == 1
    metrics.observe("ns", "a", {"status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    assert sample(name, **labels, condition="Ready", status="true") == 1
    assert sample(name, **labels, condition="Progressing", status="true") is None  # a condition gone: its series too
    metrics.observe("ns", "a", None)  # deleted
    assert sample(name, **labels, condition="Ready", status="true") is None


def test_rollout_age_counts_from_progressings_transition_while_rolling_out_only():
    metrics.observe("ns", "b", status(progressing="True", since=time.time() - 42))
    assert 41 <= sample("kvpilot_operator_rollout_age_seconds", namespace="ns", inferenceservice="b") <= 44
    metrics.observe("ns", "b", status(progressing="False", reason="RolloutComplete"))
    assert sample("kvpilot_operator_rollout_age_seconds", namespace="ns", inferenceservice="b") == 0


def test_tuning_phase_and_trial_follow_status_tuning_and_go_with_it():
    labels = {"namespace": "ns", "inferenceservice": "c"}
    metrics.observe("ns", "c", status(tuning={"phase": "Running", "trial": 3}))
    assert sample("kvpilot_operator_tuning_phase", **labels, phase="Running") == 1
    assert sample("kvpilot_operator_tuning_phase", **labels, phase="Done") == 0
    assert sample("kvpilot_operator_tuning_trial", **labels) == 3
    metrics.observe("ns", "c", status())  # tuning switched off: status.tuning cleared
    assert sample("kvpilot_operator_tuning_phase", **labels, phase="Running") is None
    assert sample("kvpilot_operator_tuning_trial", **labels) is None


def test_reconcile_timer_records_duration_and_result_by_handler():
    def count(result: str) -> float:
        return sample("kvpilot_operator_reconciles_total", handler="t", result=result) or 0
    with metrics.reconcile_timer("t"):
        pass
    with pytest.raises(kopf.TemporaryError), metrics.reconcile_timer("t"):
        raise kopf.TemporaryError("not yet")
    with pytest.raises(kopf.PermanentError), metrics.reconcile_timer("t"):
        raise kopf.PermanentError("bad spec")
    with pytest.raises(RuntimeError), metrics.reconcile_timer("t"):
        raise RuntimeError("boom")
    assert [count(r) for r in ("success", "retry", "failed", "error")] == [1, 1, 1, 1]
    assert sample("kvpilot_operator_reconcile_duration_seconds_count", handler="t") == 4
    metrics.set_leader("lease-x", True)
    text = generate_latest(metrics.REGISTRY).decode()
    assert 'kvpilot_operator_is_leader{lease="lease-x"} 1.0' in text
    assert "# TYPE kvpilot_operator_reconcile_duration_seconds histogram" in text
