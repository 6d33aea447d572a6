/*
 * kvp_exp.h: e^x on AVX-512 lanes for the kernels that need it (activation.c's SiLU, sample.c's
 * sampling terms). Include after kvp.h; defines exp_neg16 where KVP_AVX512 is set.
 */
#ifndef KVP_EXP_H
#define KVP_EXP_H

#include "kvp.h"

#ifdef KVP_AVX512
#include <immintrin.h>

/* e^x for 16 lanes x <= 0, Cephes expf (Stephen L. Moshier, Cephes Math Library, single/expf.c):
   x = n ln2 + r with n = round(x / ln2) and ln2 split in two (C1 exact in 9 bits, so n C1 is
   exact), e^r = 1 + r + r^2 P(r) on |r| <= ln2/2 (Cephes' degree-5 P: relative error 1.7e-7 peak
   over +-MAXLOG, about 1.5 ulp), then 2^n by vscalefps (no integer exponent arithmetic: underflow
   gives a denormal or 0). x is clamped to -104 first: below, e^x rounds to 0 in float32 anyway,
   and the clamp keeps r accurate (x = -1e30 would leave r meaningless). n: x / ln2 + 1.5 * 2^23
   by an FMA rounds to an integer (nearest even), subtracting 1.5 * 2^23 leaves it exactly (one
   uop each, vrndscaleps is two); the FMA is a builtin, so -ffast-math cannot cancel the pair. */
static inline __m512 exp_neg16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
    const __m512 magic = _mm512_set1_ps(12582912.f);  /* 1.5 * 2^23: adding it rounds to an integer */
    const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), magic), magic);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
    return _mm512_scalef_ps(_mm512_add_ps(p, _mm512_set1_ps(1.f)), n);
}
#endif

#endif /* KVP_EXP_H */
