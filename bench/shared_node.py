"""`kvpilot bench shared-node`: how a server holds up when its pod is not alone on the node.

Each peer's server runs in a cpu cgroup of its own (bench/harness/cgroups.py; root needed) and is
measured, in one run, in three arrangements:
- `alone`: nothing else runs (besides this client);
- `neighbours`: K busy processes (`while True: pass`) in a second cgroup of the same weight, as
  two pods with equal CPU requests on one node (`--neighbours K`, default 1);
- `quota`: alone, but its cgroup limited to `--quota-cpus` CPUs per 100 ms period (a CPU
  limit below the thread count it started with; default 1).
In each: one stream (`--stream-requests` requests one after another, `--stream-output-len`
tokens each, ignore_eos): ITL median / p95 / max and TTFT; then a burst: `--num-prompts`
ShareGPT requests sent at once (offline-style: output tokens/s). Each part has a wall-time
budget (`--stream-budget-s`, `--burst-budget-s`): a server that collapses (seconds per token)
is cut there and measured on the tokens that arrived. The table gives each figure
against the same server alone in the same run, and the goals of issue 38 (beside one
neighbour: median ITL <= 2.5x alone, p95 <= 3x, burst throughput >= 0.4x; under the quota:
median ITL <= 2.5x), which a fair share (half the CPUs) would meet at 2x.

Peers (`--peers`): `kvpilot` runs `kvpilot serve` on the builtin model with its defaults (the
command the engine image runs; extra flags go to it unchanged), threads sized by the engine
itself; `llama-cpp-python` (and `llama-server`) as `kvpilot bench compare` runs them, with
`--threads` threads (default: all CPUs) and the environment without kvpilot's OpenMP wait
setting. Results: the table, and `--output-json` with the CPU, the load averages, every figure,
the quota's throttled periods and the engine's thread lines from its log.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvpilot.bench.compare_peers import PEERS, environment, has_llama_cpp, peer_command, smollm2_gguf
from kvpilot.bench.harness.cgroups import CgroupUnavailable, CpuGroup, busy_loops, stop_all
from kvpilot.bench.harness.server_process import ServerProcess, ServerRefused
from kvpilot.bench.shared_node_report import ARRANGEMENTS, ratios, render
from kvpilot.bench.sweep import fit_requests
from kvpilot.engine.cpu import omp_wait
from kvpilot.engine.settings import BY_NAME
from kvpilot.loadgen.benchmark import run_benchmark
from kvpilot.loadgen.datasets import SampleRequest, sample_sharegpt_requests
from kvpilot.loadgen.machine import loadavg, machine_info
from kvpilot.loadgen.metrics import RequestResult
from kvpilot.loadgen.request_client import RequestInput, send_request
from kvpilot.loadgen.tokenizers import load_tokenizer


def build_parser() -> argparse.ArgumentParser:
    """`kvpilot bench shared-node`'s flags: peers and arrangements, neighbours and the quota
    (CPUs), the stream and the burst (requests, tokens, budgets in s), threads, timeouts; flags it
    does not know go to `kvpilot serve` (main's parse_known_args)."""
    p = argparse.ArgumentParser(prog="kvpilot bench shared-node", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", default="kvpilot,llama-cpp-python", help=f"comma-separated, from {','.join(PEERS)}")
    p.add_argument("--arrangements", default=",".join(ARRANGEMENTS), help="comma-separated, alone first")
    p.add_argument("--neighbours", type=int, default=1, help="busy processes beside the server")
    p.add_argument("--quota-cpus", type=float, default=1.0, help="the CPU limit of the quota arrangement")
    p.add_argument("--stream-requests", type=int, default=5)
    p.add_argument("--stream-output-len", type=int, default=64, help="tokens per stream request")
    p.add_argument("--num-prompts", type=int, default=32, help="ShareGPT requests of the burst")
    p.add_argument("--max-output-len", type=int, default=128, help="cap on a burst request's output tokens")
    p.add_argument(BY_NAME["max_model_len"].flag, type=int, default=1024, help="tokens; llama.cpp's --n_ctx")
    p.add_argument(BY_NAME["max_num_seqs"].flag, type=int, default=32, help="ours; llama-server's --parallel")
    p.add_argument("--model-name", default="smollm2-135m-instruct")
    p.add_argument("--llama-cpp-python", default=sys.executable, metavar="PYTHON",
                   help="interpreter with llama-cpp-python[server] installed")
    p.add_argument("--llama-server", metavar="BIN", help="llama.cpp's C++ llama-server binary")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's --threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="shared-node-logs", help="the servers' logs")
    p.add_argument("--output-json", default="shared-node.json")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--stream-budget-s", type=float, default=60.0,
                   help="wall time of the stream per arrangement; a request still running then is cut, its "
                        "tokens so far counted (a server that collapses would take hours otherwise)")
    p.add_argument("--burst-budget-s", type=float, default=120.0, help="likewise for the burst")
    return p


def _check(p: argparse.ArgumentParser, a: argparse.Namespace) -> tuple[list[str], list[str]]:
    names = [n.strip() for n in a.peers.split(",") if n.strip()]
    if not names or (bad := [n for n in names if n not in PEERS]):
        p.error(f"--peers takes names from {','.join(PEERS)}, got {a.peers!r}")
    arrangements = [x.strip() for x in a.arrangements.split(",") if x.strip()]
    if not arrangements or arrangements[0] != "alone" or (bad := [x for x in arrangements if x not in ARRANGEMENTS]):
        p.error(f"--arrangements takes {','.join(ARRANGEMENTS)}, alone first (the baseline), got {a.arrangements!r}")
    if a.neighbours < 1 or a.quota_cpus <= 0 or a.stream_requests < 1 or a.stream_output_len < 2 \
            or a.num_prompts < 1 or a.threads < 1:
        p.error("--neighbours, --stream-requests, --num-prompts, --threads must be >= 1, --stream-output-len >= 2 "
                "and --quota-cpus > 0")
    if "llama-cpp-python" in names and not has_llama_cpp(a.llama_cpp_python):
        p.error(f"llama_cpp is not importable by {a.llama_cpp_python}: pass --llama-cpp-python PYTHON "
                "(see `kvpilot bench compare --help` for how to build it) or leave it out of --peers")
    if "llama-server" in names and not (a.llama_server and os.access(a.llama_server, os.X_OK)):
        p.error("the llama-server peer needs --llama-server BIN")
    return names, arrangements


def _stream_stats(results: list[RequestResult]) -> dict[str, float]:
    itl = np.array([x for r in results for x in r.itl]) * 1e3
    ttft = np.array([r.ttft for r in results if r.ttft > 0]) * 1e3
    out: dict[str, float] = {"failed": sum(1 for r in results if not r.success and r.error_kind != "timeout"),
                             "cut_by_budget": sum(1 for r in results if r.error_kind == "timeout"),
                             "tokens": int(len(itl) + len(ttft))}
    if len(itl):
        out.update(median_itl_ms=float(np.median(itl)), p95_itl_ms=float(np.percentile(itl, 95)),
                   max_itl_ms=float(itl.max()))
    if len(ttft):
        out["median_ttft_ms"] = float(np.median(ttft))
    return out


async def _measure(url: str, model: str, stream: list[SampleRequest], burst: list[SampleRequest],
                   a: argparse.Namespace) -> dict[str, Any]:
    def request(r: SampleRequest, ignore_eos: bool) -> RequestInput:
        return RequestInput(r.prompt, r.prompt_len, r.expected_output_len, model, url, ignore_eos=ignore_eos)

    limits = httpx.Limits(max_connections=len(burst) + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=60.0), limits=limits) as client:
        results: list[RequestResult] = []
        deadline = time.monotonic() + a.stream_budget_s
        for r in stream:  # one at a time, until done or out of budget (the last one then cut)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            results.append(await send_request(client, request(r, True), timeout_s=left, keep_partial=True))
        out = _stream_stats(results)
        start = time.perf_counter()
        results = await asyncio.gather(*(send_request(client, request(r, False), timeout_s=a.burst_budget_s,
                                                      keep_partial=True) for r in burst))
        elapsed = time.perf_counter() - start
    tokens = sum(len(r.itl) + (r.ttft > 0) for r in results)
    out.update(burst_output_throughput=tokens / elapsed, burst_tokens=tokens, burst_duration_s=elapsed,
               burst_completed=sum(r.success for r in results),
               burst_failed=sum(1 for r in results if not r.success and r.error_kind != "timeout"))
    return out


