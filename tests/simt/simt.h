// simt.h: a small SIMT shim that lets kernels/*.cu compile with g++ as host C++ and run on the
// CPU, so CI (no GPU, no CUDA toolkit) executes the real kernel sources. Force-included before
// each kernel file (`c++ -include simt.h`) by tests/common/simt.rs, which also generates the
// per-kernel launch trampolines; the runtime is simt.cpp, the driver that calls it
// tests/fake/sim_cuda.c.
//
// Execution model (simt.cpp has the details):
//   - a block's threads are cooperative fibers on one OS thread (a hand-written context switch
//     on x86-64, ucontext elsewhere): a fiber runs until it reaches a barrier, then the next
//     runnable one resumes. __syncthreads is a block barrier; threads that have returned no
//     longer count, as on the GPU.
//   - warp-synchronous operations (__shfl_*_sync, __ballot_sync, __syncwarp, mma.sync) are warp
//     barriers over the lanes in the mask: every lane deposits its operand, the last lane to
//     arrive computes every lane's result, then all continue. A lane named in the mask that has
//     exited, a lane outside the block, or lanes disagreeing on the operation fail the launch.
//   - __shared__ is `thread_local`: one OS thread runs one block at a time, so every block sees
//     its own copy (static shared memory; dynamic `extern __shared__` is not supported and
//     fails to link: building the simulated driver stops with an undefined symbol).
//   - atomics are real (GCC __atomic builtins), so blocks may run on several OS threads at once
//     (LOCKSTEP_SIMT_WORKERS) and in a shuffled order (LOCKSTEP_SIMT_SHUFFLE), which exposes
//     kernels whose result depends on the order of their atomics.
//   - floating point: IEEE f32 with no contraction (-ffp-contract=off): an explicit fmaf() is
//     one fused operation, `a * b + c` is two roundings. NVCC contracts such expressions into
//     FMAs, so last-bit differences from a GPU are expected; tests compare with tolerances.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

// The shim emulates an sm_80 device (the simulated driver reports compute capability 8.0), so
// common.cuh takes its tensor-core (mma.sync) paths unless LOCKSTEP_NO_TENSOR_CORES is defined.
#ifndef __CUDA_ARCH__
#define __CUDA_ARCH__ 800
#endif

// ----------------------------------------------------------------------------------------------
// qualifiers

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
#define __shared__ thread_local

// ----------------------------------------------------------------------------------------------
// built-in variables

namespace simt {

struct uint3 {
    unsigned int x, y, z;
};
typedef uint3 dim3;

// What a kernel sees of the thread running it; simt.cpp's fiber extends it.
struct ThreadState {
    uint3 threadIdx;
    uint3 blockIdx;
    uint3 blockDim;
    uint3 gridDim;
};

}  // namespace simt

namespace simt {

// Which thread is running: every fiber stack is FIBER_STACK bytes aligned to FIBER_STACK, and
// its first word points at the fiber, so the running thread is found from the stack pointer: no
// thread-local variable to keep in step at every switch, nothing for the compiler to cache
// wrongly across a barrier (simt.cpp lays the stacks out).
constexpr uintptr_t FIBER_STACK = 256 * 1024;
inline ThreadState* self() {
    const uintptr_t sp = (uintptr_t)__builtin_frame_address(0);
    return *reinterpret_cast<ThreadState* const*>(sp & ~(FIBER_STACK - 1));
}

}  // namespace simt

#define threadIdx (::simt::self()->threadIdx)
#define blockIdx (::simt::self()->blockIdx)
#define blockDim (::simt::self()->blockDim)
#define gridDim (::simt::self()->gridDim)
static constexpr int warpSize = 32;

// ----------------------------------------------------------------------------------------------
// runtime entry points (simt.cpp)

namespace simt {

// Block barrier (__syncthreads).
void sync_block();
// Warp barrier over `mask` with an exchange: returns this lane's result of operation `kind`.
enum WarpOp { OP_SYNC = 1, OP_SHFL_IDX, OP_SHFL_UP, OP_SHFL_DOWN, OP_SHFL_XOR, OP_BALLOT };
uint64_t warp_op(WarpOp kind, unsigned int mask, uint64_t value, int arg, int width);
// D = A·B + C on the warp's fragments (PTX ISA layouts): m16n8k16 bf16 and f16, m16n8k8 tf32.
void mma_m16n8k16_bf16(float* c, const unsigned int* a, const unsigned int* b);
void mma_m16n8k16_f16(float* c, const unsigned int* a, const unsigned int* b);
void mma_m16n8k8_tf32(float* c, const unsigned int* a, const unsigned int* b);
// Fail the launch (the driver returns CUDA_ERROR_LAUNCH_FAILED with `why` on stderr).
[[noreturn]] void fail(const char* why);

// cvt.rna.tf32.f32: keep 10 mantissa bits, round to nearest with ties away from zero (add half
// an ulp of the tf32 result to the magnitude, then truncate). NaN and infinity pass unchanged.
inline unsigned int cvt_rna_tf32(float x) {
    unsigned int u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) == 0x7f800000u) return u;
    return (u + 0x1000u) & ~0x1fffu;
}

