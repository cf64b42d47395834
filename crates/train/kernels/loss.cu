// loss.cu: fused softmax + cross-entropy over logits (batch, classes), mean reduction, like
// F.cross_entropy(logits, targets) - plus the correct-prediction count for accuracy.
//
// CPU twins: crates/train/src/ops/loss/twin.rs
// (the CPU layer: ops::loss::SoftmaxCrossEntropy).
// Entry points (the twins take the same tensors in the same order):
//   softmax_xent_forward_f32 (losses, probs, mean_loss, correct, logits, targets, batch, classes)
//   softmax_xent_backward_f32(dlogits, probs, targets, batch, classes)
//   softmax_xent_backward_scaled_f32(dlogits, probs, targets, batch, classes, scale)
// batch, classes are int (Rust i32); targets are int32 class indices in [0, classes) (the
// device labels written by gather_batch_f32).
//
// Math, per row b with z = logits[b, :], t = targets[b], mx = max z:
//   probs[b,j]  = exp(z_j - mx) / S,   S = Σ_j exp(z_j - mx)
//   losses[b]   = log S - (z_t - mx)                  (= -log probs[b,t], without the log of a rounded p)
//   mean_loss[0] = Σ_b losses[b] / batch              (OVERWRITTEN, one float)
//   correct[0]   = #{b : argmax_j z_j == t}           (OVERWRITTEN, one int; first max wins ties)
//   backward: dlogits[b,j] = (probs[b,j] - [j == t]) / batch        (OVERWRITTEN)
//   backward_scaled: dlogits[b,j] = (probs[b,j] - [j == t]) * (scale[0] / batch)  (OVERWRITTEN)
// The backward gradient is that of the *mean* loss; data-parallel averaging over ranks is done
// by the gradient all-reduce, not here. The scaled variant is fp16 training's loss scaling
// (GradScaler's `scale(loss).backward()`) folded into the first gradient: `scale` is a device
// pointer to the current loss scale, so a captured CUDA graph reads the value of the step it
// replays in, and the host changes the scale without recapturing.
//
// Launch geometry:
//   forward: grid (1), block 256 (any multiple of 32 up to 1024). One warp per row, rows strided
//     by warp count, then one block reduction: a single block makes the mean and the count
//     deterministic without atomics or a second launch, and at batch 64 x 10 classes one block
//     is plenty (a 10 000-row eval batch is still only ~40 rows per warp).
//   backward (both): elementwise, block 256, grid ceil_div(batch*classes, 256) (grid-stride).
#include "common.cuh"

// ----------------------------------------------------------------------------
// forward

extern "C" __global__ void softmax_xent_forward_f32(float* losses, float* probs, float* mean_loss, int* correct,
                                                    const float* logits, const int* targets, int batch,
                                                    int classes) {
    __shared__ float fscratch[32];
    __shared__ int iscratch[32];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int nwarps = blockDim.x / WARP_SIZE;
    float loss_acc = 0.0f;  // per-lane partial sums; only lane 0 of each warp adds to them
    int correct_acc = 0;
    for (int b = warp; b < batch; b += nwarps) {
        const float* z = logits + (long long)b * classes;
        float* pr = probs + (long long)b * classes;
        // Max and argmax in one sweep: each lane keeps its first max, then the warp keeps the
        // smallest index among equal maxima.
        float mx = -lockstep_inf();
        int am = classes;
        for (int j = lane; j < classes; j += WARP_SIZE) {
            const float v = z[j];
            if (v > mx) { mx = v; am = j; }
        }
        for (int o = WARP_SIZE / 2; o > 0; o >>= 1) {
            const float omx = __shfl_xor_sync(0xffffffffu, mx, o);
            const int oam = __shfl_xor_sync(0xffffffffu, am, o);
            if (omx > mx || (omx == mx && oam < am)) { mx = omx; am = oam; }
        }
        float s = 0.0f;
        for (int j = lane; j < classes; j += WARP_SIZE) s += expf(z[j] - mx);
        s = warp_reduce_sum(s);
        const float inv = 1.0f / s;
        for (int j = lane; j < classes; j += WARP_SIZE) pr[j] = expf(z[j] - mx) * inv;
        if (lane == 0) {
            const int t = targets[b];
            const float l = logf(s) - (z[t] - mx);
            losses[b] = l;
            loss_acc += l;
            correct_acc += (am == t) ? 1 : 0;
        }
    }
    const float total = block_reduce_sum(loss_acc, fscratch);
    const int nc = block_reduce_sum_int(correct_acc, iscratch);
    if (threadIdx.x == 0) {
        mean_loss[0] = batch > 0 ? total / (float)batch : 0.0f;
        correct[0] = nc;
    }
}

// ----------------------------------------------------------------------------
// backward

extern "C" __global__ void softmax_xent_backward_f32(float* dlogits, const float* probs, const int* targets, int batch,
                                                     int classes) {
    const int total = batch * classes;
    const float inv_b = 1.0f / (float)batch;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const int b = i / classes, j = i - b * classes;
        dlogits[i] = (probs[i] - (j == targets[b] ? 1.0f : 0.0f)) * inv_b;
    }
}

extern "C" __global__ void softmax_xent_backward_scaled_f32(float* dlogits, const float* probs, const int* targets,
                                                            int batch, int classes, const float* scale) {
    const int total = batch * classes;
    // One factor, so the result is (p - y) rounded once by the multiplication: with the scale a
    // power of two (the loss scaler's), it equals the unscaled kernel's value times the scale
    // exactly, unless the product leaves f32's range.
    const float k = scale[0] / (float)batch;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const int b = i / classes, j = i - b * classes;
        dlogits[i] = (probs[i] - (j == targets[b] ? 1.0f : 0.0f)) * k;
    }
}