def measure(base_url: str, model: str, stream: list[SampleRequest], burst: list[SampleRequest],
            a: argparse.Namespace) -> dict[str, Any]:
    """One stream (requests one at a time, ignore_eos, within --stream-budget-s), then the burst
    (all at once, within --burst-budget-s): output tokens/s counted as streamed token events, so
    that a burst cut by its budget still counts what arrived."""
    return asyncio.run(_measure(f"{base_url}/v1/completions", model, stream, burst, a))


@contextlib.contextmanager
def arranged(name: str, engine: CpuGroup, neighbours: CpuGroup, a: argparse.Namespace) -> Iterator[None]:
    """The arrangement `name` around the server in `engine` for the with-block."""
    procs = []
    try:
        if name == "neighbours":
            procs = busy_loops(a.neighbours, neighbours)
            time.sleep(1.0)  # the scheduler's load tracking settles
        elif name == "quota":
            engine.set_quota(a.quota_cpus)
        yield
    finally:
        stop_all(procs)
        engine.set_quota(None)


def run_peer(name: str, command: list[str], health: str, env: dict[str, str], arrangements: list[str],
             loads: tuple[list[SampleRequest], list[SampleRequest]], a: argparse.Namespace) -> dict[str, Any] | str:
    """One server through every arrangement; {arrangement: figures} or why it did not start."""
    with CpuGroup(f"kvpilot-bench-{os.getpid()}-server") as engine, \
            CpuGroup(f"kvpilot-bench-{os.getpid()}-neighbours") as neighbours:
        server = ServerProcess(command, Path(a.log_dir) / f"{name}.log", health_path=health, env=env,
                               startup_timeout_s=a.startup_timeout, on_spawn=engine.add)
        try:
            server.start()
        except ServerRefused as exc:
            return str(exc)
        figures: dict[str, Any] = {}
        try:
            warm = [SampleRequest(loads[0][0].prompt, loads[0][0].prompt_len, 8)]
            asyncio.run(run_benchmark(warm, api_url=f"{server.base_url}/v1/completions", model=a.model_name,
                                      timeout_s=a.burst_budget_s, progress=False))
            for arrangement in arrangements:
                print(f"{name}: {arrangement}", file=sys.stderr, flush=True)
                before, load = engine.stat(), loadavg()
                with arranged(arrangement, engine, neighbours, a):
                    figures[arrangement] = measure(server.base_url, a.model_name, *loads, a)
                after = engine.stat()
                figures[arrangement].update(
                    loadavg_before=load, loadavg_after=loadavg(),
                    throttled_periods=after.get("nr_throttled", 0) - before.get("nr_throttled", 0))
        finally:
            server.stop()
        figures["thread_lines"] = [line.split("] ", 1)[-1] for line in server.log().splitlines()
                                   if "CPU threads:" in line]
        return figures


