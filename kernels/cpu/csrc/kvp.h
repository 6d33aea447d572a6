/*
 * kvp.h: what every kvpilot CPU kernel source shares (plain C11, no torch headers).
 *
 * One source, two builds for the attention, norm and activation library and the decode stack:
 * float32, and bfloat16 with -DKVP_BF16 (activations, norm weights and the KV cache stored as
 * bf16, every sum and product in float32, results rounded to nearest even as torch's
 * float -> bfloat16 conversion; vLLM's CPU kernels work the same way). Exported names end in
 * `_f32` or `_bf16` (KVP_FN). Each source is compiled once per x86 level (kernels/cpu/build.py)
 * and the engine loads the best level the CPU runs (kernels/cpu/loader.py).
 * Source: c10/util/BFloat16.h for the rounding.
 */
#ifndef KVP_H
#define KVP_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* bf16 bits -> float: the upper half of a float32. */
static inline float bf16_ld(uint16_t x) {
    const uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float -> bf16 bits, round to nearest even (c10/util/BFloat16.h round_to_nearest_even); NaN
   stays a quiet NaN. */
static inline uint16_t bf16_st(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* kvp_t: the stored element (activations, norm weights, KV cache); math is float32. */
#ifdef KVP_BF16
typedef uint16_t kvp_t;  /* bfloat16: the upper half of a float32 */
#define KVP_FN(name) name##_bf16
static inline float kvp_ld(kvp_t x) { return bf16_ld(x); }
static inline kvp_t kvp_st(float f) { return bf16_st(f); }
#else
typedef float kvp_t;
#define KVP_FN(name) name##_f32
static inline float kvp_ld(kvp_t x) { return x; }
static inline kvp_t kvp_st(float f) { return f; }
#endif

/* From this many elements (a prefill chunk's rows, not a decode step's) RMSNorm and SiLU*mul
   share their rows out over the calling thread's OpenMP team (torch's thread count); each row is
   computed by one thread as before, so results do not change. */
#define ELEMENTWISE_PARALLEL_MIN 65536

#endif /* KVP_H */
