"""Startup and shutdown: /health says 503 while the model loads; SIGTERM during streams
turns /health and new requests to 503, loses no accepted request, and exits 0."""

from __future__ import annotations

import subprocess
import sys
import threading

import httpx
import pytest
from server_harness import ENGINE_SETTINGS, ServerProcess, engine_flags, wait_until

pytestmark = pytest.mark.slow

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def drained_server(tmp_path_factory: pytest.TempPathFactory):
    proc = ServerProcess(tmp_path_factory.mktemp("drain") / "server.log", *engine_flags(**ENGINE_SETTINGS),
                         "--drain-timeout", "60")
    proc.start()
    yield proc
    proc.stop()


def test_health_is_503_while_the_model_loads_then_200(drained_server):
    codes = drained_server.health_codes
    assert codes[-1] == 200 and 503 in codes[:-1]


def test_sigterm_during_streams_finishes_every_accepted_request_and_exits_0(drained_server):
    server = drained_server
    results: dict[int, dict] = {}
    first_chunk = [threading.Event() for _ in range(3)]

    def stream(i: int) -> None:
        body = {"prompt": f"Story number {i}:", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        text, events = "", []
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if not line:
                    continue
                events.append(line)
                if line.startswith("data: {") and '"choices": [{' in line:
                    first_chunk[i].set()
        results[i] = {"status": r.status_code, "events": events}

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for event in first_chunk:
        assert event.wait(60), "streams started"
    server.terminate()
    wait_until(lambda: httpx.get(f"{server.url}/health").status_code == 503, 10, 0.05, "/health to turn 503")
    refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    assert refused.headers["retry-after"]
    for t in threads:
        t.join(120)
    assert server.wait(60) == 0
    for i in range(3):
        events = results[i]["events"]
        assert results[i]["status"] == 200 and events[-1] == "data: [DONE]"
        assert f'"completion_tokens": {MAX_TOKENS}' in events[-2]  # the usage chunk: every token arrived
        assert any('"finish_reason": "length"' in e for e in events)
    log = server.log()
    assert "SIGTERM: draining 3 request(s)" in log and "drained; shutting down" in log


def test_invalid_engine_flags_exit_2_with_what_to_change():
    result = subprocess.run(
        [sys.executable, "-m", "kvpilot.cli.main", "serve", "--max-model-len", "1024", "--no-enable-chunked-prefill",
         "--max-num-batched-tokens", "512", "--port", "1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "max_num_batched_tokens (512) is smaller than max_model_len (1024)" in result.stderr
