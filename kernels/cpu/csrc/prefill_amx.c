/*
 * The prefill attention's AMX path (kernels/cpu/csrc/prefill.c has the call, the work items and the
 * float32 tiles; the header comment there describes both): the amx build's bf16 library only
 * (PF_AMX, prefill.h), once Linux granted the process the tile state.
 */
#include "prefill.h"

#ifdef PF_AMX
#include <immintrin.h>
/* The AMX path (the amx build's bf16 library, once Linux granted the tile state): see the header
   comment. Every tile is 16 rows x 64 bytes (16 x 16 float32 C tiles, 16 x 32 bf16 A tiles, 16
   pairs x 16 columns of bf16 pairs as B), so one LDTILECFG serves the whole call. */
#include "amx.h"
#define PA_BK 64  /* keys per softmax tile: 4 C tiles of 16 keys for q.K^T, 2 A tiles of 32 for p.V */

/* One thread's workspace for the attention phase: the item's queries (group x 16 rows, zero-padded
   to dp columns), its float32 output accumulators, one row tile's scores and bf16 probabilities,
   the per-row running maximum (log2 units, scale included) and sum. */
typedef struct {
    uint16_t *q, *p;
    float *acc, *sc, *m, *l;
} pa_ws;

/* 2^x for x <= 0 (inputs below -127 give 2^-127): x = n + f with n an integer and |f| <= 1/2,
   2^f from Cephes' exp2f polynomial (relative error 1.7e-7), scaled by 2^n with VSCALEFPS.
   Source: Cephes Math Library, exp2f.c (S. L. Moshier). */
static inline __m512 pa_exp2(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-127.f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* The first n (clamped to [0, 16]) lanes of a 16-lane vector. */
static inline __mmask16 pa_lanes(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

/* Packs keys [k0, k0 + PA_BK) of sequence s, KV head g into the tile layouts (keys at or past the
   sequence's length as zeros: a tile may run past the end, and 0 * NaN would poison the sums):
   kt[kb][p][n][e] = K[16 kb + n][2 p + e] (pairs p < dp / 2 of head dims, zero past d: a B tile of
   q.K^T is 16 pairs x 16 keys, 1 KB contiguous), and v[vb][cb][p][n][e] = V[32 vb + 2 p + e][16 cb + n]
   (a B tile of p.V: 16 key pairs x 16 dims, VNNI's pairs of rows interleaved). K goes through 16 x 16
   transposes of 32-bit pairs (4 rounds of unpack / 128-bit lane shuffles), V through one 16-bit
   permute per 16 dims of a key pair. */
static void pa_pack(const kvp_prefill_args *a, int64_t s, int64_t g, int64_t k0, int64_t dp, uint16_t *kt,
                    uint16_t *v) {
    const int64_t d = a->head_dim, bs = a->block_size, seq_len = a->seq_lens[s];
    const int32_t *table = a->tables + s * a->max_blocks;
    int64_t off[PA_BK];  /* offset of key k0 + j's row in either cache, -1 past the end */
    for (int64_t j = 0; j < PA_BK; ++j) {
        const int64_t t = k0 + j;
        off[j] = t < seq_len ? ((int64_t)table[t / bs] * bs + t % bs) * a->num_kv_heads * d + g * d : -1;
    }
    for (int64_t kb = 0; kb < PA_BK / 16; ++kb)
        for (int64_t dc = 0; dc < dp / 32; ++dc) {
            const __mmask32 dims = d - 32 * dc >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (d - 32 * dc)) - 1);
            __m512i r[16], t[16];
            for (int n = 0; n < 16; ++n) {
                const int64_t o = off[16 * kb + n];
                r[n] = o < 0 ? _mm512_setzero_si512() : _mm512_maskz_loadu_epi16(dims, a->k_cache + o + 32 * dc);
            }
            /* within each 128-bit lane L, rows 4G..4G+3: t[4G + j] lane L = pair 4L + j of those rows */
            for (int G = 0; G < 4; ++G) {
                const __m512i lo01 = _mm512_unpacklo_epi32(r[4 * G], r[4 * G + 1]),
                              hi01 = _mm512_unpackhi_epi32(r[4 * G], r[4 * G + 1]),
                              lo23 = _mm512_unpacklo_epi32(r[4 * G + 2], r[4 * G + 3]),
                              hi23 = _mm512_unpackhi_epi32(r[4 * G + 2], r[4 * G + 3]);
                t[4 * G] = _mm512_unpacklo_epi64(lo01, lo23);
                t[4 * G + 1] = _mm512_unpackhi_epi64(lo01, lo23);
                t[4 * G + 2] = _mm512_unpacklo_epi64(hi01, hi23);
                t[4 * G + 3] = _mm512_unpackhi_epi64(hi01, hi23);
            }
            /* then a 4 x 4 transpose of 128-bit lanes: pair 4L + j = lane L of t[j], t[4 + j], ... */
            uint16_t *o = kt + ((k0 / 16 + kb) * (dp / 2) + 16 * dc) * 32;
            for (int j = 0; j < 4; ++j) {
                const __m512i x0 = _mm512_shuffle_i32x4(t[j], t[4 + j], 0x44),
                              x1 = _mm512_shuffle_i32x4(t[j], t[4 + j], 0xee),
                              x2 = _mm512_shuffle_i32x4(t[8 + j], t[12 + j], 0x44),
                              x3 = _mm512_shuffle_i32x4(t[8 + j], t[12 + j], 0xee);
                _mm512_storeu_si512(o + (0 + j) * 32, _mm512_shuffle_i32x4(x0, x2, 0x88));
                _mm512_storeu_si512(o + (4 + j) * 32, _mm512_shuffle_i32x4(x0, x2, 0xdd));
                _mm512_storeu_si512(o + (8 + j) * 32, _mm512_shuffle_i32x4(x1, x3, 0x88));
                _mm512_storeu_si512(o + (12 + j) * 32, _mm512_shuffle_i32x4(x1, x3, 0xdd));
            }
        }
    /* lane 2n takes element n of the first row (lanes 0-15), lane 2n + 1 element n of the second */
    __m512i idx;
    {
        uint16_t ix[32];
        for (int n = 0; n < 16; ++n) { ix[2 * n] = (uint16_t)n; ix[2 * n + 1] = (uint16_t)(16 + n); }
        idx = _mm512_loadu_si512(ix);
    }
    for (int64_t j = 0; j < PA_BK; j += 2) {
        const int64_t oa = off[j], ob = off[j + 1], p = (j % 32) / 2;
        uint16_t *o = v + ((k0 + j) / 32 * (d / 16) * 16 + p) * 32;
        for (int64_t cb = 0; cb < d / 16; ++cb, o += 512) {
            const __m256i ra = oa < 0 ? _mm256_setzero_si256() : _mm256_loadu_si256((const __m256i *)(a->v_cache + oa + 16 * cb)),
                          rb = ob < 0 ? _mm256_setzero_si256() : _mm256_loadu_si256((const __m256i *)(a->v_cache + ob + 16 * cb));
            _mm512_storeu_si512(o, _mm512_permutexvar_epi16(idx, _mm512_inserti64x4(_mm512_castsi256_si512(ra), rb, 1)));
        }
    }
}

