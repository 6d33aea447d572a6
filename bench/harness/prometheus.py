"""A real Prometheus server for tests and benchmarks: Debian's `prometheus` binary (2.42)
on a loopback port with its storage in a work directory, and the HTTP API calls we use.
The first samples arrive a few seconds after start: poll for a series, not for readiness."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx
import yaml

from kvpilot.loadgen.process import free_port


class Prometheus:
    """`scrape_configs`: Prometheus' own list (job_name, static_configs, honor_labels...)."""

    def __init__(self, workdir: Path, scrape_configs: list[dict], scrape_interval: str = "1s",
                 address: str = "127.0.0.1") -> None:
        """address: where it listens (loopback; a test node's address for pods to query it)."""
        binary = shutil.which("prometheus")
        assert binary, "prometheus is installed by scripts/install-tools.sh (Debian's prometheus package)"
        self.url = f"http://{address}:{free_port()}"
        config = {"global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
                  "scrape_configs": scrape_configs}
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(workdir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def query(self, promql: str, at: float | None = None) -> list[dict]:
        """An instant query (at a Unix time, default now): the result vector."""
        params = {"query": promql, **({"time": f"{at:.3f}"} if at is not None else {})}
        body = httpx.get(f"{self.url}/api/v1/query", params=params, timeout=10).json()
        assert body["status"] == "success", (promql, body)
        return body["data"]["result"]

    def query_range(self, promql: str, start: float, end: float, step_s: float = 1.0) -> list[dict]:
        """A range query over [start, end] (Unix seconds): the result matrix."""
        params = {"query": promql, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step_s:g}"}
        body = httpx.get(f"{self.url}/api/v1/query_range", params=params, timeout=30).json()
        assert body["status"] == "success", (promql, body)
        return body["data"]["result"]

    def value(self, promql: str, at: float | None = None) -> float | None:
        """The first sample's value of instant query `promql` (at Unix time `at`, default now) as a
        float, or None when the query returns no series. Raises httpx.HTTPError as `query` does."""
        result = self.query(promql, at)
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        """SIGTERM to Prometheus, waits up to 30 s for it (subprocess.TimeoutExpired after that),
        closes its log."""
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()
