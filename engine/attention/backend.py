"""The attention-backend interface: how the model's attention layers read and write the
paged KV cache.

A step's batch is flattened: the query tokens of every scheduled sequence stand one after
another, decodes first (one query token each), then prefill/extend chunks. A chunk of new
tokens attends causally to itself and to the tokens of its sequence already in the cache
(chunked prefill, prefix caching). The model runner builds one `AttentionMetadata` per
step; every layer passes it to its backend with its own layer's cache.

KV-cache layout (per layer, one tensor for K and one for V), as in vLLM's PagedAttention:

    k_cache: [num_blocks, block_size, num_kv_heads, head_dim]

    token t of a sequence lives in block block_table[t // block_size], at offset
    t % block_size; its flat slot is block_id * block_size + offset, and
    slot_mapping[i] is that slot for the i-th query token of the batch.

Every slot of the pool holds a finite value, even slots no sequence owns: the model runner
zeroes block 0 (where block-table padding points) at allocation and every other block
before its first use. A backend may therefore read whole blocks and mask by score alone.

Source: vLLM PagedAttention (Kwon et al., SOSP'23); vLLM v1 `FlashAttentionMetadata`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from kvpilot.engine.layers.rotary_embedding import Rope, apply_rotary


@dataclass
class AttentionMetadata:
    """Per-step description of the flattened batch.

    slot_mapping:    [num_tokens] int64, cache slot of each query token's new K/V.
    query_start_loc: [num_seqs + 1] int32, cumulative query lengths (query_start_loc[0] = 0).
    seq_lens:        [num_seqs] int32, tokens of each sequence in the cache after this
                     step, its new tokens included (num_computed_tokens + num_scheduled).
    block_tables:    [num_seqs, max_num_blocks_per_seq] int32, padded with 0.
    num_decodes:     the first num_decodes sequences have exactly one query token.
    query_start_loc_cpu / query_lens_cpu / seq_lens_cpu: the same values as Python
                     lists, so that backends that loop over sequences need no
                     device-to-host copy.
    backend_state:   per-step scratch: a backend may compute something once, in the
                     first layer, and reuse it in every other layer of the same step.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_decodes: int
    query_start_loc_cpu: list[int]
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    backend_state: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        """Sequences in the step's batch."""
        return len(self.seq_lens_cpu)

    @property
    def num_decode_tokens(self) -> int:
        """Query tokens of the decode rows (one per decode sequence, so num_decodes)."""
        return self.num_decodes

    @property
    def max_query_len(self) -> int:
        """Longest query (new tokens) of any sequence this step; 0 for an empty batch."""
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        """Longest sequence in the cache after this step, new tokens included; 0 for an empty batch."""
        return max(self.seq_lens_cpu, default=0)


class AttentionBackend(ABC):
    """One implementation of paged attention. Stateless: a model holds one instance and
    passes each layer's cache explicitly."""

    name: str = "abstract"

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Writes the new K/V into the cache, then attends.

        query:   [num_tokens, num_heads, head_dim]
        key:     [num_tokens, num_kv_heads, head_dim]  (value likewise)
        k_cache: [num_blocks, block_size, num_kv_heads, head_dim] (v_cache likewise),
                 the cache's dtype (may differ from query's only by backend support)
        scale:   softmax scale, usually head_dim ** -0.5
        returns  [num_tokens, num_heads, head_dim], query's dtype.
        num_heads must be a multiple of num_kv_heads (GQA groups query heads over KV heads).
        """

    def forward_qkv(self, qkv: torch.Tensor, rope: Rope, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, num_heads: int) -> torch.Tensor:
        """The attention of a layer from its fused projection: rotates q and k (rotate-half
        RoPE), then `forward`. A backend may fuse these (the torch backend's C decode kernel).

        qkv:  [num_tokens, num_heads + 2 num_kv_heads, head_dim]: q heads, k heads, v heads
        rope: (cos, sin), each [num_tokens, 1, head_dim / 2], qkv's dtype
        returns [num_tokens, num_heads, head_dim], as `forward`."""
        num_kv_heads = (qkv.shape[1] - num_heads) // 2
        qk = apply_rotary(qkv[:, : num_heads + num_kv_heads], rope)
        q, k = qk.split([num_heads, num_kv_heads], dim=1)
        return self.forward(q, k, qkv[:, num_heads + num_kv_heads :], k_cache, v_cache, meta, scale)
