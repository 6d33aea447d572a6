/*
 * Prefill/extend attention over the paged KV cache (built into the attention library with
 * attention.c; Python face: kernels/cpu/prefill.py).
 *
 * `kvp_paged_prefill_f32` (`_bf16` in the bf16 build: K/V, q and out stored as bf16, widened
 * to float32 as they are loaded) runs the causal attention of every prefill or extend chunk of a layer
 * in one call, reading K/V in place from the paged cache through each sequence's block table
 * (the chunk's own K/V already written there), as vLLM's CPU backend and its Triton
 * `context_attention_fwd` do. It is FlashAttention's loop (Dao et al., NeurIPS 2022: tiles of
 * keys, an online softmax with a running maximum and sum per query row, the output rescaled
 * when the maximum grows), laid out for an AVX2 CPU:
 *
 * - a work item is one sequence, one KV head and PF_BQ consecutive query positions, i.e. the
 *   PF_BQ x (num_heads / num_kv_heads) query rows of its GQA group that share every K/V row read;
 *   items run over the OpenMP team, longest first (an item costs its rows x its last position);
 * - per tile of up to PF_BK keys: the keys transposed into a [head_dim, PF_BK] panel (8 x 8
 *   register transposes), scores in register tiles of 6 query rows x 16 keys (BLIS's micro-kernel
 *   shape: 12 ymm accumulators, one broadcast of q per row and dim), the causal limit per row (key
 *   position <= query position), the online softmax update (expf vectorized through libmvec),
 *   then p . V in register tiles of 6 rows x 16 dims (one broadcast of p per row and key).
 *   Rows are padded to a multiple of 6 (a group of 3 heads x 16 positions is 48 rows).
 *
 * torch's flash attention on CPU runs the same loop through MKL GEMM calls on [q-block x
 * kv-block] tiles, one SDPA call per sequence; here one call per layer covers all chunks and
 * the GQA group's rows share each K/V load. head_dim a multiple of 16; AVX2 + FMA builds only: elsewhere
 * `kvp_prefill_simd()` returns 0 and the caller keeps torch's SDPA.
 *
 * AMX (the amx build's bf16 library, once Linux granted the process the tile state:
 * `kvp_prefill_amx()`): the same items and online softmax with both products on TDPBF16PS tiles
 * (16 rows x 16 float32 per C tile, sums of bf16 pair products in float32):
 * - first each (sequence, KV head)'s keys and values are packed once into a shared workspace, in
 *   units of 64 keys over the team: K^T in the B layout of q.K^T (16 pairs of head dims x 16 keys,
 *   B[p][n] = (K[n][2p], K[n][2p+1]): 16 x 16 transposes of 32-bit pairs in AVX-512) and V in VNNI's
 *   (B[p][n] = (V[2p][n], V[2p+1][n]): two key rows interleaved). Every 16-position item of the
 *   sequence and every query head of the group then read the same packed tiles;
 * - an item's rows are the group's heads x its 16 positions, one row tile (A) per head, q copied as
 *   stored (bf16); per tile of 64 keys and row tile: the scores (4 C tiles), the online softmax on them
 *   in AVX-512 (exp2 by a polynomial, the causal limit per row as a lane mask, the 16 rows' maxima
 *   and rescale factors one vector), the probabilities rounded to bf16 as the A operand of p.V,
 *   the float32 output accumulators loaded as C tiles, rescaled where a row's maximum grew, and
 *   rounded to bf16 once at the end. Rounding p to bf16 is what FlashAttention does on GPUs (the
 *   P tile fed to the tensor cores in the input dtype) and vLLM's CPU attention does on AMX
 *   (csrc/cpu, its bf16 micro-GEMMs); the row sums stay float32 (FlashAttention-2's rowsum). Results
 *   differ from the float32 tiles' in the low bits (tests/kernels/test_cpu_prefill_amx.py).
 * Should the packed workspace not be allocated, the float32 tiles serve the call.
 * Source: Intel SDM vol. 1 ch. 18 (AMX: LDTILECFG, TILELOADD, TDPBF16PS); Dao et al. 2022 and
 * Dao 2023 (FlashAttention-2) for the loop; vLLM csrc/cpu (attention on AMX) for p in bf16.
 */

#include "kvp.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PF_BQ 16  /* query positions per work item */
#define PF_BK 64  /* keys per softmax tile */

