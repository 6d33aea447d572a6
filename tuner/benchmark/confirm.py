"""`kvpilot bench tuning confirm`: the tuner's choice against the engine defaults, live.

Per scenario of a replay JSON: the setting the tuner chose most often over the replay's seeds,
among the seeds where it replaced the defaults (keeping them needs no confirmation), against
the defaults, `windows` windows each, interleaved (defaults, choice, defaults, ...) on one
engine (the two differ in scheduler limits only, changed live; a restart otherwise), judged
against the replay's SLOs (`judge.window_measurement`).
"""

from __future__ import annotations

import collections
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from kvpilot.loadgen.machine import machine_info
from kvpilot.tuner.benchmark.judge import window_measurement
from kvpilot.tuner.benchmark.replay import key
from kvpilot.tuner.benchmark.scenarios import Scenario
from kvpilot.tuner.benchmark.windows import measure_window, open_runner
from kvpilot.tuner.search.objective import SLO, is_feasible, slack
from kvpilot.tuner.search.settings import EngineSettings


def tuner_choice(replayed: dict[str, Any], defaults: EngineSettings) -> tuple[EngineSettings | None, str]:
    """The tuner's most common choice other than the defaults, and how many seeds chose it."""
    choices = replayed["strategies"]["tuner"]["choices"]
    counts = collections.Counter(key(c) for c in choices if key(c) != key(defaults.as_dict()))
    if not counts:
        return None, f"the tuner kept the defaults in all {len(choices)} seeds"
    chosen, n = counts.most_common(1)[0]
    return EngineSettings(**json.loads(chosen)), (f"{n} of the {sum(counts.values())} seeds that replaced the "
                                                  f"defaults (of {len(choices)})")


def judged_window(window: dict[str, Any], slo: SLO) -> dict[str, Any]:
    """A measured window's figures against `slo` (rates in requests/s, p95s in ms)."""
    m = window_measurement(window, slo)
    return {"throughput_rps": m.throughput_rps, "goodput_rps": m.goodput_rps, "ttft_p95_ms": m.ttft_p95_s * 1000,
            "itl_p95_ms": m.itl_p95_s * 1000, "preemptions": m.preemptions, "failed": m.failed,
            "meets_slo": is_feasible(slack(m, slo)), "applied": window["applied"], "loadavg": window["loadavg"],
            "finished": window["finished"]}


def confirm_scenario(name: str, replayed: dict[str, Any], model: str, windows: int,
                     log_dir: Path) -> dict[str, Any]:
    """The live comparison of one scenario (or a note when the tuner kept the defaults)."""
    scenario = Scenario.from_spec(name, replayed.get("spec") or {})
    slo, defaults = SLO(**replayed["slo"]), scenario.defaults()
    chosen, chosen_by = tuner_choice(replayed, defaults)
    out: dict[str, Any] = {"slo": replayed["slo"], "defaults": defaults.as_dict(),
                           "chosen": chosen and chosen.as_dict(), "chosen_by_seeds": chosen_by}
    if chosen is None:
        return out
    runs: dict[str, list[dict[str, Any]]] = {"defaults": [], "chosen": []}
    runner = open_runner(scenario, model, log_dir / f"confirm-{name}.log")
    try:
        for i in range(windows):
            for label, settings in (("defaults", defaults), ("chosen", chosen)):
                runs[label].append(judged_window(measure_window(runner, settings), slo))
                print(f"{name} {label} window {i}: {runs[label][-1]}", file=sys.stderr, flush=True)
    finally:
        runner.close()
    summary = {k: {"median_goodput_rps": statistics.median(x["goodput_rps"] for x in v),
                   "windows_meeting_slo": f"{sum(x['meets_slo'] for x in v)}/{len(v)}"} for k, v in runs.items()}
    base = summary["defaults"]["median_goodput_rps"]
    out.update(windows=runs, summary=summary, machine=machine_info(),
               chosen_over_defaults=summary["chosen"]["median_goodput_rps"] / base if base > 0 else None)
    return out
