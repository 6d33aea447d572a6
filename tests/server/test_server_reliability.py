"""The reliability suite, bounded for CI (the benchmark `kvpilot bench reliability`
runs the same probes at full size): API fuzz from the server's OpenAPI schemas, overload at
10x the server's capacity, a disconnect storm; loopback only, on the `limited` server."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from server_harness import API_KEY, LIMITED_QUEUE, wait_until

from kvpilot.bench.reliability.probes import disconnect_storm, fuzz, generate_requests, overload

pytestmark = pytest.mark.slow

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
CAPACITY = 2 + LIMITED_QUEUE  # running slots + queue


def idle(server) -> bool:
    return server.metric("vllm:num_requests_running") == 0 and server.metric("vllm:kv_cache_usage_perc") == 0


def test_fuzzed_requests_get_no_5xx_and_every_4xx_in_openai_shape(limited):
    openapi = httpx.get(f"{limited.url}/openapi.json").json()
    requests = generate_requests(openapi, 120, seed=17)
    assert len(requests) >= 100
    # one at a time: a single request never exceeds the queue (that is a 400), so any 5xx is a bug
    result = asyncio.run(fuzz(limited.url, HEADERS, requests, concurrency=1))
    assert result.server_errors == [] and result.unanswered == [] and result.bad_error_shape == []
    # both sides were reached: refused (400) and run by the engine (200, or 408 past the deadline on a busy machine)
    assert result.statuses[400] > 0 and result.statuses[200] + result.statuses[408] > 0, result.statuses
    wait_until(lambda: idle(limited), 30, what="the engine idle after the fuzz")


def test_overload_at_10x_capacity_answers_200_or_503_and_health_throughout(limited):
    result = asyncio.run(overload(limited.url, HEADERS, offered=10 * CAPACITY, pid=limited.proc.pid, max_tokens=4))
    assert set(result.statuses) <= {200, 408, 503}, result.statuses
    # a burst arrives before anything runs: the queue (8) is what is admitted at first
    assert result.statuses[503] > 0 and result.statuses[200] + result.statuses[408] >= LIMITED_QUEUE, result.statuses
    assert result.missing_retry_after == 0
    assert result.health_probes > 0 and result.health_failures == 0
    assert limited.proc.poll() is None
    wait_until(lambda: idle(limited), 30, what="every KV block free after the overload")


def test_disconnect_storm_leaks_no_kv_blocks(limited):
    started = asyncio.run(disconnect_storm(limited.url, HEADERS, streams=CAPACITY))
    assert started >= 2  # at least the running ones were closed mid-generation
    wait_until(lambda: idle(limited), 30, what="every KV block free after the storm")
    assert limited.metric("vllm:num_requests_waiting") == 0
