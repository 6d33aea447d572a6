"""Which C kernels a CPU engine runs: decided here, once per process, and logged once with why.

A CPU decode step takes one of four paths:
  1. the decode stack: every layer of a small decode-only step in one C call (float32 with
     `--quantization gguf`, or bfloat16 where the bf16 matmul kernel serves);
  2. layer by layer with the C kernels: fused RoPE + K/V write + paged attention, C prefill
     attention, RMSNorm, SiLU*mul, GGUF matmuls; oneDNN (or the bf16 kernel) for the matmuls;
  3. the same in bfloat16 with oneDNN's matmuls (no bf16 kernel copies);
  4. the torch path: no C kernel at all (KVPILOT_CPU_KERNELS=0, for comparisons).
Every mode a comparison or a test runs is a value of `CpuKernelPath`, made by `choose` (from the
CPU's flags, the environment and explicit overrides); the row limits come from the one table of
engine/cpu/row_limits.py. Engines built inside `chosen(path)` load with that path (the layers keep
its row limits when they pack or quantize their weights), and models/cpu_decode_stack.py's
`apply(model, path)` is the one place that sets a model's modules from it, builds its decode stack
and logs the start-up line (`describe`).
The kernels come from the variant kernels/cpu/loader.py selected (built at install time); where
the install built none, choosing fails with loader.KernelsNotBuilt instead of quietly running
the torch path.

Environment, read by `choose` and nothing else: KVPILOT_CPU_KERNELS=0 (path 4),
KVPILOT_DECODE_STACK=0 (no path 1), KVPILOT_GGUF_ACTIVATIONS=float32 (`--quantization gguf`'s
matmuls on exact float32 activations instead of 8-bit ones).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from kvpilot.engine.cpu.info import CpuInfo, detect_cpu
from kvpilot.engine.cpu.row_limits import bf16_kernel_max_rows, gguf_max_rows
from kvpilot.kernels.cpu.gguf import ACTIVATIONS as GGUF_ACTIVATIONS  # the GGUF kernel's formats, default first
from kvpilot.engine.settings.env import KVPILOT_CPU_KERNELS, KVPILOT_DECODE_STACK, KVPILOT_GGUF_ACTIVATIONS

logger = logging.getLogger("kvpilot.engine.cpu.kernel_path")

KERNELS_ENV = KVPILOT_CPU_KERNELS
DECODE_STACK_ENV = KVPILOT_DECODE_STACK
GGUF_ACTIVATIONS_ENV = KVPILOT_GGUF_ACTIVATIONS


@dataclass(frozen=True)
class CpuKernelPath:
    """kernels: the C kernels run at all (False: the torch path); variant: the kernel build loaded
    (kernels/cpu/build.py VARIANTS); bf16_gemm_max_rows: bfloat16 matmuls of up to this many rows
    take the bf16 kernel (packed copies; 0: never), and so do bf16 decode stacks; decode_stack:
    small decode-only steps run in one C call where the model allows; reason: why, for the log;
    gguf_max_rows: with `--quantization gguf`, matmuls of up to this many rows read the GGUF
    blocks, with `gguf_activations` ("q8_1": 8-bit, "float32": exact); gguf_amx: the 8-bit ones
    read them on AMX tiles, in kernels/cpu/gguf.amx_pack's layout; c_attention: the attention
    backend's C decode and prefill attention; fused_rope_cache: RoPE and the K/V write fused into
    the C decode attention; c_norm_act: RMSNorm and SiLU*mul in C; c_sample: random rows with a
    temperature only drawn in C from their logits (kernels/cpu/sample.py, engine/sample/sampler.py).
    Raises ValueError where the fields contradict each other (the decode stack calls the C
    attention, norm and activation, so it needs them on)."""

    kernels: bool
    variant: str | None
    bf16_gemm_max_rows: int
    decode_stack: bool
    reason: str
    gguf_max_rows: int
    gguf_amx: bool
    gguf_activations: str
    c_attention: bool
    fused_rope_cache: bool
    c_norm_act: bool
    c_sample: bool = False

    def __post_init__(self) -> None:
        if self.gguf_activations not in GGUF_ACTIVATIONS:
            raise ValueError(f"gguf_activations={self.gguf_activations!r}: use one of {', '.join(GGUF_ACTIVATIONS)}")
        if self.bf16_gemm_max_rows < 0 or self.gguf_max_rows < 0:
            raise ValueError("bf16_gemm_max_rows and gguf_max_rows count rows: use 0 or more")
        uses_c = [name for name in ("c_attention", "fused_rope_cache", "c_norm_act", "decode_stack", "gguf_amx",
                                    "c_sample")
                  if getattr(self, name)] + (["bf16_gemm_max_rows"] if self.bf16_gemm_max_rows else [])
        if not self.kernels and uses_c:
            raise ValueError(f"kernels=False runs no C kernel: set {', '.join(uses_c)} off too")
        if self.fused_rope_cache and not self.c_attention:
            raise ValueError("fused_rope_cache fuses RoPE into the C attention: set c_attention=True or "
                             "fused_rope_cache=False")
        if self.gguf_amx and self.gguf_activations != "q8_1":
            raise ValueError("gguf_amx runs 8-bit activations only: set gguf_amx=False or gguf_activations='q8_1'")
        if self.decode_stack and not (self.c_attention and self.fused_rope_cache and self.c_norm_act):
            raise ValueError("the decode stack calls the fused C attention, norm and activation: set "
                             "decode_stack=False or c_attention, fused_rope_cache and c_norm_act on")

    @property
    def bf16_gemm(self) -> bool:
        """Whether bf16 layers get the bf16 kernel's packed copies at all."""
        return self.bf16_gemm_max_rows > 0


