"""The operator exports every InferenceService's spec.slo as kvpilot_slo_* (seconds), with
the CRD's defaults for fields left out, and drops the series when the resource goes."""

from __future__ import annotations

import pytest

from kvpilot.api.tuning_metrics import REGISTRY
from kvpilot.cli.operator import build_parser, metrics_port
from kvpilot.tuner.cluster.slo_metrics import export_slo


def sample(name: str, name_label: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"namespace": "ops", "inferenceservice": name_label})


def test_spec_slo_becomes_gauges_and_deletion_removes_them():
    export_slo("ADDED", "ops", "llm", {"slo": {"ttftP95Ms": 1200, "maxPreemptionsPerMin": 4}})
    assert sample("kvpilot_slo_ttft_p95_seconds", "llm") == 1.2
    assert sample("kvpilot_slo_itl_p95_seconds", "llm") == 0.2  # the CRD default, 200 ms
    assert sample("kvpilot_slo_max_preemptions_per_minute", "llm") == 4
    export_slo("MODIFIED", "ops", "llm", {"slo": {"ttftP95Ms": 900}})
    assert sample("kvpilot_slo_ttft_p95_seconds", "llm") == 0.9
    export_slo("MODIFIED", "ops", "llm", {"slo": {"ttftP95Ms": "fast"}})  # invalid: kept as it was
    assert sample("kvpilot_slo_ttft_p95_seconds", "llm") == 0.9
    export_slo("DELETED", "ops", "llm", {})
    assert sample("kvpilot_slo_ttft_p95_seconds", "llm") is None


def test_metrics_port_comes_from_the_flag_or_the_environment(monkeypatch, capsys):
    monkeypatch.delenv("KVPILOT_METRICS_PORT", raising=False)
    parser = build_parser()
    assert metrics_port(parser, parser.parse_args([])) == 0
    assert metrics_port(parser, parser.parse_args(["--metrics-port", "9102"])) == 9102
    monkeypatch.setenv("KVPILOT_METRICS_PORT", "9103")
    assert metrics_port(parser, parser.parse_args([])) == 9103
    # what the kubelet sets for a Service named kvpilot-metrics when the pod keeps service links on
    monkeypatch.setenv("KVPILOT_METRICS_PORT", "tcp://10.0.0.198:9090")
    assert metrics_port(parser, parser.parse_args(["--metrics-port", "9102"])) == 9102  # the flag wins
    with pytest.raises(SystemExit) as exit_info:
        metrics_port(parser, parser.parse_args([]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "KVPILOT_METRICS_PORT='tcp://10.0.0.198:9090' is not a port number" in err
    assert "enableServiceLinks: false" in err
