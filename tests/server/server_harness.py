"""A real `kvpilot serve` subprocess on a free port, for the server tests."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

API_KEY = "test-key-123"
ADMIN_TOKEN = "test-admin-token-4567"  # the control routes' own token
LIMITED_DEADLINE_S = 8.0  # the `limited` server's --request-deadline-s and --max-queue-len
LIMITED_QUEUE = 8
# The settings the offline-equality test must share with the server. The dense weights (not the
# GGUF's blocks the builtin model reads by default for steps of up to 8 rows): a request's tokens then
# do not depend on how many others share its steps (the offline-equality test), and the deadline and
# drain tests' long requests (900-1000 tokens) take longer than their 8 s and 15 s at this speed.
ENGINE_SETTINGS = {"max_model_len": 1024, "max_num_seqs": 8, "num_gpu_blocks_override": 256, "dtype": "float32",
                   "quantization": "none"}


def engine_flags(**settings) -> list[str]:
    flags = []
    for name, value in settings.items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m kvpilot.cli.main serve ...` with its log in a file. `start()` returns once
    /health answers 200 and records every status /health gave before that."""

    def __init__(self, log_path: Path, *flags: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.flags = list(flags)
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.health_codes: list[int] = []
        self.loading_request_codes: dict[str, int] = {}  # API calls made while /health was 503
        self.command = [sys.executable, "-m", "kvpilot.cli.main", "serve"]  # what runs `serve`

    def start(self, timeout_s: float = 240.0) -> ServerProcess:
        cmd = [*self.command, "--host", "127.0.0.1", "--port", str(self.port),
               "--log-stats-interval", "2", *self.flags]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                code = httpx.get(f"{self.url}/health", timeout=2).status_code
                self.health_codes.append(code)
                if code == 200:
                    return self
                if code == 503 and not self.loading_request_codes:
                    for route, body in (("completions", {"prompt": "hi", "max_tokens": 2}),
                                        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
                        self.loading_request_codes[route] = httpx.post(
                            f"{self.url}/v1/{route}", json=body, timeout=5).status_code
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """/metrics as {'name{labels}': value}, label order as served."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return samples

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        total = 0.0
        for key, value in self.metrics().items():
            m = re.fullmatch(r"([^{]+)(?:\{(.*)\})?", key)
            if m.group(1) != name:
                continue
            have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                total += value
        return total

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout_s)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if getattr(self, "_log", None):
            self._log.close()


def wait_until(predicate, timeout_s: float, interval_s: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
