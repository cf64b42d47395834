// linear.cu: fully connected layer (PyTorch nn.Linear: y = x · Wᵀ + b, W stored (out, in)) on
// the shared tiled GEMM core in common.cuh (tensor cores on sm_80+).
//
// CPU twins: crates/train/src/ops/linear/twin.rs (the CPU layer: ops/linear/mod.rs).
// Entry points (the twins take the same tensors in the same order):
//   linear_forward_{f32,bf16,f16}          (out, inp, weight, bias, batch, in_f, out_f, relu)
//   linear_backward_input_{f32,bf16,f16}   (dinp, dout, weight, batch, in_f, out_f)
//   linear_backward_weight_{f32,bf16,f16}  (dweight, partials, dout, inp, batch, in_f, out_f)
//   linear_backward_bias_{f32,bf16,f16}    (dbias, dout, batch, out_f)
// All sizes are int (Rust i32); relu is an int flag (0 = off, nonzero = fused ReLU).
//
// Layouts (row-major): inp (batch, in_f); weight (out_f, in_f); bias (out_f); out (batch, out_f).
//
// Gradient convention (llm.c): dinp is OVERWRITTEN; dweight and dbias are ACCUMULATED (+=).
//
// dtype: _f32 everywhere f32 (TF32 tensor cores on sm_80+ unless -DLOCKSTEP_NO_TF32). _bf16 takes
// bf16 operands (inp, weight, dout), accumulates in f32 and writes f32 outputs; bias is f32. _f16
// is the same with IEEE fp16 operands (--precision fp16, with dynamic loss scaling).
//
// Math:
//   forward:     y[b,o]  = bias[o] + Σ_i x[b,i] * W[o,i];  if relu: y = max(y, 0)
//                (bias may be NULL = no bias). With relu fused, the caller keeps y (post-ReLU)
//                and runs relu_backward_f32(dy_pre, y, dy) before the backward kernels, exactly
//                as for a separate ReLU layer (y > 0 ⇔ pre-activation > 0).
//   bwd input:   dx[b,i]  = Σ_o dy[b,o] * W[o,i]
//   bwd weight:  dW[o,i] += Σ_b dy[b,o] * x[b,i]
//   bwd bias:    db[o]   += Σ_b dy[b,o]
//
// As GEMMs (gemm_tile, C[M,N] = A[M,K]·B[K,N]):
//   forward:     M = batch, N = out_f, K = in_f,  A = x,   B = Wᵀ
//   bwd input:   M = batch, N = in_f,  K = out_f, A = dy,  B = W
//   bwd weight:  M = out_f, N = in_f,  K = batch, A = dyᵀ, B = x
//
// Launch geometry:
//   GEMM kernels: block GEMM_THREADS = 128, grid (ceil_div(N, 64), ceil_div(M, 64), splits).
//     backward_input: splits must be 1 (it overwrites).
//     backward_weight: splits >= 1 (split-K over the batch). splits = 1 adds into dweight
//       (`partials` unused, may be NULL); splits > 1 overwrites plane z of `partials` (splits
//       planes of out_f*in_f floats) and the caller runs splitk_reduce_f32(dweight, partials,
//       splits, out_f*in_f) next: no atomics, deterministic (see accumulate_out in common.cuh).
//     forward: splits = 1 is the normal, deterministic mode. splits > 1 is split-K for a small
//       output with a long K - the FashionMNIST fc1 (64 x 3136 -> 64) is a single 64x64 tile,
//       i.e. one block on one SM, so ~8-16 splits help. Then the caller must zero `out` first,
//       relu must be 0 (run relu_forward_f32 afterwards; relu != 0 traps), and the sums are
//       added with atomics, so the result is not bitwise reproducible run to run.
//     Any splits > 1 is useful only up to ceil_div(K, 32) (one 32-wide K chunk per slice).
//   linear_backward_bias_*: grid (ceil_div(out_f, 256)), block 256 - one thread per output
//     feature walking the batch, so reads are coalesced across o and the sum order is fixed.
#include "common.cuh"

// ----------------------------------------------------------------------------
// operand loaders

// Row-major matrix with leading dimension ld, element (r, c).
template <typename T>
struct RowMajor {
    const T* p;
    int ld;
    __device__ __forceinline__ T operator()(int r, int c) const { return p[(long long)r * ld + c]; }
};

// Transposed view: element (r, c) of Pᵀ where P is row-major with leading dimension ld.
template <typename T>
struct ColMajor {
    const T* p;
    int ld;
    __device__ __forceinline__ T operator()(int r, int c) const { return p[(long long)c * ld + r]; }
};

// ----------------------------------------------------------------------------
// epilogues

struct StoreLinearOut {
    float* y;
    const float* bias;
    int out_f;
    int relu;
    __device__ __forceinline__ void operator()(int b, int o, float v) const {
        // Split-K (see the header): slice 0 adds the bias, every slice adds its partial sum.
        if (gridDim.z > 1) {
            if (blockIdx.z == 0 && bias) v += bias[o];
            atomicAdd(&y[(long long)b * out_f + o], v);
            return;
        }
        v += bias ? bias[o] : 0.0f;
        if (relu) v = fmaxf(v, 0.0f);
        y[(long long)b * out_f + o] = v;
    }
};

struct StoreOverwrite {
    float* d;
    int ld;
    __device__ __forceinline__ void operator()(int r, int c, float v) const { d[(long long)r * ld + c] = v; }
};

