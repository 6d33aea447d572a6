"""A client that goes away aborts its request at once: vllm:num_requests_running drops and
the KV cache returns to its idle usage (every block free again), long before the request
would have finished."""

from __future__ import annotations

import time

import httpx
import pytest
from server_harness import API_KEY, wait_until

pytestmark = pytest.mark.slow

LONG = {"prompt": "Tell me a long story about a dragon.", "max_tokens": 600, "ignore_eos": True, "temperature": 0}
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def idle(server) -> bool:
    return server.metric("vllm:num_requests_running") == 0 and server.metric("vllm:num_requests_waiting") == 0


def test_closing_a_stream_mid_way_aborts_the_request_and_frees_its_blocks(server):
    wait_until(lambda: idle(server), 60, what="an idle server")
    idle_usage = server.metric("vllm:kv_cache_usage_perc")
    aborted = server.metric("vllm:request_success_total", finished_reason="abort")
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}, headers=HEADERS,
                      timeout=60) as r:
        lines = r.iter_lines()
        chunks = [next(line for line in lines if line.startswith("data: ")) for _ in range(3)]
        assert len(chunks) == 3
        assert server.metric("vllm:num_requests_running") == 1
        assert server.metric("vllm:kv_cache_usage_perc") > idle_usage
        closed_at = time.monotonic()
    # leaving the block closes the connection mid-stream
    wait_until(lambda: server.metric("vllm:num_requests_running") == 0, 10, what="running to drop")
    wait_until(lambda: server.metric("vllm:kv_cache_usage_perc") == idle_usage, 10, what="blocks freed")
    assert time.monotonic() - closed_at < 10  # 600 tokens would take far longer
    assert server.metric("vllm:request_success_total", finished_reason="abort") == aborted + 1
    assert "aborted: the client disconnected" in server.log()


def test_a_non_streaming_client_that_times_out_aborts_its_request(server):
    wait_until(lambda: idle(server), 60, what="an idle server")
    idle_usage = server.metric("vllm:kv_cache_usage_perc")
    aborted = server.metric("vllm:request_success_total", finished_reason="abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=LONG, headers=HEADERS, timeout=httpx.Timeout(5, read=2))
    wait_until(lambda: server.metric("vllm:request_success_total", finished_reason="abort") == aborted + 1, 10,
               what="the abort")
    wait_until(lambda: idle(server) and server.metric("vllm:kv_cache_usage_perc") == idle_usage, 10,
               what="blocks freed")
