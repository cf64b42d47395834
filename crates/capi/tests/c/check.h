/*
 * The checking helpers of the C programs that drive liblockstep.so (capi_test.c here, and
 * benches/gpu/capi_cuda.c): a failed check prints the rank, the place, the condition and what was
 * expected, and exits 1.
 */
#ifndef LOCKSTEP_TEST_CHECK_H
#define LOCKSTEP_TEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>

#include "lockstep.h"

/* This process's rank, for the failure messages; -1 until it is known. */
static int g_rank = -1;

/* A condition that must hold; on failure, a printf-style message of what was expected. */
#define CHECK(cond, ...)                                                                      \
    do {                                                                                      \
        if (!(cond)) {                                                                        \
            fprintf(stderr, "rank %d: %s:%d: check failed: %s: ", g_rank, __FILE__, __LINE__, \
                    #cond);                                                                   \
            fprintf(stderr, __VA_ARGS__);                                                     \
            fprintf(stderr, "\n");                                                            \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

/* A call that must succeed; on failure, its code and message. */
#define OK(call)                                                                              \
    do {                                                                                      \
        lockstepResult_t r_ = (call);                                                         \
        CHECK(r_ == lockstepSuccess, "%s returned %d (%s): %s", #call, (int)r_,               \
              lockstepGetErrorString(r_), lockstepGetLastError(NULL));                        \
    } while (0)

#endif
