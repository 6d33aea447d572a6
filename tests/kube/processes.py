"""Child processes of the test control plane: each logs to a file, stops with SIGTERM (then
SIGKILL) and is never left behind."""
from __future__ import annotations

import abc
import ctypes
import os
import pathlib
import signal
import subprocess

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the test process dies, even by SIGKILL, so that
    no component outlives a killed pytest."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class Process:
    """One component: `argv` started with its output in `log`."""

    def __init__(self, name: str, argv: list[str], log: pathlib.Path, env: dict[str, str] | None = None):
        self.name, self.argv, self.log = name, argv, log
        self.proc = subprocess.Popen(argv, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                     preexec_fn=_die_with_parent)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def check(self) -> None:
        """Raises RuntimeError with the log's tail when the process has exited."""
        if not self.alive():
            tail = self.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; {self.log}:\n{tail}")

    def stop(self, timeout_s: float = 20) -> None:
        """SIGTERM, then SIGKILL after timeout_s, to the process and its process group."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # anything it started in its group goes too
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()



class Started(abc.ABC):
    """A context manager over `_start()` and `stop()`: a start that fails midway stops what it
    had started before the error goes on."""

    @abc.abstractmethod
    def _start(self) -> None:
        """Starts everything; may fail midway (stop() then runs)."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stops whatever was started, also after a partial start."""

    def __enter__(self):
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
