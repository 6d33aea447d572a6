"""Tuning-quality benchmark, step 1 (expensive): measure every point of a grid on the real
engine, `--repeats` windows per point, and store each window's per-request timings.

Three scenarios where the engine defaults (max_num_seqs 256, max_num_batched_tokens 2048,
chunked prefill on) are meant to be the wrong choice:
  preempt:  a small KV cache (--num-gpu-blocks-override) and a burst of ShareGPT requests:
            many sequences at once preempt each other (no-preemption SLO);
  ttft:     long ShareGPT prompts at a Poisson rate: the budget and the concurrency cap decide
            how long a prompt waits for its first token (p95 TTFT SLO);
  itl:      long prompts (300-450 tokens) arriving while others decode (p95 ITL SLO). The
            issue's premise is GPU-shaped (a chunk rides in a memory-bound decode step for
            free, so chunked prefill with a small budget keeps ITL low); on a CPU the step is
            compute-bound, a chunk slows every decode step it rides in, and separate prefill
            steps (chunked prefill off) give the lowest p95 ITL. The grid measures both.
            (The first itl grid, 100-200-token prompts at 1 req/s, is in grid_itl_v1.json.)
The SLOs are not fixed here: `replay.py` sets them from quantiles of this table, so the
table stores what any SLO needs (per request: TTFT, TPOT and every inter-token gap; per
window: preemptions, failures, duration, the engine's CPU seconds, the load average).

Windows are short (a handful of requests, few output tokens) so a grid of 18-30 points
with 3 repeats measures in well under an hour. One engine per scenario (every axis is a
scheduler limit, changed live); the repeats are interleaved: each repeat visits every
point once in its own shuffled order, so the shared machine's drift spreads over all
points instead of biasing a few, and the median of a point's windows is its figure.

    .venv/bin/python benchmarks/results/tuning/grid.py --out benchmarks/results/tuning/grid.json
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import sys
import tempfile
import time

from kvpilot.engine.settings import flag_words
from kvpilot.loadgen.datasets import SampleRequest, sample_sharegpt_requests
from kvpilot.loadgen.tokenizers import load_tokenizer
from kvpilot.tuner.engine_process import EngineProcess
from kvpilot.tuner.feasibility import Hardware, check, resolve_model
from kvpilot.tuner.local import WindowMeasurer
from kvpilot.tuner.objective import SLO
from kvpilot.tuner.scrape import ScrapeSource
from kvpilot.tuner.settings import EngineSettings
from kvpilot.tuner.workload import Workload, drive

MODEL = "smollm2-135m-instruct"
DEFAULTS = EngineSettings()  # the engine's own defaults, max_model_len set per scenario

SCENARIOS = {
    "preempt": {"max_model_len": 256, "kv_blocks": 16, "requests": 8, "rate": float("inf"),
                "prompt_len": (16, 96), "output_len": 16,
                "axes": {"max_num_seqs": [1, 2, 3, 4, 6, 8, 16, 256],
                         "max_num_batched_tokens": [128, 512, 2048]}},
    "ttft": {"max_model_len": 512, "kv_blocks": 128, "requests": 6, "rate": 1.0,
             "prompt_len": (100, 200), "output_len": 4,
             "axes": {"max_num_seqs": [2, 4, 8, 256], "max_num_batched_tokens": [64, 128, 256, 512, 2048]}},
    "itl": {"max_model_len": 512, "kv_blocks": 256, "requests": 8, "rate": 1.5,
            "prompt_len": (300, 450), "output_len": 32,
            "axes": {"enable_chunked_prefill": [True, False], "max_num_seqs": [4, 16, 256],
                     "max_num_batched_tokens": [64, 128, 512, 2048]}},
}


def points(name: str) -> list[EngineSettings]:
    spec = SCENARIOS[name]
    out = [DEFAULTS.replace(max_model_len=spec["max_model_len"])]
    for field, choices in spec["axes"].items():
        out = [s.replace(**{field: c}) for s in out for c in choices]
    return out


def requests_for(name: str, tokenizer) -> list[SampleRequest]:
    """One warm-up request then the window's requests: ShareGPT prompts within the scenario's
    prompt-length range, each asked for exactly output_len tokens (ignore_eos)."""
    spec = SCENARIOS[name]
    low, high = spec["prompt_len"]
    pool = sample_sharegpt_requests(tokenizer, 4000, seed=1, oversample=False)
    fit = [SampleRequest(r.prompt, r.prompt_len, spec["output_len"]) for r in pool if low <= r.prompt_len <= high]
    need = spec["requests"] + 1
    if len(fit) < need:
        raise SystemExit(f"{name}: only {len(fit)} ShareGPT prompts in {spec['prompt_len']} tokens")
    return fit[:need]


def offsets(name: str) -> list[float] | None:
    """Poisson arrival times (fixed seed, the same for every point and repeat)."""
    spec = SCENARIOS[name]
    if spec["rate"] == float("inf"):
        return None
    rng, t, out = random.Random(7), 0.0, []
    for _ in range(spec["requests"]):
        out.append(t)
        t += rng.expovariate(spec["rate"])
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` (/proc/PID/stat fields 14 and 15)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def window(engine: EngineProcess, measurer: WindowMeasurer, requests, offs, workload) -> dict:
    url, headers = engine.base_url, engine.headers
    drive(requests[:1], workload, url, MODEL, headers)
    measurer.wait_idle(url)
    source = ScrapeSource(url, {"model_name": MODEL})
    start, cpu0 = source.begin(), cpu_seconds(engine.proc.pid)
    results, duration = drive(requests[1:], workload, url, MODEL, headers, offsets=offs)
    measurer.wait_idle(url)
    server = source.measure(start, SLO())
    ok = [r for r in results if r.success]
    return {"duration_s": duration, "failed": len(results) - len(ok), "preemptions": server.preemptions,
            "engine_cpu_s": round(cpu_seconds(engine.proc.pid) - cpu0, 2),
            "ttft_s": [round(r.ttft, 4) for r in ok],
            "tpot_s": [round((r.latency - r.ttft) / max(1, (r.output_tokens or 1) - 1), 5) for r in ok],
            "itl_s": [[round(x, 4) for x in r.itl] for r in ok],
            "itl_p95_server_s": server.itl_p95_s, "ttft_p95_server_s": server.ttft_p95_s}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--out", default=str(pathlib.Path(__file__).with_name("grid.json")))
    a = p.parse_args()
    tokenizer = load_tokenizer(MODEL)
    model = resolve_model(MODEL)
    out = pathlib.Path(a.out)
    table = json.loads(out.read_text()) if out.exists() else {"scenarios": {}, "load": []}
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="tuning-grid-"))
    t0 = time.monotonic()
    for name in a.scenarios.split(","):
        spec = SCENARIOS[name]
        hardware = Hardware(device_memory_bytes=1, num_gpu_blocks_override=spec["kv_blocks"])
        scen = table["scenarios"].setdefault(name, {
            "spec": {k: (str(v) if k == "rate" else v) for k, v in spec.items()},
            "defaults": DEFAULTS.replace(max_model_len=spec["max_model_len"]).as_dict(), "points": []})
        if not scen["points"]:
            for s in points(name):
                v = check(s, model, hardware)
                scen["points"].append({"settings": s.as_dict(), "feasible_model": v.feasible, "reason": v.reason,
                                       "windows": []})
        requests, offs = requests_for(name, tokenizer), offsets(name)
        workload = Workload(num_requests=spec["requests"], warmup_requests=1, ignore_eos=True)
        engine = EngineProcess(MODEL, workdir / f"{name}.log",
                               [*flag_words("num_gpu_blocks_override", spec["kv_blocks"]), "--disable-log-requests"])
        measurer = WindowMeasurer(workload, None, SLO(), MODEL)
        try:
            for rep in range(a.repeats):
                order = [pt for pt in scen["points"] if pt["feasible_model"] and len(pt["windows"]) <= rep]
                random.Random(100 * rep + len(name)).shuffle(order)
                for pt in order:
                    s = EngineSettings(**pt["settings"])
                    if engine.running and engine.settings and (ch := engine.settings.live_changes(s)) is not None \
                            and (ch == {} or engine.apply_live(ch)):
                        engine.settings = s
                    else:
                        engine.start(s)
                    w0 = time.monotonic()
                    w = window(engine, measurer, requests, offs, workload)
                    w["load_avg"] = open("/proc/loadavg").read().split()[:3]
                    w["repeat"], w["finished"] = rep, time.strftime("%H:%M:%S", time.gmtime())
                    pt["windows"].append(w)
                    print(f"[{time.monotonic() - t0:6.0f}s] rep {rep} {name} {s.describe()}: "
                          f"{time.monotonic() - w0:.1f}s, ttft max {max(w['ttft_s'] or [0]):.2f}, "
                          f"tpot max {max(w['tpot_s'] or [0]):.3f}, preempt {w['preemptions']:.0f}, "
                          f"failed {w['failed']}, cpu {w['engine_cpu_s']}s, load {w['load_avg']}",
                          file=sys.stderr, flush=True)
                    out.write_text(json.dumps(table, indent=1) + "\n")
        finally:
            engine.stop()
    table["load"].append({"finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                          "scenarios": a.scenarios, "wall_s": round(time.monotonic() - t0),
                          "cpu": next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                                      if ln.startswith("model name"))})
    out.write_text(json.dumps(table, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
