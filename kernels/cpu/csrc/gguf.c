/*
 * y = x W^T for W kept in GGUF's Q4_1 or Q8_0 blocks, in plain C (AVX2 where the CPU
 * has it, a scalar loop elsewhere), called through ctypes (kernels/cpu/gguf.py); float32
 * activations, or (the default of `--quantization gguf`, as vLLM's GGUF path) activations
 * quantized to 8-bit blocks. Chunks of rows are shared out over torch's own OpenMP team (built
 * with -fopenmp; the library's libgomp.so.1 is, by soname, the one torch loaded).
 *
 * Why: one decode step at batch 1 reads every weight once, so its time is the weight bytes
 * over the memory bandwidth. Q4_1 takes 20 bytes per 32 weights (6.4x fewer than float32)
 * and Q8_0 34 bytes. The blocks are dequantized in registers, never in memory, as llama.cpp's
 * CPU `ggml_vec_dot_*` and vLLM's `ggml_mul_mat_vec_a8` (GGUF, batch <= 8) do.
 *
 * Float32 activations, several rows (`rows_tiled`; every float32 call of an AVX2 build takes it,
 * `kvp_gguf_set_tiled_min_m` changes that for tests).
 *
 * At 9-64 rows a decode step's float32 matmuls are bound neither by the weight stream alone
 * nor by the FMAs alone but by their sum (oneDNN at 16 rows: 63 ms for a SmolLM2 step's 121
 * matmuls with 2 threads on an AVX2 EPYC, section 11 of `git show bbe6366:benchmarks/results/throughput/README.md`). Here the weights
 * stream as the GGUF's blocks (Q4_1: 5 bits a weight, 6.4x fewer bytes than float32), and the
 * arithmetic is a plain float32 GEMM:
 *   1. TILE_N weight rows are dequantized into a per-thread panel [TILE_N, k] float32 that
 *      stays in L1/L2: Q4_1 w = d * q + m, Q8_0 w = d * q, with d * q exact in float32 (an
 *      11-bit half times a 4- or 8-bit integer) and one rounding for + m (an FMA), so the
 *      panel holds exactly the values gguf-py's `dequantize` gives, i.e. the dense float32
 *      weights the model loaded;
 *   2. register tiles of TILE_M activation rows x TILE_N weight rows (12 ymm accumulators,
 *      3 activation and 1 weight vector) accumulate x . w along k, 8 lanes at a time, and a
 *      horizontal sum per output ends each tile.
 * So results differ from the dense float32 matmul only by the order of the float32 sums.
 * The dequantization is done once per weight row and call, not once per activation row as
 * the row kernel (gguf.c) does. The scheme is the one of ggml's and oneDNN's CPU
 * GEMMs (a packed panel and a register-blocked micro-kernel; Goto and van de Geijn, "Anatomy
 * of High-Performance Matrix Multiplication", ACM TOMS 2008) with the packing step replaced
 * by dequantization. AVX2 builds only; the scalar build keeps the row kernel.
 *
 * 8-bit activations (`rows_q8`, the default).
 *
 * Each call first quantizes every activation row once into Q8_1-style blocks of 32, as
 * ggml's `quantize_row_q8_1` and vLLM's `quantize_q8_1` (GGUF, batch <= 8) do:
 *   d = max_j |x_j| / 127,  q_j = nearest(x_j * (1 / d)) int8 in -127..127,  s = d * sum_j q_j
 * (d and s kept in float32; ties round to even, as ggml's AVX2 quantizer does, where its
 * scalar reference rounds them away from zero). The dot products are then integer per block:
 *   Q4_1 x Q8_1: sum_j (d_w q4_j + m_w) (d_x q8_j) ~ d_w d_x sum_j q4_j q8_j + m_w s
 *   Q8_0 x Q8_1: d_w d_x sum_j q8w_j q8_j
 * AVX2: `_mm256_maddubs_epi16` multiplies unsigned by signed bytes and adds pairs into int16
 * (Q4_1's 0..15 is the unsigned side; for Q8_0 the sign trick maddubs(|w|, sign(x, w)), as
 * ggml does), `_mm256_madd_epi16` with ones widens to int32, and one FMA per block scales
 * the 8 partial sums. A tile of up to 4 weight rows x 4 activation rows keeps its
 * accumulators in registers and reuses each unpacked weight block and each activation load.
 * The scalar loops use the same integer arithmetic.
 */