/* sc[i * PA_BK + 16 j + n] = q_i . k_{16 j + n} for the 16 rows of q (row stride dp) and key blocks
   j < nsub of kt (at the tile's first key block): C tiles 0-3 (one per 16 keys), A tile 4 (32 head
   dims of the rows), B tiles 5-7 in turn (so a load need not wait for the previous product). */
static void pa_scores(const uint16_t *q, int64_t dp, const uint16_t *kt, int64_t nsub, float *sc) {
    const int64_t kbs = 16 * dp;  /* elements per 16-key block of kt */
    if (nsub == 4) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t dc = 0; dc < dp / 32; ++dc) {
            const uint16_t *b = kt + 512 * dc;
            _tile_loadd(4, q + 32 * dc, dp * 2);
            _tile_loadd(5, b, 64); _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, b + kbs, 64); _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(7, b + 2 * kbs, 64); _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, b + 3 * kbs, 64); _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, sc, PA_BK * 4); _tile_stored(1, sc + 16, PA_BK * 4);
        _tile_stored(2, sc + 32, PA_BK * 4); _tile_stored(3, sc + 48, PA_BK * 4);
        return;
    }
    for (int64_t j = 0; j < nsub; ++j) {
        _tile_zero(0);
        for (int64_t dc = 0; dc < dp / 32; ++dc) {
            _tile_loadd(4, q + 32 * dc, dp * 2);
            _tile_loadd(5, kt + j * kbs + 512 * dc, 64);
            _tile_dpbf16ps(0, 4, 5);
        }
        _tile_stored(0, sc + 16 * j, PA_BK * 4);
    }
}

/* The online softmax step of 16 rows over one tile's scores: row i sees keys [0, nvalid_i) of the
   tile, nvalid_i = diag + i + 1 clamped to [0, nk] (diag: the rows' first position minus the tile's
   first key). The maxima of the 16 rows are one vector (m, in log2 units: c = scale * log2(e)), so
   the rescale factors exp2(m_old - m_new) are one vector exp2; p = exp2(c s - m_new) is rounded to
   bf16 (0 past nvalid) into pb, the float32 sum of p added to l, and acc's rows (d floats) rescaled
   where their maximum grew. */
