"""Helpers for tests that drive the test cluster: kubectl and helm (built with the control
plane, at the API server's version), the operator process, polling."""
from __future__ import annotations

import functools
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


@functools.cache
def tool(name: str) -> str:
    """kubectl or helm, built with the control plane (`make controlplane`: kubectl 1.34 and
    Helm 4 against the same client libraries as the API server)."""
    from .controlplane import build

    return str(build().parent / name)


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

    def __call__(self, *args: str, check: bool = True, stdin: str | None = None,
                 cwd: pathlib.Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
        result = subprocess.run([tool("kubectl"), *args], capture_output=True, text=True,
                                env=self.env, input=stdin, timeout=timeout, cwd=cwd)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr}")
        return result

    def json(self, *args: str) -> Any:
        return json.loads(self(*args, "-o", "json").stdout)

    def apply(self, manifest: str | pathlib.Path, check: bool = True) -> subprocess.CompletedProcess:
        if isinstance(manifest, pathlib.Path):
            return self("apply", "-f", str(manifest), check=check)
        return self("apply", "-f", "-", check=check, stdin=manifest)


def helm_template(*sets: str) -> list[dict[str, Any]]:
    """The documents `helm template kv charts/kvpilot` renders with these --set flags."""
    return helm_template_release("kv", *sets)


def chart_operator_command(namespace: str = "default", release: str = "kv") -> list[str]:
    """The operator container's command line as the chart renders it for `helm install RELEASE`
    (watching `namespace`; its Lease named after the release), so that tests start exactly
    what the chart runs."""
    deployment = next(d for d in helm_template_release(release, f"--set=watch.namespaces={{{namespace}}}")
                      if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return container["command"] + container["args"]


def helm_template_release(release: str, *sets: str) -> list[dict[str, Any]]:
    import yaml

    rendered = subprocess.run([tool("helm"), "template", release, str(ROOT / "charts" / "kvpilot"), *sets],
                              capture_output=True, text=True, timeout=60, check=True).stdout
    return [d for d in yaml.safe_load_all(rendered) if d]


class Operator:
    """The operator process, started with the chart's command line (its probes on a free local
    port); start() and stop() may be called again (restarts). Like a pod of the chart's
    Deployment it has a POD_NAME (its leader-election identity; `pod` picks one, default unique
    per Operator) and KVPILOT_OPERATOR_NAMESPACE (where its Lease lives)."""

    _count = 0

    def __init__(self, kubeconfig: pathlib.Path, log: pathlib.Path, namespace: str = "default",
                 release: str = "kv", pod: str | None = None):
        Operator._count += 1
        self.pod = pod or f"{release}-operator-{Operator._count}"
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig), "KVPILOT_RESYNC_SECONDS": "1",
                    "KVPILOT_WATCH_TIMEOUT_SECONDS": "30", "POD_NAME": self.pod,
                    "KVPILOT_OPERATOR_NAMESPACE": namespace}
        self.log = log
        self.proc: subprocess.Popen | None = None
        self.cgroup: pathlib.Path | None = None  # a cgroup v2 group to start in, as a pod's (tests/kube/netcut.py)
        self.python = [sys.executable]  # the interpreter's command (a benchmark may wrap it in a profiler)
        self.liveness_port = free_port()
        command = chart_operator_command(namespace, release)
        assert command[:2] == ["kvpilot", "operator"], command
        self.metrics_port = free_port()
        self.args = [a.replace("http://0.0.0.0:8080/", f"http://127.0.0.1:{self.liveness_port}/")
                     .replace("--metrics-port=9090", f"--metrics-port={self.metrics_port}") for a in command[2:]]

    def start(self, timeout: float = 180) -> None:
        """Start it and wait, as the kubelet's readiness probe would, until its /readyz answers
        200: the leader once Kopf runs, a standby once it reads the Lease (with the tuner
        loaded, imports take seconds; a loaded machine makes it tens)."""
        procs = self.cgroup / "cgroup.procs" if self.cgroup else None
        self.proc = subprocess.Popen([*self.python, "-m", "kvpilot.cli.operator", *self.args],
                                     env=self.env, stdout=self.log.open("a"), stderr=subprocess.STDOUT,
                                     preexec_fn=(lambda: procs.write_text(str(os.getpid()))) if procs else None)
        import urllib.request

        def alive() -> bool:
            assert self.proc is not None and self.proc.poll() is None, f"the operator exited; see {self.log}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.liveness_port}/readyz", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False
        wait_for(alive, timeout=timeout, what="the operator's /readyz")

    def probe(self, path: str) -> tuple[int, str]:
        """(HTTP status, body) of one of its probe endpoints; (0, error) when it does not answer."""
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.liveness_port}{path}", timeout=2) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except OSError as e:
            return 0, str(e)

    def metrics(self) -> str:
        """Its /metrics text ("" when it does not answer)."""
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as r:
                return r.read().decode()
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
