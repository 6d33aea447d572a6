"""Paged decode attention with split-KV ("flash decoding") and grouped query heads.

Decode is memory-bound: each sequence reads its whole KV cache for one query token. With
few sequences there are too few programs to fill a GPU, so the KV range of a sequence is
cut into NUM_SPLITS contiguous parts, read in parallel (stage 1), and the partial results
are merged by their log-sum-exp (stage 2). Each stage-1 program serves all the query heads
of one KV head (GQA), so a KV tile is loaded once for the whole group.

    stage 1, grid (num_seqs, num_kv_heads, NUM_SPLITS):
        online softmax over the split's tokens -> mid_o [.., head_dim] = acc / l,
                                                  mid_lse = m + log2(l)  (base 2)
    stage 2, grid (num_seqs, num_heads):
        out = sum_s 2^(lse_s - max) * mid_o_s / sum_s 2^(lse_s - max)

With one split, stage 1 writes the output directly and stage 2 is skipped.
Sources: vLLM PagedAttention (SOSP'23) for the paged cache; FlashAttention's online
softmax (Dao et al. 2022) and Flash-Decoding (Dao et al. 2023) for the split-KV merge.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels._common import (
    check_devices,
    check_out,
    check_paged_attention_args,
    dot_options,
    is_interpreted,
    kv_tile,
    pow2_at_least,
)
from kvpilot.kernels.paged_tiles import paged_kv_online_softmax

_FN = "paged_decode_attention"
_LOG2E = 1.4426950408889634
_MAX_SPLITS = 16
_MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost outweighs its parallelism
_TARGET_PROGRAMS = 256  # about two waves of an H100's 132 SMs


@triton.jit
def _decode_split_kernel(
    Q, K_cache, V_cache, Block_tables, Seq_lens, Out, Mid_o, Mid_lse, qk_scale,
    stride_qs, stride_qh, stride_qd,
    stride_cb, stride_co, stride_ch, stride_cd,
    stride_bts, stride_btb,
    stride_os, stride_oh, stride_od,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(Seq_lens + seq).to(tl.int32)
    # Splits start on tile boundaries so that every split but the last reads whole tiles.
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(Q + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i, l_i, acc = paged_kv_online_softmax(
        q, offs_g, K_cache, V_cache, Block_tables + seq * stride_bts, kv_head, start, end, qk_scale,
        stride_cb, stride_co, stride_ch, stride_cd, stride_btb,
        ROWS=BLOCK_G, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N, CAUSAL=False,
        DOT_FP32=DOT_FP32, DOT_PRECISION=DOT_PRECISION)

    # An empty split (a short sequence) has l_i == 0: it writes o = 0, lse = -inf and so
    # gets zero weight in stage 2.
    nonempty = l_i > 0
    l_safe = tl.where(nonempty, l_i, 1.0)
    o = acc / l_safe[:, None]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(Out + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 o.to(Out.dtype.element_ty), mask=out_mask)
    else:
        # Mid_o: [num_seqs, num_heads, NUM_SPLITS, HEAD_DIM], Mid_lse: [.., NUM_SPLITS], contiguous.
        row = (seq * (tl.num_programs(1) * GROUP) + heads) * NUM_SPLITS + split
        tl.store(Mid_o + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=out_mask)
        lse = tl.where(nonempty, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(Mid_lse + row, lse, mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    Mid_o, Mid_lse, Out,
    stride_os, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM

    row = (seq * tl.num_programs(1) + head) * NUM_SPLITS
    lse = tl.load(Mid_lse + row + offs_s, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    # All splits empty only for seq_len == 0; keep the output finite (zero) then.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp2(lse - lse_max)
    o = tl.load(Mid_o + (row + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(Out + seq * stride_os + head * stride_oh + offs_d * stride_od,
             out.to(Out.dtype.element_ty), mask=d_mask)


def choose_num_kv_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Splits per sequence: enough programs to fill the GPU, but no split shorter than
    _MIN_TOKENS_PER_SPLIT tokens and at most _MAX_SPLITS. A power of two, because the
    count is a compile-time constant: a step's batch shape then picks one of five
    compiled variants."""
    by_length = triton.cdiv(max(max_seq_len, 1), _MIN_TOKENS_PER_SPLIT)
    by_occupancy = triton.cdiv(_TARGET_PROGRAMS, max(num_seqs * num_kv_heads, 1))
    return min(_MAX_SPLITS, triton.next_power_of_2(min(by_length, by_occupancy)))


