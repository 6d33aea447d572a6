/*
 * y = x W^T for GGUF Q4_1 / Q8_0 weights on AMX tiles (the amx build; Python face:
 * kernels/cpu/gguf.py `amx_pack` and `gguf_matmul` with the AMX layout's qtypes), 8-bit activations.
 *
 * Why: a decode step of 2-32 rows reads every weight once and does 2-32 multiply-adds with it. The
 * AVX2 dot products (gguf.c) spend ~7 instructions per 32 multiply-adds, so past ~4 rows they cost
 * more than the bf16 matmuls on AMX tiles that read 3.4x the bytes; TDPBSUD / TDPBSSD do
 * 16 x 16 x 32 multiply-adds in one instruction.
 *
 * Layout (`kvp_gguf_amx_pack`, once at load): per tile of 16 weight rows and per GGUF block b (32 k),
 * one record of the block's B tile (8 rows of k-quads x 16 weight rows x 4 bytes: byte
 * kk * 64 + r * 4 + j holds weight row r's value k = 32 b + 4 kk + j) and the 16 rows' scales:
 *   Q4_1: 256 bytes, byte t holding tile byte t in its low nibble and tile byte t + 256 in its
 *         high one (the 4-bit values 0..15), then d[16] and m[16] as f16: 320 bytes;
 *   Q8_0: the 512 tile bytes (int8), then d[16] as f16: 544 bytes.
 * So a record holds the same bytes per weight as the GGUF's blocks (20 or 34 per 32), and the packed
 * weight has the blocks' shape [n, k / 32 * block bytes].
 *
 * Per call: x is quantized to Q8_1 blocks (by gguf.c's kvp_gguf_matmul, as for its 8-bit path), so the A
 * tile of block b (up to 16 activation rows x 32 bytes) is read in place from the quantized rows.
 * For each tile of 16 weight rows and each group of 4 blocks (4 C tiles in flight, so their
 * latencies overlap): Q4_1's record is unpacked with two AND and one shift per 64 bytes, the C
 * tile C[i][r] = sum over the block of x8[i] * w[r] (int32) comes from TDPBSUD (signed activations x
 * unsigned 4-bit weights; Q8_0: TDPBSSD), and row i of the output tile accumulates
 * d_x[i] * d_w[r] * C[i][r] (+ s_x[i] * m_w[r] for Q4_1) in float32, 16 weight rows to a zmm. The
 * integers are the AVX2 path's; the float sums run in another order. llama.cpp's AMX backend
 * (ggml-cpu/amx/mmq.cpp) likewise repacks quantized blocks for TDPBUSD / TDPBSSD at load time.
 * Source: Intel SDM vol. 1 ch. 18 (AMX-INT8: TDPBSUD, TDPBSSD, TILELOADD); ggml-common.h (blocks).
 */

#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__F16C__)
#include <immintrin.h>
#include "amx.h"
#define KVP_AMX_INT8 1

#define GROUP 4  /* blocks in flight: C tiles 0-3, A tiles 4-5, B tiles 6-7 */

static int64_t record_bytes(int qtype) { return qtype == 3 ? 320 : 544; }

static void configure(int mt) {
    kvp_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < GROUP; ++t) { cfg.rows[t] = (uint8_t)mt; cfg.colsb[t] = 64; }  /* C: mt x 16 int32 */
    for (int t = 4; t < 6; ++t) { cfg.rows[t] = (uint8_t)mt; cfg.colsb[t] = 32; }      /* A: mt x 32 int8 */
    for (int t = 6; t < 8; ++t) { cfg.rows[t] = 8; cfg.colsb[t] = 64; }                /* B: 8 quads x 16 x 4 */
    _tile_loadconfig(&cfg);
}

