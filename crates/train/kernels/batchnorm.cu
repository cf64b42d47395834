// batchnorm.cu: BatchNorm2d over NCHW f32 (PyTorch nn.BatchNorm2d, affine, track_running_stats),
// with an optional fused ReLU after the affine transform.
//
// CPU twins: crates/train/src/ops/batchnorm/twin.rs (the CPU layer: ops/batchnorm/mod.rs).
// Entry points (the twins take the same tensors in the same order):
//   batchnorm2d_forward_train_f32(out, save_mean, save_invstd, running_mean, running_var,
//                                 inp, weight, bias, batch, channels, hw, momentum, eps, relu)
//   batchnorm2d_forward_eval_f32 (out, inp, weight, bias, running_mean, running_var,
//                                 batch, channels, hw, eps, relu)
//   batchnorm2d_backward_f32     (dinp, dweight, dbias, dout, inp, out, weight,
//                                 save_mean, save_invstd, batch, channels, hw, relu)
// batch, channels, hw = H*W and relu (0/1 flag) are int (Rust i32); momentum, eps are f32.
//
// Layouts: inp, out, dinp, dout (batch, channels, H, W); every per-channel vector (channels).
//
// Math, per channel c, with cnt = batch*hw and x ranging over the cnt values of channel c:
//   train forward:  mean = Σx / cnt;  var = Σ(x - mean)² / cnt          (biased, two passes)
//                   invstd = 1 / sqrt(var + eps)
//                   y = (x - mean) * invstd * weight[c] + bias[c];  if relu: y = max(y, 0)
//                   save_mean[c] = mean;  save_invstd[c] = invstd       (overwritten)
//                   running_mean = (1 - momentum) * running_mean + momentum * mean
//                   running_var  = (1 - momentum) * running_var + momentum * var * cnt/(cnt-1)
//                   (unbiased for the running estimate, as PyTorch; cnt = 1 uses var itself)
//   eval forward:   y = (x - running_mean) / sqrt(running_var + eps) * weight + bias (+ relu)
//   backward:       g = relu ? (out > 0 ? dout : 0) : dout         (out = saved forward output)
//                   xhat = (x - save_mean) * save_invstd
//                   dbias[c]   += Σ g;   dweight[c] += Σ g * xhat      (ACCUMULATED)
//                   dinp = weight * invstd / cnt * (cnt*g - Σg - xhat * Σ(g*xhat))  (OVERWRITTEN)
//
// Launch geometry:
//   forward_train, backward: grid (channels), one block per channel, block 256 (any multiple of
//     32 up to 1024). A block owns a whole channel, so the statistics need no atomics and the
//     reduction order is fixed (deterministic). At batch 64 the channels are 64*784 and 64*196
//     values, a few hundred per thread: well within one block.
//   forward_eval: elementwise, grid (ceil_div(batch*channels*hw, 256)), block 256; grid-stride,
//     so a capped grid is fine.
//
// FMA contraction (NVRTC's default -fmad=true, kept for speed): shift = bias - mean*scale,
// y = x*scale + shift, the eval y = t*weight + bias and the backward g - mg - xhat*mgx each
// compile to one fused multiply-add. The CPU twins (ops/batchnorm/twin.rs) use f32::mul_add
// for exactly these, so the fused ReLU's mask (y > 0) does not flip on a rounding difference.
#include "common.cuh"

// ----------------------------------------------------------------------------
// per-channel iteration: channel c of sample n is the contiguous run inp[(n*C + c)*hw, +hw)