typedef struct {
    const kvp_t *q; int64_t q_stride_token, q_stride_head;
    const kvp_t *k_cache, *v_cache;
    const int32_t *tables; int64_t max_blocks;
    const int32_t *query_start, *seq_lens;
    kvp_t *out; int64_t out_stride_token;
    int64_t num_heads, num_kv_heads, head_dim, block_size;
    float scale;
} kvp_prefill_args;

typedef struct { int64_t cost; int32_t seq, kv_head, q0, q1; } pf_item;

/* 8 consecutive stored values as floats (bf16: zero-extend to 32 bits, shift into the top half). */
static inline __m256 pf_load8(const kvp_t *p) {
#ifdef KVP_BF16
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
#else
    return _mm256_loadu_ps(p);
#endif
}

/* s[i * sst + j] = q_i . k_j for 6 query rows i and 16 keys j: kt is the tile's keys transposed,
   kt[t * PF_BK + j] = k_j[t] for t < d, so each q_i[t] is broadcast against 8 keys at once and
   the 12 accumulators need no horizontal sums (BLIS's 6 x 16 micro-kernel shape). Named
   accumulators: in an array gcc stored them to the stack at every step. */
static void pf_qk_6x16(const float *const *qp, const float *kt, int64_t d, float *s, int64_t sst) {
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0,
           a4 = a0, b4 = a0, a5 = a0, b5 = a0;
    const float *q0 = qp[0], *q1 = qp[1], *q2 = qp[2], *q3 = qp[3], *q4 = qp[4], *q5 = qp[5];
    for (int64_t t = 0; t < d; ++t, kt += PF_BK) {
        const __m256 k0 = _mm256_loadu_ps(kt), k1 = _mm256_loadu_ps(kt + 8);
        __m256 x = _mm256_broadcast_ss(q0 + t);
        a0 = _mm256_fmadd_ps(x, k0, a0); b0 = _mm256_fmadd_ps(x, k1, b0);
        x = _mm256_broadcast_ss(q1 + t);
        a1 = _mm256_fmadd_ps(x, k0, a1); b1 = _mm256_fmadd_ps(x, k1, b1);
        x = _mm256_broadcast_ss(q2 + t);
        a2 = _mm256_fmadd_ps(x, k0, a2); b2 = _mm256_fmadd_ps(x, k1, b2);
        x = _mm256_broadcast_ss(q3 + t);
        a3 = _mm256_fmadd_ps(x, k0, a3); b3 = _mm256_fmadd_ps(x, k1, b3);
        x = _mm256_broadcast_ss(q4 + t);
        a4 = _mm256_fmadd_ps(x, k0, a4); b4 = _mm256_fmadd_ps(x, k1, b4);
        x = _mm256_broadcast_ss(q5 + t);
        a5 = _mm256_fmadd_ps(x, k0, a5); b5 = _mm256_fmadd_ps(x, k1, b5);
    }
    _mm256_storeu_ps(s, a0); _mm256_storeu_ps(s + 8, b0);
    _mm256_storeu_ps(s + sst, a1); _mm256_storeu_ps(s + sst + 8, b1);
    _mm256_storeu_ps(s + 2 * sst, a2); _mm256_storeu_ps(s + 2 * sst + 8, b2);
    _mm256_storeu_ps(s + 3 * sst, a3); _mm256_storeu_ps(s + 3 * sst + 8, b3);
    _mm256_storeu_ps(s + 4 * sst, a4); _mm256_storeu_ps(s + 4 * sst + 8, b4);
    _mm256_storeu_ps(s + 5 * sst, a5); _mm256_storeu_ps(s + 5 * sst + 8, b5);
}

/* acc[i * ast + c + t] += sum_j p[i * pst + j] * v_j[c + t] for 6 rows i, 16 dims t, j < nk: 12
   accumulators, 2 V vectors and a broadcast fit the 16 ymm registers (3 rows x 32 dims did not). */
