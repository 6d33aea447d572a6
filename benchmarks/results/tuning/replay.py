"""Tuning-quality benchmark, step 2 (cheap): replay the tuner, random search and a
grid-in-random-order (vtune-style) against the grid measured by `grid.py`.

Per scenario the SLOs are set from quantiles of the table (this machine's measurements):
  preempt: no preemption; p95 TTFT and p95 ITL at the 90th percentile of the points' p95s;
  ttft:    p95 TTFT at the median of the points' p95 TTFTs (ITL and preemptions loose);
  itl:     p95 ITL (every inter-token gap of the window) at the median of the points'
           p95 ITLs (TTFT and preemptions loose).
A point's table figure is the median over its windows of the goodput (requests/s whose
TTFT and TPOT meet the limits, vLLM's definition); it is feasible when the medians of its
p95s, preemptions/min and failures meet the SLOs. A point the memory model refuses has no
windows: deploying it is a failed deployment. Each strategy gets a third of the grid as
windows (a deployment or a re-measurement each); each window observes one stored window
of the point, the next one of a per-seed shuffle of its windows (so a re-measurement sees
another window, as it would on the machine). Strategies:
  tuner:      kvpilot's Tuner as shipped (guided proposals, TPE with the SLO constraints,
              memory-model pruning, the best one re-measured with the incumbent, the
              noise-aware decision); its choice is the decision's (the defaults when it
              keeps them);
  tpe:        the Tuner with plain TPE (no guide, no re-measurement), its best trial;
  random:     points drawn uniformly with replacement (refused points included);
  grid_order: the grid shuffled by the seed, the first points (vtune-style);
random and grid order pick the best observed feasible point (the defaults when none).
Reported per scenario over the seeds: the median and worst ratio of the choice's table
goodput to the table's best feasible goodput (0 when the choice breaks the SLOs in the
table), and the deployments of settings the memory model refuses.

    .venv/bin/python benchmarks/results/tuning/replay.py [--grid grid.json ...] [--seeds 20]
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import statistics
import sys

import numpy as np
import optuna

from kvpilot.tuner import report
from kvpilot.tuner.feasibility import Hardware, resolve_model
from kvpilot.tuner.guide import RequestTokens
from kvpilot.tuner.loop import Tuner, TunerConfig, best_measured
from kvpilot.tuner.objective import SLO, Measurement, is_feasible, slack
from kvpilot.tuner.settings import EngineSettings
from kvpilot.tuner.space import SearchSpace
from kvpilot.tuner.study import make_sampler

MODEL = "smollm2-135m-instruct"
HERE = pathlib.Path(__file__).parent
LOOSE = 1e6  # ms: a limit nothing reaches


def p95(values: list[float]) -> float:
    return float(np.percentile(values, 95)) if values else math.nan


def window_measurement(w: dict, slo: SLO) -> Measurement:
    """One stored window judged against `slo`: per request TTFT and TPOT for goodput, the
    window's p95 over every inter-token gap for the ITL constraint (as the engine's
    vllm:inter_token_latency_seconds histogram measures it)."""
    good = sum(1 for t, o in zip(w["ttft_s"], w["tpot_s"])
               if t * 1000 <= slo.ttft_p95_ms and o * 1000 <= slo.itl_p95_ms)
    gaps = [x for r in w["itl_s"] for x in r] if "itl_s" in w else w["tpot_s"]
    d = w["duration_s"]
    return Measurement(duration_s=d, completed=len(w["ttft_s"]), failed=w["failed"],
                       throughput_rps=len(w["ttft_s"]) / d, goodput_rps=good / d, ttft_p95_s=p95(w["ttft_s"]),
                       itl_p95_s=p95(gaps), preemptions=w["preemptions"], source="table")


def slos_for(name: str, points: list[dict]) -> SLO:
    measured = [p for p in points if p["windows"]]
    judged = [[window_measurement(w, SLO(LOOSE, LOOSE)) for w in p["windows"]] for p in measured]
    ttft = [statistics.median(m.ttft_p95_s for m in ms) * 1000 for ms in judged]
    itl = [statistics.median(m.itl_p95_s for m in ms) * 1000 for ms in judged]
    q = lambda xs, pct: float(np.percentile(xs, pct))  # noqa: E731
    if name == "preempt":
        return SLO(ttft_p95_ms=q(ttft, 90), itl_p95_ms=q(itl, 90), max_preemptions_per_min=0)
    if name == "ttft":
        return SLO(ttft_p95_ms=q(ttft, 50), itl_p95_ms=LOOSE, max_preemptions_per_min=LOOSE)
    return SLO(ttft_p95_ms=LOOSE, itl_p95_ms=q(itl, 50), max_preemptions_per_min=LOOSE)


def table_figures(points: list[dict], slo: SLO) -> list[dict]:
    """Per point: median goodput over its windows and feasibility of the median window stats."""
    out = []
    for p in points:
        if not p["windows"]:
            out.append({"settings": p["settings"], "goodput": 0.0, "feasible": False, "windows": 0,
                        "refused": not p["feasible_model"]})
            continue
        ms = [window_measurement(w, slo) for w in p["windows"]]
        med = Measurement(duration_s=1.0, completed=int(statistics.median(m.completed for m in ms)),
                          failed=int(statistics.median(m.failed for m in ms)),
                          ttft_p95_s=statistics.median(m.ttft_p95_s for m in ms),
                          itl_p95_s=statistics.median(m.itl_p95_s for m in ms),
                          preemptions=statistics.median(m.preemptions_per_min for m in ms) / 60)
        goodputs = [m.goodput_rps for m in ms]
        out.append({"settings": p["settings"], "goodput": statistics.median(goodputs),
                    "spread": max(goodputs) - min(goodputs), "feasible": is_feasible(slack(med, slo)),
                    "windows": len(ms), "refused": False,
                    "p95_ttft_ms": med.ttft_p95_s * 1000, "p95_tpot_ms": med.itl_p95_s * 1000,
                    "preempt_per_min": med.preemptions * 60})
    return out


class GridSpace(SearchSpace):
    """The scenario's space with exactly the grid's values on each axis."""

    def __init__(self, axes: dict[str, list]):
        super().__init__(max_num_batched_tokens=(min(axes.get("max_num_batched_tokens", [1])),
                                                 max(axes.get("max_num_batched_tokens", [1])))
                         if "max_num_batched_tokens" in axes else None,
                         max_num_seqs=(min(axes["max_num_seqs"]), max(axes["max_num_seqs"]))
                         if "max_num_seqs" in axes else None,
                         enable_chunked_prefill=tuple(axes.get("enable_chunked_prefill", [True])),
                         max_num_seqs_pow2=True)
        object.__setattr__(self, "axes", axes)

    def batched_tokens_choices(self, base: EngineSettings) -> list[int]:
        return sorted(self.axes["max_num_batched_tokens"])

    def seqs_choices(self, base: EngineSettings) -> list[int]:
        return sorted(self.axes["max_num_seqs"])

    def bounds_with(self, base: EngineSettings) -> SearchSpace:
        return self


class TableRunner:
    """Deploys a point by reading its next stored window (a per-seed shuffle of them)."""

    def __init__(self, points: list[dict], slo: SLO, rng: random.Random):
        self.by_settings = {json.dumps(p["settings"], sort_keys=True): p for p in points}
        self.slo, self.rng, self.deployed = slo, rng, []
        self.order: dict[str, list[dict]] = {}

    def window(self, p: dict) -> dict:
        key = json.dumps(p["settings"], sort_keys=True)
        if not self.order.get(key):
            self.order[key] = self.rng.sample(p["windows"], len(p["windows"]))
        return self.order[key].pop()

    def run_trial(self, number: int, settings: EngineSettings) -> Measurement:
        p = self.by_settings[json.dumps(settings.as_dict(), sort_keys=True)]
        self.deployed.append(p)
        if not p["windows"]:
            from kvpilot.tuner.failures import OUT_OF_MEMORY, TrialFailed
            raise TrialFailed(OUT_OF_MEMORY, "refused by the engine (not measurable)")
        return window_measurement(self.window(p), self.slo)


def observe_pick(runner: TableRunner, order: list[dict], defaults: dict) -> dict:
    """Deploys `order`, returns the best observed feasible point (defaults when none)."""
    best, best_goodput = defaults, -1.0
    for p in order:
        if not p["windows"]:
            runner.deployed.append(p)
            continue
        m = runner.run_trial(0, EngineSettings(**p["settings"]))
        if is_feasible(slack(m, runner.slo)) and m.goodput_rps > best_goodput:
            best, best_goodput = p, m.goodput_rps
    return best


def request_tokens(spec: dict) -> RequestTokens:
    """The workload's request sizes as the tuner knows them: the prompt-length range's
    middle and top plus the output length."""
    low, high = spec["prompt_len"]
    return RequestTokens(mean=(low + high) / 2 + spec["output_len"], longest=high + spec["output_len"])


def replay(name: str, scen: dict, seeds: int) -> dict:
    points, spec = scen["points"], scen["spec"]
    slo = slos_for(name, points)
    figures = table_figures(points, slo)
    fig = {json.dumps(f["settings"], sort_keys=True): f for f in figures}
    best = max((f["goodput"] for f in figures if f["feasible"]), default=0.0)
    key = lambda p: json.dumps(p["settings"], sort_keys=True)  # noqa: E731
    base = EngineSettings(max_model_len=spec["max_model_len"])  # the engine's defaults
    defaults = next(p for p in points if key(p) == json.dumps(base.as_dict(), sort_keys=True))
    budget = math.ceil(len(points) / 3)
    model = resolve_model(MODEL)
    hardware = Hardware(device_memory_bytes=1, num_gpu_blocks_override=spec["kv_blocks"], shared_memory=True)  # a CPU engine
    results: dict[str, dict] = {k: {"ratios": [], "refused_deployed": [], "windows": [], "choices": []}
                                for k in ("tuner", "tpe", "random", "grid_order")}

    def score(p: dict) -> float:
        f = fig[key(p)]
        return (f["goodput"] / best) if f["feasible"] and best > 0 else 0.0

    def record(strategy: str, pick: dict, runner: TableRunner) -> None:
        results[strategy]["ratios"].append(score(pick))
        results[strategy]["refused_deployed"].append(sum(1 for p in runner.deployed if not p["feasible_model"]))
        results[strategy]["windows"].append(len(runner.deployed))
        results[strategy]["choices"].append(pick["settings"])

    space = GridSpace(spec["axes"])
    for seed in range(seeds):
        # the tuner as shipped: the budget covers its re-measurements (the best one and the incumbent)
        runner = TableRunner(points, slo, random.Random(seed))
        study = optuna.create_study(direction="maximize", sampler=make_sampler("tpe", seed))
        Tuner(study, space, base, model, hardware, slo, runner,
              TunerConfig(n_trials=budget - 2, remeasure_top=1, max_asks=50, guided=True,
                          request_tokens=request_tokens(spec))).run()
        rep = report.build(study, slo, "goodput")
        chosen = rep["best"]["settings"] if rep["best"] and rep["decision"]["replace"] else base.as_dict()
        record("tuner", runner.by_settings[json.dumps(chosen, sort_keys=True)], runner)
        # plain TPE, every window a new trial, its best single window
        runner = TableRunner(points, slo, random.Random(seed))
        study = optuna.create_study(direction="maximize", sampler=make_sampler("tpe", seed, n_startup_trials=1))
        Tuner(study, space, base, model, hardware, slo, runner,
              TunerConfig(n_trials=budget, remeasure_top=0, max_asks=50, guided=False)).run()
        found = best_measured(study)
        record("tpe", runner.by_settings[json.dumps(found[0].user_attrs["settings"], sort_keys=True)]
               if found else defaults, runner)
        rng = random.Random(1000 + seed)
        for strategy, order in (("random", [rng.choice(points) for _ in range(budget)]),
                                ("grid_order", rng.sample(points, budget))):
            r = TableRunner(points, slo, random.Random(seed))
            record(strategy, observe_pick(r, order, defaults), r)
    summary = {k: {"median_ratio": statistics.median(v["ratios"]), "worst_ratio": min(v["ratios"]),
                   "refused_deployed_total": sum(v["refused_deployed"]), "max_windows": max(v["windows"]),
                   "choices": v["choices"],
                   "ratios": [round(x, 3) for x in v["ratios"]]}
               for k, v in results.items()}
    violating = sum(1 for f in figures if not f["feasible"])
    return {"slo": vars(slo), "grid_points": len(points), "budget": budget, "best_feasible_goodput": best,
            "violating_points": violating, "defaults": fig[key(defaults)], "table": figures, "strategies": summary}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--grid", nargs="+", default=[str(HERE / "grid.json")], help="grid files (scenarios merged)")
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--out", default=str(HERE / "replay.json"))
    a = p.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    scenarios = {}
    for path in a.grid:
        scenarios.update(json.loads(pathlib.Path(path).read_text())["scenarios"])
    out = {name: replay(name, scen, a.seeds) for name, scen in scenarios.items()}
    pathlib.Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    for name, r in out.items():
        d = r["defaults"]
        limits = ", ".join(f"{k}={v:.0f}" for k, v in r["slo"].items() if v < LOOSE and k != "e2e_p95_ms")
        print(f"\n## {name}: SLO {limits}; "
              f"{r['violating_points']}/{r['grid_points']} points violate or are refused; budget {r['budget']}")
        print(f"defaults: goodput {d['goodput']:.3f} req/s, feasible {d['feasible']}; "
              f"best feasible {r['best_feasible_goodput']:.3f} req/s")
        print("| strategy | median ratio | worst ratio | refused settings deployed (all seeds) | windows (max) |")
        print("|---|---|---|---|---|")
        for k, s in r["strategies"].items():
            print(f"| {k} | {s['median_ratio']:.2f} | {s['worst_ratio']:.2f} | {s['refused_deployed_total']} "
                  f"| {s['max_windows']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
