"""A fused paged decode-attention kernel for CPU in plain C, built with the system's C
compiler at first use and called through ctypes; float32 only.

Why: the pure-torch decode path gathers every sequence's K/V blocks into a dense
workspace (two copies per layer), then runs SDPA with a boolean length mask that SDPA
converts to a float mask in every layer: about 25 tensor ops per layer, 750 per step of
the 30-layer SmolLM2, whatever the batch. This kernel reads each sequence's K/V rows in
place through its block table (`slot = block_table[t // block_size] * block_size +
t % block_size`, as vLLM's PagedAttention) in one call per layer, reading each K/V row
once for all query heads of its GQA group. ctypes releases the GIL during the call, so
large batches are split over `torch.get_num_threads()` Python threads.

Needs only a C compiler (`$CC`, else `cc`); built and cached by engine/cpu_build.py, keyed
by the source, the flags and the CPU's ISA flags (`-march=native`). Where it cannot build (no compiler, a
build error, a read-only cache with no writable temp dir) or `KVPILOT_CPU_KERNELS=0`,
`load()` returns None once with a warning and the torch path is used.
Source: vLLM PagedAttention (SOSP'23); two-pass softmax as in the math of SDPA.
"""

from __future__ import annotations

import ctypes
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import torch

from kvpilot.engine.cpu_build import build_library

logger = logging.getLogger("kvpilot.engine.attention.cpu_decode")

# Below this many (sequence x cached token) pairs a layer's attention costs less than
# handing half of it to a second thread.
PARALLEL_MIN_WORK = 8192

_SOURCE = r"""
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* One new query token per sequence over its paged K/V.
   q: rows [s] at q + s*q_stride_seq, heads at + h*q_stride_head, head_dim contiguous.
   k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
   tables: [num_seqs, max_blocks] int32; lens: [num_seqs] int32 (>= 1, tokens in cache).
   out: [num_seqs, num_heads, head_dim] contiguous. Returns 0, or -1 if out of memory. */
int kvp_paged_decode_f32(const float *q, int64_t q_stride_seq, int64_t q_stride_head,
                         const float *k_cache, const float *v_cache,
                         const int32_t *tables, int64_t max_blocks, const int32_t *lens,
                         float *out, int64_t seq_begin, int64_t seq_end,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t block_size, float scale) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim;
    int64_t max_len = 1;
    for (int64_t s = seq_begin; s < seq_end; ++s) if (lens[s] > max_len) max_len = lens[s];
    float *scores = malloc(sizeof(float) * group * max_len);
    float *acc = malloc(sizeof(float) * group * head_dim);
    if (!scores || !acc) { free(scores); free(acc); return -1; }
    for (int64_t s = seq_begin; s < seq_end; ++s) {
        const int64_t len = lens[s];
        const int32_t *table = tables + s * max_blocks;
        for (int64_t g = 0; g < num_kv_heads; ++g) {
            const float *qg = q + s * q_stride_seq + g * group * q_stride_head;
            for (int64_t t = 0; t < len; ++t) {
                const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
                const float *k = k_cache + slot * row + g * head_dim;
                for (int64_t j = 0; j < group; ++j) {
                    const float *qh = qg + j * q_stride_head;
                    float dot = 0.f;
                    #pragma omp simd reduction(+:dot)
                    for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * k[d];
                    scores[j * len + t] = dot * scale;
                }
            }
            for (int64_t j = 0; j < group; ++j) {
                float *sc = scores + j * len;
                float m = -FLT_MAX, sum = 0.f;
                for (int64_t t = 0; t < len; ++t) m = sc[t] > m ? sc[t] : m;
                #pragma omp simd reduction(+:sum)
                for (int64_t t = 0; t < len; ++t) { sc[t] = expf(sc[t] - m); sum += sc[t]; }
                const float inv = 1.f / sum;
                for (int64_t t = 0; t < len; ++t) sc[t] *= inv;
            }
            for (int64_t i = 0; i < group * head_dim; ++i) acc[i] = 0.f;
            for (int64_t t = 0; t < len; ++t) {
                const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
                const float *v = v_cache + slot * row + g * head_dim;
                for (int64_t j = 0; j < group; ++j) {
                    const float p = scores[j * len + t];
                    float *a = acc + j * head_dim;
                    #pragma omp simd
                    for (int64_t d = 0; d < head_dim; ++d) a[d] += p * v[d];
                }
            }
            float *o = out + (s * num_heads + g * group) * head_dim;
            for (int64_t i = 0; i < group * head_dim; ++i) o[i] = acc[i];
        }
    }
    free(scores);
    free(acc);
    return 0;
}
"""

