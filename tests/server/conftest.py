"""Fixtures for the server tests. One server (`server`, session scope) serves the API,
error, disconnect and admin tests; the Prometheus and drain tests start their own because
they need a fresh or a killed one. Small settings keep the 2-core CI machine responsive."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_stack import stack, workload  # noqa: F401  (session fixtures: Prometheus + engine + tuner)
from server_harness import (ADMIN_TOKEN, API_KEY, ENGINE_SETTINGS, LIMITED_DEADLINE_S, LIMITED_QUEUE, ServerProcess,
                            engine_flags)


@pytest.fixture(scope="session")
def profiler_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("profiles")


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, profiler_dir: Path) -> Iterator[ServerProcess]:
    """The shared server: API key (from $VLLM_API_KEY), admin and profiler routes on behind
    their own token, a waiting-queue limit of 4, a request deadline of 60 s, and the README's
    structured-output flags: tool_choice auto with the hermes parser, compact JSON."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc = ServerProcess(log, *engine_flags(**ENGINE_SETTINGS), "--max-queue-len", "4", "--enable-admin-routes",
                         "--request-deadline-s", "60", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                         "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}',
                         env={"VLLM_API_KEY": API_KEY, "KVPILOT_ADMIN_TOKEN": ADMIN_TOKEN,
                              "VLLM_TORCH_PROFILER_DIR": str(profiler_dir)})
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


@pytest.fixture(scope="session")
def admin_auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="session")
def limited(tmp_path_factory: pytest.TempPathFactory, profiler_dir: Path) -> Iterator[ServerProcess]:
    """A server with tight limits for the hardening and reliability tests: 2 running slots,
    --max-queue-len 8, --request-deadline-s 8, API key from $VLLM_API_KEY, no admin routes
    (though VLLM_TORCH_PROFILER_DIR is set)."""
    settings = {**ENGINE_SETTINGS, "max_num_seqs": 2}
    proc = ServerProcess(tmp_path_factory.mktemp("limited") / "server.log", *engine_flags(**settings),
                         "--max-queue-len", str(LIMITED_QUEUE), "--request-deadline-s", str(LIMITED_DEADLINE_S),
                         "--disable-log-requests", "--disable-uvicorn-access-log",
                         env={"VLLM_API_KEY": API_KEY, "VLLM_TORCH_PROFILER_DIR": str(profiler_dir)})
    proc.start()
    yield proc
    proc.stop()