template <class T>
inline uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "warp shuffles move at most 8 bytes");
    uint64_t u = 0;
    std::memcpy(&u, &v, sizeof(T));
    return u;
}

template <class T>
inline T from_bits(uint64_t u) {
    T v;
    std::memcpy(&v, &u, sizeof(T));
    return v;
}

}  // namespace simt

// The hooks common.cuh uses in place of its inline PTX when they are defined (never under NVRTC).
#define SIMT_MMA_BF16_M16N8K16(c, a, b) ::simt::mma_m16n8k16_bf16((c), (a), (b))
#define SIMT_MMA_F16_M16N8K16(c, a, b) ::simt::mma_m16n8k16_f16((c), (a), (b))
#define SIMT_MMA_TF32_M16N8K8(c, a, b) ::simt::mma_m16n8k8_tf32((c), (a), (b))
#define SIMT_CVT_RNA_TF32(x) ::simt::cvt_rna_tf32(x)

// ----------------------------------------------------------------------------------------------
// synchronisation and warp intrinsics

inline void __syncthreads() { simt::sync_block(); }
inline void __syncwarp(unsigned int mask = 0xffffffffu) { simt::warp_op(simt::OP_SYNC, mask, 0, 0, 32); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

template <class T>
inline T __shfl_sync(unsigned int mask, T v, int src, int width = warpSize) {
    return simt::from_bits<T>(simt::warp_op(simt::OP_SHFL_IDX, mask, simt::to_bits(v), src, width));
}
template <class T>
inline T __shfl_up_sync(unsigned int mask, T v, unsigned int delta, int width = warpSize) {
    return simt::from_bits<T>(simt::warp_op(simt::OP_SHFL_UP, mask, simt::to_bits(v), (int)delta, width));
}
template <class T>
inline T __shfl_down_sync(unsigned int mask, T v, unsigned int delta, int width = warpSize) {
    return simt::from_bits<T>(simt::warp_op(simt::OP_SHFL_DOWN, mask, simt::to_bits(v), (int)delta, width));
}
template <class T>
inline T __shfl_xor_sync(unsigned int mask, T v, int lane_mask, int width = warpSize) {
    return simt::from_bits<T>(simt::warp_op(simt::OP_SHFL_XOR, mask, simt::to_bits(v), lane_mask, width));
}
inline unsigned int __ballot_sync(unsigned int mask, int pred) {
    return (unsigned int)simt::warp_op(simt::OP_BALLOT, mask, pred != 0, 0, 32);
}
inline int __any_sync(unsigned int mask, int pred) { return __ballot_sync(mask, pred) != 0; }
inline int __all_sync(unsigned int mask, int pred) { return __ballot_sync(mask, pred) == mask; }

[[noreturn]] inline void __trap() { simt::fail("__trap() called"); }

// ----------------------------------------------------------------------------------------------
// atomics: relaxed, like CUDA's; they return the old value

namespace simt {
template <class T, class F>
inline T atomic_update(T* p, F f) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "atomics on 4- or 8-byte values");
    typedef typename std::conditional<sizeof(T) == 4, uint32_t, uint64_t>::type U;
    U* q = reinterpret_cast<U*>(p);
    U old = __atomic_load_n(q, __ATOMIC_RELAXED);
    for (;;) {
        U want = to_bits<T>(f(from_bits<T>(old)));
        if (__atomic_compare_exchange_n(q, &old, want, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return from_bits<T>(old);
    }
}
}  // namespace simt

inline float atomicAdd(float* p, float v) { return simt::atomic_update(p, [v](float o) { return o + v; }); }
inline double atomicAdd(double* p, double v) { return simt::atomic_update(p, [v](double o) { return o + v; }); }
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline unsigned int atomicAdd(unsigned int* p, unsigned int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline int atomicSub(int* p, int v) { return __atomic_fetch_sub(p, v, __ATOMIC_RELAXED); }
inline unsigned int atomicSub(unsigned int* p, unsigned int v) { return __atomic_fetch_sub(p, v, __ATOMIC_RELAXED); }
inline int atomicExch(int* p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); }
inline unsigned int atomicExch(unsigned int* p, unsigned int v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); }
inline unsigned long long atomicExch(unsigned long long* p, unsigned long long v) {
    return __atomic_exchange_n(p, v, __ATOMIC_RELAXED);
}
inline float atomicExch(float* p, float v) { return simt::atomic_update(p, [v](float) { return v; }); }
template <class T>
inline T simt_atomic_cas(T* p, T compare, T val) {
    __atomic_compare_exchange_n(p, &compare, val, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return compare;
}
inline int atomicCAS(int* p, int c, int v) { return simt_atomic_cas(p, c, v); }
inline unsigned int atomicCAS(unsigned int* p, unsigned int c, unsigned int v) { return simt_atomic_cas(p, c, v); }
inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long c, unsigned long long v) {
    return simt_atomic_cas(p, c, v);
}
#define SIMT_ATOMIC_MINMAX(T)                                                                               \
    inline T atomicMax(T* p, T v) { return simt::atomic_update(p, [v](T o) { return o > v ? o : v; }); } \
    inline T atomicMin(T* p, T v) { return simt::atomic_update(p, [v](T o) { return o < v ? o : v; }); }
