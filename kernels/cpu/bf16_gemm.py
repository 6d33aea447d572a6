"""Decode-sized bfloat16 matmuls on CPUs with AVX512_BF16: our own kernel (csrc/bf16_gemm.c)
instead of oneDNN's for steps of a few rows (any row count runs; up to how many the engine sends
it is the engine's row-limit table, engine/cpu/row_limits.py); on CPUs with AMX the same packed
copy feeds AMX tiles (`amx()`).

Why: at the row counts of a decode step oneDNN's bf16 matmuls read the 135M model's 212 MB of
layer weights at 16-22 GB/s on a 2-core Zen 4 EPYC where a plain read runs at ~30 GB/s
(section 15 of `git show bbe6366:benchmarks/results/throughput/README.md`). The kernel streams a packed
copy of each weight (`pack`: the same bytes in `vdpbf16ps` order, kept beside oneDNN's, which
still serves prefill-sized matmuls) once per call, its row tiles reusing each 64-column group
from L2. Arithmetic: exact bf16 products, float32 sums, one rounding to bf16 (as oneDNN's).

Runs in the avx512_bf16 and amx variants (`simd()`); whether the engine uses it on a CPU is
decided by engine/cpu/kernel_path.py. Other variants hold the same layout in plain C (tests
check the layout with it on any CPU).
Source: Intel SDM (VDPBF16PS); the packing is BLIS's (Van Zee and van de Geijn, 2015).
"""

from __future__ import annotations

import ctypes

import torch

from kvpilot.kernels.cpu.loader import kernel_range
from kvpilot.kernels.cpu.loader import load as load_library

GROUP = 64  # output columns per packed group: 4 vectors of 16 float32 lanes


def load(variant: str | None = None) -> ctypes.CDLL:
    """The library of this CPU's variant (or `variant`) with its argument types set.
    Raises loader.KernelsNotBuilt where the install built no kernels."""
    lib = load_library("bf16_gemm", variant)
    if lib.kvp_bf16_gemm.argtypes is None:
        p, i = ctypes.c_void_p, ctypes.c_int64
        lib.kvp_bf16_gemm.restype = None
        lib.kvp_bf16_gemm.argtypes = [p, i, p, p, i, i, i, i, i]
        lib.kvp_bf16_gemm_simd.restype = ctypes.c_int
        lib.kvp_bf16_gemm_amx.restype = ctypes.c_int
    return lib


def simd(variant: str | None = None) -> bool:
    """Whether the loaded variant runs the AVX512_BF16 kernel (vdpbf16ps), not the plain-C loop."""
    return bool(load(variant).kvp_bf16_gemm_simd())


def amx(variant: str | None = None) -> bool:
    """Whether the loaded variant serves the kernel with AMX tiles (TDPBF16PS on the same packed
    layout): the amx build, on a Linux kernel that grants the process the tile state."""
    return bool(load(variant).kvp_bf16_gemm_amx())


def supports(weight: torch.Tensor) -> bool:
    """Whether `weight` [N, K] can be packed: bf16 on CPU, N a multiple of 64, K even."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[0] % GROUP == 0 and weight.shape[1] % 2 == 0)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 -> the kernel's layout, a new contiguous [N * K] bf16 tensor:
    packed[g][p][j][i][e] = weight[64 g + 16 j + i][2 p + e]. Raises ValueError where
    `supports(weight)` is false."""
    if not supports(weight):
        raise ValueError(f"bf16_gemm.pack: need a bf16 CPU weight [N, K], N % {GROUP} == 0, K even; "
                         f"got {tuple(weight.shape)} {weight.dtype} on {weight.device}")
    n, k = weight.shape
    return weight.reshape(n // GROUP, 4, 16, k // 2, 2).permute(0, 3, 1, 2, 4).contiguous().reshape(-1)


def matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] bf16 CPU, rows contiguous -> x weight^T [M, out_features] bf16, a new tensor, for
    packed = pack(weight [out_features, K]). Uses torch.get_num_threads() threads. Raises
    ValueError on mismatched shapes or dtypes, loader.KernelsNotBuilt where the install built no
    kernels."""
    lib = load()
    m, k = x.shape
    if (x.dtype != torch.bfloat16 or packed.dtype != torch.bfloat16 or x.stride(1) != 1 or k % 2
            or out_features % GROUP or packed.numel() != out_features * k or not packed.is_contiguous()):
        raise ValueError(f"bf16_gemm.matmul: bad shapes/dtypes x {tuple(x.shape)} {x.dtype} stride {x.stride()}, "
                         f"packed {packed.numel()} {packed.dtype} for {out_features} outputs")
    out = torch.empty(m, out_features, dtype=torch.bfloat16)
    if m:
        with kernel_range("bf16_matmul"):
            lib.kvp_bf16_gemm(x.data_ptr(), x.stride(0), packed.data_ptr(), out.data_ptr(), out_features, m,
                              out_features, k, torch.get_num_threads())
    return out
