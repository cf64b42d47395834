// nccl_raw: the raw NCCL call, timed the way `lockstep bench --device cuda` times lockstep's
// (benches/gpu_verify.sh compares the two to get lockstep's per-call overhead).
//
//   nccl_raw NPROCS SIZES ITERS      e.g.  nccl_raw 2 8,1024,65536,1048576 500
//
// NPROCS processes (forked before any CUDA call), rank r on GPU r % count; with fewer GPUs than
// ranks set NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL >= 2.30), as lockstep does. For each size (bytes
// of f32): 5 warm-up calls, a 1-element all-reduce as barrier, then ITERS timed calls of
// ncclAllReduce(sum) + cudaStreamSynchronize; each rank's median, the max over ranks printed as
// "bytes time_us" (lockstep bench reports the same statistic).
//
// Build (the script does it): nvcc -O2 -o nccl_raw nccl_raw.c -I$NCCL/include $NCCL/lib/libnccl.so.2
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CK_CUDA(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "rank %d: %s: %s\n", rank, #x, cudaGetErrorString(e_)); exit(1); } } while (0)
#define CK_NCCL(x) do { ncclResult_t e_ = (x); if (e_ != ncclSuccess) { fprintf(stderr, "rank %d: %s: %s\n", rank, #x, ncclGetErrorString(e_)); exit(1); } } while (0)

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int cmp(const void* a, const void* b) {
    double x = *(const double*)a, y = *(const double*)b;
    return (x > y) - (x < y);
}

static int child(int rank, int n, ncclUniqueId id, const long* sizes, int nsizes, int iters, int out) {
    int ngpu = 0;
    CK_CUDA(cudaGetDeviceCount(&ngpu));
    CK_CUDA(cudaSetDevice(rank % ngpu));
    cudaStream_t s;
    CK_CUDA(cudaStreamCreate(&s));
    ncclComm_t comm;
    CK_NCCL(ncclCommInitRank(&comm, n, id, rank));
    float *buf, *one;
    long largest = 4;
    for (int k = 0; k < nsizes; k++) largest = sizes[k] > largest ? sizes[k] : largest;
    CK_CUDA(cudaMalloc((void**)&buf, largest));
    CK_CUDA(cudaMalloc((void**)&one, 4));
    CK_CUDA(cudaMemset(buf, 0, largest));
    double* t = malloc(sizeof(double) * iters);
    for (int k = 0; k < nsizes; k++) {
        size_t count = sizes[k] / 4 ? sizes[k] / 4 : 1;
        for (int w = 0; w < 5; w++) CK_NCCL(ncclAllReduce(buf, buf, count, ncclFloat, ncclSum, comm, s));
        CK_NCCL(ncclAllReduce(one, one, 1, ncclFloat, ncclSum, comm, s));
        CK_CUDA(cudaStreamSynchronize(s));
        for (int i = 0; i < iters; i++) {
            double t0 = now_us();
            CK_NCCL(ncclAllReduce(buf, buf, count, ncclFloat, ncclSum, comm, s));
            CK_CUDA(cudaStreamSynchronize(s));
            t[i] = now_us() - t0;
        }
        qsort(t, iters, sizeof(double), cmp);
        double med = t[iters / 2];
        if (write(out, &med, sizeof med) != sizeof med) return 1;
    }
    ncclCommDestroy(comm);
    return 0;
}

int main(int argc, char** argv) {
    int rank = -1;
    if (argc != 4) {
        fprintf(stderr, "usage: %s NPROCS SIZES(comma-separated bytes) ITERS\n", argv[0]);
        return 2;
    }
    int n = atoi(argv[1]), iters = atoi(argv[3]);
    long sizes[64];
    int nsizes = 0;
    for (char* p = strtok(argv[2], ","); p && nsizes < 64; p = strtok(NULL, ",")) sizes[nsizes++] = atol(p);
    if (n < 1 || iters < 1 || nsizes == 0) return 2;
    ncclUniqueId id;
    CK_NCCL(ncclGetUniqueId(&id));
    int fds[64][2];
    pid_t pids[64];
    for (int r = 0; r < n && r < 64; r++) {
        if (pipe(fds[r]) != 0) return 1;
        pids[r] = fork();
        if (pids[r] == 0) {
            rank = r;
            close(fds[r][0]);
            exit(child(r, n, id, sizes, nsizes, iters, fds[r][1]));
        }
        close(fds[r][1]);
    }
    double worst[64] = {0};
    int ok = 1;
    for (int r = 0; r < n; r++) {
        for (int k = 0; k < nsizes; k++) {
            double v;
            if (read(fds[r][0], &v, sizeof v) != sizeof v) { ok = 0; break; }
            if (v > worst[k]) worst[k] = v;
        }
        int st = 0;
        waitpid(pids[r], &st, 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) ok = 0;
    }
    if (!ok) {
        fprintf(stderr, "nccl_raw: a rank failed\n");
        return 1;
    }
    printf("# nccl_raw: %d ranks, ncclAllReduce f32 sum + cudaStreamSynchronize, median of %d calls (max over ranks)\n", n, iters);
    printf("# bytes time_us\n");
    for (int k = 0; k < nsizes; k++) printf("%ld %.2f\n", sizes[k], worst[k]);
    return 0;
}