/* Output rows [m0, m0 + mt) x weight rows [16 tile, 16 tile + 16). */
static void tile_rows(int qtype, const uint8_t *rec0, int64_t nb, const int8_t *xq, const float *xds, int64_t k,
                      int64_t m0, int mt, float *y, int64_t y_stride) {
    const int64_t rb = record_bytes(qtype);
    int32_t c[GROUP][16][16] __attribute__((aligned(64)));
    uint8_t bt[2][512] __attribute__((aligned(64)));
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const int8_t *xa = xq + m0 * k;
    for (int64_t b0 = 0; b0 < nb; b0 += GROUP) {
        const int g = nb - b0 < GROUP ? (int)(nb - b0) : GROUP;
#define BLOCK(i, TA, TB)                                                                           \
        if ((i) < g) {                                                                             \
            const uint8_t *rec = rec0 + (b0 + (i)) * rb;                                           \
            _tile_zero(i);                                                                         \
            _tile_loadd(TA, xa + (b0 + (i)) * 32, k);                                              \
            if (qtype == 3) {                                                                      \
                for (int v = 0; v < 4; ++v) {                                                      \
                    const __m512i p = _mm512_loadu_si512((const void *)(rec + 64 * v));            \
                    _mm512_store_si512((void *)(bt[(i) & 1] + 64 * v), _mm512_and_si512(p, low4)); \
                    _mm512_store_si512((void *)(bt[(i) & 1] + 256 + 64 * v),                      \
                                       _mm512_and_si512(_mm512_srli_epi16(p, 4), low4));           \
                }                                                                                  \
                _tile_loadd(TB, bt[(i) & 1], 64);                                                  \
                _tile_dpbsud(i, TA, TB);                                                           \
            } else {                                                                               \
                _tile_loadd(TB, rec, 64);                                                          \
                _tile_dpbssd(i, TA, TB);                                                           \
            }                                                                                      \
        }
        BLOCK(0, 4, 6) BLOCK(1, 5, 7) BLOCK(2, 4, 6) BLOCK(3, 5, 7)
#undef BLOCK
        if (g > 0) _tile_stored(0, c[0], 64);
        if (g > 1) _tile_stored(1, c[1], 64);
        if (g > 2) _tile_stored(2, c[2], 64);
        if (g > 3) _tile_stored(3, c[3], 64);
        for (int t = 0; t < g; ++t) {
            const int64_t b = b0 + t;
            const uint8_t *scales = rec0 + b * rb + (qtype == 3 ? 256 : 512);
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales));
            const __m512 mw = qtype == 3 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + 32)))
                                         : _mm512_setzero_ps();
            for (int i = 0; i < mt; ++i) {
                const float *ds = xds + ((m0 + i) * nb + b) * 2;  /* d_x, s_x */
                const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)c[t][i]));
                acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(ds[0])), sum, acc[i]);
                if (qtype == 3) acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(ds[1]), acc[i]);
            }
        }
    }
    for (int i = 0; i < mt; ++i) _mm512_storeu_ps(y + (m0 + i) * y_stride, acc[i]);
}

/* Q4_1 output rows [m0, m0 + mt), mt <= VNNI_ROWS, x weight rows of one tile, without tiles: the record's
   8 k-quad rows unpacked once into zmm registers (lane r = weight row r), then per activation row
   8 VPDPBUSD with its quads broadcast. A tile's latency (store, TILELOADD, TDPBSUD, TILESTORED, load)
   is not worth it for so few rows. Same integers; the float sums run in the same order as tile_rows'. */
#define VNNI_ROWS 4
static void vnni_rows(const uint8_t *rec0, int64_t nb, const int8_t *xq, const float *xds, int64_t k, int64_t m0,
                      int mt, float *y, int64_t y_stride) {
    __m512 acc[VNNI_ROWS];
    for (int i = 0; i < VNNI_ROWS; ++i) acc[i] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *rec = rec0 + b * 320;
        __m512i wv[8];
        for (int v = 0; v < 4; ++v) {
            const __m512i p = _mm512_loadu_si512((const void *)(rec + 64 * v));
            wv[v] = _mm512_and_si512(p, low4);
            wv[4 + v] = _mm512_and_si512(_mm512_srli_epi16(p, 4), low4);
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 256)));
        const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 288)));
        for (int i = 0; i < mt; ++i) {
            const int32_t *quads = (const int32_t *)(xq + (m0 + i) * k + b * 32);
            __m512i sum = _mm512_setzero_si512();
            for (int kk = 0; kk < 8; ++kk) sum = _mm512_dpbusd_epi32(sum, wv[kk], _mm512_set1_epi32(quads[kk]));
            const float *ds = xds + ((m0 + i) * nb + b) * 2;
            acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(ds[0])), _mm512_cvtepi32_ps(sum), acc[i]);
            acc[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(ds[1]), acc[i]);
        }
    }
    for (int i = 0; i < mt; ++i) _mm512_storeu_ps(y + (m0 + i) * y_stride, acc[i]);
}
#endif

