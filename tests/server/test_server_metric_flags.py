"""vLLM's metric flags without a server: `--custom-histogram-buckets` (vLLM's validation and
messages, the buckets it chooses), `--enable-mfu-metrics` (counters always there, counting only
with the flag), `--kv-cache-metrics` (the kv_block_* families, fed by the block manager's
sampled residency), the tool-parser counter (only with a parser), and the two config info
gauges (vLLM's cache labels; kvpilot's scheduler labels, replaced on a live change)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re

import pytest

from kvpilot.engine import EngineArgs
from kvpilot.engine.core.block_manager import BlockManager
from kvpilot.engine.entrypoints import serve
from kvpilot.engine.metrics.options import MetricOptions, check_custom_histogram_buckets
from kvpilot.engine.metrics.engine_metrics import EngineMetrics
from kvpilot.engine.metrics.tool_parsers import init_parser_metrics, record_tool_parser_invocation
from kvpilot.engine.core.kv_cache_residency import KVCacheResidency
from kvpilot.engine.engine.llm_engine import StepStats
from kvpilot.engine.core.sequence import Sequence
from kvpilot.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def config():
    return EngineArgs(max_model_len=1024, num_gpu_blocks_override=64, dtype="float32").create_engine_config()


def text_of(m: EngineMetrics) -> str:
    return m.render().decode()


def bounds(text: str, name: str) -> list[float]:
    return [float(b) for b in re.findall(rf'{name}_bucket{{[^}}]*le="([^"+]+)"', text)]


@pytest.mark.parametrize("value, message", [
    ({"nope": [1]}, "custom_histogram_buckets: unknown bucket family 'nope'; known families: ['inter_token_latency'"),
    ({"request_latency": []}, "custom_histogram_buckets['request_latency']: bucket list must not be empty"),
    ({"request_latency": [1, 1]}, "custom_histogram_buckets['request_latency']: bounds [1.0, 1.0] must be strictly "
                                  "increasing"),
    ({"request_latency": [0]}, "custom_histogram_buckets['request_latency']: bound 0.0 must be finite and greater "
                               "than 0"),
    ({"request_latency": [float("inf")]}, "bound inf must be finite and greater than 0"),
    ({"request_latency": [True]}, "custom_histogram_buckets['request_latency']: bound True must be a number, not a "
                                  "boolean"),
])
def test_custom_buckets_are_refused_with_vllms_messages(value, message):
    with pytest.raises(ValueError) as info:
        check_custom_histogram_buckets(value)
    assert message in str(info.value)


def test_a_bad_metric_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve.main(["--custom-histogram-buckets", '{"request_latency": [2, 1]}'])
    assert exit_info.value.code == 2
    assert "bounds [2.0, 1.0] must be strictly increasing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve.main(["--kv-cache-metrics-sample", "0"])
    assert "kv_cache_metrics_sample must be in (0, 1]" in capsys.readouterr().err


def test_custom_buckets_replace_a_familys_defaults_and_keep_the_others(config):
    custom = {"request_latency": [0.1, 1, 10], "request_tokens": [4, 64], "kv_cache_residency": [0.5, 5]}
    m = EngineMetrics(config, 64, 0, options=MetricOptions(custom_histogram_buckets=custom, kv_cache_metrics=True))
    text = text_of(m)
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_decode_time_seconds"):
        assert bounds(text, f"vllm:{name}") == [0.1, 1.0, 10.0], name
    assert bounds(text, "vllm:request_prompt_tokens") == bounds(text, "vllm:request_params_max_tokens") == [4.0, 64.0]
    assert bounds(text, "vllm:kv_block_lifetime_seconds") == [0.5, 5.0]
    assert bounds(text, "vllm:time_to_first_token_seconds")[-1] == 2560.0  # not listed: vLLM's default


def test_mfu_counters_are_always_there_and_count_with_the_flag(config):
    step = StepStats(10, 1, 0, [], 0.01, ((10, 10, True), (1, 30, False)))
    off = EngineMetrics(config, 64, 0)
    on = EngineMetrics(config, 64, 0, options=MetricOptions(enable_mfu_metrics=True))
    for m in (off, on):
        m.record_step(step, [], 0.0)
    names = ("flops", "read_bytes", "write_bytes")
    for name in names:
        assert f"vllm:estimated_{name}_per_gpu_total{{" in text_of(off)
        assert re.search(rf'vllm:estimated_{name}_per_gpu_total{{[^}}]*}} 0.0\n', text_of(off))
    expected = on.optional.perf.step(step.batch)
    (line,) = [x for x in text_of(on).splitlines() if x.startswith("vllm:estimated_flops_per_gpu_total{")]
    assert float(line.rsplit(" ", 1)[1]) == expected.flops
    assert expected.flops > 2 * 11 * 106e6  # at least 2 x tokens x non-embedding parameters (SmolLM2: 106M)


def test_kv_block_families_follow_the_flag_and_the_block_managers_evictions(config):
    assert "kv_block_" not in text_of(EngineMetrics(config, 64, 0))
    m = EngineMetrics(config, 64, 0, options=MetricOptions(kv_cache_metrics=True, kv_cache_metrics_sample=1.0))
    clock = iter(range(0, 10**12, 10**9))  # one second per event
    m.optional.residency = KVCacheResidency(1.0, random.Random(0), clock_ns=lambda: next(clock))
    bm = BlockManager(2, 4, enable_prefix_caching=True)
    bm.residency = m.optional.residency
    for rid in ("a", "b", "c"):  # two blocks: the third request's evicts the first's (LRU)
        seq = Sequence(rid, [1, 2, 3, 4, 5] if rid != "b" else [9, 9, 9, 9, 9], SamplingParams(max_tokens=1), ())
        hit = bm.get_computed_blocks(seq)
        assert bm.allocate_slots(seq, seq.num_tokens - len(hit) * 4, hit)
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_full_blocks(seq)
        bm.release(seq)
    m.record_step(StepStats(0, 0, 0, [], 0.0), [], 0.0)
    text = text_of(m)
    assert re.search(r'vllm:kv_block_lifetime_seconds_count{[^}]*} [1-9]', text), text
    assert re.search(r'vllm:kv_block_reuse_gap_seconds_count{[^}]*} 0.0', text)  # one hit: no gap yet


def test_tool_parser_counter_only_with_a_parser(config):
    assert "tool_call_parser" not in text_of(EngineMetrics(config, 64, 0))
    m = EngineMetrics(config, 64, 0, options=MetricOptions(tool_call_parser="hermes"))
    record_tool_parser_invocation(True, is_streaming=False)
    record_tool_parser_invocation(False, is_streaming=True)
    text = text_of(m)
    assert len(re.findall(r"^vllm:tool_call_parser_invocations_total{", text, re.M)) == 12
    assert ('vllm:tool_call_parser_invocations_total{mode="non_streaming",model_name="smollm2-135m-instruct",'
            'outcome="tool_call",request_type="chat_completions"} 1.0') in text
    init_parser_metrics(None, "")  # stop recording into this test's registry


def test_info_gauges_vllms_cache_labels_and_kvpilots_scheduler_labels(config):
    m = EngineMetrics(config, 64, 8)
    text = text_of(m)
    (cache,) = re.findall(r"^vllm:cache_config_info{(.*)} 1.0$", text, re.M)
    labels = dict(re.findall(r'(\w+)="([^"]*)"', cache))
    assert "model_name" not in labels and "max_num_seqs" not in labels and "swap_space" not in labels
    assert labels["engine"] == "0" and labels["num_gpu_blocks"] == "64" and labels["kv_cache_size_tokens"] == "1024"
    assert labels["kv_cache_max_concurrency"] == "1.0"  # 64 blocks of 16 tokens: one 1024-token request
    assert labels["enable_prefix_caching"] == str(config.cache.enable_prefix_caching)
    m.set_config(dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, max_num_seqs=3)))
    (ours,) = re.findall(r"^kvpilot:engine_config_info{(.*)} 1.0$", text_of(m), re.M)
    assert 'max_num_seqs="3"' in ours and 'model_name="smollm2-135m-instruct"' in ours


def test_options_from_the_command_line():
    ns = argparse.Namespace(show_hidden_metrics_for_version=None, enable_mfu_metrics=True, kv_cache_metrics=False,
                            kv_cache_metrics_sample=0.5, custom_histogram_buckets=json.dumps({"iteration_tokens": [8]}),
                            tool_call_parser=None)
    options = MetricOptions.from_cli_args(ns)
    assert options.buckets("iteration_tokens") == [8.0] and options.buckets("request_tokens", 100)[-1] == 100