#define _GNU_SOURCE
#include <pthread.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVP_AVX2 1
static inline float hsum8(__m256 a) {  /* the sum of a's 8 lanes */
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#endif

static float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) bits = sign | 0x7f800000u | (man << 13);
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) bits = sign;
    else {  /* subnormal half: normalize */
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; --exp; }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

#define MAXM 8  /* activation rows per pass: their accumulators stay in registers */

typedef struct {
    int qtype;
    const uint8_t *w;
    int64_t n, k, m, x_stride, y_stride, rows_per_chunk;
    const float *x, *xsum;
    float *y;
    int act8;            /* 1: 8-bit activations xq [m, k] and (d, s) pairs xds [m, k / 32, 2] */
    const int8_t *xq;
    const float *xds;
} job_t;

/* Grow-only scratch buffers per calling thread (64-byte aligned), freed when the thread
   exits: no malloc per call, and two Python threads calling at once never share one. Slot 0:
   the entry point's activation scratch (8-bit or summed activations); slot 1: the tiled
   path's weight panel (gguf.c), used inside the parallel region while slot 0 lives. */
#define SCRATCH_SLOTS 2
static pthread_key_t g_scratch_keys[SCRATCH_SLOTS];
static pthread_once_t g_scratch_once = PTHREAD_ONCE_INIT;
static __thread void *t_scratch[SCRATCH_SLOTS];
static __thread size_t t_scratch_bytes[SCRATCH_SLOTS];

static void scratch_keys_init(void) {
    for (int i = 0; i < SCRATCH_SLOTS; ++i) pthread_key_create(&g_scratch_keys[i], free);
}

static void *scratch_slot(int slot, size_t bytes) {
    if (bytes <= t_scratch_bytes[slot]) return t_scratch[slot];
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes)) return NULL;
    free(t_scratch[slot]);
    t_scratch[slot] = p;
    t_scratch_bytes[slot] = bytes;
    pthread_once(&g_scratch_once, scratch_keys_init);
    pthread_setspecific(g_scratch_keys[slot], p);
    return p;
}

static void *scratch(size_t bytes) { return scratch_slot(0, bytes); }


/* rows [n0, n1) of y for activation rows [m0, m0 + mm), float32 activations, one block at a time:
   the path of builds without AVX2 (an AVX2 build's float32 calls take gguf.c's panels;
   tests reach this loop there through kvp_gguf_set_tiled_min_m). */
static void rows(const job_t *j, int64_t n0, int64_t n1, int64_t m0, int64_t mm) {
    const int64_t nb = j->k / 32, bs = j->qtype == 3 ? 20 : 34;
    for (int64_t r = n0; r < n1; ++r) {
        const uint8_t *row = j->w + r * nb * bs;
        float tail[MAXM] = {0}, acc[MAXM] = {0};
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *blk = row + b * bs;
            uint16_t dh, mh;
            memcpy(&dh, blk, 2);
            const float d = f16_to_f32(dh);
            float q[32];
            if (j->qtype == 3) {
                memcpy(&mh, blk + 2, 2);
                const float mn = f16_to_f32(mh);
                for (int64_t i = 0; i < mm; ++i) tail[i] += mn * j->xsum[(m0 + i) * nb + b];
                for (int t = 0; t < 16; ++t) { q[t] = (float)(blk[4 + t] & 15); q[t + 16] = (float)(blk[4 + t] >> 4); }
            } else {
                for (int t = 0; t < 32; ++t) q[t] = (float)(int8_t)blk[2 + t];
            }
            for (int64_t i = 0; i < mm; ++i) {
                const float *x = j->x + (m0 + i) * j->x_stride + b * 32;
                float s = 0.f;
                for (int t = 0; t < 32; ++t) s += x[t] * q[t];
                acc[i] += d * s;
            }
        }
        for (int64_t i = 0; i < mm; ++i) j->y[(m0 + i) * j->y_stride + r] = acc[i] + tail[i];
    }
}


/* rows from which a float32 call takes the tiled path: 1, since even one row's panel (stored,
   then read once) ran the 121 matmuls of a SmolLM2 decode step in 9.7 ms against the 11.6 of the
   AVX2 row kernel it replaced (2 threads, Zen 3 EPYC, once dequant_row took 6 cycles a Q4_1
   block). Above 1 (tests) smaller calls take gguf.c's portable row loop. */
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

