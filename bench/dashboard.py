"""kvpilot bench dashboard: what the Grafana dashboard shows, drawn with matplotlib, since no
Grafana server is installable here. It records a load window on a real `kvpilot serve`
(ShareGPT prompts, a small KV cache so that preemptions happen) scraped by a real Prometheus
together with the tuner's series (kvpilot.api.tuning_metrics), changes the engine's
max_num_seqs live half-way (a rollout) and records each half as a tuner trial (verdict from
its measured p95s against spec.slo); then it runs every panel's own PromQL from charts/kvpilot/dashboards/kvpilot.json
over the window and writes one PNG per dashboard row into --out.

    kvpilot bench dashboard --seconds 120 --out benchmarks/results/dashboard
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from kvpilot.api.spec import SLOSpec
from kvpilot.api.tuning_metrics import TunerMetrics
from kvpilot.bench.harness.prometheus import Prometheus
from kvpilot.bench.harness.server_process import ServerProcess
from kvpilot.engine.settings import flag_words
from kvpilot.loadgen.datasets import sharegpt_pairs
from kvpilot.loadgen.process import KVPILOT_SERVE, REPO_ROOT, free_port

DASHBOARD = REPO_ROOT / "charts" / "kvpilot" / "dashboards" / "kvpilot.json"
LABELS = {"namespace": "default", "app_kubernetes_io_instance": "smollm2", "pod": "smollm2-0"}
ROWS = {  # PNG name -> dashboard panel titles
    "latency": ["Time to first token (p50/p95/p99)", "Inter-token latency (p50/p95/p99)",
                "End-to-end request latency (p50/p95/p99)"],
    "preemptions": ["Preemptions per minute"],
    "kv_cache": ["KV-cache usage", "Prefix-cache hit rate"],
    "queue": ["Running and waiting requests", "Queue time (p50/p95)"],
    "tuning": ["Tuning: last trial", "Tuning: best goodput", "Tuning: trials by verdict"],
}
ENGINE = [word for name, value in {"max_model_len": 384, "max_num_seqs": 4, "num_gpu_blocks_override": 24,
                                   "block_size": 16, "dtype": "float32", "enable_prefix_caching": True}.items()
          for word in flag_words(name, value)]


def parse(argv: list[str]) -> argparse.Namespace:
    """`kvpilot bench dashboard`'s flags: the load window (seconds), the closed-loop concurrency,
    the output folder, the plot step and $__rate_interval (seconds). Exits 2 on bad flags (argparse)."""
    p = argparse.ArgumentParser(prog="kvpilot bench dashboard", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=120.0, help="length of the recorded load window")
    p.add_argument("--concurrency", type=int, default=4,
                   help="closed-loop clients (4 = max_num_seqs: the KV cache overflows)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/dashboard"))
    p.add_argument("--step", type=float, default=2.0, help="seconds between plotted points")
    p.add_argument("--rate-interval", type=int, default=30,
                   help="seconds substituted for $__rate_interval (Grafana widens it with the time range; a few "
                   "scrapes would leave the latency quantiles blank between finished requests)")
    a = p.parse_args(argv)
    if a.seconds < 30 or a.concurrency < 1 or a.step <= 0:
        p.error("--seconds must be >= 30, --concurrency >= 1, --step > 0")
    return a


def run_load(url: str, seconds: float, concurrency: int, slo: SLOSpec) -> list[dict]:
    """Closed-loop streamed ShareGPT completions until `seconds` pass; per request: start,
    TTFT, mean ITL and tokens, as the client saw them."""
    prompts = [(p[:300], max(16, min(128, len(r) // 4))) for p, r in sharegpt_pairs()][:500]
    done: list[dict] = []
    lock, next_i, stop_at = threading.Lock(), [0], time.time() + seconds

    def client() -> None:
        with httpx.Client(base_url=url, timeout=600) as http:
            while time.time() < stop_at:
                with lock:
                    prompt, max_tokens = prompts[next_i[0] % len(prompts)]
                    next_i[0] += 1
                start, first, n = time.time(), None, 0
                body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
                with http.stream("POST", "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            first = first or time.time()
                            n += 1
                end = time.time()
                with lock:
                    done.append({"start": start, "ttft": (first or end) - start, "tokens": n,
                                 "itl": (end - (first or end)) / max(n - 1, 1)})

    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(client) for _ in range(concurrency)]:
            f.result()
    return done


def trial_verdict(requests: list[dict], slo: SLOSpec, seconds: float) -> tuple[str, float]:
    """'measured' when the p95 TTFT and ITL are within the SLO, else 'violates'; goodput in
    requests/s meeting both per request (the tuner's definition)."""
    def p95(xs: list[float]) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, math.ceil(0.95 * len(xs)) - 1)] if xs else math.inf
    ok = [r for r in requests if r["ttft"] * 1000 <= slo.ttftP95Ms and r["itl"] * 1000 <= slo.itlP95Ms]
    within = p95([r["ttft"] for r in requests]) * 1000 <= slo.ttftP95Ms and \
        p95([r["itl"] for r in requests]) * 1000 <= slo.itlP95Ms
    return ("measured" if within else "violates"), len(ok) / seconds


