/* Memory bandwidth of this machine, one core or two at once:
 *   gcc -O2 -mavx512f benches/baselines/membw.c -o /tmp/membw && /tmp/membw solo
 *   taskset -c 0 /tmp/membw cpu0 & taskset -c 1 /tmp/membw cpu1; wait
 * 64 MiB buffers: glibc memcpy, a streaming read (AVX-512 loads), streaming stores. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <immintrin.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){size_t n=64<<20;char*a=aligned_alloc(64,n),*b=aligned_alloc(64,n);memset(a,1,n);memset(b,2,n);
double best=1e9,bestr=1e9,bestw=1e9;for(int i=0;i<10;i++){double t=now();memcpy(b,a,n);t=now()-t;if(t<best)best=t;}
volatile __m512i acc;for(int i=0;i<10;i++){double t=now();__m512i s=_mm512_setzero_si512();for(size_t j=0;j<n;j+=64)s=_mm512_add_epi32(s,_mm512_load_si512(a+j));acc=s;t=now()-t;if(t<bestr)bestr=t;}
for(int i=0;i<10;i++){double t=now();__m512i v=_mm512_set1_epi32(i);for(size_t j=0;j<n;j+=64)_mm512_stream_si512((void*)(b+j),v);_mm_sfence();t=now()-t;if(t<bestw)bestw=t;}
printf("%s memcpy %.1f GB/s  read %.1f GB/s  ntwrite %.1f GB/s\n",argv[1],n/best/1e9,n/bestr/1e9,n/bestw/1e9);}
