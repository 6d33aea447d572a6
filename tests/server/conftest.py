"""Fixtures for the server tests. One server (`server`, session scope) serves the API,
error, disconnect and admin tests; the Prometheus and drain tests start their own because
they need a fresh or a killed one. Small settings keep the 2-core CI machine responsive."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_stack import stack, workload  # noqa: F401  (session fixtures: Prometheus + engine + tuner)
from server_harness import API_KEY, ENGINE_SETTINGS, ServerProcess, engine_flags


@pytest.fixture(scope="session")
def profiler_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, profiler_dir: Path) -> Iterator[ServerProcess]:
    """The shared server: API key set, profiler routes on, a waiting-queue limit of 4."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc = ServerProcess(log, *engine_flags(**ENGINE_SETTINGS), "--api-key", API_KEY, "--max-queue-len", "4",
                         env={"VLLM_TORCH_PROFILER_DIR": str(profiler_dir)})
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def client(server: ServerProcess):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}
