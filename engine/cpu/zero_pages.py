"""CPU tensors on fresh anonymous memory: zero without being written.

The CPU KV cache pool is gigabytes that a server fills block by block. On an anonymous private
mapping every page reads as zero until its first write (mmap(2): "MAP_ANONYMOUS ... its contents
are initialized to zero"), and the kernel zeroes a page when it is first touched, so the pool is
finite everywhere (attention may mask a padded slot by its score alone: zero weight times a finite
value) without zeroing each block at its first use, and without touching the pool up front (vLLM's
CPU worker allocates it with torch.zeros, which writes every page before the first request).
Zeroing blocks at first use cost a server 3.3 % of its engine thread (2-core Sapphire Rapids, 64
concurrent ShareGPT requests on a fresh 4 GiB pool: benchmarks/results/serving_profile).
"""

from __future__ import annotations

import math
import mmap

import torch


def zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of `shape` and `dtype` on its own anonymous private mapping (page-aligned),
    all zero and untouched: pages become resident as they are first written. The tensor keeps the
    mapping alive; it is unmapped with the last reference. Raises OSError where the mapping
    cannot be made (out of address space or overcommit), ValueError for an empty shape."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if nbytes <= 0:
        raise ValueError(f"zeroed: empty shape {shape}")
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype).view(shape)
