"""vLLM's newer engine knobs with vLLM's meaning (issue 33): `--kv-cache-memory-bytes` sizes
the KV cache in bytes per rank and ignores gpu_memory_utilization; `--max-model-len auto`
(-1) serves the model's context if the cache holds it, else the longest it holds;
`--performance-mode throughput` doubles the default max_num_seqs and max_num_batched_tokens
only where they are not given. Real SmolLM2 in float32 (46,080 KV bytes per token)."""
from __future__ import annotations

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.arg_utils import EngineArgs
from kvpilot.engine.exit_codes import KVCacheTooSmallError

TOKEN_BYTES = 2 * 30 * 3 * 64 * 4  # K and V x layers x KV heads x head_dim x float32


def test_kv_cache_memory_bytes_sizes_the_cache_and_auto_fits_max_model_len_to_it(model_path):
    llm = LLM(str(model_path), dtype="float32", max_model_len=-1, max_num_seqs=2,
              kv_cache_memory_bytes=20 * 16 * TOKEN_BYTES + 100, gpu_memory_utilization=0.01, swap_space=0.05)
    engine = llm.engine
    assert engine.block_manager.num_blocks == 20  # whole blocks; 0.01 of the memory would not hold one
    assert engine.config.scheduler.max_model_len == 20 * 16 == engine.config.model.max_model_len
    assert engine.scheduler.config.max_model_len == 20 * 16  # it ends sequences at that length
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_kv_budget_below_one_max_model_len_request_says_so():
    with pytest.raises(KVCacheTooSmallError, match="kv_cache_memory_bytes"):
        LLM(dtype="float32", max_model_len=1024, kv_cache_memory_bytes=10 * 16 * TOKEN_BYTES, swap_space=0.05)


@pytest.mark.parametrize("mode, given, expected", [
    ("balanced", {}, (256, 2048)), ("interactivity", {}, (256, 2048)), ("throughput", {}, (512, 4096)),
    ("throughput", {"max_num_seqs": 8, "max_num_batched_tokens": 512}, (8, 512))])
def test_performance_mode_moves_only_the_default_limits(mode, given, expected):
    config = EngineArgs(dtype="float32", max_model_len=1024, performance_mode=mode, **given).create_engine_config()
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == expected
    assert config.performance_mode == mode
