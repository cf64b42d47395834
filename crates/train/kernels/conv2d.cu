// conv2d.cu: 2-D convolution (NCHW, PyTorch Conv2d semantics, groups = 1, dilation = 1) as
// implicit GEMM on the shared tiled core in common.cuh (tensor cores on sm_80+).
//
// CPU twins: crates/train/src/ops/conv2d/twin.rs (the CPU layer: ops/conv2d/mod.rs).
// Entry points (the twins take the same tensors in the same order):
//   conv2d_forward_{f32,bf16,f16}          (out, inp, weight, bias, shape...)
//   conv2d_backward_input_{f32,bf16,f16}   (dinp, dout, weight, shape...)
//   conv2d_backward_weight_{f32,bf16,f16}  (dweight, partials, dout, inp, shape...)
//   conv2d_backward_bias_{f32,bf16,f16}    (dbias, dout, batch, out_c, out_h, out_w)
// where shape... = batch, in_c, in_h, in_w, out_c, kh, kw, stride, pad (all int, Rust i32) and
//   out_h = (in_h + 2*pad - kh) / stride + 1,  out_w = (in_w + 2*pad - kw) / stride + 1
// (Conv2dParams::out_h / out_w; the kernels recompute them from the same formula).
//
// Layouts: inp (batch, in_c, in_h, in_w); weight (out_c, in_c, kh, kw); bias (out_c);
//          out (batch, out_c, out_h, out_w). Gradients have the shape of their tensor.
//
// Gradient convention (llm.c): activation gradients (dinp) are OVERWRITTEN; parameter gradients
// (dweight, dbias) are ACCUMULATED (+=), so the caller zeroes them once per step.
//
// dtype: _f32 kernels take f32 everywhere (TF32 tensor cores on sm_80+ unless built with
// -DLOCKSTEP_NO_TF32). _bf16 kernels take bf16 operands (inp, weight, dout) and accumulate in
// f32; their outputs and bias are always f32, so BatchNorm etc. stay f32 and the optimizer sees
// f32 gradients. bf16 copies are made with cast_f32_bf16 (data.cu). _f16 kernels are the same
// with IEEE fp16 operands (cast_f32_f16), for --precision fp16 with dynamic loss scaling.
//
// Math (x = inp, w = weight, y = out, dy = dout, sums over every index not on the left):
//   forward:   y[n,oc,oy,ox]  = bias[oc] + Σ_{ic,ky,kx} w[oc,ic,ky,kx] * x[n,ic,oy*s-p+ky,ox*s-p+kx]
//              (x outside the image reads as 0; bias may be NULL, meaning no bias)
//   bwd input: dx[n,ic,iy,ix] = Σ_{oc,ky,kx} w[oc,ic,ky,kx] * dy[n,oc,oy,ox]
//              over (oy, ox) with oy*s-p+ky = iy, ox*s-p+kx = ix, 0 <= oy < out_h, 0 <= ox < out_w
//   bwd weight: dw[oc,ic,ky,kx] += Σ_{n,oy,ox} dy[n,oc,oy,ox] * x[n,ic,oy*s-p+ky,ox*s-p+kx]
//   bwd bias:  db[oc] += Σ_{n,oy,ox} dy[n,oc,oy,ox]
//
// As GEMMs (see gemm_tile in common.cuh; K index kk = (ic*kh + ky)*kw + kx):
//   forward:    M = out_c, N = batch*out_h*out_w, K = in_c*kh*kw, A = w (out_c x K), B = im2col(x)
//   bwd input:  M = in_c,  N = batch*in_h*in_w,   K = out_c*kh*kw, A = w^T, B = "col2im"(dy)
//   bwd weight: M = out_c, N = in_c*kh*kw,        K = batch*out_h*out_w, A = dy, B = im2col(x)^T
//
// Launch geometry:
//   GEMM kernels: block GEMM_THREADS = 128, grid (ceil_div(N, 64), ceil_div(M, 64), splits).
//     splits must be 1 for forward and backward_input (they overwrite). backward_weight accepts
//     splits > 1 (split-K): its N x M grid is tiny (1 block for the first FashionMNIST conv)
//     while K = batch*out_h*out_w is large, so pick splits ~ 2*SM count / (grid.x*grid.y),
//     capped at ceil_div(K, 32). With splits = 1 it adds into dweight and `partials` is unused
//     (may be NULL); with splits > 1 slice z overwrites plane z of `partials` (splits planes of
//     out_c*in_c*kh*kw floats) and the caller runs splitk_reduce_f32(dweight, partials, splits,
//     out_c*in_c*kh*kw) (elementwise.cu) next. Deterministic either way (no atomics).
//   conv2d_backward_bias_*: grid (out_c), block 256 (any multiple of 32 up to 1024).
#include "common.cuh"

