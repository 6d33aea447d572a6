"""Prefill/extend attention on CPU in one C call per layer (float32 or bfloat16, AVX2 builds).

The torch path runs one `scaled_dot_product_attention` per chunk, on torch's CPU flash
attention (MKL GEMMs over [query block x key block] tiles), after gathering the cached
blocks of an extend into a dense copy. `kvp_paged_prefill_f32` (csrc/prefill.c)
attends every chunk of the layer in one call, reading K/V in place through the block tables
(the chunks' own K/V are written to the cache first, as for the decodes), the query rows of a
GQA group sharing each K/V load. In a variant without AVX2 (generic) the caller keeps the torch
path (`available()`). In the amx build the bfloat16 kernel runs on AMX tiles (`amx()`): q.K^T and
p.V by TDPBF16PS, the probabilities rounded to bfloat16 as FlashAttention does on GPUs, so its
results differ from the float32 tiles' in the low bits (within bfloat16's tolerance of the float64
reference).
Source: FlashAttention's online softmax (Dao et al., NeurIPS 2022); vLLM's CPU backend and its
`context_attention_fwd` for the paged layout; vLLM's csrc/cpu attention for bf16 probabilities on AMX.
"""

from __future__ import annotations

import ctypes

import torch

from kvpilot.kernels.cpu import attention as cpu_decode
from kvpilot.kernels.cpu.loader import kernel_range


def _fn(dtype: torch.dtype = torch.float32, variant: str | None = None):
    """kvp_paged_prefill_f32 / _bf16 of the attention library for `dtype` with its argtypes, or
    None in a variant without AVX2."""
    lib = cpu_decode.load(dtype, variant)
    if not lib.kvp_prefill_simd():
        return None
    fn = getattr(lib, cpu_decode.kernel_name("kvp_paged_prefill", dtype))
    if fn.argtypes is None:
        p, i = ctypes.c_void_p, ctypes.c_int64
        fn.restype = ctypes.c_int
        fn.argtypes = [p, i, i, p, p, p, i, p, p, i, p, i, i, i, i, i, ctypes.c_float, i]
    return fn


def amx(variant: str | None = None) -> bool:
    """Whether the bfloat16 kernel of this CPU's variant (or `variant`) runs on AMX tiles
    (TDPBF16PS for q.K^T and p.V, the probabilities rounded to bfloat16): the amx build, on a
    Linux kernel that grants the process the tile state. Elsewhere, and always for float32, the
    float32 register tiles serve. Raises loader.KernelsNotBuilt where the install built no kernels."""
    return bool(cpu_decode.load(torch.bfloat16, variant).kvp_prefill_amx())


def available(dtype: torch.dtype = torch.float32, variant: str | None = None) -> bool:
    """Whether the kernel runs for `dtype` in this CPU's variant (or `variant`): AVX2 and FMA."""
    return _fn(dtype, variant) is not None


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor,
                            scale: float, out: torch.Tensor) -> torch.Tensor:
    """Causal attention of prefill/extend chunks over their sequences' paged K/V, into `out`.

    q:            [num_tokens, num_heads, head_dim] float32 or bfloat16 (the caches and out alike;
                  math in float32), head_dim contiguous (rows and heads may be strided, e.g. a
                  view of the fused qkv projection)
    k_cache:      [num_blocks, block_size, num_kv_heads, head_dim], contiguous, holding
                  every chunk's own K/V already (v_cache likewise)
    block_tables: [num_seqs, max_num_blocks_per_seq] int32, contiguous
    query_start:  [num_seqs + 1] int32: chunk s is rows [query_start[s], query_start[s + 1]) of q
    seq_lens:     [num_seqs] int32: tokens of sequence s in the cache, its chunk included; the
                  chunk's queries sit at its last positions and attend to keys at or before them
    out:          [num_tokens, num_heads, head_dim], last two dims contiguous
    Uses torch.get_num_threads() threads. Raises ValueError on bad shapes, dtypes or a head_dim
    not a multiple of 16, RuntimeError in a variant without it (check `available()`) or when
    it runs out of memory."""
    fn = _fn(q.dtype) if q.dtype in cpu_decode.SUFFIX else None
    if fn is None:
        raise RuntimeError(f"the CPU prefill attention kernel is not available for {q.dtype}")
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, kd = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if (kd != head_dim or head_dim % 16 or num_heads % num_kv_heads or v_cache.shape != k_cache.shape
            or not (q.dtype == out.dtype == k_cache.dtype == v_cache.dtype)
            or q.stride(-1) != 1 or out.shape != q.shape or out.stride(2) != 1 or out.stride(1) != head_dim
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or block_tables.dtype != torch.int32 or not block_tables.is_contiguous()
            or block_tables.shape[0] != num_seqs or query_start.dtype != torch.int32
            or query_start.shape != (num_seqs + 1,) or not query_start.is_contiguous()
            or seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous()):
        raise ValueError(f"paged_prefill_attention: bad shapes/dtypes q {tuple(q.shape)} {q.dtype} stride "
                         f"{q.stride()}, cache {tuple(k_cache.shape)} {k_cache.dtype}, tables "
                         f"{tuple(block_tables.shape)} {block_tables.dtype}, query_start "
                         f"{tuple(query_start.shape)} {query_start.dtype}, seq_lens {tuple(seq_lens.shape)}")
    with kernel_range("attention_prefill"):
        code = fn(q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
                  block_tables.data_ptr(), block_tables.shape[1], query_start.data_ptr(), seq_lens.data_ptr(),
                  num_seqs, out.data_ptr(), out.stride(0), num_heads, num_kv_heads, head_dim, block_size,
                  scale, torch.get_num_threads())
    if code:
        raise RuntimeError(f"paged_prefill_attention: the kernel failed ({'out of memory' if code == -1 else code})")
    return out


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel can serve a layer's prefill/extend chunks: what the decode kernel needs
    (`attention.supports`: float32 or bfloat16 on CPU, a contiguous cache, head_dim contiguous),
    head_dim a multiple of 16, and a variant with AVX2."""
    return cpu_decode.supports(query, k_cache) and query.shape[-1] % 16 == 0 and available(query.dtype)


class PrefillBatch:
    """A step's prefill/extend chunks for `paged_prefill_attention`, built once per step from the
    AttentionMetadata fields of sequences [first_seq, num_seqs) (the decodes come first).

    query_start_loc_cpu: [num_seqs + 1] ints; seq_lens_cpu: [num_seqs] ints; block_tables:
    [num_seqs, max_num_blocks_per_seq] int32. The chunks' rows start at row
    query_start_loc_cpu[first_seq] of the batch (`first_row`)."""

    def __init__(self, query_start_loc_cpu: list[int], seq_lens_cpu: list[int], block_tables: torch.Tensor,
                 first_seq: int) -> None:
        starts = query_start_loc_cpu[first_seq:]
        self.first_row = starts[0]
        self.query_start = torch.tensor([s - starts[0] for s in starts], dtype=torch.int32)
        self.seq_lens = torch.tensor(seq_lens_cpu[first_seq:], dtype=torch.int32)
        self.block_tables = block_tables[first_seq:].to(torch.int32).contiguous()

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                 out: torch.Tensor) -> torch.Tensor:
        """Attention of the chunks' rows q [chunk tokens, num_heads, head_dim] into out (same shape)."""
        return paged_prefill_attention(q, k_cache, v_cache, self.block_tables, self.query_start, self.seq_lens,
                                       scale, out)
