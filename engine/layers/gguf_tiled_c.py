"""The C source of the GGUF kernel's float32 path for several activation rows (spliced into
gguf_matmul_c.py's library after its row kernels; gguf_entry_c.py picks it for every float32
call of an AVX2 build, `kvp_gguf_set_tiled_min_m` changes that for tests and A/B runs).

At 9-64 rows a decode step's float32 matmuls are bound neither by the weight stream alone
nor by the FMAs alone but by their sum (oneDNN at 16 rows: 63 ms for a SmolLM2 step's 121
matmuls with 2 threads on an AVX2 EPYC, throughput README section 11). Here the weights
stream as the GGUF's blocks (Q4_1: 5 bits a weight, 6.4x fewer bytes than float32), and the
arithmetic is a plain float32 GEMM:
  1. TILE_N weight rows are dequantized into a per-thread panel [TILE_N, k] float32 that
     stays in L1/L2: Q4_1 w = d * q + m, Q8_0 w = d * q, with d * q exact in float32 (an
     11-bit half times a 4- or 8-bit integer) and one rounding for + m (an FMA), so the
     panel holds exactly the values gguf-py's `dequantize` gives, i.e. the dense float32
     weights the model loaded;
  2. register tiles of TILE_M activation rows x TILE_N weight rows (12 ymm accumulators,
     3 activation and 1 weight vector) accumulate x . w along k, 8 lanes at a time, and a
     horizontal sum per output ends each tile.
So results differ from the dense float32 matmul only by the order of the float32 sums.
The dequantization is done once per weight row and call, not once per activation row as
the row kernel (gguf_matmul_c.py) does. The scheme is the one of ggml's and oneDNN's CPU
GEMMs (a packed panel and a register-blocked micro-kernel; Goto and van de Geijn, "Anatomy
of High-Performance Matrix Multiplication", ACM TOMS 2008) with the packing step replaced
by dequantization. AVX2 builds only; the scalar build keeps the row kernel.
"""

