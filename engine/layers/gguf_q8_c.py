"""The C source of the GGUF kernel's 8-bit activation path (spliced into gguf_matmul_c.py's
library, which owns the split over threads and the entry point).

Each call first quantizes every activation row once into Q8_1-style blocks of 32, as
ggml's `quantize_row_q8_1` and vLLM's `quantize_q8_1` (GGUF, batch <= 8) do:
  d = max_j |x_j| / 127,  q_j = nearest(x_j * (1 / d)) int8 in -127..127,  s = d * sum_j q_j
(d and s kept in float32; ties round to even, as ggml's AVX2 quantizer does, where its
scalar reference rounds them away from zero). The dot products are then integer per block:
  Q4_1 x Q8_1: sum_j (d_w q4_j + m_w) (d_x q8_j) ~ d_w d_x sum_j q4_j q8_j + m_w s
  Q8_0 x Q8_1: d_w d_x sum_j q8w_j q8_j
AVX2: `_mm256_maddubs_epi16` multiplies unsigned by signed bytes and adds pairs into int16
(Q4_1's 0..15 is the unsigned side; for Q8_0 the sign trick maddubs(|w|, sign(x, w)), as
ggml does), `_mm256_madd_epi16` with ones widens to int32, and one FMA per block scales
the 8 partial sums. A tile of up to 4 weight rows x 4 activation rows keeps its
accumulators in registers and reuses each unpacked weight block and each activation load.
The scalar loops use the same integer arithmetic.
"""

Q8_SOURCE = r"""
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
"""
