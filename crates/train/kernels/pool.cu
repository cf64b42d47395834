// pool.cu: 2-D max pooling over NCHW f32 (PyTorch nn.MaxPool2d(kernel, stride), no padding,
// dilation 1, floor mode), with saved argmax indices.
//
// CPU twins: crates/train/src/ops/pool/twin.rs (the CPU layer: ops::MaxPool2d, ops/pool/mod.rs).
// Entry points (the twins take the same tensors in the same order):
//   maxpool2d_forward_f32 (out, indices, inp, batch, channels, in_h, in_w, kernel, stride)
//   maxpool2d_backward_f32(dinp, dout, indices, batch, channels, in_h, in_w, kernel, stride)
// All sizes are int (Rust i32). out_h = (in_h - kernel) / stride + 1, likewise out_w.
//
// Layouts: inp, dinp (batch, channels, in_h, in_w); out, dout, indices (batch, channels, out_h,
// out_w). indices are int32 offsets inside the (in_h, in_w) plane, iy*in_w + ix, exactly what
// PyTorch's return_indices gives.
//
// Math:
//   forward:  out[n,c,oy,ox] = max over ky,kx < kernel of inp[n,c,oy*stride+ky,ox*stride+kx];
//             ties keep the first in row-major window order; NaN wins (propagates), as PyTorch.
//   backward: dinp[n,c,iy,ix] = Σ over the windows (oy,ox) that contain (iy,ix) and whose
//             indices[n,c,oy,ox] == iy*in_w+ix of dout[n,c,oy,ox]        (OVERWRITTEN)
//             Written as a gather over input pixels (no atomics, no memset, deterministic) so
//             overlapping windows (stride < kernel) are handled too.
//
// Launch geometry: both elementwise with block 256, grid-stride:
//   forward grid ceil_div(batch*channels*out_h*out_w, 256); backward ceil_div(batch*channels*in_h*in_w, 256).
#include "common.cuh"

// ----------------------------------------------------------------------------
// forward

extern "C" __global__ void maxpool2d_forward_f32(float* out, int* indices, const float* inp, int batch, int channels,
                                                 int in_h, int in_w, int kernel, int stride) {
    const int out_h = (in_h - kernel) / stride + 1, out_w = (in_w - kernel) / stride + 1;
    const int total = batch * channels * out_h * out_w;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const int ox = i % out_w, oy = (i / out_w) % out_h, plane = i / (out_w * out_h);
        const float* src = inp + (long long)plane * in_h * in_w;
        const int y0 = oy * stride, x0 = ox * stride;
        float best = -lockstep_inf();
        int arg = y0 * in_w + x0;
        for (int ky = 0; ky < kernel; ++ky)
            for (int kx = 0; kx < kernel; ++kx) {
                const int idx = (y0 + ky) * in_w + (x0 + kx);
                const float v = src[idx];
                // `v != v` is the NaN test: a NaN becomes the max and stays (nothing is > NaN).
                if (v > best || (v != v && best == best)) {
                    best = v;
                    arg = idx;
                }
            }
        out[i] = best;
        indices[i] = arg;
    }
}

// ----------------------------------------------------------------------------
// backward

extern "C" __global__ void maxpool2d_backward_f32(float* dinp, const float* dout, const int* indices, int batch,
                                                  int channels, int in_h, int in_w, int kernel, int stride) {
    const int out_h = (in_h - kernel) / stride + 1, out_w = (in_w - kernel) / stride + 1;
    const int total = batch * channels * in_h * in_w;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const int p = i % (in_h * in_w), plane = i / (in_h * in_w);
        const int iy = p / in_w, ix = p % in_w;
        // Windows containing iy: oy*stride <= iy <= oy*stride + kernel - 1.
        const int oy_lo = iy >= kernel ? (iy - kernel) / stride + 1 : 0;
        const int oy_hi = min(iy / stride, out_h - 1);
        const int ox_lo = ix >= kernel ? (ix - kernel) / stride + 1 : 0;
        const int ox_hi = min(ix / stride, out_w - 1);
        const long long obase = (long long)plane * out_h * out_w;
        float g = 0.0f;
        for (int oy = oy_lo; oy <= oy_hi; ++oy)
            for (int ox = ox_lo; ox <= ox_hi; ++ox) {
                const long long o = obase + oy * out_w + ox;
                if (indices[o] == p) g += dout[o];
            }
        dinp[i] = g;
    }
}
