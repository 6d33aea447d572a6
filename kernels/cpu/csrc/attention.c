/*
 * Decode attention over the paged KV cache, float32 or (with -DKVP_BF16) bfloat16 storage:
 * - `kvp_paged_decode_*`: one new query token per sequence over its paged K/V (vLLM
 *   PagedAttention), the slot of token t being block_table[t / block_size] * block_size +
 *   t % block_size;
 * - `kvp_rope_cache_decode_*`: the whole decode side of an attention layer in one call: RoPE of
 *   q and k (HF Llama's rotate_half), the K/V write at the new token's cache slot, then the
 *   attention.
 * Built into one library with prefill.c, layernorm.c and activation.c (kernels/cpu/build.py);
 * Python face: kernels/cpu/attention.py.
 *
 * `attend_rows`, behind both entry points:
 *
 * Each sequence's tokens are cut into work items of `partition_tokens` (vLLM's
 * paged_attention_v2 partitions): with one thread an item is a whole sequence; with more, a
 * sequence longer than total tokens / (2 x threads) (at least 128 tokens, a multiple of
 * block_size) is cut into parts of that length, so that a step with a few long sequences (the end
 * of an offline batch, one stream) still keeps every thread reading K/V. An item's attention is
 * two passes over its blocks, each K and V token row read once for all query heads of its GQA
 * group: scores = q.K^T * scale, exp(score - the item's max), then acc = p.V; a sequence's
 * items are merged with their maxima and sums (the log-sum-exp rescaling of FlashDecoding /
 * paged_attention_v2's reduce kernel): out = sum_i e^(m_i - M) acc_i / sum_i e^(m_i - M) l_i.
 * Sources: vLLM PagedAttention (SOSP'23) and csrc/attention/paged_attention_v2.cu; Dao et al.,
 * Flash-Decoding (2023).
 */

#include "kvp.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* Software prefetch of token row t of an item's K or V (row elements: every KV head), one hint per
   64-byte line, into L2 (prefetcht1). Each decode row's attention walks its token rows in order,
   asking for the row PREFETCH_TOKENS ahead (through the block table, so across block ends, where the
   hardware prefetcher stops: the blocks of a sequence lie anywhere in the pool). 4, 8, 16 and 32 rows
   ahead timed within noise of each other (Sapphire Rapids, 2 threads, a standalone copy of this file,
   not kept); the earlier scheme (whole rows of the block two ahead) asked for nothing within 128-token
   blocks, whose next block lies 128 rows on. */
#define PREFETCH_TOKENS 8
static inline void prefetch_token(const kvp_t *cache, const int32_t *table, int64_t t, int64_t len,
                                  int64_t block_size, int64_t row) {
    if (t >= len) return;
    const kvp_t *p = cache + ((int64_t)table[t / block_size] * block_size + t % block_size) * row;
    for (int64_t i = 0; i < row; i += 64 / (int64_t)sizeof(kvp_t)) __builtin_prefetch(p + i, 0, 2);
}

/* Prefetches an item's first PREFETCH_TOKENS rows (before a pass over them starts). */
static inline void prefetch_first(const kvp_t *cache, const int32_t *table, int64_t len, int64_t block_size,
                                  int64_t row) {
    for (int64_t t = 0; t < PREFETCH_TOKENS; ++t) prefetch_token(cache, table, t, len, block_size, row);
}

/* scores [num_heads, len] -> e^(score - the row's max) in place, with mx[h] the max and l[h] the sum. */
static void softmax_rows(float *scores, int64_t num_heads, int64_t len, float *mx, float *l) {
    for (int64_t h = 0; h < num_heads; ++h) {
        float *sc = scores + h * len;
        float m = -FLT_MAX, sum = 0.f;
        for (int64_t t = 0; t < len; ++t) m = sc[t] > m ? sc[t] : m;
        #pragma omp simd reduction(+:sum)
        for (int64_t t = 0; t < len; ++t) { sc[t] = expf(sc[t] - m); sum += sc[t]; }
        mx[h] = m;
        l[h] = sum;
    }
}

