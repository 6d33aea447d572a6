"""Loads the CPU kernel libraries that build.py compiled ahead of time, in the best variant this
CPU runs.

The variants are x86 levels (build.VARIANTS: generic, x86-64-v3 = AVX2 + FMA, avx512,
avx512_bf16, amx); `selected_variant()` is the highest one built whose /proc/cpuinfo flags the
CPU has all of, as llama.cpp's GGML_CPU_ALL_VARIANTS backend loader and PyTorch's CPU capability
dispatch choose. A variant the CPU cannot run is never loaded (its code could fault with an
illegal instruction). Nothing is compiled here: where the install built no kernels,
`load` raises KernelsNotBuilt saying how to build them.
"""

from __future__ import annotations

import ctypes
import json
from contextlib import AbstractContextManager, nullcontext
from functools import lru_cache
from pathlib import Path

import torch.autograd.profiler as _torch_profiler
from torch.profiler import record_function

from kvpilot.kernels.cpu import build
from kvpilot.kernels.cpu.cpu_flags import detect_cpu

LIB_DIR = build.DEFAULT_OUT
_NO_RANGE = nullcontext()


class KernelsNotBuilt(RuntimeError):
    """The install built no CPU kernels (or not the one asked for)."""


@lru_cache(maxsize=1)
def manifest(lib_dir: Path = LIB_DIR) -> dict:
    """lib_dir/manifest.json as build.build_all wrote it. Raises KernelsNotBuilt where it is missing."""
    try:
        return json.loads((lib_dir / build.MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise KernelsNotBuilt(
            f"kvpilot's CPU kernels are not built in {lib_dir} ({e}); they are compiled when the project is "
            "installed: run `pip install -e .` (or `make install`) in the source tree, or "
            "`python -m kvpilot.kernels.cpu.build`") from e


def runnable(variant: str, flags: frozenset[str]) -> bool:
    """Whether a CPU with these /proc/cpuinfo flags runs `variant`'s code."""
    return set(manifest()["variants"][variant]["cpu_flags"]) <= flags


def variants_runnable(flags: frozenset[str] | None = None) -> list[str]:
    """The built variants this CPU (or one with `flags`) runs, lowest first."""
    flags = detect_cpu().flags if flags is None else flags
    order = [v.name for v in build.variants(manifest()["machine"])]
    return [v for v in order if v in manifest()["variants"] and runnable(v, flags)]


@lru_cache(maxsize=1)
def selected_variant() -> str:
    """The best built variant this CPU runs. Raises KernelsNotBuilt where none is."""
    ok = variants_runnable()
    if not ok:
        raise KernelsNotBuilt(f"no CPU kernel variant built in {LIB_DIR} runs on this CPU "
                              f"(built: {sorted(manifest()['variants'])})")
    return ok[-1]


_SELECTED: dict[str, ctypes.CDLL] = {}  # library -> its selected_variant() build, once loaded


def load(library: str, variant: str | None = None) -> ctypes.CDLL:
    """Kernel library `library` (a key of build.LIBRARIES) of `variant` (default:
    selected_variant()), loaded once per process. Raises KernelsNotBuilt where it was not built,
    ValueError where this CPU cannot run the variant asked for (it is never loaded then).

    The kernels' wrappers call this on every kernel call: the default variant's library comes from
    a dict after its first load (the checks and the path building took ~50 us a call, 6 ms of a
    mixed step of 30 layers on 2-core Sapphire Rapids); a variant named is checked every time."""
    if variant is None:
        lib = _SELECTED.get(library)
        if lib is None:
            lib = _SELECTED[library] = _checked_load(library, selected_variant())
        return lib
    return _checked_load(library, variant)


def _checked_load(library: str, variant: str) -> ctypes.CDLL:
    if variant not in manifest()["variants"] or library not in build.LIBRARIES:
        raise KernelsNotBuilt(f"no CPU kernel {library!r} of variant {variant!r} in {LIB_DIR}")
    if not runnable(variant, detect_cpu().flags):
        missing = sorted(set(manifest()["variants"][variant]["cpu_flags"]) - detect_cpu().flags)
        raise ValueError(f"this CPU cannot run the {variant} kernels (it lacks {', '.join(missing)})")
    return _open(build.library_path(LIB_DIR, variant, library))


@lru_cache(maxsize=None)
def _open(path: Path) -> ctypes.CDLL:
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelsNotBuilt(f"cannot load {path}: {e}") from e


def kernel_range(name: str) -> AbstractContextManager:
    """A torch profiler range `kvpilot::<name>` around a C kernel call while a torch profiler
    records (ctypes calls are invisible to it otherwise, and `bench throughput`'s breakdown
    would count them as Python), else a shared no-op context: the check is one attribute
    read, the range itself a dispatcher call of a few microseconds."""
    return record_function(f"kvpilot::{name}") if _torch_profiler._is_profiler_enabled else _NO_RANGE
