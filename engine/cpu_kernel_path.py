"""Which C kernels a CPU engine runs: decided here, once per process, and logged once with why.

A CPU decode step takes one of four paths:
  1. the decode stack: every layer of a small decode-only step in one C call (float32 with
     `--quantization gguf`, or bfloat16 where the bf16 matmul kernel serves);
  2. layer by layer with the C kernels: fused RoPE + K/V write + paged attention, C prefill
     attention, RMSNorm, SiLU*mul, GGUF matmuls; oneDNN (or the bf16 kernel) for the matmuls;
  3. the same in bfloat16 with oneDNN's matmuls (no bf16 kernel copies);
  4. the torch path: no C kernel at all (KVPILOT_CPU_KERNELS=0, for comparisons).
`choose` picks from the CPU's flags and two switches for comparisons; the model runner hands the
choice to models/cpu_decode_stack.py's `apply`, which sets the model's modules accordingly,
builds its decode stack and logs the one start-up line (`describe`).
The kernels come from the variant kernels/cpu/loader.py selected (built at install time); where
the install built none, choosing fails with loader.KernelsNotBuilt instead of quietly running
the torch path.

Environment: KVPILOT_CPU_KERNELS=0 (path 4), KVPILOT_DECODE_STACK=0 (no path 1); nothing else
reads them. The module flags `apply` sets from the path (RMSNorm.use_c_kernel,
SiluAndMul.use_c_kernel, the attention backend's use_cpu_kernel), and fuse_rope_cache and
DecodeStack.enabled, remain per-instance switches for benchmarks and tests.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from kvpilot.engine.cpu_info import GGUF_MAX_ROWS, CpuInfo, bf16_matmul_kernel_max_rows, detect_cpu, gguf_max_rows

logger = logging.getLogger("kvpilot.engine.cpu_kernel_path")

KERNELS_ENV = "KVPILOT_CPU_KERNELS"
DECODE_STACK_ENV = "KVPILOT_DECODE_STACK"


@dataclass(frozen=True)
class CpuKernelPath:
    """kernels: the C attention, norm, activation and GGUF kernels run; variant: the kernel
    build loaded (kernels/cpu/build.py VARIANTS); bf16_gemm_max_rows: bfloat16 matmuls of up to
    this many rows take the bf16 kernel (packed copies; 0: never, at most
    bf16_gemm.BF16_GEMM_MAX_TOKENS), and so do bf16 decode stacks; decode_stack: small decode-only
    steps run in one C call where the model allows; reason: why, for the log; gguf_max_rows: with
    `--quantization gguf` and 8-bit activations, matmuls of up to this many rows read the GGUF
    blocks; gguf_amx: they read them on AMX tiles, in kernels/cpu/gguf.amx_pack's layout."""

    kernels: bool
    variant: str | None
    bf16_gemm_max_rows: int
    decode_stack: bool
    reason: str
    gguf_max_rows: int = GGUF_MAX_ROWS
    gguf_amx: bool = False

    @property
    def bf16_gemm(self) -> bool:
        """Whether bf16 layers get the bf16 kernel's packed copies at all."""
        return self.bf16_gemm_max_rows > 0


def choose(cpu: CpuInfo | None = None, env: Mapping[str, str] = os.environ) -> CpuKernelPath:
    """The path for this CPU (or `cpu`). Raises loader.KernelsNotBuilt where the install built no
    kernels (unless KVPILOT_CPU_KERNELS=0)."""
    if env.get(KERNELS_ENV, "1") == "0":
        return CpuKernelPath(False, None, 0, False, f"{KERNELS_ENV}=0: the torch path, no C kernel")
    from kvpilot.kernels.cpu import bf16_gemm, gguf, loader

    cpu = cpu or detect_cpu()
    variant = loader.selected_variant()
    tiles = bf16_gemm.amx()
    rows = bf16_matmul_kernel_max_rows(cpu, tiles) if bf16_gemm.simd() else 0
    stack = env.get(DECODE_STACK_ENV, "1") != "0"
    why = [f"CPU {cpu.model_name!r} runs the {variant} kernel build (of {', '.join(loader.variants_runnable())})"]
    if not rows:
        why.append("bfloat16 matmuls through oneDNN (no AVX512_BF16 kernel here)")
    elif tiles and "amx_bf16" in cpu.flags:
        why.append(f"bfloat16 matmuls of up to {rows} rows on the bf16 kernel's AMX tiles, larger ones on oneDNN's")
    elif "amx_bf16" in cpu.flags:
        why.append(f"bfloat16 matmuls of up to {rows} rows on the AVX512_BF16 kernel, larger ones on oneDNN's AMX tiles"
                   " (this Linux kernel grants no AMX tile state to the process)")
    if not stack:
        why.append(f"{DECODE_STACK_ENV}=0")
    int8_tiles = gguf.amx()
    if int8_tiles:
        why.append(f"--quantization gguf's 8-bit matmuls of up to {gguf_max_rows(True)} rows on AMX tiles")
    return CpuKernelPath(True, variant, rows, stack, "; ".join(why), gguf_max_rows(int8_tiles), int8_tiles)


_current: CpuKernelPath | None = None


def current() -> CpuKernelPath:
    """The process's path, chosen at first use (the environment is read then)."""
    global _current
    if _current is None:
        _current = choose()
    return _current


@contextmanager
def chosen(path: CpuKernelPath) -> Iterator[CpuKernelPath]:
    """Within the block, `current()` is `path` (engines built there load with it): for
    comparisons of two paths in one process (`kvpilot bench decode-step --cpu-kernel on,bf16-gemm`)
    and tests."""
    global _current
    saved, _current = _current, path
    try:
        yield path
    finally:
        _current = saved


def reset() -> None:
    """Forgets the chosen path, so the next `current()` reads the environment again (tests)."""
    global _current
    _current = None


def describe(model, path: CpuKernelPath) -> str:
    """The start-up line: which path `model`'s decode steps take and why."""
    import torch

    dtype = str(model.config.dtype).removeprefix("torch.")
    stack = getattr(model, "decode_stack", None)
    if not path.kernels:
        how = "the torch path"
    elif stack is not None:
        qrows = stack.max_rows if stack.dtype != torch.bfloat16 else stack.md.qmax_rows
        blocks = f"; matmuls of up to {qrows} rows read the GGUF blocks" if qrows else ""
        how = f"the C decode stack (all layers in one call, up to {stack.max_rows} rows{blocks}), else layer by layer"
    else:
        how = ("layer by layer with the C kernels (the decode stack serves float32 with --quantization gguf "
               "and bfloat16 where the bf16 matmul kernel runs)")
    return f"{dtype} decode steps run {how}: {path.reason}"
