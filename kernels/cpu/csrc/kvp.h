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

/* From this many elements RMSNorm, SiLU*mul and the prefill rows' RoPE share their rows out over the
   calling thread's OpenMP team (torch's thread count); each row is computed by one thread either
   way, so results do not change. Below it one thread is faster than waking the team: the engine's
   waiting threads sleep after a short spin (engine/cpu/omp_wait.py), and a parallel region after a
   Python gap pays their futex wake-up (~50-100 us on a 2-core Sapphire Rapids VM) for work one
   thread does in that time (a 220-row norm ~40 us, SiLU*mul ~130 us). 65,536 before: 128 ShareGPT
   requests at 64 at a time, offline, dense bf16, 23.7 s -> 22.4 and 22.5 s (issue 49). */
#define ELEMENTWISE_PARALLEL_MIN 1048576

/* AVX-512 (F, BW, DQ, VL: the avx512, avx512_bf16 and amx builds) helpers for the element-wise
   kernels (activation.c, layernorm.c): 32 stored values at a time as two float32 vectors, the
   stored type converted exactly as kvp_ld / kvp_st convert one value. Other builds keep the
   portable loops. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define KVP_AVX512 1
#include <immintrin.h>

/* 32 stored values as floats, two vectors in an order of the build's choosing: bf16 interleaves
   each 128-bit lane's words with zeros (vpunpcklwd / vpunpckhwd: words 0-3 and 4-7 of each lane
   land in the upper halves of 32-bit lanes, which is bf16_ld, with no shift); float32 is two
   plain loads. kvp_st32 writes two vectors back in the same order, so element-wise code never
   sees it. The _n forms take the first n < 32 values (masked: nothing read or written past
   them, the other lanes read as 0). */
typedef struct { __m512 lo, hi; } kvp_v32;

static inline kvp_v32 kvp_ld32_n(const kvp_t *p, int64_t n) {
    kvp_v32 v;
#ifdef KVP_BF16
    const __m512i b = n >= 32 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16((__mmask32)((1ull << n) - 1), p);
    v.lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), b));
    v.hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), b));
#else
    if (n >= 32) {
        v.lo = _mm512_loadu_ps(p), v.hi = _mm512_loadu_ps(p + 16);
    } else {
        const __mmask32 m = (__mmask32)((1ull << n) - 1);
        v.lo = _mm512_maskz_loadu_ps((__mmask16)m, p), v.hi = _mm512_maskz_loadu_ps((__mmask16)(m >> 16), p + 16);
    }
#endif
    return v;
}
static inline kvp_v32 kvp_ld32(const kvp_t *p) { return kvp_ld32_n(p, 32); }

#ifdef KVP_BF16
/* bf16_st per lane, left in the upper 16 bits of each 32-bit lane (the lower 16 bits are
   garbage): round to nearest even by adding 0x7fff, or 0x8000 where the kept half's lowest bit
   is 1 (c10's round_to_nearest_even, with the same 32-bit wrap-around). Integer arithmetic on
   the bits, which -ffast-math leaves alone, and no shift (shifts share a port with the FMAs).
   Same bits as bf16_st for every finite value (denormals included) and infinity. bf16_st's NaN
   case ((bits >> 16) | 0x40) is not tested for: it is the same bits here for every f these
   kernels round, the result of a float32 operation on values widened from bf16 (x86
   arithmetic returns a quiet NaN carrying an operand NaN's payload, whose lower 16 bits are 0
   here, or the default NaN 0xffc00000: the added bias cannot carry into the upper half, and the
   quiet bit 0x40 of it is set). tests/kernels/test_cpu_elementwise.py feeds NaNs (quiet,
   signalling, either sign) and compares with the portable build bit for bit. (AVX512_BF16's
   vcvtneps2bf16 gives the same bits for normal values and NaN but flushes denormals to +-0,
   unlike bf16_st; it is not used.) */
static inline __m512i kvp_bf16_round_hi(__m512 f) {
    const __m512i u = _mm512_castps_si512(f);
    return _mm512_mask_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                 _mm512_test_epi32_mask(u, _mm512_set1_epi32(0x10000)),
                                 u, _mm512_set1_epi32(0x8000));
}
#endif

/* kvp_ld(kvp_st(f)) per lane: f rounded to the stored type (bf16), f itself in float32. */
static inline __m512 kvp_round16(__m512 f) {
#ifdef KVP_BF16
    return _mm512_castsi512_ps(_mm512_and_si512(kvp_bf16_round_hi(f), _mm512_set1_epi32((int)0xffff0000u)));
#else
    return f;
#endif
}

/* kvp_st of two vectors from kvp_ld32 order (the first n values where n < 32). */
static inline void kvp_st32_n(kvp_t *p, __m512 lo, __m512 hi, int64_t n) {
#ifdef KVP_BF16
    /* the upper words of lo's and hi's lanes, back in kvp_ld32's order: bf16 word j of each 128-bit
       lane L is lo's word 2 (4L + j) + 1 for j < 4, hi's for j >= 4 (vpermt2w: word 32 + k is hi's k) */
    const __m512i idx = _mm512_set_epi16(63, 61, 59, 57, 31, 29, 27, 25, 55, 53, 51, 49, 23, 21, 19, 17,
                                         47, 45, 43, 41, 15, 13, 11, 9, 39, 37, 35, 33, 7, 5, 3, 1);
    const __m512i b = _mm512_permutex2var_epi16(kvp_bf16_round_hi(lo), idx, kvp_bf16_round_hi(hi));
    if (n >= 32) _mm512_storeu_si512(p, b);
    else _mm512_mask_storeu_epi16(p, (__mmask32)((1ull << n) - 1), b);
#else
    if (n >= 32) {
        _mm512_storeu_ps(p, lo), _mm512_storeu_ps(p + 16, hi);
    } else {
        const __mmask32 m = (__mmask32)((1ull << n) - 1);
        _mm512_mask_storeu_ps(p, (__mmask16)m, lo), _mm512_mask_storeu_ps(p + 16, (__mmask16)(m >> 16), hi);
    }
#endif
}
static inline void kvp_st32(kvp_t *p, __m512 lo, __m512 hi) { kvp_st32_n(p, lo, hi, 32); }
#endif /* AVX-512 */

#endif /* KVP_H */
