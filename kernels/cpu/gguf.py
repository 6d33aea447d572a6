"""y = x W^T for W kept in GGUF's Q4_1 or Q8_0 blocks, in plain C (AVX2 where the CPU
has it, a scalar loop in the generic variant; csrc/gguf.c), called through ctypes; float32
activations, or (the default of
`--quantization gguf`, as vLLM's GGUF path) activations quantized to 8-bit blocks. Where the amx
build runs with the tile state granted (`amx()`), the blocks repacked once by `amx_pack` (same
bytes, csrc/gguf_amx.c) take the 8-bit products of several rows on AMX tiles (TDPBSUD / TDPBSSD),
as llama.cpp's AMX backend does.

Why: one decode step at batch 1 reads every weight once, so its time is the weight bytes
over the memory bandwidth. Q4_1 takes 20 bytes per 32 weights (6.4x fewer than float32)
and Q8_0 34 bytes. The blocks are dequantized in registers, never in memory, as llama.cpp's
CPU `ggml_vec_dot_*` and vLLM's `ggml_mul_mat_vec_a8` (GGUF, batch <= 8) do.
activations="q8_1" (their way) quantizes each activation row to blocks of 32
int8 with a float scale and runs integer dot products: 3-4x fewer instructions per block,
results within the activations' 8-bit rounding. activations="float32" keeps x in float32,
so results differ from the dense float32 matmul only by rounding order; per block of 32
with scale d and minimum m:
  Q4_1: w_j = d * q_j + m, q_j in 0..15, q_j = qs[j] & 15, q_{j+16} = qs[j] >> 4;
        sum_j x_j w_j = d * sum_j x_j q_j + m * sum_j x_j
  Q8_0: w_j = d * q_j, q_j int8;  sum_j x_j w_j = d * sum_j x_j q_j
Block layouts (ggml-common.h): Q4_1 = {f16 d, f16 m, u8 qs[16]} (20 bytes), Q8_0 = {f16 d,
i8 qs[32]} (34 bytes). Chunks of rows (output features) are shared out over torch's own
OpenMP team (built with -fopenmp; the library's libgomp.so.1 is, by soname, the one torch
loaded), so one call costs no Python thread hand-off and a step that mixes these matmuls with
torch's keeps one set of threads; ctypes releases the GIL during the call.
"""

from __future__ import annotations

import ctypes

import torch

from kvpilot.kernels.cpu.loader import kernel_range
from kvpilot.kernels.cpu.loader import load as load_library

# GGML type numbers (gguf.GGMLQuantizationType) -> bytes per block of 32 weights; Q4_1_AMX and Q8_0_AMX
# (our numbers) are the same blocks in csrc/gguf_amx.c's layout for AMX tiles (`amx_pack`), as many bytes
Q4_1, Q8_0 = 3, 8
Q4_1_AMX, Q8_0_AMX = 103, 108
BLOCK_WEIGHTS = 32
BLOCK_BYTES = {Q4_1: 20, Q8_0: 34, Q4_1_AMX: 20, Q8_0_AMX: 34}
AMX_LAYOUT = {Q4_1: Q4_1_AMX, Q8_0: Q8_0_AMX}

# Activation formats: "q8_1" (8-bit blocks, integer dot products) or "float32" (exact x).
ACTIVATIONS = ("q8_1", "float32")


def load(variant: str | None = None) -> ctypes.CDLL:
    """The library of this CPU's variant (or `variant`: "generic" holds the scalar loops, the
    others the AVX2 ones) with its functions declared. Raises loader.KernelsNotBuilt where the
    install built no kernels, ValueError where this CPU cannot run `variant`."""
    lib = load_library("gguf", variant)
    if lib.kvp_gguf_matmul.argtypes is None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.kvp_gguf_matmul.restype = ctypes.c_int
        lib.kvp_gguf_matmul.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, i64, ptr, i64, ctypes.c_int,
                                        ctypes.c_int]
        lib.kvp_quantize_q8_1.restype = None
        lib.kvp_quantize_q8_1.argtypes = [ptr, i64, i64, i64, ptr, ptr]
        lib.kvp_gguf_simd.restype = ctypes.c_int
        lib.kvp_gguf_set_tiled_min_m.restype = ctypes.c_int
        lib.kvp_gguf_set_tiled_min_m.argtypes = [ctypes.c_int]
        lib.kvp_gguf_amx.restype = ctypes.c_int
        lib.kvp_gguf_amx_pack.restype = ctypes.c_int
        lib.kvp_gguf_amx_pack.argtypes = [ctypes.c_int, ptr, i64, i64, ptr]
    return lib


def amx() -> bool:
    """Whether this CPU's build runs the 8-bit matmuls on AMX tiles (the amx build, where Linux
    grants the process the tile state): `amx_pack`'s layout is then readable."""
    return bool(load().kvp_gguf_amx())