/* Attention of one float query row (num_heads heads of head_dim, contiguous) over
   the len tokens whose blocks are table[0..], softmax not normalized: mx[h] = max_t s_ht,
   l[h] = sum_t e^(s_ht - mx[h]), acc[h][:] = sum_t e^(s_ht - mx[h]) V_t, for
   s_ht = q_h . K_t * scale. scores: num_heads*len floats (scratch). */
static void attend_part(const float *q, const kvp_t *k_cache, const kvp_t *v_cache,
                        const int32_t *table, int64_t len, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t block_size, float scale, float *scores, float *acc, float *mx,
                        float *l) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim, block_elems = block_size * row;
    prefetch_first(k_cache, table, len, block_size, row);
    for (int64_t b = 0, t = 0; t < len; ++b) {
        const kvp_t *k = k_cache + (int64_t)table[b] * block_elems;
        const int64_t end = t + block_size < len ? t + block_size : len;
        for (; t < end; ++t, k += row) {
            prefetch_token(k_cache, table, t + PREFETCH_TOKENS, len, block_size, row);
            for (int64_t h = 0; h < num_heads; ++h) {
                const float *qh = q + h * head_dim;
                const kvp_t *kh = k + (h / group) * head_dim;
                float dot = 0.f;
                #pragma omp simd reduction(+:dot)
                for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * kvp_ld(kh[d]);
                scores[h * len + t] = dot * scale;
            }
        }
    }
    prefetch_first(v_cache, table, len, block_size, row);
    softmax_rows(scores, num_heads, len, mx, l);
    for (int64_t i = 0; i < num_heads * head_dim; ++i) acc[i] = 0.f;
    for (int64_t b = 0, t = 0; t < len; ++b) {
        const kvp_t *v = v_cache + (int64_t)table[b] * block_elems;
        const int64_t end = t + block_size < len ? t + block_size : len;
        for (; t < end; ++t, v += row) {
            prefetch_token(v_cache, table, t + PREFETCH_TOKENS, len, block_size, row);
            for (int64_t h = 0; h < num_heads; ++h) {
                const float p = scores[h * len + t];
                const kvp_t *vh = v + (h / group) * head_dim;
                float *a = acc + h * head_dim;
                #pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) a[d] += p * kvp_ld(vh[d]);
            }
        }
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* 16 elements of a K or V row as floats (bf16: the upper halves of float32 lanes). */
static inline __m512 ld16(const kvp_t *p) {
#ifdef KVP_BF16
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
#else
    return _mm512_loadu_ps(p);
#endif
}

/* attend_part for head_dim = 16 * D and G query heads per KV head (always inlined with constant D and G).
   q.K^T walks the item's token rows once, in order, every KV head of a row before the next row (a row
   read whole while its lines are in L1, the row PREFETCH_TOKENS ahead requested meanwhile); each K
   slice is converted once for the G query heads that read it (the queries come from L1), the dot
   products are one FMA chain and one horizontal sum per head. p.V runs KV head by KV head with the
   G x D accumulators in zmm registers; the first KV head's pass prefetches whole rows ahead, so the
   other heads find them in cache. Same arithmetic as attend_part in another summation order (results
   differ in the last bits; the scores are the earlier per-KV-head loop's, bit for bit). Against that
   loop (each KV head's pass over the whole item, the first one prefetching whole rows two blocks
   ahead), one decode step's attention of 64 sequences of 256 tokens: 26.7 -> 24.0 ms with 16-token
   blocks in pool order, 32.9 -> 26.4 ms with 128-token blocks scattered over the pool
   (benchmarks/results/decode_attention, Sapphire Rapids, 2 threads). */
static inline __attribute__((always_inline)) void attend_part_zmm(
    const float *q, const kvp_t *k_cache, const kvp_t *v_cache, const int32_t *table, int64_t len,
    int64_t num_kv_heads, int64_t block_size, float scale, float *scores, float *acc, float *mx, float *l, const int D,
    const int G) {
    const int64_t head_dim = 16 * D, num_heads = G * num_kv_heads, row = num_kv_heads * head_dim;
    const int64_t block_elems = block_size * row;
    prefetch_first(k_cache, table, len, block_size, row);
    for (int64_t b = 0, t = 0; t < len; ++b) {
        const kvp_t *k = k_cache + (int64_t)table[b] * block_elems;
        const int64_t end = t + block_size < len ? t + block_size : len;
        for (; t < end; ++t, k += row) {
            prefetch_token(k_cache, table, t + PREFETCH_TOKENS, len, block_size, row);
            for (int64_t g = 0; g < num_kv_heads; ++g) {
                __m512 kv[D];
                for (int d = 0; d < D; ++d) kv[d] = ld16(k + g * head_dim + 16 * d);
                for (int h = 0; h < G; ++h) {
                    const float *qh = q + (g * G + h) * head_dim;
                    __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(qh), kv[0]);
                    for (int d = 1; d < D; ++d) sum = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * d), kv[d], sum);
                    scores[(g * G + h) * len + t] = _mm512_reduce_add_ps(sum) * scale;
                }
            }
        }
    }
    prefetch_first(v_cache, table, len, block_size, row);
    softmax_rows(scores, num_heads, len, mx, l);
    for (int64_t g = 0; g < num_kv_heads; ++g) {
        __m512 a[G * D];
        for (int i = 0; i < G * D; ++i) a[i] = _mm512_setzero_ps();
        for (int64_t b = 0, t = 0; t < len; ++b) {
            const kvp_t *v = v_cache + (int64_t)table[b] * block_elems + g * head_dim;
            const int64_t end = t + block_size < len ? t + block_size : len;
            for (; t < end; ++t, v += row) {
                if (g == 0) prefetch_token(v_cache, table, t + PREFETCH_TOKENS, len, block_size, row);
                __m512 vv[D];
                for (int d = 0; d < D; ++d) vv[d] = ld16(v + 16 * d);
                for (int h = 0; h < G; ++h) {
                    const __m512 p = _mm512_set1_ps(scores[(g * G + h) * len + t]);
                    for (int d = 0; d < D; ++d) a[h * D + d] = _mm512_fmadd_ps(p, vv[d], a[h * D + d]);
                }
            }
        }
        for (int h = 0; h < G; ++h)
            for (int d = 0; d < D; ++d) _mm512_storeu_ps(acc + (g * G + h) * head_dim + 16 * d, a[h * D + d]);
    }
}
#endif

