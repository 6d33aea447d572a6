/*
 * RMSNorm with vLLM's fused residual add (csrc/layernorm_kernels.cu fused_add_rms_norm, for the
 * semantics; in bf16 the normalized row is rounded before the product with the weight, as there
 * and in HF's Llama).
 *
 * Two passes over a row: (1) residual += x, stored rounded to the stored type, while the sum of
 * squares of those rounded values accumulates (vLLM's kernel fuses the same two steps); (2) out =
 * rounded(residual * inv_rms) * w. AVX-512 builds do both 32 values a step with 4 partial sums
 * (another summation order than the portable loop: inv_rms may differ in its last bit, which
 * now and then moves a rounded bf16 output by a step; the stored residual is bit-identical, it is
 * one rounding of an exact float sum either way).
 */

#include "kvp.h"

#ifdef KVP_AVX512
/* 32 values of the row from i (the first n where n < 32): with a residual, res = kvp_st(res + x)
   stored and returned as the floats it now holds; without, x. Lanes past n read as 0. */
static inline kvp_v32 norm_src32(const kvp_t *x, kvp_t *res, int64_t n) {
    kvp_v32 v = kvp_ld32_n(x, n);
    if (res) {
        const kvp_v32 r = kvp_ld32_n(res, n);
        v.lo = kvp_round16(_mm512_add_ps(r.lo, v.lo)), v.hi = kvp_round16(_mm512_add_ps(r.hi, v.hi));
        kvp_st32_n(res, v.lo, v.hi, n);  /* already rounded: storing rounds them to themselves */
    }
    return v;
}

static inline void rms_norm_row(kvp_t *x, kvp_t *res, const kvp_t *w, kvp_t *o, int64_t hidden, float eps) {
    /* 4 partial sums: one FMA chain would be bound by its latency, not by the loads */
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 64 <= hidden; i += 64) {
        const kvp_v32 v = norm_src32(x + i, res ? res + i : NULL, 32);
        const kvp_v32 v2 = norm_src32(x + i + 32, res ? res + i + 32 : NULL, 32);
        a0 = _mm512_fmadd_ps(v.lo, v.lo, a0), a1 = _mm512_fmadd_ps(v.hi, v.hi, a1);
        a2 = _mm512_fmadd_ps(v2.lo, v2.lo, a2), a3 = _mm512_fmadd_ps(v2.hi, v2.hi, a3);
    }
    for (; i < hidden; i += 32) {
        const kvp_v32 v = norm_src32(x + i, res ? res + i : NULL, hidden - i);
        a0 = _mm512_fmadd_ps(v.lo, v.lo, a0), a1 = _mm512_fmadd_ps(v.hi, v.hi, a1);
    }
    const float ss = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    const __m512 inv = _mm512_set1_ps(1.f / sqrtf(ss / (float)hidden + eps));
    const kvp_t *src = res ? res : x;
    for (i = 0; i < hidden; i += 32) {
        const kvp_v32 s = kvp_ld32_n(src + i, hidden - i), wv = kvp_ld32_n(w + i, hidden - i);
        kvp_st32_n(o + i, _mm512_mul_ps(kvp_round16(_mm512_mul_ps(s.lo, inv)), wv.lo),
                   _mm512_mul_ps(kvp_round16(_mm512_mul_ps(s.hi, inv)), wv.hi), hidden - i);
    }
}
#else
static inline void rms_norm_row(kvp_t *x, kvp_t *res, const kvp_t *w, kvp_t *o, int64_t hidden, float eps) {
    float ss = 0.f;
    if (res) {
        #pragma omp simd reduction(+:ss)
        for (int64_t i = 0; i < hidden; ++i) {
            res[i] = kvp_st(kvp_ld(res[i]) + kvp_ld(x[i]));
            const float v = kvp_ld(res[i]);
            ss += v * v;
        }
    } else {
        #pragma omp simd reduction(+:ss)
        for (int64_t i = 0; i < hidden; ++i) ss += kvp_ld(x[i]) * kvp_ld(x[i]);
    }
    const float inv = 1.f / sqrtf(ss / (float)hidden + eps);
    const kvp_t *src = res ? res : x;
    #pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) o[i] = kvp_st(kvp_ld(kvp_st(kvp_ld(src[i]) * inv)) * kvp_ld(w[i]));
}
#endif

/* RMSNorm over rows of `hidden` values, vLLM's fused_add_rms_norm when residual != NULL:
   residual += x, then out = residual / sqrt(mean(residual^2) + eps) * w; else
   out = x / sqrt(mean(x^2) + eps) * w (in bf16 the normalized value is rounded before the
   product, as HF and vLLM do). Rows are contiguous; out may be x. Rows are shared out over the
   OpenMP team from ELEMENTWISE_PARALLEL_MIN elements, one thread per row. */
void KVP_FN(kvp_rms_norm)(kvp_t *x, kvp_t *residual, const kvp_t *w, kvp_t *out,
                          int64_t rows, int64_t hidden, float eps) {
    #pragma omp parallel for schedule(static) if (rows > 1 && rows * hidden >= ELEMENTWISE_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; ++r)
        rms_norm_row(x + r * hidden, residual ? residual + r * hidden : NULL, w, out + r * hidden, hidden, eps);
}
