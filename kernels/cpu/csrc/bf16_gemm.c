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
 *
 * AMX (the amx build, where the kernel grants the process the tile state): the same packed layout
 * feeds TDPBF16PS unchanged. A B tile is 16 k-pairs x 16 columns (64 bytes a row): the rows of
 * column vector j of a group sit 256 bytes apart in `wp`, so `tileloadd` reads them with a 256-byte
 * stride; an A tile is 16 rows x 32 k of x at its own row stride. Each work item is one group (4
 * C tiles of 16 x 16 float32) x one 16-row tile; the C tiles go to a float32 buffer and are
 * rounded to bf16 as above. Tiles need k % 32 == 0; other shapes take the AVX512_BF16 loop.
 * Source: Intel SDM vol. 1 ch. 18 (AMX: LDTILECFG, TILELOADD, TDPBF16PS) and the Linux kernel's
 * Documentation/arch/x86/xstate.rst (ARCH_REQ_XCOMP_PERM before the first tile instruction).
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

#if defined(KVP_BF16_SIMD) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx.h"
#define KVP_AMX 1

/* Tiles 0-3: C (mt rows x 16 float32), 4: A (mt rows x 32 bf16), 5: B (16 k-pairs x 16 columns). */
static void amx_configure(int mt) {
    kvp_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 5; ++t) { cfg.rows[t] = (uint8_t)mt; cfg.colsb[t] = 64; }
    cfg.rows[5] = 16; cfg.colsb[5] = 64;
    _tile_loadconfig(&cfg);
}

/* Rows [0, mt) x the 64 columns of group wg: C tile j += A (32 k) . B_j, then bf16 stores. */
static void amx_group_rows(const uint16_t *x, int64_t ldx, const uint16_t *wg, int64_t k, uint16_t *y,
                           int64_t ldy, int mt) {
    float c[4][16][16];
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t k0 = 0; k0 < k; k0 += 32) {
        const uint16_t *b = wg + k0 * 64; /* pair k0/2 of the group: 128 elements a pair */
        _tile_loadd(4, x + k0, ldx * 2);
        _tile_loadd(5, b, 256); _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(5, b + 32, 256); _tile_dpbf16ps(1, 4, 5);
        _tile_loadd(5, b + 64, 256); _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(5, b + 96, 256); _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, c[0], 64); _tile_stored(1, c[1], 64); _tile_stored(2, c[2], 64); _tile_stored(3, c[3], 64);
    for (int i = 0; i < mt; ++i)
        for (int j = 0; j < 4; ++j)
            _mm256_storeu_si256((__m256i *)(y + i * ldy + 16 * j),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(c[j][i])));
}

/* The (group, 16-row tile) items [lo, hi) of kvp_bf16_gemm's AMX split. */
static void amx_items(const uint16_t *x, int64_t ldx, const uint16_t *wp, uint16_t *y, int64_t ldy, int64_t m,
                      int64_t k, int64_t tiles, int64_t lo, int64_t hi) {
    int configured = 0;
    for (int64_t it = lo; it < hi; ++it) {
        const int64_t g = it / tiles, r0 = 16 * (it % tiles);
        const int mt = (int)(m - r0 < 16 ? m - r0 : 16);
        if (mt != configured) { amx_configure(mt); configured = mt; }
        amx_group_rows(x + r0 * ldx, ldx, wp + g * 64 * k, k, y + r0 * ldy + g * 64, ldy, mt);
    }
    if (configured) _tile_release();
}
#endif

/* 1 where this build serves kvp_bf16_gemm with AMX tiles (the amx build, the tile state granted by
   the kernel), else 0. */
int kvp_bf16_gemm_amx(void) {
#ifdef KVP_AMX
    return kvp_amx_granted();
#else
    return 0;
#endif
}

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
#ifdef KVP_AMX
    if (k % 32 == 0 && kvp_amx_granted()) {
        const int64_t tiles = (m + 15) / 16, items = n / 64 * tiles;
        const int64_t teams = num_threads < items ? num_threads : items;
        #pragma omp parallel for schedule(static, 1) num_threads((int)teams) if (teams > 1)
        for (int64_t t = 0; t < teams; ++t)
            amx_items(x, ldx, wp, y, ldy, m, k, tiles, items * t / teams, items * (t + 1) / teams);
        return;
    }
#endif
    const int64_t groups = n / 64, pairs = k / 2, tiles = (m + 5) / 6, items = groups * tiles;
    #pragma omp parallel for schedule(static) num_threads((int)num_threads) if (num_threads > 1 && items > 1)
    for (int64_t it = 0; it < items; ++it) {
        const int64_t g = it / tiles, r0 = 6 * (it % tiles), rows = m - r0 < 6 ? m - r0 : 6;
        group_rows(x + r0 * ldx, ldx, wp + g * 64 * k, pairs, y + r0 * ldy + g * 64, ldy, rows);
    }
}