def render(prometheus: Prometheus, start: float, end: float, step: float, rate_interval_s: int,
           events: dict[str, list[float]], out: Path) -> list[Path]:
    """One PNG per row of ROWS: each panel's targets as lines (SLO dashed red), with the
    rollout and trial times (the dashboard's annotations) as vertical lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = {p["title"]: p for p in json.loads(DASHBOARD.read_text())["panels"]}
    rate = f"{rate_interval_s}s"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for row, titles in ROWS.items():
        fig, axes = plt.subplots(1, len(titles), figsize=(6.5 * len(titles), 3.8), squeeze=False)
        for ax, title in zip(axes[0], titles):
            for target in panels[title]["targets"]:
                expr = (target["expr"].replace("$__rate_interval", rate).replace("$namespace", LABELS["namespace"])
                        .replace("$isvc", LABELS["app_kubernetes_io_instance"]))
                for series in prometheus.query_range(expr, start, end, step):
                    xs = [float(t) - start for t, _ in series["values"]]
                    ys = [float(v) for _, v in series["values"]]
                    legend = target.get("legendFormat", "")
                    for key, value in series["metric"].items():
                        legend = legend.replace("{{" + key + "}}", value)
                    slo = legend == "SLO"
                    ax.plot(xs, ys, "--" if slo else "-", color="red" if slo else None, label=legend, lw=1.4)
            for name, color in (("rollout", "orange"), ("trial", "purple")):
                for i, t in enumerate(events.get(name, [])):
                    ax.axvline(t - start, color=color, ls=":", lw=1, label=name if i == 0 else None)
            unit = panels[title]["fieldConfig"]["defaults"].get("unit", "")
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("seconds into the window")
            ax.set_ylabel(unit)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="upper left")
        fig.tight_layout()
        path = out / f"{row}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str]) -> int:
    """Runs `kvpilot serve` under a real Prometheus beside the tuner's metrics exporter, drives two
    trials (max_num_seqs 4, then 2 applied live through /admin/scheduler_config) of closed-loop
    load, and draws every dashboard row as a PNG under --out from its panels' PromQL (charts/
    kvpilot/dashboards/kvpilot.json) over the window. Returns 0; raises ServerRefused when the
    server does not start."""
    a = parse(argv)
    # Limits this 2-core CPU machine can meet at max_num_seqs 4 (SmolLM2 in fp32).
    slo = SLOSpec(ttftP95Ms=20000, itlP95Ms=1000, e2eP95Ms=0, maxPreemptionsPerMin=5)
    work = Path(tempfile.mkdtemp(prefix="kvpilot-dashboard-"))
    tuner = TunerMetrics(LABELS["namespace"], LABELS["app_kubernetes_io_instance"])
    tuner.set_spec_slo(slo)
    exporter = free_port()
    tuner.serve(exporter, addr="127.0.0.1")
    server = ServerProcess([*KVPILOT_SERVE, *ENGINE, "--host", "127.0.0.1"], work / "server.log")
    prometheus = Prometheus(work, [
        {"job_name": "kvpilot", "static_configs": [{"targets": [f"127.0.0.1:{server.port}"], "labels": LABELS}]},
        {"job_name": "kvpilot-tuner", "honor_labels": True, "static_configs": [{"targets": [f"127.0.0.1:{exporter}"]}]},
    ])
    try:
        server.start()
        time.sleep(8)  # Prometheus' first scrapes
        start, events = time.time(), {"rollout": [], "trial": []}
        half = a.seconds / 2
        best = None
        for number, seqs in enumerate((4, 2)):
            if number:
                httpx.post(f"{server.base_url}/admin/scheduler_config", json={"max_num_seqs": seqs}, timeout=60)
                events["rollout"].append(time.time())
            requests = run_load(server.base_url, half, a.concurrency, slo)
            verdict, goodput = trial_verdict(requests, slo, half)
            best = max(goodput, best or 0.0) if verdict == "measured" else best
            tuner.record(number, verdict, best, {"max_num_seqs": seqs, "max_num_batched_tokens": 2048,
                                                 "enable_chunked_prefill": True}, best)
            events["trial"].append(time.time())
            print(f"trial {number}: max_num_seqs {seqs}: {len(requests)} requests, {verdict}, "
                  f"goodput {goodput:.3f} req/s", flush=True)
        time.sleep(4)
        for path in render(prometheus, start - 5, time.time(), a.step, a.rate_interval, events, a.out):
            print(f"wrote {path}")
    finally:
        server.stop()
        prometheus.stop()
    return 0
