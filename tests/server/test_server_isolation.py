"""One request never takes the server down (issue 30): the seed that killed the engine
loop is a 400 naming `seed` and the server goes on; /openapi.json states the bounds; and
when the engine loop does die (a fault in the step the batch shares), the process exits 5
at once with the reason on stderr instead of answering 503 forever."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from server_harness import API_KEY, ENGINE_SETTINGS, ServerProcess, engine_flags

from kvpilot.engine.exit_codes import EXIT_ENGINE_DIED, parse_failure

pytestmark = pytest.mark.slow

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 3}


def chat(server, **fields) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, **fields}, headers=HEADERS, timeout=120)


def test_the_seed_that_killed_the_engine_is_a_400_naming_seed_and_the_server_serves_on(server):
    for _ in range(3):  # as often as they like
        r = chat(server, seed=2**70)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "seed" and error["type"] == "invalid_request_error"
        assert "seed must be <= 9223372036854775807" in error["message"]
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert chat(server).status_code == 200
    # the edges of int64 are seeds; n > 1 adds the choice index, wrapping past the top
    for seed in (2**63 - 1, -(2**63)):
        r = chat(server, seed=seed, n=2, temperature=1.0)
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text


def test_openapi_states_the_bounds(server):
    schemas = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]

    def bounds(model, field):
        prop = schemas[model]["properties"][field]
        numeric = next((s for s in prop.get("anyOf", [prop]) if s.get("type") in ("integer", "number")), prop)
        return {k: numeric[k] for k in ("minimum", "maximum", "exclusiveMinimum") if k in numeric}

    assert bounds("ChatCompletionRequest", "seed") == {"minimum": -(2**63), "maximum": 2**63 - 1}
    assert bounds("CompletionRequest", "top_p") == {"exclusiveMinimum": 0, "maximum": 1}
    assert bounds("CompletionRequest", "temperature") == {"minimum": 0, "maximum": 2}
    assert bounds("ChatCompletionRequest", "n") == {"minimum": 1, "maximum": 16}
    assert bounds("ChatCompletionRequest", "top_logprobs") == {"minimum": -1, "maximum": 2**31 - 1}  # then --max-logprobs
    assert bounds("CompletionRequest", "presence_penalty") == {"minimum": -2, "maximum": 2}
    assert bounds("CompletionRequest", "max_tokens") == {"minimum": 1, "maximum": 2**31 - 1}


def test_a_dead_engine_loop_exits_the_process_at_once_with_the_reason(tmp_path):
    server = ServerProcess(tmp_path / "server.log", *engine_flags(**ENGINE_SETTINGS), env={"VLLM_API_KEY": API_KEY})
    server.command = [__import__("sys").executable, str(Path(__file__).with_name("faulty_serve.py"))]
    server.start()
    try:
        assert chat(server).status_code == 200
        t0 = time.monotonic()
        try:
            r = chat(server, max_tokens=13)  # FAULT_MAX_TOKENS: the shared step raises
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
        except httpx.TransportError:
            pass  # the process may close the connection while exiting
        code = server.wait(30)
        exited_after_s = time.monotonic() - t0
    finally:
        server.stop()
    assert code == EXIT_ENGINE_DIED, server.log()[-3000:]
    assert exited_after_s < 15
    failure = parse_failure(server.log())
    assert failure["kind"] == "engine_died" and "injected fault in the shared model step" in failure["message"]
