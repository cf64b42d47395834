/* Core-to-core latency probe: the cache-placement state of two vCPUs.
 *   gcc -O2 -pthread benches/baselines/c2c.c -o /tmp/c2c && /tmp/c2c [cpu_a cpu_b] [batches]
 * Two threads pinned to cpu_a and cpu_b (default 0 and 1) ping-pong one cache line: A writes an
 * odd value, B waits for it and writes the next even one, A waits for that. One round trip moves
 * the line twice between the cores, so it costs two cache-to-cache transfers when the cores share
 * a cache (L3 of one CCX) and two trips through the fabric or memory when they do not.
 * Prints ns per round trip over `batches` batches of 2000 round trips: min, p10 and median of the
 * batch means (a batch preempted by another process is an outlier, hence the low percentiles):
 *   c2c cpu0-cpu1 rtt_ns min=... p10=... median=...
 * benches/baselines/compare.py classifies the state from p10 (threshold in its docstring). */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define RT 2000

static _Alignas(64) _Atomic long line;
static _Atomic int go;
static int cpus[2], batches;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int pin(int cpu) {
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    return pthread_setaffinity_np(pthread_self(), sizeof s, &s);
}

static void *pong(void *arg) {
    (void)arg;
    if (pin(cpus[1])) {
        fprintf(stderr, "c2c: cannot pin to cpu %d\n", cpus[1]);
        exit(2);
    }
    atomic_store(&go, 1);
    for (long v = 1;; v += 2) {
        while (atomic_load_explicit(&line, memory_order_acquire) != v) {
        }
        atomic_store_explicit(&line, v + 1, memory_order_release);
        if (v + 1 >= 2L * RT * (batches + 1)) return NULL;
    }
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    cpus[0] = argc > 2 ? atoi(argv[1]) : 0;
    cpus[1] = argc > 2 ? atoi(argv[2]) : 1;
    batches = argc > 3 ? atoi(argv[3]) : (argc == 2 ? atoi(argv[1]) : 100);
    if (batches < 1) batches = 1;
    if (pin(cpus[0])) {
        fprintf(stderr, "c2c: cannot pin to cpu %d\n", cpus[0]);
        return 2;
    }
    pthread_t t;
    pthread_create(&t, NULL, pong, NULL);
    while (!atomic_load(&go)) {
    }
    double *ns = malloc(sizeof(double) * batches);
    long v = 0;
    /* The first batch warms up (both threads running, line in place) and is not counted. */
    for (int b = -1; b < batches; b++) {
        double t0 = now();
        for (int i = 0; i < RT; i++) {
            atomic_store_explicit(&line, v + 1, memory_order_release);
            while (atomic_load_explicit(&line, memory_order_acquire) != v + 2) {
            }
            v += 2;
        }
        if (b >= 0) ns[b] = (now() - t0) * 1e9 / RT;
    }
    pthread_join(t, NULL);
    qsort(ns, batches, sizeof(double), cmp);
    printf("c2c cpu%d-cpu%d rtt_ns min=%.1f p10=%.1f median=%.1f\n", cpus[0], cpus[1], ns[0], ns[batches / 10], ns[batches / 2]);
    return 0;
}
