/* Memory bandwidth of this machine, one core or several at once:
 *   gcc -O2 -mavx512f -pthread benches/baselines/membw.c -o /tmp/membw && /tmp/membw solo
 *   taskset -c 0 /tmp/membw cpu0 & taskset -c 1 /tmp/membw cpu1; wait
 * 64 MiB buffers: glibc memcpy, a streaming read (AVX-512 loads), streaming stores.
 *
 * Concurrent copies (the memcpy-pair bound of benches/baselines/compare.py):
 *   /tmp/membw T BYTES [REPS]
 * T threads pinned to CPUs 0..T-1 each memcpy BYTES from their own source to their own
 * destination at the same moment (a barrier starts every repetition); the time of a repetition
 * is the slowest thread's. Prints the median and the best over REPS (default: enough for about
 * 0.2 s, 5 to 2000), after 2 untimed repetitions that fault the buffers in:
 *   copies 2 bytes 67108864 median_us 4012.3 min_us 3950.1 GBps_per_copy 16.7 */
#define _GNU_SOURCE
#include <ctype.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <immintrin.h>

#include "pin.h"
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}

static int threads, reps;
static size_t bytes;
static pthread_barrier_t bar;
static double *took; /* [rep][thread] */

static void *copier(void *arg) {
    int me = (int)(long)arg;
    pin_to_cpu(me, "membw", " (fewer CPUs than threads?)");
    /* Each thread allocates and first-touches its own buffers (local NUMA node, own pages). */
    size_t n = bytes ? bytes : 1;
    char *a = aligned_alloc(64, (n + 63) / 64 * 64), *b = aligned_alloc(64, (n + 63) / 64 * 64);
    memset(a, 1 + me, n);
    memset(b, 0, n);
    for (int r = -2; r < reps; r++) {
        pthread_barrier_wait(&bar);
        double t = now();
        memcpy(b, a, bytes);
        t = now() - t;
        if (r >= 0) took[r * threads + me] = t;
    }
    free(a);
    free(b);
    return NULL;
}

static int cmp(const void *x, const void *y) {
    double p = *(const double *)x, q = *(const double *)y;
    return (p > q) - (p < q);
}

static int copies(int argc, char **argv) {
    threads = atoi(argv[1]);
    bytes = strtoull(argv[2], NULL, 10);
    if (threads < 1 || threads > 256) {
        fprintf(stderr, "membw: %d threads: give 1 to 256\n", threads);
        return 2;
    }
    reps = argc > 3 ? atoi(argv[3]) : (int)(0.2 / (bytes / 10e9 + 2e-6));
    if (reps < 5) reps = 5;
    if (reps > 2000) reps = 2000;
    took = calloc((size_t)reps * threads, sizeof(double));
    pthread_barrier_init(&bar, NULL, threads);
    pthread_t *t = malloc(sizeof(pthread_t) * threads);
    for (long i = 0; i < threads; i++) pthread_create(&t[i], NULL, copier, (void *)i);
    for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
    double *rep = malloc(sizeof(double) * reps);
    for (int r = 0; r < reps; r++) {
        rep[r] = 0;
        for (int i = 0; i < threads; i++)
            if (took[r * threads + i] > rep[r]) rep[r] = took[r * threads + i];
    }
    qsort(rep, reps, sizeof(double), cmp);
    double med = rep[reps / 2];
    printf("copies %d bytes %zu median_us %.3f min_us %.3f GBps_per_copy %.2f\n", threads, bytes, med * 1e6, rep[0] * 1e6, bytes / med / 1e9);
    return 0;
}

int main(int argc,char**argv){
if(argc>2&&isdigit((unsigned char)argv[1][0]))return copies(argc,argv);
size_t n=64<<20;char*a=aligned_alloc(64,n),*b=aligned_alloc(64,n);memset(a,1,n);memset(b,2,n);
double best=1e9,bestr=1e9,bestw=1e9;for(int i=0;i<10;i++){double t=now();memcpy(b,a,n);t=now()-t;if(t<best)best=t;}
volatile __m512i acc;for(int i=0;i<10;i++){double t=now();__m512i s=_mm512_setzero_si512();for(size_t j=0;j<n;j+=64)s=_mm512_add_epi32(s,_mm512_load_si512(a+j));acc=s;t=now()-t;if(t<bestr)bestr=t;}
for(int i=0;i<10;i++){double t=now();__m512i v=_mm512_set1_epi32(i);for(size_t j=0;j<n;j+=64)_mm512_stream_si512((void*)(b+j),v);_mm_sfence();t=now()-t;if(t<bestw)bestw=t;}
printf("%s memcpy %.1f GB/s  read %.1f GB/s  ntwrite %.1f GB/s\n",argc>1?argv[1]:"solo",n/best/1e9,n/bestr/1e9,n/bestw/1e9);}
