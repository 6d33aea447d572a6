/*
 * Thread placement (Python face: kernels/cpu/threads.py; engine/cpu/threads.py decides).
 *
 * `kvp_bind_omp_threads` pins each thread of the calling thread's OpenMP team to one CPU: team
 * thread i to cpus[i]. libgomp keeps a team's threads for the thread that forks it and reuses
 * them, in order, for every later parallel region of the same size from that thread (torch's
 * intra-op regions and the kernels' own: the libraries link libgomp.so.1, the one torch loaded),
 * so one call from the thread that runs the engine's steps places them all.
 * Source: vLLM csrc/cpu/utils.cpp `init_cpu_threads_env` (one omp_set_num_threads, then each
 * thread of a parallel region binds itself with sched_setaffinity), Linux sched_setaffinity(2):
 * pid 0 is the calling thread.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <omp.h>
#include <sched.h>
#include <stdint.h>

/* Sets the team size to n and binds team thread i to cpus[i]. Returns 0, or the errno of the first
   thread whose sched_setaffinity failed (EINVAL: a CPU outside the cpuset), or -1 when the
   region ran with fewer than n threads. */
int kvp_bind_omp_threads(const int32_t *cpus, int32_t n) {
    int failed = 0, team = 0;
    omp_set_num_threads(n);
    #pragma omp parallel num_threads(n)
    {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus[omp_get_thread_num()], &set);
        const int err = sched_setaffinity(0, sizeof set, &set) ? errno : 0;
        #pragma omp critical
        {
            if (err && !failed) failed = err;
            ++team;
        }
    }
    return failed ? failed : (team == n ? 0 : -1);
}

/* The CPU each thread of an n-thread team runs on now (sched_getcpu), into out[n]: what a test reads
   back after binding. */
void kvp_omp_thread_cpus(int32_t *out, int32_t n) {
    #pragma omp parallel num_threads(n)
    out[omp_get_thread_num()] = sched_getcpu();
}
