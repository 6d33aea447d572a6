"""The server processes a benchmark or a local tuning trial runs: what `kvpilot bench`'s
ServerProcess (kvpilot.bench.harness.server_process) and `kvpilot tune --local`'s EngineProcess
(kvpilot.tuner.local.engine_process) share, in one place because the two import nothing of each
other (.importlinter).

- KVPILOT_SERVE: `kvpilot serve` in this Python (the model and the flags follow it).
- free_port / cpu_seconds: a free TCP port to serve on; a process's CPU seconds (/proc/PID/stat).
- spawn_logged / wait_healthy / stop_process: start a server with its output in a log file, poll
  its health route until 200 or until it exits, stop it with SIGTERM then SIGKILL.
- venv_vllm_python / has_vllm: where upstream vLLM's Python is (the repository's .venv-vllm,
  `make vllm`) and whether a Python has vLLM installed beside it.

Standard library and httpx only (torch-free at import, like the rest of kvpilot.loadgen).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from kvpilot.api.vllm import VLLM_VENV

KVPILOT_SERVE = [sys.executable, "-m", "kvpilot.cli.main", "serve"]
REPO_ROOT = Path(__file__).resolve().parents[1]  # an editable install: the checkout


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on now: the kernel's pick for a bind to port 0,
    released before returning (another process may take it before the caller binds it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process `pid` (all its threads) has used: fields 14 and 15
    (utime, stime, in clock ticks) of /proc/PID/stat over SC_CLK_TCK (proc(5)). Linux only;
    raises FileNotFoundError when no such process exists."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spawn_logged(command: Sequence[str], log_path: Path, *, env: Mapping[str, str] | None = None,
                 cwd: str | Path | None = None, append: bool = False) -> subprocess.Popen:
    """Starts `command` in a session of its own (so a SIGKILL to the session reaches the server's
    children too) with stdout and stderr into `log_path`, in `env` (default: this process's) plus
    PYTHONUNBUFFERED=1 (its log is current when read after an exit) and the folder `cwd`.
    append=False truncates the log; append=True keeps it and writes "=== COMMAND" before the
    new output (one log over several starts). Raises OSError when the command cannot start."""
    with Path(log_path).open("ab" if append else "wb") as log:
        if append:
            log.write(f"\n=== {' '.join(command)}\n".encode())
            log.flush()
        return subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}, cwd=cwd)


def wait_healthy(url: str, procs: Sequence[subprocess.Popen], timeout_s: float,
                 interval_s: float = 0.25) -> tuple[int, int] | None:
    """Polls `GET url` (2 s per try) every `interval_s` seconds until it answers 200, for at most
    `timeout_s` seconds. Returns None once it does, or (index in `procs`, exit code) of the first
    process that exited before; raises TimeoutError when neither happened in time (the processes
    are left running: the caller stops them)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for index, proc in enumerate(procs):
            code = proc.poll()
            if code is not None:
                return index, code
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s")


def stop_process(proc: subprocess.Popen, timeout_s: float, *, kill_session: bool = False) -> int:
    """SIGTERM (a server drains its requests and exits), then after `timeout_s` seconds SIGKILL
    to the process, or with kill_session to its whole session (the children spawn_logged's
    session holds, e.g. vLLM's engine core and workers). Returns the exit code (negative: the
    signal that ended it)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            if kill_session:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
            proc.wait()
    return proc.returncode


def has_vllm(python: str | Path | None) -> bool:
    """Whether `python` is an executable file with the `vllm` script beside it, i.e. a Python
    whose environment has upstream vLLM installed (scripts/install-vllm.sh, `make vllm`)."""
    if not python:
        return False
    path = Path(python)
    return path.is_file() and os.access(path, os.X_OK) and (path.parent / "vllm").exists()


def venv_vllm_python(root: Path = REPO_ROOT) -> Path | None:
    """root/.venv-vllm/bin/python (kvpilot.api.vllm's VLLM_VENV, made by `make vllm`) when it
    exists, else None."""
    python = root / VLLM_VENV / "bin" / "python"
    return python if python.is_file() else None
