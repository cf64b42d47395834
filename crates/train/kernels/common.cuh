// common.cuh: helpers shared by every kernels/*.cu file.
//
// What lives here and why:
//   - ceil_div and the warp/block reductions used by batchnorm, loss and the bias gradients;
//   - header-free bf16 and fp16 types (bf16_t, f16_t) with round-to-nearest-even conversion;
//   - the tiled GEMM core (gemm_tile) that conv2d.cu (implicit GEMM) and linear.cu both use,
//     with a tensor-core path (mma.sync: bf16 and f16 m16n8k16, TF32 m16n8k8) on sm_80+ and a plain
//     shared-memory tiled FMA fallback everywhere else.
//
// CPU twin of the tiled core (split-K ranges, weight-gradient stores): crates/train/src/gemm/twin.rs.
//
// Header-free on purpose. The brief asked for cuda_bf16.h and WMMA (mma.h). Verified with NVRTC
// 12.9 (wheel nvidia-cuda-nvrtc-cu12): NVRTC ships *no* headers: cuda_bf16.h, cuda_fp16.h and
// mma.h are not built in. cuda_bf16.h comes with nvidia-cuda-runtime-cu12, but mma.h includes
// "crt/mma.h", which only the nvcc package carries. Requiring a toolkit include directory at run
// time would break "needs only the driver and libnvrtc", so these kernels use the PTX
// instruction (mma.sync) that WMMA itself lowers to on sm_80+, and a 16-bit struct for bf16.
// Every .cu file therefore compiles with no -I at all; common.cuh is passed to NVRTC as an
// in-memory header (build.rs KERNEL_HEADERS), exactly as kernels/check_nvrtc.py does.
//
// Compile-time switches (pass as NVRTC options, e.g. "-DLOCKSTEP_NO_TF32"):
//   LOCKSTEP_NO_TENSOR_CORES  use the FMA fallback for every GEMM (debugging, A/B checks)
//   LOCKSTEP_NO_TF32          f32 GEMMs use exact f32 FMA (bf16 still uses tensor cores). TF32
//                             keeps 10 mantissa bits, so f32 GEMMs with TF32 match a CPU f32
//                             reference only to about 1e-3 relative; use this switch when a test
//                             needs tighter tolerances (PyTorch's default for matmul is also
//                             TF32 off, while its cuDNN convolutions default to TF32 on).
//
// NVRTC rules followed in all files: no <cstdio>/<stdint.h>/<cmath>; integer types are int,
// unsigned int, long long, unsigned long long; C++14 is enough (no `if constexpr`).
#pragma once

// ----------------------------------------------------------------------------
// small integer helpers

// Number of blocks of size b needed to cover a (a >= 0, b > 0).
__host__ __device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Positive infinity without <cmath>/INFINITY (NVRTC has no host headers).
__device__ __forceinline__ float lockstep_inf() { return __int_as_float(0x7f800000); }

// ----------------------------------------------------------------------------
// warp and block reductions

#define WARP_SIZE 32

__device__ __forceinline__ float warp_reduce_sum(float v) {
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ int warp_reduce_sum_int(int v) {
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_reduce_max(float v) {
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum of v over the whole block; every thread gets the result. blockDim.x must be a multiple of
// 32 and at most 1024; `scratch` is 32 floats of shared memory. The leading __syncthreads makes
// back-to-back calls with the same scratch safe (a slow warp may still be reading the previous
// result when a fast warp would overwrite it). The order of additions is fixed by the thread
// layout, so the result is deterministic for a given launch geometry.
__device__ __forceinline__ float block_reduce_sum(float v, float* scratch) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int nwarps = blockDim.x / WARP_SIZE;
    v = warp_reduce_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float r = lane < nwarps ? scratch[lane] : 0.0f;
    return warp_reduce_sum(r);
}

// Integer twin of block_reduce_sum (exact), e.g. the correct-prediction count.
__device__ __forceinline__ int block_reduce_sum_int(int v, int* scratch) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int nwarps = blockDim.x / WARP_SIZE;
    v = warp_reduce_sum_int(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int r = lane < nwarps ? scratch[lane] : 0;
    return warp_reduce_sum_int(r);
}

// ----------------------------------------------------------------------------
// bf16 without cuda_bf16.h
//
// Same bit layout as __nv_bfloat16 and Rust's half::bf16 (the top 16 bits of an IEEE f32), so
// device buffers can be shared with either. A struct (not a bare unsigned short) keeps integer
// arithmetic from silently applying to it.

struct __align__(2) bf16_t {
    unsigned short bits;
};

__device__ __forceinline__ float bf16_to_f32(bf16_t h) { return __uint_as_float(((unsigned int)h.bits) << 16); }

// Round to nearest, ties to even, as __float2bfloat16 and half::bf16::from_f32 do; NaN stays a
// (quiet) NaN instead of rounding into infinity.
__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    bf16_t r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = (unsigned short)((u >> 16) | 0x0040u);
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);
        r.bits = (unsigned short)(u >> 16);
    }
    return r;
}

