"""Benchmark (not a test): the chart's operator replicas on a real control plane (tests/kube: etcd,
kube-apiserver, controller manager, scheduler, a kwok node), the leader killed mid-rollout N times.

`helm install` of the chart creates its Deployment (two replicas by default, leader election
on a Lease) and the kwok node runs its pods; one operator process per pod runs here with the
chart's command line, the chart's ServiceAccount and that pod's name as POD_NAME (its
holderIdentity). Each kill: patch spec.engine.seed of every InferenceService (a rollout each),
wait a random 0-0.5 s, SIGKILL the leading process and delete its pod (`kubectl delete pod
--grace-period=0 --force`, as a lost node's pod goes); measure the time from the kill to the
Lease changing hands and to the new leader's first finished reconcile
(kvpilot_operator_reconciles_total > 0; a standby runs no handler); start a process for the
pod the ReplicaSet created instead (the new standby); wait until every resource is Ready at its
latest configuration; count the children (exactly one of each) and the admin tokens (never
rewritten). Prints a table, writes JSON.

    .venv/bin/python tests/operator/bench_operator_kill.py [--kills 10] [--count 3] [--replicas 2] [--json PATH]

--replicas 1 is the single-pod chart: the killed container restarts in the same pod (same
identity, so it takes its own Lease back at once) and nothing is deleted.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys
import tempfile
import time

import yaml

from kvpilot.loadgen.machine import machine_info

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from bench_operator import percentile  # noqa: E402  (this folder: the script's own)
from kube.cluster import Cluster, standalone  # noqa: E402
from kube.release import Release  # noqa: E402
from kube.takeover import children, converged, first_reconcile, kill, lease, lease_name  # noqa: E402
from kube.tools import ROOT, Kubectl, Operator  # noqa: E402

SELECTOR = {"app.kubernetes.io/component": "operator", "app.kubernetes.io/name": "kvpilot"}


def operator_pods(cluster: Cluster, taken: set[str]) -> list[str]:
    """Names of the chart's operator pods that no process runs as yet (not being deleted)."""
    return sorted(p["metadata"]["name"] for p in cluster.objects("", "v1", "pods", labels=SELECTOR)
                  if not p["metadata"].get("deletionTimestamp") and p["metadata"]["name"] not in taken)


