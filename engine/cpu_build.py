"""Builds a plain-C kernel library with the system's C compiler at first use and caches it.

Shared by the CPU kernels (attention/cpu_decode.py, layers/gguf_kernel.py). Needs only a C
compiler (`$CC`, else `cc`): no torch headers, so a build takes about a second. The shared
object is cached under `<cache_dir>/kernels/` (else a per-user temp dir) keyed by the
source, the compiler, the flags and the CPU's ISA flags (`-march=native`), and is written
atomically, so concurrent processes never load a half-written file. Where no library can
be built (no compiler, every flag set fails, no writable directory) or
`KVPILOT_CPU_KERNELS=0`, `build_library` returns None and logs why once per caller.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch.autograd.profiler as _torch_profiler
from torch.profiler import record_function

# (compile flags, link flags), tried in order; the first that builds and loads wins.
FlagSets = Sequence[tuple[list[str], list[str]]]

DISABLE_ENV = "KVPILOT_CPU_KERNELS"
_NO_RANGE = nullcontext()


def kernel_range(name: str) -> AbstractContextManager:
    """A torch profiler range `kvpilot::<name>` around a C kernel call while a torch profiler
    records (ctypes calls are invisible to it otherwise, and `bench throughput`'s breakdown
    would count them as Python), else a shared no-op context: the check is one attribute
    read, the range itself a dispatcher call of a few microseconds."""
    return record_function(f"kvpilot::{name}") if _torch_profiler._is_profiler_enabled else _NO_RANGE


def _kernel_dirs() -> list[Path]:
    from kvpilot.engine.model_loader import cache_dir

    return [cache_dir() / "kernels", Path(tempfile.gettempdir()) / f"kvpilot-kernels-{os.getuid()}"]


def _build(name: str, source: str, compiler: str, compile_flags: list[str], link_flags: list[str],
           logger: logging.Logger) -> Path | None:
    from kvpilot.engine.cpu_info import detect_cpu

    flags = [*compile_flags, "|", *link_flags]
    key = hashlib.sha256("\n".join([source, compiler, *flags, *sorted(detect_cpu().flags)]).encode()).hexdigest()[:16]
    for root in _kernel_dirs():
        so = root / f"{name}_{key}.so"
        if so.exists():
            return so
        try:
            root.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=root) as tmp:
                src = Path(tmp) / f"{name}.c"
                src.write_text(source)
                obj, built = Path(tmp) / f"{name}.o", Path(tmp) / f"{name}.so"
                for cmd in ([compiler, "-c", "-fPIC", *compile_flags, str(src), "-o", str(obj)],
                            [compiler, "-shared", str(obj), "-o", str(built), *link_flags]):
                    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
                os.replace(built, so)  # atomic: concurrent builders never load a half-written file
            return so
        except subprocess.CalledProcessError as e:
            logger.debug("%s: %s %s failed: %s", name, compiler, " ".join(flags), e.stderr.decode()[-500:])
            return None
        except (OSError, subprocess.TimeoutExpired) as e:
            logger.debug("%s: cannot build in %s: %s", name, root, e)
    return None


def build_library(name: str, source: str, flag_sets: FlagSets, logger: logging.Logger,
                  fallback: str) -> ctypes.CDLL | None:
    """The C library `source` compiled into `<name>_<key>.so` and loaded, or None with one
    log line saying why and that `fallback` (e.g. 'the torch path') is used instead.
    Not cached here: callers cache the result (functools.lru_cache) and set argtypes."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        logger.info("%s disabled by %s=0: using %s", name, DISABLE_ENV, fallback)
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.warning("%s: no C compiler (%s); using %s", name, os.environ.get("CC", "cc"), fallback)
        return None
    for compile_flags, link_flags in flag_sets:
        so = _build(name, source, compiler, compile_flags, link_flags, logger)
        if so is None:
            continue
        try:
            lib = ctypes.CDLL(str(so))
        except OSError as e:
            logger.debug("%s: cannot load %s: %s", name, so, e)
            continue
        logger.info("%s built with %s %s", name, compiler, " ".join(compile_flags))
        return lib
    logger.warning("%s: the build failed with every flag set; using %s", name, fallback)
    return None
