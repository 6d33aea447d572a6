"""Pure-PyTorch paged attention: the CPU backend and the engine's reference behaviour.

Decodes run batched: each sequence's blocks are gathered into a padded [num_decodes,
max_seq_len] view and masked by its length. Prefill/extend chunks run one sequence at a
time; a fresh prefill (nothing cached) attends to its own new K/V without a gather.
Source: vLLM PagedAttention (SOSP'23); the cache layout is in attention/backend.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpilot.engine.attention.backend import AttentionBackend, AttentionMetadata


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Stores key/value [num_tokens, num_kv_heads, head_dim] at flat slots
    slot_mapping [num_tokens] int64 of caches [num_blocks, block_size, num_kv_heads, head_dim]."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _gather(cache: torch.Tensor, block_table: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """cache [NB, BS, KVH, D], block_table [..., >=num_blocks] -> [..., num_blocks*BS, KVH, D].
    index_select over whole blocks as rows: about twice as fast as advanced indexing."""
    nb, bs, kvh, d = cache.shape
    table = block_table[..., :num_blocks]
    rows = cache.view(nb, bs * kvh * d).index_select(0, table.reshape(-1))
    return rows.view(*table.shape[:-1], num_blocks * bs, kvh, d)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, query, key, value, k_cache, v_cache, meta: AttentionMetadata, scale):
        write_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(query)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(query[:nd], k_cache, v_cache, meta, scale)
        starts = meta.query_start_loc_cpu
        for i in range(nd, meta.num_seqs):
            s, e = starts[i], starts[i + 1]
            seq_len, q_len = meta.seq_lens_cpu[i], e - s
            if seq_len == q_len:  # fresh prefill: its own K/V are all there is
                k, v = key[s:e], value[s:e]
                mask = None
            else:
                nb = -(-seq_len // k_cache.shape[1])
                k = _gather(k_cache, meta.block_tables[i], nb)[:seq_len].to(query.dtype)
                v = _gather(v_cache, meta.block_tables[i], nb)[:seq_len].to(query.dtype)
                pos_q = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
                mask = torch.arange(seq_len).unsqueeze(0) <= pos_q  # [q_len, seq_len]
            o = F.scaled_dot_product_attention(
                query[s:e].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True,
            )
            out[s:e] = o.transpose(0, 1)
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale) -> torch.Tensor:
        nd = q.shape[0]
        max_len = max(meta.seq_lens_cpu[:nd])
        nb = -(-max_len // k_cache.shape[1])
        table = meta.block_tables[:nd]
        k = _gather(k_cache, table, nb).to(q.dtype).transpose(1, 2)  # [nd, KVH, L, D]
        v = _gather(v_cache, table, nb).to(q.dtype).transpose(1, 2)
        lens = meta.seq_lens[:nd].unsqueeze(1)
        mask = (torch.arange(k.shape[2], device=q.device).unsqueeze(0) < lens)[:, None, None, :]
        # Slots past a sequence's end hold stale but finite values (the runner zeroes
        # every block before its first use), so masking the scores is enough.
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )
        return o.squeeze(2)
