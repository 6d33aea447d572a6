"""RMSNorm with vLLM's fused residual add: `norm(x)` -> normed; `norm(x, residual)` ->
(normed, residual + x), so the decoder layer's residual stream costs no separate add.
On float32 or bfloat16 CPU one C call does both (kvpilot.kernels.cpu.norm_act); elsewhere torch's F.rms_norm.
Source: Zhang & Sennrich, RMSNorm (2019); vLLM `vllm/model_executor/layers/layernorm.py`;
HF `LlamaRMSNorm` for float32 statistics.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.kernels.cpu import norm_act as cpu_ops


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension (`size`), weight [size] in
    `dtype`, statistics in float32; with a residual, the add is fused (module docstring)."""

    use_c_kernel = True  # False: the torch path even where the C op serves (comparisons)

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [rows, hidden] -> normed [rows, hidden]; with residual [rows, hidden] ->
        (normed, residual + x). The C path writes the sum into `residual` and the normed
        rows into `x` (both owned by the caller, as in vLLM's fused_add_rms_norm)."""
        if self.use_c_kernel and cpu_ops.usable(x):
            out = cpu_ops.rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is not None:
            residual = x + residual
            return self._torch(residual), residual
        return self._torch(x)

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        # float32 statistics, as HF's LlamaRMSNorm, so bf16 runs stay close to it; one fused
        # F.rms_norm in float32 (bit-identical to HF's six elementwise ops).
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)
