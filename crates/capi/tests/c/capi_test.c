/*
 * The C ABI of liblockstep.so, through include/lockstep.h: every collective with checked values,
 * every data type and reduction operator, NCCL's in-place forms, send/recv in a group (a ring
 * exchange, where every rank sends first) and outside one, split (with and without a config),
 * finalize, and the error paths (mismatched counts across ranks, bad arguments, reserved FP8
 * types, configs LOCKSTEP_CONFIG_INITIALIZER did not make, a stream on a host communicator), each
 * with its code and lockstepGetLastError's message.
 *
 *   capi_test env       under `lockstep launch`: lockstepCommInitFromEnv
 *   capi_test uid N     forks N ranks that join through lockstepGetUniqueId/lockstepCommInitRank
 *   capi_test config N  forks N ranks that join through lockstepCommInitRankConfig (a name,
 *                       non-blocking, a short timeout), run the checks above, then make the last
 *                       rank late so that the others fail with lockstepTimeout
 *   capi_test resilience N
 *                       forks N ranks (N >= 2) that dump their flight recorders
 *                       (lockstepCommDumpTrace), read the job's status (lockstepStatusJson), turn
 *                       the finite check on and off (lockstepCommSetCheckFinite: rank 1's NaN is
 *                       named on every rank), then shrink the last rank out
 *                       (lockstepCommShrink) and go on without it
 *   capi_test hier      under MPI's mpiexec across (simulated) nodes: lockstepCommInitFromEnv
 *                       must give the hierarchical backend (its init line says "backend hier");
 *                       the checks above that it supports, and all-to-all, gather, scatter and
 *                       split refused alike on every rank with the communicator working on
 *
 * Each rank prints "rank R of N: all checks passed" (and what the driver, tests/capi.rs, looks
 * for); the first failed check prints what was expected and exits 1. Built and run by
 * tests/capi.rs.
 */
/* mkdtemp, and the POSIX calls the forked ranks use. */
#define _POSIX_C_SOURCE 200809L

#include <dirent.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "lockstep.h"
#include "check.h"

static size_t type_size(lockstepDataType_t t) {
    switch (t) {
    case lockstepInt8: case lockstepUint8: return 1;
    case lockstepFloat16: case lockstepBfloat16: return 2;
    case lockstepInt32: case lockstepUint32: case lockstepFloat32: return 4;
    default: return 8;
    }
}

/* A small non-negative integer v (below 256) as a half or bfloat16 bit pattern: exact in both,
   the exponent of its highest bit and the bits below it as the mantissa's top bits. */
static uint16_t small16(lockstepDataType_t t, int64_t v) {
    if (v == 0) return 0;
    int e = 0;
    while ((v >> (e + 1)) != 0) e++;
    const int mant = t == lockstepFloat16 ? 10 : 7, bias = t == lockstepFloat16 ? 15 : 127;
    return (uint16_t)(((e + bias) << mant) | ((v << (mant - e)) & ((1 << mant) - 1)));
}

/* buf[i] = v (v small and non-negative for the 16-bit floats). */
static void put(lockstepDataType_t t, void *buf, size_t i, int64_t v) {
    switch (t) {
    case lockstepInt8: ((int8_t *)buf)[i] = (int8_t)v; break;
    case lockstepUint8: ((uint8_t *)buf)[i] = (uint8_t)v; break;
    case lockstepInt32: ((int32_t *)buf)[i] = (int32_t)v; break;
    case lockstepUint32: ((uint32_t *)buf)[i] = (uint32_t)v; break;
    case lockstepInt64: ((int64_t *)buf)[i] = v; break;
    case lockstepUint64: ((uint64_t *)buf)[i] = (uint64_t)v; break;
    case lockstepFloat16: ((uint16_t *)buf)[i] = small16(t, v); break;
    case lockstepFloat32: ((float *)buf)[i] = (float)v; break;
    case lockstepFloat64: ((double *)buf)[i] = (double)v; break;
    case lockstepBfloat16: ((uint16_t *)buf)[i] = small16(t, v); break;
    default: CHECK(0, "bad type %d", (int)t);
    }
}

/* buf[i] as an integer (-1 for a 16-bit float that is not a small integer). */
static int64_t get(lockstepDataType_t t, const void *buf, size_t i) {
    switch (t) {
    case lockstepInt8: return ((const int8_t *)buf)[i];
    case lockstepUint8: return ((const uint8_t *)buf)[i];
    case lockstepInt32: return ((const int32_t *)buf)[i];
    case lockstepUint32: return ((const uint32_t *)buf)[i];
    case lockstepInt64: return ((const int64_t *)buf)[i];
    case lockstepUint64: return (int64_t)((const uint64_t *)buf)[i];
    case lockstepFloat32: return (int64_t)((const float *)buf)[i];
    case lockstepFloat64: return (int64_t)((const double *)buf)[i];
    case lockstepFloat16:
    case lockstepBfloat16: {
        for (int64_t v = 0; v < 256; v++)
            if (small16(t, v) == ((const uint16_t *)buf)[i]) return v;
        return -1;
    }
    default: CHECK(0, "bad type %d", (int)t); return 0;
    }
}

static void *alloc(size_t n, lockstepDataType_t t) {
    void *p = calloc(n ? n : 1, type_size(t));
    CHECK(p != NULL, "out of memory");
    return p;
}

/* Element i of rank r's input: small, so that every result fits every type exactly. */
static int64_t val(int r, size_t i) { return (int64_t)(r + 1 + (int)(i % 3)); }

static void all_reduce_every_type(lockstepComm_t comm, int n) {
    const size_t count = 1000;
    /* Every supported type: the FP8 values after lockstepBfloat16 are reserved (error_paths). */
    for (int t = 0; t <= lockstepBfloat16; t++) {
        void *s = alloc(count, t), *d = alloc(count, t);
        for (size_t i = 0; i < count; i++) put(t, s, i, val(g_rank, i));
        OK(lockstepAllReduce(s, d, count, t, lockstepSum, comm, NULL));
        for (size_t i = 0; i < count; i++) {
            int64_t want = 0;
            for (int r = 0; r < n; r++) want += val(r, i);
            CHECK(get(t, d, i) == want, "all-reduce sum, type %d, element %zu: got %lld, want %lld", t,
                  i, (long long)get(t, d, i), (long long)want);
        }
        free(s);
        free(d);
    }
}

static void all_reduce_every_op(lockstepComm_t comm, int n) {
    const size_t count = 257;
    int64_t sum = 0, prod = 1, max = 0, min = 1000;
    for (int r = 0; r < n; r++) {
        int64_t v = r + 2;
        sum += v, prod *= v, max = v > max ? v : max, min = v < min ? v : min;
    }
    const int64_t want[5] = {sum, prod, max, min, sum / n};
    for (int op = 0; op < lockstepNumOps; op++) {
        int32_t *s = alloc(count, lockstepInt32), *d = alloc(count, lockstepInt32);
        double *f = alloc(count, lockstepFloat64);
        for (size_t i = 0; i < count; i++) s[i] = g_rank + 2, f[i] = g_rank + 2;
        OK(lockstepAllReduce(s, d, count, lockstepInt32, op, comm, NULL));
        /* In place on float64: sendbuff == recvbuff. */
        OK(lockstepAllReduce(f, f, count, lockstepFloat64, op, comm, NULL));
        double fwant = op == lockstepAvg ? (double)sum / n : (double)want[op];
        for (size_t i = 0; i < count; i++) {
            CHECK(d[i] == want[op], "all-reduce op %d element %zu: got %d, want %lld", op, i, d[i],
                  (long long)want[op]);
            CHECK(f[i] == fwant, "in-place all-reduce op %d element %zu: got %g, want %g", op, i,
                  f[i], fwant);
        }
        free(s);
        free(d);
        free(f);
    }
}

