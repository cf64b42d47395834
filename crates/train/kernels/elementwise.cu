// elementwise.cu: small element-wise kernels used by the GPU tests and the staging paths.
// Launch geometry lives in Rust (LaunchConfig::for_elements: 256-thread blocks, grid capped at
// 65535, so every kernel loops grid-stride). Every entry point has a CPU twin with the same name
// and argument order (crates/train/src/ops/elementwise.rs), and a signature in
// KernelId::functions.
#include "common.cuh"

// -----------------------------------------------------------------------------------------------
// fill_f32: out[i] = value

extern "C" __global__ void fill_f32(float* out, float value, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)blockDim.x * gridDim.x) {
        out[i] = value;
    }
}

// -----------------------------------------------------------------------------------------------
// scale_f32: x[i] *= alpha (in place)

extern "C" __global__ void scale_f32(float* x, float alpha, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)blockDim.x * gridDim.x) {
        x[i] *= alpha;
    }
}

// -----------------------------------------------------------------------------------------------
// axpy_f32: y[i] += alpha * x[i]

extern "C" __global__ void axpy_f32(float* y, const float* x, float alpha, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)blockDim.x * gridDim.x) {
        y[i] += alpha * x[i];
    }
}

// -----------------------------------------------------------------------------------------------
// splitk_reduce_f32: out[i] += partials[i] + partials[n + i] + ... + partials[(splits-1)*n + i]
//
// The second half of a split-K weight gradient (accumulate_out in common.cuh): slice z of the
// GEMM wrote plane z of `partials` (splits planes of n floats); the planes are summed in slice
// order, starting from plane 0, and the sum is added to out once. Fixed order, no atomics:
// bit-identical run to run. Geometry: 1-D, for_elements(n) (grid-stride).

extern "C" __global__ void splitk_reduce_f32(float* out, const float* partials, int splits, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)blockDim.x * gridDim.x) {
        float s = partials[i];
        for (int z = 1; z < splits; ++z) s += partials[(long long)z * n + i];
        out[i] += s;
    }
}
