"""Fixtures of the differential test: vLLM 0.32 and kvpilot on the same model, each started
once per module (oracle_servers.py says with which settings). vLLM is spawned first and ours
loads while vLLM starts, so the pair is up in about vLLM's own start-up time."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from oracle_servers import VLLMServer, our_server


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VLLMServer, object]]:
    """(vllm, ours): both healthy; both stopped at the end of the module."""
    workdir = tmp_path_factory.mktemp("oracle")
    vllm = VLLMServer(workdir).spawn()
    ours = our_server(workdir)
    try:
        ours.start()
        vllm.wait_healthy()
        yield vllm, ours
    finally:
        ours.stop()
        vllm.stop()
