// optim.cu: fused optimizer steps over ONE flat parameter buffer (every parameter tensor of
// the model laid end to end), its flat gradient buffer and flat state buffers: one launch per
// step, whatever the number of tensors ("multi-tensor" by construction).
//
// CPU twins: crates/train/src/ops/optim/twin.rs
// (the CPU optimizers: ops::optim::Adam::step / Sgd::step).
// Entry points (the twins do the same math in the same order):
//   adam_step_f32(params, grads, m, v, n, lr, beta1, beta2, eps, weight_decay, step)
//   sgd_step_f32 (params, grads, buf, n, lr, momentum, dampening, weight_decay, nesterov, first)
//   amp_unscale_f32(grads, found_inf, scale, n)
//   grad_norm_partials_f32(partials, grads, n, num_partials)
//   grad_norm_coef_f32(coef, norm, nonfinite_step, partials, num_partials, max_norm, step)
//   clip_grad_scale_f32(grads, coef, n)
// n, step, num_partials, nesterov (0/1), first (0/1) are int (Rust i32); the rest f32.
//
// Adam (torch.optim.Adam, L2 weight decay added to the gradient, not AdamW), step t >= 1 is the
// 1-based count *including* this step:
//   g = grad + weight_decay * p
//   m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g²
//   m, v = 0 where subnormal (|x| < FLT_MIN): explicit, as the CPU engine does (its x86 slow path
//          on subnormal moments, ops::optim::flush), so the bits agree on every device
//   bc1 = 1 - beta1^t;  bc2 = 1 - beta2^t       (computed in f64, as the CPU twin does)
//   p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
//
// SGD (torch.optim.SGD):
//   g = grad + weight_decay * p
//   if momentum != 0:  buf = first ? g : momentum * buf + (1 - dampening) * g
//                      g = nesterov ? g + momentum * buf : buf
//   p -= lr * g
// `first` = 1 on the first step seeds the buffer with g, as PyTorch does (buf may be NULL when
// momentum == 0).
//
// amp_unscale_f32 (fp16 loss scaling, torch's _amp_foreach_non_finite_check_and_unscale_):
//   grads[i] *= 1 / scale[0];  found_inf[0] = 1 if any grads[i] is inf or NaN (after unscaling)
// Runs on the gradients AFTER the all-reduce, so every rank sees the same values and reaches the
// same verdict. found_inf is not cleared here: the caller zeroes it before (fill_f32), and
// threads only ever store 1.0f into it, so the result does not depend on thread order. scale is
// a device pointer (the value the step's backward used).
//
// Gradient-norm clipping (torch.nn.utils.clip_grad_norm_; the CPU engine's
// train::trainer::clip_grad_norm): coefficient max_norm / (norm + 1e-6), applied only when below
// 1. Runs on the averaged gradients (after the fp16 unscale, and not at all on a step that
// overflowed), so every rank computes the same norm. Three launches, no atomics, every sum in a
// fixed order, so the norm is bit-identical run to run and rank to rank, and the CPU twins
// reproduce it bit for bit:
//   grad_norm_partials_f32   block CLIP_THREADS (256; anything else traps), any grid (grid-stride
//                            over the num_partials partials): thread t of partial k sums g² in f64
//                            over elements k*256 + t + j*num_partials*256 for j = 0, 1, ...; the
//                            256 thread sums are added by a fixed pairwise tree
//                            (s[t] += s[t + stride], stride 128, 64, ..., 1) and partial k is
//                            sqrt(that) as f32. A partial *norm*, not a sum of squares, so an f32
//                            partial overflows only for gradients near f32's own largest value.
//   grad_norm_coef_f32       one block of 256: total = sqrt(sum of partials[k]², f64, thread t
//                            summing k = t, t + 256, ..., then the same tree); coef[0] =
//                            max_norm / (total + 1e-6) when total is finite and that is below 1,
//                            else 1; norm[0] = total. A non-finite total (fp32/bf16 gradients
//                            that diverged) leaves coef at 1, as the CPU engine leaves such
//                            gradients alone, and records `step` in nonfinite_step[0] unless an
//                            earlier step is already there (0 = none): the host reads it once per
//                            epoch and stops, as the CPU engine stops at once.
//   clip_grad_scale_f32      grads[i] *= coef[0]: a step that needs no clipping multiplies by 1,
//                            which changes no bit. coef stays on the device: no read-back.
// g² of an f32 is exact in f64 (48 significant bits), so an FMA contraction of the accumulation
// rounds exactly as the separate multiply and add do.
//
// Launch geometry: block 256, grid ceil_div(n, 256) or capped (grid-stride). Purely elementwise,
// so the result is bit-identical across ranks given identical inputs - ranks stay in lockstep.
#include "common.cuh"

// ----------------------------------------------------------------------------
// Adam

// x, or 0 when x is subnormal (the twin: ops::optim::flush).
__device__ __forceinline__ float flush_subnormal(float x) { return fabsf(x) < 1.17549435e-38f ? 0.0f : x; }

