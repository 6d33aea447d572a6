/*
 * Random sampling of one token per row in one pass over the logits (Python face:
 * kernels/cpu/sample.py; engine/sample/sampler.py uses it for rows with a temperature and no
 * top-k, top-p or min-p).
 *
 * The Gumbel-max trick: argmax_i (l_i / T + g_i), with g_i = -log(-log u_i) and u_i uniform on
 * (0, 1), is a draw from softmax(l / T). It is the exponential race vLLM's sampler runs
 * (argmax_i p_i / q_i with q_i = -log u_i ~ Exp(1): log of it is log p_i - log q_i, the same
 * order), without the [rows, vocab] tensors of probabilities and noise: torch's softmax, uniform_,
 * log_ and division each wrote and read a 12.6 MB tensor for 64 rows of SmolLM2's 49,152 logits,
 * and its allocator returned each one to the system between steps (page faults on every use).
 *
 * The uniforms come from a counter-based generator: u_i from SplitMix64's output function of
 * key + (i + 1) * 0x9E3779B97F4A7C15 (Steele, Lea and Flood, "Fast splittable pseudorandom number
 * generators", OOPSLA 2014; the mix passes BigCrush as a generator), its top 24 bits plus a half
 * scaled into (0, 1), so the row's key (drawn by the caller from the request's generator) fixes
 * every draw and any element can be computed on its own, in vector lanes. The logs are a
 * Cephes-style logf (range reduction to [sqrt(1/2), sqrt(2)), a degree-9 polynomial; within 2 ulp
 * on normal inputs, which are all it gets here) written in plain arithmetic so gcc vectorizes the
 * loop without -ffast-math, which would let it assume the -inf logits of masked tokens away. The
 * noise is bounded (the uniforms' 24 bits), so only tokens near the row's largest logit need it.
 * Source: Gumbel (1954); Maddison, Tarlow and Minka, "A* sampling" (NeurIPS 2014) for the trick;
 * vLLM v1 `vllm/v1/sample/ops/topk_topp_sampler.py` `random_sample`; Cephes `logf.c`.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#define SAMPLE_TILE 512 /* scores computed per pass: 2 KB, stays in L1 */

/* log(x) for a positive normal float x (Cephes logf's coefficients). */
static inline float cephes_logf(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    float e = (float)((int32_t)(bits >> 23) - 127);
    bits = (bits & 0x007fffffu) | 0x3f800000u; /* mantissa in [1, 2) */
    float m;
    memcpy(&m, &bits, sizeof m);
    const int big = m > 1.41421356f;
    m = big ? 0.5f * m : m;
    e = big ? e + 1.f : e;
    const float f = m - 1.f, z = f * f;
    float y = 7.0376836292e-2f;
    y = y * f - 1.1514610310e-1f;
    y = y * f + 1.1676998740e-1f;
    y = y * f - 1.2420140846e-1f;
    y = y * f + 1.4249322787e-1f;
    y = y * f - 1.6668057665e-1f;
    y = y * f + 2.0000714765e-1f;
    y = y * f - 2.4999993993e-1f;
    y = y * f + 3.3333331174e-1f;
    y = y * f * z;
    y += -2.12194440e-4f * e;
    y += -0.5f * z;
    return f + y + 0.693359375f * e;
}

/* The uniform (0, 1) draw of element i under key: SplitMix64's mix, top 24 bits, plus a half. */
static inline float uniform01(uint64_t key, uint64_t i) {
    uint64_t z = key + (i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return ((float)(uint32_t)(z >> 40) + 0.5f) * (1.f / 16777216.f);
}

/* Gumbel noise -log(-log u) lies in [G_LOW, G_HIGH] for the uniforms above (u in [2^-25, 1 - 2^-25]:
   -log(17.33) = -2.85 and -log(2.98e-8) = 17.33), so a token whose scaled logit is more than
   G_HIGH - G_LOW below the row's largest can never win; PRUNE_NATS rounds that up by a margin for
   the logs' rounding. */
#define PRUNE_NATS 21.f

/* The draw of one row: the first index of the largest l_i * inv_temp + g_i, or -1 where no
   score is above -inf (every logit -inf or NaN). Exact: the noise is computed only for the tokens
   within PRUNE_NATS of the row's largest scaled logit (the others cannot win), each token's noise
   that of its own index under the key, so the result is the one of computing every score. */
static int64_t sample_row(const float *logits, int64_t vocab, float inv_temp, uint64_t key) {
    float top = -INFINITY;
    #pragma omp simd reduction(max:top)
    for (int64_t i = 0; i < vocab; ++i) top = logits[i] > top ? logits[i] : top;
    if (top == -INFINITY) return -1; /* every logit -inf or NaN */
    const float floor = top * inv_temp - PRUNE_NATS;
    float best = -INFINITY;
    int64_t best_i = -1;
    float v[SAMPLE_TILE], s[SAMPLE_TILE];
    int64_t idx[SAMPLE_TILE];
    for (int64_t i0 = 0; i0 < vocab; i0 += SAMPLE_TILE) {
        const int64_t n = vocab - i0 < SAMPLE_TILE ? vocab - i0 : SAMPLE_TILE;
        int64_t k = 0;
        for (int64_t j = 0; j < n; ++j) { /* the tile's candidates, in index order */
            const float x = logits[i0 + j] * inv_temp;
            if (x >= floor) { v[k] = x; idx[k] = i0 + j; ++k; }
        }
        float mx = -INFINITY;
        #pragma omp simd reduction(max:mx)
        for (int64_t t = 0; t < k; ++t) {
            const float g = -cephes_logf(-cephes_logf(uniform01(key, (uint64_t)idx[t])));
            s[t] = v[t] + g;
            mx = s[t] > mx ? s[t] : mx;
        }
        if (mx > best) {
            for (int64_t t = 0; t < k; ++t)
                if (s[t] == mx) { best_i = idx[t]; break; }
            best = mx;
        }
    }
    return best_i;
}

/* out[r] = the sampled token of row r of logits [rows, vocab] float32 (row stride ld), at
   temperature 1 / inv_temp[r] with the draws of keys[r] (-1 where the row has no finite score);
   rows shared out over num_threads OpenMP threads. */
void kvp_sample_gumbel(const float *logits, int64_t ld, int64_t rows, int64_t vocab, const float *inv_temp,
                       const uint64_t *keys, int64_t *out, int64_t num_threads) {
    #pragma omp parallel for schedule(static) num_threads((int)num_threads) if (num_threads > 1 && rows > 1)
    for (int64_t r = 0; r < rows; ++r) out[r] = sample_row(logits + r * ld, vocab, inv_temp[r], keys[r]);
}