// IEEE binary16 (fp16) the same header-free way: 1 sign, 5 exponent, 10 mantissa bits. Its range
// is small (largest finite 65504, smallest subnormal 2^-24), which is why fp16 training scales
// the loss (crates/train/src/precision.rs, LossScaler); the conversions below are what make overflow
// visible: a value beyond the range becomes an infinity that the unscale check then finds.
struct __align__(2) f16_t {
    unsigned short bits;
};

// Exact widening (every fp16 value is an f32). Subnormals (exponent field 0) are m * 2^-24,
// computed in f32 without rounding (m < 1024 and the factor is a power of two); NaN stays a quiet
// NaN with its payload, as half::f16::to_f32 does.
__device__ __forceinline__ float f16_to_f32(f16_t h) {
    const unsigned int sign = ((unsigned int)h.bits & 0x8000u) << 16;
    const unsigned int exp = ((unsigned int)h.bits >> 10) & 0x1fu;
    const unsigned int man = (unsigned int)h.bits & 0x3ffu;
    if (exp == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (man ? (0x00400000u | (man << 13)) : 0u));
    if (exp == 0u) {
        const float mag = (float)man * 5.9604644775390625e-08f;  // 2^-24
        return __uint_as_float(sign | __float_as_uint(mag));
    }
    return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));  // rebias 15 -> 127
}

// Round to nearest, ties to even, as __float2half_rn and half::f16::from_f32 do: magnitudes from
// 65520 up (halfway to the next power of two above 65504) become infinity, magnitudes below 2^-25
// become zero, subnormals keep the bits they can; NaN stays a quiet NaN.
__device__ __forceinline__ f16_t f32_to_f16(float f) {
    const unsigned int x = __float_as_uint(f);
    const unsigned int sign = (x >> 16) & 0x8000u;
    const unsigned int exp = x & 0x7f800000u;
    const unsigned int man = x & 0x007fffffu;
    f16_t r;
    if (exp == 0x7f800000u) {
        r.bits = (unsigned short)(sign | 0x7c00u | (man ? (0x0200u | (man >> 13)) : 0u));
        return r;
    }
    const int half_exp = (int)(exp >> 23) - 127 + 15;
    if (half_exp >= 0x1f) {
        r.bits = (unsigned short)(sign | 0x7c00u);
        return r;
    }
    if (half_exp <= 0) {
        if (14 - half_exp > 24) {
            r.bits = (unsigned short)sign;  // below half the smallest subnormal: signed zero
            return r;
        }
        const unsigned int m = man | 0x00800000u;
        const int shift = 14 - half_exp;
        unsigned int half_man = m >> shift;
        const unsigned int round_bit = 1u << (shift - 1);
        // Round up when the dropped part is above one half, or exactly one half with an odd result.
        if ((m & round_bit) != 0u && (m & (3u * round_bit - 1u)) != 0u) half_man += 1u;
        r.bits = (unsigned short)(sign | half_man);
        return r;
    }
    const unsigned int hb = sign | ((unsigned int)half_exp << 10) | (man >> 13);
    const unsigned int round_bit = 0x1000u;
    // A carry out of the mantissa correctly bumps the exponent (up to infinity at the top).
    r.bits = (unsigned short)(((man & round_bit) != 0u && (man & (3u * round_bit - 1u)) != 0u) ? hb + 1u : hb);
    return r;
}