static void pf_pv_6x16(const float *p, int64_t pst, const kvp_t *const *vp, int64_t nk, float *acc, int64_t ast,
                       int64_t c) {
    float *o = acc + c;
#define PF_LD(i) a##i = _mm256_loadu_ps(o + i * ast), b##i = _mm256_loadu_ps(o + i * ast + 8)
    __m256 PF_LD(0), PF_LD(1), PF_LD(2), PF_LD(3), PF_LD(4), PF_LD(5);
#undef PF_LD
    for (int64_t j = 0; j < nk; ++j) {
        const __m256 v0 = pf_load8(vp[j] + c), v1 = pf_load8(vp[j] + c + 8);
        __m256 x;
#define PF_ROW(i) x = _mm256_broadcast_ss(p + i * pst + j); a##i = _mm256_fmadd_ps(x, v0, a##i); \
                  b##i = _mm256_fmadd_ps(x, v1, b##i);
        PF_ROW(0) PF_ROW(1) PF_ROW(2) PF_ROW(3) PF_ROW(4) PF_ROW(5)
#undef PF_ROW
    }
#define PF_ST(i) _mm256_storeu_ps(o + i * ast, a##i); _mm256_storeu_ps(o + i * ast + 8, b##i);
    PF_ST(0) PF_ST(1) PF_ST(2) PF_ST(3) PF_ST(4) PF_ST(5)
#undef PF_ST
}

/* kt[c * PF_BK + j] = k_j[c] for j < nk (8 keys at a time through an 8 x 8 register transpose),
   c < d; keys [nk, nk rounded up to 16) get zeros. */
static void pf_pack_kt(const kvp_t *const *kp, int64_t nk, int64_t d, float *kt) {
    int64_t j = 0;
    for (; j + 8 <= nk; j += 8)
        for (int64_t c = 0; c < d; c += 8) {
            __m256 r0 = pf_load8(kp[j] + c), r1 = pf_load8(kp[j + 1] + c),
                   r2 = pf_load8(kp[j + 2] + c), r3 = pf_load8(kp[j + 3] + c),
                   r4 = pf_load8(kp[j + 4] + c), r5 = pf_load8(kp[j + 5] + c),
                   r6 = pf_load8(kp[j + 6] + c), r7 = pf_load8(kp[j + 7] + c);
            const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1),
                         t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3),
                         t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
                         t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
            const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee),
                         u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee),
                         u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee),
                         u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
            float *o = kt + c * PF_BK + j;
            _mm256_storeu_ps(o, _mm256_permute2f128_ps(u0, u4, 0x20));
            _mm256_storeu_ps(o + PF_BK, _mm256_permute2f128_ps(u1, u5, 0x20));
            _mm256_storeu_ps(o + 2 * PF_BK, _mm256_permute2f128_ps(u2, u6, 0x20));
            _mm256_storeu_ps(o + 3 * PF_BK, _mm256_permute2f128_ps(u3, u7, 0x20));
            _mm256_storeu_ps(o + 4 * PF_BK, _mm256_permute2f128_ps(u0, u4, 0x31));
            _mm256_storeu_ps(o + 5 * PF_BK, _mm256_permute2f128_ps(u1, u5, 0x31));
            _mm256_storeu_ps(o + 6 * PF_BK, _mm256_permute2f128_ps(u2, u6, 0x31));
            _mm256_storeu_ps(o + 7 * PF_BK, _mm256_permute2f128_ps(u3, u7, 0x31));
        }
    const int64_t end = (nk + 15) / 16 * 16;
    if (j < end)
        for (int64_t c = 0; c < d; ++c)
            for (int64_t jj = j; jj < end; ++jj) kt[c * PF_BK + jj] = jj < nk ? kvp_ld(kp[jj][c]) : 0.f;
}

/* The online softmax step of row r over a tile's n scores s[0, n) of which the first nvalid are
   unmasked: s becomes p = exp(scale * s - m_new) (0 past nvalid), l and acc are rescaled by
   exp(m_old - m_new) where the maximum grew. */
static void pf_softmax_row(float *s, int64_t n, int64_t nvalid, float scale, float *m, float *l,
                           float *acc, int64_t d) {
    if (nvalid <= 0) {
        memset(s, 0, sizeof(float) * n);
        return;
    }
    float mx = *m;
    for (int64_t j = 0; j < nvalid; ++j) mx = fmaxf(mx, s[j] * scale);
    const float corr = *l > 0.f ? expf(*m - mx) : 0.f;
    float sum = 0.f;
    #pragma omp simd reduction(+:sum)
    for (int64_t j = 0; j < nvalid; ++j) {
        const float e = expf(s[j] * scale - mx);
        s[j] = e;
        sum += e;
    }
    for (int64_t j = nvalid; j < n; ++j) s[j] = 0.f;
    if (corr != 1.f)
        for (int64_t t = 0; t < d; ++t) acc[t] *= corr;
    *l = *l * corr + sum;
    *m = mx;
}