static void broadcast(lockstepComm_t comm, int n) {
    const size_t count = 100000;
    const int root = n - 1;
    float *s = alloc(count, lockstepFloat32), *d = alloc(count, lockstepFloat32);
    for (size_t i = 0; i < count; i++) s[i] = (float)(g_rank * 1000 + (int)(i % 1000)), d[i] = -1;
    /* Out of place; sendbuff is read on the root only, so the others pass NULL. */
    OK(lockstepBroadcast(g_rank == root ? s : NULL, d, count, lockstepFloat32, root, comm, NULL));
    for (size_t i = 0; i < count; i++)
        CHECK(d[i] == (float)(root * 1000 + (int)(i % 1000)), "broadcast element %zu: got %g", i, d[i]);
    /* In place from rank 0. */
    OK(lockstepBroadcast(s, s, count, lockstepFloat32, 0, comm, NULL));
    for (size_t i = 0; i < count; i++)
        CHECK(s[i] == (float)(i % 1000), "in-place broadcast element %zu: got %g", i, s[i]);
    free(s);
    free(d);
}

static void reduce(lockstepComm_t comm, int n) {
    const size_t count = 4099;
    const int root = 1 % n;
    int64_t *s = alloc(count, lockstepInt64), *d = alloc(count, lockstepInt64);
    for (size_t i = 0; i < count; i++) s[i] = val(g_rank, i), d[i] = -7;
    /* Out of place; recvbuff is written on the root only, so the others pass NULL. */
    OK(lockstepReduce(s, g_rank == root ? d : NULL, count, lockstepInt64, lockstepSum, root, comm, NULL));
    for (size_t i = 0; i < count && g_rank == root; i++) {
        int64_t want = 0;
        for (int r = 0; r < n; r++) want += val(r, i);
        CHECK(d[i] == want, "reduce element %zu: got %lld, want %lld", i, (long long)d[i], (long long)want);
    }
    for (size_t i = 0; i < count && g_rank != root; i++) CHECK(d[i] == -7, "reduce wrote a non-root's buffer");
    /* In place, max to rank 0. */
    OK(lockstepReduce(s, s, count, lockstepInt64, lockstepMax, 0, comm, NULL));
    for (size_t i = 0; i < count; i++) {
        int64_t want = g_rank == 0 ? val(n - 1, i) : val(g_rank, i);
        CHECK(s[i] == want, "in-place reduce element %zu: got %lld, want %lld", i, (long long)s[i], (long long)want);
    }
    free(s);
    free(d);
}

static void all_gather(lockstepComm_t comm, int n) {
    const size_t count = 3001;
    uint32_t *s = alloc(count, lockstepUint32), *d = alloc(count * n, lockstepUint32);
    for (size_t i = 0; i < count; i++) s[i] = (uint32_t)(g_rank * 100000 + i);
    OK(lockstepAllGather(s, d, count, lockstepUint32, comm, NULL));
    for (int r = 0; r < n; r++)
        for (size_t i = 0; i < count; i++)
            CHECK(d[r * count + i] == (uint32_t)(r * 100000 + i), "all-gather block %d element %zu: got %u", r, i, d[r * count + i]);
    /* In place: this rank's block already sits at recvbuff + rank * sendcount. */
    memset(d, 0, count * n * sizeof *d);
    memcpy(d + g_rank * count, s, count * sizeof *s);
    OK(lockstepAllGather(d + g_rank * count, d, count, lockstepUint32, comm, NULL));
    for (int r = 0; r < n; r++)
        for (size_t i = 0; i < count; i++)
            CHECK(d[r * count + i] == (uint32_t)(r * 100000 + i), "in-place all-gather block %d element %zu", r, i);
    free(s);
    free(d);
}

static void reduce_scatter(lockstepComm_t comm, int n) {
    const size_t count = 2500;
    float *s = alloc(count * n, lockstepFloat32), *d = alloc(count, lockstepFloat32);
    for (size_t i = 0; i < count * n; i++) s[i] = (float)(g_rank + 1) * (float)(i % 50);
    OK(lockstepReduceScatter(s, d, count, lockstepFloat32, lockstepSum, comm, NULL));
    const float ranks = (float)(n * (n + 1) / 2);
    for (size_t i = 0; i < count; i++) {
        float want = ranks * (float)((g_rank * count + i) % 50);
        CHECK(d[i] == want, "reduce-scatter element %zu: got %g, want %g", i, d[i], want);
    }
    /* In place: the result block lands at sendbuff + rank * recvcount. */
    OK(lockstepReduceScatter(s, s + g_rank * count, count, lockstepFloat32, lockstepSum, comm, NULL));
    for (size_t i = 0; i < count; i++)
        CHECK(s[g_rank * count + i] == d[i], "in-place reduce-scatter element %zu: got %g, want %g", i, s[g_rank * count + i], d[i]);
    free(s);
    free(d);
}

static void send_recv(lockstepComm_t comm, int n) {
    /* Ring exchange in a group: every rank sends to the next before it receives from the
       previous one, which completes only because the group posts them together. Large enough
       to stream through the mailboxes. */
    const size_t count = 1 << 18;
    const int next = (g_rank + 1) % n, prev = (g_rank + n - 1) % n;
    int32_t *s = alloc(count, lockstepInt32), *d = alloc(count, lockstepInt32);
    int32_t self_s = 1000 + g_rank, self_d = -1;
    for (size_t i = 0; i < count; i++) s[i] = (int32_t)(g_rank * 7 + i), d[i] = -1;
    OK(lockstepGroupStart());
    OK(lockstepSend(s, count, lockstepInt32, next, comm, NULL));
    OK(lockstepRecv(d, count, lockstepInt32, prev, comm, NULL));
    /* Nested group, and a message to oneself, which completes inside the group. */
    OK(lockstepGroupStart());
    OK(lockstepSend(&self_s, 1, lockstepInt32, g_rank, comm, NULL));
    OK(lockstepRecv(&self_d, 1, lockstepInt32, g_rank, comm, NULL));
    OK(lockstepGroupEnd());
    CHECK(d[0] == -1, "a send/recv ran before the outermost lockstepGroupEnd");
    OK(lockstepGroupEnd());
    for (size_t i = 0; i < count; i++)
        CHECK(d[i] == (int32_t)(prev * 7 + i), "ring element %zu from rank %d: got %d", i, prev, d[i]);
    CHECK(self_d == 1000 + g_rank, "send to self: got %d", self_d);
    /* Outside a group: a blocking send from rank 0, received by rank n-1. */
    if (n > 1) {
        double x = 3.25 + g_rank;
        if (g_rank == 0) OK(lockstepSend(&x, 1, lockstepFloat64, n - 1, comm, NULL));
        if (g_rank == n - 1) {
            OK(lockstepRecv(&x, 1, lockstepFloat64, 0, comm, NULL));
            CHECK(x == 3.25, "blocking send/recv: got %g", x);
        }
    }
    free(s);
    free(d);
}

/* Element i of rank r's block for rank j in the exchanges: distinct for every (r, j, i). */
static int32_t xval(int r, int j, size_t i) { return (int32_t)(r * 1000000 + j * 10000 + (int)i); }

