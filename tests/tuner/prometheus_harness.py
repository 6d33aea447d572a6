"""A real Prometheus (Debian's 2.42 binary) on loopback scraping one target every second."""
from __future__ import annotations

import time
from pathlib import Path

import httpx

from kvpilot.bench.harness.prometheus import Prometheus as _Prometheus


class Prometheus(_Prometheus):
    def __init__(self, workdir: Path, target: str, labels: dict[str, str] | None = None):
        super().__init__(workdir, [{"job_name": "engine", "static_configs": [
            {"targets": [target], "labels": labels or {}}]}])

    def has_series(self, promql: str) -> bool:
        try:
            reply = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=5)
        except httpx.HTTPError:
            return False
        if reply.status_code != 200:  # 503 "Service Unavailable" (plain text) while Prometheus starts
            return False
        body = reply.json()
        return body.get("status") == "success" and bool(body["data"]["result"])

    def wait_for(self, promql: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.has_series(promql):
                return
            time.sleep(0.5)
        raise AssertionError(f"Prometheus has no {promql} after {timeout_s} s")
