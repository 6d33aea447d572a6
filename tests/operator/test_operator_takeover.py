"""issue 42: two operator processes as the chart runs them (its command line with --leader-elect,
the chart's ServiceAccount, one POD_NAME each): exactly one reconciles; SIGKILL of the
leader in the middle of a rollout, and the standby takes the Lease once the dead leader's
renewals stop for leaseDurationSeconds (15 s, the chart's default), reconciles, and the
resource converges with one of each child. Ten kills, with the pods deleted, are
tests/operator/bench_operator_kill.py's (benchmarks/results/operator/README.md)."""
from __future__ import annotations

import json

import yaml
from kube.takeover import children, converged, first_reconcile, is_leader, kill, lease, lease_name, reconciles
from kube.tools import ROOT, Operator, wait_for

LEASE_DURATION_S, RETRY_PERIOD_S = 15, 2  # the chart's values


def test_the_standby_takes_over_a_killed_leader_mid_rollout_and_the_resource_converges(
        cluster, kubectl, release, tmp_path, capsys):
    kubeconfig = release.operator_kubeconfig(tmp_path / "kubeconfig")
    first = Operator(kubeconfig, tmp_path / "first.log", cluster.namespace, release.name, pod="operator-first")
    second = Operator(kubeconfig, tmp_path / "second.log", cluster.namespace, release.name, pod="operator-second")
    first.start()  # alone: it leads as soon as Kopf runs
    second.start()  # Ready as a standby
    try:
        name = lease_name(first)
        assert lease(cluster, name)["spec"]["holderIdentity"] == "operator-first"
        assert is_leader(first) and not is_leader(second)
        assert second.probe("/readyz/leader") == (503, f"standby, lease {cluster.namespace}/{name} held by operator-first")
        assert f'kvpilot_operator_is_leader{{lease="{name}"}} 0.0' in second.metrics()

        doc = yaml.safe_load((ROOT / "examples" / "inferenceservice-smollm2.yaml").read_text())
        doc["metadata"]["name"] = "takeover"
        kubectl.apply(yaml.safe_dump(doc))
        wait_for(lambda: converged(kubectl.json("get", "isvc", "takeover"), doc["spec"]["engine"].get("seed", 0)),
                 timeout=60, what="takeover Ready")
        assert reconciles(first) > 0 and reconciles(second) == 0  # the standby ran no handler

        kubectl("patch", "isvc", "takeover", "--type", "merge", "-p", json.dumps({"spec": {"engine": {"seed": 7}}}))
        killed_at = kill(first)  # mid-rollout: the new configuration's pods are not Ready yet
        winner, took = first_reconcile([second], killed_at, timeout=LEASE_DURATION_S + 30)
        assert winner is second and LEASE_DURATION_S - RETRY_PERIOD_S <= took < LEASE_DURATION_S + 15, took
        obj = wait_for(lambda: (o := kubectl.json("get", "isvc", "takeover")) and converged(o, 7) and o,
                       timeout=60, what="the rollout finished by the new leader")
        assert children(cluster, "takeover") == {"deployments": 1, "services": 1, "configmaps": 1, "secrets": 1,
                                                 "networkpolicies": 1}
        spec = lease(cluster, name)["spec"]
        assert spec["holderIdentity"] == "operator-second" and spec["leaseTransitions"] == 1
        assert is_leader(second) and f'kvpilot_operator_is_leader{{lease="{name}"}} 1.0' in second.metrics()
        with capsys.disabled():
            print(f"\n[takeover] SIGKILL of the leader mid-rollout -> the standby's first reconcile in {took:.1f} s "
                  f"(leaseDurationSeconds {LEASE_DURATION_S}); generation {obj['metadata']['generation']} Ready")
        kubectl("delete", "isvc", "takeover")
    finally:
        for operator in (first, second):
            operator.stop()