static void bcast_alltoall_gather_scatter(lockstepComm_t comm, int n) {
    const size_t count = 777;
    lockstepResult_t r;

    /* Bcast: always in place, here from the last rank. */
    double *b = alloc(count, lockstepFloat64);
    for (size_t i = 0; i < count; i++) b[i] = g_rank == n - 1 ? 0.5 * (double)i : -1.0;
    OK(lockstepBcast(b, count, lockstepFloat64, n - 1, comm, NULL));
    for (size_t i = 0; i < count; i++) CHECK(b[i] == 0.5 * (double)i, "bcast element %zu: got %g", i, b[i]);

    /* AlltoAll: block j of rank r's sendbuff lands in block r of rank j's recvbuff. */
    int32_t *s = alloc(count * n, lockstepInt32), *d = alloc(count * n, lockstepInt32);
    for (int j = 0; j < n; j++)
        for (size_t i = 0; i < count; i++) s[j * count + i] = xval(g_rank, j, i), d[j * count + i] = -1;
    OK(lockstepAlltoAll(s, d, count, lockstepInt32, comm, NULL));
    for (int q = 0; q < n; q++)
        for (size_t i = 0; i < count; i++)
            CHECK(d[q * count + i] == xval(q, g_rank, i), "all-to-all block from rank %d element %zu: got %d, want %d", q, i,
                  d[q * count + i], xval(q, g_rank, i));
    /* No in-place form (nor in NCCL): refused on every rank, which stay in step. */
    r = lockstepAlltoAll(s, s, count, lockstepInt32, comm, NULL);
    CHECK(r == lockstepInvalidArgument && strstr(lockstepGetLastError(comm), "no in-place form"), "in-place all-to-all: %d: %s",
          (int)r, lockstepGetLastError(comm));
    /* Zero elements: nothing to move, buffers may be NULL. */
    OK(lockstepAlltoAll(NULL, NULL, 0, lockstepInt32, comm, NULL));

    /* Gather to rank 1 % n; recvbuff is written on the root only, so the others pass NULL. */
    int root = 1 % n;
    uint64_t *gs = alloc(count, lockstepUint64), *gd = alloc(count * n, lockstepUint64);
    for (size_t i = 0; i < count; i++) gs[i] = (uint64_t)xval(g_rank, 0, i);
    for (size_t i = 0; i < count * n; i++) gd[i] = 7;
    OK(lockstepGather(gs, g_rank == root ? gd : NULL, count, lockstepUint64, root, comm, NULL));
    for (int q = 0; q < n && g_rank == root; q++)
        for (size_t i = 0; i < count; i++)
            CHECK(gd[q * count + i] == (uint64_t)xval(q, 0, i), "gather block %d element %zu: got %llu", q, i,
                  (unsigned long long)gd[q * count + i]);
    for (size_t i = 0; i < count * n && g_rank != root; i++) CHECK(gd[i] == 7, "gather wrote a non-root's buffer");
    /* In place to the last rank: its own block already sits at recvbuff + root * count. */
    root = n - 1;
    for (size_t i = 0; i < count * n; i++) gd[i] = 7;
    if (g_rank == root) memcpy(gd + root * count, gs, count * sizeof *gs);
    OK(lockstepGather(g_rank == root ? gd + root * count : gs, g_rank == root ? gd : NULL, count, lockstepUint64, root, comm, NULL));
    for (int q = 0; q < n && g_rank == root; q++)
        for (size_t i = 0; i < count; i++)
            CHECK(gd[q * count + i] == (uint64_t)xval(q, 0, i), "in-place gather block %d element %zu: got %llu", q, i,
                  (unsigned long long)gd[q * count + i]);

    /* Scatter from the last rank; sendbuff is read on the root only, so the others pass NULL. */
    float *ss = alloc(count * n, lockstepFloat32), *sd = alloc(count, lockstepFloat32);
    for (int j = 0; j < n; j++)
        for (size_t i = 0; i < count; i++) ss[j * count + i] = (float)(j * 1000 + (int)i);
    for (size_t i = 0; i < count; i++) sd[i] = -1.0f;
    OK(lockstepScatter(g_rank == root ? ss : NULL, sd, count, lockstepFloat32, root, comm, NULL));
    for (size_t i = 0; i < count; i++)
        CHECK(sd[i] == (float)(g_rank * 1000 + (int)i), "scatter element %zu: got %g", i, sd[i]);
    /* In place from rank n / 2: its own block stays at sendbuff + root * count. */
    root = n / 2;
    for (size_t i = 0; i < count; i++) sd[i] = -1.0f;
    float *mine = g_rank == root ? ss + root * count : sd;
    OK(lockstepScatter(g_rank == root ? ss : NULL, mine, count, lockstepFloat32, root, comm, NULL));
    for (size_t i = 0; i < count; i++)
        CHECK(mine[i] == (float)(g_rank * 1000 + (int)i), "in-place scatter element %zu: got %g", i, mine[i]);
    r = lockstepScatter(ss, sd, count, lockstepFloat32, n, comm, NULL);
    CHECK(r == lockstepInvalidArgument && strstr(lockstepGetLastError(comm), "root"), "scatter bad root: %d", (int)r);

    /* In a group: recorded, run in order at lockstepGroupEnd. */
    for (size_t i = 0; i < count; i++) b[i] = g_rank == 0 ? 2.0 : 0.0;
    OK(lockstepGroupStart());
    OK(lockstepBcast(b, count, lockstepFloat64, 0, comm, NULL));
    OK(lockstepAlltoAll(s, d, count, lockstepInt32, comm, NULL));
    CHECK(b[0] == (g_rank == 0 ? 2.0 : 0.0), "a bcast ran before lockstepGroupEnd");
    OK(lockstepGroupEnd());
    CHECK(b[count - 1] == 2.0 && d[count * n - 1] == xval(n - 1, g_rank, count - 1), "grouped bcast/all-to-all");
    free(b), free(s), free(d), free(gs), free(gd), free(ss), free(sd);
    printf("rank %d: bcast/alltoall/gather/scatter: verified\n", g_rank);
}

/* The hierarchical backend (nodes joined through MPI): in-place Bcast, which it runs as a
   broadcast, and the calls it refuses on every rank alike (lockstepInvalidUsage, the ranks stay in
   step and the communicator works on). */
static void hier_bcast_and_refusals(lockstepComm_t comm, int n) {
    const size_t count = 777;
    double *b = alloc(count, lockstepFloat64);
    for (size_t i = 0; i < count; i++) b[i] = g_rank == n - 1 ? 0.5 * (double)i : -1.0;
    OK(lockstepBcast(b, count, lockstepFloat64, n - 1, comm, NULL));
    for (size_t i = 0; i < count; i++) CHECK(b[i] == 0.5 * (double)i, "bcast element %zu: got %g", i, b[i]);
    int32_t *s = alloc(count * n, lockstepInt32), *d = alloc(count * n, lockstepInt32);
    const char *names[4] = {"all-to-all", "gather", "scatter", "split"};
    for (int k = 0; k < 4; k++) {
        lockstepResult_t r = lockstepSuccess;
        lockstepComm_t sub = NULL;
        switch (k) {
        case 0: r = lockstepAlltoAll(s, d, count, lockstepInt32, comm, NULL); break;
        case 1: r = lockstepGather(s, d, count, lockstepInt32, 0, comm, NULL); break;
        case 2: r = lockstepScatter(s, d, count, lockstepInt32, 0, comm, NULL); break;
        default: r = lockstepCommSplit(comm, g_rank % 2, g_rank, &sub, NULL); break;
        }
        const char *msg = lockstepGetLastError(k == 3 ? NULL : comm);
        CHECK(r == lockstepInvalidUsage && strstr(msg, "not supported on the hier"), "%s on hier: %d: %s", names[k],
              (int)r, msg);
        CHECK(sub == NULL, "a refused split made a communicator");
    }
    lockstepResult_t async = lockstepNumResults;
    OK(lockstepCommGetAsyncError(comm, &async));
    CHECK(async == lockstepSuccess, "a refusal broke the communicator: %d", (int)async);
    for (size_t i = 0; i < count; i++) s[i] = g_rank;
    OK(lockstepAllReduce(s, d, count, lockstepInt32, lockstepSum, comm, NULL));
    CHECK(d[count - 1] == n * (n - 1) / 2, "all-reduce after the refusals: got %d", d[count - 1]);
    free(b), free(s), free(d);
    printf("rank %d: hier: bcast verified, all-to-all/gather/scatter/split refused\n", g_rank);
}

