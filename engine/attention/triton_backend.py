"""Paged attention on Triton kernels: the default backend on CUDA (`--attention-backend
triton`). It also runs on the CPU under TRITON_INTERPRET=1, slowly, which is how its tests
check it without a GPU.

A step is three launches at most: the KV-cache write for every new token, split-KV decode
attention for the leading decodes, and extend attention for the prefill/extend chunks
after them, each writing its own rows of one output tensor.
Sources: vLLM PagedAttention (SOSP'23); FlashAttention's online softmax; the kernels are
in kvpilot.kernels.
"""

from __future__ import annotations

import torch

from kvpilot.engine.attention.backend import AttentionBackend, AttentionMetadata
from kvpilot.kernels.cache_write import write_kv_cache
from kvpilot.kernels.decode_attention import paged_decode_attention
from kvpilot.kernels.extend_attention import paged_extend_attention


class TritonAttentionBackend(AttentionBackend):
    """Writes the step's K/V with `write_kv_cache`, then runs `paged_decode_attention` on
    the first meta.num_decodes tokens and `paged_extend_attention` on the rest.

    query [num_tokens, num_heads, head_dim] and the caches must share a dtype (float16,
    bfloat16 or float32) and a device; the kernels raise ValueError otherwise."""

    name = "triton"

    def forward(self, query, key, value, k_cache, v_cache, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """AttentionBackend.forward (shapes and dtypes there)."""
        write_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        nd = meta.num_decodes
        if nd:
            paged_decode_attention(
                query[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                max_seq_len=max(meta.seq_lens_cpu[:nd]), out=out[:nd],
            )
        if meta.num_seqs > nd:
            # Offsets stay absolute rows of `query`, so the kernel writes the chunks' rows
            # of `out` in place, after the decodes'.
            paged_extend_attention(
                query, k_cache, v_cache, meta.block_tables[nd:], meta.query_start_loc[nd:],
                meta.seq_lens[nd:], scale, max_query_len=max(meta.query_lens_cpu[nd:]), out=out,
            )
        return out
