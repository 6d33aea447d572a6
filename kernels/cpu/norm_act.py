"""RMSNorm (with vLLM's fused residual add) and SiLU-and-mul for float32 or bfloat16 CPU rows,
each one call of the attention library (csrc/layernorm.c, csrc/activation.c) instead of 3-10
small torch ops (bf16: stored values widened to float32 for the math, rounded back as HF's
Llama rounds them). The callers (engine/layers/layernorm.py, activation.py) use them where the
engine's kernel path says so (engine/cpu/kernel_path.py).
Source: vLLM csrc/layernorm_kernels.cu (fused_add_rms_norm) and
csrc/activation_kernels.cu (silu_and_mul), for the semantics.
"""

from __future__ import annotations

import ctypes

import torch

from kvpilot.kernels.cpu import attention as cpu_decode
from kvpilot.kernels.cpu.loader import kernel_range

_P, _I = ctypes.c_void_p, ctypes.c_int64


def lib(dtype: torch.dtype = torch.float32) -> ctypes.CDLL:
    """The CPU kernel library for `dtype` with the argument types of its layer functions set.
    Raises loader.KernelsNotBuilt where the install built no kernels."""
    lib = cpu_decode.load(dtype)
    if not getattr(lib, "_kvp_layer_ops", False):
        norm = getattr(lib, cpu_decode.kernel_name("kvp_rms_norm", dtype))
        norm.restype = None
        norm.argtypes = [_P, _P, _P, _P, _I, _I, ctypes.c_float]
        silu = getattr(lib, cpu_decode.kernel_name("kvp_silu_mul", dtype))
        silu.restype = None
        silu.argtypes = [_P, _P, _I, _I]
        lib._kvp_layer_ops = (norm, silu)
    return lib


def usable(x: torch.Tensor) -> bool:
    """Whether x [rows, features] can go to the C ops: float32 or bfloat16, CPU, contiguous."""
    return x.dtype in cpu_decode.SUFFIX and x.device.type == "cpu" and x.is_contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """CPU rows x [rows, hidden], contiguous (check `usable`), weight [hidden] of x's dtype.
    Without residual: returns rms_norm(x) * weight, a new tensor. With residual [rows,
    hidden] (vLLM's fused_add_rms_norm, in place): residual += x, then x = rms_norm(residual)
    * weight; returns x. Raises ValueError on mismatched shapes or dtypes."""
    rows, hidden = x.shape
    if (weight.shape != (hidden,) or weight.dtype != x.dtype or not weight.is_contiguous()
            or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                          or not residual.is_contiguous()))):
        raise ValueError(f"rms_norm: bad shapes/dtypes x {tuple(x.shape)}, weight {tuple(weight.shape)} "
                         f"{weight.dtype}, residual {None if residual is None else tuple(residual.shape)}")
    out = x if residual is not None else torch.empty_like(x)
    with kernel_range("rms_norm"):
        lib(x.dtype)._kvp_layer_ops[0](x.data_ptr(), None if residual is None else residual.data_ptr(),
                                       weight.data_ptr(), out.data_ptr(), rows, hidden, eps)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [rows, 2 * d] float32 or bfloat16 CPU contiguous (gate | up; check `usable`) ->
    silu(gate) * up [rows, d], a new tensor."""
    rows, two_d = x.shape
    out = torch.empty(rows, two_d // 2, dtype=x.dtype)
    with kernel_range("silu_mul"):
        lib(x.dtype)._kvp_layer_ops[1](x.data_ptr(), out.data_ptr(), rows, two_d // 2)
    return out