def main(argv: list[str]) -> int:
    """Exit 2 on bad flags or where cgroups cannot be made (not root), 1 when a server does not
    start, else 0 (the goals are reported, not enforced)."""
    parser = build_parser()
    a, serve_args = parser.parse_known_args(argv)
    names, arrangements = _check(parser, a)
    tokenizer = load_tokenizer(a.model_name)
    pool = sample_sharegpt_requests(tokenizer, 4 * a.num_prompts + 32, seed=a.seed)
    burst = fit_requests(pool, a.max_model_len, a.max_output_len, a.num_prompts)
    stream = [SampleRequest(r.prompt, r.prompt_len, a.stream_output_len)
              for r in fit_requests(pool, a.max_model_len - a.stream_output_len, None, a.stream_requests)]
    gguf = smollm2_gguf()
    env = environment(a, names)
    report: dict[str, Any] = {"environment": env, "arrangements": arrangements, "neighbours": a.neighbours,
                              "quota_cpus": a.quota_cpus, "stream_requests": a.stream_requests,
                              "stream_output_len": a.stream_output_len, "num_prompts": a.num_prompts,
                              "max_output_len": a.max_output_len, "peers": {}, "commands": {}}
    t0 = time.monotonic()
    try:
        for name in names:
            command, health = peer_command(name, gguf, a, serve_args)
            if name == "kvpilot":  # what the image runs: the builtin model and the engine's own thread sizing
                command[command.index(str(gguf))] = a.model_name
            peer_env = os.environ.copy() if name == "kvpilot" else omp_wait.without_default()
            report["commands"][name] = command
            report["peers"][name] = run_peer(name, command, health, peer_env, arrangements, (stream, burst), a)
    except CgroupUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    env.update(machine=machine_info(loadavg_before=env["machine"]["loadavg"]), wall_s=round(time.monotonic() - t0))
    for name, figures in report["peers"].items():
        if isinstance(figures, dict):
            figures["vs_alone"] = ratios(figures, arrangements)
    Path(a.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output_json).write_text(json.dumps(report, indent=2) + "\n")
    render(report)
    return 1 if any(isinstance(f, str) for f in report["peers"].values()) else 0
