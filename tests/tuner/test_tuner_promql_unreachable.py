"""A Prometheus that does not answer fails the trial as transient (retried once, then hidden
from the study), never the tuning session: on a real cluster the tuner's first query met a
Prometheus that was not listening yet, and the whole session ended Failed."""
from __future__ import annotations

import socket

import pytest

from kvpilot.tuner.failures import TRANSIENT, TrialFailed
from kvpilot.tuner.measure.promql import PrometheusSource


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


def test_an_unreachable_prometheus_is_a_transient_trial_failure():
    source = PrometheusSource(f"http://127.0.0.1:{closed_port()}", 'job="engine"')
    with pytest.raises(TrialFailed) as failed:
        source.query("vllm:num_requests_running", 0.0)
    assert failed.value.kind == TRANSIENT and failed.value.retryable
    assert "did not answer" in failed.value.message and "127.0.0.1" in failed.value.message
