"""Benchmark (not a test): the operator at scale on a real control plane (tests/kube: etcd,
kube-apiserver, controller manager, scheduler, a kwok node whose pods turn Ready with no
container). The operator runs with the chart's command line as the chart's ServiceAccount.

Phase 1: N InferenceServices (default 200) applied by one `kubectl apply`: the time until
every child (Deployment, Service, ConfigMap, admin-token Secret, NetworkPolicy) exists and
every status says Ready at its generation. Phase 2: spec changes at a fixed rate (default 10
per second for 60 s, spec.engine.seed of a random resource): the lag from a resource's latest
change to its Ready status at that generation (a change overtaken by the next one to the same
resource is not timed). For each phase: the operator's CPU seconds, its peak RSS, and
the API requests it sent (from the API server's audit log) per reconcile.

    .venv/bin/python tests/operator/bench_operator.py [--count 200] [--rate 10] [--seconds 60] [--json PATH]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import platform
import random
import sys
import tempfile
import threading
import time

import psutil
import yaml

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from kube.cluster import Cluster, standalone  # noqa: E402
from kube.release import Release  # noqa: E402
from kube.tools import ROOT, Kubectl, Operator  # noqa: E402

CHILDREN = (("apps", "v1", "deployments"), ("", "v1", "services"), ("", "v1", "configmaps"),
            ("", "v1", "secrets"), ("networking.k8s.io", "v1", "networkpolicies"))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else float("nan")


def fresh_ready(obj: dict) -> bool:
    status = obj.get("status") or {}
    return status.get("observedGeneration") == obj["metadata"]["generation"] and any(
        c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", ()))


class Meter:
    """The operator process's CPU seconds and peak RSS (VmHWM, Linux), and its API requests."""

    def __init__(self, operator: Operator, cluster: Cluster, username: str):
        self.process = psutil.Process(operator.proc.pid)
        self.cluster, self.username = cluster, username
        self.cpu_s, self.requests = self._cpu(), len(cluster.requests(username))

    def _cpu(self) -> float:
        times = self.process.cpu_times()
        return times.user + times.system

    def peak_rss_bytes(self) -> int:
        for line in pathlib.Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return self.process.memory_info().rss

    def phase(self) -> dict:
        """CPU seconds and API requests (in all, and by verb and resource) since the last call."""
        events = self.cluster.requests(self.username)
        cpu, new = self._cpu(), events[self.requests:]
        by_kind = collections.Counter(f"{e['verb']} {(e.get('objectRef') or {}).get('resource', e['requestURI'])}"
                                      + (f"/{e['objectRef']['subresource']}" if (e.get("objectRef") or {}).get(
                                          "subresource") else "") for e in new)
        out = {"operator_cpu_s": round(cpu - self.cpu_s, 2), "api_requests": len(new),
               "api_requests_by_kind": dict(by_kind.most_common()), "operator_peak_rss_bytes": self.peak_rss_bytes()}
        self.cpu_s, self.requests = cpu, len(events)
        return out


def apply_many(cluster: Cluster, kubectl: Kubectl, count: int, timeout_s: float, workdir: pathlib.Path) -> dict:
    example = yaml.safe_load((ROOT / "examples" / "inferenceservice-smollm2.yaml").read_text())
    docs = []
    for i in range(count):
        doc = json.loads(json.dumps(example))
        doc["metadata"]["name"] = f"bench-{i:03d}"
        docs.append(doc)
    manifest = workdir / "many.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    start = time.monotonic()
    kubectl("apply", "-f", str(manifest), timeout=timeout_s)
    applied_s = time.monotonic() - start
    children_s = ready_s = None
    while time.monotonic() - start < timeout_s and ready_s is None:
        if children_s is None and all(
                len([o for o in cluster.objects(*kind) if o["metadata"]["name"].startswith("bench-")]) >= count
                for kind in CHILDREN):
            children_s = time.monotonic() - start
        items = cluster.objects("kvpilot.dev", "v1alpha1", "inferenceservices")
        if children_s is not None and sum(fresh_ready(o) for o in items) == count:
            ready_s = time.monotonic() - start
        time.sleep(0.5)
    return {"count": count, "kubectl_apply_s": round(applied_s, 2),
            "all_children_s": children_s and round(children_s, 2), "all_ready_s": ready_s and round(ready_s, 2)}