static void split(lockstepComm_t comm, int n) {
    lockstepComm_t sub = (lockstepComm_t)1;
    OK(lockstepCommSplit(comm, g_rank % 2, -g_rank, &sub, NULL));
    /* Ranks of one parity, ordered by key (descending rank). */
    int count = 0, me = -1, members = (n + 1 - g_rank % 2) / 2;
    OK(lockstepCommCount(sub, &count));
    OK(lockstepCommUserRank(sub, &me));
    CHECK(count == members, "split: %d ranks, want %d", count, members);
    CHECK(me == members - 1 - g_rank / 2, "split: rank %d by key", me);
    int32_t x = g_rank, sum = 0, want = 0;
    for (int q = g_rank % 2; q < n; q += 2) want += q;
    OK(lockstepAllReduce(&x, &sum, 1, lockstepInt32, lockstepSum, sub, NULL));
    CHECK(sum == want, "split all-reduce: got %d, want %d", sum, want);
    /* The parent still works while the child exists. */
    x = 1;
    OK(lockstepAllReduce(&x, &sum, 1, lockstepInt32, lockstepSum, comm, NULL));
    CHECK(sum == n, "parent all-reduce after split: got %d, want %d", sum, n);
    OK(lockstepCommDestroy(sub));

    /* The last rank opts out: it gets NULL, the others a communicator without it. */
    sub = (lockstepComm_t)1;
    OK(lockstepCommSplit(comm, g_rank == n - 1 ? LOCKSTEP_SPLIT_NOCOLOR : 7, 0, &sub, NULL));
    if (g_rank == n - 1) {
        CHECK(sub == NULL, "NOCOLOR split: newcomm %p, want NULL", (void *)sub);
    } else {
        OK(lockstepCommCount(sub, &count));
        CHECK(count == n - 1, "split without the last rank: %d ranks, want %d", count, n - 1);
        x = g_rank;
        OK(lockstepAllReduce(&x, &sum, 1, lockstepInt32, lockstepMax, sub, NULL));
        CHECK(sum == n - 2, "split max: got %d, want %d", sum, n - 2);
        OK(lockstepCommDestroy(sub));
    }

    /* With a config: a name, quoted in the new communicator's messages, and blocking = 0. */
    lockstepConfig_t cfg = LOCKSTEP_CONFIG_INITIALIZER;
    cfg.commName = g_rank % 2 ? "odds" : "evens";
    cfg.blocking = 0;
    OK(lockstepCommSplit(comm, g_rank % 2, 0, &sub, &cfg));
    lockstepResult_t r = lockstepAllReduce(&x, &sum, 1, (lockstepDataType_t)42, lockstepSum, sub, NULL);
    CHECK(r == lockstepInvalidArgument && strstr(lockstepGetLastError(sub), g_rank % 2 ? "on communicator \"odds\"" : "on communicator \"evens\""),
          "named split: %d: %s", (int)r, lockstepGetLastError(sub));
    x = 1;
    OK(lockstepAllReduce(&x, &sum, 1, lockstepInt32, lockstepSum, sub, NULL));
    CHECK(sum == members, "named split all-reduce: got %d, want %d", sum, members);
    OK(lockstepCommDestroy(sub));

    /* A timeout in a split's config: refused on every rank (the new communicator inherits it). */
    cfg.timeoutMs = 1000;
    sub = (lockstepComm_t)1;
    r = lockstepCommSplit(comm, 0, 0, &sub, &cfg);
    CHECK(r == lockstepInvalidArgument && sub == NULL && strstr(lockstepGetLastError(comm), "timeoutMs"), "split timeout: %d: %s",
          (int)r, lockstepGetLastError(comm));
    /* One rank's bad arguments (a config LOCKSTEP_CONFIG_INITIALIZER did not make, a negative
       color): it gets lockstepInvalidArgument, the others lockstepInvalidUsage naming it, and
       nobody waits. */
    for (int bad = 0; bad < 2 && n > 1; bad++) {
        lockstepConfig_t junk;
        memset(&junk, 0xA5, sizeof junk);
        const int culprit = bad ? 0 : n - 1;
        sub = (lockstepComm_t)1;
        if (bad == 0)
            r = lockstepCommSplit(comm, 0, 0, &sub, g_rank == culprit ? &junk : NULL);
        else
            r = lockstepCommSplit(comm, g_rank == culprit ? -5 : 0, 0, &sub, NULL);
        const char *m = lockstepGetLastError(comm);
        if (g_rank == culprit)
            CHECK(r == lockstepInvalidArgument && strstr(m, bad ? "color -5" : "config->magic"), "split culprit: %d: %s", (int)r, m);
        else
            CHECK(r == lockstepInvalidUsage && strstr(m, "refused their lockstepCommSplit arguments"), "split peer: %d: %s", (int)r, m);
        CHECK(sub == NULL, "a refused split left newcomm %p", (void *)sub);
    }
    /* The parent splits normally afterwards. */
    OK(lockstepCommSplit(comm, 0, 0, &sub, NULL));
    x = 1;
    OK(lockstepAllReduce(&x, &sum, 1, lockstepInt32, lockstepSum, sub, NULL));
    CHECK(sum == n, "split after refused splits: got %d, want %d", sum, n);
    OK(lockstepCommDestroy(sub));

    /* Inside a group: refused on every rank at once, before anything is exchanged. */
    OK(lockstepGroupStart());
    r = lockstepCommSplit(comm, 0, 0, &sub, NULL);
    OK(lockstepGroupEnd());
    CHECK(r == lockstepInvalidUsage && sub == NULL && strstr(lockstepGetLastError(comm), "inside lockstepGroupStart"),
          "split in a group: %d (%s)", (int)r, lockstepGetLastError(comm));
    printf("rank %d: split: verified\n", g_rank);
}

/* lockstepCommInitRankConfig with a config LOCKSTEP_CONFIG_INITIALIZER did not make, or a field
   out of range: refused before anything else (the id, all zeros here, is never looked at). */
static void config_refused(lockstepConfig_t cfg, const char *needle) {
    lockstepUniqueId zero;
    memset(&zero, 0, sizeof zero);
    lockstepComm_t c = (lockstepComm_t)1;
    lockstepResult_t r = lockstepCommInitRankConfig(&c, 2, zero, 0, &cfg);
    const char *msg = lockstepGetLastError(NULL);
    CHECK(r == lockstepInvalidArgument && c == NULL && strstr(msg, needle), "config refused for `%s`: %d: %s", needle, (int)r, msg);
}

