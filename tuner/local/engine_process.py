"""One local engine server process (`kvpilot serve`, or any server with `vllm serve`'s flags):
start with a trial's flags and wait for health, change scheduler limits live through
`POST /admin/scheduler_config`, stop. A start that fails is classified from kvpilot's
documented exit code, or from the log for other engines (`kvpilot.tuner.failures`).

A trial over nnodes > 1 nodes runs them all on this machine, as vLLM's multi-node serving
does across machines: node 0 serves HTTP with `--nnodes N --node-rank 0 --master-addr
127.0.0.1 --master-port P`, nodes 1..N-1 run the same command with their `--node-rank` and
`--headless`, each logging to a file of its own (engine.node1.log, ...). Node 0 answers
/health once every node joined; when a node is lost it exits (kvpilot: code 5), which ends
the trial as any engine exit does."""

from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path

import httpx

from kvpilot.engine.settings import flag_words, to_flags
from kvpilot.loadgen.process import KVPILOT_SERVE, free_port, spawn_logged, stop_process, wait_healthy
from kvpilot.tuner.failures import REJECTED, TRANSIENT, TrialFailed, classify
from kvpilot.tuner.search.settings import EngineSettings
from kvpilot.engine.settings.env import KVPILOT_ADMIN_TOKEN, VLLM_API_KEY


def check_flags(serve_command: list[str], flags: list[str], timeout_s: float = 120, help_flag: str = "--help",
                cwd: str | Path | None = None) -> None:
    """Raises ValueError naming every flag in `flags` that `serve_command help_flag` does not
    list (so a study never starts against an engine that would reject its settings). vLLM's
    plain --help lists its config groups only: pass "--help=all" for it."""
    out = subprocess.run([*serve_command, help_flag], capture_output=True, text=True, timeout=timeout_s, cwd=cwd)
    text = out.stdout + out.stderr
    missing = sorted({f for f in flags if f.startswith("--") and f not in text})
    if missing:
        raise ValueError(f"the engine ({' '.join(serve_command)}) does not accept {', '.join(missing)}")


