"""SiLU-and-mul over the fused gate/up projection (vLLM's SiluAndMul): x [rows, 2 d] ->
silu(x[:, :d]) * x[:, d:]; one C call on float32 or bfloat16 CPU (kvpilot.kernels.cpu.norm_act), torch elsewhere.
Source: vLLM `vllm/model_executor/layers/activation.py`; Shazeer, GLU variants (2020).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.kernels.cpu import norm_act as cpu_ops


class SiluAndMul(nn.Module):
    """SwiGLU's activation over the fused gate/up output (module docstring); no parameters."""

    use_c_kernel = True  # False: the torch path even where the C op serves (comparisons)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, 2 d] -> silu(x[:, :d]) * x[:, d:], [rows, d], x's dtype; the C op on float32 or
        bfloat16 CPU tensors, torch otherwise."""
        if self.use_c_kernel and cpu_ops.usable(x):
            return cpu_ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