/* attend_part, by the register-blocked path where this build and the shape have one. */
static void attend_item(const float *q, const kvp_t *k_cache, const kvp_t *v_cache, const int32_t *table, int64_t len,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                        float *scores, float *acc, float *mx, float *l) {
#if defined(__AVX512F__)
    const int64_t group = num_heads / num_kv_heads;
#define ZMM_CASE(D, G) \
    if (head_dim == 16 * (D) && group == (G)) { \
        attend_part_zmm(q, k_cache, v_cache, table, len, num_kv_heads, block_size, scale, scores, acc, mx, l, D, G); \
        return; \
    }
    ZMM_CASE(4, 1) ZMM_CASE(4, 2) ZMM_CASE(4, 3) ZMM_CASE(4, 4) ZMM_CASE(8, 1) ZMM_CASE(8, 2)
#undef ZMM_CASE
#endif
    attend_part(q, k_cache, v_cache, table, len, num_heads, num_kv_heads, head_dim, block_size, scale, scores, acc,
                mx, l);
}

/* out[h][:] from a sequence's parts items (each acc[num_heads*head_dim], mx[num_heads],
   l[num_heads], stride floats apart): sum_i e^(mx_i - M) acc_i / sum_i e^(mx_i - M) l_i. */
static void merge_parts(const float *partial, int64_t parts, int64_t stride, int64_t num_heads, int64_t head_dim,
                        kvp_t *out) {
    const int64_t hh = num_heads * head_dim;
    float o[head_dim];
    for (int64_t h = 0; h < num_heads; ++h) {
        float m = -FLT_MAX, sum = 0.f;
        for (int64_t i = 0; i < parts; ++i) m = partial[i * stride + hh + h] > m ? partial[i * stride + hh + h] : m;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = 0.f;
        for (int64_t i = 0; i < parts; ++i) {
            const float *p = partial + i * stride, w = expf(p[hh + h] - m), *a = p + h * head_dim;
            sum += w * p[hh + num_heads + h];
            #pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) o[d] += w * a[d];
        }
        const float inv = 1.f / sum;
        for (int64_t d = 0; d < head_dim; ++d) out[h * head_dim + d] = kvp_st(o[d] * inv);
    }
}

