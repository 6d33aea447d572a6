"""Benchmark (not a test): how good the tuner's pick is against a full grid, on the real
engine with a fixed local workload.

Both search the same discrete space: max_num_batched_tokens in {128 ... 1024} and the
engine default 2048, max_num_seqs in {2, 4, 8, 16} and the default 256, chunked prefill on,
with a small KV cache (48 blocks of 16 tokens) so that concurrency causes preemptions. The
grid measures every feasible point; the tuner (TPE, engine defaults first) gets a third of
the grid's measurements. Reported: the best SLO-feasible goodput each found and their
ratio, the ratio of the grid's own measurement of the tuner's pick to the grid's best
(free of run-to-run noise), the trials each spent, and that no trial was started on a
setting the feasibility check rejects.

    .venv/bin/python tests/tuner/bench_tuning_quality.py [--out tests/tuner/bench_tuning_quality.json]
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import tempfile
import time

import optuna

from kvpilot.bench.tokenizers import load_tokenizer
from kvpilot.tuner.engine_process import EngineProcess
from kvpilot.tuner.feasibility import Hardware, check, resolve_model
from kvpilot.tuner.local import LocalRunner
from kvpilot.tuner.loop import Tuner, TunerConfig, best_measured
from kvpilot.tuner.objective import SLO, is_feasible, slack
from kvpilot.tuner.settings import EngineSettings
from kvpilot.tuner.space import SearchSpace
from kvpilot.tuner.study import open_study
from kvpilot.tuner.workload import Workload, load_requests

MODEL = "smollm2-135m-instruct"
BASE = EngineSettings(max_model_len=512, max_num_seqs=256, max_num_batched_tokens=2048)
SPACE = SearchSpace(max_num_batched_tokens=(128, 1024), max_num_seqs=(2, 16), enable_chunked_prefill=(True,),
                    max_num_seqs_pow2=True)
HARDWARE = Hardware(device_memory_bytes=1, num_gpu_blocks_override=48)
SLOS = SLO(ttft_p95_ms=20_000, itl_p95_ms=1_000, max_preemptions_per_min=0)


class CheckedRunner:
    """Counts the runs and records whether each started setting passed the feasibility check."""

    def __init__(self, runner: LocalRunner):
        self.runner, self.started, self.infeasible_started = runner, 0, 0

    def run_trial(self, number: int, settings: EngineSettings):
        self.started += 1
        if not check(settings, resolve_model(MODEL), HARDWARE).feasible:
            self.infeasible_started += 1
        return self.runner.run_trial(number, settings)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(pathlib.Path(__file__).with_suffix(".json")))
    a = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    model = resolve_model(MODEL)
    workload = Workload(num_requests=a.requests, max_prompt_len=128, max_output_len=a.output_len, warmup_requests=1)
    load = load_requests(load_tokenizer(MODEL), workload, BASE.max_model_len)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="tuning-quality-"))
    engine = EngineProcess(MODEL, workdir / "engine.log", ["--num-gpu-blocks-override", "48", "--disable-log-requests"])
    runner = CheckedRunner(LocalRunner(engine, workload, load, SLOS, MODEL))
    space = SPACE.bounds_with(BASE)
    t0 = time.monotonic()
    try:
        grid, pruned = [], 0
        for i, settings in enumerate(space.grid(BASE)):
            if not check(settings, model, HARDWARE).feasible:
                pruned += 1
                continue
            m = runner.run_trial(i, settings)
            grid.append({"settings": settings.as_dict(), "goodput": m.goodput_rps,
                         "feasible": is_feasible(slack(m, SLOS)), "measurement": m.as_dict()})
            print(f"grid {settings.describe()}: goodput {m.goodput_rps:.3f} feasible={grid[-1]['feasible']}",
                  file=sys.stderr, flush=True)
        grid_seconds, grid_runs = time.monotonic() - t0, runner.started
        budget = math.ceil(len(grid) / 3)
        study = open_study("quality", None, "goodput", "tpe", a.seed)
        t1 = time.monotonic()
        Tuner(study, SPACE, BASE, model, HARDWARE, SLOS, runner, TunerConfig(n_trials=budget, remeasure_top=0)).run()
        tuner_seconds, tuner_runs = time.monotonic() - t1, runner.started - grid_runs
    finally:
        engine.stop()
    feasible = [g for g in grid if g["feasible"]]
    grid_best = max(feasible, key=lambda g: g["goodput"]) if feasible else None
    best = best_measured(study)
    tuner_best = best[0] if best else None
    on_grid = next((g for g in grid if tuner_best and g["settings"] == tuner_best.user_attrs["settings"]), None)
    result = {
        "workload": {"requests": a.requests, "max_output_len": a.output_len, "max_prompt_len": 128,
                     "kv_blocks": 48, "max_model_len": BASE.max_model_len}, "slo": vars(SLOS),
        "grid": {"points": len(grid) + pruned, "pruned_by_feasibility": pruned, "measured": grid_runs,
                 "feasible": len(feasible), "best": grid_best and {"settings": grid_best["settings"],
                                                                    "goodput": grid_best["goodput"]},
                 "seconds": round(grid_seconds), "all": [{**g["settings"], "goodput": g["goodput"],
                                                          "feasible": g["feasible"]} for g in grid]},
        "tuner": {"budget": budget, "measured": tuner_runs, "asked": len(study.trials),
                  "pruned": sum(1 for t in study.trials if t.state.name == "PRUNED"), "seconds": round(tuner_seconds),
                  "best": tuner_best and {"settings": tuner_best.user_attrs["settings"],
                                          "goodput": tuner_best.values[0]}},
        "ratio_best_goodput": (tuner_best.values[0] / grid_best["goodput"]) if tuner_best and grid_best else None,
        "ratio_on_grid": (on_grid["goodput"] / grid_best["goodput"]) if on_grid and grid_best and on_grid["feasible"]
        else None,
        "infeasible_settings_started": runner.infeasible_started,
    }
    pathlib.Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "grid"}, indent=2))
    print(f"grid best {result['grid']['best']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