class EngineProcess:
    """model: what `serve` loads; extra_args: flags every trial gets (e.g.
    --num-gpu-blocks-override 256); api_key guards /v1 (a generated admin token guards /admin); port: a fixed port (for
    a Prometheus that scrapes it), else a free one per start. runtime: how settings are spelled
    (EngineSettings.to_flags: "vllm" leaves out what the pinned vLLM no longer takes); env: the
    environment the server starts in (default: this process's); cwd: its working directory."""

    def __init__(self, model: str, log_path: Path, extra_args: list[str] | None = None, api_key: str | None = None,
                 serve_command: list[str] | None = None, startup_timeout_s: float = 300.0, host: str = "127.0.0.1",
                 port: int = 0, runtime: str = "kvpilot", env: dict[str, str] | None = None,
                 cwd: str | Path | None = None):
        self.model, self.log_path = model, Path(log_path)
        self.extra_args = list(extra_args or [])
        self.api_key = api_key
        self.serve_command = list(serve_command or KVPILOT_SERVE)
        self.startup_timeout_s = startup_timeout_s
        self.host = host
        self.proc: subprocess.Popen | None = None
        self.nodes: list[subprocess.Popen] = []  # nodes 1..nnodes-1 of a multi-node trial (headless)
        self.master_port = 0
        self.fixed_port = port  # 0: a free port per start
        self.port = 0
        self.settings: EngineSettings | None = None
        self.runtime, self.env, self.cwd = runtime, env, cwd
        # kvpilot serve states why it stopped by its exit code (kvpilot.engine.exit_codes); others: the log.
        self.structured_exit = self.serve_command == KVPILOT_SERVE
        # kvpilot serve's control routes need a token of their own (never the API key).
        self.admin_token = secrets.token_urlsafe(24) if self.serve_command == KVPILOT_SERVE else None

    @property
    def base_url(self) -> str:
        """http://HOST:PORT of node 0 (the port chosen at start(); 0 before)."""
        return f"http://{self.host}:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        """The Authorization header the /v1 routes take (the API key), {} without one."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def admin_headers(self) -> dict[str, str]:
        """The Authorization header of kvpilot serve's /admin routes (the generated admin token), {}
        for other engines."""
        return {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}

    @property
    def running(self) -> bool:
        """Whether node 0's process was started and has not exited."""
        return self.proc is not None and self.proc.poll() is None

    def command(self, settings: EngineSettings, node_rank: int = 0) -> list[str]:
        """The command line of node `node_rank` (0: the one serving HTTP; more only when
        settings.nnodes > 1: headless, no HTTP flags)."""
        nodes = to_flags({"node_rank": node_rank, "master_addr": "127.0.0.1", "master_port": self.master_port}
                         ) if settings.nnodes > 1 else []
        if node_rank > 0:  # vLLM's --headless is a plain switch (no --no-headless): only where it is on
            return [*self.serve_command, self.model, *settings.to_flags(self.runtime), *nodes,
                    *flag_words("headless", True),
                    *self.extra_args]
        cmd = [*self.serve_command, self.model, "--host", self.host, *flag_words("port", self.port),
               *settings.to_flags(self.runtime), *nodes, *self.extra_args]
        return cmd + (["--enable-admin-routes"] if self.admin_token else [])

    def node_log_path(self, node_rank: int) -> Path:
        """Node 0 logs to log_path, node r to log_path's name with '.node{r}' before the suffix."""
        if node_rank == 0:
            return self.log_path
        return self.log_path.with_name(f"{self.log_path.stem}.node{node_rank}{self.log_path.suffix}")

    def _spawn(self, settings: EngineSettings, node_rank: int) -> subprocess.Popen:
        return spawn_logged(self.command(settings, node_rank), self.node_log_path(node_rank), env=self.environment(),
                            cwd=self.cwd, append=True)

    def environment(self) -> dict[str, str]:
        """The key and the admin token go in the environment, never on the command line."""
        env = {**(os.environ if self.env is None else self.env), "PYTHONUNBUFFERED": "1"}
        if self.api_key:
            env[VLLM_API_KEY] = self.api_key
        if self.admin_token:
            env[KVPILOT_ADMIN_TOKEN] = self.admin_token
        return env

    def log_tail(self, chars: int = 4000, node_rank: int = 0) -> str:
        """The last `chars` characters of node `node_rank`'s log, "" when it cannot be read."""
        try:
            return self.node_log_path(node_rank).read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def start(self, settings: EngineSettings) -> None:
        """Starts the server (every node of a multi-node trial) and waits until /health
        answers 200. Raises TrialFailed (every process is stopped) when one exits, classified
        by its exit code and log, or when it does not get healthy in time."""
        self.stop()
        self.port = self.fixed_port or free_port()
        self.master_port = free_port() if settings.nnodes > 1 else 0
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = self._spawn(settings, 0)
        self.nodes = [self._spawn(settings, rank) for rank in range(1, settings.nnodes)]
        try:
            exited = wait_healthy(f"{self.base_url}/health", [self.proc, *self.nodes], self.startup_timeout_s, 0.5)
        except TimeoutError:
            tail = self.log_tail()
            self.stop()
            raise TrialFailed(classify(None, tail) if "KV blocks" in tail else TRANSIENT,
                              f"engine not healthy after {self.startup_timeout_s:.0f} s: {tail[-1500:]}") from None
        if exited is not None:
            (rank, code), tail = exited, self.log_tail(node_rank=exited[0])
            self.stop()
            which = f"engine node {rank}" if settings.nnodes > 1 else "engine"
            raise TrialFailed(classify(code, tail, structured=self.structured_exit),
                              f"{which} exited with {code}: {tail[-1500:]}")
        self.settings = settings

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
        """SIGTERM (the server drains; node 0 then stops the other nodes), then SIGKILL after
        timeout_s to the process's whole session (vLLM's engine core and workers are children of
        its API server, started in the session `_spawn` opened); the other nodes likewise."""
        for proc in ([self.proc] if self.proc is not None else []) + self.nodes:
            stop_process(proc, timeout_s, kill_session=True)
        self.proc, self.nodes = None, []
        self.settings = None