extern "C" __global__ void adam_step_f32(float* params, const float* grads, float* m, float* v, int n, float lr,
                                         float beta1, float beta2, float eps, float weight_decay, int step) {
    // Bias corrections once per thread in f64 (pow in f32 loses digits of beta2^t near 1).
    const double bc1 = 1.0 - pow((double)beta1, (double)step);
    const double bc2 = 1.0 - pow((double)beta2, (double)step);
    const float step_size = (float)((double)lr / bc1);
    const float bc2_sqrt = (float)sqrt(bc2);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float p = params[i];
        float g = grads[i];
        if (weight_decay != 0.0f) g += weight_decay * p;
        const float mi = flush_subnormal(beta1 * m[i] + (1.0f - beta1) * g);
        const float vi = flush_subnormal(beta2 * v[i] + (1.0f - beta2) * g * g);
        m[i] = mi;
        v[i] = vi;
        const float denom = sqrtf(vi) / bc2_sqrt + eps;
        params[i] = p - step_size * mi / denom;
    }
}

// ----------------------------------------------------------------------------
// SGD

extern "C" __global__ void sgd_step_f32(float* params, const float* grads, float* buf, int n, float lr, float momentum,
                                        float dampening, float weight_decay, int nesterov, int first) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float p = params[i];
        float g = grads[i] + weight_decay * p;
        if (momentum != 0.0f) {
            const float b = first ? g : momentum * buf[i] + (1.0f - dampening) * g;
            buf[i] = b;
            g = nesterov ? g + momentum * b : b;
        }
        params[i] = p - lr * g;
    }
}

// ----------------------------------------------------------------------------
// loss-scale unscale and overflow check

extern "C" __global__ void amp_unscale_f32(float* grads, float* found_inf, const float* scale, int n) {
    const float inv = 1.0f / scale[0];
    bool bad = false;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float g = grads[i] * inv;
        grads[i] = g;
        // An all-ones exponent is inf or NaN; a bit test, so no compiler flag can fold it away.
        bad |= (__float_as_uint(g) & 0x7f800000u) == 0x7f800000u;
    }
    if (bad) found_inf[0] = 1.0f;
}

// ----------------------------------------------------------------------------
// gradient-norm clipping

#define CLIP_THREADS 256

// Sum of v over the block's CLIP_THREADS threads by the fixed pairwise tree the header describes;
// thread 0 gets the result. `s` is CLIP_THREADS doubles of shared memory; the trailing barrier
// lets the caller reuse it at once.
__device__ __forceinline__ double clip_tree_sum(double v, double* s) {
    s[threadIdx.x] = v;
    for (int stride = CLIP_THREADS / 2; stride > 0; stride >>= 1) {
        __syncthreads();
        if ((int)threadIdx.x < stride) s[threadIdx.x] += s[threadIdx.x + stride];
    }
    __syncthreads();
    return s[0];
}

extern "C" __global__ void __launch_bounds__(CLIP_THREADS) grad_norm_partials_f32(float* partials, const float* grads, int n,
                                                                                    int num_partials) {
    if (blockDim.x != CLIP_THREADS) __trap();
    __shared__ double s[CLIP_THREADS];
    const long long stride = (long long)num_partials * CLIP_THREADS;
    // Uniform over the block: every thread passes the same barriers.
    for (int k = blockIdx.x; k < num_partials; k += gridDim.x) {
        double acc = 0.0;
        for (long long i = (long long)k * CLIP_THREADS + threadIdx.x; i < n; i += stride) {
            const double g = (double)grads[i];
            acc += g * g;
        }
        const double total = clip_tree_sum(acc, s);
        if (threadIdx.x == 0) partials[k] = (float)sqrt(total);
    }
}

extern "C" __global__ void __launch_bounds__(CLIP_THREADS) grad_norm_coef_f32(float* coef, float* norm, int* nonfinite_step,
                                                                                const float* partials, int num_partials,
                                                                                float max_norm, int step) {
    if (blockDim.x != CLIP_THREADS || gridDim.x != 1) __trap();
    __shared__ double s[CLIP_THREADS];
    double acc = 0.0;
    for (int k = threadIdx.x; k < num_partials; k += CLIP_THREADS) {
        const double p = (double)partials[k];
        acc += p * p;
    }
    const double total = sqrt(clip_tree_sum(acc, s));
    if (threadIdx.x == 0) {
        // An all-ones exponent is inf or NaN (a bit test, as in amp_unscale_f32).
        const bool finite = (__double_as_longlong(total) & 0x7ff0000000000000LL) != 0x7ff0000000000000LL;
        const double c = (double)max_norm / (total + 1e-6);
        coef[0] = finite && c < 1.0 ? (float)c : 1.0f;
        norm[0] = (float)total;
        if (!finite && nonfinite_step[0] == 0) nonfinite_step[0] = step;
    }
}

extern "C" __global__ void clip_grad_scale_f32(float* grads, const float* coef, int n) {
    const float c = coef[0];
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) grads[i] *= c;
}