static void config_errors(void) {
    lockstepConfig_t cfg = LOCKSTEP_CONFIG_INITIALIZER;
    CHECK(cfg.size == sizeof cfg && cfg.magic == LOCKSTEP_API_MAGIC && cfg.version == LOCKSTEP_VERSION_CODE &&
              cfg.blocking == LOCKSTEP_CONFIG_UNDEF_INT && cfg.timeoutMs == LOCKSTEP_CONFIG_UNDEF_INT &&
              cfg.commName == LOCKSTEP_CONFIG_UNDEF_PTR,
          "LOCKSTEP_CONFIG_INITIALIZER");
    lockstepConfig_t c = cfg;
    memset(&c, 0xA5, sizeof c); /* never initialised */
    config_refused(c, "config->magic");
    c = cfg, c.magic = 0xcafebeef; /* NCCL_API_MAGIC: an ncclConfig_t */
    config_refused(c, "LOCKSTEP_CONFIG_INITIALIZER");
    c = cfg, c.size = sizeof cfg - 8;
    config_refused(c, "config->size");
    c = cfg, c.version = LOCKSTEP_VERSION_CODE + 1; /* a newer header than the library */
    config_refused(c, "config->version");
    c = cfg, c.version = 99;
    config_refused(c, "config->version");
    c = cfg, c.blocking = 2;
    config_refused(c, "config->blocking");
    c = cfg, c.timeoutMs = 0;
    config_refused(c, "config->timeoutMs");
    c = cfg, c.timeoutMs = -5;
    config_refused(c, "config->timeoutMs");
    /* A valid config gets past the config checks to the id's. */
    lockstepUniqueId zero;
    memset(&zero, 0, sizeof zero);
    lockstepComm_t h = (lockstepComm_t)1;
    c = cfg, c.blocking = 1, c.timeoutMs = 5000, c.commName = "ok";
    lockstepResult_t r = lockstepCommInitRankConfig(&h, 2, zero, 0, &c);
    CHECK(r == lockstepInvalidArgument && h == NULL && strstr(lockstepGetLastError(NULL), "lockstepGetUniqueId"), "valid config: %d: %s",
          (int)r, lockstepGetLastError(NULL));
    r = lockstepCommInitRankConfig(NULL, 2, zero, 0, &cfg);
    CHECK(r == lockstepInvalidArgument && strstr(lockstepGetLastError(NULL), "comm is NULL"), "NULL comm: %d", (int)r);
}

static void error_paths(lockstepComm_t comm, int n) {
    float a[8] = {0}, b[8] = {0};
    lockstepResult_t r;
    const char *msg;

    /* Mismatched counts across ranks: every rank gets an error, none hangs. */
    if (n > 1) {
        r = lockstepAllReduce(a, b, g_rank == 0 ? 4 : 5, lockstepFloat32, lockstepSum, comm, NULL);
        msg = lockstepGetLastError(comm);
        CHECK(r == lockstepInvalidUsage, "mismatched counts returned %d (%s)", (int)r, msg);
        CHECK(strstr(msg, "mismatch") && strstr(msg, "lockstepAllReduce"), "mismatch message: %s", msg);
        CHECK(strcmp(lockstepGetLastError(NULL), msg) == 0, "thread's last error differs: %s", lockstepGetLastError(NULL));
        printf("rank %d: mismatch: code %d (%s): %s\n", g_rank, (int)r, lockstepGetErrorString(r), msg);
        lockstepResult_t async = lockstepNumResults;
        OK(lockstepCommGetAsyncError(comm, &async));
        CHECK(async == lockstepSuccess, "a mismatch broke the communicator: %d", (int)async);
    }
    /* A data type outside the enum, on every rank: refused locally, the ranks stay in step. */
    r = lockstepAllReduce(a, b, 8, (lockstepDataType_t)42, lockstepSum, comm, NULL);
    msg = lockstepGetLastError(comm);
    CHECK(r == lockstepInvalidArgument && strstr(msg, "datatype 42"), "bad datatype: %d: %s", (int)r, msg);
    /* FP8: NCCL's values, reserved, not supported yet. */
    r = lockstepAllReduce(a, b, 8, lockstepFloat8e4m3, lockstepSum, comm, NULL);
    msg = lockstepGetLastError(comm);
    CHECK(r == lockstepInvalidArgument && strstr(msg, "lockstepFloat8e4m3") && strstr(msg, "not supported"), "fp8 e4m3: %d: %s", (int)r, msg);
    r = lockstepBcast(a, 8, lockstepFloat8e5m2, 0, comm, NULL);
    msg = lockstepGetLastError(comm);
    CHECK(r == lockstepInvalidArgument && strstr(msg, "lockstepFloat8e5m2"), "fp8 e5m2: %d: %s", (int)r, msg);
    r = lockstepReduce(a, b, 8, lockstepFloat32, (lockstepRedOp_t)9, 0, comm, NULL);
    CHECK(r == lockstepInvalidArgument && strstr(lockstepGetLastError(comm), "op 9"), "bad op: %d", (int)r);
    r = lockstepBroadcast(a, b, 8, lockstepFloat32, n, comm, NULL);
    CHECK(r == lockstepInvalidArgument && strstr(lockstepGetLastError(comm), "root"), "bad root: %d", (int)r);
    /* NULL buffers, a misaligned one, and partly overlapping ones. */
    r = lockstepAllReduce(NULL, b, 8, lockstepFloat32, lockstepSum, comm, NULL);
    CHECK(r == lockstepInvalidArgument && strstr(lockstepGetLastError(comm), "sendbuff is NULL"), "NULL sendbuff: %d", (int)r);
    r = lockstepAllReduce(a, (char *)b + 1, 2, lockstepFloat32, lockstepSum, comm, NULL);
    CHECK(r == lockstepInvalidArgument && strstr(lockstepGetLastError(comm), "not aligned"), "misaligned: %d", (int)r);
    r = lockstepAllReduce(a, a + 2, 4, lockstepFloat32, lockstepSum, comm, NULL);
    CHECK(r == lockstepInvalidArgument && strstr(lockstepGetLastError(comm), "overlap"), "overlap: %d", (int)r);
    /* A CUDA stream on a host communicator. */
    r = lockstepAllReduce(a, b, 8, lockstepFloat32, lockstepSum, comm, (void *)0x1234);
    CHECK(r == lockstepInvalidUsage && strstr(lockstepGetLastError(comm), "stream"), "stream: %d: %s", (int)r, lockstepGetLastError(comm));
    /* The communicator still works after all of these, on every rank. */
    for (int i = 0; i < 8; i++) a[i] = (float)g_rank;
    OK(lockstepAllReduce(a, b, 8, lockstepFloat32, lockstepMax, comm, NULL));
    CHECK(b[7] == (float)(n - 1), "all-reduce after the errors: got %g", b[7]);
    OK(lockstepBarrier(comm, NULL));

    /* Calls without a valid communicator: the thread's last error. */
    int x = 0;
    r = lockstepCommCount(NULL, &x);
    CHECK(r == lockstepInvalidArgument && strstr(lockstepGetLastError(NULL), "comm is NULL"), "NULL comm: %d", (int)r);
    r = lockstepCommCount((lockstepComm_t)&x, &x);
    CHECK(r == lockstepInvalidArgument && strstr(lockstepGetLastError(NULL), "not a live communicator"), "bogus comm: %d", (int)r);
    r = lockstepCommCount(comm, NULL);
    CHECK(r == lockstepInvalidArgument && strstr(lockstepGetLastError(comm), "count is NULL"), "NULL count: %d", (int)r);
    r = lockstepGroupEnd();
    CHECK(r == lockstepInvalidUsage && strstr(lockstepGetLastError(NULL), "without a matching"), "GroupEnd: %d", (int)r);
    r = lockstepGetVersion(NULL);
    CHECK(r == lockstepInvalidArgument, "GetVersion(NULL): %d", (int)r);
    lockstepUniqueId bad;
    memset(&bad, 0, sizeof bad);
    lockstepComm_t c2 = (lockstepComm_t)1;
    r = lockstepCommInitRank(&c2, 2, bad, 0);
    CHECK(r == lockstepInvalidArgument && c2 == NULL && strstr(lockstepGetLastError(NULL), "lockstepGetUniqueId"), "bad id: %d", (int)r);
    r = lockstepCommInitRank(&c2, 2, bad, 5);
    CHECK(r == lockstepInvalidArgument && strstr(lockstepGetLastError(NULL), "out of range"), "bad rank: %d", (int)r);
    config_errors();
    CHECK(strcmp(lockstepGetErrorString(lockstepSuccess), "no error") == 0, "error string 0");
    CHECK(strncmp(lockstepGetErrorString(lockstepTimeout), "timeout", 7) == 0, "error string 8");
    CHECK(strcmp(lockstepGetErrorString(lockstepNumResults), "unknown result code") == 0, "error string 9");
    CHECK(strcmp(lockstepGetErrorString(lockstepInvalidUsage), "invalid usage") == 0, "error string 5");
    CHECK(strcmp(lockstepGetErrorString((lockstepResult_t)99), "unknown result code") == 0, "error string 99");
}

