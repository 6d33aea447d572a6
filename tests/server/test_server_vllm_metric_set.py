"""A live `kvpilot serve` exports vLLM 0.33's metric set: every name of the committed table
(vllm_metrics_v0.33.json, read from vLLM's own source) with the same type, label names,
pre-created label values and buckets, with `--show-hidden-metrics-for-version 0.11`; the
deprecated names appear only with the flag value that vLLM used for them. Without the flag:
test_server_prometheus.py (its server); 0.8 and 0.10: test_server_metrics.py (the registry
without a server, to spare two more model loads)."""

from __future__ import annotations

import httpx
import pytest
from server_harness import ServerProcess, engine_flags
from vllm_metric_table import TABLE, check_against_table, families

from kvpilot.engine.entrypoints import serve

pytestmark = pytest.mark.slow

SETTINGS = {"max_model_len": 256, "max_num_seqs": 4, "num_gpu_blocks_override": 64, "dtype": "float32"}
FLAG = "0.11"  # the operator's default; no flag is checked on the Prometheus test's server


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> tuple[str | None, dict, dict]:
    """A server with the flag, a small workload of every kind, then one scrape."""
    flag = FLAG
    extra = ["--show-hidden-metrics-for-version", flag]
    server = ServerProcess(tmp_path_factory.mktemp("metric-set") / "server.log", *engine_flags(**SETTINGS), *extra)
    server.start()
    try:
        client = httpx.Client(base_url=server.url, timeout=120)
        work = {
            "one_token": client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1}),
            "n2": client.post("/v1/completions", json={"prompt": "One two", "max_tokens": 3, "n": 2,
                                                       "ignore_eos": True}),
            "chat": client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                              "max_tokens": 4, "temperature": 0}),
            "bad": client.post("/v1/completions", json={"prompt": "x", "max_tokens": -1}),
            "unknown": client.get("/v1/nothing-here"),
        }
        text = client.get("/metrics").text
        return flag, families(text), work
    finally:
        server.stop()


def test_every_vllm_metric_is_exported_and_only_the_flags_hidden_ones(scraped):
    flag, got, _ = scraped
    check_against_table(got, SETTINGS["max_model_len"], flag)
    assert TABLE["hidden"][flag]  # the flag shows something


def test_values_follow_vllm_semantics(scraped):
    """TPOT for every finished request (0 for the one-token one), n and the most tokens per
    prompt, the engine awake, HTTP requests counted by handler and grouped status."""
    flag, got, work = scraped
    assert work["one_token"].status_code == 200 and work["bad"].status_code == 400

    def value(name: str, suffix: str = "", **labels) -> float:
        family = got[name.removesuffix("_total")]
        return sum(s.value for s in family.samples
                   if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()))

    finished = 4  # one-token + two choices + chat
    assert value("vllm:request_success_total") == finished
    assert value("vllm:request_time_per_output_token_seconds", "_count") == finished
    assert value("vllm:request_time_per_output_token_seconds", "_bucket", le="0.01") >= 1  # the 0 of one token
    assert value("vllm:request_params_n", "_count") == 3 and value("vllm:request_params_n", "_sum") == 4
    assert value("vllm:request_max_num_generation_tokens", "_sum") == 1 + 3 + work["chat"].json()[
        "usage"]["completion_tokens"]
    assert value("vllm:engine_sleep_state", sleep_state="awake") == 1
    assert value("vllm:engine_sleep_state", sleep_state="discard_all") == 0
    assert value("http_requests_total", handler="/v1/completions", status="2xx") == 2
    assert value("http_requests_total", handler="/v1/completions", status="4xx") == 1
    assert value("http_requests_total", handler="/v1/chat/completions", method="POST", status="2xx") == 1
    assert value("http_requests_total", handler="none", status="4xx") == 1  # untemplated path, as in vLLM
    assert not [s for s in got["http_requests"].samples if s.labels["handler"] == "/metrics"]
    itl = value("vllm:inter_token_latency_seconds", "_count")
    assert value("vllm:time_per_output_token_seconds", "_count") == itl > 0  # the deprecated name, same data


def test_an_invalid_flag_value_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve.main(["--show-hidden-metrics-for-version", "latest"])
    assert exit_info.value.code == 2
    assert "--show-hidden-metrics-for-version must be a version such as 0.11" in capsys.readouterr().err
