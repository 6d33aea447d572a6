"""A benchmark's server subprocess: start a command on a free port, poll `GET /health`
until 200, stop with SIGTERM (the server drains) and SIGKILL after a grace period. The process
helpers (the free port, the spawn into a log, the health poll, the stop) are the load library's
(kvpilot.loadgen.process), which the tuner's EngineProcess starts `kvpilot serve` with too.

A server that exits before it is healthy is a `ServerRefused` carrying its exit code and
the last lines of its output, e.g. `kvpilot serve` exiting 2 with "max_num_batched_tokens
(128) is smaller than max_model_len (256) with chunked prefill off ...".
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from kvpilot.loadgen.process import free_port, spawn_logged, stop_process, wait_healthy


class ServerRefused(RuntimeError):
    """The server exited (or never got healthy) before serving. `exit_code` is None for a
    startup timeout; `message` is the most telling line of its log (an `error:` line when
    there is one), `log_tail` the end of the log."""

    def __init__(self, exit_code: int | None, message: str, log_tail: str) -> None:
        super().__init__(f"server exited with {exit_code}: {message}" if exit_code is not None else message)
        self.exit_code, self.message, self.log_tail = exit_code, message, log_tail


def refusal_message(log: str) -> str:
    """The line that says why a server refused to start: the last line containing
    "error" (case-insensitive), else the last non-empty line, else ""."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or [""])[-1]


class ServerProcess:
    """`command` (a list, without --port) started with `--port P` appended, its stdout and
    stderr in `log_path`, in the environment `env` (default: this process's) and the folder `cwd`
    (default: this process's). Use as a context manager: entering waits for health (raising
    ServerRefused), leaving stops it. port=0 takes a free one; the timeouts are in seconds."""

    def __init__(self, command: list[str], log_path: Path, *, port: int = 0, host: str = "127.0.0.1",
                 startup_timeout_s: float = 300.0, stop_timeout_s: float = 30.0, health_path: str = "/health",
                 env: Mapping[str, str] | None = None, on_spawn: Callable[[int], None] | None = None,
                 cwd: Path | None = None) -> None:
        self.command = list(command)
        self.cwd = cwd  # vLLM runs outside the repository, whose operator/ shadows the standard library's
        self.env = dict(os.environ if env is None else env)
        self.on_spawn = on_spawn  # called with the pid right after the spawn (e.g. a cgroup's add)
        self.log_path = Path(log_path)
        self.host, self.port = host, port or free_port()
        self.startup_timeout_s, self.stop_timeout_s = startup_timeout_s, stop_timeout_s
        self.health_path = health_path  # llama-cpp-python's server has no /health: /v1/models there
        self.proc: subprocess.Popen | None = None
        self.startup_s = 0.0  # seconds from spawn to the first healthy answer

    @property
    def base_url(self) -> str:
        """http://HOST:PORT of the server (no trailing slash)."""
        return f"http://{self.host}:{self.port}"

    def log(self) -> str:
        """The server's output so far (the whole log file), or "" when it cannot be read."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def start(self) -> ServerProcess:
        """Spawn and wait for 200 on health_path. Raises ServerRefused when the process exits
        first or is not healthy within startup_timeout_s (it is then stopped)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        self.proc = spawn_logged([*self.command, "--port", str(self.port)], self.log_path, env=self.env, cwd=self.cwd)
        if self.on_spawn is not None:
            self.on_spawn(self.proc.pid)
        try:
            exited = wait_healthy(self.base_url + self.health_path, [self.proc],
                                  self.startup_timeout_s - (time.monotonic() - t0))
        except TimeoutError:
            self.stop()
            log = self.log()
            raise ServerRefused(None, f"not healthy after {self.startup_timeout_s:.0f} s", log[-3000:]) from None
        if exited is not None:
            self.proc = None
            log = self.log()
            raise ServerRefused(exited[1], refusal_message(log), log[-3000:])
        self.startup_s = time.monotonic() - t0
        return self

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after stop_timeout_s; returns the exit code."""
        if self.proc is None:
            return None
        proc, self.proc = self.proc, None
        return stop_process(proc, self.stop_timeout_s)

    def __enter__(self) -> ServerProcess:
        """start(): the server, healthy (or ServerRefused)."""
        return self.start()

    def __exit__(self, *exc: object) -> None:
        """stop(), whatever ended the block."""
        self.stop()
