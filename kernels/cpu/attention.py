"""Decode attention on CPU over the paged KV cache, one C call per layer (csrc/attention.c),
float32, or bfloat16 from the library's -DKVP_BF16 build (bf16 storage, float32 math).

Why: the pure-torch decode path gathers every sequence's K/V blocks into a dense
workspace (two copies per layer), then runs SDPA with a boolean length mask that SDPA
converts to a float mask in every layer: about 25 tensor ops per layer, 750 per step of
the 30-layer SmolLM2, whatever the batch. This kernel reads each sequence's K/V rows in
place through its block table (`slot = block_table[t // block_size] * block_size +
t % block_size`, as vLLM's PagedAttention) in one call per layer, reading each K/V row
once for all query heads of its GQA group. A layer's attention is shared out over
`torch.get_num_threads()` threads of torch's own OpenMP team, long sequences cut into parts
merged by their softmax maxima and sums (vLLM's paged_attention_v2): the library is built with
`-fopenmp`, and its `libgomp.so.1` resolves to the one torch has loaded (same soname), so the
attention's parallel region reuses the threads torch's matmuls just used. `FusedDecode` does the
whole decode side of a layer in that one call: RoPE of q and k, the K/V write at the new token's
slot, then the attention.
Source: vLLM PagedAttention (SOSP'23); two-pass softmax as in the math of SDPA.
"""

from __future__ import annotations

import ctypes

import torch

from kvpilot.kernels.cpu.loader import kernel_range
from kvpilot.kernels.cpu.loader import load as load_library
from kvpilot.kernels.cpu.threads import partition_width

# Below this many (cached token x KV head) pairs, summed over a layer's sequences, its attention
# costs less than waking the OpenMP team for it: one sequence of 256 tokens (3 KV heads) took
# 0.084 ms on one thread and 0.049 on two, one of 128 tokens 0.046 and 0.049.
PARALLEL_MIN_WORK = 768

# The dtypes the library is built for, with the suffix of their exported names and the library.
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
LIBRARY = {torch.float32: "attention", torch.bfloat16: "attention_bf16"}


def kernel_name(base: str, dtype: torch.dtype) -> str:
    """The exported name of kernel `base` (e.g. "kvp_paged_decode") for `dtype` (a key of SUFFIX)."""
    return f"{base}_{SUFFIX[dtype]}"