TILED_SOURCE = r"""
/* rows from which a float32 call takes the tiled path: 1, since even one row's panel (stored,
   then read once) ran the 121 matmuls of a SmolLM2 decode step in 9.7 ms against the 11.6 of the
   AVX2 row kernel it replaced (2 threads, Zen 3 EPYC, once dequant_row took 6 cycles a Q4_1
   block). Above 1 (tests) smaller calls take gguf_matmul_c.py's portable row loop. */
static int g_tiled_min_m = 1;

/* Sets the row count from which float32 calls use the tiled path (tests, A/B runs; the
   scalar build never does); returns the previous one. */
int kvp_gguf_set_tiled_min_m(int m) {
    const int old = g_tiled_min_m;
    g_tiled_min_m = m;
    return old;
}

#ifdef KVP_AVX2
#define TILE_N 4  /* weight rows per dequantized panel */
#define TILE_M 3  /* activation rows per register tile */

/* this thread's grow-only panel of `floats` floats (gguf_matmul_c.py's scratch slot 1) */
static float *panel_scratch(size_t floats) { return scratch_slot(1, floats * sizeof(float)); }

/* One weight row's nb blocks -> dst [nb * 32] float32, gguf-py's exact values. A Q4_1 block's
   16 bytes widen straight from memory to two vectors of 8 int32 (vpmovzxbd, bytes 0-7 and
   8-15); their low nibbles are weights 0-15 and their high nibbles weights 16-31, split with an
   AND and a shift on the int32 lanes: 2 shuffles a block where unpacking the nibbles of a
   16-byte register took 6 (8.3 -> 6.1 cycles a block alone on a Zen 3 EPYC, same values). */
static inline void dequant_row(int qtype, const uint8_t *row, int64_t nb, float *dst) {
    const __m256i low4 = _mm256_set1_epi32(0x0f);
    for (int64_t b = 0; b < nb; ++b, dst += 32) {
        if (qtype == 3) {
            const uint8_t *blk = row + b * 20;
            int32_t dm;  /* d and m, adjacent halves: one conversion for both */
            memcpy(&dm, blk, 4);
            const __m128 dmf = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
            const __m256 dv = _mm256_broadcastss_ps(dmf), mv = _mm256_broadcastss_ps(_mm_movehdup_ps(dmf));
            const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 4)));
            const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 12)));
            _mm256_store_ps(dst, _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(_mm256_and_si256(a, low4)), mv));
            _mm256_store_ps(dst + 8, _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(_mm256_and_si256(c, low4)), mv));
            _mm256_store_ps(dst + 16, _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), mv));
            _mm256_store_ps(dst + 24, _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4)), mv));
        } else {
            const uint8_t *blk = row + b * 34;
            uint16_t dh;
            memcpy(&dh, blk, 2);
            const __m256 dv = _mm256_set1_ps(f16_to_f32(dh));
            for (int t = 0; t < 4; ++t) {
                const __m128i q = _mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * t));
                _mm256_store_ps(dst + 8 * t, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
            }
        }
    }
}

/* y[i, r] = sum_t x[i, t] * p[r, t] for i < mr, r < nr, t < k (k a multiple of 8); mr and
   nr are constants at every call site, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t xs, const float *p, int64_t k,
                                                       int mr, int nr, float *y, int64_t ys) {
    __m256 acc[TILE_M][TILE_N];
    for (int i = 0; i < mr; ++i)
        for (int r = 0; r < nr; ++r) acc[i][r] = _mm256_setzero_ps();
    for (int64_t t = 0; t < k; t += 8) {
        __m256 xv[TILE_M];  /* the empty asm keeps each load in a register: folded into every FMA it
                               would be loaded mr (or nr) times, and the loads would bound the loop */
        for (int i = 0; i < mr; ++i) {
            xv[i] = _mm256_loadu_ps(x + i * xs + t);
            __asm__("" : "+x"(xv[i]));
        }
        for (int r = 0; r < nr; ++r) {
            __m256 w = _mm256_load_ps(p + r * k + t);
            __asm__("" : "+x"(w));
            for (int i = 0; i < mr; ++i) acc[i][r] = _mm256_fmadd_ps(xv[i], w, acc[i][r]);
        }
    }
    for (int i = 0; i < mr; ++i)
        for (int r = 0; r < nr; ++r) y[i * ys + r] = hsum8(acc[i][r]);
}

#define TILE_CASE(MR, NR) case MR * 8 + NR: tile(x, xs, p, k, MR, NR, y, ys); break;

static void tile_any(const float *x, int64_t xs, const float *p, int64_t k, int mr, int nr, float *y, int64_t ys) {
    switch (mr * 8 + nr) {
        TILE_CASE(1, 1) TILE_CASE(1, 2) TILE_CASE(1, 3) TILE_CASE(1, 4)
        TILE_CASE(2, 1) TILE_CASE(2, 2) TILE_CASE(2, 3) TILE_CASE(2, 4)
        TILE_CASE(3, 1) TILE_CASE(3, 2) TILE_CASE(3, 3) TILE_CASE(3, 4)
    }
}

/* rows [n0, n1) of y for all m activation rows, float32 activations. Returns -2 when the
   panel cannot be allocated, else 0. */
static int rows_tiled(const job_t *j, int64_t n0, int64_t n1) {
    const int64_t k = j->k, nb = k / 32, bs = j->qtype == 3 ? 20 : 34;
    float *p = panel_scratch((size_t)(TILE_N * k));
    if (!p) return -2;
    for (int64_t r0 = n0; r0 < n1; r0 += TILE_N) {
        const int nr = n1 - r0 < TILE_N ? (int)(n1 - r0) : TILE_N;
        const uint8_t *w = j->w + r0 * nb * bs;
        for (int r = 0; r < nr; ++r) dequant_row(j->qtype, w + r * nb * bs, nb, p + r * k);
        for (int64_t m0 = 0; m0 < j->m; m0 += TILE_M) {
            const int mr = j->m - m0 < TILE_M ? (int)(j->m - m0) : TILE_M;
            tile_any(j->x + m0 * j->x_stride, j->x_stride, p, k, mr, nr, j->y + m0 * j->y_stride + r0, j->y_stride);
        }
    }
    return 0;
}
#endif

/* 1 where float32 calls of m rows take the tiled path. */
static int use_tiled(int64_t m) {
#ifdef KVP_AVX2
    return m >= g_tiled_min_m;
#else
    (void)m;
    return 0;
#endif
}
"""

