"""One engine over several `kvpilot serve` processes on this machine, each a node as a pod
would be (`--nnodes N --node-rank R --master-addr 127.0.0.1 --master-port P`): node 0 a
`ServerProcess` (HTTP, /health), the others headless. For the multi-node benchmark and its
tests; in a cluster the operator renders the same flags per pod.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from kvpilot.engine.settings import to_flags

from kvpilot.bench.harness.server_process import ServerProcess
from kvpilot.loadgen.process import KVPILOT_SERVE, free_port, spawn_logged, stop_process


def node_flags(nnodes: int, node_rank: int, master_port: int) -> list[str]:
    """vLLM's multi-node flags for node `node_rank` of `nnodes` meeting at 127.0.0.1:master_port."""
    return to_flags({"nnodes": nnodes, "node_rank": node_rank, "master_addr": "127.0.0.1",
                     "master_port": master_port})


class HeadlessNode:
    """A node > 0: `kvpilot serve MODEL FLAGS --node-rank R ...`, output in log_path, started
    in `env` (kvpilot.loadgen.process.spawn_logged: a session of its own, unbuffered output)."""

    def __init__(self, command: list[str], log_path: Path, env: Mapping[str, str]) -> None:
        self.log_path = Path(log_path)
        self.proc = spawn_logged(command, self.log_path, env=env)

    def log(self) -> str:
        """The node's output so far (raises OSError when the log cannot be read)."""
        return self.log_path.read_text(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Sends `sig` (default SIGKILL: a lost node) to the node's process unless it has exited."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait(self, timeout_s: float) -> int:
        """The exit code; raises subprocess.TimeoutExpired while it still runs."""
        return self.proc.wait(timeout_s)


class NodeGroup:
    """`nnodes` processes serving `model` with the engine flags `flags` (the same on every node).
    `start()` spawns the headless nodes, then node 0 (or node 0 first with
    workers_first=False, the others `stagger_s` later) and returns once node 0's /health is
    200, setting `ready_s` (first spawn to healthy). `stop()` ends every process."""

    def __init__(self, model: str, flags: list[str], nnodes: int, log_dir: Path,
                 env: Mapping[str, str] | None = None, startup_timeout_s: float = 300.0) -> None:
        self.model, self.flags, self.nnodes = model, list(flags), nnodes
        self.log_dir = Path(log_dir)
        self.env = dict(os.environ if env is None else env)
        self.startup_timeout_s = startup_timeout_s
        self.master_port = free_port()
        self.workers: list[HeadlessNode] = []
        self.server: ServerProcess | None = None
        self.ready_s = 0.0
        self.starts = 0

    def _command(self, node_rank: int) -> list[str]:
        return [*KVPILOT_SERVE, self.model, *self.flags, *node_flags(self.nnodes, node_rank, self.master_port)]

    def _spawn_workers(self) -> None:
        self.workers = [HeadlessNode(self._command(r), self.log_dir / f"node{r}-{self.starts}.log", self.env)
                        for r in range(1, self.nnodes)]

    def start(self, workers_first: bool = True, stagger_s: float = 2.0) -> NodeGroup:
        """Raises ServerRefused (node 0's exit code and reason) when node 0 does not get healthy."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        t0 = time.monotonic()
        self.server = ServerProcess(self._command(0), self.log_dir / f"node0-{self.starts}.log",
                                    startup_timeout_s=self.startup_timeout_s, env=self.env)
        if workers_first:
            self._spawn_workers()
            self.server.start()
        else:
            late = threading.Timer(stagger_s, self._spawn_workers)
            late.start()
            try:
                self.server.start()
            finally:
                late.join()
        self.ready_s = time.monotonic() - t0
        return self

    @property
    def url(self) -> str:
        """Node 0's http://HOST:PORT (the only node serving HTTP); start() first."""
        return self.server.base_url

    def node0_exit_code(self, timeout_s: float) -> int:
        """Node 0's exit code once it has exited by itself; raises TimeoutExpired otherwise."""
        return self.server.proc.wait(timeout_s)

    def stop(self) -> None:
        """Stops node 0 (SIGTERM, then SIGKILL after its stop timeout), then every headless node
        (SIGTERM, SIGKILL after 10 s)."""
        if self.server is not None:
            self.server.stop()
        for node in self.workers:
            stop_process(node.proc, 10)

    def __enter__(self) -> NodeGroup:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