// Uniform "as float" for the operand types of the GEMM core.
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16_t x) { return bf16_to_f32(x); }
__device__ __forceinline__ float to_f32(f16_t x) { return f16_to_f32(x); }

// This thread's share of the sum of channel c over every sample of x[batch, channels, hw] (the
// run x[(n*channels + c)*hw, +hw) of each sample n), in a fixed order: one block per channel
// then takes block_reduce_sum of the shares (BatchNorm's mean, a convolution's bias gradient).
template <typename T>
__device__ __forceinline__ float channel_partial_sum(const T* x, int batch, int channels, int c, int hw) {
    float s = 0.0f;
    for (int n = 0; n < batch; ++n) {
        const T* row = x + ((long long)n * channels + c) * hw;
        for (int p = threadIdx.x; p < hw; p += blockDim.x) s += to_f32(row[p]);
    }
    return s;
}

// Zero of each operand type (out-of-range tile elements are zero-filled).
template <typename T> __device__ __forceinline__ T zero_of();
template <> __device__ __forceinline__ float zero_of<float>() { return 0.0f; }
template <> __device__ __forceinline__ bf16_t zero_of<bf16_t>() { bf16_t z; z.bits = 0; return z; }
template <> __device__ __forceinline__ f16_t zero_of<f16_t>() { f16_t z; z.bits = 0; return z; }

// ----------------------------------------------------------------------------
// GEMM core: C[M, N] = A[M, K] · B[K, N], tiled in shared memory
//
// Launch geometry (every GEMM kernel in conv2d.cu and linear.cu):
//   block = GEMM_THREADS (128) threads, 1-D
//   grid  = (ceil_div(N, GEMM_BN), ceil_div(M, GEMM_BM), splits)
// blockIdx.z selects a contiguous slice of K ("split-K"); with splits > 1 each slice's partial
// products go to its own plane of a workspace (accumulate_out), and splitk_reduce_f32
// (elementwise.cu) adds the planes in slice order: only the accumulating epilogues (weight
// gradients) take that path. No atomics, so results are bit-identical run to run.
//
// The operands are not materialised: the caller passes loader functors a(m, k) and b(k, n)
// (only called with m < M, k < K, n < N) that compute addresses, which is how conv2d does
// implicit GEMM (im2col on the fly). The epilogue functor st(m, n, acc) is called once per
// in-range output element with the f32 accumulator.
//
// A_K_FAST / B_K_FAST say which index is contiguous in memory for each operand, so consecutive
// threads load consecutive addresses (coalescing) while filling the tile.
//
// Shared tiles are As[BM][BK + pad] (row-major, k fastest) and Bs[BN][BK + pad] (B transposed, k
// fastest), i.e. the "row.col" layouts mma.sync wants. The pads (4 floats / 8 bf16 per row) make
// the fragment reads below bank-conflict free: 8 rows x 4 consecutive 32-bit words land in 32
// distinct banks.

#define GEMM_BM 64
#define GEMM_BN 64
#define GEMM_BK 32
#define GEMM_THREADS 128

// enum, not `static const int`: under -default-device a static data member becomes a __device__
// global in every module.
template <typename T> struct GemmPad;
template <> struct GemmPad<float> { enum { value = 4 }; };
template <> struct GemmPad<bf16_t> { enum { value = 8 }; };
template <> struct GemmPad<f16_t> { enum { value = 8 }; };

// Tensor-core availability: decided per instantiation by overloads below, never by a runtime if,
// so the mma path is not even compiled for archs that lack it.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800) && !defined(LOCKSTEP_NO_TENSOR_CORES)
#define LOCKSTEP_MMA_BF16 1
#if !defined(LOCKSTEP_NO_TF32)
#define LOCKSTEP_MMA_TF32 1
#endif
#endif

