"""The liveness fuzz in CI (issue 30), bounded for CI time: 600 generated requests over
every route of the server's OpenAPI document (schemathesis, positive and negative, plus
hostile values), each followed by /health (200) and, every CANARY_EVERY requests, a canary
chat request that must complete; then the engine is idle with every KV block free. The
benchmark `kvpilot bench fuzz-liveness` sends 2,000 (its figures are in
benchmarks/results/reliability/README.md)."""

from __future__ import annotations

import httpx
import pytest
from server_harness import ServerProcess

from kvpilot.loadgen.process import KVPILOT_SERVE
from kvpilot.bench.reliability.fuzz_cases import fuzz_cases
from kvpilot.bench.reliability.fuzz_liveness import ADMIN_TOKEN, API_KEY, NUM_BLOCKS, leaked_blocks, run_fuzz, server_command

pytestmark = pytest.mark.slow

REQUESTS = 600
CANARY_EVERY = 30


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    flags = server_command("smollm2-135m-instruct", 128)[len(KVPILOT_SERVE):]
    proc = ServerProcess(tmp_path_factory.mktemp("fuzz") / "server.log", *flags,
                         env={"VLLM_API_KEY": API_KEY, "KVPILOT_ADMIN_TOKEN": ADMIN_TOKEN})
    proc.start()
    yield proc
    proc.stop()


@pytest.mark.timeout(1800)  # a loaded 2-core machine; quiet, it takes a few minutes
def test_fuzzed_requests_over_every_route_leave_the_engine_alive_and_no_block_leaked(fuzzed):
    openapi = httpx.get(f"{fuzzed.url}/openapi.json").json()
    cases = fuzz_cases(openapi, REQUESTS, seed=30, max_size=100_000)
    assert len(cases) == REQUESTS
    routes = {f"{method.upper()} {path}" for path, ops in openapi["paths"].items() for method in ops}
    assert {f"{c.method} {c.path}" for c in cases} == routes  # every route, admin ones included
    result = run_fuzz(fuzzed.url, cases, canary_every=CANARY_EVERY)
    assert result.engine_deaths == [], result.engine_deaths[:3]
    assert fuzzed.proc.poll() is None
    assert result.sent == REQUESTS and result.health_checks >= REQUESTS and result.canaries >= REQUESTS // CANARY_EVERY
    assert result.server_errors == [] and result.unanswered == [] and result.bad_error_shape == []
    assert result.statuses[200] > 0 and result.statuses[400] > 0, result.statuses
    assert {"schemathesis-positive", "schemathesis-negative", "hostile-huge-int", "hostile-nan-infinity",
            "hostile-wrong-type", "hostile-huge-array", "hostile-huge-string", "hostile-odd-unicode", "hostile-structured",
            "hostile-raw"} <= set(result.kinds)
    assert leaked_blocks(fuzzed.url, NUM_BLOCKS) == (0, 0)
