"""The numbers and tables of `kvpilot bench compare --max-concurrency`: per concurrency level
and server, the median over repeats of output tokens/s, median and p95 TTFT and median ITL,
and the ratios to vLLM's output tokens/s and median TTFT in the same pass; compare.md and
compare.json with the machine (CPU, load) and the versions."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from kvpilot.bench.compare_peers import DENSE_DTYPE
from kvpilot.loadgen.machine import load_1m, recorded_machine

NUMBERS = ("output_throughput", "median_ttft_ms", "p95_ttft_ms", "median_itl_ms")
BASELINE = "vllm"


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(runs: list[dict[str, Any]], levels: list[int], names: list[str]) -> dict[int, dict[str, dict]]:
    """{level: {server: {NUMBERS' medians over the repeats, "runs", "failed_runs",
    "output_ratio_to_vllm", "ttft_ratio_to_vllm", "load_1m": [min, max]}}}. A ratio is taken
    within one pass (same repeat and level) and its median reported; None without a vLLM run."""
    done = {(r["repeat"], r["concurrency"], r["server"]): r for r in runs if "error" not in r}
    out: dict[int, dict[str, dict]] = {}
    for level in levels:
        out[level] = {}
        for name in names:
            mine = [r for r in runs if r["concurrency"] == level and r["server"] == name]
            ok = [r for r in mine if "error" not in r]
            row: dict[str, Any] = {k: _median([r[k] for r in ok if r.get(k) is not None]) for k in NUMBERS}
            out_ratios, ttft_ratios = [], []
            for r in ok:
                base = done.get((r["repeat"], level, BASELINE))
                if base and base.get("output_throughput"):
                    out_ratios.append(r["output_throughput"] / base["output_throughput"])
                if base and base.get("median_ttft_ms"):
                    ttft_ratios.append(r["median_ttft_ms"] / base["median_ttft_ms"])
            loads = [x for r in mine for x in (load_1m(r, "before"), load_1m(r, "after")) if x is not None]
            row.update(runs=len(ok), failed_runs=len(mine) - len(ok), output_ratio_to_vllm=_median(out_ratios),
                       ttft_ratio_to_vllm=_median(ttft_ratios),
                       failed_requests=sum(r.get("failed", 0) for r in ok),
                       load_1m=[min(loads), max(loads)] if loads else None)
            out[level][name] = row
    return out


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown_table(summary: dict[int, dict[str, dict]]) -> str:
    """One row per concurrency level and server."""
    lines = ["| concurrency | server | runs | out tok/s | median TTFT ms | p95 TTFT ms | median ITL ms "
             "| out tok/s / vLLM | TTFT / vLLM | failed requests | load 1m min-max |", "|" + "---|" * 11]
    for level, servers in summary.items():
        for name, r in servers.items():
            load = "-" if r["load_1m"] is None else f"{r['load_1m'][0]:.1f}-{r['load_1m'][1]:.1f}"
            lines.append(f"| {level} | {name} | {r['runs']} | {_cell(r['output_throughput'], '.1f')} "
                         f"| {_cell(r['median_ttft_ms'], '.0f')} | {_cell(r['p95_ttft_ms'], '.0f')} "
                         f"| {_cell(r['median_itl_ms'], '.1f')} | {_cell(r['output_ratio_to_vllm'], '.2f')} "
                         f"| {_cell(r['ttft_ratio_to_vllm'], '.2f')} | {r['failed_requests']} | {load} |")
    return "\n".join(lines) + "\n"


def write_reports(out: Path, a: argparse.Namespace, levels: list[int], names: list[str], runs: list[dict],
                  summary: dict[int, dict[str, dict]], commands: dict[str, list[str]], info: dict[str, Any]) -> None:
    """Prints the table and writes compare.md and compare.json under `out`. `info`: client,
    machine, versions, start-up times, wall time."""
    table = markdown_table(summary)
    errors = [f"- {r['server']} at concurrency {r['concurrency']} (pass {r['repeat']}): {r['error']}"
              for r in runs if "error" in r]
    print(table + "\n".join(errors))
    cpu = recorded_machine(info)  # the machine block, or an old record's (its ISA flags as "isa_flags")
    setup = (f"ShareGPT, max_tokens {a.max_output_len}, request rate inf, max(--num-prompts {a.num_prompts}, "
             f"2 x concurrency) requests per run, {a.repeats} repeat(s), server order reversed every other pass; "
             f"client {info['client']}; max_model_len {a.max_model_len}, max_num_seqs {a.max_num_seqs}, "
             f"{a.threads} threads per server; CPU {cpu['cpu']} ({', '.join(cpu['flags'] or [])}); "
             f"vLLM args {' '.join(a.vllm_arg) or 'none'}")
    (out / "compare.md").write_text(
        f"Setup: {setup}\n\nVersions: {info['versions']}\n\n{table}\n" + "\n".join(errors)
        + "\n\nCommands:\n\n" + "".join(f"- {n}: `{' '.join(c)}`\n" for n, c in commands.items())
        + f"- client (last run): `{' '.join(info.get('client_command_example', []))}`\n")
    (out / "compare.json").write_text(json.dumps(
        {"mode": "concurrency", "concurrency": levels, "repeats": a.repeats, "servers": names,
         "max_output_len": a.max_output_len, "dtype": a.dtype or DENSE_DTYPE, "vllm_args": a.vllm_arg,
         "eager": "--enforce-eager" in a.vllm_arg,
         "seed": a.seed, "setup": setup, "metadata": dict(m.split("=", 1) for m in a.metadata), **info,
         "commands": commands, "summary": {str(k): v for k, v in summary.items()}, "runs": runs}, indent=1))