def amx_pack(blocks: torch.Tensor, qtype: int) -> tuple[torch.Tensor, int]:
    """The GGUF blocks [N, K / 32 * BLOCK_BYTES[qtype]] uint8 (Q4_1 or Q8_0; N a multiple of 16) in
    csrc/gguf_amx.c's layout for AMX tiles (tiles of 16 rows, per block a B tile and the rows'
    scales): a tensor of the same shape and bytes, and its qtype (Q4_1_AMX, Q8_0_AMX), which
    `gguf_matmul` reads with 8-bit activations only. Raises ValueError on another qtype or shape."""
    n, row_bytes = blocks.shape
    if qtype not in AMX_LAYOUT or n % 16 or blocks.dtype != torch.uint8 or not blocks.is_contiguous():
        raise ValueError(f"amx_pack: needs contiguous Q4_1/Q8_0 blocks of a multiple of 16 rows, got "
                         f"{tuple(blocks.shape)} {blocks.dtype} of type {qtype}")
    out = torch.empty_like(blocks)
    k = row_bytes // BLOCK_BYTES[qtype] * BLOCK_WEIGHTS
    if load().kvp_gguf_amx_pack(qtype, blocks.data_ptr(), n, k, out.data_ptr()):
        raise ValueError(f"amx_pack: the kernel refused {tuple(blocks.shape)} of type {qtype}")
    return out, AMX_LAYOUT[qtype]


def quantize_q8_1(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's activation quantizer, exposed for tests: x [M, K] float32 (K a multiple
    of 32, last dim contiguous) -> (q [M, K] int8, d [M, K/32] float32, s [M, K/32] float32)
    with d = max|x| / 127 per block of 32, q = x * (1/d) rounded to nearest (ties to even),
    s = d * sum(q) (ggml's quantize_row_q8_1). Raises ValueError on bad shapes."""
    m, k = x.shape
    if x.dtype != torch.float32 or x.stride(1) != 1 or k % BLOCK_WEIGHTS:
        raise ValueError(f"quantize_q8_1: x must be [M, K] float32, K a multiple of 32, got {tuple(x.shape)} {x.dtype}")
    q, ds = torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // BLOCK_WEIGHTS, 2)
    load().kvp_quantize_q8_1(x.data_ptr(), x.stride(0), m, k, q.data_ptr(), ds.data_ptr())
    return q, ds[..., 0], ds[..., 1]


def gguf_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int, out_features: int,
                out: torch.Tensor | None = None, activations: str = "q8_1") -> torch.Tensor:
    """x @ W^T with W given as GGUF blocks.

    x:       [M, K] float32 on CPU, K a multiple of 32, last dim contiguous (rows may be strided)
    blocks:  [N, K / 32 * BLOCK_BYTES[qtype]] uint8, contiguous: row n holds W[n]'s blocks
    qtype:   Q4_1 (3) or Q8_0 (8), gguf.GGMLQuantizationType's numbers, or Q4_1_AMX / Q8_0_AMX
             (`amx_pack`'s layout; activations "q8_1" only)
    out:     optional [M, N] float32 contiguous, written and returned
    activations: "q8_1" (x quantized to 8-bit blocks, integer dot products) or "float32"
    returns  [M, N] float32. Uses torch.get_num_threads() threads.
    Raises ValueError on mismatched shapes, dtypes, an unsupported qtype or activations,
    loader.KernelsNotBuilt where the install built no kernels, RuntimeError when the kernel runs
    out of memory."""
    lib = load()
    if activations not in ACTIVATIONS:
        raise ValueError(f"gguf_matmul: activations must be one of {ACTIVATIONS}, not {activations!r}")
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"gguf_matmul: quantization type {qtype} is not supported (Q4_1=3, Q8_0=8)")
    if qtype in (Q4_1_AMX, Q8_0_AMX) and activations != "q8_1":
        raise ValueError("gguf_matmul: the AMX layout is read with 8-bit activations only")
    m, k = x.shape
    if (x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(1) != 1 or k % BLOCK_WEIGHTS
            or blocks.dtype != torch.uint8 or not blocks.is_contiguous()
            or tuple(blocks.shape) != (out_features, k // BLOCK_WEIGHTS * BLOCK_BYTES[qtype])):
        raise ValueError(f"gguf_matmul: bad shapes/dtypes x {tuple(x.shape)} {x.dtype} stride {x.stride()}, "
                         f"blocks {tuple(blocks.shape)} {blocks.dtype} for {out_features} outputs of type {qtype}")
    if out is None:
        out = torch.empty(m, out_features, dtype=torch.float32)
    elif out.shape != (m, out_features) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"gguf_matmul: out must be [{m}, {out_features}] float32 contiguous")
    with kernel_range("gguf_matmul"):
        code = lib.kvp_gguf_matmul(qtype, blocks.data_ptr(), out_features, k, x.data_ptr(), x.stride(0), m,
                                   out.data_ptr(), out_features, torch.get_num_threads(), activations == "q8_1")
    if code:
        raise RuntimeError(f"gguf_matmul: the kernel failed ({'out of memory' if code == -2 else code})")
    return out
