"""The C source of the GGUF kernel's exported entry points (spliced after gguf_matmul_c.py's
row kernels, gguf_tiled_c.py's tiled float32 path and gguf_q8_c.py's integer dot products,
which it calls): chunks of rows are shared out over torch's own OpenMP team (the library is built with -fopenmp and its
libgomp.so.1 resolves to the one torch loaded, as attention/cpu_decode.py's), so a step that
mixes these matmuls with torch's dense ones or the C attention keeps one set of threads.
"""

ENTRY_SOURCE = r"""
/* Rows per chunk: about CHUNKS_PER_THREAD chunks per thread (at least MIN_CHUNK rows, a multiple
   of 4 for the q8 tiles). Each claim is an atomic on a line the cores share: with chunks of
   32 rows, 2 threads ran a 576-row decode matmul no faster than 1. */
#define MIN_CHUNK 32
#define CHUNKS_PER_THREAD 4

static int run_chunk(const job_t *j, int64_t c, int tiled) {
    const int64_t n0 = c * j->rows_per_chunk, n1 = n0 + j->rows_per_chunk < j->n ? n0 + j->rows_per_chunk : j->n;
    if (j->act8) { rows_q8(j, n0, n1); return 0; }
#ifdef KVP_AVX2
    if (tiled) return rows_tiled(j, n0, n1);
#endif
    for (int64_t m0 = 0; m0 < j->m; m0 += MAXM) rows(j, n0, n1, m0, j->m - m0 < MAXM ? j->m - m0 : MAXM);
    return 0;
}

/* y[m, y_stride] (first n columns) = x[m, x_stride] (first k columns) @ W^T, W [n, k] in
   blocks of qtype 3 (Q4_1) or 8 (Q8_0), rows contiguous; k a multiple of 32. act8: quantize
   x to 8-bit blocks first (kvp_quantize_q8_1) and use integer dot products. Uses up to
   `threads` threads. Returns 0, -1 for a bad qtype or k, -2 out of memory. */
int kvp_gguf_matmul(int qtype, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t x_stride,
                    int64_t m, float *y, int64_t y_stride, int threads, int act8) {
    if ((qtype != 3 && qtype != 8) || k % 32) return -1;
    if (m <= 0 || n <= 0) return 0;
    if (threads < 1) threads = 1;
    int64_t per = (n + threads * CHUNKS_PER_THREAD - 1) / (threads * CHUNKS_PER_THREAD);
    per = per < MIN_CHUNK ? MIN_CHUNK : (per + 3) / 4 * 4;
    const int64_t nb = k / 32, chunks = (n + per - 1) / per;
    const int tiled = !act8 && use_tiled(m);
    job_t job = {qtype, w, n, k, m, x_stride, y_stride, per, x, NULL, y, act8, NULL, NULL};
    if (act8) {
        const size_t qbytes = ((size_t)(m * k) + 63) & ~(size_t)63;
        char *buf = scratch(qbytes + sizeof(float) * 2 * m * nb);
        if (!buf) return -2;
        job.xq = (const int8_t *)buf;
        job.xds = (const float *)(buf + qbytes);
        kvp_quantize_q8_1(x, x_stride, m, k, (int8_t *)buf, (float *)(buf + qbytes));
    } else if (qtype == 3 && !tiled) {
        float *xsum = scratch(sizeof(float) * m * nb);
        if (!xsum) return -2;
        for (int64_t i = 0; i < m; ++i)
            for (int64_t b = 0; b < nb; ++b) {
                float s = 0.f;
                for (int t = 0; t < 32; ++t) s += x[i * x_stride + b * 32 + t];
                xsum[i * nb + b] = s;
            }
        job.xsum = xsum;
    }
    const int team = threads > 1 && chunks > 1;
    int err = 0;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (team)
    for (int64_t c = 0; c < chunks; ++c) {
        const int rc = run_chunk(&job, c, tiled);
        if (rc) {
            #pragma omp atomic write
            err = rc;
        }
    }
    return err;
}

/* 1 where this build runs the AVX2 paths, 0 for the scalar loops. */
int kvp_gguf_simd(void) {
#ifdef KVP_AVX2
    return 1;
#else
    return 0;
#endif
}
"""