SIMT_ATOMIC_MINMAX(int)
SIMT_ATOMIC_MINMAX(unsigned int)
SIMT_ATOMIC_MINMAX(long long)
SIMT_ATOMIC_MINMAX(unsigned long long)
#undef SIMT_ATOMIC_MINMAX
inline int atomicAnd(int* p, int v) { return __atomic_fetch_and(p, v, __ATOMIC_RELAXED); }
inline unsigned int atomicAnd(unsigned int* p, unsigned int v) { return __atomic_fetch_and(p, v, __ATOMIC_RELAXED); }
inline int atomicOr(int* p, int v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }
inline unsigned int atomicOr(unsigned int* p, unsigned int v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }
inline int atomicXor(int* p, int v) { return __atomic_fetch_xor(p, v, __ATOMIC_RELAXED); }
inline unsigned int atomicXor(unsigned int* p, unsigned int v) { return __atomic_fetch_xor(p, v, __ATOMIC_RELAXED); }

// ----------------------------------------------------------------------------------------------
// math and bit intrinsics (the fast-math ones are computed exactly: tolerances cover the GPU's
// approximations, and exact values keep the shim's results stable)

inline float __int_as_float(int x) { return simt::from_bits<float>((uint32_t)x); }
inline int __float_as_int(float x) { return (int)(uint32_t)simt::to_bits(x); }
inline float __uint_as_float(unsigned int x) { return simt::from_bits<float>(x); }
inline unsigned int __float_as_uint(float x) { return (uint32_t)simt::to_bits(x); }
inline double __longlong_as_double(long long x) { return simt::from_bits<double>((uint64_t)x); }
inline long long __double_as_longlong(double x) { return (long long)simt::to_bits(x); }

inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __fdividef(float x, float y) { return x / y; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : (x != x ? 0.0f : x)); }

// CUDA's device min/max overloads (C++ has none in the global namespace for these types).
#define SIMT_MINMAX(T)                                 \
    inline T min(T a, T b) { return a < b ? a : b; } \
    inline T max(T a, T b) { return a > b ? a : b; }
SIMT_MINMAX(int)
SIMT_MINMAX(unsigned int)
SIMT_MINMAX(long long)
SIMT_MINMAX(unsigned long long)
#undef SIMT_MINMAX
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned int)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline unsigned int __brev(unsigned int x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
    x = ((x >> 8) & 0x00ff00ffu) | ((x & 0x00ff00ffu) << 8);
    return (x >> 16) | (x << 16);
}

template <class T>
inline T __ldg(const T* p) {
    return *p;
}

// ----------------------------------------------------------------------------------------------
// bf16 as cuda_bf16.h names it (the kernels carry their own bf16_t; these serve any that use the
// toolkit's names): the top 16 bits of an f32, rounded to nearest even, NaN kept quiet.

struct __align__(2) __nv_bfloat16 {
    unsigned short __x;
};
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t u = simt::to_bits(f) & 0xffffffffu;
    __nv_bfloat16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.__x = (unsigned short)((u >> 16) | 0x0040u);
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);
        r.__x = (unsigned short)(u >> 16);
    }
    return r;
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline float __bfloat162float(__nv_bfloat16 h) { return simt::from_bits<float>((uint32_t)h.__x << 16); }
