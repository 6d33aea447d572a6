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
 * its packed weights; the attention library's `_bf16` norm, activation and attention).
 */

#include "kvp.h"

#ifdef KVP_BF16
typedef void (*matmul_fn)(const kvp_t *x, int64_t ldx, const kvp_t *wp, kvp_t *y, int64_t ldy, int64_t m,
                          int64_t n, int64_t k, int64_t threads);
/* kvp_bf16_gemm cannot fail */
#define MATMUL(L, x, ldx, y, ldy) \
    (md->matmul((x), (ldx), (const kvp_t *)(L).w, (y), (ldy), m, (L).n, (L).k, threads), 0)
#else
typedef int (*matmul_fn)(int qtype, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t x_stride,
                         int64_t m, float *y, int64_t y_stride, int threads, int act8);
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

/* one linear layer [n outputs, k inputs]: float32, GGUF blocks [n, k / 32 * block bytes] (qtype, act8:
   gguf_kernel's); bf16, the packed weight of bf16_gemm.pack (qtype, act8 unused) */
typedef struct {
    const void *w;
    int64_t n, k;
    int64_t qtype, act8;
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
} kvp_model_t;

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
