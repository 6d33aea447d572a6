/*
 * The decode stack (Python face: kernels/cpu/decode_stack.py; engine/models/cpu_decode_stack.py
 * fills its structs from a model).
 *
 * `kvp_decode_stack` runs every decoder layer of a decode-only step in one call, then the final
 * norm, by calling the engine's existing C functions through pointers it is given (so each does
 * exactly what the per-module path does, bit for bit):
 *   layer 0:  h = rms_norm(residual)                       (residual = the embeddings)
 *   other:    residual += h; h = rms_norm(residual)        (vLLM's fused_add_rms_norm)
 *   qkv = h W_qkv^T; attn = fused RoPE + K/V write + paged attention (qkv)
 *   h = attn W_o^T; residual += h; h = rms_norm(residual)
 *   h = (silu(gate) * up)(h W_gate_up^T) W_down^T
 *   end:      residual += h; h = rms_norm(residual)        (the model's final norm)
 * The glue itself is a loop over plain structs: no arithmetic of its own beyond gathering
 * the step's RoPE cos/sin rows from the tables.
 * One source, two builds: float32 (elements `float`, the GGUF matmul `kvp_gguf_matmul`) and, with
 * -DKVP_BF16, bfloat16 (elements bf16 bits, the matmul `kvp_bf16_gemm` of bf16_gemm.c over
 * its packed weights; the attention library's `_bf16` norm, activation and attention). With
 * `--quantization gguf` the bf16 build reads a layer's GGUF blocks instead for steps of at most
 * `qmax_rows` rows, as the module path does (engine/layers/linear.py): the bf16 rows widened to
 * float32 (exact), `kvp_gguf_matmul`, the float32 results rounded to nearest even.
 */

#include "kvp.h"

typedef int (*gguf_fn)(int qtype, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t x_stride,
                       int64_t m, float *y, int64_t y_stride, int threads, int act8);
#ifdef KVP_BF16
typedef void (*matmul_fn)(const kvp_t *x, int64_t ldx, const kvp_t *wp, kvp_t *y, int64_t ldy, int64_t m,
                          int64_t n, int64_t k, int64_t threads);
#define MATMUL(L, x, ldx, y, ldy) matmul_bf16(md, &(L), (x), (ldx), (y), (ldy), m, threads)
#else
typedef gguf_fn matmul_fn;
#define MATMUL(L, x, ldx, y, ldy) \
    md->matmul((int)(L).qtype, (const uint8_t *)(L).w, (L).n, (L).k, (x), (ldx), m, (y), (ldy), threads, \
               (int)(L).act8)
#endif
typedef void (*norm_fn)(kvp_t *x, kvp_t *residual, const kvp_t *w, kvp_t *out, int64_t rows, int64_t hidden,
                        float eps);
typedef void (*silu_fn)(const kvp_t *gate_up, kvp_t *out, int64_t rows, int64_t inter);
typedef int (*attn_fn)(const kvp_t *qkv, int64_t qkv_stride, const kvp_t *cos, const kvp_t *sin,
                       int64_t rope_stride, const int64_t *slots, kvp_t *k_cache, kvp_t *v_cache,
                       const int32_t *tables, int64_t max_blocks, const int32_t *lens, kvp_t *out,
                       int64_t seq_begin, int64_t seq_end, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, int64_t block_size, float scale, int64_t num_threads);

/* one linear layer [n outputs, k inputs]: float32, w the GGUF blocks [n, k / 32 * block bytes] (qtype,
   act8: kvp_gguf_matmul's); bf16, w the packed weight of bf16_gemm.pack and qw the GGUF blocks
   (qtype, act8) or NULL */
typedef struct {
    const void *w;
    int64_t n, k;
    int64_t qtype, act8;
    const void *qw;
} kvp_qlinear_t;

typedef struct {
    const kvp_t *input_norm, *post_norm;
    double input_eps, post_eps;
    kvp_qlinear_t qkv, o, gate_up, down;
    kvp_t *k_cache, *v_cache;
} kvp_layer_t;

