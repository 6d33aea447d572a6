/*
 * vLLM's silu_and_mul (csrc/activation_kernels.cu, for the semantics; in bf16 silu(gate) is
 * rounded before the product with up, as there and in HF's Llama).
 */

#include "kvp.h"

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