def _gguf_activations(env: Mapping[str, str]) -> str:
    value = env.get(GGUF_ACTIVATIONS_ENV, "").strip() or GGUF_ACTIVATIONS[0]
    if value not in GGUF_ACTIVATIONS:
        raise ValueError(f"{GGUF_ACTIVATIONS_ENV}={value!r}: use one of {', '.join(GGUF_ACTIVATIONS)} "
                         "(q8_1: 8-bit activations, the default; float32: exact activations)")
    return value


def choose(cpu: CpuInfo | None = None, env: Mapping[str, str] = os.environ, **overrides) -> CpuKernelPath:
    """The path for this CPU (or `cpu`) under the switches in `env`, with `overrides` (field values,
    for comparisons and tests: e.g. decode_stack=False, bf16_gemm_max_rows=32) replacing the chosen
    ones; a `gguf_activations` override also sets the GGUF row limit and AMX layout for that format
    unless they are overridden too. The reason names the overrides. Raises ValueError on a bad
    KVPILOT_GGUF_ACTIVATIONS or a contradictory path, TypeError on an unknown field,
    loader.KernelsNotBuilt where the install built no kernels (unless KVPILOT_CPU_KERNELS=0)."""
    activations = _gguf_activations(env)
    activations = overrides.get("gguf_activations", activations)
    if env.get(KERNELS_ENV, "1") == "0":
        path = CpuKernelPath(kernels=False, variant=None, bf16_gemm_max_rows=0, decode_stack=False,
                             reason=f"{KERNELS_ENV}=0: the torch path, no C kernel",
                             gguf_max_rows=gguf_max_rows(activations), gguf_amx=False, gguf_activations=activations,
                             c_attention=False, fused_rope_cache=False, c_norm_act=False)
    else:
        path = _with_kernels(cpu or detect_cpu(), activations, env.get(DECODE_STACK_ENV, "1") != "0")
    if not overrides:
        return path
    told = ", ".join(f"{name}={value!r}" for name, value in overrides.items())
    return dataclasses.replace(path, **overrides, reason=f"{path.reason}; set for a comparison: {told}")


def _with_kernels(cpu: CpuInfo, activations: str, stack: bool) -> CpuKernelPath:
    """The path with the C kernels on for `cpu` (the kernels' own probes say what they run on)."""
    from kvpilot.kernels.cpu import bf16_gemm, gguf, loader, sample

    variant = loader.selected_variant()
    tiles = bf16_gemm.amx()
    rows = bf16_kernel_max_rows(cpu, tiles) if bf16_gemm.simd() else 0
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
    int8_tiles = activations == "q8_1" and gguf.amx()
    if int8_tiles:
        why.append(f"--quantization gguf's 8-bit matmuls of up to {gguf_max_rows(activations, True)} rows on AMX tiles")
    return CpuKernelPath(kernels=True, variant=variant, bf16_gemm_max_rows=rows, decode_stack=stack,
                         reason="; ".join(why), gguf_max_rows=gguf_max_rows(activations, int8_tiles),
                         gguf_amx=int8_tiles, gguf_activations=activations,
                         c_attention=True, fused_rope_cache=True, c_norm_act=True, c_sample=sample.available())


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
