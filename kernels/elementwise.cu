// elementwise.cu: small element-wise kernels used by the GPU tests and the training loop.
// Launch geometry lives in Rust (src/cuda/kernels.rs, `elementwise_*` launchers). Every entry has
// a CPU twin with the same name and argument order in src/cuda/kernels.rs (`cpu::`).
#include "common.cuh"

// -----------------------------------------------------------------------------------------------
// fill_f32: out[i] = value

extern "C" __global__ void fill_f32(float* out, float value, long long n) {
    GRID_STRIDE_LOOP(i, n) { out[i] = value; }
}

// -----------------------------------------------------------------------------------------------
// scale_f32: x[i] *= alpha (in place)

extern "C" __global__ void scale_f32(float* x, float alpha, long long n) {
    GRID_STRIDE_LOOP(i, n) { x[i] *= alpha; }
}

// -----------------------------------------------------------------------------------------------
// axpy_f32: y[i] += alpha * x[i]

extern "C" __global__ void axpy_f32(float* y, const float* x, float alpha, long long n) {
    GRID_STRIDE_LOOP(i, n) { y[i] += alpha * x[i]; }
}
