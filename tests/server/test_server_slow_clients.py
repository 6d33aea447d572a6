"""Slow and idle clients are bounded (issue 30): a request's headers and body must arrive
within --request-read-timeout-s (408 and close), a connection that sends nothing is closed
after it, an idle keep-alive connection after --timeout-keep-alive, a request with more
than --h11-max-header-count headers is refused, and past --limit-concurrency new requests
get 503 until the stalled connections are closed; /health and chat answer meanwhile.
(The benchmark `kvpilot bench slow-clients` does the same with 1,000.)"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time

import httpx
import pytest
from server_harness import ENGINE_SETTINGS, ServerProcess, engine_flags, wait_until

from kvpilot.bench.reliability.slow_clients import API_KEY, raise_open_file_limit, stall_and_probe

pytestmark = pytest.mark.slow

READ_TIMEOUT_S = 5
KEEP_ALIVE_S = 2
LIMIT = 60


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    raise_open_file_limit(1024)
    proc = ServerProcess(tmp_path_factory.mktemp("slow") / "server.log", *engine_flags(**ENGINE_SETTINGS),
                         "--request-read-timeout-s", str(READ_TIMEOUT_S), "--timeout-keep-alive", str(KEEP_ALIVE_S),
                         "--limit-concurrency", str(LIMIT), "--h11-max-header-count", "32",
                         "--disable-uvicorn-access-log", env={"VLLM_API_KEY": API_KEY})
    proc.start()
    yield proc
    proc.stop()


def test_stalled_and_idle_connections_are_closed_within_the_limit_while_the_server_answers(guarded):
    result = asyncio.run(stall_and_probe(guarded.url, stalled=40, idle=5, wait_s=READ_TIMEOUT_S + 30))
    assert result.open_failures == 0 and result.still_open == 0
    assert len(result.closed_after_s) == 40 and result.answered_408 == 40
    # from each client's connect: the server's timer starts at the connection, so never before the limit
    assert min(result.closed_after_s) >= READ_TIMEOUT_S - 0.1 and max(result.closed_after_s) < READ_TIMEOUT_S + 5
    assert len(result.idle_closed_after_s) == 5 and max(result.idle_closed_after_s) < READ_TIMEOUT_S + 5
    assert result.health_failures == [] and result.chat_failures == []
    assert result.health_s and result.chat_s
    assert "Traceback" not in guarded.log()


def test_an_idle_keep_alive_connection_is_closed(guarded):
    with socket.create_connection(("127.0.0.1", guarded.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        sock.settimeout(KEEP_ALIVE_S + 10)
        assert sock.recv(4096) == b""  # closed by the server
        assert time.monotonic() - t0 < KEEP_ALIVE_S + 2


def test_too_many_headers_are_refused(guarded):
    many = {f"x-h{i}": "1" for i in range(40)}
    refused = httpx.get(f"{guarded.url}/health", headers=many)
    assert refused.status_code == 431 and "--h11-max-header-count" in refused.text
    assert httpx.get(f"{guarded.url}/health", headers=dict(list(many.items())[:20])).status_code == 200


def test_past_the_concurrency_limit_new_requests_get_503_until_stalled_ones_are_closed(guarded):
    """uvicorn counts open connections when a request's headers arrive: LIMIT - 1 stalled
    connections hold every slot but the probe's own."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"
    held = []
    for _ in range(LIMIT - 1):
        sock = socket.create_connection(("127.0.0.1", guarded.port))
        sock.sendall(head)
        held.append(sock)
    try:
        time.sleep(0.5)
        r = httpx.get(f"{guarded.url}/health")
        assert r.status_code == 503 and r.text == "Service Unavailable", r.text
        wait_until(lambda: httpx.get(f"{guarded.url}/health").status_code == 200, READ_TIMEOUT_S + 10,
                   what="/health 200 once the read timeout closed the stalled connections")
    finally:
        for sock in held:
            sock.close()


@pytest.mark.parametrize("flag, value", [("--request-read-timeout-s", "-1"), ("--limit-concurrency", "0"),
                                         ("--h11-max-header-count", "0"), ("--timeout-keep-alive", "0")])
def test_bad_limits_exit_2(flag, value):
    out = subprocess.run([sys.executable, "-m", "kvpilot.cli.main", "serve", flag, value], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and flag in out.stderr


def test_serve_help_lists_the_limits_under_vllm_and_uvicorn_names():
    out = subprocess.run([sys.executable, "-m", "kvpilot.cli.main", "serve", "--help"], capture_output=True,
                         text=True, timeout=120).stdout
    for flag in ("--request-read-timeout-s", "--timeout-keep-alive", "--limit-concurrency",
                 "--h11-max-incomplete-event-size", "--h11-max-header-count", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"):
        assert flag in out
