"""A recorded window and a recorded grid judged against SLOs, as the tuner judges a trial.

A window's goodput is the requests per second whose TTFT and TPOT met the limits (vLLM's
`--goodput`, DistServe's definition); its p95 ITL is over every inter-token gap of the window
(as the engine's vllm:inter_token_latency_seconds histogram measures it). The SLOs of a
scenario come from the grid itself (`scenario_slo`): each limit at a percentile of the
measured points' median p95s, so that a good share of the grid breaks them on the machine
that measured it. A point's table figure is the median of its windows' goodputs; it is
feasible when the medians of its p95s, preemptions/min and failures meet the SLOs.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import numpy as np

from kvpilot.tuner.benchmark.scenarios import Scenario
from kvpilot.tuner.search.objective import SLO, Measurement, is_feasible, slack

LOOSE_MS = 1e6  # a limit nothing reaches: the SLO does not constrain it


def p95(values: list[float]) -> float:
    """The 95th percentile of `values` (numpy's linear interpolation), NaN when empty."""
    return float(np.percentile(values, 95)) if values else math.nan


def window_measurement(w: dict[str, Any], slo: SLO) -> Measurement:
    """One recorded window (`windows.measure_window`'s dict) judged against `slo`."""
    good = sum(1 for t, o in zip(w["ttft_s"], w["tpot_s"])
               if t * 1000 <= slo.ttft_p95_ms and o * 1000 <= slo.itl_p95_ms)
    gaps = [x for r in w["itl_s"] for x in r] if "itl_s" in w else w["tpot_s"]
    d = w["duration_s"]
    return Measurement(duration_s=d, completed=len(w["ttft_s"]), failed=w["failed"],
                       throughput_rps=len(w["ttft_s"]) / d, goodput_rps=good / d, ttft_p95_s=p95(w["ttft_s"]),
                       itl_p95_s=p95(gaps), preemptions=w["preemptions"], source="table")


def scenario_slo(scenario: Scenario, points: list[dict[str, Any]]) -> SLO:
    """The scenario's SLOs from the grid: each limit of `scenario.slo_percentiles` at that
    percentile of the measured points' median p95s (ms); no preemption when the scenario
    says so, else preemptions are not limited."""
    judged = [[window_measurement(w, SLO(LOOSE_MS, LOOSE_MS)) for w in p["windows"]] for p in points if p["windows"]]
    if not judged:
        raise ValueError("the grid has no measured window: run `kvpilot bench tuning grid` first")
    medians = {"ttft_p95_ms": [statistics.median(m.ttft_p95_s for m in ms) * 1000 for ms in judged],
               "itl_p95_ms": [statistics.median(m.itl_p95_s for m in ms) * 1000 for ms in judged]}
    limits = {name: float(np.percentile(medians[name], q)) for name, q in scenario.slo_percentiles.items()}
    return SLO(ttft_p95_ms=limits.get("ttft_p95_ms", LOOSE_MS), itl_p95_ms=limits.get("itl_p95_ms", LOOSE_MS),
               max_preemptions_per_min=0.0 if scenario.no_preemption else LOOSE_MS)


def point_figure(point: dict[str, Any], slo: SLO) -> dict[str, Any]:
    """A grid point's table figures: median goodput over its windows, their spread, the medians
    of its p95s (ms) and preemptions/min, and whether those meet `slo`."""
    if not point["windows"]:
        return {"settings": point["settings"], "goodput": 0.0, "feasible": False, "windows": 0,
                "refused": not point["feasible_model"]}
    ms = [window_measurement(w, slo) for w in point["windows"]]
    median = Measurement(duration_s=1.0, completed=int(statistics.median(m.completed for m in ms)),
                         failed=int(statistics.median(m.failed for m in ms)),
                         ttft_p95_s=statistics.median(m.ttft_p95_s for m in ms),
                         itl_p95_s=statistics.median(m.itl_p95_s for m in ms),
                         preemptions=statistics.median(m.preemptions_per_min for m in ms) / 60)
    goodputs = [m.goodput_rps for m in ms]
    return {"settings": point["settings"], "goodput": statistics.median(goodputs),
            "spread": max(goodputs) - min(goodputs), "feasible": is_feasible(slack(median, slo)),
            "windows": len(ms), "refused": False, "p95_ttft_ms": median.ttft_p95_s * 1000,
            "p95_itl_ms": median.itl_p95_s * 1000, "preempt_per_min": median.preemptions * 60}
