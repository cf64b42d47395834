/*
 * The C ABI of liblockstep.so on device buffers with a CUDA stream: a communicator from
 * lockstepCommInitFromEnv with LOCKSTEP_BACKEND=nccl (NCCL when every rank has its own GPU, or
 * NCCL's multi-rank mode; otherwise device buffers staged through shared memory), run under
 *
 *   LOCKSTEP_BACKEND=nccl lockstep launch --nproc-per-node N -- capi_cuda
 *
 * Checks, each on device memory and the rank's own stream: all-reduce sum in place and average
 * out of place (f32), int64 sum, broadcast from the last rank, all-gather, reduce-scatter max, a
 * ring of send/recv in a group, a barrier; and the stream rule (NULL on a device communicator is
 * lockstepInvalidUsage naming the stream). Each rank prints "rank R of N: CUDA stream checks
 * passed"; the first failed check prints what was expected and exits 1.
 *
 * The CUDA driver is loaded with dlopen (LOCKSTEP_CUDA_LIBRARY, else libcuda.so.1), so building
 * needs no CUDA toolkit: only the calls below, with the driver API's C prototypes. Every call
 * used here exists in the simulated driver too (tests/fake/sim_cuda.c), where
 * benches/gpu_verify.sh --dry-run rehearses this program. lockstep initialises CUDA first (in
 * lockstepCommInitFromEnv), so the primary context this program retains is the one lockstep's
 * device communicator uses.
 *
 * Built by benches/gpu_stage.sh: cc -I include benches/gpu/capi_cuda.c -llockstep -ldl.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lockstep.h"
/* The checking helpers shared with crates/capi/tests/c/capi_test.c. */
#include "../../crates/capi/tests/c/check.h"

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

static struct {
    CUresult (*init)(unsigned);
    CUresult (*device_get_count)(int *);
    CUresult (*device_get)(int *, int);
    CUresult (*primary_ctx_retain)(void **, int);
    CUresult (*primary_ctx_release)(int);
    CUresult (*ctx_set_current)(void *);
    CUresult (*stream_create)(void **, unsigned);
    CUresult (*stream_destroy)(void *);
    CUresult (*stream_synchronize)(void *);
    CUresult (*mem_alloc)(CUdeviceptr *, size_t);
    CUresult (*mem_free)(CUdeviceptr);
    CUresult (*htod_async)(CUdeviceptr, const void *, size_t, void *);
    CUresult (*dtoh_async)(void *, CUdeviceptr, size_t, void *);
    CUresult (*error_string)(CUresult, const char **);
} cu;

static const char *cu_error(CUresult r) {
    const char *s = NULL;
    if (cu.error_string == NULL || cu.error_string(r, &s) != 0 || s == NULL) return "unknown CUDA error";
    return s;
}

