"""`kvpilot bench retune`: continuous tuning against a workload shift, beside tuning once.

Each arm runs what a user runs, `kvpilot tune --local --continuous` (a subprocess: the engine,
the trials on live traffic, the watcher), and sends it live traffic with `kvpilot bench serve`
(vLLM's `vllm bench serve` flags; random prompts of a fixed length at a Poisson rate): phase A
for --phase-a-s seconds, then phase B (longer prompts and replies, another rate) for
--phase-b-s. The first study has --first-trials trials (1: the --settled settings, two
requests at once, which phase A's short replies never exceed; phase B's long replies keep
each request running 8x longer, so two at once serve half its rate, requests queue and TTFT
breaks, while more at once serve it). Arms:
- `continuous`: the watcher re-tunes when the SLOs break (--breach-windows) or the shape moves;
- `once`: the same session with re-tunes held back for ever (a cool-down longer than the run),
  so its watch windows measure what tuning once leaves running after the shift.
From each arm's timeline (REPORT_DIR/ARM/timeline.json): windows from the shift to the
trigger, the re-tune's trials, and before the shift, between the shift and the re-tune's
outcome, and after it: the share of watch windows that broke no SLO (latency p95s and
preemptions per minute) and the mean request attainment (the share of requests within the
latency SLOs). Prints a table and writes JSON with the CPU and the load.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvpilot.engine.settings import BY_NAME
from kvpilot.engine.settings.env import VLLM_API_KEY
from kvpilot.loadgen.machine import loadavg, machine_info
from kvpilot.loadgen.process import free_port
from kvpilot.tuner.benchmark.windows import DEFAULT_MODEL

ARMS = ("continuous", "once")


def _phase(text: str) -> tuple[int, int, float]:
    """'INPUT,OUTPUT,RATE': prompt and reply tokens, requests/s."""
    i, o, r = text.split(",")
    return int(i), int(o), float(r)


def parse(argv: list[str]) -> argparse.Namespace:
    """`kvpilot bench retune`'s flags: the arms, each phase as IN,OUT,RATE (prompt and reply
    tokens, req/s) and its length (s), the watch and live windows (s), the SLOs, the report
    folder. Exits 2 on bad flags (argparse)."""
    p = argparse.ArgumentParser(prog="kvpilot bench retune", description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default="continuous,once")
    p.add_argument("--phase-a", type=_phase, default=(32, 16, 1.5), metavar="IN,OUT,RATE")
    p.add_argument("--phase-b", type=_phase, default=(64, 128, 1.0), metavar="IN,OUT,RATE")
    p.add_argument("--range-ratio", type=float, default=0.0, help="prompt and reply lengths vary by this "
                   "fraction (vllm bench serve's --random-range-ratio); 0: the phase's lengths exactly")
    p.add_argument("--phase-a-s", type=float, default=200.0)
    p.add_argument("--phase-b-s", type=float, default=420.0)
    p.add_argument("--watch-seconds", type=float, default=40.0)
    p.add_argument("--live-seconds", type=float, default=40.0, help="one trial's window on the live traffic")
    p.add_argument("--breach-windows", type=int, default=2)
    p.add_argument("--first-trials", type=int, default=1)
    p.add_argument("--retune-trials", type=int, default=4)
    p.add_argument("--settled", default="max_num_seqs=2", metavar="NAME=VALUE,...",
                   help="the settings running before the shift (the first study's trial 0): two requests at once, "
                   "plenty for phase A's short replies")
    p.add_argument("--search", default="2:64", metavar="LOW:HIGH", help="max_num_seqs range searched; the token "
                   "budget, chunked prefill and the memory fraction are pinned")
    p.add_argument(BY_NAME["max_model_len"].flag, type=int, default=2048)
    p.add_argument("--slo", default="ttft=3000,itl=1000,preemptions=0", help="ms; preemptions per minute")
    p.add_argument("--tune-arg", action="append", default=[], help="more `kvpilot tune` flags")
    p.add_argument("--report-dir", type=Path, default=None)
    p.add_argument("--output-json", type=Path, default=None)
    a = p.parse_args(argv)
    a.arms = [x for x in a.arms.split(",") if x]
    if set(a.arms) - set(ARMS):
        p.error(f"--arms: choose from {ARMS}")
    a.slo = dict(kv.split("=") for kv in a.slo.split(","))
    a.settled = dict(kv.split("=") for kv in a.settled.split(",") if kv)
    a.report_dir = a.report_dir or Path(tempfile.mkdtemp(prefix="kvpilot-retune-"))
    return a


def tune_command(a: argparse.Namespace, arm: str, port: int, report_dir: Path) -> list[str]:
    """The `kvpilot tune --local --continuous` command of one arm."""
    return [sys.executable, "-P", "-m", "kvpilot.cli.main", "tune", "--local", "--continuous", BY_NAME["port"].flag, str(port),
            "--live-seconds", str(a.live_seconds), "--watch-seconds", str(a.watch_seconds),
            "--breach-windows", str(a.breach_windows), "--trials", str(a.first_trials),
            "--retune-trials", str(a.retune_trials), "--remeasure-top", "0", BY_NAME["max_model_len"].flag, str(a.max_model_len),
            *(f"--engine-arg=--{k.replace('_', '-')}={v}" for k, v in a.settled.items()),
            BY_NAME["max_num_seqs"].flag, a.search, "--pin", "enable_chunked_prefill,max_num_batched_tokens,gpu_memory_utilization",
            "--slo-ttft-ms", a.slo.get("ttft", "20000"), "--slo-itl-ms", a.slo.get("itl", "2000"),
            "--max-preemptions-per-min", a.slo.get("preemptions", "0"),
            "--cooldown-s", "0" if arm == "continuous" else "1e9", "--max-studies-per-hour", "60",
            "--report-dir", str(report_dir), *a.tune_arg]


def load_command(base_url: str, phase: tuple[int, int, float], seconds: float, seed: int,
                 range_ratio: float = 0.0) -> list[str]:
    """`kvpilot bench serve` of one phase: random prompts, Poisson arrivals, for about `seconds`."""
    i, o, rate = phase
    return [sys.executable, "-P", "-m", "kvpilot.cli.main", "bench", "serve", "--base-url", base_url,
            "--dataset-name", "random", "--random-input-len", str(i), "--random-output-len", str(o),
            "--random-range-ratio", str(range_ratio), "--request-rate", str(rate), "--num-prompts", str(max(1, int(rate * seconds))),
            "--ignore-eos", "--disable-tqdm", BY_NAME["seed"].flag, str(seed), "--model", DEFAULT_MODEL]


def wait_for_engine(base_url: str, key: str, timeout_s: float = 300.0) -> None:
    """Blocks until the engine answers /v1/models. Raises TimeoutError."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5).is_success:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"no engine at {base_url} within {timeout_s:.0f} s")