def load(dtype: torch.dtype = torch.float32, variant: str | None = None) -> ctypes.CDLL:
    """The attention / norm / activation library for `dtype` (float32 or bfloat16) in this CPU's
    variant (or `variant`), with the decode kernel's argument types set. Raises ValueError for
    another dtype, loader.KernelsNotBuilt where the install built no kernels."""
    if dtype not in SUFFIX:
        raise ValueError(f"the CPU attention kernels serve float32 and bfloat16, not {dtype}")
    lib = load_library(LIBRARY[dtype], variant)
    fn = getattr(lib, kernel_name("kvp_paged_decode", dtype))
    if fn.argtypes is None:
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_int64, ctypes.c_float, ctypes.c_int64]
    return lib


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel can serve this layer: float32 or bfloat16 on CPU (query and cache
    alike), contiguous caches, a contiguous head_dim in the query."""
    return (query.dtype in SUFFIX and k_cache.dtype == query.dtype and query.device.type == "cpu"
            and k_cache.is_contiguous() and query.stride(-1) == 1)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           out: torch.Tensor, seq_lens_cpu: list[int] | None = None) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged KV cache, in place.

    q:            [num_seqs, num_heads, head_dim] float32 or bfloat16 (head_dim contiguous; rows may
                  be strided); the caches and out have its dtype (math in float32 either way)
    k_cache:      [num_blocks, block_size, num_kv_heads, head_dim], contiguous (v_cache likewise)
    block_tables: [num_seqs, max_num_blocks_per_seq] int32, contiguous
    seq_lens:     [num_seqs] int32, tokens in the cache including the new one (>= 1)
    out:          [num_seqs, num_heads, head_dim], contiguous; written and returned
    Raises ValueError on mismatched shapes or dtypes, loader.KernelsNotBuilt where the install
    built no kernels, RuntimeError when the kernel runs out of memory."""
    if q.dtype not in SUFFIX:
        raise ValueError(f"paged_decode_attention: q must be float32 or bfloat16, not {q.dtype}")
    lib = load(q.dtype)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, kd = k_cache.shape
    if (kd != head_dim or v_cache.shape != k_cache.shape or num_heads % num_kv_heads
            or out.shape != q.shape or not out.is_contiguous() or block_tables.dtype != torch.int32
            or seq_lens.dtype != torch.int32 or seq_lens.shape != (num_seqs,)
            or block_tables.shape[0] != num_seqs or not block_tables.is_contiguous()
            or not (q.dtype == out.dtype == k_cache.dtype == v_cache.dtype) or q.dtype not in SUFFIX
            or not (k_cache.is_contiguous() and v_cache.is_contiguous()) or q.stride(-1) != 1):
        raise ValueError(f"paged_decode_attention: bad shapes/dtypes q {tuple(q.shape)} {q.dtype}, "
                         f"cache {tuple(k_cache.shape)} {k_cache.dtype}, tables {tuple(block_tables.shape)} "
                         f"{block_tables.dtype}, seq_lens {tuple(seq_lens.shape)} {seq_lens.dtype}")
    if num_seqs == 0:
        return out
    fn = getattr(lib, kernel_name("kvp_paged_decode", q.dtype))
    common = (q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
              block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(), out.data_ptr())
    tail = (num_heads, num_kv_heads, head_dim, block_size, scale)
    lens = seq_lens_cpu if seq_lens_cpu is not None else seq_lens.tolist()
    _run_rows(fn, common, tail, lens, num_kv_heads)
    return out


def attention_threads(lens: list[int], num_kv_heads: int) -> int:
    """Threads for one layer's decode attention over sequences of `lens` cached tokens: the
    engine's planned width (threads.partition_width: torch's thread count unless the engine set
    one) when the layer's work reaches PARALLEL_MIN_WORK, else 1 (no parallel region). The kernel
    cuts long sequences into parts by this number and runs them on the calling thread's team,
    at most this many threads (csrc/attention.c), so fewer sequences than threads still take
    them all."""
    threads = partition_width()
    return threads if threads > 1 and sum(lens) * num_kv_heads >= PARALLEL_MIN_WORK else 1


def _run_rows(fn, head: tuple, tail: tuple, lens: list[int], num_kv_heads: int) -> None:
    """Calls fn(*head, 0, num_seqs, *tail, attention_threads(lens, num_kv_heads))."""
    with kernel_range("attention_decode"):
        code = fn(*head, 0, len(lens), *tail, attention_threads(lens, num_kv_heads))
    if code:
        raise RuntimeError("CPU decode kernel: out of memory for the score buffer")


