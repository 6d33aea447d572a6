"""The chunked-prefill study's report: per-configuration records, the checks of the
published study's conclusions (DESIGN.md, "Engine behaviour we owe our users"), PNG plots
and summary.md.

A record is a dict: `max_num_batched_tokens`, `enable_chunked_prefill`, `status` ("ok",
"refused": the server exited at startup, "failed": it ran but no request completed),
`message` (the server's refusal line), and for runs the vLLM result keys (`duration` s,
`output_throughput` tok/s, `mean_ttft_ms`, `p99_ttft_ms`, `mean_tpot_ms`, ..., `completed`,
`failed`, `error_counts`). Sources: vLLM `benchmark_serving` (metric definitions) and the
study of `--enable-chunked-prefill` x `--max-num-batched-tokens` on ShareGPT.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SMALL_BUDGET = 256  # "below ~256 tokens total time grows as the budget shrinks"
LARGE_BUDGET = 2048  # "above ~2048 the curves are flat"
FLAT_TOLERANCE = 0.15  # a curve is flat when (max - min) / median <= this
GROWTH_TOLERANCE = 0.05  # noise allowed on "total time grows" between neighbours
FLAT_KEYS = ("duration", "output_throughput", "mean_ttft_ms", "mean_itl_ms")
PLOTS = {  # file -> (title, [(result key, y label)])
    "duration_throughput.png": ("Total duration and throughput",
                                [("duration", "total duration (s)"), ("output_throughput", "output tok/s")]),
    "ttft.png": ("TTFT", [("mean_ttft_ms", "mean TTFT (ms)"), ("p99_ttft_ms", "p99 TTFT (ms)")]),
    "tpot.png": ("TPOT", [("mean_tpot_ms", "mean TPOT (ms)"), ("p99_tpot_ms", "p99 TPOT (ms)")]),
    "itl.png": ("ITL", [("mean_itl_ms", "mean ITL (ms)"), ("p99_itl_ms", "p99 ITL (ms)")]),
}


@dataclass
class Verdict:
    """One study conclusion: `agrees` is True, False, or None (not enough runs to tell);
    `evidence` states the numbers behind it."""

    claim: str
    agrees: bool | None
    evidence: str

    @property
    def label(self) -> str:
        """"agrees", "disagrees" or "not tested" for `agrees` True, False or None (the summary's word)."""
        return {True: "agrees", False: "disagrees", None: "not tested"}[self.agrees]


def _curve(records: Sequence[dict], chunked: bool) -> dict[int, dict]:
    return {r["max_num_batched_tokens"]: r for r in records
            if r["status"] == "ok" and r["enable_chunked_prefill"] == chunked}


def check_chunked_off_ttft_itl(records: Sequence[dict]) -> Verdict:
    """Chunked off: better (lower) mean TTFT and worse (higher) mean ITL than chunked on, at
    the majority of budgets where both ran."""
    claim = "Chunked prefill off gives better TTFT and worse ITL than on"
    on, off = _curve(records, True), _curve(records, False)
    common = sorted(set(on) & set(off))
    if not common:
        return Verdict(claim, None, "no budget ran with both settings")
    rows, ttft_ok, itl_ok = [], 0, 0
    for b in common:
        ttft_ok += off[b]["mean_ttft_ms"] < on[b]["mean_ttft_ms"]
        itl_ok += off[b]["mean_itl_ms"] > on[b]["mean_itl_ms"]
        rows.append(f"{b}: TTFT off {off[b]['mean_ttft_ms']:.0f} vs on {on[b]['mean_ttft_ms']:.0f} ms, "
                    f"ITL off {off[b]['mean_itl_ms']:.1f} vs on {on[b]['mean_itl_ms']:.1f} ms")
    n = len(common)
    agrees = 2 * ttft_ok > n and 2 * itl_ok > n
    return Verdict(claim, agrees, f"TTFT lower with off at {ttft_ok}/{n} budgets, ITL higher with off at "
                   f"{itl_ok}/{n}; " + "; ".join(rows))


def check_chunked_on_budget_tradeoff(records: Sequence[dict]) -> Verdict:
    """Chunked on: the smallest budget has lower mean ITL than the largest, and the largest
    has lower mean TTFT and higher output throughput than the smallest."""
    claim = "Chunked prefill on: small budgets favour ITL, large budgets favour TTFT and throughput"
    on = _curve(records, True)
    if len(on) < 2:
        return Verdict(claim, None, "fewer than two chunked-on runs")
    s, l = on[min(on)], on[max(on)]
    agrees = (s["mean_itl_ms"] < l["mean_itl_ms"] and l["mean_ttft_ms"] < s["mean_ttft_ms"]
              and l["output_throughput"] > s["output_throughput"])
    return Verdict(claim, agrees, (
        f"budget {min(on)} vs {max(on)}: mean ITL {s['mean_itl_ms']:.1f} vs {l['mean_itl_ms']:.1f} ms, "
        f"mean TTFT {s['mean_ttft_ms']:.0f} vs {l['mean_ttft_ms']:.0f} ms, "
        f"output {s['output_throughput']:.1f} vs {l['output_throughput']:.1f} tok/s"))


def check_small_budget_growth(records: Sequence[dict]) -> Verdict:
    """Below ~256: for each chunked setting with >= 2 runs at budgets <= SMALL_BUDGET, total
    duration never drops (beyond GROWTH_TOLERANCE) as the budget halves, and the smallest
    budget's duration exceeds the largest such budget's by more than GROWTH_TOLERANCE."""
    claim = f"Below ~{SMALL_BUDGET} tokens, total time grows as the budget shrinks"
    parts, results = [], []
    for chunked in (True, False):
        curve = {b: r["duration"] for b, r in _curve(records, chunked).items() if b <= SMALL_BUDGET}
        if len(curve) < 2:
            continue
        budgets = sorted(curve)
        steps = all(curve[a] >= curve[b] * (1 - GROWTH_TOLERANCE) for a, b in zip(budgets, budgets[1:]))
        results.append(steps and curve[budgets[0]] > curve[budgets[-1]] * (1 + GROWTH_TOLERANCE))
        parts.append(f"chunked {'on' if chunked else 'off'}: " + ", ".join(f"{b}: {curve[b]:.1f} s" for b in budgets))
    if not results:
        return Verdict(claim, None, f"fewer than two runs at budgets <= {SMALL_BUDGET}")
    return Verdict(claim, all(results), "; ".join(parts))


def check_large_budget_flat(records: Sequence[dict]) -> Verdict:
    """Above ~2048: for each chunked setting with >= 2 runs at budgets >= LARGE_BUDGET,
    every metric in FLAT_KEYS varies by at most FLAT_TOLERANCE of its median."""
    claim = f"Above ~{LARGE_BUDGET} tokens the curves are flat"
    parts, results = [], []
    for chunked in (True, False):
        curve = [r for b, r in sorted(_curve(records, chunked).items()) if b >= LARGE_BUDGET]
        if len(curve) < 2:
            continue
        spreads = {}
        for key in FLAT_KEYS:
            values = sorted(r[key] for r in curve)
            median = values[len(values) // 2] if len(values) % 2 else (values[len(values) // 2 - 1]
                                                                        + values[len(values) // 2]) / 2
            spreads[key] = (values[-1] - values[0]) / median if median else 0.0
        results.append(all(s <= FLAT_TOLERANCE for s in spreads.values()))
        parts.append(f"chunked {'on' if chunked else 'off'} spread (max-min)/median: "
                     + ", ".join(f"{k} {100 * s:.0f}%" for k, s in spreads.items()))
    if not results:
        return Verdict(claim, None, f"fewer than two runs at budgets >= {LARGE_BUDGET}")
    return Verdict(claim, all(results), "; ".join(parts) + f" (flat: <= {100 * FLAT_TOLERANCE:.0f}%)")


def study_verdicts(records: Sequence[dict]) -> list[Verdict]:
    """The four verdicts on the published chunked-prefill study (DESIGN.md), in order: chunked
    off's TTFT/ITL, chunked on's budget trade-off, small budgets' growth, large budgets flat."""
    return [check(records) for check in (check_chunked_off_ttft_itl, check_chunked_on_budget_tradeoff,
                                         check_small_budget_growth, check_large_budget_flat)]


def write_plots(records: Sequence[dict], out_dir: Path) -> list[Path]:
    """One PNG per entry of PLOTS: each metric against max_num_batched_tokens (log2 x axis),
    one line per chunked setting. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, (title, panels) in PLOTS.items():
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
        for ax, (key, ylabel) in zip(axes[0], panels):
            for chunked in (True, False):
                curve = _curve(records, chunked)
                budgets = sorted(curve)
                ax.plot(budgets, [curve[b][key] for b in budgets], marker="o",
                        label=f"chunked prefill {'on' if chunked else 'off'}")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("max_num_batched_tokens")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=90)
        plt.close(fig)
        paths.append(out_dir / name)
    return paths


def render_summary(records: Sequence[dict], setup: dict[str, Any]) -> str:
    """summary.md: the setup, one line per study conclusion (agrees / disagrees / not
    tested, with the numbers), the table of runs, refused configurations with the server's
    message, and failed requests."""
    lines = ["# Chunked-prefill sweep", "", "Setup: " + ", ".join(f"{k}={v}" for k, v in setup.items()), "",
             "## The published study's conclusions, checked", ""]
    for v in study_verdicts(records):
        lines.append(f"- **{v.claim}**: {v.label}. {v.evidence}")
    lines += ["", "## Runs", "",
              "| budget | chunked | status | completed | failed | duration s | out tok/s | mean TTFT ms "
              "| p99 TTFT ms | mean TPOT ms | mean ITL ms | p99 ITL ms |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(records, key=lambda r: (not r["enable_chunked_prefill"], r["max_num_batched_tokens"])):
        head = f"| {r['max_num_batched_tokens']} | {'on' if r['enable_chunked_prefill'] else 'off'} | {r['status']} |"
        if "duration" in r:
            lines.append(head + f" {r['completed']} | {r['failed']} | {r['duration']:.1f} | "
                         f"{r['output_throughput']:.1f} | {r['mean_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | "
                         f"{r['mean_tpot_ms']:.1f} | {r['mean_itl_ms']:.1f} | {r['p99_itl_ms']:.1f} |")
        else:
            lines.append(head + " | | | | | | | | |")
    refused = [r for r in records if r["status"] != "ok" and r.get("message")]
    if refused:
        lines += ["", "## Configurations refused at startup or failed", ""]
        lines += [f"- budget {r['max_num_batched_tokens']}, chunked {'on' if r['enable_chunked_prefill'] else 'off'}"
                  f" ({r['status']}): `{r['message']}`" for r in refused]
    failed = [r for r in records if r.get("failed")]
    if failed:
        lines += ["", "## Failed requests", ""]
        lines += [f"- budget {r['max_num_batched_tokens']}, chunked {'on' if r['enable_chunked_prefill'] else 'off'}:"
                  f" {r['failed']} failed {r.get('error_counts', {})}" for r in failed]
    return "\n".join(lines) + "\n"


def write_report(records: Sequence[dict], out_dir: Path, setup: dict[str, Any]) -> Path:
    """The report folder: runs/<budget>-chunked-<on|off>.json per record, the PLOTS PNGs,
    summary.md. Returns the summary's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "runs").mkdir(exist_ok=True)
    for r in records:
        name = f"{r['max_num_batched_tokens']}-chunked-{'on' if r['enable_chunked_prefill'] else 'off'}.json"
        (out_dir / "runs" / name).write_text(json.dumps(r, indent=1))
    write_plots(records, out_dir)
    summary = out_dir / "summary.md"
    summary.write_text(render_summary(records, setup))
    return summary
