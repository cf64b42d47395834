/* The floor of the single-copy collectives on ordinary buffers (the CMA path: its bodies in
 * src/shm/coll/, chosen by src/shm/path.rs): the same copies as lockstep's paths, done by two
 * bare processes with nothing else (no descriptors, no verdicts, no library), so that a
 * collective's time can be set against what its copies alone cost on this machine.
 *   gcc -O2 benches/baselines/cma_floor.c -o /tmp/cma_floor && /tmp/cma_floor [BYTES] [REPS] [ROUNDS]
 * Two processes (fork) pinned to CPU 0 and CPU 1, each with its own page-aligned BYTES-long input
 * and output, filled once. Every variant runs REPS timed repetitions (default 200) after 5
 * untimed ones, every repetition between two spin barriers on a shared line (the time is rank
 * 0's, barrier to barrier, so it includes one barrier); the variants take turns for ROUNDS rounds
 * (default 10) so that drift hits them alike. Prints the median and p10 per variant. BYTES is the
 * message as `lockstep bench` counts it (all_gather: the output; default 1 MiB).
 * Set FRESH=1 to rewrite every input and read every output between repetitions (untimed), as an
 * application does: the inputs are then modified lines in their owner's cache.
 * "pull" is process_vm_readv from the peer, "push" process_vm_writev into the peer, "memcpy" a
 * local copy. The "shm" variants do the same copies with memcpy between buffers in one shared
 * mapping made before the fork (a tmpfs-backed MAP_SHARED, like lockstep's segment), as the
 * zero-copy paths on shared buffers do. The "staged" variants copy through staging slots in that
 * mapping, as lockstep's staged paths on ordinary buffers do ("|" in their names is a barrier:
 * the slots are complete); the slots alternate between two buffers from one repetition to the
 * next, as lockstep's alternate by phase parity (one slot, rewritten while its lines sit in the
 * peer's cache, took twice as long). `compare.py` runs the out-of-place all_gather and broadcast
 * variants each op-round as the ordinary-buffer floor. ONLY=letters runs only those variants (a =
 * the first listed below, z the 26th, then A, B, ...). */
#define _GNU_SOURCE
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static struct ctl {
    _Atomic long seq[2];
    pid_t pid[2];
    char *in[2], *out[2];
    char *shin[2], *shout[2];
} *C;
static int me;
static long myseq;

static void barrier(void) {
    myseq++;
    atomic_store(&C->seq[me], myseq);
    while (atomic_load(&C->seq[1 - me]) < myseq) __builtin_ia32_pause();
}

static void cma(int write, char *local, char *remote, size_t n) {
    if (!n) return;
    struct iovec l = {local, n}, r = {remote, n};
    pid_t p = C->pid[1 - me];
    ssize_t got = write ? process_vm_writev(p, &l, 1, &r, 1, 0) : process_vm_readv(p, &l, 1, &r, 1, 0);
    if (got != (ssize_t)n) {
        perror(write ? "process_vm_writev" : "process_vm_readv");
        exit(1);
    }
}
#define PULL(local, remote, n) cma(0, local, remote, n)
#define PUSH(local, remote, n) cma(1, local, remote, n)

/* Read n bytes of src once and write them to a and to b, 32 bytes at a time (what lockstep's
 * put2 does): the fused form of two copies of one source. */
