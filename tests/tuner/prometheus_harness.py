"""A real Prometheus (Debian's 2.42 binary) on loopback scraping one target every second."""
from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx
import yaml

from kvpilot.tuner.engine_process import free_port


class Prometheus:
    def __init__(self, workdir: Path, target: str, labels: dict[str, str] | None = None):
        binary = shutil.which("prometheus")
        assert binary, "prometheus is installed by scripts/install-tools.sh (Debian's prometheus package)"
        self.url = f"http://127.0.0.1:{free_port()}"
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "scrape_configs": [{"job_name": "engine", "static_configs": [
                      {"targets": [target], "labels": labels or {}}]}]}
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(workdir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def has_series(self, promql: str) -> bool:
        try:
            body = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=5).json()
        except httpx.HTTPError:
            return False
        return body.get("status") == "success" and bool(body["data"]["result"])

    def wait_for(self, promql: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.has_series(promql):
                return
            time.sleep(0.5)
        raise AssertionError(f"Prometheus has no {promql} after {timeout_s} s")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()