// Per-thread accumulator for the 64x64 block tile over 128 threads: 32 floats either way.
//   mma path: warp w owns the 32x32 sub-tile (w / 2, w % 2); acc[i][j][r] is element r of the
//             m16n8 fragment (i, j): row 16*i + g + 8*(r >= 2), col 8*j + 2*t + (r & 1), with
//             g = lane / 4, t = lane % 4 (the PTX ISA's C-fragment layout).
//   fma path: thread (ty = tid / 16, tx = tid % 16) owns rows ty + 8*i, cols tx + 16*j.
struct GemmAcc {
    float v[2][4][4];
};

#if defined(LOCKSTEP_MMA_BF16)
// D = A·B + D for one m16n8k16 16-bit fragment (f32 accumulate); the operand type picks the
// instruction. fp16 and bf16 share the fragment layout, so one GEMM body serves both.
__device__ __forceinline__ void mma_16816(float* c, const unsigned int* a, const unsigned int* b, bf16_t) {
#ifdef SIMT_MMA_BF16_M16N8K16  // host-C++ SIMT shim (tests/simt); never defined under NVRTC
    SIMT_MMA_BF16_M16N8K16(c, a, b);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

__device__ __forceinline__ void mma_16816(float* c, const unsigned int* a, const unsigned int* b, f16_t) {
#ifdef SIMT_MMA_F16_M16N8K16
    SIMT_MMA_F16_M16N8K16(c, a, b);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}
#endif

#if defined(LOCKSTEP_MMA_TF32)
// f32 -> tf32 with round-to-nearest (ties away), as cuBLAS/cuDNN do before TF32 mma.
__device__ __forceinline__ unsigned int f32_to_tf32(float x) {
#ifdef SIMT_CVT_RNA_TF32
    return SIMT_CVT_RNA_TF32(x);
#else
    unsigned int r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
#endif
}

// D = A·B + D for one m16n8k8 TF32 fragment (f32 accumulate).
__device__ __forceinline__ void mma_tf32_1688(float* c, const unsigned int* a, const unsigned int* b) {
#ifdef SIMT_MMA_TF32_M16N8K8
    SIMT_MMA_TF32_M16N8K8(c, a, b);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}
#endif

// Plain FMA over one BK slice: works for any arch and both operand types.
template <typename T>
__device__ __forceinline__ void gemm_compute_fma(GemmAcc& acc, const T (*As)[GEMM_BK + GemmPad<T>::value],
                                                 const T (*Bs)[GEMM_BK + GemmPad<T>::value]) {
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    float* c = &acc.v[0][0][0];
#pragma unroll 4
    for (int k = 0; k < GEMM_BK; ++k) {
        float a[8], b[4];
#pragma unroll
        for (int i = 0; i < 8; ++i) a[i] = to_f32(As[ty + 8 * i][k]);
#pragma unroll
        for (int j = 0; j < 4; ++j) b[j] = to_f32(Bs[tx + 16 * j][k]);
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) c[i * 4 + j] = fmaf(a[i], b[j], c[i * 4 + j]);
    }
}

// Tensor-core compute over one BK slice. The overload set picks the path at compile time: the
// generic template is the FMA fallback, the (non-template) overloads below win when enabled.
template <typename T>
__device__ __forceinline__ bool gemm_compute(GemmAcc& acc, const T (*As)[GEMM_BK + GemmPad<T>::value],
                                             const T (*Bs)[GEMM_BK + GemmPad<T>::value]) {
    gemm_compute_fma<T>(acc, As, Bs);
    return false;  // false: accumulator uses the fma layout
}

#if defined(LOCKSTEP_MMA_BF16)
// Tensor-core body shared by the two 16-bit operand types (T = bf16_t or f16_t).
template <typename T>
__device__ __forceinline__ bool gemm_compute_mma16(GemmAcc& acc, const T (*As)[GEMM_BK + 8], const T (*Bs)[GEMM_BK + 8]) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int g = lane / 4, t = lane % 4;
    const int wm = (warp / 2) * 32, wn = (warp % 2) * 32;
