"""A trial's warm-up right after its rollout (tuner/measure/trial_window.py WindowMeasurer.warm_up): where no warm-up
request can connect (the pod is Ready but the node's proxy rules do not route the Service to it
yet), the requests are sent again for up to ROUTE_WAIT_S before the trial fails; any other failure,
or one past that time, fails the trial at once as transient."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvpilot.tuner.measure import trial_window as local
from kvpilot.tuner.failures import TRANSIENT, TrialFailed
from kvpilot.tuner.measure.trial_window import WindowMeasurer


@dataclass
class Result:
    success: bool
    error_kind: str = ""
    error: str = ""


REFUSED = Result(False, "connect", "cannot connect to http://tuned:8000/v1/completions: All connection attempts failed")


def measurer_with(monkeypatch, answers: list[list[Result]]) -> tuple[WindowMeasurer, list]:
    sent = []

    def drive(requests, *args, **kwargs):
        sent.append(len(requests))
        return answers[min(len(sent), len(answers)) - 1], 0.0

    monkeypatch.setattr(local, "drive", drive)
    monkeypatch.setattr(local.time, "sleep", lambda s: None)
    return WindowMeasurer(workload=None, load=None, slo=None, model_name="m"), sent


def test_connect_failures_are_sent_again_until_the_service_routes(monkeypatch):
    measurer, sent = measurer_with(monkeypatch, [[REFUSED, REFUSED], [REFUSED, REFUSED], [Result(True), REFUSED]])
    measurer.warm_up(["a", "b"], "http://tuned:8000", {}, timed=False)
    assert sent == [2, 2, 2]


def test_other_failures_fail_the_trial_at_once(monkeypatch):
    measurer, sent = measurer_with(monkeypatch, [[Result(False, "http_500", "HTTP 500: boom")]])
    with pytest.raises(TrialFailed, match="warm-up requests failed: HTTP 500") as e:
        measurer.warm_up(["a"], "http://tuned:8000", {}, timed=False)
    assert e.value.kind == TRANSIENT and sent == [1]


def test_a_service_that_never_routes_fails_the_trial_after_the_wait(monkeypatch):
    measurer, sent = measurer_with(monkeypatch, [[REFUSED]])
    clock = iter(range(0, 1000, 10))
    monkeypatch.setattr(local.time, "monotonic", lambda: next(clock))
    with pytest.raises(TrialFailed, match="cannot connect"):
        measurer.warm_up(["a"], "http://tuned:8000", {}, timed=False)
    assert 1 < len(sent) <= local.ROUTE_WAIT_S / 10 + 2