def _check_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, num_kv_splits: int | None) -> tuple[int, int, int, int, bool]:
    """(block_size, num_kv_heads, head_dim, group, interpreted); ValueError on a mismatch."""
    block_size, num_kv_heads, head_dim, group = check_paged_attention_args(
        _FN, q, k_cache, v_cache, block_tables, seq_lens, q.shape[0], "[num_seqs, num_heads, head_dim]")
    interpreted = is_interpreted(_decode_split_kernel)
    check_devices(_FN, interpreted, q=q, k_cache=k_cache, v_cache=v_cache,
                  block_tables=block_tables, seq_lens=seq_lens)
    if num_kv_splits is not None and not 1 <= num_kv_splits <= 256:
        raise ValueError(f"{_FN}: num_kv_splits must be in [1, 256], got {num_kv_splits}")
    return block_size, num_kv_heads, head_dim, group, interpreted


def _split_buffers(out: torch.Tensor, num_kv_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1's partial outputs [num_seqs, num_heads, splits, head_dim] and log-sum-exps
    [num_seqs, num_heads, splits], float32; with one split `out` (the kernel ignores them)."""
    if num_kv_splits == 1:
        return out, out
    num_seqs, num_heads, head_dim = out.shape
    mid_o = torch.empty((num_seqs, num_heads, num_kv_splits, head_dim), dtype=torch.float32, device=out.device)
    mid_lse = torch.empty((num_seqs, num_heads, num_kv_splits), dtype=torch.float32, device=out.device)
    return mid_o, mid_lse


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    num_kv_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged KV cache.

    q:             [num_seqs, num_heads, head_dim], float16/bfloat16/float32 (any strides)
    k_cache:       [num_blocks, block_size, num_kv_heads, head_dim], q's dtype (v_cache
                   likewise); the new token's K/V must already be written
    block_tables:  [num_seqs, max_num_blocks_per_seq] int32/int64, padding entries unused
    seq_lens:      [num_seqs] int32/int64, tokens in the cache including the new one (>= 1)
    scale:         softmax scale, usually head_dim ** -0.5
    max_seq_len:   max(seq_lens) if the caller knows it on the host (saves a device sync);
                   used only to choose the number of splits
    num_kv_splits: KV splits per sequence (None: chosen from the batch's shape)
    out:           optional [num_seqs, num_heads, head_dim] output buffer, q's dtype
    returns        [num_seqs, num_heads, head_dim], q's dtype.
    num_heads must be a multiple of num_kv_heads: head h reads KV head h // group.
    Raises ValueError on mismatched shapes, dtypes or devices.
    Sources: vLLM PagedAttention (SOSP'23); FlashAttention online softmax; Flash-Decoding.
    """
    block_size, num_kv_heads, head_dim, group, interpreted = _check_args(q, k_cache, v_cache, block_tables,
                                                                         seq_lens, num_kv_splits)
    num_seqs, num_heads, _ = q.shape
    out = check_out(_FN, out, q)
    if num_seqs == 0:
        return out

    if num_kv_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        num_kv_splits = choose_num_kv_splits(num_seqs, num_kv_heads, max_seq_len)
    mid_o, mid_lse = _split_buffers(out, num_kv_splits)
    block_d = pow2_at_least(head_dim)
    block_n, num_stages = kv_tile(q.element_size(), block_d)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_kv_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, mid_o, mid_lse, scale * _LOG2E,
        *q.stride(), *k_cache.stride(), *block_tables.stride(), *out.stride(),
        GROUP=group, BLOCK_G=pow2_at_least(group), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_kv_splits,
        **dot_options(q.dtype, interpreted), num_warps=4, num_stages=num_stages,
    )
    if num_kv_splits > 1:
        _decode_merge_kernel[(num_seqs, num_heads)](
            mid_o, mid_lse, out, *out.stride(), HEAD_DIM=head_dim, BLOCK_D=block_d,
            NUM_SPLITS=num_kv_splits, BLOCK_S=triton.next_power_of_2(num_kv_splits), num_warps=4,
        )
    return out