/* Every check on `comm`; `hier`: the hierarchical backend's set (see the usage above). */
static void run(lockstepComm_t comm, int expect_n, int hier) {
    int n = 0, rank = -1, version = 0;
    OK(lockstepGetVersion(&version));
    CHECK(version == LOCKSTEP_VERSION_CODE, "library version %d, header LOCKSTEP_VERSION_CODE %d", version, LOCKSTEP_VERSION_CODE);
    CHECK(LOCKSTEP_VERSION_CODE == LOCKSTEP_VERSION(LOCKSTEP_MAJOR, LOCKSTEP_MINOR, LOCKSTEP_PATCH), "LOCKSTEP_VERSION");
    OK(lockstepCommCount(comm, &n));
    OK(lockstepCommUserRank(comm, &rank));
    g_rank = rank;
    CHECK(expect_n < 0 || n == expect_n, "count %d, want %d", n, expect_n);
    CHECK(rank >= 0 && rank < n, "rank %d of %d", rank, n);
    CHECK(strcmp(lockstepGetLastError(comm), "") == 0, "fresh communicator has an error: %s", lockstepGetLastError(comm));
    all_reduce_every_type(comm, n);
    all_reduce_every_op(comm, n);
    broadcast(comm, n);
    reduce(comm, n);
    all_gather(comm, n);
    reduce_scatter(comm, n);
    if (hier) {
        hier_bcast_and_refusals(comm, n);
    } else {
        bcast_alltoall_gather_scatter(comm, n);
    }
    send_recv(comm, n);
    if (!hier) split(comm, n);
    error_paths(comm, n);
    OK(lockstepBarrier(comm, NULL));
    /* Finalize: collective, outside a group; afterwards only queries and destroy. */
    OK(lockstepGroupStart());
    lockstepResult_t fr = lockstepCommFinalize(comm);
    OK(lockstepGroupEnd());
    CHECK(fr == lockstepInvalidUsage && strstr(lockstepGetLastError(comm), "inside lockstepGroupStart"), "finalize in a group: %d", (int)fr);
    OK(lockstepCommFinalize(comm));
    float f = 1.0f;
    fr = lockstepAllReduce(&f, &f, 1, lockstepFloat32, lockstepSum, comm, NULL);
    CHECK(fr == lockstepInvalidUsage && strstr(lockstepGetLastError(comm), "finalized"), "call after finalize: %d: %s", (int)fr,
          lockstepGetLastError(comm));
    CHECK(lockstepCommFinalize(comm) == lockstepInvalidUsage, "second finalize");
    int after = 0;
    OK(lockstepCommCount(comm, &after));
    lockstepResult_t async = lockstepNumResults;
    OK(lockstepCommGetAsyncError(comm, &async));
    CHECK(after == n && async == lockstepSuccess, "queries after finalize: count %d, async %d", after, (int)async);
    OK(lockstepCommDestroy(comm));
    /* The handle is gone: an error, not a crash. */
    lockstepResult_t r = lockstepCommCount(comm, &n);
    CHECK(r == lockstepInvalidArgument && strstr(lockstepGetLastError(NULL), "not a live communicator"), "destroyed comm: %d", (int)r);
    CHECK(lockstepCommDestroy(comm) == lockstepInvalidArgument, "double destroy");
    printf("rank %d of %d: all checks passed (version %d)\n", rank, n, version);
    fflush(stdout);
}

/* A communicator made with a 300 ms timeout, whose last rank arrives only once every other rank
   has given up on it (it waits on `late`, a pipe they write to): the others fail with
   lockstepTimeout (or lockstepRemoteError, when another waiting rank aborted the communicator
   first), and so does the last rank's call, late. */
static void timeout_run(lockstepUniqueId id, int n, int r, int late[2]) {
    lockstepConfig_t cfg = LOCKSTEP_CONFIG_INITIALIZER;
    cfg.timeoutMs = 300;
    cfg.commName = "impatient";
    lockstepComm_t comm = NULL;
    OK(lockstepCommInitRankConfig(&comm, n, id, r, &cfg));
    /* A local failure: the message quotes the communicator's name. */
    CHECK(lockstepCommCount(comm, NULL) == lockstepInvalidArgument && strstr(lockstepGetLastError(comm), "on communicator \"impatient\""),
          "named communicator: %s", lockstepGetLastError(comm));
    int32_t x = 1, y = 0;
    if (r < n - 1) {
        lockstepResult_t res = lockstepAllReduce(&x, &y, 1, lockstepInt32, lockstepSum, comm, NULL);
        const char *msg = lockstepGetLastError(comm);
        CHECK(res == lockstepTimeout ? strstr(msg, "timed out") != NULL : res == lockstepRemoteError, "waiting for a late rank: %d: %s", (int)res, msg);
        lockstepResult_t async = lockstepSuccess;
        OK(lockstepCommGetAsyncError(comm, &async));
        CHECK(async == res, "async error %d after %d", (int)async, (int)res);
        printf("rank %d: timeout: code %d (%s): %s\n", r, (int)res, lockstepGetErrorString(res), msg);
        fflush(stdout);
        CHECK(write(late[1], "x", 1) == 1, "write to the late rank's pipe");
    } else {
        /* Only the waiting ranks write: should one die first, the read sees the end of the pipe. */
        close(late[1]);
        char buf[64];
        size_t got = 0;
        while (got < (size_t)(n - 1)) {
            ssize_t k = read(late[0], buf, sizeof buf);
            CHECK(k > 0, "the other ranks never reported their timeout");
            got += (size_t)k;
        }
        lockstepResult_t res = lockstepAllReduce(&x, &y, 1, lockstepInt32, lockstepSum, comm, NULL);
        CHECK(res == lockstepRemoteError || res == lockstepTimeout, "late rank: %d: %s", (int)res, lockstepGetLastError(comm));
        printf("rank %d: late: code %d\n", r, (int)res);
    }
    OK(lockstepCommDestroy(comm));
}

/* Fork `n` ranks that each run `body(rank, arg)`, close the `nfds` descriptors `fds` (the
   parent's ends of the ranks' pipes), and wait for them all. */
