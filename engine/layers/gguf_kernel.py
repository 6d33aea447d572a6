"""y = x W^T for W kept in GGUF's Q4_1 or Q8_0 blocks, in plain C (AVX2 where the CPU
has it, a scalar loop elsewhere), built with the system's C compiler at first use
(engine/cpu_build.py) and called through ctypes; float32 activations and accumulation.

Why: one decode step at batch 1 reads every weight once, so its time is the weight bytes
over the memory bandwidth. Q4_1 takes 20 bytes per 32 weights (6.4x fewer than float32)
and Q8_0 34 bytes. The blocks are dequantized in registers, never in memory, as llama.cpp's
CPU `ggml_vec_dot_*` and vLLM's `ggml_mul_mat_vec_a8` (GGUF, batch <= 8) do; unlike them the
activations stay float32 (no 8-bit quantization of x), so results differ from the dense
float32 matmul only by rounding order. Per block of 32 with scale d and minimum m:
  Q4_1: w_j = d * q_j + m, q_j in 0..15, q_j = qs[j] & 15, q_{j+16} = qs[j] >> 4;
        sum_j x_j w_j = d * sum_j x_j q_j + m * sum_j x_j
  Q8_0: w_j = d * q_j, q_j int8;  sum_j x_j w_j = d * sum_j x_j q_j
Block layouts (ggml-common.h): Q4_1 = {f16 d, f16 m, u8 qs[16]} (20 bytes), Q8_0 = {f16 d,
i8 qs[32]} (34 bytes). Rows (output features) are split over a small persistent pthread
pool inside the library (workers spin briefly, then sleep), so one call costs no Python
thread hand-off; ctypes releases the GIL during the call.
"""

from __future__ import annotations

import ctypes
import logging
from functools import lru_cache

import torch

from kvpilot.engine.cpu_build import build_library
from kvpilot.engine.layers.gguf_matmul_c import SOURCE

logger = logging.getLogger("kvpilot.engine.layers.gguf_kernel")

# GGML type numbers (gguf.GGMLQuantizationType) -> bytes per block of 32 weights
Q4_1, Q8_0 = 3, 8
BLOCK_WEIGHTS = 32
BLOCK_BYTES = {Q4_1: 20, Q8_0: 34}


# -ffp-contract=off keeps d * q + m and the sums as written; AVX2 needs FMA (every AVX2 x86
# CPU has it) and the scalar path builds anywhere.
_FLAG_SETS = (
    (["-O3", "-march=native", "-ffp-contract=off", "-pthread"], ["-pthread"]),
    (["-O2", "-pthread"], ["-pthread"]),
)


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    """The compiled library, or None (logged once) where it cannot be built or
    KVPILOT_CPU_KERNELS=0 disables it."""
    lib = build_library("gguf_matmul", SOURCE, _FLAG_SETS, logger, "the dense float32 weights")
    if lib is None:
        return None
    fn = lib.kvp_gguf_matmul
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    return lib


def gguf_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int, out_features: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T with W given as GGUF blocks.

    x:       [M, K] float32 on CPU, K a multiple of 32, last dim contiguous (rows may be strided)
    blocks:  [N, K / 32 * BLOCK_BYTES[qtype]] uint8, contiguous: row n holds W[n]'s blocks
    qtype:   Q4_1 (3) or Q8_0 (8), gguf.GGMLQuantizationType's numbers
    out:     optional [M, N] float32 contiguous, written and returned
    returns  [M, N] float32. Uses torch.get_num_threads() threads.
    Raises ValueError on mismatched shapes, dtypes or an unsupported qtype, RuntimeError when
    the library is not built (check `load()` first) or runs out of memory."""
    lib = load()
    if lib is None:
        raise RuntimeError("the GGUF matmul kernel is not available")
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"gguf_matmul: quantization type {qtype} is not supported (Q4_1=3, Q8_0=8)")
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
    code = lib.kvp_gguf_matmul(qtype, blocks.data_ptr(), out_features, k, x.data_ptr(), x.stride(0), m,
                               out.data_ptr(), out_features, torch.get_num_threads())
    if code:
        raise RuntimeError(f"gguf_matmul: the kernel failed ({'out of memory' if code == -2 else code})")
    return out