/* One work item: rows r = i * group + g2 (query position i of the item, head kv_head * group + g2),
   padded to a multiple of 6 with copies of row 0 whose scores are zeroed and output dropped; the
   rows' queries are first copied as floats into the workspace.
   ws: this thread's workspace (ws_floats), qp: padded query pointers, kvp: 2 * PF_BK K/V row pointers. */
static void pf_run_item(const kvp_prefill_args *a, const pf_item *it, float *ws, const float **qp,
                        const kvp_t **kvp) {
    const int64_t d = a->head_dim, group = a->num_heads / a->num_kv_heads, s = it->seq;
    const int64_t start = a->query_start[s], q_len = a->query_start[s + 1] - start;
    const int64_t first_pos = a->seq_lens[s] - q_len, rows = (it->q1 - it->q0) * group, padded = (rows + 5) / 6 * 6;
    const int64_t row_kv = a->num_kv_heads * d, bs = a->block_size;
    const int32_t *table = a->tables + s * a->max_blocks;
    float *acc = ws, *sc = acc + padded * d, *m = sc + padded * PF_BK, *l = m + padded, *kt = l + padded;
    float *qf = kt + d * PF_BK;
    const kvp_t **kp = kvp, **vp = kvp + PF_BK;
    for (int64_t r = 0; r < padded; ++r) {
        if (r >= rows) { qp[r] = qp[0]; continue; }
        const kvp_t *src = a->q + (start + it->q0 + r / group) * a->q_stride_token
                           + (it->kv_head * group + r % group) * a->q_stride_head;
        for (int64_t t = 0; t < d; ++t) qf[r * d + t] = kvp_ld(src[t]);
        qp[r] = qf + r * d;
    }
    memset(acc, 0, sizeof(float) * padded * d);
    for (int64_t r = 0; r < rows; ++r) { m[r] = -FLT_MAX; l[r] = 0.f; }
    const int64_t kend = first_pos + it->q1;  /* keys [0, kend): up to the item's last query */
    for (int64_t k0 = 0; k0 < kend; k0 += PF_BK) {
        const int64_t nk = kend - k0 < PF_BK ? kend - k0 : PF_BK;
        for (int64_t j = 0; j < nk; ++j) {
            const int64_t t = k0 + j, slot = (int64_t)table[t / bs] * bs + t % bs;
            kp[j] = a->k_cache + slot * row_kv + it->kv_head * d;
            vp[j] = a->v_cache + slot * row_kv + it->kv_head * d;
        }
        pf_pack_kt(kp, nk, d, kt);
        for (int64_t r0 = 0; r0 < padded; r0 += 6)
            for (int64_t j0 = 0; j0 < nk; j0 += 16) pf_qk_6x16(qp + r0, kt + j0, d, sc + r0 * PF_BK + j0, PF_BK);
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t pos = first_pos + it->q0 + r / group, nvalid = pos - k0 + 1;
            pf_softmax_row(sc + r * PF_BK, nk, nvalid < nk ? nvalid : nk, a->scale, m + r, l + r, acc + r * d, d);
        }
        memset(sc + rows * PF_BK, 0, sizeof(float) * (padded - rows) * PF_BK);
        for (int64_t r0 = 0; r0 < padded; r0 += 6)
            for (int64_t c = 0; c < d; c += 16) pf_pv_6x16(sc + r0 * PF_BK, PF_BK, vp, nk, acc + r0 * d, d, c);
    }
    for (int64_t r = 0; r < rows; ++r) {
        kvp_t *o = a->out + (start + it->q0 + r / group) * a->out_stride_token + (it->kv_head * group + r % group) * d;
        const float inv = 1.f / l[r];
        for (int64_t t = 0; t < d; ++t) o[t] = kvp_st(acc[r * d + t] * inv);
    }
}

static int pf_cost_desc(const void *x, const void *y) {
    const int64_t a = ((const pf_item *)x)->cost, b = ((const pf_item *)y)->cost;
    return (a < b) - (a > b);
}

#if defined(KVP_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) \
    && defined(__AVX512BW__)
/* The AMX path (the amx build's bf16 library, once Linux granted the tile state): see the header
   comment. Every tile is 16 rows x 64 bytes (16 x 16 float32 C tiles, 16 x 32 bf16 A tiles, 16
   pairs x 16 columns of bf16 pairs as B), so one LDTILECFG serves the whole call. */
