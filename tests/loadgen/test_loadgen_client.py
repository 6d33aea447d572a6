"""The streaming client and the benchmark runner over real HTTP, against the conftest's
scripted SSE test peer (a protocol peer, not a model server)."""

import asyncio
import socket

import httpx
import pytest

from kvpilot.loadgen.benchmark import run_benchmark
from kvpilot.loadgen.datasets import SampleRequest
from kvpilot.loadgen.request_client import RequestInput, send_request


def send(url, prompt, *, chat=False, timeout_s=None, output_len=4):
    api_url = url + ("/v1/chat/completions" if chat else "/v1/completions")

    async def go():
        async with httpx.AsyncClient(timeout=10) as client:
            return await send_request(client, RequestInput(prompt, 3, output_len, "m", api_url, chat),
                                      timeout_s=timeout_s)

    return asyncio.run(go())


@pytest.mark.parametrize("chat", [False, True])
def test_stream_timings_text_and_usage(sse_peer, chat):
    url, _ = sse_peer
    r = send(url, "tokens=4 delay=0.05", chat=chat)
    assert r.success and r.error_kind == ""
    assert r.generated_text == "t0 t1 t2 t3 "
    assert r.output_tokens == 4 and r.prompt_len == 7  # from the usage event
    assert len(r.itl) == 3
    # each token waits 50 ms at the peer (the chat role chunk before them is not a token)
    assert 0.04 <= r.ttft < 0.5
    assert all(0.03 <= gap < 0.5 for gap in r.itl)
    assert r.latency == pytest.approx(r.ttft + sum(r.itl))
    assert r.token_times[-1] == pytest.approx(r.start_time + r.latency)


def test_missing_usage_leaves_token_count_to_the_metrics(sse_peer):
    url, _ = sse_peer
    r = send(url, "tokens=3 usage=no")
    assert r.success and r.output_tokens is None and len(r.itl) == 2


@pytest.mark.parametrize("prompt, kind, message", [
    ("mode=http503", "http_503", "overloaded"),
    ("mode=http400", "http_400", "HTTP 400"),
    ("tokens=5 mode=drop", "disconnect", "broke off"),
    ("tokens=3 mode=error_event", "error_event", "out of KV cache"),
    ("tokens=3 mode=bad_event", "bad_event", "not JSON"),
    ("mode=no_tokens", "no_tokens", "without any token"),
])
def test_failures_are_classified_by_kind(sse_peer, prompt, kind, message):
    url, _ = sse_peer
    r = send(url, prompt)
    assert not r.success
    assert r.error_kind == kind
    assert message in r.error
    assert (r.ttft, r.itl, r.latency) == (0.0, [], 0.0)


def test_no_tokens_in_chat_despite_role_chunk(sse_peer):
    url, _ = sse_peer
    r = send(url, "mode=no_tokens", chat=True)
    assert r.error_kind == "no_tokens"


def test_overall_timeout(sse_peer):
    url, _ = sse_peer
    r = send(url, "mode=hang", timeout_s=0.3)
    assert r.error_kind == "timeout"


def test_refused_connection():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: connections are refused
        r = send(f"http://127.0.0.1:{port}", "tokens=1")
    assert r.error_kind == "connect"


def test_max_concurrency_caps_requests_in_flight(sse_peer):
    url, stats = sse_peer
    stats["max_in_flight"] = 0
    reqs = [SampleRequest("tokens=3 delay=0.03", 3, 3)] * 8
    results, duration = asyncio.run(run_benchmark(reqs, api_url=url + "/v1/completions", model="m",
                                                  max_concurrency=2, progress=False))
    assert all(r.success for r in results)
    assert stats["max_in_flight"] == 2
    assert max(r.client_queue_time for r in results) > 0.05  # later ones waited for a slot
    assert duration >= 4 * 3 * 0.03  # 8 requests, 2 at a time, ~90 ms each


def test_request_rate_spreads_sends_over_n_over_rate(sse_peer):
    url, _ = sse_peer
    reqs = [SampleRequest("tokens=1", 3, 1)] * 6
    results, duration = asyncio.run(run_benchmark(reqs, api_url=url + "/v1/completions", model="m",
                                                  request_rate=12.0, burstiness=1.0, seed=0, progress=False))
    starts = sorted(r.start_time for r in results)
    assert duration >= 0.5 - 0.01  # the normalized schedule ends at 6 / 12 s
    assert starts[-1] - starts[0] > 0.1


def test_payload_reaches_the_server(sse_peer):
    url, stats = sse_peer
    reqs = [SampleRequest("tokens=2", 3, 9)]
    asyncio.run(run_benchmark(reqs, api_url=url + "/v1/chat/completions", model="peer", ignore_eos=True,
                              extra_body={"temperature": 0.0}, progress=False))
    body = stats["bodies"][-1]
    assert body["model"] == "peer" and body["max_tokens"] == 9 and body["ignore_eos"] is True
    assert body["temperature"] == 0.0 and body["stream"] is True
