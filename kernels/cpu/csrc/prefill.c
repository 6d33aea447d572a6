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
#include "prefill.h"
#ifdef PF_AMX
#include "amx.h" /* kvp_amx_granted */
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

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

#endif

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