/* this thread's grow-only panel of `floats` floats (gguf.c's scratch slot 1) */
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

/* x [m, x_stride] (first k columns) -> q [m, k] int8, ds [m, k / 32, 2] float (d, s). */
void kvp_quantize_q8_1(const float *x, int64_t x_stride, int64_t m, int64_t k, int8_t *q, float *ds) {
    const int64_t nb = k / 32;
    for (int64_t i = 0; i < m; ++i)
        for (int64_t b = 0; b < nb; ++b) {
            const float *xb = x + i * x_stride + b * 32;
            int8_t *qb = q + i * k + b * 32;
            float *o = ds + (i * nb + b) * 2;
#ifdef KVP_AVX2
            const __m256 nosign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
            __m256 v[4], amax = _mm256_setzero_ps();
            for (int t = 0; t < 4; ++t) {
                v[t] = _mm256_loadu_ps(xb + 8 * t);
                amax = _mm256_max_ps(amax, _mm256_and_ps(v[t], nosign));
            }
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            const float d = _mm_cvtss_f32(h) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            const __m256 idv = _mm256_set1_ps(id);
            __m256i n[4];  /* cvtps rounds to nearest even (the default MXCSR mode) */
            for (int t = 0; t < 4; ++t) n[t] = _mm256_cvtps_epi32(_mm256_mul_ps(v[t], idv));
            __m256i sum = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
            /* the packs interleave 128-bit lanes: groups of 4 come out as 0,2,4,6,1,3,5,7 */
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
            const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            _mm256_storeu_si256((__m256i *)qb, _mm256_permutevar8x32_epi32(p, order));
            o[0] = d;
            o[1] = d * (float)_mm_cvtsi128_si32(s4);
#else
            float amax = 0.f;
            for (int t = 0; t < 32; ++t) amax = fabsf(xb[t]) > amax ? fabsf(xb[t]) : amax;
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int sum = 0;
            for (int t = 0; t < 32; ++t) {
                /* adding and removing 1.5 * 2^23 rounds |v| < 2^22 to the nearest integer, ties to even */
                const float v = xb[t] * id, r = (v + 12582912.0f) - 12582912.0f;
                qb[t] = (int8_t)r;
                sum += qb[t];
            }
            o[0] = d;
            o[1] = d * (float)sum;
#endif
        }
}

#ifdef KVP_AVX2
/* NR weight rows from r0 x MM activation rows from m0; q4: Q4_1 else Q8_0. Always inlined
   with constant NR, MM and q4, so the loops unroll and the arrays live in registers. */
