"""Startup and shutdown: /health says 503 while the model loads; SIGTERM during streams
turns /health and new requests to 503, lets accepted requests finish (up to the drain
timeout), and exits 0."""

from __future__ import annotations

import subprocess
import sys
import threading

import httpx
import pytest
from server_harness import ENGINE_SETTINGS, ServerProcess, engine_flags, wait_until

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
LONG_TOKENS = 1000  # cannot finish within DRAIN_TIMEOUT_S
DRAIN_TIMEOUT_S = 15


@pytest.fixture(scope="module")
def drained_server(tmp_path_factory: pytest.TempPathFactory):
    proc = ServerProcess(tmp_path_factory.mktemp("drain") / "server.log", *engine_flags(**ENGINE_SETTINGS),
                         "--drain-timeout", str(DRAIN_TIMEOUT_S))
    proc.start()
    yield proc
    proc.stop()


def test_health_is_503_while_the_model_loads_then_200(drained_server):
    codes = drained_server.health_codes
    assert codes[-1] == 200 and 503 in codes[:-1]
    # the API answers 503 (not a 500 from a missing tokenizer) while the model loads
    assert drained_server.loading_request_codes == {"completions": 503, "chat/completions": 503}


def test_sigterm_during_streams_finishes_every_accepted_request_and_exits_0(drained_server):
    """Three short streams finish in full during the drain; two requests too long for
    --drain-timeout are aborted when it runs out and told so (an error event, a 503)."""
    server = drained_server
    results: dict[str, dict] = {}
    started = {name: threading.Event() for name in ("short0", "short1", "short2", "long-stream")}

    def stream(name: str, max_tokens: int) -> None:
        body = {"prompt": f"Story {name}:", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        events = []
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
                    started[name].set()
        results[name] = {"status": r.status_code, "events": events}

    def complete(name: str) -> None:
        r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                       json={"prompt": "Story:", "max_tokens": LONG_TOKENS, "ignore_eos": True})
        results[name] = {"status": r.status_code, "body": r.json()}

    threads = [threading.Thread(target=stream, args=(f"short{i}", MAX_TOKENS)) for i in range(3)]
    threads += [threading.Thread(target=stream, args=("long-stream", LONG_TOKENS)),
                threading.Thread(target=complete, args=("long",))]
    for t in threads:
        t.start()
    for event in started.values():
        assert event.wait(60), "streams started"
    wait_until(lambda: server.metric("vllm:num_requests_running") == 5, 30, what="five running requests")
    server.terminate()
    wait_until(lambda: httpx.get(f"{server.url}/health").status_code == 503, 10, 0.05, "/health to turn 503")
    refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    assert refused.headers["retry-after"]
    for t in threads:
        t.join(120)
    assert server.wait(60) == 0
    for i in range(3):
        events = results[f"short{i}"]["events"]
        assert results[f"short{i}"]["status"] == 200 and events[-1] == "data: [DONE]"
        assert f'"completion_tokens": {MAX_TOKENS}' in events[-2]  # the usage chunk: every token arrived
        assert any('"finish_reason": "length"' in e for e in events)
    long_events = results["long-stream"]["events"]
    assert long_events[-1] == "data: [DONE]" and "drain timeout" in long_events[-2] and '"code": 503' in long_events[-2]
    assert results["long"]["status"] == 503 and "drain timeout" in results["long"]["body"]["error"]["message"]
    log = server.log()
    assert "SIGTERM: draining 5 request(s)" in log and "drain timeout: aborting 2 request(s)" in log
    assert "drained; shutting down" in log


def test_invalid_engine_flags_exit_2_with_what_to_change():
    result = subprocess.run(
        [sys.executable, "-m", "kvpilot.cli.main", "serve", "--max-model-len", "1024", "--no-enable-chunked-prefill",
         "--max-num-batched-tokens", "512", "--port", "1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "max_num_batched_tokens (512) is smaller than max_model_len (1024)" in result.stderr
