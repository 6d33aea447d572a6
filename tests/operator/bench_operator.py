"""Benchmark (not a test): the operator at scale on a real control plane (tests/kube: etcd,
kube-apiserver, controller manager, scheduler, a kwok node whose pods turn Ready with no
container). The operator runs with the chart's command line as the chart's ServiceAccount.

Phase 1: N InferenceServices (default 200) applied by one `kubectl apply`, or with --parallel
P by P threads creating them at once: the time until every child (Deployment, Service,
ConfigMap, admin-token Secret, NetworkPolicy) exists and every status says Ready at its
generation; each resource's creationTimestamp -> Ready lastTransitionTime (p50/p99); the
operator's own reconcile histogram (kvpilot_operator_reconcile_duration_seconds on its metrics
port: p50/p99 and the number of reconciles). With --unrelated M, first M Deployments that are
not ours (replicas 0, no kvpilot labels) in the watched namespace: the operator's RSS and CPU
before and after them, and the labelSelector of its Deployment list and watch requests. Phase 2: spec changes at a fixed rate (default 10
per second for 60 s, spec.engine.seed of a random resource): the lag from a resource's latest
change to its Ready status at that generation (a change overtaken by the next one to the same
resource is not timed; --seconds 0 skips it). For each phase: the operator's CPU seconds, its peak RSS, and
the API requests it sent (from the API server's audit log) per reconcile.

    .venv/bin/python tests/operator/bench_operator.py [--count 200] [--rate 10] [--seconds 60] [--json PATH]
    .venv/bin/python tests/operator/bench_operator.py --count 1000 --parallel 16 --unrelated 1000 --seconds 0 \
        --json benchmarks/results/operator/scale-1000.json
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import datetime
import json
import pathlib
import random
import sys
import tempfile
import threading
import time
import urllib.parse

import psutil
import yaml

from kvpilot.loadgen.machine import loadavg, machine_info

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from kube.cluster import Cluster, standalone  # noqa: E402
from kube.nodes import node_manifest  # noqa: E402
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
        try:
            times = self.process.cpu_times()
        except psutil.Error:  # it exited: what it had used until then
            return self.cpu_s
        return times.user + times.system

    def peak_rss_bytes(self) -> int:
        return self._status_kib("VmHWM") * 1024

    def rss_bytes(self) -> int:
        return self._status_kib("VmRSS") * 1024

    def _status_kib(self, field: str) -> int:
        status = pathlib.Path(f"/proc/{self.process.pid}/status")
        for line in (status.read_text() if status.exists() else "").splitlines():  # gone once it exited
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
        return 0

    def phase(self) -> dict:
        """CPU seconds and API requests (in all, and by verb and resource) since the last call."""
        events = self.cluster.requests(self.username)
        cpu, new = self._cpu(), events[self.requests:]
        by_kind = collections.Counter(f"{e['verb']} {(e.get('objectRef') or {}).get('resource', e['requestURI'])}"
                                      + (f"/{e['objectRef']['subresource']}" if (e.get("objectRef") or {}).get(
                                          "subresource") else "") for e in new)
        served_s = [stamp(e["stageTimestamp"]) - stamp(e["requestReceivedTimestamp"])
                    for e in new if e["verb"] != "watch" and "stageTimestamp" in e]
        out = {"operator_cpu_s": round(cpu - self.cpu_s, 2), "api_requests": len(new),
               "api_server_latency_p50_s": round(percentile(served_s, 0.5), 3),
               "api_server_latency_p99_s": round(percentile(served_s, 0.99), 3),
               "api_requests_by_kind": dict(by_kind.most_common()), "operator_peak_rss_bytes": self.peak_rss_bytes()}
        self.cpu_s, self.requests = cpu, len(events)
        return out


def component_cpu_s(cluster: Cluster) -> dict[str, float]:
    """CPU seconds (user + system) each control-plane process has used so far: which of them
    the 2 cores went to."""
    out = {}
    for component in cluster.control_plane.processes:
        try:
            times = psutil.Process(component.proc.pid).cpu_times()
            out[component.name] = times.user + times.system
        except psutil.Error:
            out[component.name] = float("nan")
    return out


METADATA_ONLY = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"


def child_stamps(cluster: Cluster, group: str, version: str, plural: str) -> list[float]:
    """The creation times (epoch seconds, whole) of the objects of a kind that carry an
    InferenceService's label: a metadata-only list (PartialObjectMetadataList), so that the
    benchmark's own polling of 5,000 children costs the API server, on the same 2 cores, a
    fraction of full lists."""
    root = f"/api/{version}" if not group else f"/apis/{group}/{version}"
    path = f"{root}/namespaces/{cluster.namespace}/{plural}?labelSelector=kvpilot.dev%2Finferenceservice"
    items = json.loads(cluster.control_plane.api("GET", path, accept=METADATA_ONLY))["items"]
    return [stamp(o["metadata"]["creationTimestamp"]) for o in items]


def create_all(cluster: Cluster, path: str, docs: list[dict], parallel: int) -> None:
    """POST every document, `parallel` requests at a time (the admin's client certificate)."""
    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
        list(pool.map(lambda doc: cluster.control_plane.api("POST", path, doc), docs))


def apply_many(cluster: Cluster, kubectl: Kubectl, operator: Operator, count: int, timeout_s: float,
               workdir: pathlib.Path, parallel: int = 0) -> dict:
    example = yaml.safe_load((ROOT / "examples" / "inferenceservice-smollm2.yaml").read_text())
    docs = []
    for i in range(count):
        doc = json.loads(json.dumps(example))
        doc["metadata"]["name"] = f"bench-{i:03d}"
        doc["metadata"].pop("namespace", None)
        docs.append(doc)
    manifest = workdir / "many.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    start, start_epoch = time.monotonic(), time.time()
    if parallel:
        create_all(cluster, f"/apis/kvpilot.dev/v1alpha1/namespaces/{cluster.namespace}/inferenceservices",
                   docs, parallel)
    else:
        kubectl("apply", "-f", str(manifest), timeout=timeout_s)
    applied_s = time.monotonic() - start
    # The times come from the objects' own timestamps (whole seconds: children's creation, the
    # Ready condition's transition), so the poll only has to notice the end; at 1,000 it polls
    # every 5 s, since each full list of the resources costs the API server on the same 2 cores.
    children_s = ready_s = None
    items: list[dict] = []
    while time.monotonic() - start < timeout_s and ready_s is None and operator.proc.poll() is None:
        time.sleep(0.5 if count <= 200 else 5.0)
        try:
            if children_s is None:
                stamps = [child_stamps(cluster, *kind) for kind in CHILDREN]
                if all(len(kind) >= count for kind in stamps):
                    children_s = max(max(kind) for kind in stamps) - start_epoch
            items = cluster.objects("kvpilot.dev", "v1alpha1", "inferenceservices")
        except OSError as e:  # a list that timed out (10 s) on a saturated machine: poll again
            print(f"poll at {time.monotonic() - start:.0f} s: {e}", file=sys.stderr)
            continue
        if children_s is not None and sum(fresh_ready(o) for o in items) == count:
            ready_s = max(ready_stamp(o) for o in items) - start_epoch
    waits = [ready_stamp(o) - stamp(o["metadata"]["creationTimestamp"]) for o in items if fresh_ready(o)]  # creation -> Ready
    return {"count": count, "parallel_creates": parallel, "kubectl_apply_s": round(applied_s, 2),
            "operator_exit_code": operator.proc.poll(), "ready": sum(fresh_ready(o) for o in items),
            "not_ready": not_ready(cluster, [o for o in items if not fresh_ready(o)][:10]),
            "all_children_s": children_s and round(children_s, 2), "all_ready_s": ready_s and round(ready_s, 2),
            "created_to_ready_p50_s": round(percentile(waits, 0.5), 1),
            "created_to_ready_p99_s": round(percentile(waits, 0.99), 1)}


def ready_stamp(obj: dict) -> float:
    """When the Ready condition last turned (epoch seconds, whole)."""
    return stamp(next(c for c in obj["status"]["conditions"] if c["type"] == "Ready")["lastTransitionTime"])


def not_ready(cluster: Cluster, items: list[dict]) -> list[dict]:
    """What a resource that did not turn Ready shows: its status and its Deployment's."""
    out = []
    for obj in items:
        name = obj["metadata"]["name"]
        deployment = json.loads(cluster.control_plane.get(
            f"/apis/apps/v1/namespaces/{cluster.namespace}/deployments/{name}", quiet=True) or "{}")
        out.append({"name": name, "generation": obj["metadata"].get("generation"), "status": obj.get("status"),
                    "deployment_generation": (deployment.get("metadata") or {}).get("generation"),
                    "deployment_status": deployment.get("status")})
    return out


def stamp(text: str) -> float:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def histogram(text: str, name: str) -> dict[str, dict[float, float]]:
    """{handler: {le: cumulative count}} of a Prometheus histogram in exposition text."""
    out: dict[str, dict[float, float]] = collections.defaultdict(dict)
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            labels, value = line[len(name) + 8:].rsplit("} ", 1)
            fields = dict(part.split("=", 1) for part in labels.split(","))
            out[fields["handler"].strip('"')][float(fields["le"].strip('"'))] = float(value)
    return out


def histogram_quantile(buckets: dict[float, float], q: float) -> float:
    """Prometheus's histogram_quantile: linear within the bucket that holds the q-th observation."""
    edges = sorted(buckets)
    total = buckets[edges[-1]] if edges else 0
    if not total:
        return float("nan")
    rank, lower, below = q * total, 0.0, 0.0
    for edge in edges:
        if buckets[edge] >= rank:
            if edge == float("inf"):
                return lower
            return lower + (edge - lower) * (rank - below) / max(buckets[edge] - below, 1e-9)
        lower, below = edge, buckets[edge]
    return lower


def reconcile_latency(operator: Operator) -> dict:
    """The operator's reconcile histogram: reconciles and p50/p99 by handler and in all."""
    by_handler = histogram(operator.metrics(), "kvpilot_operator_reconcile_duration_seconds")
    merged: dict[float, float] = collections.Counter()
    for buckets in by_handler.values():
        merged.update(buckets)
    out = {}
    for handler, buckets in sorted({**by_handler, "all": dict(merged)}.items()):
        out[handler] = {"reconciles": int(buckets.get(float("inf"), 0)),
                        "p50_s": round(histogram_quantile(buckets, 0.5), 3),
                        "p99_s": round(histogram_quantile(buckets, 0.99), 3)}
    return out


def unrelated_deployments(cluster: Cluster, meter: Meter, count: int, parallel: int, settle_s: float = 15) -> dict:
    """`count` Deployments that are not the operator's (replicas 0, no kvpilot label) in the
    watched namespace: the operator's RSS and CPU before and after (then `settle_s` of quiet)."""
    template = {"apiVersion": "apps/v1", "kind": "Deployment",
                "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "other"}},
                         "template": {"metadata": {"labels": {"app": "other"}},
                                      "spec": {"containers": [{"name": "c", "image": "example.invalid/other:1"}]}}}}
    docs = [{**template, "metadata": {"name": f"other-{i:04d}", "labels": {"app": "other"}}} for i in range(count)]
    rss_before, cpu_before = meter.rss_bytes(), meter._cpu()
    start = time.monotonic()
    create_all(cluster, f"/apis/apps/v1/namespaces/{cluster.namespace}/deployments", docs, parallel)
    created_s = time.monotonic() - start
    time.sleep(settle_s)
    return {"unrelated_deployments": count, "created_s": round(created_s, 2),
            "operator_rss_before_bytes": rss_before, "operator_rss_after_bytes": meter.rss_bytes(),
            "operator_cpu_s": round(meter._cpu() - cpu_before, 2)}


