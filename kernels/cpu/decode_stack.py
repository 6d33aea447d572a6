"""The decode stack's library (csrc/decode_stack.c): every decoder layer of a small decode-only
step, then the final norm, in one C call that calls the other kernels (the GGUF or bf16 matmul,
the fused RoPE/KV-write/attention, RMSNorm, SiLU*mul) through the function pointers of `Model`.
engine/models/cpu_decode_stack.py fills these structs from a model and calls `run`.

One source, two builds: float32 over the GGUF matmul ("decode_stack"), bfloat16 over the bf16
kernel ("decode_stack_bf16", -DKVP_BF16). Source: the per-layer order of vLLM's Llama
(residual stream, fused_add_rms_norm); llama.cpp's ggml graph, which likewise runs a whole
decode step without returning to the host language.
"""

from __future__ import annotations

import ctypes

import torch

from kvpilot.kernels.cpu import attention, bf16_gemm, gguf, norm_act
from kvpilot.kernels.cpu.loader import load as load_library

_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
LIBRARY = {torch.float32: "decode_stack", torch.bfloat16: "decode_stack_bf16"}


class QLinear(ctypes.Structure):
    """kvp_qlinear_t: one linear layer [n outputs, k inputs]: float32, `w` the GGUF blocks (qtype,
    act8); bfloat16, `w` bf16_gemm.pack's copy and `qw` the GGUF blocks (qtype, act8) or None."""

    _fields_ = [("w", _P), ("n", _I), ("k", _I), ("qtype", _I), ("act8", _I), ("qw", _P)]


class Layer(ctypes.Structure):
    """kvp_layer_t: one decoder layer's norm weights, linear layers and KV caches."""

    _fields_ = [("input_norm", _P), ("post_norm", _P), ("input_eps", _D), ("post_eps", _D),
                ("qkv", QLinear), ("o", QLinear), ("gate_up", QLinear), ("down", QLinear),
                ("k_cache", _P), ("v_cache", _P)]


class Model(ctypes.Structure):
    """kvp_model_t: the kernels called, the shapes, the final norm and the RoPE tables; in bfloat16
    also the GGUF matmul (`gguf_kernel`) for layers with GGUF blocks, the most rows it serves
    (0: none) and its float32 scratch of qmax_rows * (the largest k + the largest n) floats."""

    _fields_ = [("matmul", _P), ("norm", _P), ("silu", _P), ("attn", _P),
                ("hidden", _I), ("num_heads", _I), ("num_kv_heads", _I), ("head_dim", _I), ("block_size", _I),
                ("intermediate", _I), ("scale", _D), ("final_norm", _P), ("final_eps", _D),
                ("cos_table", _P), ("sin_table", _P), ("qmatmul", _P), ("qmax_rows", _I), ("qscratch", _P)]


_ARGTYPES = [_P, _P, _I, _P, _P, _I, _P, _P, _P, _I, _P, _P, ctypes.c_int, ctypes.c_int]


def load(dtype: torch.dtype = torch.float32) -> ctypes.CDLL:
    """The glue library for `dtype` (float32 or bfloat16) with `kvp_decode_stack` declared.
    Raises ValueError for another dtype, loader.KernelsNotBuilt where the install built none."""
    if dtype not in LIBRARY:
        raise ValueError(f"the decode stack serves float32 and bfloat16, not {dtype}")
    lib = load_library(LIBRARY[dtype])
    if lib.kvp_decode_stack.argtypes is None:
        lib.kvp_decode_stack.restype = ctypes.c_int
        lib.kvp_decode_stack.argtypes = _ARGTYPES
    return lib


def _fn_ptr(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(lib[name], _P).value  # lib[name]: a fresh handle, whatever wraps lib.name


def gguf_kernel() -> int:
    """Address of `kvp_gguf_matmul` (the bfloat16 stack's matmul for layers with GGUF blocks)."""
    return _fn_ptr(gguf.load(), "kvp_gguf_matmul")


def kernels(dtype: torch.dtype) -> tuple[int, int, int, int]:
    """Addresses of the matmul, RMSNorm, SiLU*mul and fused decode functions the glue calls for
    `dtype` (the first four fields of Model), from this CPU's variant."""
    clib = norm_act.lib(dtype)
    matmul = (gguf_kernel() if dtype == torch.float32
              else _fn_ptr(bf16_gemm.load(), "kvp_bf16_gemm"))
    return (matmul, *(_fn_ptr(clib, attention.kernel_name(base, dtype))
                      for base in ("kvp_rms_norm", "kvp_silu_mul", "kvp_rope_cache_decode")))