/* Tokens per work item: every sequence whole on one thread; with more, total / (2 x threads),
   at least 128 and a multiple of block_size (paged_attention_v2 uses parts of 512), so that no
   item holds more than half a thread's share (dynamic schedule). */
static int64_t partition_tokens(const int32_t *lens, int64_t n, int64_t threads, int64_t block_size) {
    int64_t total = 0, longest = 1;
    for (int64_t s = 0; s < n; ++s) { total += lens[s]; longest = lens[s] > longest ? lens[s] : longest; }
    if (threads <= 1) return longest;
    int64_t p = total / (threads * 2);
    p = p < 128 ? 128 : p;
    p = (p + block_size - 1) / block_size * block_size;
    return p < longest ? p : longest;
}

/* The fused path's per-row RoPE and cache write (kvp_rope_cache_decode_f32). */
typedef struct {
    const kvp_t *qkv, *cos, *sin;
    int64_t qkv_stride, rope_stride;
    const int64_t *slots;
    kvp_t *k_cache, *v_cache;
} kvp_rope_args;

/* A layer's decode attention: one query row per sequence, the paged caches, the output. */
typedef struct {
    const kvp_t *q;
    int64_t q_stride_seq, q_stride_head;
    const kvp_t *k_cache, *v_cache;
    const int32_t *tables;
    int64_t max_blocks;
    const int32_t *lens;
    kvp_t *out;
    int64_t seq_begin, seq_end, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
} kvp_attn_args;

static void rope_row(const kvp_rope_args *r, int64_t s, const kvp_attn_args *a, float *qrot);

/* Row s's query heads as floats (without rope; attend_part reads float queries). */
static void q_to_float(const kvp_attn_args *a, int64_t s, float *dst) {
    for (int64_t h = 0; h < a->num_heads; ++h) {
        const kvp_t *src = a->q + (a->seq_begin + s) * a->q_stride_seq + h * a->q_stride_head;
        for (int64_t d = 0; d < a->head_dim; ++d) dst[h * a->head_dim + d] = kvp_ld(src[d]);
    }
}

/* Rows [seq_begin, seq_end) of a layer's decode attention over num_threads OpenMP threads: with
   rope, first each row's RoPE and cache write (its q rotated into a float scratch; without,
   its q copied there as floats), then the work items, then each sequence's merge.
   Returns 0, or -1 if out of memory. */
static int attend_rows(kvp_attn_args a, const kvp_rope_args *rope, int64_t num_threads) {
    const int64_t n = a.seq_end - a.seq_begin, hh = a.num_heads * a.head_dim, stride = hh + 2 * a.num_heads;
    if (n <= 0) return 0;
    const int32_t *lens = a.lens + a.seq_begin;
    const int64_t part = partition_tokens(lens, n, num_threads, a.block_size);
    /* the parts follow num_threads (the engine's planned width), the team the calling thread's
       current size, which may be smaller: the same parts, merged the same way, the same result */
#ifdef _OPENMP
    const int cap = omp_get_max_threads();
#else
    const int cap = 1;
#endif
    const int team = num_threads < cap ? (int)num_threads : cap;
    int64_t *first = malloc(sizeof(int64_t) * (n + 1));
    if (!first) return -1;
    first[0] = 0;
    for (int64_t s = 0; s < n; ++s) first[s + 1] = first[s] + (lens[s] + part - 1) / part;
    int64_t *item_seq = malloc(sizeof(int64_t) * first[n]);
    float *partial = malloc(sizeof(float) * first[n] * stride), *qrot = malloc(sizeof(float) * n * hh);
    int failed = !item_seq || !partial || !qrot;
    for (int64_t s = 0; !failed && s < n; ++s)
        for (int64_t i = first[s]; i < first[s + 1]; ++i) item_seq[i] = s;
    if (!failed) {
        #pragma omp parallel num_threads(team) if (team > 1) reduction(|:failed)
        {
        float *scores = malloc(sizeof(float) * a.num_heads * part);
        failed = !scores;
        #pragma omp for schedule(static)
        for (int64_t s = 0; s < n; ++s) {
            if (rope) rope_row(rope, a.seq_begin + s, &a, qrot + s * hh);
            else q_to_float(&a, s, qrot + s * hh);
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < first[n]; ++i) {
            const int64_t s = item_seq[i], begin = (i - first[s]) * part;
            const int64_t len = lens[s] - begin < part ? lens[s] - begin : part;
            float *p = partial + i * stride;
            if (!failed)
                attend_item(qrot + s * hh, a.k_cache, a.v_cache,
                            a.tables + (a.seq_begin + s) * a.max_blocks + begin / a.block_size, len, a.num_heads,
                            a.num_kv_heads, a.head_dim, a.block_size, a.scale, scores, p, p + hh, p + hh + a.num_heads);
        }
        #pragma omp for schedule(static)
        for (int64_t s = 0; s < n; ++s)
            if (!failed)
                merge_parts(partial + first[s] * stride, first[s + 1] - first[s], stride, a.num_heads, a.head_dim,
                            a.out + (a.seq_begin + s) * hh);
        free(scores);
        }
    }
    free(first); free(item_seq); free(partial); free(qrot);
    return failed ? -1 : 0;
}

