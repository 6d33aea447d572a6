"""The C source of the CPU kernel library (plain C, no torch headers), built by
attention/cpu_decode.py with the system's C compiler and called through ctypes. One source,
two builds: float32, and bfloat16 with `-DKVP_BF16` (activations, weights of the norms and the
KV cache stored as bf16, every sum and product in float32, results rounded to nearest even
as torch's float -> bfloat16 conversion; vLLM's CPU kernels work the same way). Exported names
end in `_f32` or `_bf16`:

- `kvp_paged_decode_*`: decode attention over the paged KV cache (vLLM PagedAttention).
- `kvp_rope_cache_decode_*`: the whole decode side of an attention layer in one call:
  RoPE of q and k, the K/V write at the new token's cache slot, then the attention.
- `kvp_rms_norm_*`: RMSNorm, with vLLM's fused_add_rms_norm (residual += x first).
- `kvp_silu_mul_*`: vLLM's silu_and_mul over the fused gate/up projection.
- `kvp_paged_prefill_*`: causal attention of a layer's prefill/extend chunks over the paged
  cache (attention/cpu_prefill_c.py).

One library so the engine builds one shared object per dtype; each function is called once per
layer (or per norm) for a whole batch, which replaces 5-15 small torch ops each.
Sources: vLLM PagedAttention (SOSP'23), vLLM csrc/layernorm_kernels.cu and
csrc/activation_kernels.cu for the semantics (in bf16 the normalized row and silu(gate) are
rounded before the product with the weight / up, as there and in HF's Llama), HF Llama's
rotate_half RoPE, c10/util/BFloat16.h for the rounding.
"""

from kvpilot.engine.attention.cpu_attend_c import SOURCE as ATTEND_SOURCE
from kvpilot.engine.attention.cpu_prefill_c import PREFILL_SOURCE
from kvpilot.engine.layers.bf16_gemm_c import BF16_CONVERT_SOURCE

