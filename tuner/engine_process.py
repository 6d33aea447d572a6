"""One local engine server process (`kvpilot serve`, or any server with `vllm serve`'s flags):
start with a trial's flags and wait for health, change scheduler limits live through
`POST /admin/scheduler_config`, stop. A start that fails is classified from kvpilot's
documented exit code, or from the log for other engines (`kvpilot.tuner.failures`)."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvpilot.engine.settings import flag_words
from kvpilot.tuner.failures import REJECTED, TRANSIENT, TrialFailed, classify
from kvpilot.tuner.settings import EngineSettings

KVPILOT_SERVE = [sys.executable, "-m", "kvpilot.cli.main", "serve"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_flags(serve_command: list[str], flags: list[str], timeout_s: float = 120) -> None:
    """Raises ValueError naming every flag in `flags` that `serve_command --help` does not
    list (so a study never starts against an engine that would reject its settings)."""
    out = subprocess.run([*serve_command, "--help"], capture_output=True, text=True, timeout=timeout_s)
    text = out.stdout + out.stderr
    missing = sorted({f for f in flags if f.startswith("--") and f not in text})
    if missing:
        raise ValueError(f"the engine ({' '.join(serve_command)}) does not accept {', '.join(missing)}")


class EngineProcess:
    """model: what `serve` loads; extra_args: flags every trial gets (e.g.
    --num-gpu-blocks-override 256); api_key guards /v1 (a generated admin token guards /admin); port: a fixed port (for
    a Prometheus that scrapes it), else a free one per start."""

    def __init__(self, model: str, log_path: Path, extra_args: list[str] | None = None, api_key: str | None = None,
                 serve_command: list[str] | None = None, startup_timeout_s: float = 300.0, host: str = "127.0.0.1",
                 port: int = 0):
        self.model, self.log_path = model, Path(log_path)
        self.extra_args = list(extra_args or [])
        self.api_key = api_key
        self.serve_command = list(serve_command or KVPILOT_SERVE)
        self.startup_timeout_s = startup_timeout_s
        self.host = host
        self.proc: subprocess.Popen | None = None
        self.fixed_port = port  # 0: a free port per start
        self.port = 0
        self.settings: EngineSettings | None = None
        # kvpilot serve states why it stopped by its exit code (kvpilot.engine.exit_codes); others: the log.
        self.structured_exit = self.serve_command == KVPILOT_SERVE
        # kvpilot serve's control routes need a token of their own (never the API key).
        self.admin_token = secrets.token_urlsafe(24) if self.serve_command == KVPILOT_SERVE else None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def command(self, settings: EngineSettings) -> list[str]:
        cmd = [*self.serve_command, self.model, "--host", self.host, *flag_words("port", self.port),
               *settings.to_flags(), *self.extra_args]
        return cmd + (["--enable-admin-routes"] if self.admin_token else [])

    def environment(self) -> dict[str, str]:
        """The key and the admin token go in the environment, never on the command line."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        if self.admin_token:
            env["KVPILOT_ADMIN_TOKEN"] = self.admin_token
        return env

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def start(self, settings: EngineSettings) -> None:
        """Starts the server and waits until /health answers 200. Raises TrialFailed (the
        process is stopped) when it exits or does not get healthy in time."""
        self.stop()
        self.port = self.fixed_port or free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"\n=== {' '.join(self.command(settings))}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.command(settings), stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=self.environment())
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                self.proc = None
                raise TrialFailed(classify(code, self.log_tail(), structured=self.structured_exit),
                                  f"engine exited with {code}: {self.log_tail(1500)}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    self.settings = settings
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        tail = self.log_tail()
        self.stop()
        raise TrialFailed(classify(None, tail) if "KV blocks" in tail else TRANSIENT,
                          f"engine not healthy after {self.startup_timeout_s:.0f} s: {tail[-1500:]}")

    def apply_live(self, changes: dict) -> bool:
        """Sends scheduler changes to the running server. True when applied; False when
        the server has no admin endpoint (restart instead). Raises TrialFailed(rejected)
        when the server refuses the values."""
        if not self.running:
            return False
        resp = httpx.post(f"{self.base_url}/admin/scheduler_config", json=changes, headers=self.admin_headers,
                          timeout=30)
        if resp.status_code in (404, 405):
            return False
        if resp.status_code == 400:
            raise TrialFailed(REJECTED, f"live change {changes} refused: {resp.text[:500]}")
        resp.raise_for_status()
        assert self.settings is not None
        self.settings = self.settings.replace(**changes)
        return True

    def stop(self, timeout_s: float = 40.0) -> None:
        """SIGTERM (the server drains), then SIGKILL after timeout_s."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        self.settings = None