static inline __attribute__((always_inline)) void tile_q8(const job_t *j, int64_t r0, int64_t m0,
                                                          const int NR, const int MM, const int q4) {
    const int64_t nb = j->k / 32, bs = q4 ? 20 : 34;
    const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0f);
    __m256 acc[4][4];
    __m128 tail[4][4];  /* lane 1 sums m_w * s (Q4_1) */
    for (int r = 0; r < NR; ++r)
        for (int i = 0; i < MM; ++i) { acc[r][i] = _mm256_setzero_ps(); tail[r][i] = _mm_setzero_ps(); }
    /* Software prefetch of the next tile's rows, spread over this tile's blocks: NR * bs bytes
       (rounded up to cache lines) per block. The hardware prefetcher alone left one core at
       ~6.5 GB/s here; with it the M=1 matmuls ran 1.5x faster. Prefetches never fault. */
    const int PF = (NR * (int)bs + 63) / 64;
    const char *next = (const char *)(j->w + (r0 + NR) * nb * bs);
    for (int64_t b = 0; b < nb; ++b) {
        for (int t = 0; t < PF; ++t) _mm_prefetch(next + (b * PF + t) * 64, _MM_HINT_T0);
        __m256i wq[4], wabs[4];
        __m128 sc[4];  /* (d_w, m_w, 0, 0) for Q4_1, (d_w, 0, 0, 0) for Q8_0 */
        for (int r = 0; r < NR; ++r) {
            const uint8_t *blk = j->w + (r0 + r) * nb * bs + b * bs;
            if (q4) {
                uint32_t dm;
                memcpy(&dm, blk, 4);
                sc[r] = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
                const __m128i v = _mm_loadu_si128((const __m128i *)(blk + 4));  /* j: low nibble, j+16: high */
                const __m256i lo_hi = _mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1);
                wq[r] = _mm256_and_si256(lo_hi, low4);
            } else {
                uint16_t dh;
                memcpy(&dh, blk, 2);
                sc[r] = _mm_cvtph_ps(_mm_cvtsi32_si128(dh));
                wq[r] = _mm256_loadu_si256((const __m256i *)(blk + 2));
                wabs[r] = _mm256_sign_epi8(wq[r], wq[r]);
            }
        }
        for (int i = 0; i < MM; ++i) {
            const int64_t xi = (m0 + i) * nb + b;
            const __m256i xq = _mm256_loadu_si256((const __m256i *)(j->xq + xi * 32));
            const __m128 xds = _mm_castpd_ps(_mm_load_sd((const double *)(j->xds + xi * 2)));  /* (d, s, 0, 0) */
            for (int r = 0; r < NR; ++r) {
                const __m128 p = _mm_mul_ps(sc[r], xds);  /* (d_w d, m_w s, 0, 0) */
                const __m256i p16 = q4 ? _mm256_maddubs_epi16(wq[r], xq)
                                       : _mm256_maddubs_epi16(wabs[r], _mm256_sign_epi8(xq, wq[r]));
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
                acc[r][i] = _mm256_fmadd_ps(_mm256_broadcastss_ps(p), dot, acc[r][i]);
                if (q4) tail[r][i] = _mm_add_ps(tail[r][i], p);
            }
        }
    }
    for (int r = 0; r < NR; ++r)
        for (int i = 0; i < MM; ++i)
            j->y[(m0 + i) * j->y_stride + r0 + r] =
                hsum8(acc[r][i]) + (q4 ? _mm_cvtss_f32(_mm_movehdup_ps(tail[r][i])) : 0.f);
}

#define TILE(NR, MM) (q4 ? tile_q8(j, r, m0, NR, MM, 1) : tile_q8(j, r, m0, NR, MM, 0))

/* rows [n0, n1) of y, activations in passes of up to 4 rows: 4 x 1-2 or 2 x 3-4 tiles */
static void rows_q8(const job_t *j, int64_t n0, int64_t n1) {
    const int q4 = j->qtype == 3;
    for (int64_t m0 = 0; m0 < j->m; m0 += 4) {
        const int mm = j->m - m0 < 4 ? (int)(j->m - m0) : 4;
        int64_t r = n0;
        switch (mm) {
        case 1: for (; r + 4 <= n1; r += 4) TILE(4, 1); for (; r < n1; ++r) TILE(1, 1); break;
        case 2: for (; r + 4 <= n1; r += 4) TILE(4, 2); for (; r < n1; ++r) TILE(1, 2); break;
        case 3: for (; r + 2 <= n1; r += 2) TILE(2, 3); for (; r < n1; ++r) TILE(1, 3); break;
        default: for (; r + 2 <= n1; r += 2) TILE(2, 4); for (; r < n1; ++r) TILE(1, 4); break;
        }
    }
}
#else
static void rows_q8(const job_t *j, int64_t n0, int64_t n1) {
    const int64_t nb = j->k / 32, bs = j->qtype == 3 ? 20 : 34;
    for (int64_t r = n0; r < n1; ++r)
        for (int64_t i = 0; i < j->m; ++i) {
            float acc = 0.f, tail = 0.f;
            for (int64_t b = 0; b < nb; ++b) {
                const uint8_t *blk = j->w + r * nb * bs + b * bs;
                const int8_t *xq = j->xq + (i * nb + b) * 32;
                const float *xds = j->xds + (i * nb + b) * 2;
                uint16_t dh, mh;
                memcpy(&dh, blk, 2);
                int32_t isum = 0;
                if (j->qtype == 3) {
                    memcpy(&mh, blk + 2, 2);
                    for (int t = 0; t < 16; ++t) isum += (blk[4 + t] & 15) * xq[t] + (blk[4 + t] >> 4) * xq[t + 16];
                    tail += f16_to_f32(mh) * xds[1];
                } else {
                    for (int t = 0; t < 32; ++t) isum += (int8_t)blk[2 + t] * xq[t];
                }
                acc += f16_to_f32(dh) * xds[0] * (float)isum;
            }
            j->y[i * j->y_stride + r] = acc + tail;
        }
}
#endif

