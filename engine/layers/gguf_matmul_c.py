"""The C source of the GGUF block matmul (engine/layers/gguf_kernel.py builds and calls it).

`kvp_gguf_matmul` computes y = x W^T for W in Q4_1 or Q8_0 blocks of 32 (ggml-common.h
layouts) and splits the rows over torch's OpenMP threads. With float32 activations it
dequantizes the blocks with float32 accumulation: in an AVX2 build into a panel that every
activation row reuses (gguf_tiled_c.py), in a build without AVX2 and FMA one block and
activation row at a time here. With 8-bit activations it runs the
integer dot products of gguf_q8_c.py; the thread split and the exported entry points are in
gguf_entry_c.py. Kept in their own modules so the wrapper stays short.
"""

from kvpilot.engine.layers.gguf_entry_c import ENTRY_SOURCE
from kvpilot.engine.layers.gguf_q8_c import Q8_SOURCE
from kvpilot.engine.layers.gguf_tiled_c import TILED_SOURCE

_HEAD = r"""
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
   path's weight panel (gguf_tiled_c.py), used inside the parallel region while slot 0 lives. */
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

"""

_FLOAT_ROWS = r"""
/* rows [n0, n1) of y for activation rows [m0, m0 + mm), float32 activations, one block at a time:
   the path of builds without AVX2 (an AVX2 build's float32 calls take gguf_tiled_c.py's panels;
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

"""

SOURCE = _HEAD + _FLOAT_ROWS + TILED_SOURCE + Q8_SOURCE + ENTRY_SOURCE
