// activation.cu: elementwise ReLU, forward and backward (PyTorch nn.ReLU).
//
// CPU twins: crates/train/src/ops/activation.rs, beside the engine's CPU layer (ops::Relu),
// which runs the same functions.
// Entry points:
//   relu_forward_f32 (out, inp, n)          out[i] = max(inp[i], 0)
//   relu_backward_f32(dinp, out, dout, n)   dinp[i] = out[i] > 0 ? dout[i] : 0   (OVERWRITTEN)
// n is the element count (int, Rust i32). out/inp may alias (in-place ReLU is fine: each thread
// reads its element before writing it); dinp/dout may alias likewise.
//
// Backward masks on the saved *output*, not the input: out > 0 ⇔ inp > 0, and the output is
// what fused-ReLU layers (linear, batchnorm) keep, so one kernel serves both cases. The gradient
// at exactly 0 is 0, as PyTorch's threshold_backward.
//
// Launch geometry: block 256, grid ceil_div(n, 256) (grid-stride, so a capped grid is fine).
#include "common.cuh"

// ----------------------------------------------------------------------------
// kernels

extern "C" __global__ void relu_forward_f32(float* out, const float* inp, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        out[i] = fmaxf(inp[i], 0.0f);
    }
}

extern "C" __global__ void relu_backward_f32(float* dinp, const float* out, const float* dout, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        dinp[i] = out[i] > 0.0f ? dout[i] : 0.0f;
    }
}
