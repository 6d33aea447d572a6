"""The C source of the GGUF kernel's thread pool and its exported entry points (spliced
after gguf_matmul_c.py's row kernels and gguf_q8_c.py's integer dot products, which it
calls): rows are claimed in chunks by a small persistent pthread pool (workers spin
briefly, then sleep), so one call costs no Python thread hand-off.
"""

POOL_SOURCE = r"""
/* Rows per claim: about CHUNKS_PER_THREAD claims per thread (at least MIN_CHUNK rows, a multiple
   of 4 for the q8 tiles). Each claim and each finished chunk is an atomic on a line the cores
   share: with claims of 32 rows, 2 threads ran a 576-row decode matmul no faster than 1. */
#define MIN_CHUNK 32
#define CHUNKS_PER_THREAD 4

static void run_chunk(const job_t *j, int64_t c) {
    const int64_t n0 = c * j->rows_per_chunk, n1 = n0 + j->rows_per_chunk < j->n ? n0 + j->rows_per_chunk : j->n;
    if (j->act8) { rows_q8(j, n0, n1); return; }
    for (int64_t m0 = 0; m0 < j->m; m0 += MAXM) rows(j, n0, n1, m0, j->m - m0 < MAXM ? j->m - m0 : MAXM);
}

/* A persistent pool. The caller and the workers claim chunks of rows from g_next until none
   is left; the caller then waits only for chunks a worker has claimed, so a worker that is
   not scheduled (a busy machine) never stalls a call. Workers spin (pause, then
   sched_yield) for SPIN_NS after a job, then sleep on a condition variable. */
#define MAXT 64
#define SPIN_NS 300000L
static pthread_mutex_t g_call = PTHREAD_MUTEX_INITIALIZER, g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static job_t g_job;
static atomic_long g_gen;
static long g_base;  /* g_gen when the workers started: they run every job published after it */
/* g_next = chunks << 32 | next chunk: one atomic, so a claim always reads the chunk count
   of the job it claims from; g_done = chunks finished */
static atomic_long g_next, g_done;
static int g_workers, g_sleepers, g_stop;
static pid_t g_pid;
static pthread_t g_threads[MAXT];

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static inline void relax(void) {
#ifdef KVP_AVX2
    _mm_pause();
#endif
}

/* Runs chunks of the current job until none is left. A successful claim is of the job in
   g_job: the caller writes g_job before it stores g_next, and does not return (or publish
   another job) before every claimed chunk is finished. */
static void claim_chunks(void) {
    for (;;) {
        const long v = atomic_fetch_add_explicit(&g_next, 1, memory_order_acq_rel);
        const long c = v & 0xffffffffL;
        if (c >= (v >> 32)) return;
        run_chunk(&g_job, c);
        atomic_fetch_add_explicit(&g_done, 1, memory_order_release);
    }
}

static void *worker(void *arg) {
    const int64_t id = (int64_t)(intptr_t)arg;
    long seen = g_base;
    for (;;) {
        long g, start = now_ns();
        for (int spins = 0; (g = atomic_load_explicit(&g_gen, memory_order_acquire)) == seen; ++spins) {
            if (spins < 4096) { relax(); continue; }
            if ((spins & 63) == 0 && now_ns() - start > SPIN_NS) {
                pthread_mutex_lock(&g_mu);
                ++g_sleepers;
                while ((g = atomic_load(&g_gen)) == seen) pthread_cond_wait(&g_cv, &g_mu);
                --g_sleepers;
                pthread_mutex_unlock(&g_mu);
                break;
            }
            sched_yield();
        }
        seen = g;
        if (g_stop) return NULL;
        (void)id;
        claim_chunks();
    }
}

static void publish(void) {
    pthread_mutex_lock(&g_mu);
    atomic_fetch_add_explicit(&g_gen, 1, memory_order_release);
    if (g_sleepers) pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
}

/* Makes the pool hold `want` workers; returns how many it holds (fewer if creation fails). */
static int resize(int want) {
    if (getpid() != g_pid) {  /* a forked child inherits no threads: start afresh */
        pthread_mutex_init(&g_mu, NULL);
        pthread_cond_init(&g_cv, NULL);
        g_workers = g_sleepers = 0;
        g_pid = getpid();
    }
    if (want == g_workers) return g_workers;
    if (g_workers) {
        g_stop = 1;
        publish();
        for (int i = 0; i < g_workers; ++i) pthread_join(g_threads[i], NULL);
        g_stop = 0;
        g_workers = 0;
    }
    g_base = atomic_load(&g_gen);
    for (; g_workers < want; ++g_workers)
        if (pthread_create(&g_threads[g_workers], NULL, worker, (void *)(intptr_t)g_workers)) break;
    return g_workers;
}

/* y[m, y_stride] (first n columns) = x[m, x_stride] (first k columns) @ W^T, W [n, k] in
   blocks of qtype 3 (Q4_1) or 8 (Q8_0), rows contiguous; k a multiple of 32. act8: quantize
   x to 8-bit blocks first (kvp_quantize_q8_1) and use integer dot products. Uses up to
   `threads` threads. Returns 0, -1 for a bad qtype or k, -2 out of memory. */
int kvp_gguf_matmul(int qtype, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t x_stride,
                    int64_t m, float *y, int64_t y_stride, int threads, int act8) {
    if ((qtype != 3 && qtype != 8) || k % 32) return -1;
    if (m <= 0 || n <= 0) return 0;
    if (threads > MAXT) threads = MAXT;
    if (threads < 1) threads = 1;
    int64_t per = (n + threads * CHUNKS_PER_THREAD - 1) / (threads * CHUNKS_PER_THREAD);
    per = per < MIN_CHUNK ? MIN_CHUNK : (per + 3) / 4 * 4;
    const int64_t nb = k / 32, chunks = (n + per - 1) / per;
    job_t job = {qtype, w, n, k, m, x_stride, y_stride, per, x, NULL, y, act8, NULL, NULL};
    if (act8) {
        const size_t qbytes = ((size_t)(m * k) + 63) & ~(size_t)63;
        char *buf = scratch(qbytes + sizeof(float) * 2 * m * nb);
        if (!buf) return -2;
        job.xq = (const int8_t *)buf;
        job.xds = (const float *)(buf + qbytes);
        kvp_quantize_q8_1(x, x_stride, m, k, (int8_t *)buf, (float *)(buf + qbytes));
    } else if (qtype == 3) {
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
    if (threads <= 1 || chunks == 1) {
        for (int64_t c = 0; c < chunks; ++c) run_chunk(&job, c);
    } else {
        pthread_mutex_lock(&g_call);
        resize(threads - 1);
        g_job = job;
        atomic_store_explicit(&g_done, 0, memory_order_relaxed);
        atomic_store_explicit(&g_next, chunks << 32, memory_order_release);
        if (g_workers) publish();
        claim_chunks();
        while (atomic_load_explicit(&g_done, memory_order_acquire) < chunks) relax();
        pthread_mutex_unlock(&g_call);
    }
    return 0;
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
