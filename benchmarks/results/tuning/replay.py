"""Tuning-quality benchmark, step 2 (cheap): replay the tuner, random search and a
grid-in-random-order (vtune-style) against the grid measured by `grid.py`.

Per scenario the SLOs are set from quantiles of the table (this machine's measurements):
  preempt: no preemption; p95 TTFT and p95 TPOT at the 75th percentile of the points' p95s;
  ttft:    p95 TTFT at the median of the points' p95 TTFTs (TPOT loose);
  itl:     p95 TPOT (a request's mean inter-token latency) at the median of the points'
           p95 TPOTs (TTFT loose).
A point's table figure is the median over its windows of the goodput (requests/s meeting
every per-request limit); it is feasible when the medians of its p95s, preemptions/min and
failures meet the SLOs. A point the memory model refuses has no windows: deploying it is a
failed deployment. Each strategy gets a third of the grid as deployments; each deployment
observes ONE stored window of the point, drawn by the seed (the real run-to-run noise),
and picks the best observed feasible point (the running defaults when none). Reported per
scenario over the seeds: the median and worst ratio of the pick's table goodput to the
table's best feasible goodput, and the deployments of settings the memory model refuses.

    .venv/bin/python benchmarks/results/tuning/replay.py [--grid grid.json] [--seeds 20]
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
    """One stored window judged against `slo` (the ITL limit applies to each request's TPOT)."""
    good = sum(1 for t, o in zip(w["ttft_s"], w["tpot_s"])
               if t * 1000 <= slo.ttft_p95_ms and o * 1000 <= slo.itl_p95_ms)
    d = w["duration_s"]
    return Measurement(duration_s=d, completed=len(w["ttft_s"]), failed=w["failed"],
                       throughput_rps=len(w["ttft_s"]) / d, goodput_rps=good / d, ttft_p95_s=p95(w["ttft_s"]),
                       itl_p95_s=p95(w["tpot_s"]), preemptions=w["preemptions"], source="table")


def slos_for(name: str, points: list[dict]) -> SLO:
    measured = [p for p in points if p["windows"]]
    ttft = [statistics.median(p95(w["ttft_s"]) for w in p["windows"]) * 1000 for p in measured]
    tpot = [statistics.median(p95(w["tpot_s"]) for w in p["windows"]) * 1000 for p in measured]
    q = lambda xs, pct: float(np.percentile(xs, pct))  # noqa: E731
    if name == "preempt":
        return SLO(ttft_p95_ms=q(ttft, 75), itl_p95_ms=q(tpot, 75), max_preemptions_per_min=0)
    if name == "ttft":
        return SLO(ttft_p95_ms=q(ttft, 50), itl_p95_ms=LOOSE, max_preemptions_per_min=LOOSE)
    return SLO(ttft_p95_ms=LOOSE, itl_p95_ms=q(tpot, 50), max_preemptions_per_min=LOOSE)


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
    """Deploys a point by reading one of its stored windows (drawn by rng)."""

    def __init__(self, points: list[dict], slo: SLO, rng: random.Random):
        self.by_settings = {json.dumps(p["settings"], sort_keys=True): p for p in points}
        self.slo, self.rng, self.deployed = slo, rng, []

    def run_trial(self, number: int, settings: EngineSettings) -> Measurement:
        p = self.by_settings[json.dumps(settings.as_dict(), sort_keys=True)]
        self.deployed.append(p)
        if not p["windows"]:
            from kvpilot.tuner.failures import OUT_OF_MEMORY, TrialFailed
            raise TrialFailed(OUT_OF_MEMORY, "refused by the engine (not measurable)")
        return window_measurement(self.rng.choice(p["windows"]), self.slo)


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
    hardware = Hardware(device_memory_bytes=1, num_gpu_blocks_override=spec["kv_blocks"])
    results: dict[str, dict] = {k: {"ratios": [], "refused_deployed": []}
                                for k in ("tuner", "tuner_decide", "random", "grid_order")}

    def score(p: dict) -> float:
        f = fig[key(p)]
        return (f["goodput"] / best) if f["feasible"] and best > 0 else 0.0

    for seed in range(seeds):
        runner = TableRunner(points, slo, random.Random(seed))
        study = optuna.create_study(direction="maximize", sampler=make_sampler("tpe", seed, n_startup_trials=1))
        Tuner(study, GridSpace(spec["axes"]), base, model, hardware, slo, runner,
              TunerConfig(n_trials=budget, remeasure_top=0, max_asks=50)).run()
        found = best_measured(study)
        pick = runner.by_settings[json.dumps(found[0].user_attrs["settings"], sort_keys=True)] if found else defaults
        results["tuner"]["ratios"].append(score(pick))
        results["tuner"]["refused_deployed"].append(sum(1 for p in runner.deployed if not p["feasible_model"]))
        # the same, plus the re-measurement of its best and of the incumbent and the noise-aware
        # decision (up to 2 windows over the budget): deploy the winner only beyond the spread
        runner = TableRunner(points, slo, random.Random(seed))
        study = optuna.create_study(direction="maximize", sampler=make_sampler("tpe", seed, n_startup_trials=1))
        Tuner(study, GridSpace(spec["axes"]), base, model, hardware, slo, runner,
              TunerConfig(n_trials=budget, remeasure_top=1, max_asks=50)).run()
        rep = report.build(study, slo, "goodput")
        chosen = rep["best"]["settings"] if rep["best"] and rep["decision"]["replace"] else base.as_dict()
        results["tuner_decide"]["ratios"].append(score(runner.by_settings[json.dumps(chosen, sort_keys=True)]))
        results["tuner_decide"]["refused_deployed"].append(sum(1 for p in runner.deployed if not p["feasible_model"]))
        rng = random.Random(1000 + seed)
        for strategy, order in (("random", [rng.choice(points) for _ in range(budget)]),
                                ("grid_order", rng.sample(points, budget))):
            r = TableRunner(points, slo, random.Random(seed))
            pick = observe_pick(r, order, defaults)
            results[strategy]["ratios"].append(score(pick))
            results[strategy]["refused_deployed"].append(sum(1 for p in r.deployed if not p["feasible_model"]))
    summary = {k: {"median_ratio": statistics.median(v["ratios"]), "worst_ratio": min(v["ratios"]),
                   "refused_deployed_total": sum(v["refused_deployed"]), "ratios": [round(x, 3) for x in v["ratios"]]}
               for k, v in results.items()}
    violating = sum(1 for f in figures if not f["feasible"])
    return {"slo": vars(slo), "grid_points": len(points), "budget": budget, "best_feasible_goodput": best,
            "violating_points": violating, "defaults": fig[key(defaults)], "table": figures, "strategies": summary}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--grid", default=str(HERE / "grid.json"))
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--out", default=str(HERE / "replay.json"))
    a = p.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    grid = json.loads(pathlib.Path(a.grid).read_text())
    out = {name: replay(name, scen, a.seeds) for name, scen in grid["scenarios"].items()}
    pathlib.Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    for name, r in out.items():
        d = r["defaults"]
        limits = ", ".join(f"{k}={v:.0f}" for k, v in r["slo"].items() if v < LOOSE and k != "e2e_p95_ms")
        print(f"\n## {name}: SLO {limits}; "
              f"{r['violating_points']}/{r['grid_points']} points violate or are refused; budget {r['budget']}")
        print(f"defaults: goodput {d['goodput']:.3f} req/s, feasible {d['feasible']}; "
              f"best feasible {r['best_feasible_goodput']:.3f} req/s")
        print("| strategy | median ratio | worst ratio | refused settings deployed (all seeds) |")
        print("|---|---|---|---|")
        for k, s in r["strategies"].items():
            print(f"| {k} | {s['median_ratio']:.2f} | {s['worst_ratio']:.2f} | {s['refused_deployed_total']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
