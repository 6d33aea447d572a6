"""Rotate-half rotary position embedding (RoPE), as HF Llama and vLLM's `get_rope` with
is_neox_style=True: the head is split in halves x1, x2 and rotated to
(x1 cos - x2 sin, x2 cos + x1 sin).
Source: Su et al., RoFormer (2021); HF transformers `modeling_llama.py` (rotate_half).
"""

from __future__ import annotations

import torch
from torch import nn

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [num_tokens, 1, head_dim / 2]


def apply_rotary(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim] -> a new tensor of the same shape and dtype."""
    cos, sin = rope
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RotaryEmbedding(nn.Module):
    """A precomputed cos/sin table [max_positions, head_dim / 2] (float32). The model looks
    up a step's positions once (`cos_sin`); each attention layer rotates its q and k heads
    with them (`apply_rotary`, or fused into the CPU decode kernel)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """positions [num_tokens] int64 -> (cos, sin), each [num_tokens, 1, head_dim / 2]."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)
