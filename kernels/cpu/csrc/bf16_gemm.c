/*
 * The small-M bfloat16 matmul for CPUs with AVX512_BF16 (kernels/cpu/bf16_gemm.py
 * builds and calls it).
 *
 * y[m, n] = sum_k x[m, k] w[n, k]: x [M, K] bf16 rows, w packed once from the [N, K] bf16 weight,
 * y [M, N] bf16. Every product of two bf16 values is exact in float32 and the sums are float32,
 * rounded to bf16 once at the store (round to nearest even), which is the arithmetic of oneDNN's
 * bf16 matmul and of HF `nn.Linear` in bf16 on such a CPU, in another summation order.
 *
 * `vdpbf16ps` (`_mm512_dpbf16_ps`) adds to each of 16 float32 lanes the products of one pair of
 * bf16 values of each operand. The lanes are output columns: the weight is packed in groups of 64
 * columns (4 vectors of 16) and pairs of k, `wp[g][p][j][i][e] = w[64 g + 16 j + i][2 p + e]`, so
 * that one k-pair of a group is 256 contiguous bytes, and each row's pair (x[m][2p], x[m][2p+1]) is
 * broadcast as one 32-bit value. A register tile is up to 6 rows x 64 columns (24 accumulators, 4
 * weight vectors, a broadcast: 29 of the 32 zmm registers); the (group, row tile) pairs are shared
 * out over the OpenMP team, and a group's packed weight (K x 128 bytes) stays in L2 while the
 * tiles of later rows read it.
 * This is the shape of oneDNN's and BLIS's micro-kernels (Van Zee and van de Geijn, ACM TOMS 2015)
 * with the bf16 dot-product instruction (Intel SDM, VDPBF16PS). Builds without AVX512_BF16 get the
 * same layout in plain float32 C (`kvp_bf16_gemm_simd()` is 0 there and the engine keeps oneDNN;
 * tests use it to check the layout on any CPU).
 */

#include "kvp.h"


#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define KVP_BF16_SIMD 1

/* Rows [m0, m0 + mt) x the 64 columns of group g. */
static inline __attribute__((always_inline)) void tile(const uint16_t *x, int64_t ldx, const uint16_t *wg,
                                                       int64_t pairs, uint16_t *y, int64_t ldy, int mt) {
    __m512 acc[6][4];
    for (int i = 0; i < mt; ++i)
        for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p, wg += 128) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wg), w1 = (__m512bh)_mm512_loadu_si512(wg + 32),
                       w2 = (__m512bh)_mm512_loadu_si512(wg + 64), w3 = (__m512bh)_mm512_loadu_si512(wg + 96);
        for (int i = 0; i < mt; ++i) {
            int32_t pair;
            memcpy(&pair, x + i * ldx + 2 * p, sizeof pair);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xb, w0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xb, w1);
            acc[i][2] = _mm512_dpbf16_ps(acc[i][2], xb, w2);
            acc[i][3] = _mm512_dpbf16_ps(acc[i][3], xb, w3);
        }
    }
    for (int i = 0; i < mt; ++i)
        for (int j = 0; j < 4; ++j)
            _mm256_storeu_si256((__m256i *)(y + i * ldy + 16 * j), (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
}

static void group_rows(const uint16_t *x, int64_t ldx, const uint16_t *wg, int64_t pairs, uint16_t *y,
                       int64_t ldy, int64_t m) {
    int64_t m0 = 0;
    for (; m0 + 6 <= m; m0 += 6) tile(x + m0 * ldx, ldx, wg, pairs, y + m0 * ldy, ldy, 6);
    switch (m - m0) {
        case 5: tile(x + m0 * ldx, ldx, wg, pairs, y + m0 * ldy, ldy, 5); break;
        case 4: tile(x + m0 * ldx, ldx, wg, pairs, y + m0 * ldy, ldy, 4); break;
        case 3: tile(x + m0 * ldx, ldx, wg, pairs, y + m0 * ldy, ldy, 3); break;
        case 2: tile(x + m0 * ldx, ldx, wg, pairs, y + m0 * ldy, ldy, 2); break;
        case 1: tile(x + m0 * ldx, ldx, wg, pairs, y + m0 * ldy, ldy, 1); break;
        default: break;
    }
}
#else
/* The same layout and sums in plain C (products of bf16 values are exact in float32). */
static void group_rows(const uint16_t *x, int64_t ldx, const uint16_t *wg, int64_t pairs, uint16_t *y,
                       int64_t ldy, int64_t m) {
    for (int64_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < 64; ++c) {
            const int64_t j = c / 16, i = c % 16;
            float acc = 0.f;
            for (int64_t p = 0; p < pairs; ++p) {
                const uint16_t *w = wg + p * 128 + j * 32 + i * 2;
                acc += bf16_ld(x[r * ldx + 2 * p]) * bf16_ld(w[0]) + bf16_ld(x[r * ldx + 2 * p + 1]) * bf16_ld(w[1]);
            }
            y[r * ldy + c] = bf16_st(acc);
        }
}
#endif

/* 1 where this build has the AVX512_BF16 kernel, else 0 (the portable loop above). */
int kvp_bf16_gemm_simd(void) {
#ifdef KVP_BF16_SIMD
    return 1;
#else
    return 0;
#endif
}

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) . w^T for wp packed from w [n, k] as above
   (k even, n a multiple of 64), all bf16. The work items are (column group, 6-row tile) pairs,
   a group's tiles consecutive, shared out in contiguous runs over num_threads threads: a small
   weight (576 outputs: 9 groups) splits evenly, and a group split between two threads is read
   from memory once and from the shared L3 by the other. */
void kvp_bf16_gemm(const uint16_t *x, int64_t ldx, const uint16_t *wp, uint16_t *y, int64_t ldy, int64_t m,
                   int64_t n, int64_t k, int64_t num_threads) {
    const int64_t groups = n / 64, pairs = k / 2, tiles = (m + 5) / 6, items = groups * tiles;
    #pragma omp parallel for schedule(static) num_threads((int)num_threads) if (num_threads > 1 && items > 1)
    for (int64_t it = 0; it < items; ++it) {
        const int64_t g = it / tiles, r0 = 6 * (it % tiles), rows = m - r0 < 6 ? m - r0 : 6;
        group_rows(x + r0 * ldx, ldx, wp + g * 64 * k, pairs, y + r0 * ldy + g * 64, ldy, rows);
    }
}