#include "amx.h"
#define PF_AMX 1
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
static int pa_prefill(const kvp_prefill_args *a, const pf_item *items, int64_t n_items, int64_t num_seqs,
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

/* 1 where this build has the AVX2 prefill kernel, else 0 (kvp_paged_prefill_* returns -3). */
int kvp_prefill_simd(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

/* Causal attention of num_seqs prefill/extend chunks over the paged cache, in one call.
   Sequence s's chunk is token rows [query_start[s], query_start[s + 1]) of q and out, at
   positions seq_lens[s] - chunk length ... seq_lens[s] - 1; it attends to the seq_lens[s]
   tokens of its sequence in the cache (its own K/V included, written before the call), each
   query to the keys at or before its position.
   q: row t at q + t * q_stride_token, head h at + h * q_stride_head, head_dim contiguous values.
   k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] contiguous.
   tables: [num_seqs, max_blocks] int32; query_start: [num_seqs + 1] int32; seq_lens: [num_seqs]
   int32. out: row t at out + t * out_stride_token, heads contiguous. head_dim a multiple of 16,
   num_heads a multiple of num_kv_heads. Returns 0, -1 out of memory, -2 bad arguments, -3 no
   AVX2 build. */
int KVP_FN(kvp_paged_prefill)(const kvp_t *q, int64_t q_stride_token, int64_t q_stride_head,
                          const kvp_t *k_cache, const kvp_t *v_cache, const int32_t *tables, int64_t max_blocks,
                          const int32_t *query_start, const int32_t *seq_lens, int64_t num_seqs,
                          kvp_t *out, int64_t out_stride_token, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, int64_t block_size, float scale, int64_t num_threads) {
#if defined(__AVX2__) && defined(__FMA__)
    if (head_dim % 16 || num_kv_heads < 1 || num_heads % num_kv_heads || block_size < 1) return -2;
    int64_t n_items = 0;
    for (int64_t s = 0; s < num_seqs; ++s)
        n_items += (query_start[s + 1] - query_start[s] + PF_BQ - 1) / PF_BQ * num_kv_heads;
    if (n_items == 0) return 0;
    pf_item *items = malloc(sizeof(pf_item) * n_items);
    if (!items) return -1;
    int64_t n = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int32_t q_len = query_start[s + 1] - query_start[s], first_pos = seq_lens[s] - q_len;
        for (int32_t q0 = 0; q0 < q_len; q0 += PF_BQ)
            for (int32_t g = 0; g < num_kv_heads; ++g) {
                const int32_t q1 = q_len - q0 < PF_BQ ? q_len : q0 + PF_BQ;
                items[n++] = (pf_item){(int64_t)(q1 - q0) * (first_pos + q1), (int32_t)s, g, q0, q1};
            }
    }
    qsort(items, n_items, sizeof(pf_item), pf_cost_desc);
    const kvp_prefill_args a = {q, q_stride_token, q_stride_head, k_cache, v_cache, tables, max_blocks,
                                query_start, seq_lens, out, out_stride_token, num_heads, num_kv_heads,
                                head_dim, block_size, scale};
#ifdef PF_AMX
    if (kvp_amx_granted()) {
        const int r = pa_prefill(&a, items, n_items, num_seqs, num_threads);
        if (r <= 0) {
            free(items);
            return r;
        }
    }
#endif
    const int64_t padded = (PF_BQ * (num_heads / num_kv_heads) + 5) / 6 * 6;
    const size_t ws_floats = padded * (2 * head_dim + PF_BK + 2) + head_dim * PF_BK;
    int err = 0;
    #pragma omp parallel num_threads(num_threads) if (num_threads > 1 && n_items > 1)
    {
        float *ws = malloc(sizeof(float) * ws_floats);
        const float **qp = malloc(sizeof(float *) * padded);
        const kvp_t **kvp = malloc(sizeof(kvp_t *) * 2 * PF_BK);
        if (!ws || !qp || !kvp) {
            #pragma omp atomic write
            err = -1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_items; ++i)
            if (ws && qp && kvp) pf_run_item(&a, &items[i], ws, qp, kvp);
        free(ws);
        free(qp);
        free(kvp);
    }
    free(items);
    return err;
#else
    (void)q; (void)q_stride_token; (void)q_stride_head; (void)k_cache; (void)v_cache; (void)tables;
    (void)max_blocks; (void)query_start; (void)seq_lens; (void)num_seqs; (void)out; (void)out_stride_token;
    (void)num_heads; (void)num_kv_heads; (void)head_dim; (void)block_size; (void)scale; (void)num_threads;
    return -3;
#endif
}
