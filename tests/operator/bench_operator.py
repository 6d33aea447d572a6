"""Benchmark (not a test): the real operator on the test cluster with N InferenceServices
applied at once by one `kubectl apply`. Reports the time until all are Ready and the
reconcile latency from the resource's creation to its Deployment's creation (p50/p95).

    .venv/bin/python tests/operator/bench_operator.py [--count 100]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

import yaml

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from cluster.harness import TestCluster  # noqa: E402
from kube.tools import ROOT, Kubectl, Operator  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    example = yaml.safe_load((ROOT / "examples" / "inferenceservice-smollm2.yaml").read_text())
    with tempfile.TemporaryDirectory() as tmp, TestCluster(pathlib.Path(tmp)) as cluster:
        created: dict[tuple[str, str], float] = {}

        def record(store):  # timestamps of ADDED events, taken on the cluster's loop
            def listener(kind, rtype, obj, old):
                if kind == "ADDED" and rtype.kind in ("InferenceService", "Deployment"):
                    created.setdefault((rtype.kind, obj["metadata"]["name"]), time.monotonic())
            store.listeners.append(listener)
        cluster.call(record)
        kubectl = Kubectl(cluster.kubeconfig)
        kubectl.apply(ROOT / "crds" / "inferenceservices.kvpilot.dev.yaml")
        operator = Operator(cluster.kubeconfig, pathlib.Path(tmp) / "operator.log")
        operator.env["KVPILOT_RESYNC_SECONDS"] = "30"
        operator.start()
        time.sleep(2)  # let the operator start watching
        docs = []
        for i in range(args.count):
            doc = json.loads(json.dumps(example))
            doc["metadata"]["name"] = f"bench-{i:03d}"
            docs.append(doc)
        manifest = pathlib.Path(tmp) / "many.yaml"
        manifest.write_text(yaml.safe_dump_all(docs))
        start = time.monotonic()
        kubectl.apply(manifest)
        applied = time.monotonic() - start
        ready_at = None
        while time.monotonic() - start < args.timeout:
            items = cluster.objects("kvpilot.dev", "v1alpha1", "inferenceservices")
            ready = sum(1 for o in items if o.get("status", {}).get("observedGeneration") == o["metadata"]["generation"]
                        and any(c["type"] == "Ready" and c["status"] == "True" for c in o["status"].get("conditions", [])))
            if ready == args.count:
                ready_at = time.monotonic() - start
                break
            time.sleep(0.2)
        operator.stop()
        latencies = [created[("Deployment", f"bench-{i:03d}")] - created[("InferenceService", f"bench-{i:03d}")]
                     for i in range(args.count) if ("Deployment", f"bench-{i:03d}") in created]
    print(f"InferenceServices:          {args.count}")
    print(f"kubectl apply took:         {applied:.2f} s")
    print(f"all Ready after:            {ready_at:.2f} s" if ready_at else f"not all Ready within {args.timeout} s")
    if latencies:
        print(f"apply -> Deployment p50:    {statistics.median(latencies) * 1000:.0f} ms")
        print(f"apply -> Deployment p95:    {percentile(latencies, 0.95) * 1000:.0f} ms")
        print(f"apply -> Deployment max:    {max(latencies) * 1000:.0f} ms")
    return 0 if ready_at else 1


if __name__ == "__main__":
    raise SystemExit(main())