SOURCE = r"""
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* kvp_t: the stored element (activations, norm weights, KV cache); math is float32. */
#ifdef KVP_BF16
""" + BF16_CONVERT_SOURCE + r"""
typedef uint16_t kvp_t;  /* bfloat16: the upper half of a float32 */
#define KVP_FN(name) name##_bf16
static inline float kvp_ld(kvp_t x) { return bf16_ld(x); }
static inline kvp_t kvp_st(float f) { return bf16_st(f); }
#else
typedef float kvp_t;
#define KVP_FN(name) name##_f32
static inline float kvp_ld(kvp_t x) { return x; }
static inline kvp_t kvp_st(float f) { return f; }
#endif

""" + ATTEND_SOURCE + r"""
/* One new query token per sequence over its paged K/V (kvp_t: float or bf16, above).
   q: rows [s] at q + s*q_stride_seq, heads at + h*q_stride_head, head_dim contiguous.
   k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
   tables: [num_seqs, max_blocks] int32; lens: [num_seqs] int32 (>= 1, tokens in cache).
   out: [num_seqs, num_heads, head_dim] contiguous. Rows [seq_begin, seq_end) are shared out over
   num_threads OpenMP threads (one thread: no parallel region; a build without OpenMP runs
   them serially). Returns 0, or -1 if out of memory. */
int KVP_FN(kvp_paged_decode)(const kvp_t *q, int64_t q_stride_seq, int64_t q_stride_head,
                         const kvp_t *k_cache, const kvp_t *v_cache,
                         const int32_t *tables, int64_t max_blocks, const int32_t *lens,
                         kvp_t *out, int64_t seq_begin, int64_t seq_end,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t block_size, float scale, int64_t num_threads) {
    const kvp_attn_args a = {q, q_stride_seq, q_stride_head, k_cache, v_cache, tables, max_blocks, lens, out,
                             seq_begin, seq_end, num_heads, num_kv_heads, head_dim, block_size, scale};
    return attend_rows(a, NULL, num_threads);
}

/* Rotate-half RoPE of n_heads heads (x1 = x[:half], x2 = x[half:]) into floats:
   dst = (x1 cos - x2 sin, x2 cos + x1 sin), as HF Llama's rotate_half. */
static void rope_heads(const kvp_t *src, float *dst, int64_t n_heads, int64_t head_dim,
                       const kvp_t *cos, const kvp_t *sin) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < n_heads; ++h) {
        const kvp_t *x = src + h * head_dim;
        float *y = dst + h * head_dim;
        #pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
            const float x1 = kvp_ld(x[i]), x2 = kvp_ld(x[i + half]), c = kvp_ld(cos[i]), sn = kvp_ld(sin[i]);
            y[i] = x1 * c - x2 * sn;
            y[i + half] = x2 * c + x1 * sn;
        }
    }
}

/* Row s's RoPE of q (into qrot) and k, and its K/V write at cache slot slots[s]. */
static void rope_row(const kvp_rope_args *r, int64_t s, const kvp_attn_args *a, float *qrot) {
    const int64_t row = a->num_kv_heads * a->head_dim;
    const kvp_t *src = r->qkv + s * r->qkv_stride, *c = r->cos + s * r->rope_stride, *sn = r->sin + s * r->rope_stride;
    float krot[row];
    kvp_t *kc = r->k_cache + r->slots[s] * row;
    rope_heads(src, qrot, a->num_heads, a->head_dim, c, sn);
    rope_heads(src + a->num_heads * a->head_dim, krot, a->num_kv_heads, a->head_dim, c, sn);
    for (int64_t i = 0; i < row; ++i) kc[i] = kvp_st(krot[i]);
    memcpy(r->v_cache + r->slots[s] * row, src + (a->num_heads + a->num_kv_heads) * a->head_dim, sizeof(kvp_t) * row);
}

/* The whole decode side of an attention layer in one call, per decode row s:
   rotates q and k of row s (RoPE with the row's cos/sin), stores the rotated k and the v
   at flat cache slot slots[s], then attends over the lens[s] tokens of its sequence (the
   new one included).
   qkv: row s at qkv + s*qkv_stride: num_heads q heads, then num_kv_heads k heads, then
        num_kv_heads v heads, each head_dim contiguous (the fused qkv projection).
   cos, sin: row s at + s*rope_stride, head_dim/2 values (the row's position).
   slots: [num_seqs] int64. Other arguments as kvp_paged_decode_f32. Returns 0 or -1. */
int KVP_FN(kvp_rope_cache_decode)(const kvp_t *qkv, int64_t qkv_stride, const kvp_t *cos, const kvp_t *sin,
                              int64_t rope_stride, const int64_t *slots, kvp_t *k_cache, kvp_t *v_cache,
                              const int32_t *tables, int64_t max_blocks, const int32_t *lens,
                              kvp_t *out, int64_t seq_begin, int64_t seq_end,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                              int64_t block_size, float scale, int64_t num_threads) {
    const kvp_attn_args a = {NULL, 0, 0, k_cache, v_cache, tables, max_blocks, lens, out,
                             seq_begin, seq_end, num_heads, num_kv_heads, head_dim, block_size, scale};
    const kvp_rope_args r = {qkv, cos, sin, qkv_stride, rope_stride, slots, k_cache, v_cache};
    return attend_rows(a, &r, num_threads);
}

/* From this many elements (a prefill chunk's rows, not a decode step's) RMSNorm and SiLU*mul
   share their rows out over the calling thread's OpenMP team (torch's thread count); each row is
   computed by one thread as before, so results do not change. */
#define ELEMENTWISE_PARALLEL_MIN 65536

/* RMSNorm over rows of `hidden` values, vLLM's fused_add_rms_norm when residual != NULL:
   residual += x, then out = residual / sqrt(mean(residual^2) + eps) * w; else
   out = x / sqrt(mean(x^2) + eps) * w (in bf16 the normalized value is rounded before the
   product, as HF and vLLM do). Rows are contiguous; out may be x. */
void KVP_FN(kvp_rms_norm)(kvp_t *x, kvp_t *residual, const kvp_t *w, kvp_t *out,
                          int64_t rows, int64_t hidden, float eps) {
    #pragma omp parallel for schedule(static) if (rows > 1 && rows * hidden >= ELEMENTWISE_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; ++r) {
        kvp_t *xr = x + r * hidden, *o = out + r * hidden;
        const kvp_t *src = xr;
        if (residual) {
            kvp_t *res = residual + r * hidden;
            #pragma omp simd
            for (int64_t i = 0; i < hidden; ++i) res[i] = kvp_st(kvp_ld(res[i]) + kvp_ld(xr[i]));
            src = res;
        }
        float ss = 0.f;
        #pragma omp simd reduction(+:ss)
        for (int64_t i = 0; i < hidden; ++i) ss += kvp_ld(src[i]) * kvp_ld(src[i]);
        const float inv = 1.f / sqrtf(ss / (float)hidden + eps);
        #pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) o[i] = kvp_st(kvp_ld(kvp_st(kvp_ld(src[i]) * inv)) * kvp_ld(w[i]));
    }
}

/* vLLM's silu_and_mul: gate_up rows [gate (inter) | up (inter)] contiguous ->
   out[r][i] = silu(gate) * up, silu(g) = g / (1 + exp(-g)) (rounded before the product in bf16). */
void KVP_FN(kvp_silu_mul)(const kvp_t *gate_up, kvp_t *out, int64_t rows, int64_t inter) {
    #pragma omp parallel for schedule(static) if (rows > 1 && rows * inter >= ELEMENTWISE_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; ++r) {
        const kvp_t *g = gate_up + r * 2 * inter, *u = g + inter;
        kvp_t *o = out + r * inter;
        #pragma omp simd
        for (int64_t i = 0; i < inter; ++i) {
            const float gi = kvp_ld(g[i]);
            o[i] = kvp_st(kvp_ld(kvp_st(gi / (1.f + expf(-gi)))) * kvp_ld(u[i]));
        }
    }
}
""" + PREFILL_SOURCE