static void pa_softmax(const float *sc, int64_t nk, int64_t diag, float c, float *m, float *l, uint16_t *pb,
                       float *acc, int64_t d) {
    float mx[16], sum[16], corr[16];
    const __m512 cc = _mm512_set1_ps(c);
    const int full = nk == PA_BK && diag + 1 >= PA_BK;  /* every row sees the whole tile: no masks */
    for (int i = 0; i < 16; ++i) {
        const float *si = sc + i * PA_BK;
        if (full) {
            const __m512 best = _mm512_max_ps(_mm512_max_ps(_mm512_loadu_ps(si), _mm512_loadu_ps(si + 16)),
                                              _mm512_max_ps(_mm512_loadu_ps(si + 32), _mm512_loadu_ps(si + 48)));
            mx[i] = _mm512_reduce_max_ps(best) * c;
            continue;
        }
        const int64_t nvalid = diag + i + 1 < nk ? diag + i + 1 : nk;
        __m512 best = _mm512_set1_ps(-FLT_MAX);
        for (int64_t j = 0; 16 * j < nvalid; ++j)
            best = _mm512_mask_max_ps(best, pa_lanes(nvalid - 16 * j), best, _mm512_loadu_ps(si + 16 * j));
        mx[i] = nvalid > 0 ? _mm512_reduce_max_ps(best) * c : -FLT_MAX;
    }
    const __m512 m_old = _mm512_loadu_ps(m), m_new = _mm512_max_ps(m_old, _mm512_loadu_ps(mx));
    const __m512 cv = pa_exp2(_mm512_sub_ps(m_old, m_new));
    _mm512_storeu_ps(m, m_new);
    _mm512_storeu_ps(corr, cv);
    for (int i = 0; i < 16; ++i) {
        const float *si = sc + i * PA_BK;
        const __m512 mn = _mm512_set1_ps(m[i]);
        __m512 s;
        if (full) {
            const __m512 e0 = pa_exp2(_mm512_fmsub_ps(_mm512_loadu_ps(si), cc, mn)),
                         e1 = pa_exp2(_mm512_fmsub_ps(_mm512_loadu_ps(si + 16), cc, mn)),
                         e2 = pa_exp2(_mm512_fmsub_ps(_mm512_loadu_ps(si + 32), cc, mn)),
                         e3 = pa_exp2(_mm512_fmsub_ps(_mm512_loadu_ps(si + 48), cc, mn));
            _mm512_storeu_si512(pb + i * PA_BK, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
            _mm512_storeu_si512(pb + i * PA_BK + 32, (__m512i)_mm512_cvtne2ps_pbh(e3, e2));
            s = _mm512_add_ps(_mm512_add_ps(e0, e1), _mm512_add_ps(e2, e3));
        } else {
            const int64_t nvalid = diag + i + 1 < nk ? diag + i + 1 : nk;
            s = _mm512_setzero_ps();
            for (int64_t j = 0; j < PA_BK / 16; j += 2) {
                const __mmask16 m0 = pa_lanes(nvalid - 16 * j), m1 = pa_lanes(nvalid - 16 * j - 16);
                __m512 e0 = _mm512_setzero_ps(), e1 = e0;
                if (m0) e0 = _mm512_maskz_mov_ps(m0, pa_exp2(_mm512_fmsub_ps(_mm512_loadu_ps(si + 16 * j), cc, mn)));
                if (m1) e1 = _mm512_maskz_mov_ps(m1, pa_exp2(_mm512_fmsub_ps(_mm512_loadu_ps(si + 16 * j + 16), cc, mn)));
                s = _mm512_add_ps(s, _mm512_add_ps(e0, e1));
                _mm512_storeu_si512(pb + i * PA_BK + 16 * j, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
            }
        }
        sum[i] = _mm512_reduce_add_ps(s);
        if (corr[i] != 1.f) {
            const __m512 f = _mm512_set1_ps(corr[i]);
            for (int64_t t = 0; t < d; t += 16)
                _mm512_storeu_ps(acc + i * d + t, _mm512_mul_ps(f, _mm512_loadu_ps(acc + i * d + t)));
        }
    }
    _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), cv, _mm512_loadu_ps(sum)));
}