# Tried in order; the first that builds wins: (compile flags, link flags). -ffast-math lets
# gcc vectorize expf through glibc's libmvec and reassociate the dot products (finite inputs
# only: the cache holds finite values everywhere, attention/backend.py). It is a compile flag
# only: linking a shared library with -ffast-math adds crtfastmath.o, whose constructor sets
# the FTZ/DAZ bits of the whole process when the library loads, so every later float
# computation in the server (numpy, hypothesis, torch) would flush subnormals to zero.
_FLAG_SETS = (
    (["-O3", "-march=native", "-fopenmp-simd", "-ffast-math"], ["-lmvec", "-lm"]),
    (["-O3", "-march=native", "-fopenmp-simd"], ["-lm"]),
    (["-O2"], ["-lm"]),
)


@lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    """The compiled kernel library, or None (logged once) where it cannot be built or
    KVPILOT_CPU_KERNELS=0 disables it (engine/cpu_build.py)."""
    lib = build_library("paged_decode", _SOURCE, _FLAG_SETS, logger, "the torch path")
    if lib is None:
        return None
    fn = lib.kvp_paged_decode_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_float]
    return lib


_pools: dict[tuple[int, int], ThreadPoolExecutor] = {}


def _pool(threads: int) -> ThreadPoolExecutor:
    """A pool per (process, size): a forked worker (tensor/pipeline ranks) must not
    inherit its parent's pool, whose threads do not exist in the child."""
    key = (os.getpid(), threads)
    pool = _pools.get(key)
    if pool is None:
        pool = _pools[key] = ThreadPoolExecutor(threads, thread_name_prefix="kvpilot-attn")
    return pool


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel can serve this layer: float32 on CPU, contiguous caches, a
    contiguous head_dim in the query, and the library built."""
    return (query.dtype == torch.float32 and k_cache.dtype == torch.float32 and query.device.type == "cpu"
            and k_cache.is_contiguous() and query.stride(-1) == 1 and load() is not None)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           out: torch.Tensor, seq_lens_cpu: list[int] | None = None) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged KV cache, in place.

    q:            [num_seqs, num_heads, head_dim] float32 (head_dim contiguous; rows may be strided)
    k_cache:      [num_blocks, block_size, num_kv_heads, head_dim] float32, contiguous (v_cache likewise)
    block_tables: [num_seqs, max_num_blocks_per_seq] int32, contiguous
    seq_lens:     [num_seqs] int32, tokens in the cache including the new one (>= 1)
    out:          [num_seqs, num_heads, head_dim] float32, contiguous; written and returned
    Raises ValueError on mismatched shapes or dtypes, RuntimeError when the kernel is not
    built (check `supports` first) or runs out of memory."""
    lib = load()
    if lib is None:
        raise RuntimeError("the CPU decode kernel is not available")
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, kd = k_cache.shape
    if (kd != head_dim or v_cache.shape != k_cache.shape or num_heads % num_kv_heads
            or out.shape != q.shape or not out.is_contiguous() or block_tables.dtype != torch.int32
            or seq_lens.dtype != torch.int32 or seq_lens.shape != (num_seqs,)
            or block_tables.shape[0] != num_seqs or not block_tables.is_contiguous()
            or not (q.dtype == out.dtype == k_cache.dtype == v_cache.dtype == torch.float32)
            or not (k_cache.is_contiguous() and v_cache.is_contiguous()) or q.stride(-1) != 1):
        raise ValueError(f"paged_decode_attention: bad shapes/dtypes q {tuple(q.shape)} {q.dtype}, "
                         f"cache {tuple(k_cache.shape)} {k_cache.dtype}, tables {tuple(block_tables.shape)} "
                         f"{block_tables.dtype}, seq_lens {tuple(seq_lens.shape)} {seq_lens.dtype}")
    if num_seqs == 0:
        return out
    fn = lib.kvp_paged_decode_f32
    common = (q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
              block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(), out.data_ptr())
    tail = (num_heads, num_kv_heads, head_dim, block_size, scale)
    lens = seq_lens_cpu if seq_lens_cpu is not None else seq_lens.tolist()
    threads = min(torch.get_num_threads(), num_seqs)
    if threads > 1 and sum(lens) * num_kv_heads >= PARALLEL_MIN_WORK:
        cuts = _balanced_cuts(lens, threads)
        jobs = [_pool(threads).submit(fn, *common, a, b, *tail) for a, b in zip(cuts, cuts[1:])]
        codes = [j.result() for j in jobs]
    else:
        codes = [fn(*common, 0, num_seqs, *tail)]
    if any(codes):
        raise RuntimeError("paged_decode_attention: out of memory for the score buffer")
    return out


def _balanced_cuts(lens: list[int], parts: int) -> list[int]:
    """Row boundaries [0, ..., len(lens)] splitting lens into `parts` runs of about equal sum."""
    total, cuts, acc = sum(lens), [0], 0
    for i, n in enumerate(lens):
        acc += n
        if acc * parts >= total * len(cuts) and len(cuts) < parts and i + 1 < len(lens):
            cuts.append(i + 1)
    cuts.append(len(lens))
    return cuts