def wait_new_pod(cluster: Cluster, taken: set[str], timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := operator_pods(cluster, taken):
            return found[0]
        time.sleep(0.2)
    raise SystemExit("the ReplicaSet created no replacement operator pod")


def start(release: Release, cluster: Cluster, workdir: pathlib.Path, pod: str) -> Operator:
    operator = Operator(release.operator_kubeconfig(workdir / "sa.kubeconfig"), workdir / f"{pod}.log",
                        cluster.namespace, release.name, pod=pod)
    operator.env["KVPILOT_RESYNC_SECONDS"] = "300"  # the chart's default
    operator.start()
    return operator


def leader_of(operators: list[Operator], name: str, cluster: Cluster) -> Operator:
    holder = lease(cluster, name)["spec"]["holderIdentity"]
    return next(o for o in operators if o.pod == holder)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--count", type=int, default=3, help="InferenceServices rolling out at each kill")
    parser.add_argument("--replicas", type=int, default=2, help="the chart's replicaCount")
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--json", type=pathlib.Path,
                        default=ROOT / "benchmarks" / "results" / "operator" / "takeover.json")
    args = parser.parse_args()
    example = yaml.safe_load((ROOT / "examples" / "inferenceservice-smollm2.yaml").read_text())
    names = [f"kill-{i}" for i in range(args.count)]
    rng = random.Random(17)
    kills: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp, standalone(pathlib.Path(tmp), "bench-kill") as cluster:
        workdir = pathlib.Path(tmp)
        kubectl = Kubectl(cluster.kubeconfig)
        release = Release(cluster, "kv", f"--set=replicaCount={args.replicas}").install()
        taken: set[str] = set()
        operators = []
        for _ in range(args.replicas):
            pod = wait_new_pod(cluster, taken)
            taken.add(pod)
            operators.append(start(release, cluster, workdir, pod))
        name = lease_name(operators[0])
        docs = []
        for n in names:
            doc = json.loads(json.dumps(example))
            doc["metadata"]["name"] = n
            docs.append(doc)
        kubectl.apply(yaml.safe_dump_all(docs))
        seed = example["spec"]["engine"].get("seed", 0)
        wait_all(kubectl, names, seed, args.timeout)
        tokens = {n: kubectl.json("get", "secret", f"{n}-admin-token")["data"]["token"] for n in names}
        for i in range(1, args.kills + 1):
            leader = leader_of(operators, name, cluster)
            for n in names:
                kubectl("patch", "isvc", n, "--type", "merge", "-p", json.dumps({"spec": {"engine": {"seed": i}}}))
            time.sleep(rng.uniform(0.0, 0.5))  # somewhere inside the rollouts
            killed_at = kill(leader)
            operators.remove(leader)
            row: dict = {"kill": i, "killed": leader.pod}
            if args.replicas > 1:  # the pod goes too; the ReplicaSet makes another
                kubectl("delete", "pod", leader.pod, "--grace-period=0", "--force", "--wait=false")
                winner, took = first_reconcile(operators, killed_at, args.timeout)
                row["lease_acquired_s"] = lease_acquired_s(cluster, name, leader.pod, killed_at, winner.pod)
                pod = wait_new_pod(cluster, taken)
                taken.add(pod)
                operators.append(start(release, cluster, workdir, pod))
            else:  # the kubelet restarts the container in the same pod
                leader.start()
                operators.append(leader)
                winner, took = first_reconcile([leader], killed_at, args.timeout)
            row.update(new_leader=winner.pod, takeover_s=round(took, 2))
            row["converged_s"] = wait_all(kubectl, names, i, args.timeout, since=killed_at)
            counts = {n: children(cluster, n) for n in names}
            row["duplicate_children"] = sum(c > 1 for per in counts.values() for c in per.values())
            row["missing_children"] = sum(c == 0 for per in counts.values() for c in per.values())
            row["token_changes"] = sum(kubectl.json("get", "secret", f"{n}-admin-token")["data"]["token"] != tokens[n]
                                       for n in names)
            row["lease_transitions"] = lease(cluster, name)["spec"].get("leaseTransitions")
            kills.append(row)
            print(json.dumps(row), flush=True)
        version = cluster.control_plane.version["gitVersion"]
        for operator in operators:
            operator.stop()
    result = summary(args, kills, version)
    print_table(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")
    ok = result["converged"] == args.kills and not result["duplicate_children"] and not result["missing_children"]
    return 0 if ok else 1


def lease_acquired_s(cluster: Cluster, name: str, dead: str, since: float, winner: str) -> float | None:
    """Seconds from the kill until the Lease named the new holder, from its acquireTime (wall
    clock, this machine's, as the operator processes run here)."""
    import datetime

    spec = lease(cluster, name)["spec"]
    if spec.get("holderIdentity") != winner or not spec.get("acquireTime"):
        return None
    acquired = datetime.datetime.strptime(spec["acquireTime"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(
        tzinfo=datetime.timezone.utc).timestamp()
    return round(acquired - (time.time() - (time.monotonic() - since)), 2)


def wait_all(kubectl: Kubectl, names: list[str], seed: int, timeout: float, since: float | None = None) -> float | None:
    """Seconds (from `since`, default now) until every resource is Ready with `seed`; None on timeout."""
    start = since if since is not None else time.monotonic()
    while time.monotonic() - start < timeout:
        items = kubectl.json("get", "isvc")["items"]
        if sum(converged(o, seed) for o in items if o["metadata"]["name"] in names) == len(names):
            return round(time.monotonic() - start, 2)
        time.sleep(0.2)
    return None


def summary(args: argparse.Namespace, kills: list[dict], version: str) -> dict:
    takeover = [k["takeover_s"] for k in kills]
    converge = [k["converged_s"] for k in kills if k["converged_s"] is not None]
    return {"kube_apiserver": version, "machine": machine_info(), "replicas": args.replicas, "inferenceservices": args.count,
            "lease_duration_s": 15, "renew_deadline_s": 10, "retry_period_s": 2,
            "kills": len(kills), "converged": len(converge),
            "duplicate_children": sum(k["duplicate_children"] for k in kills),
            "missing_children": sum(k["missing_children"] for k in kills),
            "token_changes": sum(k["token_changes"] for k in kills),
            "takeover_s": {"min": min(takeover), "p50": percentile(takeover, 0.5), "max": max(takeover)},
            "converged_s": {"min": min(converge, default=None), "p50": percentile(converge, 0.5),
                            "max": max(converge, default=None)},
            "per_kill": kills}


def print_table(result: dict) -> None:
    machine = result["machine"]
    print(f"kube-apiserver {result['kube_apiserver']}, {machine['cpu']}, {machine['cores']} cores, load average "
          f"{machine['loadavg'][0]:.2f}; {result['replicas']} replicas, {result['inferenceservices']} "
          f"InferenceServices rolling out at each kill")
    header = ("kill", "killed", "new leader", "lease taken s", "first reconcile s", "all Ready s", "dup", "missing",
              "tokens changed")
    rows = [header] + [(str(k["kill"]), k["killed"], k["new_leader"], str(k.get("lease_acquired_s", "-")),
                        str(k["takeover_s"]), str(k["converged_s"]), str(k["duplicate_children"]),
                        str(k["missing_children"]), str(k["token_changes"])) for k in result["per_kill"]]
    width = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, width)))
    t, c = result["takeover_s"], result["converged_s"]
    print(f"takeover (kill -> first reconcile) min / p50 / max: {t['min']} / {t['p50']} / {t['max']} s; "
          f"every resource Ready: {c['min']} / {c['p50']} / {c['max']} s; converged {result['converged']}/"
          f"{result['kills']}, duplicate children {result['duplicate_children']}, missing "
          f"{result['missing_children']}, admin tokens changed {result['token_changes']}")


if __name__ == "__main__":
    raise SystemExit(main())
