"""Random paged batches for the kernel tests.

A batch is a list of sequences, each with seq_len tokens of which the last query_len are
this step's new tokens. Physical blocks are a random permutation (so a sequence's blocks
are scattered), block-table padding points at block 0, and every cache slot that holds
no token of the batch is NaN, so a kernel that reads past a sequence's end, or through a
padding entry, produces NaN instead of a plausible number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvpilot.kernels.reference import write_kv_cache_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Max relative error (max |out - ref| / max |ref|) against the float64 reference: the
# output's rounding plus, on GPUs, fp16/bf16 probabilities fed to the tensor cores.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
HEADS = {"mha": (4, 4), "gqa": (6, 2)}  # (num_heads, num_kv_heads); GQA group of 3


@dataclass
class PagedBatch:
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]; context only
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim], the new tokens' K
    value: torch.Tensor
    slot_mapping: torch.Tensor  # [num_tokens] int64, the new tokens' slots
    seq_lens_list: list[int]
    query_lens_list: list[int]

    def write_new_tokens(self) -> None:
        """Puts the new tokens' K/V into the cache with the reference writer."""
        write_kv_cache_ref(self.key, self.value, self.k_cache, self.v_cache, self.slot_mapping)


def make_paged_batch(
    seq_lens: list[int],
    query_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    spare_blocks: int = 2,
) -> PagedBatch:
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    physical = torch.randperm(num_blocks)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq, default=0) + 1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = physical[used : used + n]
        used += n

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    ctx_slots, new_slots = [], []
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        for pos in range(seq_len):
            slot = int(block_tables[i, pos // block_size]) * block_size + pos % block_size
            (ctx_slots if pos < seq_len - q_len else new_slots).append(slot)
    ctx_slots = torch.tensor(ctx_slots, dtype=torch.int64)
    write_kv_cache_ref(
        torch.randn(len(ctx_slots), num_kv_heads, head_dim).to(dtype),
        torch.randn(len(ctx_slots), num_kv_heads, head_dim).to(dtype),
        k_cache, v_cache, ctx_slots,
    )
    num_tokens = sum(query_lens)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    return PagedBatch(
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        query=torch.randn(num_tokens, num_heads, head_dim).to(dtype),
        key=torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype),
        value=torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype),
        slot_mapping=torch.tensor(new_slots, dtype=torch.int64),
        seq_lens_list=list(seq_lens),
        query_lens_list=list(query_lens),
    )


def shuffled(items: list) -> list:
    order = torch.randperm(len(items)).tolist()
    return [items[i] for i in order]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|, NaN if out has any NaN."""
    diff = (out.double() - ref.double()).abs()
    if torch.isnan(diff).any():
        return float("nan")
    return float(diff.max() / ref.double().abs().max().clamp_min(1e-30))


def assert_close_to_ref(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, seed: int) -> None:
    err = rel_err(out, ref)
    bad = torch.isnan(out).any(dim=-1).nonzero().tolist()[:5]
    assert not bad, f"NaN in output rows {bad} (unwritten or stale reads), seed={seed}"
    assert err <= TOLERANCE[dtype], f"relative error {err:.3e} > {TOLERANCE[dtype]:.0e}, seed={seed}"
