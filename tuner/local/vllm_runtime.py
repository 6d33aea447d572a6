"""Upstream vLLM as the engine of local trials (`kvpilot tune --local --runtime vllm`).

- Where it is (`vllm_serve_command`): --vllm-python PATH (a Python whose environment has vLLM,
  its `vllm` script beside it), else the repository's .venv-vllm (scripts/install-vllm.sh, `make
  vllm`, the version pinned in kvpilot.api.vllm), else `vllm` on PATH. A Python is started as
  `PYTHON -P -m vllm.entrypoints.cli.main serve`, and every vLLM process in the report folder:
  a Python other than the project venv's started in the repository root imports its
  `operator/` folder instead of the standard library's `operator`.
- What it serves (`vllm_engine`): a Hugging Face directory (a builtin model is its safetensors
  conversion, `feasibility.model_directory`) under `--served-model-name`, the name the tuner's
  requests and metric labels use.
- Its environment (`vllm_environment`): VLLM_CPU_NUM_OF_RESERVED_CPU=0 (vLLM's CPU backend keeps
  one CPU out of the engine by default: half of a 2-core machine) and
  VLLM_CPU_OMP_THREADS_BIND=nobind (no pinning of OpenMP threads to cores that other processes
  share), VLLM_LOG_STATS_INTERVAL=1 (its stats line, "... Running: N reqs, Waiting: N reqs, CPU
  KV cache usage: P%", each second instead of each 10 s, while busy: a trial's window lasts
  seconds, and a preemption shows there only as a full cache with requests sent back to
  waiting: vLLM 0.32 logs no line per preemption, and the line's "Preemptions: N" never prints,
  its count reset before it is read, vllm-project/vllm#38452); values already set win. VLLM_CPU_KVCACHE_SPACE is removed: vLLM lets it override
  --kv-cache-memory-bytes, the KV cache the trials set.
- Its block size on CPU: 32 (`VLLM_CPU_BLOCK_SIZE`). vLLM 0.32's CPU attention takes multiples
  of 32 only (16, kvpilot's default, stops the engine: "No common block size for 16 (CPU_ATTN:
  [MultipleOf(32)])"), and its own default of 128 is coarse for the small caches of the story.
- Every trial is a restart: vLLM has no live scheduler changes (kvpilot's
  /admin/scheduler_config), so `kvpilot tune` turns live changes off for it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

from kvpilot.api.vllm import VLLM_CPU_BLOCK_SIZE_MULTIPLE, VLLM_CPU_UNPINNED_ENVIRONMENT, VLLM_MODULE, VLLM_VENV
from kvpilot.engine.settings import flag_words
from kvpilot.tuner.local.engine_process import EngineProcess
from kvpilot.engine.settings.env import VLLM_CPU_KVCACHE_SPACE, VLLM_LOG_STATS_INTERVAL
from kvpilot.loadgen.process import REPO_ROOT, venv_vllm_python

VLLM_CPU_BLOCK_SIZE = VLLM_CPU_BLOCK_SIZE_MULTIPLE  # the smallest vLLM's CPU attention takes (kvpilot.api.vllm)
VLLM_HELP = "--help=all"  # `vllm serve --help` lists its config groups only
DEFAULT_ENVIRONMENT = {**VLLM_CPU_UNPINNED_ENVIRONMENT, VLLM_LOG_STATS_INTERVAL: "1"}
OVERRIDES_KV_CACHE = VLLM_CPU_KVCACHE_SPACE


class VLLMNotFound(ValueError):
    """No vLLM to start: the message says what to change."""


def _python_command(python: Path) -> list[str]:
    return [str(python), "-P", "-m", VLLM_MODULE, "serve"]


def vllm_serve_command(vllm_python: str | None = None, root: Path = REPO_ROOT,
                       which: Callable[[str], str | None] = shutil.which) -> list[str]:
    """The `vllm serve` command (without the model): --vllm-python's Python when given (it must
    exist and have the `vllm` script beside it), else root/.venv-vllm/bin/python when present,
    else `vllm` on PATH. Raises VLLMNotFound saying what to change."""
    if vllm_python:
        python = Path(vllm_python)
        if not python.is_file() or not os.access(python, os.X_OK):
            raise VLLMNotFound(f"--vllm-python {vllm_python}: no such executable; give the Python of an "
                               f"environment with vLLM (e.g. {root / VLLM_VENV / 'bin' / 'python'})")
        if not (python.parent / "vllm").exists():
            raise VLLMNotFound(f"--vllm-python {vllm_python}: no `vllm` beside it, so vLLM is not installed in its "
                               f"environment; install it there (scripts/install-vllm.sh VENV) or give another Python")
        return _python_command(python)
    venv = venv_vllm_python(root)
    if venv is not None:
        return _python_command(venv)
    found = which("vllm")
    if found:
        return [found, "serve"]
    raise VLLMNotFound(f"--runtime vllm: no vLLM found (no {root / VLLM_VENV}, no `vllm` on PATH); run `make vllm` "
                       f"(the pinned vLLM into {VLLM_VENV}), give --vllm-python PATH, or put `vllm` on PATH")


def vllm_environment(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with DEFAULT_ENVIRONMENT's values where
    unset (see the module doc), and without VLLM_CPU_KVCACHE_SPACE."""
    env = {**DEFAULT_ENVIRONMENT, **(os.environ if base is None else base)}
    env.pop(OVERRIDES_KV_CACHE, None)
    return env


def served_name(model: str) -> str:
    """The name requests and metric labels use: a builtin model's name, else the argument."""
    return model.removeprefix("builtin://")


def vllm_engine(model: str, log_path: Path, serve_command: list[str], extra_args: list[str] | None = None,
                api_key: str | None = None, port: int = 0) -> EngineProcess:
    """An EngineProcess that runs `serve_command` (`vllm_serve_command`) on `model`'s directory,
    in log_path's folder, with the module doc's environment and flags spelled for vLLM.
    Raises ValueError for a model that is neither builtin nor a directory."""
    from kvpilot.tuner.search.feasibility import model_directory

    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    return EngineProcess(str(model_directory(model)), log_path,
                         [*flag_words("served_model_name", served_name(model)), *(extra_args or [])], api_key,
                         serve_command=serve_command, port=port, runtime="vllm", env=vllm_environment(),
                         cwd=log_path.parent)
