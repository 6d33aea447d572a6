"""Pure-PyTorch references for the paged-attention kernels: plain loops and dense softmax,
written to be obviously right rather than fast. They compute in the inputs' dtype, so a
test passes float64 copies to get the exact answer a kernel is compared with.

Cache layout (see engine/attention/backend.py):
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    token t of a sequence is at block_table[t // block_size], offset t % block_size.

Sources: vLLM PagedAttention (Kwon et al., SOSP'23) for the paged layout; the causal rule
for a chunk of new tokens over a cached prefix as in vLLM's chunked prefill.
"""

from __future__ import annotations

import torch


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes key[i] and value[i] into flat slot slot_mapping[i] of the caches, in place.

    key, value:   [num_tokens, num_kv_heads, head_dim]
    k_cache:      [num_blocks, block_size, num_kv_heads, head_dim] (v_cache likewise)
    slot_mapping: [num_tokens] integer; slot = block_id * block_size + offset; a negative
                  slot skips its token (padding).
    Values are cast to the cache's dtype.
    """
    block_size = k_cache.shape[1]
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    slots = slots[keep]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


def gather_kv_ref(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len tokens of one sequence, in order: [seq_len, num_kv_heads, head_dim].

    cache: [num_blocks, block_size, num_kv_heads, head_dim]; block_table: [max_blocks] int.
    """
    positions = torch.arange(seq_len, device=cache.device)
    blocks = block_table.to(torch.int64)[positions // cache.shape[1]]
    return cache[blocks, positions % cache.shape[1]]


def causal_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Dense attention of the last q_len positions of a sequence over all of its kv_len
    positions: query i sits at position kv_len - q_len + i and sees keys 0..that position.

    q: [q_len, num_heads, head_dim]; k, v: [kv_len, num_kv_heads, head_dim], kv_len >= q_len.
    returns [q_len, num_heads, head_dim], q's dtype. GQA: query head h reads KV head
    h // (num_heads // num_kv_heads).
    """
    q_len, num_heads, _ = q.shape
    kv_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
    k_pos = torch.arange(kv_len, device=q.device)
    visible = k_pos[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One new query token per sequence over its whole paged cache (new token included).

    q:            [num_seqs, num_heads, head_dim]
    block_tables: [num_seqs, max_num_blocks_per_seq]; seq_lens: [num_seqs], each >= 1
    returns       [num_seqs, num_heads, head_dim], q's dtype.
    """
    out = torch.empty_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        k = gather_kv_ref(k_cache, block_tables[i], seq_len)
        v = gather_kv_ref(v_cache, block_tables[i], seq_len)
        out[i] = causal_attention_ref(q[i : i + 1], k, v, scale)[0]
    return out


def paged_extend_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Each sequence's chunk of new query tokens attends causally to itself and to the
    sequence's earlier tokens; the chunk's own K/V are already in the cache.

    q:               [num_tokens, num_heads, head_dim], the chunks one after another
    query_start_loc: [num_seqs + 1]; sequence i's queries are rows
                     query_start_loc[i] : query_start_loc[i + 1] of q
    seq_lens:        [num_seqs], tokens in the cache including the chunk (>= chunk length)
    returns          [num_tokens, num_heads, head_dim], q's dtype; rows outside every
                     chunk are zero.
    """
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[i], starts[i + 1]
        k = gather_kv_ref(k_cache, block_tables[i], seq_len)
        v = gather_kv_ref(v_cache, block_tables[i], seq_len)
        out[lo:hi] = causal_attention_ref(q[lo:hi], k, v, scale)
    return out