class FusedDecode:
    """The decode side of every attention layer of one step, one C call per layer
    (`kvp_rope_cache_decode_f32` / `_bf16`): per decode row, RoPE (rotate-half) of q and k with the
    row's cos/sin, the rotated k and the v stored at the row's cache slot, then attention
    over the sequence's paged K/V. Built once per step from its metadata (validated here);
    each layer then passes its qkv, caches and output.

    cos, sin:     [num_seqs, 1 or nothing, head_dim / 2] float32 or bfloat16, head_dim / 2
                  contiguous; their dtype is the step's (qkv and the caches have it too)
    slots:        [num_seqs] int64, contiguous: flat cache slot of each row's new token
    block_tables: [num_seqs, max_num_blocks_per_seq] int32, contiguous
    seq_lens:     [num_seqs] int32 (>= 1, the new token included), contiguous
    Raises ValueError on mismatched shapes/dtypes (check `supports` first),
    loader.KernelsNotBuilt where the install built no kernels. Source: vLLM PagedAttention; HF Llama rotate_half."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, seq_lens_cpu: list[int], num_heads: int, scale: float) -> None:
        self.dtype = cos.dtype
        self.fn = _bind_fused(load(self.dtype), self.dtype)
        n = len(seq_lens_cpu)
        cos, sin = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)
        if (cos.shape != sin.shape or cos.shape[0] != n or cos.stride() != sin.stride() or cos.stride(-1) != 1
                or sin.dtype != cos.dtype
                or slots.dtype != torch.int64 or slots.shape != (n,) or not slots.is_contiguous()
                or block_tables.dtype != torch.int32 or block_tables.shape[0] != n
                or not block_tables.is_contiguous() or seq_lens.dtype != torch.int32
                or seq_lens.shape != (n,) or not seq_lens.is_contiguous()):
            raise ValueError(f"FusedDecode: bad metadata cos {tuple(cos.shape)} {cos.dtype}, slots "
                             f"{tuple(slots.shape)} {slots.dtype}, tables {tuple(block_tables.shape)} "
                             f"{block_tables.dtype}, seq_lens {tuple(seq_lens.shape)} {seq_lens.dtype}")
        self.keep = (cos, sin, slots, block_tables, seq_lens)  # alive while the pointers are used
        self.meta_ptrs = (cos.data_ptr(), sin.data_ptr(), cos.stride(0), slots.data_ptr())
        self.table_ptrs = (block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr())
        self.lens, self.num_heads, self.half, self.scale = seq_lens_cpu, num_heads, cos.shape[1], scale

    def __call__(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """qkv [num_seqs, num_heads + 2 num_kv_heads, head_dim] (the fused projection; head_dim
        contiguous), caches [num_blocks, block_size, num_kv_heads, head_dim] contiguous, all in
        the step's dtype (written at the slots) -> attention output [num_seqs, num_heads, head_dim]:
        `out` where given (contiguous, that shape and dtype: e.g. the first rows of a mixed step's
        output, whose prefill rows another kernel fills), else a new tensor."""
        n, _, head_dim = qkv.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        if (not _qkv_and_caches_fit(qkv, k_cache, v_cache, len(self.lens), self.num_heads, self.half, self.dtype)
                or self.num_heads % num_kv_heads
                or (out is not None and (out.shape != (n, self.num_heads, head_dim) or out.dtype != self.dtype
                                         or not out.is_contiguous()))):
            raise ValueError(f"FusedDecode: bad qkv {tuple(qkv.shape)} {qkv.dtype}, cache "
                             f"{tuple(k_cache.shape)} {k_cache.dtype} or out "
                             f"{None if out is None else (tuple(out.shape), out.dtype)}")
        if out is None:
            out = torch.empty(n, self.num_heads, head_dim, dtype=self.dtype)
        if n:
            head = (qkv.data_ptr(), qkv.stride(0), *self.meta_ptrs, k_cache.data_ptr(), v_cache.data_ptr(),
                    *self.table_ptrs, out.data_ptr())
            _run_rows(self.fn, head, (self.num_heads, num_kv_heads, head_dim, block_size, self.scale),
                      self.lens, num_kv_heads)
        return out


class PrefillRope:
    """RoPE (rotate-half) of the prefill/extend rows of every attention layer of one step, one C
    call per layer (`kvp_rope_cache_write_f32` / `_bf16`): per row, q and k rotated in float32 with
    the row's cos/sin, the rotated q returned (rounded once to the step's dtype), the rotated k and
    the v stored at the row's cache slot. Built once per step (validated here), as FusedDecode,
    whose decode rows get the same rotation.

    cos, sin: [rows, 1 or nothing, head_dim / 2] float32 or bfloat16, head_dim / 2 contiguous
    slots:    [rows] int64, contiguous: flat cache slot of each row's token
    Raises ValueError on mismatched shapes/dtypes, loader.KernelsNotBuilt where the install built
    no kernels. Source: HF Llama rotate_half (the rotation; its bf16 ops round after each product)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, num_heads: int) -> None:
        self.dtype = cos.dtype
        self.fn = _bind_rope_write(load(self.dtype), self.dtype)
        cos, sin = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)
        n = cos.shape[0]
        if (cos.shape != sin.shape or cos.stride() != sin.stride() or cos.stride(-1) != 1 or sin.dtype != cos.dtype
                or slots.dtype != torch.int64 or slots.shape != (n,) or not slots.is_contiguous()):
            raise ValueError(f"PrefillRope: bad metadata cos {tuple(cos.shape)} {cos.dtype}, sin "
                             f"{tuple(sin.shape)}, slots {tuple(slots.shape)} {slots.dtype}")
        self.keep = (cos, sin, slots)  # alive while the pointers are used
        self.ptrs = (cos.data_ptr(), sin.data_ptr(), cos.stride(0), slots.data_ptr())
        self.rows, self.num_heads, self.half = n, num_heads, cos.shape[1]

    def __call__(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """qkv [rows, num_heads + 2 num_kv_heads, head_dim] (the fused projection; head_dim
        contiguous), caches [num_blocks, block_size, num_kv_heads, head_dim] contiguous, all in the
        step's dtype (k and v written at the slots) -> the rotated q [rows, num_heads, head_dim], a new
        tensor. Uses torch.get_num_threads() threads."""
        n, _, head_dim = qkv.shape
        num_kv_heads = k_cache.shape[2]
        if not _qkv_and_caches_fit(qkv, k_cache, v_cache, self.rows, self.num_heads, self.half, self.dtype):
            raise ValueError(f"PrefillRope: bad qkv {tuple(qkv.shape)} {qkv.dtype} or cache "
                             f"{tuple(k_cache.shape)} {k_cache.dtype}")
        q = torch.empty(n, self.num_heads, head_dim, dtype=self.dtype)
        if n:
            with kernel_range("rope_cache_write"):
                self.fn(qkv.data_ptr(), qkv.stride(0), *self.ptrs, k_cache.data_ptr(), v_cache.data_ptr(),
                        q.data_ptr(), n, self.num_heads, num_kv_heads, head_dim, torch.get_num_threads())
        return q


def _qkv_and_caches_fit(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: int, num_heads: int,
                        half: int, dtype: torch.dtype) -> bool:
    """Whether a layer's qkv [rows, num_heads + 2 num_kv_heads, head_dim] (heads and head_dim
    contiguous) and its caches [num_blocks, block_size, num_kv_heads, head_dim] (contiguous, one
    shape) fit a step built for `rows` rows, `num_heads` query heads and cos/sin rows of `half`
    values, all in `dtype` (FusedDecode's and PrefillRope's check of each layer's call)."""
    n, heads, head_dim = qkv.shape
    num_kv_heads = k_cache.shape[2]
    return (n == rows and k_cache.shape[3] == head_dim and head_dim == 2 * half and v_cache.shape == k_cache.shape
            and heads == num_heads + 2 * num_kv_heads and qkv.stride(1) == head_dim and qkv.stride(2) == 1
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and qkv.dtype == k_cache.dtype == v_cache.dtype == dtype)


def _bind_rope_write(lib: ctypes.CDLL, dtype: torch.dtype):
    fn = getattr(lib, kernel_name("kvp_rope_cache_write", dtype))
    if fn.argtypes is None:
        p, i = ctypes.c_void_p, ctypes.c_int64
        fn.restype = ctypes.c_int
        fn.argtypes = [p, i, p, p, i, p, p, p, p, i, i, i, i, i]
    return fn


def _bind_fused(lib: ctypes.CDLL, dtype: torch.dtype):
    fn = getattr(lib, kernel_name("kvp_rope_cache_decode", dtype))
    if fn.argtypes is None:
        p, i = ctypes.c_void_p, ctypes.c_int64
        fn.restype = ctypes.c_int
        fn.argtypes = [p, i, p, p, i, p, p, p, p, i, p, p, i, i, i, i, i, i, ctypes.c_float, i]
    return fn
