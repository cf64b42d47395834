// common.cuh: helpers shared by every lockstep kernel (included through NVRTC's in-memory
// headers, see src/cuda/kernels.rs). Keep it free of host code and of includes: NVRTC has no
// system headers here.
#pragma once

// -----------------------------------------------------------------------------------------------
// Index helpers

// Grid-stride loop over [0, n): each thread handles i, i + stride, ...
#define GRID_STRIDE_LOOP(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (long long)(n); \
         i += (long long)blockDim.x * gridDim.x)

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// -----------------------------------------------------------------------------------------------
// Reductions

// Sum of `v` over the 32 lanes of a warp; every lane gets the result.
__device__ __forceinline__ float warp_reduce_sum(float v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// Max of `v` over the lanes of a warp; every lane gets the result.
__device__ __forceinline__ float warp_reduce_max(float v) {
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}
