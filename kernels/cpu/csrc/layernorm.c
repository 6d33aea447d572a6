/*
 * RMSNorm with vLLM's fused residual add (csrc/layernorm_kernels.cu fused_add_rms_norm, for the
 * semantics; in bf16 the normalized row is rounded before the product with the weight, as there
 * and in HF's Llama).
 */

#include "kvp.h"

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
