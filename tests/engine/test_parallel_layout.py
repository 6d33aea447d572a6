"""The arithmetic of parallel layouts, without processes: vLLM's layer split, the rank
layout, per-rank KV bytes and parameters, micro-batch cuts and the per-rank KV sizing."""

from __future__ import annotations

import pytest

from kvpilot.engine.config import ModelConfig, ParallelConfig
from kvpilot.engine.memory import GiB, KVCachePlan, RankMemory
from kvpilot.engine.distributed.parallel_layout import (
    RankPosition,
    get_pp_indices,
    rank_kv_bytes_per_token,
    rank_num_params,
)
from kvpilot.engine.distributed.pipeline import MicroBatchPolicy, split_micro_batches

SMOL = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                   num_kv_heads=3, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True)


@pytest.mark.parametrize("layers, pp, expected", [
    (30, 1, [(0, 30)]),
    (30, 2, [(0, 15), (15, 30)]),
    (30, 4, [(0, 7), (7, 15), (15, 23), (23, 30)]),  # remainder 2: the two middle stages
    (5, 2, [(0, 3), (3, 5)]),  # remainder 1: the second-to-last stage, here the first
    (10, 3, [(0, 3), (3, 7), (7, 10)]),
    (7, 4, [(0, 2), (2, 4), (4, 6), (6, 7)]),  # remainder 3: every stage but the last
])
def test_layers_split_as_vllm_get_pp_indices(layers, pp, expected):
    assert [get_pp_indices(layers, r, pp) for r in range(pp)] == expected


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 exceeds the model's 2 layers"):
        get_pp_indices(2, 0, 3)


def test_tensor_parallel_ranks_of_a_stage_are_contiguous_and_neighbours_are_tp_apart():
    parallel = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=3)
    positions = [RankPosition.of(r, parallel) for r in range(6)]
    assert [(p.pp_rank, p.tp_rank) for p in positions] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert positions[3].prev_rank == 1 and positions[3].next_rank == 5
    assert [p.rank for p in positions if p.sends_logits] == [4]
    assert positions[0].is_first_stage and positions[5].is_last_stage


@pytest.mark.parametrize("tp, pp", [(1, 1), (3, 1), (1, 2), (3, 2), (1, 4)])
def test_rank_kv_bytes_add_up_to_the_models(tp, pp):
    parallel = ParallelConfig(tp, pp)
    per_rank = [rank_kv_bytes_per_token(SMOL, parallel, r, dtype_bytes=2) for r in range(parallel.world_size)]
    assert sum(per_rank) == SMOL.kv_bytes_per_token(dtype_bytes=2)
    if pp == 4:  # stages of 7, 8, 8, 7 layers
        assert per_rank == [2 * n * 3 * 64 * 2 for n in (7, 8, 8, 7)]


def test_rank_params_add_up_and_a_tied_lm_head_is_copied_to_the_last_stage():
    assert rank_num_params(SMOL, ParallelConfig(), 0) == SMOL.num_params()
    two_stages = [rank_num_params(SMOL, ParallelConfig(1, 2), r) for r in range(2)]
    assert sum(two_stages) == SMOL.num_params() + SMOL.vocab_size * SMOL.hidden_size
    tp3 = sum(rank_num_params(SMOL, ParallelConfig(3, 1), r) for r in range(3))
    assert tp3 == pytest.approx(SMOL.num_params(), rel=0.01)  # norms replicated on each rank


def test_micro_batches_are_contiguous_non_empty_and_balanced_by_tokens():
    scheduled = [("d0", 1), ("d1", 1), ("d2", 1), ("p0", 30), ("p1", 29)]
    chunks = split_micro_batches(scheduled, 2)
    assert [x for c in chunks for x in c] == scheduled
    assert [sum(n for _, n in c) for c in chunks] == [33, 29]
    assert split_micro_batches(scheduled[:1], 4) == [scheduled[:1]]
    many = split_micro_batches([("big", 100), ("a", 1), ("b", 1)], 3)
    assert [len(c) for c in many] == [1, 1, 1]
    assert split_micro_batches(scheduled, 1) == [scheduled]


def test_small_steps_are_not_cut_and_large_ones_up_to_the_limit():
    policy = MicroBatchPolicy(max_micro_batches=2, min_tokens=128)
    decode = [(f"d{i}", 1) for i in range(64)]
    assert policy.count(decode) == 1
    assert policy.count([("p0", 200), ("p1", 100)]) == 2
    assert policy.count([("p0", 2000)]) == 1  # one sequence is never cut
    assert MicroBatchPolicy(4, 1).count(decode) == 4


def test_micro_batch_policy_from_the_environment(monkeypatch):
    assert MicroBatchPolicy.from_env(1) == MicroBatchPolicy(1)
    assert MicroBatchPolicy.from_env(3) == MicroBatchPolicy(3, 128)
    monkeypatch.setenv("KVPILOT_PP_MICRO_BATCHES", "0")
    with pytest.raises(ValueError, match="must be >= 1"):
        MicroBatchPolicy.from_env(2)


def test_cpu_ranks_share_one_pool_and_gpu_ranks_take_the_minimum():
    ranks = [RankMemory(0, weights_bytes=3 * GiB, activation_bytes=GiB, block_bytes=1 << 20),
             RankMemory(1, weights_bytes=GiB, activation_bytes=GiB, block_bytes=1 << 19)]
    shared = KVCachePlan.build(16 * GiB, 0.5, 16, ranks, shared_memory=True)
    assert shared.num_blocks == (8 * GiB - 6 * GiB) // (3 << 19)  # one pool, summed
    per_device = KVCachePlan.build(16 * GiB, 0.5, 16, ranks, shared_memory=False)
    assert per_device.num_blocks == min((8 - 4) * GiB // (1 << 20), (8 - 2) * GiB // (1 << 19))
    assert per_device.ranks[per_device.limiting].rank == 0
    assert "rank 0 has the fewest blocks" in per_device.describe()
    assert "2 ranks share one memory" in shared.describe()
    single = KVCachePlan.build(16 * GiB, 0.5, 16, ranks[:1], shared_memory=True)
    assert single.describe() == single.budgets[0].describe()
