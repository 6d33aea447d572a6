"""Shared pieces of the Triton kernels: the launchers' argument checks and the choice
of tl.dot precision shared by the attention kernels.

The checks raise `ValueError` naming the launcher, the argument and the mismatch, so a
wrong call fails on the host with a readable message instead of reading out of bounds
on the device.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import triton

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256


def is_interpreted(kernel) -> bool:
    """True when `kernel` was decorated under TRITON_INTERPRET=1 (it then runs on the CPU
    through Triton's interpreter instead of being compiled for a GPU)."""
    return type(kernel).__name__ == "InterpretedFunction"


def dot_options(dtype: torch.dtype, interpreted: bool) -> dict:
    """Constexpr arguments DOT_FP32 / DOT_PRECISION of the attention kernels: whether
    tl.dot operands are cast to float32 and multiplied at IEEE precision.

    float32 inputs: always, so that a float32 model is not silently computed in TF32.
    bfloat16 under the interpreter: its bf16 tl.dot multiplies the raw bit patterns
    (triton#11584, see DESIGN.md), so bf16 loads are widened and accumulated in fp32.
    float16 and (on GPUs) bfloat16 go to the tensor cores as they are, accumulating in fp32.
    """
    fp32 = dtype == torch.float32 or (interpreted and dtype == torch.bfloat16)
    # None keeps the backend's default, which only matters for float32 operands, and
    # those never reach tl.dot without DOT_FP32.
    return {"DOT_FP32": fp32, "DOT_PRECISION": "ieee" if fp32 else None}


def check_devices(fn: str, interpreted: bool, **tensors: torch.Tensor) -> None:
    """All tensors on one device, and a device the kernel can run on: CUDA, or any device
    the interpreter can read (CPU) when interpreting."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"{fn}: all tensors must be on one device, got {listed}")
    device = next(iter(devices.values()))
    allowed = ("cuda", "cpu") if interpreted else ("cuda",)
    if device.type not in allowed:
        hint = "" if interpreted else " (or set TRITON_INTERPRET=1 to run on the CPU)"
        raise ValueError(f"{fn}: tensors are on {device}; the Triton kernel needs CUDA{hint}")


def check_dtype(fn: str, name: str, t: torch.Tensor, allowed: Iterable[torch.dtype]) -> None:
    """ValueError (naming fn and the tensor) unless t's dtype is one of allowed."""
    allowed = tuple(allowed)
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise ValueError(f"{fn}: {name} has dtype {str(t.dtype).replace('torch.', '')}, expected one of {names}")


def check_shape(fn: str, name: str, t: torch.Tensor, expected: tuple, layout: str) -> None:
    """`expected` holds ints or None (any size); `layout` names the dimensions for the message."""
    ok = t.dim() == len(expected) and all(e is None or e == s for e, s in zip(expected, t.shape))
    if not ok:
        want = ", ".join("*" if e is None else str(e) for e in expected)
        raise ValueError(f"{fn}: {name} has shape {list(t.shape)}, expected {layout} = [{want}]")


def check_same_dtype(fn: str, **tensors: torch.Tensor) -> None:
    """ValueError (naming fn and each tensor's dtype) unless all the keyword tensors share one dtype."""
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{n} {str(d).replace('torch.', '')}" for n, d in dtypes.items())
        raise ValueError(f"{fn}: dtypes must match, got {listed}")


def check_cache_pair(fn: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """k_cache and v_cache are [num_blocks, block_size, num_kv_heads, head_dim] of one float
    dtype; returns those four sizes."""
    if k_cache.dim() != 4:
        raise ValueError(
            f"{fn}: k_cache has shape {list(k_cache.shape)}, expected "
            "[num_blocks, block_size, num_kv_heads, head_dim]"
        )
    check_shape(fn, "v_cache", v_cache, tuple(k_cache.shape), "k_cache's shape")
    check_dtype(fn, "k_cache", k_cache, FLOAT_DTYPES)
    check_same_dtype(fn, k_cache=k_cache, v_cache=v_cache)
    if k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"{fn}: k_cache and v_cache must have the same strides, got "
            f"{k_cache.stride()} and {v_cache.stride()}"
        )
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if min(num_blocks, block_size, num_kv_heads, head_dim) < 1:
        raise ValueError(f"{fn}: k_cache has an empty dimension: {list(k_cache.shape)}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"{fn}: head_dim {head_dim} exceeds the supported {MAX_HEAD_DIM}")
    return num_blocks, block_size, num_kv_heads, head_dim


def check_group(fn: str, num_heads: int, num_kv_heads: int) -> int:
    """Query heads per KV head (GQA); num_heads must be a multiple of num_kv_heads."""
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{fn}: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
        )
    return num_heads // num_kv_heads


def check_out(fn: str, out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The output buffer: a new one shaped like `like`, or the caller's, checked."""
    if out is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    check_shape(fn, "out", out, tuple(like.shape), "q's shape")
    check_same_dtype(fn, q=like, out=out)
    if out.device != like.device:
        raise ValueError(f"{fn}: out is on {out.device}, q on {like.device}")
    return out


def kv_tile(element_size: int, block_d: int) -> tuple[int, int]:
    """(BLOCK_N, num_stages) for the attention kernels: KV tokens per tile and software
    pipeline depth, shrunk for wide rows so that the K and V tiles of every stage and the
    query tile fit in shared memory (~100 KiB at most, below an A100's 164 KiB)."""
    row_bytes = element_size * block_d
    if row_bytes <= 256:  # fp16/bf16, head_dim <= 128
        return 64, 3
    if row_bytes <= 512:  # fp32 head_dim 128, fp16 head_dim 256
        return 32, 2
    return 32, 1


def pow2_at_least(n: int, floor: int = 16) -> int:
    """Next power of two >= n, and >= floor (tl.dot needs every dimension >= 16)."""
    return max(floor, triton.next_power_of_2(n))


def check_paged_attention_args(fn: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, num_seqs: int,
                               q_layout: str) -> tuple[int, int, int, int]:
    """What the paged attention launchers share: the cache pair, q [*, num_heads, head_dim]
    of the cache's float dtype (`q_layout` names its dimensions for the message),
    block_tables [num_seqs, *] and seq_lens [num_seqs] of an index dtype. Returns
    (block_size, num_kv_heads, head_dim, group); ValueError on a mismatch."""
    _, block_size, num_kv_heads, head_dim = check_cache_pair(fn, k_cache, v_cache)
    check_shape(fn, "q", q, (None, None, head_dim), q_layout)
    group = check_group(fn, q.shape[1], num_kv_heads)
    check_dtype(fn, "q", q, FLOAT_DTYPES)
    check_same_dtype(fn, q=q, k_cache=k_cache)
    check_shape(fn, "block_tables", block_tables, (num_seqs, None), "[num_seqs, max_num_blocks_per_seq]")
    check_shape(fn, "seq_lens", seq_lens, (num_seqs,), "[num_seqs]")
    check_dtype(fn, "block_tables", block_tables, INDEX_DTYPES)
    check_dtype(fn, "seq_lens", seq_lens, INDEX_DTYPES)
    return block_size, num_kv_heads, head_dim, group
