// optim.cu: fused optimizer steps over ONE flat parameter buffer (every parameter tensor of
// the model laid end to end), its flat gradient buffer and flat state buffers: one launch per
// step, whatever the number of tensors ("multi-tensor" by construction).
//
// Entry points (CPU twins: train::optim::Adam::step / Sgd::step, same math, same order):
//   adam_step_f32(params, grads, m, v, n, lr, beta1, beta2, eps, weight_decay, step)
//   sgd_step_f32 (params, grads, buf, n, lr, momentum, dampening, weight_decay, nesterov, first)
//   amp_unscale_f32(grads, found_inf, scale, n)
// n, step, nesterov (0/1), first (0/1) are int (Rust i32); the rest f32.
//
// Adam (torch.optim.Adam, L2 weight decay added to the gradient, not AdamW), step t >= 1 is the
// 1-based count *including* this step:
//   g = grad + weight_decay * p
//   m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g²
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
// Launch geometry: block 256, grid ceil_div(n, 256) or capped (grid-stride). Purely elementwise,
// so the result is bit-identical across ranks given identical inputs - ranks stay in lockstep.
#include "common.cuh"

// ----------------------------------------------------------------------------
// Adam

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
        const float mi = beta1 * m[i] + (1.0f - beta1) * g;
        const float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
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
