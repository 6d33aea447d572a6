"""`kvpilot bench tuning grid`: every point of each scenario's grid measured on the engine,
`repeats` windows per point (`windows.measure_window`).

One engine per scenario (every axis is a scheduler limit, changed live); the repeats are
interleaved: each repeat visits every point once in its own shuffled order, so a shared
machine's drift spreads over all points instead of biasing a few. Points the memory model
refuses (`feasibility.check`: a budget below max_num_seqs, chunked prefill off with a budget
below max_model_len, a cache that cannot hold one max_model_len sequence) are stored
unmeasured: deploying one is a failed deployment in the replay. The table is written after
every window, and a run given the same output file continues it (more repeats, more scenarios).

JSON: {"model", "scenarios": {name: {"spec", "defaults", "points": [{"settings",
"feasible_model", "reason", "windows": [...]}]}}, "runs": [{"finished", "scenarios", "wall_s",
"machine"}]}: kvpilot.loadgen.machine's machine block, and each window's load as "loadavg".
Recorded grids kept "runs" as "load", later as loose "cpu", "cpus", "load_avg" keys (the
windows' "load_avg"); nothing reads those back.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvpilot.loadgen.machine import machine_info
from kvpilot.tuner.benchmark.scenarios import Scenario
from kvpilot.tuner.benchmark.windows import measure_window, open_runner
from kvpilot.tuner.search.feasibility import Hardware, check, resolve_model
from kvpilot.tuner.search.settings import EngineSettings


def scenario_entry(table: dict[str, Any], name: str, scenario: Scenario, model: str) -> dict[str, Any]:
    """The table's entry for `name`, created with every point and the memory model's verdict.
    Raises ValueError when the table holds `name` with another load or grid."""
    entry = table["scenarios"].get(name)
    if entry is not None:
        if Scenario.from_spec(name, entry["spec"]) != scenario:
            raise ValueError(f"the output JSON holds scenario {name!r} with another load or grid: "
                             f"choose another --output-json, or the same flags as its run")
        return entry
    hardware = Hardware(device_memory_bytes=1, num_gpu_blocks_override=scenario.kv_blocks)
    model_config = resolve_model(model)
    points = []
    for s in scenario.points():
        verdict = check(s, model_config, hardware)
        points.append({"settings": s.as_dict(), "feasible_model": verdict.feasible, "reason": verdict.reason,
                       "windows": []})
    table["scenarios"][name] = {"spec": scenario.spec(), "defaults": scenario.defaults().as_dict(), "points": points}
    return table["scenarios"][name]


def measure_scenario(entry: dict[str, Any], name: str, scenario: Scenario, model: str, repeats: int,
                     log_dir: Path, save: Callable[[], None]) -> None:
    """Measures the entry's points up to `repeats` windows each, saving after every window."""
    runner = open_runner(scenario, model, log_dir / f"{name}.log")
    t0 = time.monotonic()
    try:
        for rep in range(repeats):
            order = [p for p in entry["points"] if p["feasible_model"] and len(p["windows"]) <= rep]
            random.Random(100 * rep + len(name)).shuffle(order)
            for point in order:
                settings = EngineSettings(**point["settings"])
                window = measure_window(runner, settings)
                window["repeat"] = rep
                point["windows"].append(window)
                save()
                print(f"[{time.monotonic() - t0:6.0f}s] {name} repeat {rep} {settings.describe()} "
                      f"({window['applied']}): {window['duration_s']:.1f}s, ttft max {max(window['ttft_s'] or [0]):.2f}"
                      f" s, preemptions {window['preemptions']:.0f}, failed {window['failed']}, "
                      f"load {window['loadavg'][0]}", file=sys.stderr, flush=True)
    finally:
        runner.close()


def measure_grid(table: dict[str, Any], scenarios: dict[str, Scenario], model: str, repeats: int, log_dir: Path,
                 save: Callable[[], None]) -> dict[str, Any]:
    """Measures every scenario into `table` (a new or a resumed grid JSON) and returns it."""
    t0 = time.monotonic()
    table.setdefault("model", model)
    table.setdefault("scenarios", {})
    if table["model"] != model:
        raise ValueError(f"the output JSON holds a grid of {table['model']!r}: choose another --output-json")
    for name, scenario in scenarios.items():
        entry = scenario_entry(table, name, scenario, model)
        measure_scenario(entry, name, scenario, model, repeats, log_dir, save)
    table.setdefault("runs", []).append({"finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                         "scenarios": ",".join(scenarios), "wall_s": round(time.monotonic() - t0),
                                         "machine": machine_info()})
    save()
    return table