/* acc[i][t] += sum_k p[i][k] v_k[t] for the 16 rows, the tile's key pairs kp < npair (32 keys each, v
   at the tile's first 32-key block) and dims t < d: the accumulators are C tiles loaded from and
   stored back to acc (row stride d floats), 4 column blocks of 16 at a time (tiles 0-3; A tile 4:
   32 keys of p; B tiles 5-7 in turn), then single blocks for d % 64. */
static void pa_pv(const uint16_t *pb, int64_t npair, const uint16_t *v, int64_t d, float *acc) {
    const int64_t ncb = d / 16, vbs = ncb * 512;  /* elements per 32-key block of v */
    int64_t cb = 0;
    for (; cb + 4 <= ncb; cb += 4) {
        float *o = acc + 16 * cb;
        _tile_loadd(0, o, d * 4); _tile_loadd(1, o + 16, d * 4);
        _tile_loadd(2, o + 32, d * 4); _tile_loadd(3, o + 48, d * 4);
        for (int64_t kp = 0; kp < npair; ++kp) {
            const uint16_t *b = v + kp * vbs + cb * 512;
            _tile_loadd(4, pb + 32 * kp, PA_BK * 2);
            _tile_loadd(5, b, 64); _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, b + 512, 64); _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(7, b + 1024, 64); _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, b + 1536, 64); _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, o, d * 4); _tile_stored(1, o + 16, d * 4);
        _tile_stored(2, o + 32, d * 4); _tile_stored(3, o + 48, d * 4);
    }
    for (; cb < ncb; ++cb) {
        _tile_loadd(0, acc + 16 * cb, d * 4);
        for (int64_t kp = 0; kp < npair; ++kp) {
            _tile_loadd(4, pb + 32 * kp, PA_BK * 2);
            _tile_loadd(5, v + kp * vbs + cb * 512, 64);
            _tile_dpbf16ps(0, 4, 5);
        }
        _tile_stored(0, acc + 16 * cb, d * 4);
    }
}

/* One work item on tiles: row tile g2 of the group is head kv_head * group + g2 at the item's 16
   positions (rows past the chunk's end: zero queries, output dropped). Per tile of PA_BK keys, each
   row tile in turn (the tile's packed K/V stay in L1 across the group): scores, softmax, p.V.
   kt, v: the (sequence, KV head)'s packed keys and values (pa_pack). */
static void pa_run_item(const kvp_prefill_args *a, const pf_item *it, const uint16_t *kt, const uint16_t *v,
                        int64_t dp, const pa_ws *w) {
    const int64_t d = a->head_dim, group = a->num_heads / a->num_kv_heads, s = it->seq;
    const int64_t start = a->query_start[s], q_len = a->query_start[s + 1] - start;
    const int64_t base = a->seq_lens[s] - q_len + it->q0, nq = it->q1 - it->q0, kend = base + nq;
    const float c = a->scale * 1.4426950408889634f;  /* log2(e): exp(x) = exp2(x log2(e)) */
    for (int64_t g2 = 0; g2 < group; ++g2)
        for (int64_t i = 0; i < 16; ++i) {
            uint16_t *dst = w->q + (g2 * 16 + i) * dp;
            const kvp_t *src = a->q + (start + it->q0 + i) * a->q_stride_token + (it->kv_head * group + g2) * a->q_stride_head;
            for (int64_t t = 0; t < dp; t += 32) {  /* 32 dims at a time, zeros past d and past the chunk */
                const __mmask32 in = i >= nq ? 0 : d - t >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (d - t)) - 1);
                _mm512_storeu_si512(dst + t, _mm512_maskz_loadu_epi16(in, src + t));
            }
        }
    memset(w->acc, 0, sizeof(float) * group * 16 * d);
    for (int64_t r = 0; r < group * 16; ++r) { w->m[r] = -FLT_MAX; w->l[r] = 0.f; }
    for (int64_t k0 = 0; k0 < kend; k0 += PA_BK) {
        const int64_t nk = kend - k0 < PA_BK ? kend - k0 : PA_BK;
        const uint16_t *ktile = kt + k0 * dp, *vtile = v + k0 * d;  /* 16 dp per 16-key block, 32 d per 32 */
        for (int64_t g2 = 0; g2 < group; ++g2) {
            float *acc = w->acc + g2 * 16 * d;
            pa_scores(w->q + g2 * 16 * dp, dp, ktile, (nk + 15) / 16, w->sc);
            pa_softmax(w->sc, nk, base - k0, c, w->m + g2 * 16, w->l + g2 * 16, w->p, acc, d);
            pa_pv(w->p, (nk + 31) / 32, vtile, d, acc);
        }
    }
    for (int64_t g2 = 0; g2 < group; ++g2)
        for (int64_t i = 0; i < nq; ++i) {
            uint16_t *o = a->out + (start + it->q0 + i) * a->out_stride_token + (it->kv_head * group + g2) * d;
            const float *acc = w->acc + (g2 * 16 + i) * d;
            const __m512 inv = _mm512_set1_ps(1.f / w->l[g2 * 16 + i]);
            for (int64_t t = 0; t < d; t += 16)
                _mm256_storeu_si256((__m256i *)(o + t), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(inv, _mm512_loadu_ps(acc + t))));
        }
}

