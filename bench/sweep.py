"""`kvpilot bench sweep`: the chunked-prefill study on our engine, one command.

For each configuration of the grid (`--max-num-batched-tokens` x `--enable-chunked-prefill`
on/off; default budgets 64, 128, ..., 8192, both settings) it starts `kvpilot serve` on a
free port, waits for /health, sends the same ShareGPT requests with `kvpilot bench serve`'s
client (`run_benchmark`, `calculate_metrics`: vLLM benchmark_serving definitions), stops
the server with SIGTERM, and records the run. A configuration the server refuses at
startup (exit 2, e.g. chunked prefill off with max_num_batched_tokens < max_model_len) is
recorded with the server's message. The report folder gets every run's JSON, PNG plots
and summary.md, which checks the conclusions of the published study listed in DESIGN.md
(see `kvpilot.bench.sweep_report`).

Defaults are sized to finish in about 15 minutes on this 2-core CPU when it is otherwise
idle: 8 prompts, max_model_len 512 (so chunked off refuses budgets 64-256), at most 64
output tokens per request, max_num_seqs 16, all requests at once. Each server start costs
10-25 s (model load) and each run 10-30 s of load; of the 16 configurations, chunked off
with budgets 64-256 is refused at startup (a few seconds each) and 13 run.
Flags not listed below go to `kvpilot serve` unchanged (e.g. --num-gpu-blocks-override 64
--dtype bfloat16).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from kvpilot.bench import report
from kvpilot.bench.harness.server_process import ServerProcess, ServerRefused
from kvpilot.bench.sweep_report import write_report
from kvpilot.engine.settings import BY_NAME, to_flags
from kvpilot.loadgen.benchmark import run_benchmark
from kvpilot.loadgen.datasets import SampleRequest, encode_plain, sample_sharegpt_requests
from kvpilot.loadgen.metrics import calculate_metrics, result_dict
from kvpilot.loadgen.process import KVPILOT_SERVE
from kvpilot.loadgen.tokenizers import load_tokenizer

# Per-request lists are kept out of the run JSON: the report folder stays small.
DROPPED_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "queue_times",
                "generated_texts", "errors")


def parse_int_list(text: str) -> list[int]:
    """"64,128,256" -> [64, 128, 256]; also "64-8192" = the powers of two from 64 to 8192.
    Raises ValueError on non-positive or malformed entries."""
    values: list[int] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if "-" in part:
            lo, hi = (int(x) for x in part.split("-", 1))
            if lo < 1 or hi < lo or lo & (lo - 1):
                raise ValueError(f"range {part!r}: write LOW-HIGH with LOW a power of two, LOW <= HIGH")
            values += [2**k for k in range(lo.bit_length() - 1, hi.bit_length()) if lo <= 2**k <= hi]
        else:
            values.append(int(part))
    if not values or any(v < 1 for v in values):
        raise ValueError(f"need positive integers, got {text!r}")
    return sorted(set(values))


def parse_chunked(text: str) -> list[bool]:
    """"on,off" -> [True, False]. Raises ValueError on anything but on/off/true/false."""
    names = {"on": True, "true": True, "off": False, "false": False}
    try:
        values = [names[p.strip().lower()] for p in text.split(",") if p.strip()]
    except KeyError as exc:
        raise ValueError(f"chunked settings are on/off, got {exc.args[0]!r}") from None
    if not values:
        raise ValueError("no chunked setting given")
    return list(dict.fromkeys(values))


def grid(budgets: list[int], chunked: list[bool]) -> list[tuple[int, bool]]:
    """The configurations in run order: chunked setting outer, budgets ascending."""
    return [(b, c) for c in chunked for b in sorted(budgets)]


def fit_requests(requests: list[SampleRequest], max_model_len: int, max_output_len: int | None,
                 num_prompts: int) -> list[SampleRequest]:
    """The first `num_prompts` requests whose prompt + output fits max_model_len tokens,
    after capping outputs at max_output_len. Raises ValueError when too few fit."""
    out = []
    for r in requests:
        n = min(r.expected_output_len, max_output_len) if max_output_len else r.expected_output_len
        if r.prompt_len + n <= max_model_len:
            out.append(SampleRequest(r.prompt, r.prompt_len, n))
        if len(out) == num_prompts:
            return out
    raise ValueError(f"only {len(out)} ShareGPT requests fit max_model_len {max_model_len}; raise it")


def build_parser() -> argparse.ArgumentParser:
    """`kvpilot bench sweep`'s flags: the model, the budgets and chunked settings of the grid,
    requests and their rate (req/s), the model length (tokens), timeouts (s) and the report
    folder; flags it does not know go to `kvpilot serve` (main's parse_known_args)."""
    p = argparse.ArgumentParser(prog="kvpilot bench sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="what `kvpilot serve` loads")
    p.add_argument(BY_NAME["max_num_batched_tokens"].flag, default="64-8192",
                   help="budgets: a list (64,256) or a power-of-two range (64-8192, the default)")
    p.add_argument("--chunked-prefill", default="on,off", help="settings to run: on,off (default both)")
    p.add_argument("--num-prompts", type=int, default=8, help="ShareGPT requests per run (default 8)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s; inf (default) = all at once")
    p.add_argument(BY_NAME["max_model_len"].flag, type=int, default=512, help="tokens (default 512)")
    p.add_argument(BY_NAME["max_num_seqs"].flag, type=int, default=16,
                   help="must be <= the smallest budget (default 16)")
    p.add_argument("--max-output-len", type=int, default=64,
                   help="cap on each request's output tokens (ShareGPT reply length otherwise; 0 = no cap)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", help="report folder (default sweep-<date>)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for /health")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def serve_command(model: str, budget: int, chunked: bool, a: argparse.Namespace, serve_args: list[str]) -> list[str]:
    """`kvpilot serve` for one configuration; flags the sweep does not know go to it unchanged."""
    engine = {"max_model_len": a.max_model_len, "max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": budget,
              "enable_chunked_prefill": chunked}
    return [*KVPILOT_SERVE, model, "--host", "127.0.0.1", *to_flags(engine),
            "--disable-log-requests", "--disable-uvicorn-access-log", *serve_args]


def run_one(model: str, budget: int, chunked: bool, requests: list[SampleRequest], a: argparse.Namespace,
            serve_args: list[str], out_dir: Path, tokenizer: Any) -> dict[str, Any]:
    """Start the server with one configuration, run the requests, stop it; the record."""
    record: dict[str, Any] = {"max_num_batched_tokens": budget, "enable_chunked_prefill": chunked}
    tag = f"{budget}-chunked-{'on' if chunked else 'off'}"
    command = serve_command(model, budget, chunked, a, serve_args)
    server = ServerProcess(command, out_dir / "logs" / f"{tag}.log", startup_timeout_s=a.startup_timeout)
    try:
        server.start()
    except ServerRefused as exc:
        return {**record, "status": "refused", "exit_code": exc.exit_code, "message": exc.message}
    try:
        results, duration = asyncio.run(run_benchmark(
            requests, api_url=f"{server.base_url}/v1/completions", model=model, request_rate=a.request_rate,
            seed=a.seed, timeout_s=a.request_timeout, progress=not a.disable_tqdm))
    finally:
        server.stop()
    metrics, output_lens = calculate_metrics(results, duration,
                                             count_tokens=lambda text: len(encode_plain(tokenizer, text)))
    run = result_dict(metrics, results, output_lens, duration)
    for key in DROPPED_KEYS:
        run.pop(key, None)
    errors = [r.error.splitlines()[0] for r in results if not r.success and r.error]
    return {**record, "status": "ok" if metrics.completed else "failed", "startup_s": server.startup_s,
            "message": errors[0] if errors and not metrics.completed else "",
            "error_counts": report.error_counts(results), "request_errors": errors[:5], **run}


def main(argv: list[str]) -> int:
    """Run the sweep; returns 0 when at least one configuration completed requests, 1
    otherwise; bad flags exit 2."""
    parser = build_parser()
    a, serve_args = parser.parse_known_args(argv)
    try:
        budgets = parse_int_list(a.max_num_batched_tokens)
        chunked = parse_chunked(a.chunked_prefill)
    except ValueError as exc:
        parser.error(str(exc))
    if a.num_prompts < 1 or a.max_model_len < 1 or a.max_num_seqs < 1:
        parser.error("--num-prompts, --max-model-len and --max-num-seqs must be >= 1")
    if not a.request_rate > 0:
        parser.error("--request-rate must be > 0 (inf sends all requests at once)")
    out_dir = Path(a.output_dir or f"sweep-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    try:
        tokenizer = load_tokenizer(a.model)
        pool = sample_sharegpt_requests(tokenizer, 8 * a.num_prompts + 32, seed=a.seed)
        requests = fit_requests(pool, a.max_model_len, a.max_output_len or None, a.num_prompts)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    setup = {"model": a.model, "num_prompts": a.num_prompts, "request_rate": a.request_rate,
             "max_model_len": a.max_model_len, "max_num_seqs": a.max_num_seqs, "max_output_len": a.max_output_len,
             "seed": a.seed, "serve_args": " ".join(serve_args) or "-",
             "prompt_tokens": sum(r.prompt_len for r in requests),
             "max_output_tokens": sum(r.expected_output_len for r in requests)}
    records = []
    t0 = time.monotonic()
    for i, (budget, on) in enumerate(grid(budgets, chunked), 1):
        print(f"[{i}/{len(budgets) * len(chunked)}] max_num_batched_tokens={budget} chunked prefill "
              f"{'on' if on else 'off'}", file=sys.stderr, flush=True)
        record = run_one(a.model, budget, on, requests, a, serve_args, out_dir, tokenizer)
        records.append(record)
        print(f"  {record['status']}: " + (record.get("message") or
              f"{record['completed']} ok, {record['failed']} failed, {record['duration']:.1f} s"),
              file=sys.stderr, flush=True)
    setup["wall_s"] = round(time.monotonic() - t0)
    summary = write_report(records, out_dir, setup)
    print(summary.read_text())
    print(f"report written to {out_dir}")
    return 0 if any(r["status"] == "ok" for r in records) else 1