static void copy2(char *a, char *b, const char *src, size_t n) {
    typedef long long v4 __attribute__((vector_size(32), aligned(1)));
    for (size_t i = 0; i + 128 <= n; i += 128) {
        v4 x0 = *(const v4 *)(src + i), x1 = *(const v4 *)(src + i + 32);
        v4 x2 = *(const v4 *)(src + i + 64), x3 = *(const v4 *)(src + i + 96);
        *(v4 *)(a + i) = x0, *(v4 *)(a + i + 32) = x1, *(v4 *)(a + i + 64) = x2, *(v4 *)(a + i + 96) = x3;
        *(v4 *)(b + i) = x0, *(v4 *)(b + i + 32) = x1, *(v4 *)(b + i + 64) = x2, *(v4 *)(b + i + 96) = x3;
    }
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* a[i] = b[i] = x[i] + y[i] over n bytes of f32 (n a multiple of 128), 32 bytes at a time: the
 * staged all-reduce's step, whose sum goes to the rank's output and to its slot for the peer (as
 * lockstep's reduce_into with two destinations). */
static void sum2(char *a, char *b, const char *x, const char *y, size_t n) {
    typedef float v8 __attribute__((vector_size(32), aligned(1)));
    for (size_t i = 0; i + 128 <= n; i += 128)
        for (size_t j = 0; j < 128; j += 32) {
            v8 v = *(const v8 *)(x + i + j) + *(const v8 *)(y + i + j);
            *(v8 *)(a + i + j) = v, *(v8 *)(b + i + j) = v;
        }
}

static const char *names[] = {
    "barrier alone",
    "broadcast in place, pull: 1 pulls S",
    "broadcast in place, split: 0 pushes S/2, 1 pulls S/2",
    "broadcast out of place, pull: 0 memcpy S; 1 pulls S",
    "broadcast out of place, split: 0 memcpy S + pushes S/4; 1 pulls 3S/4",
    "broadcast out of place, halves: 0 memcpy+pushes S/2; 1 pulls+pushes S/2",
    "broadcast out of place, halves in 128K chunks",
    "all_gather out of place, pull: each memcpy S/2 + pulls S/2",
    "all_gather out of place, push: each memcpy S/2 + pushes S/2",
    "all_gather in place, push: each pushes S/2",
    "memcpy S on both (the copy each core does in oop broadcast)",
    "memcpy 3S/4 on both (compare.py's all_gather bound)",
    "memcpy S/2 on both (compare.py's broadcast bound)",
    "push S/2 on both",
    "pull S/2 on both",
    "broadcast in place, shm pull: 1 memcpy S from 0's shm input",
    "broadcast in place, shm split: 0 memcpy S/2 into 1's shm output; 1 memcpy S/2",
    "pull S/2 on both, shm (memcpy from the peer's shm input)",
    "all_gather out of place, staged: each stages S/2 | copies own S/2, peer's S/2",
    "all_gather out of place, staged, own copy first: own S/2, stage S/2 | peer's S/2",
    "all_gather out of place, staged, fused: stage + own S/2 in one pass | peer's S/2",
    "broadcast out of place, staged: 0 stages S | 0 memcpy S, 1 copies S out",
    "broadcast out of place, staged, fused: 0 stages + memcpy S in one pass | 1 copies S out",
    "all_gather staged, fused in 4 KiB memcpy pairs (lockstep's copy_block2 before)",
    "memcpy S/2 three times on both (the staged all_gather's copies, no handshake)",
    "all_reduce out of place, staged: stage peer's S/2 | reduce own S/2 into output + slot | copy peer's S/2 out",
    "all_gather in place, staged: each stages its S/2 block | copies peer's S/2 out",
    "broadcast in place, staged, pipelined: 0 stages S while 1 copies out the last",
};
#define NV (int)(sizeof names / sizeof *names)

/* The letter ONLY= names variant v by: a-z, then A-Z. */
static int letter(int v) { return v < 26 ? 'a' + v : 'A' + v - 26; }

int main(int argc, char **argv) {
    size_t S = argc > 1 ? strtoull(argv[1], NULL, 10) : 1 << 20;
    int reps = argc > 2 ? atoi(argv[2]) : 200, rounds = argc > 3 ? atoi(argv[3]) : 10;
    int fresh = getenv("FRESH") && atoi(getenv("FRESH"));
    /* ONLY=letters: run only these variants (a = the first, b = the second, ..., z, then A, B, ...). */
    const char *only = getenv("ONLY");
    S = S / 256 * 256;
    if (S == 0 || reps < 1 || rounds < 1) {
        fprintf(stderr, "usage: cma_floor [BYTES >= 256] [REPS] [ROUNDS]\n");
        return 2;
    }
    C = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (C == MAP_FAILED) return perror("mmap"), 1;
    char *sh = mmap(NULL, 4 * S, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (sh == MAP_FAILED) return perror("mmap"), 1;
    for (int r = 0; r < 2; r++) {
        C->shin[r] = sh + (size_t)r * 2 * S;
        C->shout[r] = sh + (size_t)r * 2 * S + S;
    }
    pid_t child = fork();
    if (child < 0) return perror("fork"), 1;
    me = child == 0;
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(me, &s);
    if (sched_setaffinity(0, sizeof s, &s)) return perror("sched_setaffinity (2 CPUs needed)"), 1;
    char *in, *out;
    if (posix_memalign((void **)&in, 4096, S) || posix_memalign((void **)&out, 4096, S)) return perror("posix_memalign"), 1;
    memset(in, 1 + me, S);
    memset(out, 0, S);
    memset(C->shin[me], 1 + me, S);
    memset(C->shout[me], 0, S);
    C->pid[me] = getpid();
    C->in[me] = in;
    C->out[me] = out;
    barrier();
    int peer = 1 - me;
    size_t H = S / 2, Q = S / 4;
    double *t = malloc(sizeof(double) * (size_t)reps * rounds * NV);
    int cnt[NV] = {0};
    long sink = 0;
    for (int rd = 0; rd < rounds; rd++)
        for (int v = 0; v < NV; v++)
            for (int r = -5; r < reps && (!only || strchr(only, letter(v))); r++) {
                if (fresh) {
                    for (size_t i = 0; i < S; i += 64) sink += out[i];
                    memset(in, (int)(sink + r) & 0x7f, S);
                }
                barrier();
                double t0 = now();
                char *pin = C->in[peer], *pout = C->out[peer];
                /* Staging slots alternate between two buffers by repetition, as lockstep's alternate
                 * by phase parity. */
                char *slot[2] = {r & 1 ? C->shout[0] : C->shin[0], r & 1 ? C->shout[1] : C->shin[1]};
                switch (v) {
                case 0: break;
                case 1: if (me) PULL(out, pin, S); break;
                case 2: if (me) PULL(out, pin, H); else PUSH(in + H, pout + H, H); break;
                case 3: if (me) PULL(out, pin, S); else memcpy(out, in, S); break;
                case 4: if (me) PULL(out, pin, S - Q); else { PUSH(in + S - Q, pout + S - Q, Q); memcpy(out, in, S); } break;
                case 5:
                    if (me) {
                        PULL(out, pin, H);
                        PUSH(out, pout, H);
                    } else {
                        memcpy(out + H, in + H, H);
                        PUSH(in + H, pout + H, H);
                    }
                    break;
                case 6:
                    for (size_t o = 0; o < H; o += 131072) {
                        size_t c = H - o < 131072 ? H - o : 131072;
                        if (me) {
                            PULL(out + o, pin + o, c);
                            PUSH(out + o, pout + o, c);
                        } else {
                            memcpy(out + H + o, in + H + o, c);
                            PUSH(out + H + o, pout + H + o, c);
                        }
                    }
                    break;
                case 7: memcpy(out + me * H, in, H); PULL(out + peer * H, pin, H); break;
                case 8: memcpy(out + me * H, in, H); PUSH(in, pout + me * H, H); break;
                case 9: PUSH(in, pout + me * H, H); break;
                case 10: memcpy(out, in, S); break;
                case 11: memcpy(out, in, 3 * Q); break;
                case 12: memcpy(out, in, H); break;
                case 13: PUSH(in, pout + me * H, H); break;
                case 14: PULL(out + peer * H, pin, H); break;
                case 15: if (me) memcpy(C->shout[1], C->shin[0], S); break;
                case 16: if (me) memcpy(C->shout[1], C->shin[0], H); else memcpy(C->shout[1] + H, C->shin[0] + H, H); break;
                case 17: memcpy(C->shout[me] + peer * H, C->shin[peer], H); break;
                /* Staged through the shared mapping, as lockstep's staged paths on ordinary
                 * buffers: shin[r] is rank r's slot; "|" is a barrier (the slot is complete). */
                case 18:
                    memcpy(slot[me], in, H);
                    barrier();
                    memcpy(out + me * H, in, H);
                    memcpy(out + peer * H, slot[peer], H);
                    break;
                case 19:
                    memcpy(out + me * H, in, H);
                    memcpy(slot[me], in, H);
                    barrier();
                    memcpy(out + peer * H, slot[peer], H);
                    break;
                case 20:
                    copy2(slot[me], out + me * H, in, H);
                    barrier();
                    memcpy(out + peer * H, slot[peer], H);
                    break;
                case 21:
                    if (!me) memcpy(slot[0], in, S);
                    barrier();
                    if (me) memcpy(out, slot[0], S); else memcpy(out, in, S);
                    break;
                case 22:
                    if (!me) copy2(slot[0], out, in, S);
                    barrier();
                    if (me) memcpy(out, slot[0], S);
                    break;
                case 23:
                    for (size_t o = 0; o < H; o += 4096) {
                        memcpy(slot[me] + o, in + o, 4096);
                        memcpy(out + me * H + o, in + o, 4096);
                    }
                    barrier();
                    memcpy(out + peer * H, slot[peer], H);
                    break;
                case 24: memcpy(out, in, H); memcpy(C->shin[me], in, H); memcpy(in, out, H); break;
                case 25: {
                    /* The result slot is the buffer the stage slot is not in this repetition. */
                    char *res[2] = {r & 1 ? C->shin[0] : C->shout[0], r & 1 ? C->shin[1] : C->shout[1]};
                    memcpy(slot[me], in + peer * H, H);
                    barrier();
                    sum2(out + me * H, res[me], in + me * H, slot[peer], H);
                    barrier();
                    memcpy(out + peer * H, res[peer], H);
                    break;
                }
                /* In place: a rank's own block already lies in its output, so all_gather stages
                 * it from there and copies only the peer's block out; broadcast's root copies
                 * nothing into its own buffer. The staged broadcast's root returns once it has
                 * staged (it has nothing to copy out), so in a loop of calls it stages the next
                 * message while the receiver still copies out the last one from the other slot:
                 * variant 27 times that overlap. all_gather cannot overlap so: each rank both
                 * stages and copies out. */
                case 26:
                    memcpy(slot[me], out + me * H, H);
                    barrier();
                    memcpy(out + peer * H, slot[peer], H);
                    break;
                case 27:
                    if (!me) memcpy(slot[0], in, S);
                    else memcpy(out, r & 1 ? C->shin[0] : C->shout[0], S);
                    break;
                }
                barrier();
                if (r >= 0) t[(size_t)v * reps * rounds + cnt[v]++] = now() - t0;
            }
    if (me == 0) {
        printf("cma_floor: %zu bytes, %d x %d repetitions per variant%s\n", S, rounds, reps, fresh ? ", fresh inputs" : "");
        for (int v = 0; v < NV; v++) {
            double *x = t + (size_t)v * reps * rounds;
            if (!cnt[v]) continue;
            qsort(x, cnt[v], sizeof(double), cmp);
            printf("%-72s median_us %8.2f p10_us %8.2f\n", names[v], x[cnt[v] / 2] * 1e6, x[cnt[v] / 10] * 1e6);
        }
        waitpid(child, NULL, 0);
    }
    return (int)(sink & 0);
}