#define CU(call)                                                                              \
    do {                                                                                      \
        CUresult c_ = (call);                                                                 \
        CHECK(c_ == 0, "%s returned CUDA error %d (%s)", #call, c_, cu_error(c_));            \
    } while (0)

static void *sym(void *lib, const char *name) {
    void *p = dlsym(lib, name);
    CHECK(p != NULL, "the CUDA driver has no %s", name);
    return p;
}

static void load_driver(void) {
    const char *path = getenv("LOCKSTEP_CUDA_LIBRARY");
    if (path == NULL || path[0] == '\0') path = "libcuda.so.1";
    void *lib = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    CHECK(lib != NULL, "dlopen(%s): %s", path, dlerror());
    /* Object pointers to function pointers: POSIX guarantees dlsym's result converts. */
    *(void **)&cu.init = sym(lib, "cuInit");
    *(void **)&cu.device_get_count = sym(lib, "cuDeviceGetCount");
    *(void **)&cu.device_get = sym(lib, "cuDeviceGet");
    *(void **)&cu.primary_ctx_retain = sym(lib, "cuDevicePrimaryCtxRetain");
    *(void **)&cu.primary_ctx_release = sym(lib, "cuDevicePrimaryCtxRelease_v2");
    *(void **)&cu.ctx_set_current = sym(lib, "cuCtxSetCurrent");
    *(void **)&cu.stream_create = sym(lib, "cuStreamCreate");
    *(void **)&cu.stream_destroy = sym(lib, "cuStreamDestroy_v2");
    *(void **)&cu.stream_synchronize = sym(lib, "cuStreamSynchronize");
    *(void **)&cu.mem_alloc = sym(lib, "cuMemAlloc_v2");
    *(void **)&cu.mem_free = sym(lib, "cuMemFree_v2");
    *(void **)&cu.htod_async = sym(lib, "cuMemcpyHtoDAsync_v2");
    *(void **)&cu.dtoh_async = sym(lib, "cuMemcpyDtoHAsync_v2");
    *(void **)&cu.error_string = sym(lib, "cuGetErrorString");
}

static void *stream;

static CUdeviceptr dev_alloc(size_t bytes) {
    CUdeviceptr p = 0;
    CU(cu.mem_alloc(&p, bytes));
    return p;
}

static void to_dev(CUdeviceptr d, const void *h, size_t bytes) {
    CU(cu.htod_async(d, h, bytes, stream));
}

/* Device to host, then wait: the host copy is complete when this returns. */
static void to_host(void *h, CUdeviceptr d, size_t bytes) {
    CU(cu.dtoh_async(h, d, bytes, stream));
    CU(cu.stream_synchronize(stream));
}

#define DP(x) ((void *)(uintptr_t)(x))

int main(void) {
    lockstepComm_t comm;
    int n = 0;
    /* lockstep first: it initialises CUDA through its single-init guard and picks the device. */
    OK(lockstepCommInitFromEnv(&comm));
    OK(lockstepCommUserRank(comm, &g_rank));
    OK(lockstepCommCount(comm, &n));
    CHECK(n >= 2, "run under lockstep launch with at least 2 ranks (got %d)", n);

    load_driver();
    CU(cu.init(0));
    int devices = 0;
    CU(cu.device_get_count(&devices));
    CHECK(devices > 0, "no CUDA device");
    const char *lr = getenv("LOCAL_RANK");
    int ordinal = (lr != NULL ? atoi(lr) : g_rank) % devices;
    int dev = 0;
    void *ctx = NULL;
    CU(cu.device_get(&dev, ordinal));
    CU(cu.primary_ctx_retain(&ctx, dev));
    CU(cu.ctx_set_current(ctx));
    CU(cu.stream_create(&stream, 0));

    const int r = g_rank;
    /* An odd count, so no size is a multiple of any internal chunk. */
    enum { COUNT = 1001, PART = 5 };
    static float hf[COUNT], hg[COUNT];
    static int64_t hl[COUNT];
    const size_t fb = sizeof hf;

    /* All-reduce sum in place (f32): sum of 1..n everywhere. */
    CUdeviceptr x = dev_alloc(fb);
    for (int i = 0; i < COUNT; i++) hf[i] = (float)(r + 1);
    to_dev(x, hf, fb);
    OK(lockstepAllReduce(DP(x), DP(x), COUNT, lockstepFloat32, lockstepSum, comm, stream));
    to_host(hg, x, fb);
    for (int i = 0; i < COUNT; i++) CHECK(hg[i] == (float)(n * (n + 1) / 2), "all-reduce sum [%d] = %g", i, hg[i]);

    /* All-reduce average out of place: (n + 1) / 2. */
    CUdeviceptr y = dev_alloc(fb);
    for (int i = 0; i < COUNT; i++) hf[i] = (float)(r + 1);
    to_dev(x, hf, fb);
    OK(lockstepAllReduce(DP(x), DP(y), COUNT, lockstepFloat32, lockstepAvg, comm, stream));
    to_host(hg, y, fb);
    for (int i = 0; i < COUNT; i++) CHECK(hg[i] == (float)(n + 1) / 2.0f, "all-reduce avg [%d] = %g", i, hg[i]);

    /* int64 sum, values past 32 bits. */
    CUdeviceptr l = dev_alloc(sizeof hl);
    for (int i = 0; i < COUNT; i++) hl[i] = ((int64_t)1 << 40) + r;
    to_dev(l, hl, sizeof hl);
    OK(lockstepAllReduce(DP(l), DP(l), COUNT, lockstepInt64, lockstepSum, comm, stream));
    to_host(hl, l, sizeof hl);
    for (int i = 0; i < COUNT; i++)
        CHECK(hl[i] == (int64_t)n * ((int64_t)1 << 40) + (int64_t)n * (n - 1) / 2, "int64 sum [%d] = %lld", i, (long long)hl[i]);

    /* Broadcast from the last rank, in place. */
    for (int i = 0; i < COUNT; i++) hf[i] = r == n - 1 ? (float)(i % 7) : -1.0f;
    to_dev(x, hf, fb);
    OK(lockstepBroadcast(DP(x), DP(x), COUNT, lockstepFloat32, n - 1, comm, stream));
    to_host(hg, x, fb);
    for (int i = 0; i < COUNT; i++) CHECK(hg[i] == (float)(i % 7), "broadcast [%d] = %g", i, hg[i]);

    /* All-gather: PART elements of value r from each rank, in rank order. */
    CUdeviceptr mine = dev_alloc(PART * sizeof(float));
    CUdeviceptr all = dev_alloc((size_t)n * PART * sizeof(float));
    for (int i = 0; i < PART; i++) hf[i] = (float)r;
    to_dev(mine, hf, PART * sizeof(float));
    OK(lockstepAllGather(DP(mine), DP(all), PART, lockstepFloat32, comm, stream));
    float *g = calloc((size_t)n * PART, sizeof(float));
    CHECK(g != NULL, "out of memory");
    to_host(g, all, (size_t)n * PART * sizeof(float));
    for (int i = 0; i < n * PART; i++) CHECK(g[i] == (float)(i / PART), "all-gather [%d] = %g", i, g[i]);

    /* Reduce-scatter max: rank q's block is max over ranks of (rank + q). */
    for (int i = 0; i < n * PART; i++) g[i] = (float)(r + i / PART);
    to_dev(all, g, (size_t)n * PART * sizeof(float));
    OK(lockstepReduceScatter(DP(all), DP(mine), PART, lockstepFloat32, lockstepMax, comm, stream));
    to_host(hf, mine, PART * sizeof(float));
    for (int i = 0; i < PART; i++) CHECK(hf[i] == (float)(n - 1 + r), "reduce-scatter max [%d] = %g", i, hf[i]);

    /* A ring in a group: every rank sends to the next before receiving from the previous. */
    CUdeviceptr out = dev_alloc(sizeof(int32_t)), in = dev_alloc(sizeof(int32_t));
    int32_t v = 100 + r, got = -1;
    to_dev(out, &v, sizeof v);
    OK(lockstepGroupStart());
    OK(lockstepSend(DP(out), 1, lockstepInt32, (r + 1) % n, comm, stream));
    OK(lockstepRecv(DP(in), 1, lockstepInt32, (r + n - 1) % n, comm, stream));
    OK(lockstepGroupEnd());
    to_host(&got, in, sizeof got);
    CHECK(got == 100 + (r + n - 1) % n, "ring: got %d from rank %d", got, (r + n - 1) % n);

    OK(lockstepBarrier(comm, stream));

    /* The stream rule: device communicators take a stream (checked on this rank alone). */
    lockstepResult_t e = lockstepAllReduce(DP(x), DP(x), COUNT, lockstepFloat32, lockstepSum, comm, NULL);
    CHECK(e == lockstepInvalidUsage && strstr(lockstepGetLastError(comm), "stream") != NULL, "NULL stream: %d: %s", (int)e,
          lockstepGetLastError(comm));
    OK(lockstepBarrier(comm, stream));

    free(g);
    CUdeviceptr bufs[] = {x, y, l, mine, all, out, in};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) CU(cu.mem_free(bufs[i]));
    CU(cu.stream_destroy(stream));
    OK(lockstepCommDestroy(comm));
    CU(cu.primary_ctx_release(dev));
    printf("rank %d of %d: CUDA stream checks passed (device %d)\n", r, n, ordinal);
    return 0;
}