/* Rows per chunk: about CHUNKS_PER_THREAD chunks per thread (at least MIN_CHUNK rows, a multiple
   of 4 for the q8 tiles). Each claim is an atomic on a line the cores share: with chunks of
   32 rows, 2 threads ran a 576-row decode matmul no faster than 1. */
#define MIN_CHUNK 32
#define CHUNKS_PER_THREAD 4

static int run_chunk(const job_t *j, int64_t c, int tiled) {
    const int64_t n0 = c * j->rows_per_chunk, n1 = n0 + j->rows_per_chunk < j->n ? n0 + j->rows_per_chunk : j->n;
    if (j->act8) { rows_q8(j, n0, n1); return 0; }
#ifdef KVP_AVX2
    if (tiled) return rows_tiled(j, n0, n1);
#endif
    for (int64_t m0 = 0; m0 < j->m; m0 += MAXM) rows(j, n0, n1, m0, j->m - m0 < MAXM ? j->m - m0 : MAXM);
    return 0;
}

/* y[m, y_stride] (first n columns) = x[m, x_stride] (first k columns) @ W^T, W [n, k] in
   blocks of qtype 3 (Q4_1) or 8 (Q8_0), rows contiguous, or (qtype 103 / 108, act8 only) in
   kvp_gguf_amx_pack's layout of them; k a multiple of 32. act8: quantize
   x to 8-bit blocks first (kvp_quantize_q8_1) and use integer dot products. Uses up to
   `threads` threads. Returns 0, -1 for a bad qtype or k, -2 out of memory. */
int kvp_gguf_amx_run(int qtype, const uint8_t *wp, int64_t n, int64_t k, const int8_t *xq, const float *xds,
                     int64_t m, float *y, int64_t y_stride, int threads);

int kvp_gguf_matmul(int qtype, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t x_stride,
                    int64_t m, float *y, int64_t y_stride, int threads, int act8) {
    const int amx_layout = qtype == 103 || qtype == 108;  /* kvp_gguf_amx_pack's layout (gguf_amx.c) */
    if ((amx_layout ? !act8 : qtype != 3 && qtype != 8) || k % 32) return -1;
    if (m <= 0 || n <= 0) return 0;
    if (threads < 1) threads = 1;
    int64_t per = (n + threads * CHUNKS_PER_THREAD - 1) / (threads * CHUNKS_PER_THREAD);
    per = per < MIN_CHUNK ? MIN_CHUNK : (per + 3) / 4 * 4;
    const int64_t nb = k / 32, chunks = (n + per - 1) / per;
    const int tiled = !act8 && use_tiled(m);
    job_t job = {qtype, w, n, k, m, x_stride, y_stride, per, x, NULL, y, act8, NULL, NULL};
    if (act8) {
        const size_t qbytes = ((size_t)(m * k) + 63) & ~(size_t)63;
        char *buf = scratch(qbytes + sizeof(float) * 2 * m * nb);
        if (!buf) return -2;
        job.xq = (const int8_t *)buf;
        job.xds = (const float *)(buf + qbytes);
        kvp_quantize_q8_1(x, x_stride, m, k, (int8_t *)buf, (float *)(buf + qbytes));
        if (amx_layout) return kvp_gguf_amx_run(qtype - 100, w, n, k, job.xq, job.xds, m, y, y_stride, threads);
    } else if (qtype == 3 && !tiled) {
        float *xsum = scratch(sizeof(float) * m * nb);
        if (!xsum) return -2;
        for (int64_t i = 0; i < m; ++i)
            for (int64_t b = 0; b < nb; ++b) {
                float s = 0.f;
                for (int t = 0; t < 32; ++t) s += x[i * x_stride + b * 32 + t];
                xsum[i * nb + b] = s;
            }
        job.xsum = xsum;
    }
    const int team = threads > 1 && chunks > 1;
    int err = 0;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (team)
    for (int64_t c = 0; c < chunks; ++c) {
        const int rc = run_chunk(&job, c, tiled);
        if (rc) {
            #pragma omp atomic write
            err = rc;
        }
    }
    return err;
}

/* 1 where this build runs the AVX2 paths, 0 for the scalar loops. */
int kvp_gguf_simd(void) {
#ifdef KVP_AVX2
    return 1;
#else
    return 0;
#endif
}