#pragma unroll
    for (int kk = 0; kk < GEMM_BK; kk += 16) {
        // Two 16-bit values per 32-bit register: element with the lower k in the low half (little endian).
        unsigned int a[2][4], b[4][2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int r0 = wm + 16 * i + g;
            a[i][0] = *reinterpret_cast<const unsigned int*>(&As[r0][kk + 2 * t]);
            a[i][1] = *reinterpret_cast<const unsigned int*>(&As[r0 + 8][kk + 2 * t]);
            a[i][2] = *reinterpret_cast<const unsigned int*>(&As[r0][kk + 2 * t + 8]);
            a[i][3] = *reinterpret_cast<const unsigned int*>(&As[r0 + 8][kk + 2 * t + 8]);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int c0 = wn + 8 * j + g;
            b[j][0] = *reinterpret_cast<const unsigned int*>(&Bs[c0][kk + 2 * t]);
            b[j][1] = *reinterpret_cast<const unsigned int*>(&Bs[c0][kk + 2 * t + 8]);
        }
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) mma_16816(acc.v[i][j], a[i], b[j], T());
    }
    return true;
}

__device__ __forceinline__ bool gemm_compute(GemmAcc& acc, const bf16_t (*As)[GEMM_BK + 8],
                                             const bf16_t (*Bs)[GEMM_BK + 8]) {
    return gemm_compute_mma16<bf16_t>(acc, As, Bs);
}

__device__ __forceinline__ bool gemm_compute(GemmAcc& acc, const f16_t (*As)[GEMM_BK + 8],
                                             const f16_t (*Bs)[GEMM_BK + 8]) {
    return gemm_compute_mma16<f16_t>(acc, As, Bs);
}
#endif

#if defined(LOCKSTEP_MMA_TF32)
__device__ __forceinline__ bool gemm_compute(GemmAcc& acc, const float (*As)[GEMM_BK + 4],
                                             const float (*Bs)[GEMM_BK + 4]) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int g = lane / 4, t = lane % 4;
    const int wm = (warp / 2) * 32, wn = (warp % 2) * 32;
#pragma unroll
    for (int kk = 0; kk < GEMM_BK; kk += 8) {
        unsigned int a[2][4], b[4][2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int r0 = wm + 16 * i + g;
            a[i][0] = f32_to_tf32(As[r0][kk + t]);
            a[i][1] = f32_to_tf32(As[r0 + 8][kk + t]);
            a[i][2] = f32_to_tf32(As[r0][kk + t + 4]);
            a[i][3] = f32_to_tf32(As[r0 + 8][kk + t + 4]);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int c0 = wn + 8 * j + g;
            b[j][0] = f32_to_tf32(Bs[c0][kk + t]);
            b[j][1] = f32_to_tf32(Bs[c0][kk + t + 4]);
        }
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) mma_tf32_1688(acc.v[i][j], a[i], b[j]);
    }
    return true;
}
#endif

// Fill one (ROWS x GEMM_BK) shared tile, row r / column c, from load(r, c) (global row r0 + r,
// global k k0 + c). K_FAST: consecutive threads take consecutive k (k contiguous in memory);
// otherwise consecutive rows. Out-of-range elements become zero so they add nothing.
template <typename T, int ROWS, bool K_FAST, typename Load>
__device__ __forceinline__ void gemm_fill(T (*S)[GEMM_BK + GemmPad<T>::value], const Load& load, int r0, int rows,
                                          int k0, int k_end) {
#pragma unroll 4
    for (int idx = threadIdx.x; idx < ROWS * GEMM_BK; idx += GEMM_THREADS) {
        const int r = K_FAST ? idx / GEMM_BK : idx % ROWS;
        const int c = K_FAST ? idx % GEMM_BK : idx / ROWS;
        const int gr = r0 + r, gk = k0 + c;
        S[r][c] = (gr < rows && gk < k_end) ? load(gr, gk) : zero_of<T>();
    }
}

