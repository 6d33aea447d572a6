"""How many KV blocks (and swap blocks) the engine allocates, from the config and the
model runner's measured memory; with `--max-model-len auto` also the longest context the
cache holds. Source: vLLM's `determine_available_memory` / `_check_enough_kv_cache_memory`
(v1 `kv_cache_utils`), whose meaning of gpu_memory_utilization, kv_cache_memory_bytes and
num_gpu_blocks_override this keeps."""

from __future__ import annotations

import dataclasses
import logging

from kvpilot.engine import settings
from kvpilot.engine.config import EngineConfig
from kvpilot.engine.executor.multiproc import profile_rank_memory
from kvpilot.engine.memory import GiB, KVCachePlan, check_fits, total_device_memory_bytes
from kvpilot.engine.distributed.parallel_layout import rank_kv_bytes_per_token

logger = logging.getLogger("kvpilot.engine")


def size_kv_cache(cfg: EngineConfig, runner) -> tuple[EngineConfig, int, int]:
    """Returns (config, num_blocks, num_swap_blocks). Blocks are what every rank holds (the
    same number on all: block ids are global); each rank's bytes per block are its stage's
    layers x its KV-head shard; the count is the minimum over ranks' devices, or, on CPU
    where a node's ranks share its memory, what one pool per node fits for its ranks, every
    node having node 0's memory (memory.KVCachePlan; one node unless --nnodes). The config returned differs from `cfg` only where max_model_len
    auto lowered the length. Raises KVCacheTooSmallError (memory.check_fits) when one
    max_model_len sequence does not fit, with the numbers."""
    bs = cfg.cache.block_size
    rank_block_bytes = [bs * rank_kv_bytes_per_token(cfg.model, cfg.parallel, r)
                        for r in range(cfg.parallel.world_size)]
    block_bytes = sum(rank_block_bytes)  # one block id over all ranks
    if cfg.cache.num_gpu_blocks_override is not None:
        num_blocks = cfg.cache.num_gpu_blocks_override
        cfg = fit_max_model_len(cfg, num_blocks, block_bytes, "num_gpu_blocks_override")
    elif cfg.cache.kv_cache_memory_bytes is not None:  # per rank, as vLLM's is per GPU
        num_blocks = cfg.cache.kv_cache_memory_bytes // max(rank_block_bytes)
        logger.info("KV cache sizing: kv_cache_memory_bytes %d per rank = %d blocks of %d tokens "
                    "(gpu_memory_utilization not used)", cfg.cache.kv_cache_memory_bytes, num_blocks, bs)
        cfg = fit_max_model_len(cfg, num_blocks, block_bytes, "kv_cache_memory_bytes")
    else:
        on_cpu = runner.device.type == "cpu"
        plan = KVCachePlan.build(
            total_bytes=total_device_memory_bytes(runner.device),
            gpu_memory_utilization=cfg.cache.gpu_memory_utilization,
            block_size=bs,
            ranks=profile_rank_memory(runner, cfg),
            shared_memory=on_cpu,
            space_bytes=cfg.cache.cpu_kvcache_space_bytes if on_cpu else None,
            nnodes=cfg.parallel.nnodes,  # each node (pod) has node 0's memory: one budget per node's ranks
        )
        logger.info("KV cache sizing: %s", plan.describe())
        num_blocks = plan.num_blocks
        cfg = fit_max_model_len(cfg, num_blocks, plan.budgets[plan.limiting].block_bytes, plan.describe())
    max_len = cfg.scheduler.max_model_len
    # swap_space is per rank (vLLM: per GPU); the rank with the largest blocks bounds it
    num_swap = int(cfg.cache.swap_space * GiB) // max(rank_block_bytes)
    logger.info(
        "# KV blocks: %d (%d tokens) on each of %d rank(s); maximum concurrency for %d tokens per "
        "request: %.2fx; swap blocks: %d", num_blocks, num_blocks * bs, cfg.parallel.world_size,
        max_len, num_blocks * bs / max_len, num_swap,
    )
    return cfg, num_blocks, num_swap


def fit_max_model_len(cfg: EngineConfig, num_blocks: int, block_bytes: int, how: str) -> EngineConfig:
    """Checks that one max_model_len sequence fits `num_blocks` (KVCacheTooSmallError with
    the numbers otherwise). With `--max-model-len auto` it returns a config whose
    max_model_len is the most tokens the cache holds, when that is less than the model's
    context (vLLM's auto: the model's context length if it fits, else the largest length
    that does)."""
    bs, max_len = cfg.cache.block_size, cfg.scheduler.max_model_len
    fits = num_blocks * bs
    if cfg.auto_max_model_len and fits < max_len and fits >= settings.BY_NAME["max_model_len"].minimum:
        logger.info("max_model_len auto: %d tokens (the KV cache holds %d blocks of %d; the model's context "
                    "is %d)", fits, num_blocks, bs, max_len)
        return dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler, max_model_len=fits),
                                   model=dataclasses.replace(cfg.model, max_model_len=fits))
    check_fits(num_blocks, bs, max_len, block_bytes, how)
    return cfg
