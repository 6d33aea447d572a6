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


def has_bf16_matmul_kernel(cpu: CpuInfo) -> bool:
    """Whether a bfloat16 engine runs kernels/cpu/bf16_gemm.py's matmul kernel on this CPU: AVX512F
    with AVX512_BF16 (up to how many rows: engine/cpu/row_limits.py). Where it runs the engine keeps
    the kernel's packed copy of each weight, so its embedding / LM-head weights are held three
    times (plain, oneDNN's, the kernel's)."""
    return {"avx512f", "avx512_bf16"} <= cpu.flags


def choose_auto_dtype(device: str, cpu: CpuInfo | None = None) -> DtypeChoice:
    """`--dtype auto`: on CUDA bfloat16 (vLLM's default for bf16 checkpoints), on CPU
    `choose_cpu_dtype` of this machine (or `cpu`)."""
    if device.startswith("cuda"):
        return DtypeChoice("bfloat16", "CUDA device")
    return choose_cpu_dtype(cpu or detect_cpu())
