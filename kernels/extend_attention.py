"""Prefill/extend attention over the paged KV cache.

A sequence's chunk of q_len new tokens attends causally to itself and to the ctx_len
tokens of the sequence already in the cache (ctx_len = seq_len - q_len): query i sits at
position ctx_len + i and sees keys 0 .. ctx_len + i. This one rule covers a plain prefill
(ctx_len = 0), chunked prefill (later chunks of a long prompt) and prefix caching (the
prefix's blocks are shared and already filled). The chunk's own K/V are written into the
cache before the call, so every key is read through the block table the same way.

    grid (num_seqs, num_kv_heads, cdiv(max_query_len, BLOCK_Q)):
        a tile of BLOCK_M = BLOCK_Q tokens x GROUP query heads (one GQA group, so each
        K/V tile is loaded once for the group) streams the KV tiles it can see, up to its
        last token's position, with FlashAttention's online softmax.

Sources: vLLM PagedAttention (SOSP'23) for the paged cache and chunked prefill;
FlashAttention-2 (Dao, 2023) for the tiled online softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.kernels._common import (
    INDEX_DTYPES,
    check_devices,
    check_dtype,
    check_out,
    check_paged_attention_args,
    check_shape,
    dot_options,
    is_interpreted,
    kv_tile,
    pow2_at_least,
)
from kvpilot.kernels.paged_tiles import paged_kv_online_softmax

_FN = "paged_extend_attention"
_LOG2E = 1.4426950408889634


@triton.jit
def _extend_kernel(
    Q, K_cache, V_cache, Block_tables, Query_start_loc, Seq_lens, Out, qk_scale,
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_co, stride_ch, stride_cd,
    stride_bts, stride_btb,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    q_block = tl.program_id(2)

    q_start = tl.load(Query_start_loc + seq).to(tl.int64)
    q_len = (tl.load(Query_start_loc + seq + 1) - q_start).to(tl.int32)
    if q_block * BLOCK_Q >= q_len:  # this sequence's chunk is shorter than the grid
        return
    seq_len = tl.load(Seq_lens + seq).to(tl.int32)
    ctx_len = seq_len - q_len

    # Row r of the tile is query token q_block * BLOCK_Q + r // GROUP of head
    # kv_head * GROUP + r % GROUP: the GQA group shares every K/V tile it loads.
    offs_r = tl.arange(0, BLOCK_M)
    offs_q = q_block * BLOCK_Q + offs_r // GROUP
    heads = kv_head * GROUP + offs_r % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    r_mask = (offs_r < BLOCK_Q * GROUP) & (offs_q < q_len)
    d_mask = offs_d < HEAD_DIM
    q_pos = ctx_len + offs_q
    q_rows = (q_start + offs_q)[:, None] * stride_qt + heads[:, None] * stride_qh
    q = tl.load(Q + q_rows + offs_d[None, :] * stride_qd,
                mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    # The tile's last query token sees up to its own position; nothing after it is read.
    # Every row, padding rows included, sees position 0, so the row max is finite from the
    # first tile on and exp2(-inf - m) is a clean 0.
    kv_end = tl.minimum(seq_len, ctx_len + (q_block + 1) * BLOCK_Q)
    m_i, l_i, acc = paged_kv_online_softmax(
        q, q_pos, K_cache, V_cache, Block_tables + seq * stride_bts, kv_head, 0, kv_end, qk_scale,
        stride_cb, stride_co, stride_ch, stride_cd, stride_btb,
        ROWS=BLOCK_M, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N, CAUSAL=True,
        DOT_FP32=DOT_FP32, DOT_PRECISION=DOT_PRECISION)

    o = acc / l_i[:, None]
    out_rows = (q_start + offs_q)[:, None] * stride_ot + heads[:, None] * stride_oh
    tl.store(Out + out_rows + offs_d[None, :] * stride_od,
             o.to(Out.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


def _tile_rows(max_query_len: int, group: int, row_bytes: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): tile rows, and query tokens per tile (BLOCK_M // group).
    Long chunks get 64 rows (32 for rows over 512 bytes, to bound shared memory); short
    ones (decode-like) the smallest tile that holds them."""
    block_m = min(64 if row_bytes <= 512 else 32, pow2_at_least(max_query_len * group))
    block_m = max(block_m, pow2_at_least(group))
    return block_m, block_m // group


def _check_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> tuple[int, int, int, int, bool]:
    """(block_size, num_kv_heads, head_dim, group, interpreted); ValueError on a mismatch."""
    check_shape(_FN, "seq_lens", seq_lens, (None,), "[num_seqs]")
    num_seqs = seq_lens.shape[0]
    block_size, num_kv_heads, head_dim, group = check_paged_attention_args(
        _FN, q, k_cache, v_cache, block_tables, seq_lens, num_seqs, "[num_tokens, num_heads, head_dim]")
    check_shape(_FN, "query_start_loc", query_start_loc, (num_seqs + 1,), "[num_seqs + 1]")
    check_dtype(_FN, "query_start_loc", query_start_loc, INDEX_DTYPES)
    interpreted = is_interpreted(_extend_kernel)
    check_devices(_FN, interpreted, q=q, k_cache=k_cache, v_cache=v_cache,
                  block_tables=block_tables, query_start_loc=query_start_loc, seq_lens=seq_lens)
    return block_size, num_kv_heads, head_dim, group, interpreted


def paged_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's chunk of new tokens over its paged KV cache.

    q:               [num_tokens, num_heads, head_dim], float16/bfloat16/float32 (any
                     strides); sequence i's queries are rows
                     query_start_loc[i] : query_start_loc[i + 1]
    k_cache:         [num_blocks, block_size, num_kv_heads, head_dim], q's dtype (v_cache
                     likewise), with the chunks' own K/V already written
    block_tables:    [num_seqs, max_num_blocks_per_seq] int32/int64
    query_start_loc: [num_seqs + 1] int32/int64, non-decreasing row offsets into q; need
                     not start at 0 (a slice of the engine's, after its decodes)
    seq_lens:        [num_seqs] int32/int64, cached tokens including the chunk, each >= the
                     chunk's length
    scale:           softmax scale, usually head_dim ** -0.5
    max_query_len:   the longest chunk, if the caller knows it on the host (saves a sync)
    out:             optional [num_tokens, num_heads, head_dim] buffer, q's dtype; only the
                     rows of the chunks are written
    returns          out, [num_tokens, num_heads, head_dim], q's dtype.
    num_heads must be a multiple of num_kv_heads: head h reads KV head h // group.
    Raises ValueError on mismatched shapes, dtypes or devices.
    Sources: vLLM PagedAttention (SOSP'23); FlashAttention-2 online softmax.
    """
    block_size, num_kv_heads, head_dim, group, interpreted = _check_args(q, k_cache, v_cache, block_tables,
                                                                         query_start_loc, seq_lens)
    num_seqs = seq_lens.shape[0]
    out = check_out(_FN, out, q)
    if num_seqs == 0 or q.shape[0] == 0:
        return out

    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len <= 0:
        return out
    block_d = pow2_at_least(head_dim)
    block_n, num_stages = kv_tile(q.element_size(), block_d)
    block_m, block_q = _tile_rows(max_query_len, group, q.element_size() * block_d)
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q))
    _extend_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, scale * _LOG2E,
        *q.stride(), *k_cache.stride(), *block_tables.stride(), *out.stride(),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        **dot_options(q.dtype, interpreted), num_warps=4, num_stages=num_stages,
    )
    return out
