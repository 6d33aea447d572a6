"""The defaults against the tuner's winner, in the words of vLLM's performance-tuning guide.

vLLM's guide ("Optimization and Tuning", section "Preemption") names the symptom and its
remedies: requests preempted for lack of KV cache space; to fix it, raise
gpu_memory_utilization (more KV cache), lower max_num_seqs or max_num_batched_tokens (fewer
requests or tokens per step need less cache), or raise tensor_parallel_size /
pipeline_parallel_size (the weights spread, more memory left for the cache). The chunked
prefill section adds: a smaller max_num_batched_tokens favours inter-token latency, a
larger one time to first token and throughput. `before_after` reads a tuning report
(`kvpilot.tuner.report.tuning_report.build`) and prints, for the defaults and the winner, preemptions per
minute, p95 TTFT, p95 ITL and goodput (medians over each one's measured windows; goodput
counts the requests that met the TTFT and TPOT limits, vLLM's `--goodput`), the goodput
within the SLOs (DistServe's sense: a window that broke an SLO, the preemption limit
included, serves none; mean over windows), how many windows met the SLOs, and every changed
setting with the guide's reason; `write_plot` draws the same as bars against the SLO limits
(matplotlib).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

METRICS = (("preemptions_per_min", "preemptions/min", 1.0), ("ttft_p95_s", "p95 TTFT ms", 1000.0),
           ("itl_p95_s", "p95 ITL ms", 1000.0), ("goodput_rps", "goodput req/s", 1.0),
           ("goodput_within_slos", "within SLOs", 1.0))
_SLO_OF = {"preemptions_per_min": "max_preemptions_per_min", "ttft_p95_s": "ttft_p95_ms", "itl_p95_s": "itl_p95_ms"}

# why a change helps, by setting and direction, in the guide's terms
_WHY = {
    ("max_num_seqs", "lower"): "fewer requests run at once, so their KV blocks fit the cache: no preemption "
                               "(guide: decrease max_num_seqs)",
    ("max_num_seqs", "raise"): "more requests share each step (throughput) where the cache holds them",
    ("max_num_batched_tokens", "lower"): "fewer tokens per step: less cache claimed per step and shorter steps, "
                                         "which favours ITL (guide: decrease max_num_batched_tokens)",
    ("max_num_batched_tokens", "raise"): "more tokens per step, which favours TTFT and throughput (guide: "
                                         "chunked prefill section)",
    ("gpu_memory_utilization", "raise"): "more memory for the KV cache (guide: increase gpu_memory_utilization)",
    ("gpu_memory_utilization", "lower"): "less memory for the KV cache; fits beside other processes",
    ("kv_cache_memory_bytes", "raise"): "a larger KV cache (guide: more KV cache memory)",
    ("kv_cache_memory_bytes", "lower"): "a smaller KV cache",
    ("tensor_parallel_size", "raise"): "weights split over more devices leave more memory for the KV cache "
                                       "(guide: increase tensor_parallel_size)",
    ("pipeline_parallel_size", "raise"): "layers split over more devices leave more memory for the KV cache "
                                         "(guide: increase pipeline_parallel_size)",
    ("nnodes", "raise"): "the ranks spread over more pods: each pod holds fewer of them, more of its memory is left "
                         "for the KV cache",
    ("nnodes", "lower"): "fewer pods per engine: less traffic between pods in every step",
    ("enable_chunked_prefill", "raise"): "decodes first, prompts chunked into the rest of the budget",
    ("enable_chunked_prefill", "lower"): "whole prompts in their own steps: decode steps stay short on a CPU",
}


def windows(report: dict[str, Any], number: int) -> list[dict[str, Any]]:
    """The measurements of trial `number` and of its re-measurements."""
    return [t["measurement"] for t in report["trials"]
            if (t["number"] == number or t.get("remeasure_of") == number) and t.get("measurement")]


def summary(report: dict[str, Any], number: int) -> dict[str, Any]:
    """Median of each metric over the trial's windows, how many windows met the SLOs, its settings."""
    ms = windows(report, number)
    trials = [t for t in report["trials"] if t["number"] == number or t.get("remeasure_of") == number]
    out: dict[str, Any] = {"number": number, "windows": len(ms),
                           "met": sum(1 for t in trials if t["verdict"] == "measured"),
                           "settings": next(t["settings"] for t in report["trials"] if t["number"] == number)}
    for key, _, _ in METRICS[:-1]:
        values = [m[key] for m in ms if m.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    # a window that breaks an SLO serves no goodput within the SLOs
    out["goodput_within_slos"] = statistics.fmean(
        [(t["measurement"].get("goodput_rps") or 0.0) if t["verdict"] == "measured" else 0.0
         for t in trials if t.get("measurement")] or [0.0])
    return out


def changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """'setting old -> new: why' for every setting that differs."""
    lines = []
    for name, old in before.items():
        new = after.get(name)
        if new == old or (name, "raise") not in _WHY and (name, "lower") not in _WHY:
            continue
        direction = "raise" if (new or 0) > (old or 0) else "lower"
        lines.append(f"{direction} {name} {old} -> {new}: {_WHY.get((name, direction), '')}")
    return lines


def _cell(key: str, value: float | None, scale: float) -> str:
    if value is None:
        return "-"
    return f"{value * scale:.3f}" if key.startswith("goodput") else f"{value * scale:.1f}" if scale == 1 else \
        f"{value * scale:.0f}"


def before_after(report: dict[str, Any]) -> str:
    """The defaults against the winner (the decision's pick), as text."""
    slo, defaults, best = report["slo"], report.get("defaults"), report.get("best")
    if not defaults:
        return "no measured defaults to compare"
    rows = [("defaults", summary(report, defaults["number"]))]
    if best and best["number"] != defaults["number"]:
        rows.append(("tuned", summary(report, best["number"])))
    limits = {k: slo[v] for k, v in _SLO_OF.items()}
    head = f"{'':<10}" + "".join(f"{label:>17}" for _, label, _ in METRICS) + "   SLOs met (windows)"
    def limit(key: str, scale: float) -> str:
        if key not in limits:
            return "max"
        return "<= " + _cell(key, limits[key] / (1.0 if key == "preemptions_per_min" else 1000.0), scale)
    lines = ["before/after (vLLM's tuning guide: preemptions mean the KV cache is too small for the load)",
             head, f"{'SLO':<10}" + "".join(f"{limit(k, s):>17}" for k, _, s in METRICS)]
    for name, row in rows:
        lines.append(f"{name:<10}" + "".join(f"{_cell(k, row[k], s):>17}" for k, _, s in METRICS)
                     + f"   {row['met']}/{row['windows']}")
    if len(rows) == 1:
        lines.append("the tuner kept the defaults" + ("" if defaults["feasible"] else " (no setting met the SLOs)"))
        return "\n".join(lines)
    lines.append("changed (in the guide's terms):")
    lines += ["  " + c for c in changes(rows[0][1]["settings"], rows[1][1]["settings"])]
    before, after = rows[0][1], rows[1][1]
    lines.append(f"goodput within the SLOs (mean over windows, 0 where one broke them): defaults "
                 f"{before['goodput_within_slos']:.3f} req/s, tuned {after['goodput_within_slos']:.3f} req/s; "
                 f"per-request goodput alone {_cell('goodput_rps', before['goodput_rps'], 1)}"
                 f" -> {_cell('goodput_rps', after['goodput_rps'], 1)} req/s; preemptions/min "
                 f"{_cell('preemptions_per_min', before['preemptions_per_min'], 1)} -> "
                 f"{_cell('preemptions_per_min', after['preemptions_per_min'], 1)}")
    return "\n".join(lines)


def write_plot(report: dict[str, Any], folder: Path) -> Path | None:
    """before_after.png: one bar pair per metric (defaults, winner) with the SLO limit as a
    line; None when there is no winner other than the defaults."""
    defaults, best = report.get("defaults"), report.get("best")
    if not defaults or not best or best["number"] == defaults["number"]:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [summary(report, defaults["number"]), summary(report, best["number"])]
    fig, axes = plt.subplots(1, len(METRICS), figsize=(14, 3.6))
    for ax, (key, label, scale) in zip(axes, METRICS):
        values = [(r[key] or 0.0) * scale for r in rows]
        ax.bar(["defaults", "tuned"], values, color=["tab:red", "tab:green"])
        if key in _SLO_OF:
            limit = report["slo"][_SLO_OF[key]]
            ax.axhline(limit, color="black", linestyle="--", label="SLO")
            ax.legend(loc="upper right")
        ax.set_title(label)
    seqs = [r["settings"]["max_num_seqs"] for r in rows]
    fig.suptitle(f"defaults (max_num_seqs {seqs[0]}) vs tuned (max_num_seqs {seqs[1]}): vLLM's tuning guide "
                 f"on this CPU")
    fig.tight_layout()
    path = folder / "before_after.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
