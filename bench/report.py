"""Presentation of a serving-benchmark run: the rich results table and the vLLM-format
result JSON (`vllm bench serve --save-result`)."""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvpilot.loadgen.metrics import METRIC_TITLES, BenchmarkMetrics, RequestResult, percentile_key

# Per-request lists that vLLM drops from the saved file unless --save-detailed.
DETAILED_KEYS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")


def error_counts(results: Sequence[RequestResult]) -> dict[str, int]:
    """Failed requests counted by error kind, most frequent first."""
    return dict(Counter(r.error_kind for r in results if not r.success).most_common())


def render_table(
    metrics: BenchmarkMetrics,
    duration_s: float,
    *,
    selected_metrics: Sequence[str],
    request_rate: float,
    max_concurrency: int | None,
    goodput: bool,
    errors: dict[str, int],
) -> Table:
    """The end-of-run table: the rows and units of vLLM's "Serving Benchmark Result"."""
    table = Table(title="Serving Benchmark Result", show_header=False, title_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    # A row whose value is None is not shown (no concurrency cap, infinite rate, no SLOs).
    rows: list[tuple[str, str | None]] = [
        ("Successful requests", f"{metrics.completed}"),
        ("Failed requests", f"{metrics.failed}"),
        *((f"  failed: {kind}", f"{n}") for kind, n in errors.items()),
        ("Maximum request concurrency", None if max_concurrency is None else f"{max_concurrency}"),
        ("Request rate configured (RPS)", None if math.isinf(request_rate) else f"{request_rate:.2f}"),
        ("Benchmark duration (s)", f"{duration_s:.2f}"),
        ("Total input tokens", f"{metrics.total_input}"),
        ("Total generated tokens", f"{metrics.total_output}"),
        ("Request throughput (req/s)", f"{metrics.request_throughput:.2f}"),
        ("Request goodput (req/s)", f"{metrics.request_goodput:.2f}" if goodput else None),
        ("Output token throughput (tok/s)", f"{metrics.output_throughput:.2f}"),
        ("Peak output token throughput (tok/s)", f"{metrics.max_output_tokens_per_s:.2f}"),
        ("Peak concurrent requests", f"{metrics.max_concurrent_requests}"),
        ("Total token throughput (tok/s)", f"{metrics.total_token_throughput:.2f}"),
    ]
    for label, value in rows:
        if value is not None:
            table.add_row(label, value)
    for name in selected_metrics:
        short, title = METRIC_TITLES[name]
        s = metrics.stats[name]
        table.add_section()
        table.add_row(f"[bold]{title}[/bold]", "")
        table.add_row(f"Mean {short} (ms)", f"{s.mean:.2f}")
        table.add_row(f"Median {short} (ms)", f"{s.median:.2f}")
        for p, value in s.percentiles.items():
            table.add_row(f"{percentile_key(p).upper()} {short} (ms)", f"{value:.2f}")
    return table


def print_table(table: Table, console: Console | None = None) -> None:
    """Prints `table` on `console` (default: a new rich Console on stdout)."""
    (console or Console()).print(table)


def result_file_json(
    run: dict[str, Any],
    *,
    backend: str,
    label: str | None,
    model_id: str,
    tokenizer_id: str | None,
    num_prompts: int,
    request_rate: float,
    burstiness: float,
    max_concurrency: int | None,
    metadata: dict[str, str] | None = None,
    detailed: bool = False,
    date: str | None = None,
) -> dict[str, Any]:
    """The whole result file: vLLM's setup keys (date, endpoint_type, backend, label,
    model_id, tokenizer_id, num_prompts, metadata, request_rate, burstiness,
    max_concurrency) followed by the run's keys; per-request lists only if `detailed`."""
    out: dict[str, Any] = {
        "date": date or datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": backend,
        "backend": backend,
        "label": label,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "num_prompts": num_prompts,
        **(metadata or {}),
        "request_rate": request_rate if not math.isinf(request_rate) else "inf",
        "burstiness": burstiness if not math.isinf(burstiness) else "inf",
        "max_concurrency": max_concurrency,
        **run,
    }
    if not detailed:
        for key in DETAILED_KEYS:
            out.pop(key, None)
    return out


def result_path(
    *, label: str, request_rate: float, max_concurrency: int | None, model_id: str, date: str,
    result_dir: str | None = None, result_filename: str | None = None,
) -> Path:
    """vLLM's default name `{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json`."""
    concurrency = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    name = result_filename or f"{label}-{request_rate}qps{concurrency}-{model_id.split('/')[-1]}-{date}.json"
    if result_dir:
        os.makedirs(result_dir, exist_ok=True)
        return Path(result_dir) / name
    return Path(name)


def write_result(path: str | Path, data: dict[str, Any]) -> Path:
    """Writes an offline benchmark's result `data` as indented JSON to `path` (its folder made)
    and prints "wrote PATH"; returns the path. Raises OSError when it cannot be written."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2))
    print(f"wrote {out}")
    return out


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Writes `data` as compact JSON (UTF-8) to `path`, as vLLM's --save-result does. Raises
    OSError when the file cannot be written."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)