// ----------------------------------------------------------------------------
// shape (device-side only; built from the scalar arguments)

struct ConvShape {
    int batch, in_c, in_h, in_w, out_c, kh, kw, stride, pad, out_h, out_w;
};

__device__ __forceinline__ ConvShape make_conv_shape(int batch, int in_c, int in_h, int in_w, int out_c, int kh,
                                                     int kw, int stride, int pad) {
    ConvShape s;
    s.batch = batch; s.in_c = in_c; s.in_h = in_h; s.in_w = in_w; s.out_c = out_c;
    s.kh = kh; s.kw = kw; s.stride = stride; s.pad = pad;
    s.out_h = (in_h + 2 * pad - kh) / stride + 1;
    s.out_w = (in_w + 2 * pad - kw) / stride + 1;
    return s;
}

// ----------------------------------------------------------------------------
// operand loaders (functors: NVRTC-friendly and inlined into gemm_tile)

// im2col element: row kk = (ic, ky, kx) of the filter, column col = (n, oy, ox) of the output.
template <typename T>
struct Im2col {
    const T* x;
    ConvShape s;
    __device__ __forceinline__ T operator()(int kk, int col) const {
        const int khw = s.kh * s.kw, ohw = s.out_h * s.out_w;
        const int ic = kk / khw, r = kk - ic * khw;
        const int ky = r / s.kw, kx = r - ky * s.kw;
        const int n = col / ohw, p = col - n * ohw;
        const int oy = p / s.out_w, ox = p - oy * s.out_w;
        const int iy = oy * s.stride - s.pad + ky, ix = ox * s.stride - s.pad + kx;
        if (iy < 0 || iy >= s.in_h || ix < 0 || ix >= s.in_w) return zero_of<T>();
        return x[((long long)(n * s.in_c + ic) * s.in_h + iy) * s.in_w + ix];
    }
};

// Forward A: weight as (out_c, K) row-major.
template <typename T>
struct WeightRows {
    const T* w;
    int K;
    __device__ __forceinline__ T operator()(int oc, int kk) const { return w[(long long)oc * K + kk]; }
};

// Backward-input A: w^T, row ic, column kk2 = (oc, ky, kx).
template <typename T>
struct WeightT {
    const T* w;
    ConvShape s;
    __device__ __forceinline__ T operator()(int ic, int kk2) const {
        const int khw = s.kh * s.kw;
        const int oc = kk2 / khw, r = kk2 - oc * khw;
        return w[((long long)oc * s.in_c + ic) * khw + r];
    }
};

// Backward-input B: row kk2 = (oc, ky, kx), column col = (n, iy, ix): the dy element whose
// receptive field puts filter tap (ky, kx) on input pixel (iy, ix), or 0 if there is none
// (stride does not divide, or the output position is out of range).
template <typename T>
struct Col2imDy {
    const T* dy;
    ConvShape s;
    __device__ __forceinline__ T operator()(int kk2, int col) const {
        const int khw = s.kh * s.kw, hw = s.in_h * s.in_w;
        const int oc = kk2 / khw, r = kk2 - oc * khw;
        const int ky = r / s.kw, kx = r - ky * s.kw;
        const int n = col / hw, p = col - n * hw;
        const int iy = p / s.in_w, ix = p - iy * s.in_w;
        const int ty = iy + s.pad - ky, tx = ix + s.pad - kx;
        // Test sign before % so negative numerators never reach the division.
        if (ty < 0 || tx < 0) return zero_of<T>();
        if (ty % s.stride != 0 || tx % s.stride != 0) return zero_of<T>();
        const int oy = ty / s.stride, ox = tx / s.stride;
        if (oy >= s.out_h || ox >= s.out_w) return zero_of<T>();
        return dy[((long long)(n * s.out_c + oc) * s.out_h + oy) * s.out_w + ox];
    }
};

