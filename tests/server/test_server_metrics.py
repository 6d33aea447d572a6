"""The metrics module without a server: vLLM v1's names, labels and buckets, the classic
text format, and what one request's outputs record."""

from __future__ import annotations

import re

import pytest

from kvpilot.engine import EngineArgs
from kvpilot.engine.metrics.engine_metrics import CONTENT_TYPE, EngineMetrics, build_1_2_5_buckets
from kvpilot.engine.engine.llm_engine import StepStats
from kvpilot.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput


@pytest.fixture(scope="module")
def config():
    return EngineArgs(max_model_len=1024, num_gpu_blocks_override=64, dtype="float32").create_engine_config()


def samples(metrics: EngineMetrics) -> dict[str, float]:
    lines = metrics.render().decode().splitlines()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))}


def bucket_bounds(metrics: EngineMetrics, name: str) -> list[float]:
    return [float(m) for m in re.findall(rf'{name}_bucket{{[^}}]*le="([^"]+)"', metrics.render().decode())
            if m != "+Inf"]


def test_buckets_are_vllms(config):
    m = EngineMetrics(config, 64, 0)
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert bucket_bounds(m, "vllm:request_prompt_tokens") == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    assert bucket_bounds(m, "vllm:time_to_first_token_seconds")[:3] == [0.001, 0.005, 0.01]
    assert bucket_bounds(m, "vllm:time_to_first_token_seconds")[-1] == 2560.0
    assert bucket_bounds(m, "vllm:inter_token_latency_seconds")[-1] == 80.0
    assert bucket_bounds(m, "vllm:e2e_request_latency_seconds")[-1] == 7680.0
    assert bucket_bounds(m, "vllm:iteration_tokens_total") == [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096,
                                                               8192, 16384]


def test_classic_text_with_colon_names_model_and_engine_labels_and_no_created_series(config):
    m = EngineMetrics(config, 64, 0)
    text = m.render().decode()
    assert CONTENT_TYPE.startswith("text/plain; version=0.0.4")
    assert 'vllm:num_requests_running{engine="0",model_name="smollm2-135m-instruct"} 0.0' in text
    assert "_created" not in text and "vllm_" not in text
    for reason in ("stop", "length", "abort"):
        assert f'finished_reason="{reason}"' in text


def test_one_request_records_tokens_once_and_its_latencies(config):
    m = EngineMetrics(config, 64, 0)

    def output(n_tokens: int, t: float, finished: bool) -> RequestOutput:
        return RequestOutput("r", None, [1, 2, 3, 4], [CompletionOutput(0, "x", [7] * n_tokens,
                             finish_reason="length" if finished else None)], finished,
                             RequestMetrics(0.0, 0.5, 1.0, t, t if finished else None), "x", [7])

    m.record_step(StepStats(4, 1, 0, [], 0.1), [output(1, 1.0, False)], now=1.0)
    m.record_step(StepStats(0, 1, 2, [], 0.1), [output(2, 1.5, False)], now=1.5)
    last = output(3, 2.0, True)
    m.record_step(StepStats(0, 1, 0, [], 0.1), [last], now=2.0)
    m.record_finished(last, max_tokens=3)
    s = samples(m)
    key = '{engine="0",model_name="smollm2-135m-instruct"}'
    assert s[f"vllm:prompt_tokens_total{key}"] == 4  # once, at the first token
    assert s[f"vllm:generation_tokens_total{key}"] == 3
    assert s[f"vllm:num_preemptions_total{key}"] == 2
    assert s[f"vllm:time_to_first_token_seconds_sum{key}"] == 1.0
    assert s[f"vllm:inter_token_latency_seconds_count{key}"] == 2
    assert s[f"vllm:inter_token_latency_seconds_sum{key}"] == 1.0
    assert s[f"vllm:request_time_per_output_token_seconds_sum{key}"] == 0.5
    assert s[f"vllm:e2e_request_latency_seconds_sum{key}"] == 2.0
    assert s[f"vllm:request_queue_time_seconds_sum{key}"] == 0.5
    assert s[f"vllm:request_prefill_time_seconds_sum{key}"] == 0.5
    assert s[f"vllm:request_decode_time_seconds_sum{key}"] == 1.0
    assert s[f"vllm:iteration_tokens_total_sum{key}"] == 7
    assert s['vllm:request_success_total{engine="0",finished_reason="length",model_name="smollm2-135m-instruct"}'] == 1


def _minor(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split(".")[:2])


@pytest.mark.parametrize("flag", ["0.8", "0.9", "0.10", "0.10.2", "0.11", "0.32", None])
def test_show_hidden_metrics_for_version_adds_every_name_hidden_since_that_version(config, flag):
    """The table's hidden names of every version not older than `flag` and no others: a
    dashboard of vLLM 0.10 reads 0.10's and 0.11's deprecated names from one value (vLLM's
    own flag would show only 0.10's); 0.32: vLLM 0.33 hides nothing."""
    import json
    from pathlib import Path

    from prometheus_client.parser import text_string_to_metric_families
    table = json.loads((Path(__file__).parent / "vllm_metrics_v0.33.json").read_text())
    m = EngineMetrics(config, 64, 0, show_hidden_for=flag)
    m.record_scheduler_state(1, 0, 0, 0.25, 10, 4)
    names = {f.name for f in text_string_to_metric_families(m.render().decode())}
    for version, specs in table["hidden"].items():
        for spec in specs:
            name = spec["name"].removesuffix("_total")
            assert (name in names) == (flag is not None and _minor(version) >= _minor(flag)), (flag, name)
    if flag in ("0.8", "0.9", "0.10"):  # the dashboard of the issue: both old names from one value
        assert {"vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds"} <= names
    s = samples(m)
    key = '{engine="0",model_name="smollm2-135m-instruct"}'
    if flag == "0.10":  # the old names carry the same values as the new ones
        assert s[f"vllm:gpu_cache_usage_perc{key}"] == s[f"vllm:kv_cache_usage_perc{key}"] == 0.25
        assert s[f"vllm:gpu_prefix_cache_hits_total{key}"] == s[f"vllm:prefix_cache_hits_total{key}"] == 4


def test_a_one_token_request_records_a_zero_time_per_output_token(config):
    m = EngineMetrics(config, 64, 0)
    out = RequestOutput("r", None, [1, 2], [CompletionOutput(0, "x", [7], finish_reason="length")], True,
                       RequestMetrics(0.0, 0.1, 0.5, 0.5, 0.5), "x", [7])
    m.record_step(StepStats(2, 1, 0, [], 0.1), [out], now=0.5)
    m.record_finished(out, max_tokens=1)
    s = samples(m)
    key = '{engine="0",model_name="smollm2-135m-instruct"}'
    assert s[f"vllm:request_time_per_output_token_seconds_count{key}"] == 1
    assert s[f"vllm:request_time_per_output_token_seconds_sum{key}"] == 0