extern "C" __global__ void batchnorm2d_forward_train_f32(float* out, float* save_mean, float* save_invstd,
                                                         float* running_mean, float* running_var, const float* inp,
                                                         const float* weight, const float* bias, int batch,
                                                         int channels, int hw, float momentum, float eps, int relu) {
    __shared__ float scratch[32];
    const int c = blockIdx.x;
    const int cnt = batch * hw;

    // Pass 1: mean. Two passes instead of Σx² - (Σx)²/n, which cancels badly when |mean| >> std.
    const float mean = block_reduce_sum(channel_partial_sum(inp, batch, channels, c, hw), scratch) / (float)cnt;

    // Pass 2: biased variance around that mean.
    float q = 0.0f;
    for (int n = 0; n < batch; ++n) {
        const float* row = inp + ((long long)n * channels + c) * hw;
        for (int p = threadIdx.x; p < hw; p += blockDim.x) {
            const float d = row[p] - mean;
            q += d * d;
        }
    }
    const float var = block_reduce_sum(q, scratch) / (float)cnt;
    const float invstd = 1.0f / sqrtf(var + eps);

    if (threadIdx.x == 0) {
        save_mean[c] = mean;
        save_invstd[c] = invstd;
        const float unbiased = cnt > 1 ? var * (float)cnt / (float)(cnt - 1) : var;
        running_mean[c] = (1.0f - momentum) * running_mean[c] + momentum * mean;
        running_var[c] = (1.0f - momentum) * running_var[c] + momentum * unbiased;
    }

    // Normalise with the affine folded into one scale and shift per channel.
    const float scale = invstd * weight[c];
    const float shift = bias[c] - mean * scale;
    for (int n = 0; n < batch; ++n) {
        const long long base = ((long long)n * channels + c) * hw;
        for (int p = threadIdx.x; p < hw; p += blockDim.x) {
            float y = inp[base + p] * scale + shift;
            if (relu) y = fmaxf(y, 0.0f);
            out[base + p] = y;
        }
    }
}

// ----------------------------------------------------------------------------
// eval: running statistics, elementwise

extern "C" __global__ void batchnorm2d_forward_eval_f32(float* out, const float* inp, const float* weight,
                                                        const float* bias, const float* running_mean,
                                                        const float* running_var, int batch, int channels, int hw,
                                                        float eps, int relu) {
    const long long total = (long long)batch * channels * hw;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int c = (int)((i / hw) % channels);
        const float invstd = 1.0f / sqrtf(running_var[c] + eps);
        float y = (inp[i] - running_mean[c]) * invstd * weight[c] + bias[c];
        if (relu) y = fmaxf(y, 0.0f);
        out[i] = y;
    }
}

// ----------------------------------------------------------------------------
// backward

extern "C" __global__ void batchnorm2d_backward_f32(float* dinp, float* dweight, float* dbias, const float* dout,
                                                    const float* inp, const float* out, const float* weight,
                                                    const float* save_mean, const float* save_invstd, int batch,
                                                    int channels, int hw, int relu) {
    __shared__ float scratch[32];
    const int c = blockIdx.x;
    const int cnt = batch * hw;
    const float mean = save_mean[c], invstd = save_invstd[c];

    // Pass 1: Σg and Σ g*xhat (g = dout masked by the fused ReLU; out may be NULL when relu = 0).
    float sg = 0.0f, sgx = 0.0f;
    for (int n = 0; n < batch; ++n) {
        const long long base = ((long long)n * channels + c) * hw;
        for (int p = threadIdx.x; p < hw; p += blockDim.x) {
            float g = dout[base + p];
            if (relu && !(out[base + p] > 0.0f)) g = 0.0f;
            sg += g;
            sgx += g * (inp[base + p] - mean) * invstd;
        }
    }
    sg = block_reduce_sum(sg, scratch);
    sgx = block_reduce_sum(sgx, scratch);
    if (threadIdx.x == 0) {
        dbias[c] += sg;
        dweight[c] += sgx;
    }

    // Pass 2: dinp = w*invstd*(g - Σg/cnt - xhat*Σ(g*xhat)/cnt).
    const float k = weight[c] * invstd;
    const float mg = sg / (float)cnt, mgx = sgx / (float)cnt;
    for (int n = 0; n < batch; ++n) {
        const long long base = ((long long)n * channels + c) * hw;
        for (int p = threadIdx.x; p < hw; p += blockDim.x) {
            float g = dout[base + p];
            if (relu && !(out[base + p] > 0.0f)) g = 0.0f;
            const float xhat = (inp[base + p] - mean) * invstd;
            dinp[base + p] = k * (g - mg - xhat * mgx);
        }
    }
}
