"""The paged K/V tile loop that the decode and the extend kernels share.

A program holds ROWS query rows (decode: the query heads of one GQA group; extend: a tile
of tokens x heads of one group) that all read the same KV head, and streams that head's
keys and values at positions start .. end - 1 in tiles of BLOCK_N tokens, fetched through
the block table (`slot = block_id * BLOCK_SIZE + offset`), with FlashAttention's online
softmax in base 2 (`qk_scale` includes log2(e)). The caller turns the state into outputs.
Sources: vLLM PagedAttention (SOSP'23); FlashAttention-2 (Dao, 2023).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_kv_online_softmax(
    q, q_pos, K_cache, V_cache, table, kv_head, start, end, qk_scale,
    stride_cb, stride_co, stride_ch, stride_cd, stride_btb,
    ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Returns (m_i [ROWS], l_i [ROWS], acc [ROWS, BLOCK_D]), float32: the running max and
    sum of exp2(score - max), and the unnormalized output; out = acc / l_i.

    q:      [ROWS, BLOCK_D] (already float32 when DOT_FP32), zero past HEAD_DIM
    q_pos:  [ROWS] int, each row's position in its sequence: with CAUSAL a row sees the
            keys at positions <= its own; without CAUSAL it is ignored and every row sees
            every key in start .. end - 1
    table:  pointer to the sequence's row of the block table
    A row that sees no key keeps l_i == 0 and m_i == -inf."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for tile in range(start, end, BLOCK_N):
        pos = tile + offs_n
        n_mask = pos < end
        block_id = tl.load(table + (pos // BLOCK_SIZE) * stride_btb, mask=n_mask, other=0)
        slot = block_id.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_co + kv_head * stride_ch
        # K is loaded transposed, [BLOCK_D, BLOCK_N]. Masked lanes read 0 so that stale
        # (even NaN) cache contents past the sequence's end never reach the sums.
        k = tl.load(K_cache + slot[None, :] + offs_d[:, None] * stride_cd,
                    mask=n_mask[None, :] & d_mask[:, None], other=0.0)
        v = tl.load(V_cache + slot[:, None] + offs_d[None, :] * stride_cd,
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        if CAUSAL:
            s = tl.where((pos[None, :] <= q_pos[:, None]) & n_mask[None, :], s, float("-inf"))
        else:
            s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc
