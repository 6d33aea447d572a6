"""The numbers and tables of `kvpilot bench compare`: one run's summary, the highest
request rate within the SLOs, the terminal table, and compare.md / compare.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvpilot.loadgen.datasets import encode_plain
from kvpilot.loadgen.machine import load_1m
from kvpilot.loadgen.metrics import calculate_metrics

Peers = dict[str, dict[float, dict] | str]  # peer -> {rate: numbers}, or why it did not start


def summarize_run(results: list, duration: float, tokenizer: Any) -> dict[str, float]:
    """The comparison's numbers of one run: req/s, output tok/s, median and p95 TTFT and
    ITL (ms), duration (s)."""
    m, _ = calculate_metrics(results, duration, percentiles=[95],
                             count_tokens=lambda text: len(encode_plain(tokenizer, text)))
    return {"completed": m.completed, "failed": m.failed, "duration": duration,
            "request_throughput": m.request_throughput, "output_throughput": m.output_throughput,
            "total_output_tokens": m.total_output, "median_ttft_ms": m.stats["ttft"].median,
            "p95_ttft_ms": m.stats["ttft"].percentiles[95.0], "median_itl_ms": m.stats["itl"].median,
            "p95_itl_ms": m.stats["itl"].percentiles[95.0]}


def max_sustained_rate(runs: dict[float, dict], slo_ttft_ms: float, slo_itl_ms: float) -> float | None:
    """Highest rate whose run failed no request and met both p95 SLOs, when every lower
    rate did too; None when the lowest rate already misses."""
    best = None
    for rate in sorted(runs):
        r = runs[rate]
        if r["failed"] or r["p95_ttft_ms"] > slo_ttft_ms or r["p95_itl_ms"] > slo_itl_ms:
            break
        best = rate
    return best


def render(peers: Peers, rates: list[float], slo: tuple[float, float]) -> Table:
    """The terminal table: per request rate, each peer's achieved req/s, output tok/s, p95 TTFT
    and p95 ITL (ms), then each peer's highest rate within `slo` = (p95 TTFT ms, p95 ITL ms)
    (max_sustained_rate). A peer that did not start (a str) shows "-"."""
    table = Table(title="kvpilot vs llama.cpp (same ShareGPT requests, same client)")
    table.add_column("req/s sent", justify="right")
    for name in peers:
        for col in ("req/s", "out tok/s", "p95 TTFT ms", "p95 ITL ms"):
            table.add_column(f"{name} {col}", justify="right")
    for rate in rates:
        row = [f"{rate:g}"]
        for runs in peers.values():
            r = runs.get(rate) if isinstance(runs, dict) else None
            row += ([f"{r['request_throughput']:.2f}", f"{r['output_throughput']:.1f}", f"{r['p95_ttft_ms']:.0f}",
                     f"{r['p95_itl_ms']:.1f}"] if r else ["-"] * 4)
        table.add_row(*row)
    best = ["max rate within SLO"]
    for runs in peers.values():
        rate = max_sustained_rate(runs, *slo) if isinstance(runs, dict) else None
        best += [f"{rate:g}" if rate is not None else "none", "", "", ""]
    table.add_row(*best)
    return table


def markdown_table(peers: Peers, rates: list[float]) -> str:
    """One row per request rate and peer, for the committed report."""
    lines = ["| req/s sent | server | completed | failed | req/s | out tok/s | median TTFT ms | p95 TTFT ms "
             "| median ITL ms | p95 ITL ms | load 1m before/after |", "|" + "---|" * 11]
    for rate in rates:
        for name, runs in peers.items():
            r = runs.get(rate) if isinstance(runs, dict) else None
            if r is None:
                lines.append(f"| {rate:g} | {name} |" + " - |" * 9)
                continue
            lines.append(f"| {rate:g} | {name} | {r['completed']} | {r['failed']} | {r['request_throughput']:.2f} "
                         f"| {r['output_throughput']:.1f} | {r['median_ttft_ms']:.0f} | {r['p95_ttft_ms']:.0f} "
                         f"| {r['median_itl_ms']:.1f} | {r['p95_itl_ms']:.1f} "
                         f"| {load_1m(r, 'before') or 0:.1f} / {load_1m(r, 'after') or 0:.1f} |")
    return "\n".join(lines) + "\n"


def write_reports(out_dir: Path, peers: Peers, rates: list[float], a: Any, setup: str, env: dict[str, Any],
                  commands: dict[str, list[str]]) -> None:
    """Prints the table and writes compare.md and compare.json under `out_dir`. `a`: the
    parsed flags (SLOs, number of prompts, metadata)."""
    console = Console(record=True, width=60 + 50 * len(peers))
    console.print(render(peers, rates, (a.slo_ttft_ms, a.slo_itl_ms)))
    for name, runs in peers.items():
        if isinstance(runs, str):
            console.print(f"{name} did not start: {runs}")
    best = {n: (max_sustained_rate(r, a.slo_ttft_ms, a.slo_itl_ms) if isinstance(r, dict) else None)
            for n, r in peers.items()}
    (out_dir / "compare.md").write_text(
        f"Setup: {setup}\n\n" + markdown_table(peers, rates)
        + f"\nHighest rate with no failures, p95 TTFT <= {a.slo_ttft_ms:g} ms and p95 ITL <= {a.slo_itl_ms:g} ms "
        + "(every lower rate too): " + ", ".join(f"{n} {r:g} req/s" if r is not None else f"{n} none"
                                                  for n, r in best.items())
        + "\n\n```\n" + console.export_text() + "```\n\nCommands:\n\n"
        + "".join(f"- {n}: `{' '.join(c)}`\n" for n, c in commands.items()))
    (out_dir / "compare.json").write_text(json.dumps(
        {"rates": rates, "num_prompts": a.num_prompts, "setup": setup,
         "slo": {"p95_ttft_ms": a.slo_ttft_ms, "p95_itl_ms": a.slo_itl_ms},
         "max_rate_within_slo": best, "metadata": dict(m.split("=", 1) for m in a.metadata),
         "environment": env, "commands": commands,
         "peers": {n: ({str(k): v for k, v in r.items()} if isinstance(r, dict) else r) for n, r in peers.items()}},
        indent=1))
