/*
 * prefill.h: what the prefill attention's two sources share (prefill.c: the float32 register tiles
 * and the entry point; prefill_amx.c: the AMX tiles of the amx build's bf16 library): the call's
 * arguments, its work items, and whether this build has the AMX path (PF_AMX).
 */
#ifndef KVP_PREFILL_H
#define KVP_PREFILL_H

#include "kvp.h"

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

#if defined(KVP_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) \
    && defined(__AVX512BW__) && defined(__AVX2__) && defined(__FMA__)
#define PF_AMX 1
/* prefill_amx.c: runs the items on AMX tiles; 0, -1 out of memory, or 1 where its packed workspace
   could not be allocated (the float32 tiles then serve the call). */
__attribute__((visibility("hidden"))) int pa_prefill(const kvp_prefill_args *a, const pf_item *items,
                                                     int64_t n_items, int64_t num_seqs, int64_t num_threads);
#endif

#endif /* KVP_PREFILL_H */
