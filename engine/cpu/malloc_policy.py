"""glibc malloc settings for the CPU engine: keep freed activation memory instead of giving it back.

A prefill step of 2,048 tokens allocates and frees tens of MB per layer (the gate_up output alone is
2,048 x 3,072 bf16: 12 MiB). glibc serves such blocks with mmap until its dynamic threshold rises,
and returns free memory at the top of a heap to the kernel once it exceeds the trim threshold (which
of the two bites in which step was not traced), so the next tensors are fresh pages again: a page
fault per 4 KiB, ~88,000 in each such step (four prefill steps: 352,000 minor faults; with the
settings below 21,000, most of them the KV cache blocks' first use; Sapphire Rapids VM). `apply` sets, unless the user set them
(MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, GLIBC_TUNABLES): mmap only above 32 MiB (glibc's
largest mmap threshold on 64-bit) and a trim threshold of 1 GiB, so the process keeps up to its
peak of freed heap memory (the activation peak the KV cache sizing already leaves room for) and
reuses it. vLLM's CPU guide reaches the same end with tcmalloc in LD_PRELOAD; these are glibc's
own switches, so nothing is preloaded. Source: mallopt(3) (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD;
setting either turns the dynamic threshold off).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Mapping

logger = logging.getLogger("kvpilot.engine")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 1 << 30
USER_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
_state = {"applied": False}


def apply(environ: Mapping[str, str] | None = None) -> bool:
    """Sets the two thresholds once per process (Linux with glibc; elsewhere, or where the user set
    any of USER_ENV, nothing). Returns whether they are set."""
    environ = os.environ if environ is None else environ
    if _state["applied"]:
        return True
    if not sys.platform.startswith("linux") or any(environ.get(name) for name in USER_ENV):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # glibc's; musl has none
    except AttributeError:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1 or mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) != 1:
        logger.warning("mallopt refused the mmap/trim thresholds: large activations keep faulting in fresh pages")
        return False
    _state["applied"] = True
    return True