typedef struct {
    matmul_fn matmul;
    norm_fn norm;
    silu_fn silu;
    attn_fn attn;
    int64_t hidden, num_heads, num_kv_heads, head_dim, block_size, intermediate;
    double scale;
    const kvp_t *final_norm;
    double final_eps;
    const kvp_t *cos_table, *sin_table;  /* [max_positions, head_dim / 2] */
    /* bf16 build: the GGUF matmul for layers with qw, steps of at most qmax_rows rows (0: none), and
       its float32 scratch of qmax_rows * (the largest k + the largest n) floats */
    gguf_fn qmatmul;
    int64_t qmax_rows;
    float *qscratch;
} kvp_model_t;

#ifdef KVP_BF16
/* y = x W^T for one bf16 layer: its GGUF blocks where it has them and m <= qmax_rows, else the bf16
   kernel's packed copy. Returns kvp_gguf_matmul's code (-2: out of memory), else 0. */
static int matmul_bf16(const kvp_model_t *md, const kvp_qlinear_t *L, const kvp_t *x, int64_t ldx, kvp_t *y,
                       int64_t ldy, int64_t m, int threads) {
    if (L->qw == NULL || m > md->qmax_rows) {
        md->matmul(x, ldx, (const kvp_t *)L->w, y, ldy, m, L->n, L->k, threads);
        return 0;
    }
    float *fx = md->qscratch, *fy = fx + m * L->k;
    for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < L->k; ++j) fx[i * L->k + j] = bf16_ld(x[i * ldx + j]);
    const int code = md->qmatmul((int)L->qtype, (const uint8_t *)L->qw, L->n, L->k, fx, L->k, m, fy, L->n,
                                 threads, (int)L->act8);
    if (code) return code;
    for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < L->n; ++j) y[i * ldy + j] = bf16_st(fy[i * L->n + j]);
    return 0;
}
#endif

/* residual [m, hidden]: the embeddings in, the residual stream out; h [m, hidden]: the
   final-normed hidden states out. work: m * (head_dim + qkv_n + num_heads * head_dim
   + 3 * intermediate) elements. threads: the matmuls' OpenMP threads; attn_threads: the
   attention's (attention.attention_threads). Returns 0, or the first non-zero code of a kernel
   (-1 attention scratch, -2 matmul scratch out of memory; any other: a bad argument). */
int kvp_decode_stack(const kvp_model_t *md, const kvp_layer_t *layers, int64_t n_layers, kvp_t *residual,
                     kvp_t *h, int64_t m, const int64_t *positions, const int64_t *slots, const int32_t *tables,
                     int64_t max_blocks, const int32_t *lens, kvp_t *work, int threads, int attn_threads) {
    const int64_t hid = md->hidden, half = md->head_dim / 2, hd = md->head_dim;
    const int64_t qkv_n = (md->num_heads + 2 * md->num_kv_heads) * hd, attn_n = md->num_heads * hd;
    const int64_t inter = md->intermediate;
    kvp_t *cos = work, *sin = cos + m * half, *qkv = sin + m * half, *attn = qkv + m * qkv_n;
    kvp_t *gu = attn + m * attn_n, *act = gu + m * 2 * inter;
    for (int64_t i = 0; i < m; ++i) {
        memcpy(cos + i * half, md->cos_table + positions[i] * half, sizeof(kvp_t) * half);
        memcpy(sin + i * half, md->sin_table + positions[i] * half, sizeof(kvp_t) * half);
    }
    int code;
    for (int64_t l = 0; l < n_layers; ++l) {
        const kvp_layer_t *L = layers + l;
        if (l == 0) md->norm(residual, NULL, L->input_norm, h, m, hid, (float)L->input_eps);
        else md->norm(h, residual, L->input_norm, h, m, hid, (float)L->input_eps);
        if ((code = MATMUL(L->qkv, h, hid, qkv, qkv_n))) return code;
        if ((code = md->attn(qkv, qkv_n, cos, sin, half, slots, L->k_cache, L->v_cache, tables, max_blocks, lens,
                             attn, 0, m, md->num_heads, md->num_kv_heads, hd, md->block_size, (float)md->scale,
                             attn_threads)))
            return code;
        if ((code = MATMUL(L->o, attn, attn_n, h, hid))) return code;
        md->norm(h, residual, L->post_norm, h, m, hid, (float)L->post_eps);
        if ((code = MATMUL(L->gate_up, h, hid, gu, 2 * inter))) return code;
        md->silu(gu, act, m, inter);
        if ((code = MATMUL(L->down, act, inter, h, hid))) return code;
    }
    md->norm(h, residual, md->final_norm, h, m, hid, (float)md->final_eps);
    return 0;
}
