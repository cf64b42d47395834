/* Floor of a small collective per call, timed the way `lockstep bench` and mpi_bench.c time one.
 *   gcc -O2 -pthread benches/baselines/xfloor.c -o /tmp/xfloor && /tmp/xfloor [calls]
 *
 * Two threads pinned to CPU 0 and CPU 1 (like c2c.c) run two bare protocols, with nothing of a
 * library around them. Each call is timed on its own with clock_gettime, and the median per
 * thread is kept; the slower thread's median is printed, as both benchmarks report it.
 *
 *   exchange  Each thread writes the call's number into its own cache line (release store; one
 *             line per call parity, as lockstep's fast entries), then spins (with pause) until
 *             the peer's line shows the same number. This is the least any protocol does in
 *             which every rank hears from every peer in every call. lockstep's small collectives
 *             do that, so that a call whose arguments disagree fails on every rank in that same
 *             call; a broadcast's root too.
 *   eager     Broadcast as Open MPI's shared-memory path does it: the root writes the number into
 *             a ring of 8 lines and returns without waiting unless the ring is full; the receiver
 *             spins until the next line shows its number and acknowledges every fourth in its
 *             own line, which the root reads only when it comes round to a slot not yet acked. The root never
 *             hears from the receiver within a call, so the calls overlap.
 *   clock     Only the two clock reads of the timing: what every per-call time includes.
 *   own       The exchange, then one read of the thread's own line (the number it just wrote).
 *             On the AMD host of RESULTS.md this costs one more crossing between cores: the
 *             peer's read took the modified line along (migratory sharing), so reading it back
 *             misses. Why lockstep's inline path never reads its own entry after the exchange
 *             (src/shm/inline.rs; RESULTS.md, session 15).
 *
 * Prints one line per protocol: `xfloor <name> median_ns=...` (the slower thread's median).
 * compare.py prints them beside its tables; RESULTS.md (issue 16 goal 2) uses them. */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "pin.h"

#define RING 8

typedef struct {
    _Alignas(64) _Atomic long v;
    char pad[56];
} line_t;

static line_t entry[2][2]; /* [thread][call parity] */
static line_t ring[RING];  /* eager: the root's messages */
static line_t ack;         /* eager: last number the receiver took */
static pthread_barrier_t start;
static long calls;
static double med[2];

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void exchange(int me, long k) {
    atomic_store_explicit(&entry[me][k & 1].v, k, memory_order_release);
    while (atomic_load_explicit(&entry[1 - me][k & 1].v, memory_order_acquire) != k) _mm_pause();
}

static void eager(int me, long k) {
    line_t *slot = &ring[k % RING];
    if (me == 0) {
        /* The slot's previous message (k - RING) must have been taken (acks come every half ring). */
        while (atomic_load_explicit(&ack.v, memory_order_acquire) < k - RING) _mm_pause();
        atomic_store_explicit(&slot->v, k, memory_order_release);
    } else {
        while (atomic_load_explicit(&slot->v, memory_order_acquire) != k) _mm_pause();
        /* Acknowledged every half ring, so that the ack line does not cross on every call. */
        if (k % (RING / 2) == 0) atomic_store_explicit(&ack.v, k, memory_order_release);
    }
}

static volatile long sink;

static void own(int me, long k) {
    exchange(me, k);
    sink = atomic_load_explicit(&entry[me][k & 1].v, memory_order_relaxed);
}

static int mode; /* 0 exchange, 1 eager, 2 clock, 3 own */

static void *thread(void *arg) {
    int me = (int)(long)arg;
    pin_to_cpu(me, "xfloor", "");
    double *t = malloc(sizeof(double) * calls);
    if (!t) exit(2);
    pthread_barrier_wait(&start);
    for (long k = 1; k <= calls; k++) {
        double a = now_ns();
        if (mode == 0) exchange(me, k);
        else if (mode == 1) eager(me, k);
        else if (mode == 3) own(me, k);
        t[k - 1] = now_ns() - a;
    }
    /* The first tenth warms up. */
    long skip = calls / 10;
    qsort(t + skip, calls - skip, sizeof(double), cmp);
    med[me] = t[skip + (calls - skip) / 2];
    free(t);
    return NULL;
}

int main(int argc, char **argv) {
    calls = argc > 1 ? atol(argv[1]) : 2000000;
    if (calls < 100) calls = 100;
    const char *names[] = {"exchange", "eager", "clock", "own"};
    for (mode = 0; mode < 4; mode++) {
        for (int i = 0; i < 2; i++)
            for (int j = 0; j < 2; j++) atomic_store(&entry[i][j].v, 0);
        for (int i = 0; i < RING; i++) atomic_store(&ring[i].v, 0);
        atomic_store(&ack.v, 0);
        pthread_barrier_init(&start, NULL, 2);
        pthread_t a, b;
        pthread_create(&a, NULL, thread, (void *)0);
        pthread_create(&b, NULL, thread, (void *)1);
        pthread_join(a, NULL);
        pthread_join(b, NULL);
        pthread_barrier_destroy(&start);
        printf("xfloor %s median_ns=%.1f\n", names[mode], med[0] > med[1] ? med[0] : med[1]);
    }
    return 0;
}