static int fork_ranks(int n, void (*body)(int rank, void *arg), void *arg, const int *fds, int nfds) {
    fflush(stdout);
    for (int r = 0; r < n; r++) {
        pid_t pid = fork();
        CHECK(pid >= 0, "fork failed");
        if (pid == 0) {
            g_rank = r;
            body(r, arg);
            fflush(stdout);
            exit(0);
        }
    }
    for (int i = 0; i < nfds; i++) close(fds[i]);
    int failed = 0;
    for (int r = 0; r < n; r++) {
        int status = 0;
        CHECK(wait(&status) > 0, "wait failed");
        failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    return failed;
}

struct job {
    int n;
    lockstepUniqueId id, id2;
    int late[2];
};

static void uid_rank(int r, void *arg) {
    struct job *j = arg;
    lockstepComm_t comm = NULL;
    OK(lockstepCommInitRank(&comm, j->n, j->id, r));
    run(comm, j->n, 0);
}

static void config_rank(int r, void *arg) {
    struct job *j = arg;
    /* Named, non-blocking (calls complete before they return all the same), a generous timeout. */
    lockstepConfig_t cfg = LOCKSTEP_CONFIG_INITIALIZER;
    cfg.commName = "world";
    cfg.blocking = 0;
    cfg.timeoutMs = 120000;
    lockstepComm_t comm = NULL;
    OK(lockstepCommInitRankConfig(&comm, j->n, j->id, r, &cfg));
    run(comm, j->n, 0);
    if (j->n > 1) timeout_run(j->id2, j->n, r, j->late);
    printf("rank %d: config: verified\n", r);
}

/* The ranks of `capi_test resilience N`: the job's id, the directory the traces go to, and the
   pipes that order the shrink: `ready[r]`, rank r's, into which every other rank writes a byte
   once it has left its last call on the communicator (a shrink aborts the peers' calls in
   flight, so none may still be in one), and `shrunk`, into which the others write once they
   have their new communicator (the last rank, left out, then calls). */
struct resilience {
    int n;
    lockstepUniqueId id;
    char dir[64];
    int ready[64][2], shrunk[2];
};

/* Read `k` bytes from `fd` (one from each rank that reports through it), no more: other ranks
   may read the same pipe. */
static void await_bytes(int fd, int k, const char *what) {
    char buf[64];
    int got = 0;
    while (got < k) {
        ssize_t m = read(fd, buf, (size_t)(k - got) < sizeof buf ? (size_t)(k - got) : sizeof buf);
        CHECK(m > 0, "%s: the pipe closed after %d of %d ranks reported", what, got, k);
        got += (int)m;
    }
}

/* lockstepCommDumpTrace: this rank's file holds the calls made so far; a NULL directory is
   refused. */
static void dump_trace(lockstepComm_t comm, const char *dir) {
    OK(lockstepCommDumpTrace(comm, dir));
    CHECK(lockstepCommDumpTrace(comm, NULL) == lockstepInvalidArgument && strstr(lockstepGetLastError(comm), "dir is NULL"),
          "DumpTrace(NULL): %s", lockstepGetLastError(comm));
}

/* lockstepStatusJson, from rank 0 while the others wait in a barrier: the list of jobs holds
   this one, the job by this process's pid has every rank, and a job that does not exist is
   lockstepInvalidArgument naming it. */
static void status(lockstepComm_t comm, int n) {
    if (g_rank == 0) {
        const char *json = NULL;
        char mine[32], want[64];
        OK(lockstepStatusJson(NULL, &json));
        CHECK(json != NULL && strstr(json, "\"jobs\"") != NULL, "status list: %s", json ? json : "(null)");
        snprintf(mine, sizeof mine, "%d", (int)getpid());
        CHECK(strstr(json, mine) != NULL, "status list lacks this rank's pid %s: %s", mine, json);
        OK(lockstepStatusJson(mine, &json));
        snprintf(want, sizeof want, "\"world\":%d", n);
        CHECK(strstr(json, "\"ranks\"") != NULL && strstr(json, want) != NULL, "status of pid %s: want %s in %s", mine, want, json);
        json = NULL;
        lockstepResult_t r = lockstepStatusJson("no-such-job-4711", &json);
        CHECK(r == lockstepInvalidArgument && strstr(lockstepGetLastError(NULL), "no-such-job-4711") != NULL, "unknown job: %d: %s",
              (int)r, lockstepGetLastError(NULL));
    }
    OK(lockstepBarrier(comm, NULL));
}

/* lockstepCommSetCheckFinite: with the check on, rank 1's NaN fails the all-reduce on every
   rank with lockstepInvalidArgument naming rank 1 and the element, and the communicator goes on;
   with it off the NaN goes through. */
static void check_finite(lockstepComm_t comm, int n) {
    int on = -1;
    OK(lockstepCommGetCheckFinite(comm, &on));
    CHECK(on == 0, "the finite check is on before it was asked for (LOCKSTEP_CHECK_FINITE set?)");
    OK(lockstepCommSetCheckFinite(comm, 1));
    OK(lockstepCommGetCheckFinite(comm, &on));
    CHECK(on == 1, "the finite check reads %d after it was turned on", on);
    CHECK(lockstepCommGetCheckFinite(comm, NULL) == lockstepInvalidArgument, "GetCheckFinite(NULL)");
    float x[8], y[8];
    for (int i = 0; i < 8; i++) x[i] = 1.0f;
    if (g_rank == 1) x[5] = NAN;
    lockstepResult_t r = lockstepAllReduce(x, y, 8, lockstepFloat32, lockstepSum, comm, NULL);
    const char *msg = lockstepGetLastError(comm);
    CHECK(r == lockstepInvalidArgument && strstr(msg, "rank 1 contributed NaN at element 5 of all_reduce") != NULL,
          "a NaN with the check on: %d: %s", (int)r, msg);
    lockstepResult_t async = lockstepNumResults;
    OK(lockstepCommGetAsyncError(comm, &async));
    CHECK(async == lockstepSuccess, "the finite check broke the communicator: async error %d", (int)async);
    OK(lockstepCommSetCheckFinite(comm, 0));
    OK(lockstepAllReduce(x, y, 8, lockstepFloat32, lockstepSum, comm, NULL));
    CHECK(isnan(y[5]) && y[0] == (float)n, "the check off: y[5] %f, y[0] %f", (double)y[5], (double)y[0]);
    printf("rank %d: check finite: %s\n", g_rank, msg);
}

/* lockstepCommShrink with the last rank in excludeRanksList: the others get a communicator of
   n - 1 ranks, ranked as before, on which an all-reduce is right, and their old communicator
   says "shrunk"; the last rank, once they have shrunk, is told it was excluded. */
static void shrink(struct resilience *j, lockstepComm_t comm, int n) {
    int last = n - 1;
    int32_t x = g_rank + 1, sum = 0;
    for (int q = 0; q < n - 1; q++) {
        if (q != g_rank) CHECK(write(j->ready[q][1], "x", 1) == 1, "write to rank %d's ready pipe", q);
    }
    if (g_rank == last) {
        await_bytes(j->shrunk[0], n - 1, "shrunk");
        lockstepResult_t r = lockstepAllReduce(&x, &sum, 1, lockstepInt32, lockstepSum, comm, NULL);
        CHECK(r == lockstepRemoteError && strstr(lockstepGetLastError(comm), "exclu") != NULL, "the excluded rank's call: %d: %s", (int)r,
              lockstepGetLastError(comm));
        printf("rank %d: excluded: %s\n", g_rank, lockstepGetLastError(comm));
        OK(lockstepCommDestroy(comm));
        return;
    }
    await_bytes(j->ready[g_rank][0], n - 1, "ready");
    lockstepComm_t sub = (lockstepComm_t)1;
    OK(lockstepCommShrink(comm, &last, 1, &sub, NULL, LOCKSTEP_SHRINK_DEFAULT));
    CHECK(write(j->shrunk[1], "x", 1) == 1, "write to the shrunk pipe");
    int count = 0, me = -1;
    OK(lockstepCommCount(sub, &count));
    OK(lockstepCommUserRank(sub, &me));
    CHECK(count == n - 1 && me == g_rank, "shrunk: rank %d of %d, want %d of %d", me, count, g_rank, n - 1);
    OK(lockstepAllReduce(&x, &sum, 1, lockstepInt32, lockstepSum, sub, NULL));
    CHECK(sum == (n - 1) * n / 2, "all-reduce after the shrink: %d, want %d", sum, (n - 1) * n / 2);
    lockstepResult_t r = lockstepAllReduce(&x, &sum, 1, lockstepInt32, lockstepSum, comm, NULL);
    CHECK(r == lockstepInvalidUsage && strstr(lockstepGetLastError(comm), "shrunk") != NULL, "the old communicator: %d: %s", (int)r,
          lockstepGetLastError(comm));
    OK(lockstepCommDestroy(comm));
    OK(lockstepCommDestroy(sub));
    printf("rank %d: shrunk to rank %d of %d\n", g_rank, me, count);
}

static void resilience_rank(int r, void *arg) {
    struct resilience *j = arg;
    lockstepComm_t comm = NULL;
    OK(lockstepCommInitRank(&comm, j->n, j->id, r));
    int32_t x = 1, sum = 0;
    for (int i = 0; i < 3; i++) OK(lockstepAllReduce(&x, &sum, 1, lockstepInt32, lockstepSum, comm, NULL));
    dump_trace(comm, j->dir);
    status(comm, j->n);
    check_finite(comm, j->n);
    shrink(j, comm, j->n);
}

/* Every rank's trace file in `dir` (one per rank: its first line names the rank, and it records
   the three all-reduces); removes them and `dir`. */
static void check_traces(const char *dir, int n) {
    int calls[64] = {0}, files = 0;
    DIR *d = opendir(dir);
    CHECK(d != NULL, "opendir %s", dir);
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.') continue;
        char path[512], line[4096];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        FILE *f = fopen(path, "r");
        CHECK(f != NULL, "open %s", path);
        int rank = -1, k = 0;
        CHECK(fgets(line, sizeof line, f) != NULL, "%s is empty", path);
        const char *at = strstr(line, "\"rank\":");
        CHECK(at != NULL && sscanf(at, "\"rank\":%d", &rank) == 1 && rank >= 0 && rank < n, "%s: no rank in its first line: %s", path, line);
        while (fgets(line, sizeof line, f)) k += strstr(line, "\"op\":\"all_reduce\"") != NULL;
        fclose(f);
        CHECK(calls[rank] == 0, "two trace files of rank %d", rank);
        CHECK(k >= 3, "%s: %d all-reduces, want 3", path, k);
        calls[rank] = k;
        CHECK(unlink(path) == 0, "unlink %s", path);
        files++;
    }
    closedir(d);
    CHECK(rmdir(dir) == 0, "rmdir %s", dir);
    CHECK(files == n, "%d trace files in %s, want %d", files, dir, n);
    printf("traces: %d ranks wrote theirs\n", files);
}

