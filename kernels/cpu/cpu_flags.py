"""What this CPU can do: its model name and ISA flags as Linux lists them in /proc/cpuinfo.

The kernel loader (kernels/cpu/loader.py) picks the ahead-of-time built variant from these
flags; engine/cpu/info.py chooses the dtype from them. Torch-free at import (the tuner reads
them too). Source: the flag names of Linux's arch/x86/include/asm/cpufeatures.h.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # bf16 matmuls in hardware
# flags reported in benchmark JSON (the ones that decide kernels and dtypes)
ISA_FLAGS = ("sse4_2", "avx", "f16c", "fma", "avx2", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
             "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class CpuInfo:
    """model_name: /proc/cpuinfo's 'model name'; flags: its ISA flags (lower case)."""

    model_name: str
    flags: frozenset[str]
    machine: str = "x86_64"

    @classmethod
    def parse(cls, text: str, machine: str = "x86_64") -> CpuInfo:
        """Reads the first processor's 'model name' and 'flags' lines of /proc/cpuinfo text."""
        model, flags = "unknown", frozenset()
        for line in text.splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model == "unknown":
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = frozenset(value.lower().split())
        return cls(model, flags, machine)

    @property
    def native_bf16(self) -> bool:
        """Whether the CPU multiplies bf16 in hardware (AVX512_BF16 or AMX-BF16)."""
        return any(f in self.flags for f in NATIVE_BF16_FLAGS)

    def as_dict(self) -> dict:
        """For benchmark JSON: model, architecture, the ISA flags that matter, torch's view."""
        import torch

        return {"model_name": self.model_name, "machine": self.machine,
                "isa_flags": sorted(f for f in ISA_FLAGS if f in self.flags),
                "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}


@lru_cache(maxsize=1)
def detect_cpu(path: str = "/proc/cpuinfo") -> CpuInfo:
    """This machine's CpuInfo (empty flags where /proc/cpuinfo is unreadable)."""
    try:
        text = Path(path).read_text()
    except OSError:
        text = ""
    return CpuInfo.parse(text, platform.machine())