def change_specs(cluster: Cluster, count: int, rate: float, seconds: float, timeout_s: float) -> dict:
    """`rate` merge patches per second (spec.engine.seed of a random resource) for `seconds`,
    while a watcher thread lists the resources every 0.2 s: the lag from each resource's latest
    change to a Ready status at (or past) that generation."""
    rng = random.Random(31)
    path = f"/apis/kvpilot.dev/v1alpha1/namespaces/{cluster.namespace}/inferenceservices"
    pending: dict[str, tuple[int, float]] = {}  # name -> (generation, when) of its latest unobserved change
    lags: list[float] = []
    lock, sending_done = threading.Lock(), threading.Event()

    def watch() -> None:
        deadline = None
        while True:
            items = cluster.objects("kvpilot.dev", "v1alpha1", "inferenceservices")
            now = time.monotonic()
            with lock:
                for obj in items:
                    name = obj["metadata"]["name"]
                    if name in pending and fresh_ready(obj) and obj["status"]["observedGeneration"] >= pending[name][0]:
                        lags.append(now - pending.pop(name)[1])
                if sending_done.is_set():
                    deadline = deadline or now + timeout_s
                    if not pending or now > deadline:
                        return
            time.sleep(0.2)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    start, n, changed = time.monotonic(), 0, set()
    while time.monotonic() - start < seconds:
        time.sleep(max(0.0, start + n / rate - time.monotonic()))
        name = f"bench-{rng.randrange(count):03d}"
        answer = json.loads(cluster.control_plane.api(
            "PATCH", f"{path}/{name}", {"spec": {"engine": {"seed": n + 1}}}, "application/merge-patch+json"))
        with lock:
            pending[name] = (answer["metadata"]["generation"], time.monotonic())
        changed.add(name)
        n += 1
    elapsed = time.monotonic() - start
    sending_done.set()
    watcher.join()
    return {"changes": n, "rate_per_s": rate, "achieved_rate_per_s": round(n / elapsed, 1), "seconds": seconds,
            "resources_changed": len(changed), "not_converged": len(pending),
            "lag_p50_s": round(percentile(lags, 0.5), 2), "lag_p95_s": round(percentile(lags, 0.95), 2),
            "lag_max_s": round(max(lags, default=float("nan")), 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--rate", type=float, default=10.0, help="spec changes per second in phase 2")
    parser.add_argument("--seconds", type=float, default=60.0, help="length of phase 2")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", type=pathlib.Path, default=ROOT / "benchmarks" / "results" / "operator" / "scale.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, standalone(pathlib.Path(tmp), "bench", audit=True) as cluster:
        kubectl = Kubectl(cluster.kubeconfig)
        release = Release(cluster, "kv").install()
        operator = Operator(release.operator_kubeconfig(pathlib.Path(tmp) / "sa.kubeconfig"),
                            pathlib.Path(tmp) / "operator.log", cluster.namespace, release.name)
        operator.env["KVPILOT_RESYNC_SECONDS"] = "30"  # the chart's default
        operator.start()
        meter = Meter(operator, cluster, release.username)
        meter.phase()
        create = {**apply_many(cluster, kubectl, args.count, args.timeout, pathlib.Path(tmp)), **meter.phase()}
        create["api_requests_per_reconcile"] = round(create["api_requests"] / args.count, 1)
        change = {**change_specs(cluster, args.count, args.rate, args.seconds, args.timeout), **meter.phase()}
        change["api_requests_per_reconcile"] = round(change["api_requests"] / max(1, change["changes"]), 1)
        version = cluster.control_plane.version["gitVersion"]
        operator.stop()
    result = {"kube_apiserver": version, "cpu": platform.processor() or platform.machine(),
              "cpu_model": cpu_model(), "cores": os.cpu_count(), "load_average": os.getloadavg(),
              "create": create, "change": change}
    print_table(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0 if create["all_ready_s"] and not change["not_converged"] else 1


def cpu_model() -> str:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def print_table(result: dict) -> None:
    create, change = result["create"], result["change"]
    rows = [("phase", "what", "value"),
            ("create", f"{create['count']} InferenceServices, one kubectl apply", f"{create['kubectl_apply_s']} s"),
            ("create", "every child exists", f"{create['all_children_s']} s"),
            ("create", "every status Ready at its generation", f"{create['all_ready_s']} s"),
            ("create", "operator CPU", f"{create['operator_cpu_s']} s"),
            ("create", "API requests per reconcile", f"{create['api_requests_per_reconcile']}"),
            ("change", f"{change['changes']} spec changes asked at {change['rate_per_s']}/s",
             f"{change['achieved_rate_per_s']}/s sent for {change['seconds']} s"),
            ("change", "lag to Ready status p50 / p95 / max",
             f"{change['lag_p50_s']} / {change['lag_p95_s']} / {change['lag_max_s']} s"),
            ("change", "not converged", f"{change['not_converged']}"),
            ("change", "operator CPU", f"{change['operator_cpu_s']} s"),
            ("change", "API requests per reconcile", f"{change['api_requests_per_reconcile']}"),
            ("both", "operator peak RSS", f"{change['operator_peak_rss_bytes'] / 2**20:.0f} MiB")]
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    print(f"kube-apiserver {result['kube_apiserver']}, {result['cpu_model']}, {result['cores']} cores, "
          f"load average {result['load_average'][0]:.2f}")
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, width)))


if __name__ == "__main__":
    raise SystemExit(main())
