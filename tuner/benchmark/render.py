"""The tables `kvpilot bench tuning` prints (Markdown, so a results README can take them as
they are)."""

from __future__ import annotations

from typing import Any

from kvpilot.tuner.benchmark.judge import LOOSE_MS, point_figure
from kvpilot.tuner.search.objective import SLO


def _point(settings: dict[str, Any]) -> str:
    return (f"| {'on' if settings['enable_chunked_prefill'] else 'off'} | {settings['max_num_seqs']} "
            f"| {settings['max_num_batched_tokens']} ")


def grid_table(table: dict[str, Any]) -> str:
    """Per scenario and point: windows, the medians over them of throughput (every request
    counts), p95 TTFT, p95 ITL and preemptions/min."""
    lines = []
    loose = SLO(LOOSE_MS, LOOSE_MS, max_preemptions_per_min=LOOSE_MS)
    for name, entry in table["scenarios"].items():
        lines += [f"## {name}", "", "| chunked | max_num_seqs | max_num_batched_tokens | windows | req/s "
                  "| p95 TTFT ms | p95 ITL ms | preemptions/min |", "|---|---|---|---|---|---|---|---|"]
        for point in entry["points"]:
            f = point_figure(point, loose)
            if not f["windows"]:
                why = f"refused by the memory model: {point['reason']}" if f["refused"] else "not measured yet"
                lines.append(_point(point["settings"]) + f"| 0 | {why} | | | |")
                continue
            lines.append(_point(point["settings"]) + f"| {f['windows']} | {f['goodput']:.3f} | {f['p95_ttft_ms']:.0f} "
                         f"| {f['p95_itl_ms']:.0f} | {f['preempt_per_min']:.1f} |")
        lines.append("")
    return "\n".join(lines)


def _limits(slo: dict[str, float]) -> str:
    shown = [f"{k}={v:.0f}" for k, v in slo.items() if k != "e2e_p95_ms" and v < LOOSE_MS]
    return ", ".join(shown) or "none"


def replay_table(replayed: dict[str, Any]) -> str:
    """Per scenario: the SLOs, the defaults' table figure, and each strategy's median and worst
    ratio to the best feasible point."""
    lines = []
    for name, r in replayed.items():
        d = r["defaults"]
        lines += [f"## {name}: SLO {_limits(r['slo'])}; {r['violating_points']}/{r['grid_points']} points violate "
                  f"or are refused; budget {r['budget']} windows",
                  f"defaults: goodput {d['goodput']:.3f} req/s, feasible {d['feasible']}; best feasible "
                  f"{r['best_feasible_goodput']:.3f} req/s", "",
                  "| strategy | median ratio | worst ratio | refused settings deployed (all seeds) | windows (max) |",
                  "|---|---|---|---|---|"]
        lines += [f"| {k} | {s['median_ratio']:.2f} | {s['worst_ratio']:.2f} | {s['refused_deployed_total']} "
                  f"| {s['max_windows']} |" for k, s in r["strategies"].items()]
        lines.append("")
    return "\n".join(lines)


def confirm_table(confirmed: dict[str, Any]) -> str:
    """Per scenario: the choice, and median goodput and windows within the SLOs of both."""
    lines = ["| scenario | choice (chunked, max_num_seqs, max_num_batched_tokens) | chosen by | defaults: median "
             "goodput req/s, windows within the SLOs | choice: the same |", "|---|---|---|---|---|"]
    for name, c in confirmed.items():
        if not c["chosen"]:
            lines.append(f"| {name} | - | {c['chosen_by_seeds']} | - | - |")
            continue
        s, summary = c["chosen"], c["summary"]
        lines.append(f"| {name} | {'on' if s['enable_chunked_prefill'] else 'off'}, {s['max_num_seqs']}, "
                     f"{s['max_num_batched_tokens']} | {c['chosen_by_seeds']} "
                     + "".join(f"| {summary[k]['median_goodput_rps']:.3f}, {summary[k]['windows_meeting_slo']} "
                               for k in ("defaults", "chosen")) + "|")
    return "\n".join(lines)