struct StoreAccumulate {
    float* d;
    float* part;
    int ld;
    long long plane;
    __device__ __forceinline__ void operator()(int r, int c, float v) const {
        accumulate_out(d, part, plane, (long long)r * ld + c, v);
    }
};

// ----------------------------------------------------------------------------
// templated bodies

template <typename T>
__device__ __forceinline__ void linear_forward_impl(float* out, const T* inp, const T* weight, const float* bias,
                                                    int batch, int in_f, int out_f, int relu) {
    RowMajor<T> a{inp, in_f};        // x[b, i]: k = i contiguous
    ColMajor<T> b{weight, in_f};     // Wᵀ[i, o] = W[o, i]: k = i contiguous
    // A fused ReLU cannot be applied to split-K partial sums: fail the launch loudly (the error
    // surfaces at the next synchronisation) rather than return wrong activations.
    if (relu && gridDim.z > 1) __trap();
    StoreLinearOut st{out, bias, out_f, relu};
    gemm_tile<T, true, true>(batch, out_f, in_f, a, b, st);
}

template <typename T>
__device__ __forceinline__ void linear_backward_input_impl(float* dinp, const T* dout, const T* weight, int batch,
                                                           int in_f, int out_f) {
    RowMajor<T> a{dout, out_f};      // dy[b, o]: k = o contiguous
    RowMajor<T> b{weight, in_f};     // W[o, i]: n = i contiguous
    StoreOverwrite st{dinp, in_f};
    gemm_tile<T, true, false>(batch, in_f, out_f, a, b, st);
}

template <typename T>
__device__ __forceinline__ void linear_backward_weight_impl(float* dweight, float* partials, const T* dout, const T* inp,
                                                            int batch, int in_f, int out_f) {
    ColMajor<T> a{dout, out_f};      // dyᵀ[o, b] = dy[b, o]: m = o contiguous
    RowMajor<T> b{inp, in_f};        // x[b, i]: n = i contiguous
    StoreAccumulate st{dweight, partials, in_f, (long long)out_f * in_f};
    gemm_tile<T, false, false>(out_f, in_f, batch, a, b, st);
}

template <typename T>
__device__ __forceinline__ void linear_backward_bias_impl(float* dbias, const T* dout, int batch, int out_f) {
    const int o = blockIdx.x * blockDim.x + threadIdx.x;
    if (o >= out_f) return;
    float sum = 0.0f;
    for (int b = 0; b < batch; ++b) sum += to_f32(dout[(long long)b * out_f + o]);
    dbias[o] += sum;
}

// ----------------------------------------------------------------------------
// entry points

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
linear_forward_f32(float* out, const float* inp, const float* weight, const float* bias, int batch, int in_f,
                   int out_f, int relu) {
    linear_forward_impl<float>(out, inp, weight, bias, batch, in_f, out_f, relu);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
linear_forward_bf16(float* out, const bf16_t* inp, const bf16_t* weight, const float* bias, int batch, int in_f,
                    int out_f, int relu) {
    linear_forward_impl<bf16_t>(out, inp, weight, bias, batch, in_f, out_f, relu);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
linear_forward_f16(float* out, const f16_t* inp, const f16_t* weight, const float* bias, int batch, int in_f,
                    int out_f, int relu) {
    linear_forward_impl<f16_t>(out, inp, weight, bias, batch, in_f, out_f, relu);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
linear_backward_input_f32(float* dinp, const float* dout, const float* weight, int batch, int in_f, int out_f) {
    linear_backward_input_impl<float>(dinp, dout, weight, batch, in_f, out_f);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
linear_backward_input_bf16(float* dinp, const bf16_t* dout, const bf16_t* weight, int batch, int in_f, int out_f) {
    linear_backward_input_impl<bf16_t>(dinp, dout, weight, batch, in_f, out_f);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
linear_backward_input_f16(float* dinp, const f16_t* dout, const f16_t* weight, int batch, int in_f, int out_f) {
    linear_backward_input_impl<f16_t>(dinp, dout, weight, batch, in_f, out_f);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
linear_backward_weight_f32(float* dweight, float* partials, const float* dout, const float* inp, int batch, int in_f,
                          int out_f) {
    linear_backward_weight_impl<float>(dweight, partials, dout, inp, batch, in_f, out_f);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
linear_backward_weight_bf16(float* dweight, float* partials, const bf16_t* dout, const bf16_t* inp, int batch, int in_f,
                          int out_f) {
    linear_backward_weight_impl<bf16_t>(dweight, partials, dout, inp, batch, in_f, out_f);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
linear_backward_weight_f16(float* dweight, float* partials, const f16_t* dout, const f16_t* inp, int batch, int in_f,
                          int out_f) {
    linear_backward_weight_impl<f16_t>(dweight, partials, dout, inp, batch, in_f, out_f);
}

extern "C" __global__ void linear_backward_bias_f32(float* dbias, const float* dout, int batch, int out_f) {
    linear_backward_bias_impl<float>(dbias, dout, batch, out_f);
}

extern "C" __global__ void linear_backward_bias_bf16(float* dbias, const bf16_t* dout, int batch, int out_f) {
    linear_backward_bias_impl<bf16_t>(dbias, dout, batch, out_f);
}

extern "C" __global__ void linear_backward_bias_f16(float* dbias, const f16_t* dout, int batch, int out_f) {
    linear_backward_bias_impl<f16_t>(dbias, dout, batch, out_f);
}
