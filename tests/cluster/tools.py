"""Helpers for tests that drive the test cluster: kubectl, the operator process, polling."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(sys.executable).parent
T = TypeVar("T")


def wait_for(check: Callable[[], T], timeout: float = 20, what: str = "condition") -> T:
    """Poll check() until it returns something truthy; fail the test after timeout seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (KeyError, IndexError, TypeError, AssertionError) as e:
            last = e
        else:
            if last:
                return last
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


class Kubectl:
    def __init__(self, kubeconfig: pathlib.Path):
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig), "HOME": str(kubeconfig.parent)}

    def __call__(self, *args: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess:
        result = subprocess.run([str(BIN / "kubectl"), *args], capture_output=True, text=True,
                                env=self.env, input=stdin, timeout=60)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr}")
        return result

    def json(self, *args: str) -> Any:
        return json.loads(self(*args, "-o", "json").stdout)

    def apply(self, manifest: str | pathlib.Path, check: bool = True) -> subprocess.CompletedProcess:
        if isinstance(manifest, pathlib.Path):
            return self("apply", "--validate=false", "-f", str(manifest), check=check)
        return self("apply", "--validate=false", "-f", "-", check=check, stdin=manifest)


class Operator:
    """The operator process; start() and stop() may be called again (restarts)."""

    def __init__(self, kubeconfig: pathlib.Path, log: pathlib.Path):
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig), "KVPILOT_RESYNC_SECONDS": "1",
                    "KVPILOT_WATCH_TIMEOUT_SECONDS": "30"}
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvpilot.operator.cli", "--namespace", "default"],
                                     env=self.env, stdout=self.log.open("a"), stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