/* The AMX call: packs each (sequence, KV head)'s keys and values once into a shared workspace
   (units of PA_BK keys over the team), then runs the sorted items (dynamic schedule) on tiles.
   Returns 0, -1 where a thread's workspace could not be allocated, 1 where the packed workspace
   could not (the caller then takes the float32 path, which needs none). */
int pa_prefill(const kvp_prefill_args *a, const pf_item *items, int64_t n_items, int64_t num_seqs,
                      int64_t num_threads) {
    const int64_t d = a->head_dim, dp = (d + 31) / 32 * 32, nkv = a->num_kv_heads, group = a->num_heads / nkv;
    /* sequence s: npk[s] keys packed per KV head (its length rounded up to tiles, 0 without a
       chunk), its heads' layouts from element base[s] of the workspace, its pack units from unit[s] */
    int64_t *npk = malloc(sizeof(int64_t) * (3 * num_seqs + 2)), *base = npk + num_seqs, *unit = base + num_seqs + 1;
    if (!npk) return 1;
    base[0] = unit[0] = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        npk[s] = a->query_start[s + 1] > a->query_start[s] ? (a->seq_lens[s] + PA_BK - 1) / PA_BK * PA_BK : 0;
        base[s + 1] = base[s] + nkv * npk[s] * (dp + d);
        unit[s + 1] = unit[s] + nkv * npk[s] / PA_BK;
    }
    const int64_t n_units = unit[num_seqs];
    uint16_t *packed = aligned_alloc(64, (sizeof(uint16_t) * base[num_seqs] + 63) / 64 * 64 + 64);
    if (!packed) { free(npk); return 1; }
    int err = 0;
    #pragma omp parallel num_threads(num_threads) if (num_threads > 1 && (n_items > 1 || n_units > 1))
    {
        #pragma omp for schedule(dynamic, 4)
        for (int64_t u = 0; u < n_units; ++u) {
            int64_t s = 0;  /* unit u: sequence s, KV head g, keys [k0, k0 + PA_BK) */
            while (u >= unit[s + 1]) ++s;
            const int64_t per_head = npk[s] / PA_BK, g = (u - unit[s]) / per_head, k0 = (u - unit[s]) % per_head * PA_BK;
            uint16_t *kt = packed + base[s] + g * npk[s] * (dp + d);
            pa_pack(a, s, g, k0, dp, kt, kt + npk[s] * dp);
        }
        const size_t rows = 16 * group;
        pa_ws w = {aligned_alloc(64, sizeof(uint16_t) * rows * dp), aligned_alloc(64, sizeof(uint16_t) * 16 * PA_BK),
                   aligned_alloc(64, sizeof(float) * rows * d), aligned_alloc(64, sizeof(float) * 16 * PA_BK),
                   aligned_alloc(64, sizeof(float) * rows), aligned_alloc(64, sizeof(float) * rows)};
        const int ok = w.q && w.p && w.acc && w.sc && w.m && w.l;
        if (!ok) {
            #pragma omp atomic write
            err = -1;
        } else {
            kvp_tile_config cfg;
            memset(&cfg, 0, sizeof cfg);
            cfg.palette = 1;
            for (int t = 0; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
            _tile_loadconfig(&cfg);
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_items; ++i)
            if (ok) {
                const pf_item *it = &items[i];
                const uint16_t *kt = packed + base[it->seq] + it->kv_head * npk[it->seq] * (dp + d);
                pa_run_item(a, it, kt, kt + npk[it->seq] * dp, dp, &w);
            }
        if (ok) _tile_release();
        free(w.q); free(w.p); free(w.acc); free(w.sc); free(w.m); free(w.l);
    }
    free(packed);
    free(npk);
    return err;
}
#endif

/* 1 where kvp_paged_prefill_bf16 runs on AMX tiles (the amx build's bf16 library, the tile state
   granted by Linux), else 0 (the float32 register tiles serve). */
int kvp_prefill_amx(void) {
#ifdef PF_AMX
    return kvp_amx_granted();
#else
    return 0;
#endif
}