// Backward-weight A: dy viewed as (out_c, batch*out_h*out_w), row oc, column q = (n, oy, ox).
template <typename T>
struct DyRows {
    const T* dy;
    ConvShape s;
    __device__ __forceinline__ T operator()(int oc, int q) const {
        const int ohw = s.out_h * s.out_w;
        const int n = q / ohw, p = q - n * ohw;
        return dy[((long long)n * s.out_c + oc) * ohw + p];
    }
};

// Backward-weight B: im2col transposed, row q = (n, oy, ox), column kk = (ic, ky, kx).
template <typename T>
struct Im2colT {
    Im2col<T> f;
    __device__ __forceinline__ T operator()(int q, int kk) const { return f(kk, q); }
};

// ----------------------------------------------------------------------------
// epilogues

// y[n, oc, p] = acc + bias[oc]; column col = (n, p).
struct StoreConvOut {
    float* y;
    const float* bias;
    int out_c, ohw;
    __device__ __forceinline__ void operator()(int oc, int col, float v) const {
        const int n = col / ohw, p = col - n * ohw;
        y[((long long)n * out_c + oc) * ohw + p] = v + (bias ? bias[oc] : 0.0f);
    }
};

// dx[n, ic, p] = acc (overwrite); column col = (n, p).
struct StoreConvDinp {
    float* dx;
    int in_c, hw;
    __device__ __forceinline__ void operator()(int ic, int col, float v) const {
        const int n = col / hw, p = col - n * hw;
        dx[((long long)n * in_c + ic) * hw + p] = v;
    }
};

// dw[oc, kk] += acc, or the split-K partial into its plane (accumulate_out).
struct StoreConvDweight {
    float* dw;
    float* part;
    int K;
    long long plane;
    __device__ __forceinline__ void operator()(int oc, int kk, float v) const {
        accumulate_out(dw, part, plane, (long long)oc * K + kk, v);
    }
};

// ----------------------------------------------------------------------------
// templated bodies (one per pass), instantiated for f32 and bf16 below

template <typename T>
__device__ __forceinline__ void conv2d_forward_impl(float* out, const T* inp, const T* weight, const float* bias,
                                                    ConvShape s) {
    const int M = s.out_c, N = s.batch * s.out_h * s.out_w, K = s.in_c * s.kh * s.kw;
    WeightRows<T> a{weight, K};
    Im2col<T> b{inp, s};
    StoreConvOut st{out, bias, s.out_c, s.out_h * s.out_w};
    // A: k contiguous (weight rows). B: the column index (output pixel) is the contiguous one.
    gemm_tile<T, true, false>(M, N, K, a, b, st);
}

template <typename T>
__device__ __forceinline__ void conv2d_backward_input_impl(float* dinp, const T* dout, const T* weight, ConvShape s) {
    const int M = s.in_c, N = s.batch * s.in_h * s.in_w, K = s.out_c * s.kh * s.kw;
    WeightT<T> a{weight, s};
    Col2imDy<T> b{dout, s};
    StoreConvDinp st{dinp, s.in_c, s.in_h * s.in_w};
    gemm_tile<T, true, false>(M, N, K, a, b, st);
}

template <typename T>
__device__ __forceinline__ void conv2d_backward_weight_impl(float* dweight, float* partials, const T* dout, const T* inp,
                                                            ConvShape s) {
    const int M = s.out_c, N = s.in_c * s.kh * s.kw, K = s.batch * s.out_h * s.out_w;
    DyRows<T> a{dout, s};
    Im2colT<T> b{Im2col<T>{inp, s}};
    StoreConvDweight st{dweight, partials, N, (long long)M * N};
    // Both operands are contiguous along the output-pixel index, which is K here.
    gemm_tile<T, true, true>(M, N, K, a, b, st);
}

// One block per output channel; fixed reduction order, so deterministic.
template <typename T>
__device__ __forceinline__ void conv2d_backward_bias_impl(float* dbias, const T* dout, int batch, int out_c, int out_h,
                                                          int out_w) {
    __shared__ float scratch[32];
    const int oc = blockIdx.x;
    const float sum = block_reduce_sum(channel_partial_sum(dout, batch, out_c, oc, out_h * out_w), scratch);
    if (threadIdx.x == 0) dbias[oc] += sum;
}

