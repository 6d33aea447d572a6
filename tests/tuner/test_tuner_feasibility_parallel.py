"""Feasibility for parallel sizes: refused sizes carry the engine's own message, and the
KV cache is predicted per rank (its stage's layers, its KV-head shard), from one shared
pool on CPU or the smallest device on GPUs, as the engine sizes it."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvpilot.engine.config import ParallelConfig
from kvpilot.engine.memory import GiB
from kvpilot.engine.distributed.parallel_layout import rank_vocab_params
from kvpilot.tuner.search import feasibility
from kvpilot.tuner.search.feasibility import Hardware, check, estimate_rank_memory, resolve_model
from kvpilot.tuner.search.settings import EngineSettings

SMOL = resolve_model("smollm2-135m-instruct")  # 30 layers, 9 heads, 3 KV heads, bf16
BASE = EngineSettings(max_model_len=1024, max_num_batched_tokens=256, max_num_seqs=8, gpu_memory_utilization=0.5)


def _engine_message(tp: int, pp: int) -> str:
    try:
        ParallelConfig(tp, pp).check_model(SMOL)
    except ValueError as e:
        return str(e)
    raise AssertionError("the engine accepts it")


@pytest.mark.parametrize("tp, pp", [(2, 1), (6, 1), (4, 2), (1, 31)])
def test_sizes_the_engine_refuses_are_infeasible_with_its_message(tp, pp):
    verdict = check(BASE.replace(tensor_parallel_size=tp, pipeline_parallel_size=pp), SMOL,
                    Hardware(64 * GiB, num_devices=64))
    assert not verdict.feasible
    assert verdict.reason == f"engine rule: {_engine_message(tp, pp)}"


def test_uneven_pipeline_stages_are_accepted_as_the_engine_accepts_them():
    verdict = check(BASE.replace(pipeline_parallel_size=4), SMOL, Hardware(64 * GiB, num_devices=4))
    assert verdict.feasible  # 30 layers: stages of 7, 8, 8, 7


def test_per_rank_kv_bytes_follow_the_stage_layers_and_the_head_shard():
    ranks = estimate_rank_memory(BASE, SMOL, ParallelConfig(3, 2))
    per_block = [2 * 15 * 1 * 64 * 2 * 16] * 6  # 15 layers, 1 of 3 KV heads, bf16, 16 tokens
    assert [r.block_bytes for r in ranks] == per_block
    assert sum(r.block_bytes for r in ranks) == 16 * SMOL.kv_bytes_per_token()
    # stage 0 holds the embedding shard, stage 1 its tied copy as LM head
    assert ranks[0].weights_bytes == ranks[3].weights_bytes - 576 * 2


def test_gpus_take_the_tightest_rank_and_cpu_ranks_share_one_pool():
    pp2 = BASE.replace(pipeline_parallel_size=2)
    ranks = estimate_rank_memory(pp2, SMOL, ParallelConfig(1, 2))
    per_device = check(pp2, SMOL, Hardware(2 * GiB, num_devices=2))
    assert per_device.num_blocks == min((GiB - r.weights_bytes - r.activation_bytes) // r.block_bytes for r in ranks)
    shared = check(pp2, SMOL, Hardware(2 * GiB, num_devices=2, shared_memory=True, dtype=torch.bfloat16))
    # a CPU engine in bf16 also holds oneDNN-packed copies of its weights
    cpu_ranks = estimate_rank_memory(pp2, SMOL, ParallelConfig(1, 2), packed_weights=True)
    assert [r.weights_bytes for r in cpu_ranks] == [2 * r.weights_bytes for r in ranks]
    pool = GiB - sum(r.weights_bytes + r.activation_bytes for r in cpu_ranks)
    assert shared.num_blocks == pool // sum(r.block_bytes for r in cpu_ranks)
    # two devices give each rank its own memory: about twice the blocks of one shared pool
    assert per_device.num_blocks > 1.8 * shared.num_blocks
    single_cpu = check(BASE, SMOL, Hardware(2 * GiB, shared_memory=True, dtype=torch.bfloat16))
    (one,) = estimate_rank_memory(BASE, SMOL, ParallelConfig(1, 1))
    assert single_cpu.num_blocks == (GiB - 2 * one.weights_bytes - one.activation_bytes) // one.block_bytes
    assert check(BASE, SMOL, Hardware(2 * GiB)).num_blocks == (GiB - one.weights_bytes - one.activation_bytes) // one.block_bytes


def test_a_pipeline_that_needs_a_copy_of_the_tied_embedding_can_tip_a_tight_cpu_over():
    # one rank: 2 x 257 MiB of bf16 weights (plain + oneDNN-packed) + 7 MiB activation
    # + 180 MiB of KV for 8192 tokens fits in 800 MiB x 0.9; two stages add a 54 MiB
    # embedding copy (twice, packed too) and a second activation
    tight = EngineSettings(max_model_len=8192, max_num_batched_tokens=256, max_num_seqs=8)
    memory = Hardware(800 << 20, num_devices=2, shared_memory=True, dtype=torch.bfloat16)
    assert check(tight, SMOL, memory).feasible
    verdict = check(tight.replace(pipeline_parallel_size=2), SMOL, memory)
    assert not verdict.feasible and "2 ranks share one memory" in verdict.reason


def test_a_cpu_engine_takes_its_kv_space_not_the_whole_machine(monkeypatch):
    # 24 GiB x 0.9 would leave about 20 GiB; the engine caps each rank at VLLM_CPU_KVCACHE_SPACE
    # (4 GiB when unset), in the dtype `--dtype auto` picks (float32 on an AVX2-only CPU)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    fp32 = dataclasses.replace(SMOL, dtype=torch.float32)
    block_bytes = 16 * 2 * 30 * 3 * 64 * 4  # 16 tokens x K,V x 30 layers x 3 KV heads x 64 x fp32
    assert 16 * fp32.kv_bytes_per_token() == block_bytes
    default = check(BASE, SMOL, Hardware(24 * GiB, shared_memory=True, dtype=torch.float32))
    assert default.num_blocks == 4 * GiB // block_bytes == 5825
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert check(BASE, SMOL, Hardware(24 * GiB, shared_memory=True, dtype=torch.float32)).num_blocks == 1456
    explicit = Hardware(24 * GiB, shared_memory=True, dtype=torch.float32, cpu_kvcache_space_bytes=2 * GiB)
    assert check(BASE, SMOL, explicit).num_blocks == 2 * GiB // block_bytes
    # two pipeline stages: each rank holds 15 layers, so each block id costs half per rank
    assert check(BASE.replace(pipeline_parallel_size=2), SMOL,
                 Hardware(24 * GiB, num_devices=2, shared_memory=True, dtype=torch.float32)).num_blocks == 2 * 1456
    # GPUs have no such cap (24 GiB x 0.5: about 11.5 GiB of KV); a small machine is still
    # bounded by its memory budget
    assert check(BASE, SMOL, Hardware(24 * GiB, dtype=torch.float32)).num_blocks > 11 * GiB // block_bytes
    small = check(BASE, SMOL, Hardware(2 * GiB, shared_memory=True, dtype=torch.float32))
    (one,) = estimate_rank_memory(BASE, fp32, ParallelConfig(1, 1))
    head_copy = fp32.vocab_size * fp32.hidden_size * 4  # float32: packed linears replace the plain ones,
    assert fp32.tie_word_embeddings                     # the tied embedding keeps its own beside the LM head's
    assert small.num_blocks == (GiB - one.weights_bytes - head_copy - one.activation_bytes) // block_bytes


def test_cpu_hardware_without_a_dtype_follows_the_engine_auto_rule():
    from kvpilot.engine.cpu.info import choose_cpu_dtype, detect_cpu

    want = choose_cpu_dtype(detect_cpu()).name  # dtypes travel as names in the tuner
    assert Hardware(GiB, shared_memory=True).engine_dtype(SMOL) == want
    assert Hardware(GiB).engine_dtype(SMOL) == SMOL.dtype  # GPUs: the model's dtype


def test_gguf_quantization_adds_its_blocks_to_the_cpu_weights():
    fp32 = dataclasses.replace(SMOL, dtype="float32")
    (dense,) = estimate_rank_memory(BASE, fp32, ParallelConfig(1, 1))
    (quant,) = estimate_rank_memory(BASE, fp32, ParallelConfig(1, 1), gguf_blocks=True)
    # the builtin GGUF: 30 layers of Q4_1 linears (20 bytes / 32 weights) and the Q8_0 LM head (34 / 32)
    linear = 30 * (576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536)
    assert quant.weights_bytes - dense.weights_bytes == int(linear * 20 / 32 + 49152 * 576 * 34 / 32)
    plain = check(BASE, fp32, Hardware(2 * GiB, shared_memory=True, dtype="float32"))
    quantized = check(BASE, fp32, Hardware(2 * GiB, shared_memory=True, dtype="float32", quantization="gguf"))
    assert quantized.num_blocks < plain.num_blocks
    # on a GPU the engine keeps no blocks (the kernel is CPU-only), so nothing changes
    assert check(BASE, fp32, Hardware(2 * GiB, quantization="gguf")).num_blocks == check(BASE, fp32, Hardware(2 * GiB)).num_blocks


def test_float32_on_cpu_counts_every_embedding_and_lm_head_weight_twice():
    """layers/linear.py keeps an embedding's plain weight (the lookup) beside its packed
    copy; with two stages the last one holds its own LM head even when tied (as vLLM does)."""
    fp32 = dataclasses.replace(SMOL, dtype=torch.float32)
    shard = fp32.vocab_size * fp32.hidden_size
    pp2 = ParallelConfig(1, 2)
    assert [rank_vocab_params(fp32, pp2, r) for r in range(2)] == [shard, shard]
    assert rank_vocab_params(fp32, ParallelConfig(1, 1), 0) == shard  # tied on one stage: one weight
    plain = estimate_rank_memory(BASE, fp32, pp2)
    packed = estimate_rank_memory(BASE, fp32, pp2, packed_vocab=True)
    assert [b.weights_bytes - a.weights_bytes for a, b in zip(plain, packed)] == [shard * 4, shard * 4]


@pytest.mark.parametrize("kernel", [False, True], ids=["no-avx512-bf16", "avx512-bf16"])
def test_a_bf16_cpu_engine_holds_a_third_vocab_copy_where_the_bf16_kernel_runs(monkeypatch, kernel):
    # engine/layers/linear.py: with layers/bf16_gemm.py's kernel (AVX512F + AVX512_BF16) the kernel's
    # copy replaces each linear layer's plain weight, and the embedding / LM head keeps its plain
    # weight (the lookup), oneDNN's copy and the kernel's
    monkeypatch.setattr(feasibility, "has_bf16_matmul_kernel", lambda cpu: kernel)
    got = check(BASE, SMOL, Hardware(2 * GiB, shared_memory=True, dtype=torch.bfloat16))
    (one,) = estimate_rank_memory(BASE, SMOL, ParallelConfig(1, 1))
    vocab = rank_vocab_params(SMOL, ParallelConfig(1, 1), 0) * 2 if kernel else 0
    assert got.num_blocks == (GiB - 2 * one.weights_bytes - vocab - one.activation_bytes) // one.block_bytes