/* What the log callback saw: init lines of this process's communicator, malformed calls. */
struct seen {
    int init_lines;
    int bad;
};

static void on_log(int level, const char *target, const char *message, void *user) {
    struct seen *s = user;
    if (level < 1 || level > 5 || target == NULL || message == NULL) {
        s->bad++;
        return;
    }
    if (level == 3 && strcmp(target, "lockstep::init") == 0 && strstr(message, "init: rank 0 of 1") != NULL) s->init_lines++;
}

/* The init lines a communicator's making logged: how many, and how many named the hierarchical
   backend (the per-node shared-memory communicator under it logs one of its own). */
struct backend_seen {
    int lines;
    int hier;
};

static void on_backend_line(int level, const char *target, const char *message, void *user) {
    struct backend_seen *b = user;
    if (target == NULL || message == NULL || strcmp(target, "lockstep::init") != 0) return;
    (void)level;
    b->lines++;
    if (strstr(message, " backend hier ") != NULL) b->hier++;
}

/* lockstepSetLogCallback: the init line of a 1-rank communicator reaches the callback, and
   nothing after the callback is cleared. */
static void log_callback(void) {
    struct seen s = {0, 0};
    OK(lockstepSetLogCallback(on_log, &s));
    lockstepUniqueId id;
    OK(lockstepGetUniqueId(&id));
    lockstepComm_t comm = NULL;
    OK(lockstepCommInitRank(&comm, 1, id, 0));
    CHECK(s.init_lines == 1 && s.bad == 0, "callback: %d init lines, %d malformed calls", s.init_lines, s.bad);
    OK(lockstepSetLogCallback(NULL, NULL));
    lockstepComm_t comm2 = NULL;
    OK(lockstepCommInitRank(&comm2, 1, id, 0));
    CHECK(s.init_lines == 1, "the cleared callback was still called");
    OK(lockstepCommDestroy(comm2));
    OK(lockstepCommDestroy(comm));
    printf("log: the callback saw the init line\n");
}

int main(int argc, char **argv) {
    if (argc >= 2 && strcmp(argv[1], "log") == 0) {
        log_callback();
        return 0;
    }
    if (argc >= 2 && strcmp(argv[1], "env") == 0) {
        lockstepComm_t comm = NULL;
        OK(lockstepCommInitFromEnv(&comm));
        run(comm, -1, 0);
        return 0;
    }
    if (argc >= 2 && strcmp(argv[1], "hier") == 0) {
        struct backend_seen b = {0, 0};
        OK(lockstepSetLogCallback(on_backend_line, &b));
        lockstepComm_t comm = NULL;
        OK(lockstepCommInitFromEnv(&comm));
        OK(lockstepSetLogCallback(NULL, NULL));
        int rank = -1, n = 0;
        OK(lockstepCommUserRank(comm, &rank));
        OK(lockstepCommCount(comm, &n));
        CHECK(b.hier == 1, "rank %d of %d: %d init lines named backend hier (%d lines in all): not joined through MPI", rank, n, b.hier,
              b.lines);
        printf("rank %d of %d: backend hier\n", rank, n);
        run(comm, -1, 1);
        return 0;
    }
    if (argc >= 3 && strcmp(argv[1], "resilience") == 0) {
        struct resilience j;
        j.n = atoi(argv[2]);
        CHECK(j.n >= 2 && j.n <= 64, "rank count %s (2 or more)", argv[2]);
        OK(lockstepGetUniqueId(&j.id));
        strcpy(j.dir, "/tmp/lockstep-capi-trace-XXXXXX");
        CHECK(mkdtemp(j.dir) != NULL, "mkdtemp");
        int fds[2 * 64 + 2], nfds = 0;
        for (int q = 0; q < j.n; q++) {
            CHECK(pipe(j.ready[q]) == 0, "pipe failed");
            fds[nfds++] = j.ready[q][0];
            fds[nfds++] = j.ready[q][1];
        }
        CHECK(pipe(j.shrunk) == 0, "pipe failed");
        fds[nfds++] = j.shrunk[0];
        fds[nfds++] = j.shrunk[1];
        int failed = fork_ranks(j.n, resilience_rank, &j, fds, nfds);
        CHECK(failed == 0, "%d of %d forked ranks failed", failed, j.n);
        check_traces(j.dir, j.n);
        printf("resilience: %d ranks passed\n", j.n);
        return 0;
    }
    int config = argc >= 3 && strcmp(argv[1], "config") == 0;
    if (argc >= 3 && (config || strcmp(argv[1], "uid") == 0)) {
        struct job j;
        j.n = atoi(argv[2]);
        CHECK(j.n >= 1 && j.n <= 64, "rank count %s", argv[2]);
        OK(lockstepGetUniqueId(&j.id));
        OK(lockstepGetUniqueId(&j.id2));
        CHECK(pipe(j.late) == 0, "pipe failed");
        int failed = fork_ranks(j.n, config ? config_rank : uid_rank, &j, j.late, 2);
        CHECK(failed == 0, "%d of %d forked ranks failed", failed, j.n);
        printf("%s: %d ranks passed\n", argv[1], j.n);
        return 0;
    }
    fprintf(stderr, "usage: %s env | hier | log | uid N | config N | resilience N\n", argv[0]);
    return 2;
}
