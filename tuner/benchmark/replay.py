"""`kvpilot bench tuning replay`: search strategies replayed on a measured grid.

Each strategy gets a third of the grid (at least 3) as windows, a deployment or a
re-measurement each; a window of a point shows that point's next recorded window (a per-seed
shuffle of them, so a re-measurement sees another window, as on the machine), and a point the
memory model refused is a failed deployment. Strategies:
- tuner: `Tuner` as `kvpilot tune` ships it (engine defaults first, the guide, TPE with the SLO
  constraints, memory-model pruning, the best trial and the incumbent re-measured inside the
  budget, a CPU engine as the grid was measured); its choice is the report's decision (the
  defaults when it keeps them);
- tpe: the Tuner with plain TPE (no guide, no re-measurement), its best trial;
- random: points drawn uniformly with replacement (refused ones included);
- grid_order: the grid shuffled by the seed, the first points (vtune-style).
random and grid_order pick the best observed feasible point (the defaults when none).
Reported per scenario over the seeds: each choice's table goodput over the table's best
feasible goodput (0 when the choice breaks the SLOs in the table), its median and worst, and
the deployments of settings the memory model refuses.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from typing import Any

import optuna

from kvpilot.tuner.report import tuning_report as report
from kvpilot.tuner.benchmark.judge import point_figure, scenario_slo, window_measurement
from kvpilot.tuner.benchmark.scenarios import Scenario
from kvpilot.tuner.failures import OUT_OF_MEMORY, TrialFailed
from kvpilot.tuner.search.feasibility import Hardware, resolve_model
from kvpilot.tuner.search.guide import RequestTokens
from kvpilot.tuner.search.loop import Tuner, TunerConfig, best_measured
from kvpilot.tuner.search.objective import SLO, Measurement, is_feasible, slack
from kvpilot.tuner.search.settings import EngineSettings
from kvpilot.tuner.search.space import SearchSpace
from kvpilot.tuner.search.study import make_sampler

STRATEGIES = ("tuner", "tpe", "random", "grid_order")


def key(settings: dict[str, Any]) -> str:
    """A point's identity: its settings with today's defaults for fields a recorded grid lacks."""
    return json.dumps(EngineSettings(**settings).as_dict(), sort_keys=True)


class GridSpace(SearchSpace):
    """The scenario's search space with exactly the grid's values on each axis."""

    def __init__(self, axes: dict[str, list[Any]]):
        def bounds(name: str) -> tuple[int, int] | None:
            return (min(axes[name]), max(axes[name])) if name in axes else None
        super().__init__(max_num_batched_tokens=bounds("max_num_batched_tokens"), max_num_seqs=bounds("max_num_seqs"),
                         enable_chunked_prefill=tuple(axes.get("enable_chunked_prefill", [True])),
                         max_num_seqs_pow2=True)
        object.__setattr__(self, "axes", axes)

    def batched_tokens_choices(self, base: EngineSettings) -> list[int]:
        """The grid's max_num_batched_tokens values, sorted; the base value alone when the grid has
        no such axis (SearchSpace.batched_tokens_choices: powers of two)."""
        return sorted(self.axes.get("max_num_batched_tokens", [base.max_num_batched_tokens]))

    def seqs_choices(self, base: EngineSettings) -> list[int]:
        """The grid's max_num_seqs values, sorted; the base value alone when the grid has no such axis."""
        return sorted(self.axes.get("max_num_seqs", [base.max_num_seqs]))

    def bounds_with(self, base: EngineSettings) -> SearchSpace:
        """This space unchanged: a replay deploys only the grid's recorded points, so the ranges are
        not widened to hold the base settings (as SearchSpace.bounds_with widens them)."""
        return self


class TableRunner:
    """The tuner's Runner on a recorded grid: deploying a point reads its next recorded window."""

    def __init__(self, points: list[dict[str, Any]], slo: SLO, rng: random.Random):
        self.by_key = {key(p["settings"]): p for p in points}
        self.slo, self.rng = slo, rng
        self.deployed: list[dict[str, Any]] = []
        self.order: dict[str, list[dict[str, Any]]] = {}

    def point(self, settings: dict[str, Any]) -> dict[str, Any]:
        """The grid point of `settings`. Raises ValueError for settings off the grid."""
        found = self.by_key.get(key(settings))
        if found is None:
            raise ValueError(f"{EngineSettings(**settings).describe()} is not a point of the grid")
        return found

    def run_trial(self, number: int, settings: EngineSettings) -> Measurement:
        """Trial `number` at `settings`: the point's next recorded window (each point's windows in a
        random order drawn once, then taken in turn) judged against the SLO. Raises ValueError for
        settings off the grid and TrialFailed(OUT_OF_MEMORY) for a point the engine refused."""
        p = self.point(settings.as_dict())
        self.deployed.append(p)
        if not p["windows"]:
            raise TrialFailed(OUT_OF_MEMORY, "refused by the engine (not measurable)")
        k = key(p["settings"])
        if not self.order.get(k):
            self.order[k] = self.rng.sample(p["windows"], len(p["windows"]))
        return window_measurement(self.order[k].pop(), self.slo)

    def observe_pick(self, order: list[dict[str, Any]], defaults: dict[str, Any]) -> dict[str, Any]:
        """Deploys `order`; the best observed feasible point (`defaults` when none)."""
        best, best_goodput = defaults, -1.0
        for p in order:
            if not p["windows"]:
                self.deployed.append(p)
                continue
            m = self.run_trial(0, EngineSettings(**p["settings"]))
            if is_feasible(slack(m, self.slo)) and m.goodput_rps > best_goodput:
                best, best_goodput = p, m.goodput_rps
        return best


