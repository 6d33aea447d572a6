/*
 * vLLM's silu_and_mul (csrc/activation_kernels.cu, for the semantics; in bf16 silu(gate) is
 * rounded before the product with up, as there and in HF's Llama).
 *
 * silu(g) = g / (1 + e^-g), computed as the equal g / (1 + e^-|g|) for g >= 0 and
 * g e^-|g| / (1 + e^-|g|) for g < 0 (the logistic function's usual stable split): the exponent
 * never overflows, the denominator lies in (1, 2], so silu(-100) is the tiny -3.7e-42 (not the NaN
 * of -100 / inf after -ffast-math's reciprocal) and silu(100) is 100.
 * AVX-512 builds: 32 values a step with an inlined Cephes expf (below); elsewhere the portable
 * loop, which gcc vectorizes through libmvec's expf. The two differ by the exp's and the
 * division's last bits (float32: a few ulp; bf16: now and then one step of the rounded silu).
 */

#include "kvp.h"
#include "kvp_exp.h"

#ifdef KVP_AVX512
/* silu(g) for 16 lanes, the split above (the sign bit decides: -0 takes the g e^-|g| side, which
   is -0 too). The quotient: vrcp14ps (relative error < 2^-14) and one Newton-Raphson step
   (about 2^-28) give 1 / d, d in (1, 2] keeping every step finite; the product with the
   numerator then rounds once (float32: within 3 ulp of silu over the normal range, measured
   against float64; tests/kernels/test_cpu_elementwise.py). A NaN gate stays NaN (numerator). */
static inline __m512 silu16(__m512 g) {
    const __m512 e = exp_neg16(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(g),
                                                                    _mm512_set1_epi32((int)0x80000000u))));
    const __m512 num = _mm512_mask_mul_ps(g, _mm512_movepi32_mask(_mm512_castps_si512(g)), g, e);
    const __m512 d = _mm512_add_ps(e, _mm512_set1_ps(1.f));
    __m512 inv = _mm512_rcp14_ps(d);
    inv = _mm512_fmadd_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(1.f)), inv);
    return _mm512_mul_ps(num, inv);
}

/* One row: o = silu(g) * u, silu rounded to the stored type first; 32 values a step, the tail masked. */
static inline void silu_mul_row(const kvp_t *g, const kvp_t *u, kvp_t *o, int64_t n) {
    for (int64_t i = 0; i < n; i += 32) {
        const int64_t k = n - i;
        const kvp_v32 gv = kvp_ld32_n(g + i, k), uv = kvp_ld32_n(u + i, k);
        kvp_st32_n(o + i, _mm512_mul_ps(kvp_round16(silu16(gv.lo)), uv.lo),
                   _mm512_mul_ps(kvp_round16(silu16(gv.hi)), uv.hi), k);
    }
}
#else
static inline void silu_mul_row(const kvp_t *g, const kvp_t *u, kvp_t *o, int64_t n) {
    #pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
        const float gi = kvp_ld(g[i]), e = expf(-fabsf(gi));
        o[i] = kvp_st(kvp_ld(kvp_st((gi < 0.f ? gi * e : gi) / (1.f + e))) * kvp_ld(u[i]));
    }
}
#endif

/* vLLM's silu_and_mul: gate_up rows [gate (inter) | up (inter)] contiguous ->
   out[r][i] = silu(gate) * up (silu rounded before the product in bf16). Rows are shared out
   over the OpenMP team from ELEMENTWISE_PARALLEL_MIN elements, one thread per row. */
void KVP_FN(kvp_silu_mul)(const kvp_t *gate_up, kvp_t *out, int64_t rows, int64_t inter) {
    #pragma omp parallel for schedule(static) if (rows > 1 && rows * inter >= ELEMENTWISE_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; ++r) silu_mul_row(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter,
                                                    out + r * inter, inter);
}

/* 1 where this build has the AVX-512 RMSNorm and SiLU-and-mul loops, else 0 (the portable ones). */
int kvp_elementwise_simd(void) {
#ifdef KVP_AVX512
    return 1;
#else
    return 0;
#endif
}
