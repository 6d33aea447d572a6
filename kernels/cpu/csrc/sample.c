/*
 * Random sampling of one token per row straight from the logits (Python face: kernels/cpu/sample.py;
 * engine/sample/sampler.py uses it for rows with a temperature and no top-k, top-p or min-p).
 *
 * Inverse transform sampling: with p_i = exp((l_i - max l) / T) (softmax(l / T) before its
 * normalization, S = sum p_i) and one uniform u per row, the token is the first i whose running sum
 * p_0 + ... + p_i exceeds u * S: a draw from softmax(l / T), as torch.multinomial and FlashInfer's
 * sampling_from_probs draw, and the same distribution as vLLM's exponential race. One exp per logit
 * and one random number per row, in three passes over the row (its maximum; the p_i and their sums
 * per tile of SAMPLE_TILE; the scan of the one tile the target falls in), instead of torch's
 * softmax, uniform_, log_ and division each writing and reading a [rows, vocab] float32 tensor
 * (12.6 MB for 64 rows of SmolLM2's 49,152 logits, handed back to the system between steps).
 *
 * The row's uniform is SplitMix64's output for its key (Steele, Lea and Flood, "Fast splittable
 * pseudorandom number generators", OOPSLA 2014), 53 bits; the caller draws the key from the
 * request's generator, so a seed fixes its tokens. The exp is Cephes' expf on AVX-512 lanes
 * (kvp_exp.h, shared with SiLU) where built, libm's expf elsewhere; no -ffast-math, which would
 * let gcc assume the -inf logits of masked tokens away; arguments below -87 (probabilities under 2^-125 of the top token's) count as 0, as do
 * NaN logits. Sums are float32 within a tile and double across tiles; the scan recomputes the
 * tile's terms in the same order, and should rounding leave the target past the tile's last term,
 * the tile's last token with mass is drawn.
 * Source: Devroye, Non-Uniform Random Variate Generation (1986), ch. 2 (inversion); FlashInfer
 * `sampling_from_probs`; vLLM v1 `vllm/v1/sample/ops/topk_topp_sampler.py`; Cephes `expf.c`.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kvp.h"
#include "kvp_exp.h"

#define SAMPLE_TILE 1024 /* terms per partial sum */

/* The term of one scaled logit: e^x, or 0 where x is below -87 or NaN. */
static inline float term(float x) { return x >= -87.f ? expf(x) : 0.f; }

/* The terms of n scaled logits, stored in p where p is not NULL; returns their float32 sum. */
#ifdef KVP_AVX512
static float terms(const float *l, int64_t n, float top, float inv_temp, float *p) {
    __m512 acc = _mm512_setzero_ps();
    const __m512 vt = _mm512_set1_ps(top), vi = _mm512_set1_ps(inv_temp), lo = _mm512_set1_ps(-87.f);
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 in = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1u);
        const __m512 x = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, l + j), vt), vi);
        const __mmask16 live = _mm512_mask_cmp_ps_mask(in, x, lo, _CMP_GE_OQ); /* NaN and -inf: no mass */
        const __m512 e = _mm512_maskz_mov_ps(live, exp_neg16(x));
        if (p) _mm512_mask_storeu_ps(p + j, in, e);
        acc = _mm512_add_ps(acc, e);
    }
    return _mm512_reduce_add_ps(acc);
}
#else
static float terms(const float *l, int64_t n, float top, float inv_temp, float *p) {
    float s = 0.f;
    for (int64_t j = 0; j < n; ++j) {
        const float e = term((l[j] - top) * inv_temp);
        if (p) p[j] = e;
        s += e;
    }
    return s;
}
#endif

/* SplitMix64's output for key: the row's uniform in [0, 1), 53 bits. */
static inline double uniform53(uint64_t key) {
    uint64_t z = key + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

/* The draw of one row, or -1 where it has no finite logit (every one -inf or NaN). */
static int64_t sample_row(const float *logits, int64_t vocab, float inv_temp, uint64_t key) {
    float top = -INFINITY;
    #pragma omp simd reduction(max:top)
    for (int64_t i = 0; i < vocab; ++i) top = logits[i] > top ? logits[i] : top;
    if (top == -INFINITY) return -1;
    const int64_t tiles = (vocab + SAMPLE_TILE - 1) / SAMPLE_TILE;
    float sums[tiles];
    double total = 0.0;
    for (int64_t b = 0; b < tiles; ++b) {
        const float *l = logits + b * SAMPLE_TILE;
        const int64_t n = vocab - b * SAMPLE_TILE < SAMPLE_TILE ? vocab - b * SAMPLE_TILE : SAMPLE_TILE;
        sums[b] = terms(l, n, top, inv_temp, NULL);
        total += sums[b];
    }
    const double target = uniform53(key) * total;
    double before = 0.0;
    int64_t b = 0;
    while (b < tiles - 1 && before + sums[b] <= target) before += sums[b++];
    const float *l = logits + b * SAMPLE_TILE;
    const int64_t n = vocab - b * SAMPLE_TILE < SAMPLE_TILE ? vocab - b * SAMPLE_TILE : SAMPLE_TILE;
    float p[SAMPLE_TILE];
    terms(l, n, top, inv_temp, p); /* the same terms as the tile's sum */
    int64_t last = -1;
    double acc = before;
    for (int64_t j = 0; j < n; ++j) {
        if (p[j] > 0.f) {
            acc += p[j];
            last = b * SAMPLE_TILE + j;
            if (acc > target) return last;
        }
    }
    if (last >= 0) return last;
    /* the tile held no mass after all (rounding at its edge): the row's last token with mass */
    for (int64_t i = b * SAMPLE_TILE - 1; i >= 0; --i)
        if ((logits[i] - top) * inv_temp >= -87.f) return i;
    return -1;
}

/* out[r] = the sampled token of row r of logits [rows, vocab] float32 (row stride ld), at
   temperature 1 / inv_temp[r] with the draw of keys[r] (-1 where the row has no finite logit);
   rows shared out over num_threads OpenMP threads. */
void kvp_sample_rows(const float *logits, int64_t ld, int64_t rows, int64_t vocab, const float *inv_temp,
                       const uint64_t *keys, int64_t *out, int64_t num_threads) {
    #pragma omp parallel for schedule(static) num_threads((int)num_threads) if (num_threads > 1 && rows > 1)
    for (int64_t r = 0; r < rows; ++r) out[r] = sample_row(logits + r * ld, vocab, inv_temp[r], keys[r]);
}