def request_tokens(scenario: Scenario) -> RequestTokens:
    """The window's request sizes as the tuner knows them: the prompt range's middle and top
    plus the output length (tokens)."""
    low, high = scenario.prompt_len
    return RequestTokens(mean=(low + high) / 2 + scenario.output_len, longest=high + scenario.output_len)


def run_tuner(runner: TableRunner, scenario: Scenario, model: str, slo: SLO, budget: int, seed: int,
              guided: bool) -> dict[str, Any] | None:
    """The Tuner on the table: guided (as shipped: its decision's choice, None when it keeps the
    defaults) or plain TPE (its best trial, None when none met the SLOs)."""
    hardware = Hardware(device_memory_bytes=1, num_gpu_blocks_override=scenario.kv_blocks, shared_memory=True)
    sampler = make_sampler("tpe", seed) if guided else make_sampler("tpe", seed, n_startup_trials=1)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    config = (TunerConfig(n_trials=budget - 2, remeasure_top=1, max_asks=50, guided=True,
                          request_tokens=request_tokens(scenario)) if guided
              else TunerConfig(n_trials=budget, remeasure_top=0, max_asks=50, guided=False))
    Tuner(study, GridSpace(scenario.axes), scenario.defaults(), resolve_model(model), hardware, slo, runner,
          config).run()
    if guided:
        rep = report.build(study, slo, "goodput")
        return runner.point(rep["best"]["settings"]) if rep["best"] and rep["decision"]["replace"] else None
    found = best_measured(study)
    return runner.point(found[0].user_attrs["settings"]) if found else None


def replay_scenario(name: str, entry: dict[str, Any], model: str, seeds: int) -> dict[str, Any]:
    """Every strategy over `seeds` seeds on one scenario's recorded grid entry."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    scenario, points = Scenario.from_spec(name, entry["spec"]), entry["points"]
    slo = scenario_slo(scenario, points)
    figures = {key(p["settings"]): point_figure(p, slo) for p in points}
    best = max((f["goodput"] for f in figures.values() if f["feasible"]), default=0.0)
    defaults = next(p for p in points if key(p["settings"]) == key(scenario.defaults().as_dict()))
    budget = max(3, math.ceil(len(points) / 3))
    results = {s: {"ratios": [], "refused_deployed": [], "windows": [], "choices": []} for s in STRATEGIES}

    def record(strategy: str, pick: dict[str, Any], runner: TableRunner) -> None:
        f = figures[key(pick["settings"])]
        results[strategy]["ratios"].append(f["goodput"] / best if f["feasible"] and best > 0 else 0.0)
        results[strategy]["refused_deployed"].append(sum(1 for p in runner.deployed if not p["feasible_model"]))
        results[strategy]["windows"].append(len(runner.deployed))
        results[strategy]["choices"].append(pick["settings"])

    for seed in range(seeds):
        for strategy, guided in (("tuner", True), ("tpe", False)):
            runner = TableRunner(points, slo, random.Random(seed))
            record(strategy, run_tuner(runner, scenario, model, slo, budget, seed, guided) or defaults, runner)
        rng = random.Random(1000 + seed)
        for strategy, order in (("random", [rng.choice(points) for _ in range(budget)]),
                                ("grid_order", rng.sample(points, min(budget, len(points))))):
            runner = TableRunner(points, slo, random.Random(seed))
            record(strategy, runner.observe_pick(order, defaults), runner)
    summary = {s: {"median_ratio": statistics.median(v["ratios"]), "worst_ratio": min(v["ratios"]),
                   "refused_deployed_total": sum(v["refused_deployed"]), "max_windows": max(v["windows"]),
                   "choices": v["choices"], "ratios": [round(x, 3) for x in v["ratios"]]}
               for s, v in results.items()}
    return {"spec": scenario.spec(), "model": model, "slo": vars(slo), "grid_points": len(points), "budget": budget,
            "best_feasible_goodput": best, "violating_points": sum(1 for f in figures.values() if not f["feasible"]),
            "defaults": figures[key(defaults["settings"])], "table": list(figures.values()), "strategies": summary}