/* 1 where this build runs kvp_gguf_amx_run (the amx build, the tile state granted), else 0. */
int kvp_gguf_amx(void) {
#ifdef KVP_AMX_INT8
    return kvp_amx_granted();
#else
    return 0;
#endif
}

/* out [n / 16 tiles, k / 32 blocks, record] from GGUF blocks w [n, k / 32 * block bytes] of qtype 3
   (Q4_1) or 8 (Q8_0); n a multiple of 16, k of 32. Returns 0, -1 for a bad qtype or shape. */
int kvp_gguf_amx_pack(int qtype, const uint8_t *w, int64_t n, int64_t k, uint8_t *out) {
    if ((qtype != 3 && qtype != 8) || k % 32 || n % 16) return -1;
    const int64_t nb = k / 32, bs = qtype == 3 ? 20 : 34, rb = qtype == 3 ? 320 : 544;
    for (int64_t t = 0; t < n / 16; ++t)
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t *rec = out + (t * nb + b) * rb, tile[512];
            for (int r = 0; r < 16; ++r) {
                const uint8_t *blk = w + ((16 * t + r) * nb + b) * bs;
                for (int kk = 0; kk < 32; ++kk) {  /* weight k = 32 b + kk of row r */
                    const int v = qtype == 3 ? (kk < 16 ? blk[4 + kk] & 15 : blk[4 + kk - 16] >> 4) : blk[2 + kk];
                    tile[(kk / 4) * 64 + r * 4 + kk % 4] = (uint8_t)v;
                }
                memcpy(rec + (qtype == 3 ? 256 : 512) + 2 * r, blk, 2);                /* d */
                if (qtype == 3) memcpy(rec + 256 + 32 + 2 * r, blk + 2, 2);            /* m */
            }
            if (qtype == 3)
                for (int i = 0; i < 256; ++i) rec[i] = (uint8_t)(tile[i] | tile[i + 256] << 4);
            else
                memcpy(rec, tile, 512);
        }
    return 0;
}

/* y [m, y_stride] (first n columns) = x8 @ W^T for W packed by kvp_gguf_amx_pack from qtype 3 or 8
   blocks, x8 the rows x already quantized to Q8_1 blocks (kvp_quantize_q8_1: xq [m, k] int8, xds
   [m, k / 32, 2]); kvp_gguf_matmul quantizes into its per-thread scratch and calls this for the
   layout's qtypes. m any (in passes of 16 rows). Uses up to `threads` OpenMP threads over the tiles
   of 16 weight rows. Returns 0, or -1 for a bad qtype or shape or a build / process without AMX. */
int kvp_gguf_amx_run(int qtype, const uint8_t *wp, int64_t n, int64_t k, const int8_t *xq, const float *xds,
                     int64_t m, float *y, int64_t y_stride, int threads) {
#ifdef KVP_AMX_INT8
    if ((qtype != 3 && qtype != 8) || k % 32 || n % 16 || !kvp_amx_granted()) return -1;
    if (m <= 0 || n <= 0) return 0;
    const int64_t nb = k / 32, tiles = n / 16, rb = record_bytes(qtype);
    const int team = threads > 1 ? threads : 1;
    #pragma omp parallel num_threads(team) if (team > 1)
    {
        int configured = 0;
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t)
            for (int64_t m0 = 0; m0 < m; m0 += 16) {
                const int mt = m - m0 < 16 ? (int)(m - m0) : 16;
                if (qtype == 3 && mt <= VNNI_ROWS) {
                    vnni_rows(wp + t * nb * rb, nb, xq, xds, k, m0, mt, y + 16 * t, y_stride);
                    continue;
                }
                if (mt != configured) { configure(mt); configured = mt; }
                tile_rows(qtype, wp + t * nb * rb, nb, xq, xds, k, m0, mt, y + 16 * t, y_stride);
            }
        if (configured) _tile_release();
    }
    return 0;
#else
    (void)qtype; (void)wp; (void)n; (void)k; (void)xq; (void)xds; (void)m; (void)y; (void)y_stride; (void)threads;
    return -1;
#endif
}