// The whole block computes the output tile at (blockIdx.y * BM, blockIdx.x * BN) over its K
// slice and hands each in-range element to st(m, n, value).
template <typename T, bool A_K_FAST, bool B_K_FAST, typename LoadA, typename LoadB, typename Store>
__device__ __forceinline__ void gemm_tile(int M, int N, int K, const LoadA& la, const LoadB& lb, const Store& st) {
    const int PAD = GemmPad<T>::value;
    // 16-byte alignment so the 32-bit fragment loads of bf16 pairs are aligned.
    __shared__ __align__(16) T As[GEMM_BM][GEMM_BK + PAD];
    __shared__ __align__(16) T Bs[GEMM_BN][GEMM_BK + PAD];

    const int m0 = blockIdx.y * GEMM_BM, n0 = blockIdx.x * GEMM_BN;
    // Split-K: each z-slice owns a BK-aligned contiguous range of K.
    const int kchunk = ceil_div(ceil_div(K, (int)gridDim.z), GEMM_BK) * GEMM_BK;
    const int k_begin = blockIdx.z * kchunk;
    const int k_end = min(K, k_begin + kchunk);

    GemmAcc acc;
#pragma unroll
    for (int i = 0; i < 32; ++i) (&acc.v[0][0][0])[i] = 0.0f;

    // The b(k, n) loader is called as lb(k, n); the fill helper hands (row, k), so swap here.
    struct BT {
        const LoadB& f;
        __device__ __forceinline__ T operator()(int n, int k) const { return f(k, n); }
    } lbt{lb};

    bool mma_layout = false;
    for (int k0 = k_begin; k0 < k_end; k0 += GEMM_BK) {
        gemm_fill<T, GEMM_BM, A_K_FAST>(As, la, m0, M, k0, k_end);
        gemm_fill<T, GEMM_BN, B_K_FAST>(Bs, lbt, n0, N, k0, k_end);
        __syncthreads();
        mma_layout = gemm_compute(acc, (const T(*)[GEMM_BK + GemmPad<T>::value])As,
                                  (const T(*)[GEMM_BK + GemmPad<T>::value])Bs);
        __syncthreads();
    }
    // A block whose K slice is empty (more splits than BK chunks) still stores its zeros: with
    // split-K every slice owns a whole plane of the partials, which the reduction reads.

#if defined(LOCKSTEP_MMA_BF16)
    const bool is_mma = mma_layout;
#else
    const bool is_mma = false;
    (void)mma_layout;
#endif
    if (is_mma) {
        const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
        const int g = lane / 4, t = lane % 4;
        const int wm = m0 + (warp / 2) * 32, wn = n0 + (warp % 2) * 32;
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int m = wm + 16 * i + g + ((r >= 2) ? 8 : 0);
                    const int n = wn + 8 * j + 2 * t + (r & 1);
                    if (m < M && n < N) st(m, n, acc.v[i][j][r]);
                }
    } else {
        const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
        const float* c = &acc.v[0][0][0];
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int m = m0 + ty + 8 * i, n = n0 + tx + 16 * j;
                if (m < M && n < N) st(m, n, c[i * 4 + j]);
            }
    }
}

// Epilogue helper for accumulating outputs (parameter gradients), element i of `out`:
//   one K slice (gridDim.z == 1): out[i] += v (partials is unused and may be NULL);
//   split-K (gridDim.z > 1): the slice's partial sum OVERWRITES partials[blockIdx.z * plane + i]
//     (plane = elements of out; the workspace holds gridDim.z planes), and the caller then runs
//     splitk_reduce_f32(out, partials, gridDim.z, plane), which adds the planes in slice order.
// Every block writes each in-range element of its tile exactly once, so no atomics are needed
// and the sum order is fixed: bit-identical run to run and in CUDA graphs.
__device__ __forceinline__ void accumulate_out(float* out, float* partials, long long plane, long long i, float v) {
    if (gridDim.z > 1) partials[(long long)blockIdx.z * plane + i] = v;
    else out[i] += v;
}
