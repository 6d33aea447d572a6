"""The figures of `kvpilot bench shared-node` against the same server alone, the goals they are
held to (issue 38), and the terminal table."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from kvpilot.loadgen.machine import load_1m, recorded_machine

ARRANGEMENTS = ("alone", "neighbours", "quota")
# arrangement -> {figure: the largest (ITL) or smallest (throughput) ratio to alone that meets the goal}
GOALS = {
    "neighbours": {"median_itl_ms": 2.5, "p95_itl_ms": 3.0, "burst_output_throughput": 0.4},
    "quota": {"median_itl_ms": 2.5},
}
FIGURES = ("median_itl_ms", "p95_itl_ms", "max_itl_ms", "median_ttft_ms", "burst_output_throughput")


def ratios(figures: dict[str, Any], arrangements: list[str]) -> dict[str, dict[str, float]]:
    """{arrangement: {figure: its value / the value alone}} for every arrangement but alone."""
    alone = figures.get("alone", {})
    out = {}
    for arrangement in arrangements[1:]:
        mine = figures.get(arrangement, {})
        out[arrangement] = {k: mine[k] / alone[k] for k in FIGURES if mine.get(k) and alone.get(k)}
    return out


def meets(arrangement: str, vs_alone: dict[str, float]) -> dict[str, bool]:
    """{figure: whether it meets its goal} for the figures the arrangement has goals for."""
    goals = GOALS.get(arrangement, {})
    return {k: (vs_alone[k] >= limit if k == "burst_output_throughput" else vs_alone[k] <= limit)
            for k, limit in goals.items() if k in vs_alone}


def _cell(figures: dict, vs: dict, ok: dict, key: str, fmt: str) -> str:
    if key not in figures:
        return "-"
    text = format(figures[key], fmt)
    if key in vs:
        mark = "" if key not in ok else (" ok" if ok[key] else " MISSED")
        text += f" ({vs[key]:.2f}x{mark})"
    return text


def render(report: dict[str, Any], console: Console | None = None) -> Table:
    """Prints (and returns) one row per peer and arrangement."""
    table = Table(title=f"Shared node: {report['neighbours']} busy neighbour(s) at equal weight, "
                        f"quota {report['quota_cpus']:g} CPUs; ratios against the same server alone")
    for col in ("peer", "arrangement", "ITL median ms", "ITL p95 ms", "ITL max ms", "TTFT median ms",
                "burst out tok/s", "throttled periods", "load 1m"):
        table.add_column(col, justify="left" if col in ("peer", "arrangement") else "right")
    for name, figures in report["peers"].items():
        if isinstance(figures, str):
            table.add_row(name, "did not start", figures, *[""] * 6)
            continue
        for arrangement in report["arrangements"]:
            f = figures.get(arrangement, {})
            vs = figures.get("vs_alone", {}).get(arrangement, {})
            ok = meets(arrangement, vs)
            table.add_row(name, arrangement, *(_cell(f, vs, ok, k, fmt) for k, fmt in (
                ("median_itl_ms", ".1f"), ("p95_itl_ms", ".1f"), ("max_itl_ms", ".1f"), ("median_ttft_ms", ".1f"),
                ("burst_output_throughput", ".1f"))), str(f.get("throttled_periods", "-")),
                f"{load_1m(f, 'before') or 0:.2f}")
    console = console or Console(width=150)
    console.print(table)
    machine = recorded_machine(report["environment"])  # a new record's block or an old one's loose keys
    console.print(f"CPU: {machine['cpu']} ({machine['cores']} CPUs); load average at start "
                  f"{_loads(machine['loadavg_before'])}, at end {_loads(machine['loadavg_after'])}")
    return table


def _loads(values: list[float] | float | None) -> str:
    """A recorded load average as "1m 5m 15m" (or the one figure an old record kept); "-" when none."""
    if values is None:
        return "-"
    return " ".join(f"{v:.2f}" for v in (values if isinstance(values, list) else [values]))
