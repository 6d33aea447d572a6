"""`kvpilot operator` argument handling (the run itself is covered by the end-to-end tests)."""
from __future__ import annotations

import pytest

from kvpilot.cli.operator import build_parser, main


def test_namespaces_repeat_and_exclude_all_namespaces():
    args = build_parser().parse_args(["-n", "a", "--namespace", "b", "--liveness", "http://0.0.0.0:8080/healthz"])
    assert args.namespace == ["a", "b"] and not args.all_namespaces
    assert args.liveness == "http://0.0.0.0:8080/healthz" and args.peering == ""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["-n", "a", "--all-namespaces"])


def test_a_non_positive_resync_interval_is_refused(capsys):
    with pytest.raises(SystemExit) as refused:
        main(["--resync-seconds", "0"])
    assert refused.value.code == 2 and "--resync-seconds must be > 0" in capsys.readouterr().err


def test_leader_election_durations_client_go_refuses_are_refused(capsys, monkeypatch):
    monkeypatch.setenv("POD_NAME", "kvpilot-0")
    with pytest.raises(SystemExit) as refused:
        main(["--leader-elect", "--leader-elect-renew-deadline", "20"])
    assert refused.value.code == 2 and "must be greater than the renew deadline (20.0 s)" in capsys.readouterr().err
    args = build_parser().parse_args(["--leader-elect"])
    assert (args.leader_elect, args.leader_election_lease, args.leader_elect_lease_duration,
            args.leader_elect_renew_deadline, args.leader_elect_retry_period) == (True, "kvpilot-operator", 15, 10, 2)
