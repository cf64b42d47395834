/*
 * hello.c: a first lockstep program in C. Every rank all-reduces (rank + 1 + i) for i = 0..7 and
 * checks that it got the sum over all ranks; it exits 1 on a wrong element or a failed call.
 *
 *   cc hello.c $(pkg-config --cflags --libs lockstep) -o hello
 *   lockstep launch --nproc-per-node 3 -- ./hello
 *
 * (With the library outside the loader's search path, add
 * -Wl,-rpath,$(pkg-config --variable=libdir lockstep) or set LD_LIBRARY_PATH.)
 */
#include <stdio.h>

#include <lockstep.h>

#define CHECK(call)                                                                             \
    do {                                                                                        \
        lockstepResult_t r_ = (call);                                                           \
        if (r_ != lockstepSuccess) {                                                            \
            fprintf(stderr, "%s: %s: %s\n", #call, lockstepGetErrorString(r_),                   \
                    lockstepGetLastError(NULL));                                                \
            return 1;                                                                           \
        }                                                                                       \
    } while (0)

int main(void) {
    int version = 0;
    CHECK(lockstepGetVersion(&version));
    if (version != LOCKSTEP_VERSION_CODE) {
        fprintf(stderr, "built against lockstep.h %d, but loaded liblockstep %d\n", LOCKSTEP_VERSION_CODE, version);
        return 1;
    }

    /* Join the job the launcher started (lockstep launch, torchrun, mpirun or srun). */
    lockstepComm_t comm;
    int rank, nranks;
    CHECK(lockstepCommInitFromEnv(&comm));
    CHECK(lockstepCommUserRank(comm, &rank));
    CHECK(lockstepCommCount(comm, &nranks));

    /* stream = NULL: host buffers; sendbuff == recvbuff: in place, as in NCCL. */
    double x[8];
    for (int i = 0; i < 8; i++) x[i] = rank + 1 + i;
    CHECK(lockstepAllReduce(x, x, 8, lockstepFloat64, lockstepSum, comm, NULL));
    for (int i = 0; i < 8; i++) {
        double want = nranks * (nranks + 1) / 2.0 + (double)nranks * i;
        if (x[i] != want) {
            fprintf(stderr, "rank %d: element %d is %g, want %g\n", rank, i, x[i], want);
            return 1;
        }
    }
    printf("rank %d of %d: hello from lockstep %d.%d.%d, all-reduce sum %g (checked)\n", rank, nranks, LOCKSTEP_MAJOR,
           LOCKSTEP_MINOR, LOCKSTEP_PATCH, x[0]);

    CHECK(lockstepCommFinalize(comm)); /* every rank is done with it */
    CHECK(lockstepCommDestroy(comm));
    return 0;
}