/* One new query token per sequence over its paged K/V (kvp_t: float or bf16, above).
   q: rows [s] at q + s*q_stride_seq, heads at + h*q_stride_head, head_dim contiguous.
   k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
   tables: [num_seqs, max_blocks] int32; lens: [num_seqs] int32 (>= 1, tokens in cache).
   out: [num_seqs, num_heads, head_dim] contiguous. Rows [seq_begin, seq_end) are shared out over
   num_threads OpenMP threads (one thread: no parallel region; a build without OpenMP runs
   them serially). Returns 0, or -1 if out of memory. */
int KVP_FN(kvp_paged_decode)(const kvp_t *q, int64_t q_stride_seq, int64_t q_stride_head,
                         const kvp_t *k_cache, const kvp_t *v_cache,
                         const int32_t *tables, int64_t max_blocks, const int32_t *lens,
                         kvp_t *out, int64_t seq_begin, int64_t seq_end,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t block_size, float scale, int64_t num_threads) {
    const kvp_attn_args a = {q, q_stride_seq, q_stride_head, k_cache, v_cache, tables, max_blocks, lens, out,
                             seq_begin, seq_end, num_heads, num_kv_heads, head_dim, block_size, scale};
    return attend_rows(a, NULL, num_threads);
}

/* Rotate-half RoPE of n_heads heads (x1 = x[:half], x2 = x[half:]) into floats:
   dst = (x1 cos - x2 sin, x2 cos + x1 sin), as HF Llama's rotate_half. */
static void rope_heads(const kvp_t *src, float *dst, int64_t n_heads, int64_t head_dim,
                       const kvp_t *cos, const kvp_t *sin) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < n_heads; ++h) {
        const kvp_t *x = src + h * head_dim;
        float *y = dst + h * head_dim;
        #pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
            const float x1 = kvp_ld(x[i]), x2 = kvp_ld(x[i + half]), c = kvp_ld(cos[i]), sn = kvp_ld(sin[i]);
            y[i] = x1 * c - x2 * sn;
            y[i + half] = x2 * c + x1 * sn;
        }
    }
}

/* Row s's RoPE of q (into qrot) and k, and its K/V write at cache slot slots[s]. */
static void rope_row(const kvp_rope_args *r, int64_t s, const kvp_attn_args *a, float *qrot) {
    const int64_t row = a->num_kv_heads * a->head_dim;
    const kvp_t *src = r->qkv + s * r->qkv_stride, *c = r->cos + s * r->rope_stride, *sn = r->sin + s * r->rope_stride;
    float krot[row];
    kvp_t *kc = r->k_cache + r->slots[s] * row;
    rope_heads(src, qrot, a->num_heads, a->head_dim, c, sn);
    rope_heads(src + a->num_heads * a->head_dim, krot, a->num_kv_heads, a->head_dim, c, sn);
    for (int64_t i = 0; i < row; ++i) kc[i] = kvp_st(krot[i]);
    memcpy(r->v_cache + r->slots[s] * row, src + (a->num_heads + a->num_kv_heads) * a->head_dim, sizeof(kvp_t) * row);
}

