"""What this CPU can do, and the dtype `--dtype auto` runs on it.

On x86, bfloat16 matmuls are fast only where the CPU has native bf16 instructions
(AVX512_BF16, or AMX tiles with AMX_BF16): there oneDNN's bf16 kernels reach several
times the fp32 rate (about 650-730 GFLOP/s against ~200 on the Intel/AMX machines we
measured). Elsewhere (AVX2 only, or AVX-512 without BF16) PyTorch falls back to a slow
bf16 path: 1-2 GFLOP/s against 15-110 in fp32 on a 2-core AVX2 AMD EPYC (oneDNN's
weight prepacking refuses there: it needs avx512bw/vl/dq or avx_ne_convert); reading half
the weight bytes still wins at batch 1-2, but batched decode, which is what a server
runs, is faster in float32 there (`git show bbe6366:benchmarks/results/throughput/dtype_avx2.json`).
So `auto` on CPU is bfloat16 with native bf16 and float32 otherwise, with the reason
logged. (vLLM's CPU platform lists bf16 as supported on every x86 CPU and keeps the
checkpoint's dtype; it does not choose by ISA. PyTorch's own check is
torch.cpu._is_avx512_bf16_supported / _is_amx_tile_supported.)
Source: the ISA flags (avx512_bf16, amx_bf16) as Linux lists them in /proc/cpuinfo.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpilot.kernels.cpu.cpu_flags import (  # noqa: F401 (re-exported)
    ISA_FLAGS, NATIVE_BF16_FLAGS, CpuInfo, detect_cpu)

if TYPE_CHECKING:  # torch-free at import: the tuner asks for the dtype's name
    import torch


@dataclass(frozen=True)
class DtypeChoice:
    """name: 'bfloat16' or 'float32'; reason: why, for the startup log."""

    name: str
    reason: str

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype of `name` (imports torch)."""
        from kvpilot.engine.config import resolve_dtype

        return resolve_dtype(self.name)


def choose_cpu_dtype(cpu: CpuInfo) -> DtypeChoice:
    """The dtype `--dtype auto` runs on this CPU: bfloat16 where native bf16 exists
    (AVX512_BF16 or AMX_BF16), float32 otherwise."""
    present = [f for f in NATIVE_BF16_FLAGS if f in cpu.flags]
    if present:
        return DtypeChoice("bfloat16", f"CPU {cpu.model_name!r} has native bf16 ({', '.join(present)})")
    isa = "AVX-512 without BF16" if "avx512f" in cpu.flags else ("AVX2" if "avx2" in cpu.flags else cpu.machine)
    return DtypeChoice("float32", (
        f"CPU {cpu.model_name!r} has no native bf16 ({isa}; neither avx512_bf16 nor amx_bf16): "
        f"bf16 matmuls run on a slow path there and batched decode is faster in float32"))


# The most rows a bfloat16 matmul takes kernels/cpu/bf16_gemm.py's kernel for, by CPU kind: the
# crossover with oneDNN measured by `kvpilot bench decode-step --cpu-kernel on,bf16-gemm` (2 threads,
# benchmarks/results/throughput/README.md). Zen 4 (AVX512_BF16, no AMX): the kernel wins up to the
# kernel's own limit, 32 rows. Sapphire Rapids (AMX), the kernel's vdpbf16ps loop: its one pass over
# the weights wins while a step is bound by reading them (1.75x oneDNN's AMX matmuls at 1 row,
# 1.08x at 8), oneDNN's tiles win from 12 rows on (0.95x at 12, 0.72x at 32). Where the kernel runs
# on AMX tiles itself (bf16_gemm.amx(), engine/cpu_kernel_path.py) it wins up to 32 rows there too.
BF16_KERNEL_MAX_ROWS = 32  # the kernel's own limit (bf16_gemm.BF16_GEMM_MAX_TOKENS)
BF16_KERNEL_MAX_ROWS_AMX = 8  # the vdpbf16ps loop on an AMX CPU


def bf16_matmul_kernel_max_rows(cpu: CpuInfo, tiles: bool = False) -> int:
    """Up to how many rows a bfloat16 engine runs kernels/cpu/bf16_gemm.py's kernel on this CPU
    instead of oneDNN's matmul (0: never): AVX512F with AVX512_BF16 is needed; on an AMX CPU the
    kernel's `vdpbf16ps` loop hands over to oneDNN's tiles above BF16_KERNEL_MAX_ROWS_AMX rows,
    unless the kernel runs on the tiles itself (`tiles`: bf16_gemm.amx()). Where it runs the engine
    keeps the kernel's packed copy of each weight, so its embedding / LM-head weights are held
    three times (plain, oneDNN's, the kernel's)."""
    if not {"avx512f", "avx512_bf16"} <= cpu.flags:
        return 0
    if "amx_bf16" in cpu.flags and not tiles:
        return BF16_KERNEL_MAX_ROWS_AMX
    return BF16_KERNEL_MAX_ROWS


# The most rows a matmul reads `--quantization gguf`'s blocks for with 8-bit activations (either dtype):
# vLLM's MMVQ limit (linear.GGUF_MAX_TOKENS) with the AVX2 dot products; where they run on AMX tiles
# (kernels/cpu/gguf.amx(), csrc/gguf_amx.c) up to 16 rows: `kvpilot bench decode-step --dtypes bfloat16
# --quantization none,gguf` on Sapphire Rapids (2 threads), ms a step, dense bf16 (the bf16 kernel on
# AMX tiles) vs the blocks: 1 row 13.1 vs 6.0, 8 rows 16.7 vs 12.7, 16 rows 20.5 vs 18.2, 24 rows 26.5 vs
# 26.9, 32 rows 30.1 vs 31.7 (benchmarks/results/throughput/README.md).
GGUF_MAX_ROWS = 8
GGUF_MAX_ROWS_AMX = 16


def gguf_max_rows(amx_int8: bool) -> int:
    """Up to how many rows a matmul reads the GGUF blocks (8-bit activations) instead of the dense
    weight: GGUF_MAX_ROWS_AMX where the 8-bit matmuls run on AMX tiles (`amx_int8`), else GGUF_MAX_ROWS."""
    return GGUF_MAX_ROWS_AMX if amx_int8 else GGUF_MAX_ROWS


def has_bf16_matmul_kernel(cpu: CpuInfo) -> bool:
    """Whether a bfloat16 engine runs the bf16 matmul kernel (and keeps its copies) on this CPU."""
    return bf16_matmul_kernel_max_rows(cpu) > 0


def choose_auto_dtype(device: str, cpu: CpuInfo | None = None) -> DtypeChoice:
    """`--dtype auto`: on CUDA bfloat16 (vLLM's default for bf16 checkpoints), on CPU
    `choose_cpu_dtype` of this machine (or `cpu`)."""
    if device.startswith("cuda"):
        return DtypeChoice("bfloat16", "CUDA device")
    return choose_cpu_dtype(cpu or detect_cpu())
