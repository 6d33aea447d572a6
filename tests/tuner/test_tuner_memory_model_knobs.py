"""The tuner's memory model knows vLLM's newer knobs as the engine reads them (issue 33):
`kv_cache_memory_bytes` sizes the cache in bytes per rank whatever the memory fraction,
`max_model_len` -1 (auto) fits the context to the cache, and performance mode 'throughput'
moves the defaults trial's limits."""
from __future__ import annotations

from kvpilot.engine.config import ParallelConfig
from kvpilot.engine.distributed.parallel_layout import rank_kv_bytes_per_token
from kvpilot.tuner.search import guide
from kvpilot.tuner.search.feasibility import Hardware, check, resolve_model
from kvpilot.tuner.search.settings import EngineSettings
from kvpilot.tuner.search.space import SearchSpace

MODEL = resolve_model("smollm2-135m-instruct", "float32")
CPU = Hardware(device_memory_bytes=64 << 30, shared_memory=True, dtype="float32")
TOKEN = rank_kv_bytes_per_token(MODEL, ParallelConfig(), 0)  # 46,080 bytes in float32


def test_kv_bytes_give_the_blocks_whatever_the_memory_fraction():
    s = EngineSettings(max_model_len=256, kv_cache_memory_bytes=24 * 16 * TOKEN + 5, gpu_memory_utilization=0.05)
    verdict = check(s, MODEL, CPU)
    assert verdict.feasible and verdict.num_blocks == 24 and verdict.max_concurrency == 24 * 16 / 256
    small = check(s.replace(kv_cache_memory_bytes=8 * 16 * TOKEN), MODEL, CPU)
    assert not small.feasible and "kv_cache_memory_bytes" in small.reason


def test_max_model_len_auto_fits_the_cache_and_is_refused_only_below_16_tokens():
    assert check(EngineSettings(max_model_len=-1, kv_cache_memory_bytes=8 * 16 * TOKEN), MODEL, CPU).feasible
    tiny = check(EngineSettings(max_model_len=-1, kv_cache_memory_bytes=16 * TOKEN // 2), MODEL, CPU)
    assert not tiny.feasible and "auto" in tiny.reason


def test_the_guides_memory_point_reads_the_kv_bytes():
    """24 blocks and a longest request of 100 tokens (7 blocks): at most 3 sequences."""
    base = EngineSettings(max_model_len=256, kv_cache_memory_bytes=24 * 16 * TOKEN)
    points = guide.kv_fit_settings(base, SearchSpace(max_num_seqs=(1, 256), max_num_batched_tokens=None), MODEL,
                                   CPU, guide.RequestTokens(mean=60, longest=100))
    assert [p.max_num_seqs for p in points][0] == 3
