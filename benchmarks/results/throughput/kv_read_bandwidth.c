/* Read bandwidth of one thread over 512 MB in blocks of B bytes, in order and in a scattered
   order (block i -> i*7919 mod n), optionally prefetching the next block (README section 11).
   gcc -O3 -march=native kv_read_bandwidth.c -o rd && ./rd 12288 0 */
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <time.h>
#include <immintrin.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
    int64_t blk = atoi(argv[1]) / 4, nb = (int64_t)(512e6 / 4) / blk; int pf = atoi(argv[2]);
    float *x = aligned_alloc(1 << 21, nb * blk * 4);
    for (int64_t i = 0; i < nb * blk; ++i) x[i] = 1.f;
    int32_t *tab = malloc(4 * nb);
    for (int mode = 0; mode < 2; ++mode) {
        for (int64_t i = 0; i < nb; ++i) tab[i] = mode ? (int32_t)((i * 7919) % nb) : (int32_t)i;
        for (int r = 0; r < 3; ++r) {
            double t = now(); __m256 a = _mm256_setzero_ps(), b = a, c = a, d = a;
            for (int64_t i = 0; i < nb; ++i) {
                const float *p = x + (int64_t)tab[i] * blk;
                if (pf && i + 1 < nb) { const char *n = (const char *)(x + (int64_t)tab[i + 1] * blk); for (int64_t j = 0; j < blk * 4; j += 64) __builtin_prefetch(n + j); }
                for (int64_t j = 0; j < blk; j += 32) {
                    a = _mm256_add_ps(a, _mm256_load_ps(p + j)); b = _mm256_add_ps(b, _mm256_load_ps(p + j + 8));
                    c = _mm256_add_ps(c, _mm256_load_ps(p + j + 16)); d = _mm256_add_ps(d, _mm256_load_ps(p + j + 24));
                }
            }
            t = now() - t; float o[8]; _mm256_storeu_ps(o, _mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d)));
            printf("%s blk %ld B pf %d: %.1f GB/s (%g)\n", mode ? "random" : "seq", blk * 4, pf, nb * blk * 4 / t / 1e9, o[0]);
        }
    }
}