/* The whole decode side of an attention layer in one call, per decode row s:
   rotates q and k of row s (RoPE with the row's cos/sin), stores the rotated k and the v
   at flat cache slot slots[s], then attends over the lens[s] tokens of its sequence (the
   new one included).
   qkv: row s at qkv + s*qkv_stride: num_heads q heads, then num_kv_heads k heads, then
        num_kv_heads v heads, each head_dim contiguous (the fused qkv projection).
   cos, sin: row s at + s*rope_stride, head_dim/2 values (the row's position).
   slots: [num_seqs] int64. Other arguments as kvp_paged_decode_f32. Returns 0 or -1. */
int KVP_FN(kvp_rope_cache_decode)(const kvp_t *qkv, int64_t qkv_stride, const kvp_t *cos, const kvp_t *sin,
                              int64_t rope_stride, const int64_t *slots, kvp_t *k_cache, kvp_t *v_cache,
                              const int32_t *tables, int64_t max_blocks, const int32_t *lens,
                              kvp_t *out, int64_t seq_begin, int64_t seq_end,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                              int64_t block_size, float scale, int64_t num_threads) {
    const kvp_attn_args a = {NULL, 0, 0, k_cache, v_cache, tables, max_blocks, lens, out,
                             seq_begin, seq_end, num_heads, num_kv_heads, head_dim, block_size, scale};
    const kvp_rope_args r = {qkv, cos, sin, qkv_stride, rope_stride, slots, k_cache, v_cache};
    return attend_rows(a, &r, num_threads);
}


/* The prefill/extend side of RoPE and the cache write (the decode side is fused into
   kvp_rope_cache_decode), per row s < n: q_out row s = the rotated q heads, rounded once to the
   stored type; the rotated k and the v stored at flat cache slot slots[s]. The same float32 rotation
   as the decode rows (rope_heads), one rounding of each result (torch's unfused bf16 ops round
   after each product; the float32 rotation is the decode rows', not checked against vLLM's CPU
   rotary output). qkv, cos, sin, slots as
   kvp_rope_cache_decode; q_out: n x num_heads x head_dim contiguous. Rows are shared over
   num_threads threads where there are enough of them. Returns 0. */
int KVP_FN(kvp_rope_cache_write)(const kvp_t *qkv, int64_t qkv_stride, const kvp_t *cos, const kvp_t *sin,
                                 int64_t rope_stride, const int64_t *slots, kvp_t *k_cache, kvp_t *v_cache,
                                 kvp_t *q_out, int64_t n, int64_t num_heads, int64_t num_kv_heads,
                                 int64_t head_dim, int64_t num_threads) {
    const int64_t qn = num_heads * head_dim, row = num_kv_heads * head_dim;
    #pragma omp parallel for schedule(static) num_threads((int)num_threads) \
        if (num_threads > 1 && n > 1 && n * (qn + 2 * row) >= ELEMENTWISE_PARALLEL_MIN)
    for (int64_t s = 0; s < n; ++s) {
        const kvp_t *src = qkv + s * qkv_stride, *c = cos + s * rope_stride, *sn = sin + s * rope_stride;
        float qrot[qn], krot[row];
        rope_heads(src, qrot, num_heads, head_dim, c, sn);
        rope_heads(src + qn, krot, num_kv_heads, head_dim, c, sn);
        kvp_t *qo = q_out + s * qn, *kc = k_cache + slots[s] * row;
        for (int64_t i = 0; i < qn; ++i) qo[i] = kvp_st(qrot[i]);
        for (int64_t i = 0; i < row; ++i) kc[i] = kvp_st(krot[i]);
        memcpy(v_cache + slots[s] * row, src + qn + row, sizeof(kvp_t) * row);
    }
    return 0;
}