def deployment_watch_uris(cluster: Cluster, username: str) -> list[str]:
    """The operator's list and watch requests for Deployments (their URIs: is a labelSelector on them?)."""
    return sorted({urllib.parse.unquote(e["requestURI"]).split("&resourceVersion")[0]
                   for e in cluster.requests(username)
                   if e["verb"] in ("list", "watch") and (e.get("objectRef") or {}).get("resource") == "deployments"})


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
    parser.add_argument("--parallel", type=int, default=0,
                        help="create the InferenceServices with this many concurrent POSTs (default: one kubectl apply)")
    parser.add_argument("--no-leader-elect", action="store_true", help="the operator without the chart's --leader-elect")
    parser.add_argument("--operator-log", type=pathlib.Path, help="keep the operator's log here")
    parser.add_argument("--unrelated", type=int, default=0,
                        help="first create this many Deployments that are not the operator's, in its namespace")
    parser.add_argument("--disable-qps-limits", action="store_true",
                        help="kube-controller-manager and kube-scheduler without their client rate limits "
                             "(kwokctl's --disable-qps-limits: 5000 QPS, burst 10000)")
    parser.add_argument("--memray", type=pathlib.Path,
                        help="run the operator under memray (pip install memray) and write its capture here: "
                             "where the peak memory was allocated (memray tree / flamegraph FILE)")
    parser.add_argument("--json", type=pathlib.Path, default=ROOT / "benchmarks" / "results" / "operator" / "scale.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, standalone(pathlib.Path(tmp), "bench", audit=True,
                                                                   service_cidr="10.0.0.0/20",
                                                                   disable_qps_limits=args.disable_qps_limits) as cluster:
        kubectl = Kubectl(cluster.kubeconfig)
        for extra in range(1, (args.count + 2 + 999) // 1000):  # a kwok node holds 1,000 pods: the engines and 2 operators
            cluster.control_plane.api("POST", "/api/v1/nodes", node_manifest(f"kwok-node-{extra}"))
        release = Release(cluster, "kv").install()
        operator = Operator(release.operator_kubeconfig(pathlib.Path(tmp) / "sa.kubeconfig"),
                            pathlib.Path(tmp) / "operator.log", cluster.namespace, release.name)
        operator.env["KVPILOT_RESYNC_SECONDS"] = "300"  # the chart's default
        if args.no_leader_elect:
            operator.args.append("--no-leader-elect")
        if args.memray:
            operator.python = [sys.executable, "-m", "memray", "run", "--aggregate", "--force", "-o", str(args.memray)]
        operator.start()
        meter = Meter(operator, cluster, release.username)
        load_before = loadavg()
        unrelated = unrelated_deployments(cluster, meter, args.unrelated, args.parallel or 16) if args.unrelated else {}
        meter.phase()
        cpu_before, wall_before = component_cpu_s(cluster), time.monotonic()
        create = {**apply_many(cluster, kubectl, operator, args.count, args.timeout, pathlib.Path(tmp), args.parallel),
                  **meter.phase()}
        create["wall_s"] = round(time.monotonic() - wall_before, 1)
        create["component_cpu_s"] = {name: round(cpu - cpu_before[name], 1)
                                     for name, cpu in component_cpu_s(cluster).items()}
        create["api_requests_per_reconcile"] = round(create["api_requests"] / args.count, 1)
        create["reconcile_latency"] = reconcile_latency(operator)
        reconciles = create["reconcile_latency"].get("all", {}).get("reconciles")
        create["api_requests_per_histogram_reconcile"] = reconciles and round(create["api_requests"] / reconciles, 1)
        create["deployment_list_watch_uris"] = deployment_watch_uris(cluster, release.username)
        change = {}
        if args.seconds > 0:
            change = {**change_specs(cluster, args.count, args.rate, args.seconds, args.timeout), **meter.phase()}
            change["api_requests_per_reconcile"] = round(change["api_requests"] / max(1, change["changes"]), 1)
        version = cluster.control_plane.version["gitVersion"]
        operator.stop()
        if args.operator_log:
            args.operator_log.write_bytes(operator.log.read_bytes())
    result = {"kube_apiserver": version, "controller_qps_limits": not args.disable_qps_limits,
              "command": " ".join(["tests/operator/bench_operator.py", *sys.argv[1:]]),
              "machine": machine_info(loadavg_before=load_before), "unrelated": unrelated, "create": create,
              "change": change}
    print_table(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0 if create["all_ready_s"] and not change.get("not_converged") else 1


def print_table(result: dict) -> None:
    create, change, unrelated = result["create"], result["change"], result["unrelated"]
    how = f"{create['parallel_creates']} parallel POSTs" if create["parallel_creates"] else "one kubectl apply"
    latency = create["reconcile_latency"]
    rows = [("phase", "what", "value")]
    if unrelated:
        rows += [("before", f"{unrelated['unrelated_deployments']} Deployments not ours: operator RSS before / after",
                  f"{unrelated['operator_rss_before_bytes'] / 2**20:.0f} / "
                  f"{unrelated['operator_rss_after_bytes'] / 2**20:.0f} MiB"),
                 ("before", "operator CPU while they were created", f"{unrelated['operator_cpu_s']} s")]
    rows += [("create", f"{create['count']} InferenceServices, {how}", f"{create['kubectl_apply_s']} s"),
             ("create", "every child exists", f"{create['all_children_s']} s"),
             ("create", "every status Ready at its generation", f"{create['all_ready_s']} s"),
             ("create", "creation -> Ready per resource p50 / p99",
              f"{create['created_to_ready_p50_s']} / {create['created_to_ready_p99_s']} s"),
             *[("create", f"reconcile ({handler}) p50 / p99, count",
                f"{v['p50_s']} / {v['p99_s']} s, {v['reconciles']}") for handler, v in latency.items()],
             ("create", "operator CPU", f"{create['operator_cpu_s']} s"),
             ("create", f"control plane CPU in the phase's {create['wall_s']} s",
              ", ".join(f"{k} {v} s" for k, v in create["component_cpu_s"].items())),
             ("create", "API requests per InferenceService / per reconcile",
              f"{create['api_requests_per_reconcile']} / {create['api_requests_per_histogram_reconcile']}"),
             ("create", "operator peak RSS", f"{create['operator_peak_rss_bytes'] / 2**20:.0f} MiB"),
             ("create", "the operator's requests: time in the API server p50 / p99 (audit log)",
              f"{create['api_server_latency_p50_s']} / {create['api_server_latency_p99_s']} s")]
    if not change:
        return print_rows(result, rows)
    rows += [("change", f"{change['changes']} spec changes asked at {change['rate_per_s']}/s",
             f"{change['achieved_rate_per_s']}/s sent for {change['seconds']} s"),
            ("change", "lag to Ready status p50 / p95 / max",
             f"{change['lag_p50_s']} / {change['lag_p95_s']} / {change['lag_max_s']} s"),
            ("change", "not converged", f"{change['not_converged']}"),
            ("change", "operator CPU", f"{change['operator_cpu_s']} s"),
            ("change", "API requests per reconcile", f"{change['api_requests_per_reconcile']}"),
            ("both", "operator peak RSS", f"{change['operator_peak_rss_bytes'] / 2**20:.0f} MiB")]
    print_rows(result, rows)


def print_rows(result: dict, rows: list[tuple[str, str, str]]) -> None:
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    machine = result["machine"]
    print(f"kube-apiserver {result['kube_apiserver']}, {machine['cpu']}, {machine['cores']} cores, "
          f"load average {machine['loadavg_after'][0]:.2f}")
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, width)))


if __name__ == "__main__":
    raise SystemExit(main())