def run_arm(a: argparse.Namespace, arm: str) -> dict[str, Any]:
    """One arm: the tuner, phase A's load, then phase B's; returns the arm's figures."""
    out = a.report_dir / arm
    out.mkdir(parents=True, exist_ok=True)
    port, key = free_port(), secrets.token_hex(8)
    base_url = f"http://127.0.0.1:{port}"
    env = {**os.environ, VLLM_API_KEY: key, "OPENAI_API_KEY": key}  # never on a command line
    load_before = loadavg()
    with open(out / "tune.log", "w") as log:
        tuner = subprocess.Popen(tune_command(a, arm, port, out), env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for_engine(base_url, key)
            started = time.time()
            run_phase(base_url, a.phase_a, a.phase_a_s, env, out / "load-a.log", 1, a.range_ratio)
            shift_s = time.time()
            run_phase(base_url, a.phase_b, a.phase_b_s, env, out / "load-b.log", 2, a.range_ratio)
        finally:
            tuner.send_signal(signal.SIGINT)  # the session writes its timeline and stops the engine
            try:
                tuner.wait(120)
            except subprocess.TimeoutExpired:
                tuner.kill()
    timeline = json.loads((out / "timeline.json").read_text())
    return {"arm": arm, **figures(timeline, started, shift_s), "loadavg_before": load_before,
            "loadavg_after": loadavg(), "report_dir": str(out)}


def run_phase(base_url: str, phase: tuple[int, int, float], seconds: float, env: dict[str, str], log: Path,
              seed: int, range_ratio: float = 0.0) -> None:
    """Sends one phase's traffic for `seconds` (the client is restarted while time is left)."""
    end = time.monotonic() + seconds
    with open(log, "a") as f:
        while (left := end - time.monotonic()) > 2:
            proc = subprocess.Popen(load_command(base_url, phase, left, seed, range_ratio), env=env, stdout=f,
                                    stderr=subprocess.STDOUT)
            try:
                proc.wait(timeout=left + 5)
            except subprocess.TimeoutExpired:
                proc.kill()
            seed += 100


def figures(timeline: list[dict[str, Any]], started_s: float, shift_s: float) -> dict[str, Any]:
    """The arm's figures from its timeline (see the module doc); None where it has none."""
    windows = [e for e in timeline if e["kind"] == "window"]
    studies = [e for e in timeline if e["kind"] == "study"]
    retune = next((s for s in studies[1:] if s["time_s"] > shift_s), None)
    trigger = next((w for w in windows if w["trigger"] and w["time_s"] > shift_s), None)
    after_shift = [w for w in windows if w["time_s"] > shift_s]

    def mean(ws: list[dict[str, Any]]) -> float | None:
        values = [w["attainment"] for w in ws if w["attainment"] is not None]
        return round(statistics.fmean(values), 3) if values else None

    def met(ws: list[dict[str, Any]]) -> float | None:  # share of windows with no SLO broken
        judged = [w for w in ws if w["completed"]]
        return round(sum(not w["violations"] for w in judged) / len(judged), 3) if judged else None

    restored_at = retune["time_s"] if retune else None
    before = [w for w in windows if started_s < w["time_s"] <= shift_s]
    during = [w for w in after_shift if restored_at is None or w["time_s"] <= restored_at]
    after = [w for w in after_shift if restored_at is not None and w["time_s"] > restored_at]
    return {
        "windows_to_detection": after_shift.index(trigger) + 1 if trigger else None,
        "trigger": trigger and trigger["trigger"], "studies": len(studies),
        "retune_trials": retune and retune["trials"], "deployed_after": retune and retune["deployed"],
        "attainment_before": mean(before), "attainment_during": mean(during), "attainment_after": mean(after),
        "windows_met_before": met(before), "windows_met_during": met(during), "windows_met_after": met(after),
        "windows": [len(before), len(during), len(after)],
        "preemptions_after_shift": sum(w["preemptions"] or 0 for w in after_shift),
    }


def main(argv: list[str]) -> int:
    """`kvpilot bench retune`: runs each arm (`run_arm`), prints its figures and writes them with
    the machine block (kvpilot.loadgen.machine; the load before the first arm and after the last)
    to --output-json (default REPORT_DIR/retune.json). Returns 0."""
    a = parse(argv)
    results = [run_arm(a, arm) for arm in a.arms]
    machine = machine_info(loadavg_before=results[0]["loadavg_before"])
    doc = {"machine": machine, "phase_a": a.phase_a, "phase_b": a.phase_b,
           "phase_a_s": a.phase_a_s, "phase_b_s": a.phase_b_s, "watch_seconds": a.watch_seconds,
           "live_seconds": a.live_seconds, "slo": a.slo, "arms": results}
    keys = ("windows_to_detection", "trigger", "retune_trials", "windows_met_before", "windows_met_during",
            "windows_met_after", "attainment_before", "attainment_during", "attainment_after",
            "preemptions_after_shift")
    for r in results:
        print(f"{r['arm']}: " + ", ".join(f"{k} {r[k]}" for k in keys))
    print(f"CPU {machine['cpu']}, {machine['cores']} cores; load {machine['loadavg_before']} -> "
          f"{machine['loadavg_after']}")
    path = a.output_json or a.report_dir / "retune.json"
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path}")
    return 0
