"""POST /admin/scheduler_config: the tuner's live change of scheduler limits, applied on
the engine thread, guarded by its own admin token (the API key does not open it), reflected
in kvpilot:engine_config_info (vLLM's vllm:cache_config_info has no scheduler limits)."""

from __future__ import annotations

import httpx
import pytest
from server_harness import ADMIN_TOKEN, API_KEY, ENGINE_SETTINGS

pytestmark = pytest.mark.slow

HEADERS = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
DEFAULTS = {"max_num_seqs": ENGINE_SETTINGS["max_num_seqs"], "max_num_batched_tokens": 2048,
            "enable_chunked_prefill": True, "preemption_mode": "recompute"}


@pytest.fixture
def admin(server):
    url = f"{server.url}/admin/scheduler_config"
    yield url
    assert httpx.post(url, json=DEFAULTS, headers=HEADERS).status_code == 200


def config_info(server) -> dict[str, str]:
    import re

    series = [k for k in server.metrics() if k.startswith("kvpilot:engine_config_info{")]
    assert len(series) == 1, series
    return dict(re.findall(r'(\w+)="([^"]*)"', series[0]))


def test_update_returns_the_new_config_and_the_info_metric_follows(server, admin):
    new = {"max_num_seqs": 4, "max_num_batched_tokens": 1024, "enable_chunked_prefill": False,
           "preemption_mode": "swap"}
    r = httpx.post(admin, json=new, headers=HEADERS)
    assert r.status_code == 200 and r.json() == {**new, "max_model_len": 1024}
    assert httpx.get(admin, headers=HEADERS).json() == r.json()
    info = config_info(server)
    assert (info["max_num_seqs"], info["max_num_batched_tokens"], info["enable_chunked_prefill"],
            info["preemption_mode"]) == ("4", "1024", "False", "swap")
    assert info["block_size"] == "16" and info["num_gpu_blocks"] == "256" and info["max_model_len"] == "1024"
    done = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                      json={"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0})
    assert done.status_code == 200 and done.json()["choices"][0]["text"] == " Paris."  # same output


@pytest.mark.parametrize("body, fragment", [
    ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
    ({"max_num_batched_tokens": 4}, "must be >= max_num_seqs"),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 512}, "chunked prefill off"),
    ({"preemption_mode": "drop"}, "preemption_mode"),
    ({"block_size": 32}, "block_size"),
    ({}, "nothing to change"),
])
def test_invalid_values_get_400_with_the_reason_and_change_nothing(server, admin, body, fragment):
    before = httpx.get(admin, headers=HEADERS).json()
    r = httpx.post(admin, json=body, headers=HEADERS)
    assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text
    assert httpx.get(admin, headers=HEADERS).json() == before
    assert config_info(server)["max_num_seqs"] == str(before["max_num_seqs"])


def test_admin_route_needs_the_admin_token_not_the_api_key(server, admin):
    for headers in ({}, {"Authorization": f"Bearer {API_KEY}"}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(admin, json={"max_num_seqs": 2}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token", r.text
        assert httpx.get(admin, headers=headers).status_code == 401
    assert httpx.get(admin, headers=HEADERS).json()["max_num_seqs"] == DEFAULTS["max_num_seqs"]