// ----------------------------------------------------------------------------
// entry points

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
conv2d_forward_f32(float* out, const float* inp, const float* weight, const float* bias, int batch, int in_c, int in_h,
                   int in_w, int out_c, int kh, int kw, int stride, int pad) {
    conv2d_forward_impl<float>(out, inp, weight, bias, make_conv_shape(batch, in_c, in_h, in_w, out_c, kh, kw, stride, pad));
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
conv2d_forward_bf16(float* out, const bf16_t* inp, const bf16_t* weight, const float* bias, int batch, int in_c,
                    int in_h, int in_w, int out_c, int kh, int kw, int stride, int pad) {
    conv2d_forward_impl<bf16_t>(out, inp, weight, bias, make_conv_shape(batch, in_c, in_h, in_w, out_c, kh, kw, stride, pad));
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
conv2d_forward_f16(float* out, const f16_t* inp, const f16_t* weight, const float* bias, int batch, int in_c,
                    int in_h, int in_w, int out_c, int kh, int kw, int stride, int pad) {
    conv2d_forward_impl<f16_t>(out, inp, weight, bias, make_conv_shape(batch, in_c, in_h, in_w, out_c, kh, kw, stride, pad));
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
conv2d_backward_input_f32(float* dinp, const float* dout, const float* weight, int batch, int in_c, int in_h, int in_w,
                          int out_c, int kh, int kw, int stride, int pad) {
    conv2d_backward_input_impl<float>(dinp, dout, weight, make_conv_shape(batch, in_c, in_h, in_w, out_c, kh, kw, stride, pad));
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
conv2d_backward_input_bf16(float* dinp, const bf16_t* dout, const bf16_t* weight, int batch, int in_c, int in_h,
                           int in_w, int out_c, int kh, int kw, int stride, int pad) {
    conv2d_backward_input_impl<bf16_t>(dinp, dout, weight, make_conv_shape(batch, in_c, in_h, in_w, out_c, kh, kw, stride, pad));
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
conv2d_backward_input_f16(float* dinp, const f16_t* dout, const f16_t* weight, int batch, int in_c, int in_h,
                           int in_w, int out_c, int kh, int kw, int stride, int pad) {
    conv2d_backward_input_impl<f16_t>(dinp, dout, weight, make_conv_shape(batch, in_c, in_h, in_w, out_c, kh, kw, stride, pad));
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
conv2d_backward_weight_f32(float* dweight, float* partials, const float* dout, const float* inp, int batch, int in_c,
                           int in_h, int in_w, int out_c, int kh, int kw, int stride, int pad) {
    conv2d_backward_weight_impl<float>(dweight, partials, dout, inp,
                                       make_conv_shape(batch, in_c, in_h, in_w, out_c, kh, kw, stride, pad));
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
conv2d_backward_weight_bf16(float* dweight, float* partials, const bf16_t* dout, const bf16_t* inp, int batch,
                            int in_c, int in_h, int in_w, int out_c, int kh, int kw, int stride, int pad) {
    conv2d_backward_weight_impl<bf16_t>(dweight, partials, dout, inp,
                                        make_conv_shape(batch, in_c, in_h, in_w, out_c, kh, kw, stride, pad));
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
conv2d_backward_weight_f16(float* dweight, float* partials, const f16_t* dout, const f16_t* inp, int batch,
                            int in_c, int in_h, int in_w, int out_c, int kh, int kw, int stride, int pad) {
    conv2d_backward_weight_impl<f16_t>(dweight, partials, dout, inp,
                                        make_conv_shape(batch, in_c, in_h, in_w, out_c, kh, kw, stride, pad));
}

extern "C" __global__ void conv2d_backward_bias_f32(float* dbias, const float* dout, int batch, int out_c, int out_h,
                                                    int out_w) {
    conv2d_backward_bias_impl<float>(dbias, dout, batch, out_c, out_h, out_w);
}

extern "C" __global__ void conv2d_backward_bias_bf16(float* dbias, const bf16_t* dout, int batch, int out_c, int out_h,
                                                     int out_w) {
    conv2d_backward_bias_impl<bf16_t>(dbias, dout, batch, out_c, out_h, out_w);
}

extern "C" __global__ void conv2d_backward_bias_f16(float* dbias, const f16_t* dout, int batch, int out_c, int out_h,
                                                     int out_w) {
    conv2d_backward_bias_impl<f16_t>(dbias, dout, batch, out_c, out_h, out_w);
}
