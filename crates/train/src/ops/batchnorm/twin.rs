//! CPU twins of `kernels/batchnorm.cu`: BatchNorm2d forward (train and eval) and backward, with
//! the optional fused ReLU; `f32::mul_add` where the kernel contracts to one fused multiply-add.
//!
//! The conventions every twin follows are in the module documentation (`ops/twins.rs`); the
//! kernels' scalar arguments arrive as one [`Bn2dShape`].

use super::Bn2dShape;

/// The per-channel statistics the training forward writes: the batch mean and 1/std saved for
/// backward, and the running estimates it updates (`(C)` each).
#[derive(Debug)]
pub struct BnStats<'a> {
    /// Batch mean, saved for backward.
    pub save_mean: &'a mut [f32],
    /// Batch 1/std, saved for backward.
    pub save_invstd: &'a mut [f32],
    /// Running mean, updated.
    pub running_mean: &'a mut [f32],
    /// Running (unbiased) variance, updated.
    pub running_var: &'a mut [f32],
}

/// Training-mode BatchNorm2d: batch statistics (biased variance, two passes), saved mean and
/// 1/std, running estimates updated with the unbiased variance, optional fused ReLU.
pub fn batchnorm2d_forward_train_f32(
    out: &mut [f32],
    stats: BnStats<'_>,
    inp: &[f32],
    weight: &[f32],
    bias: &[f32],
    shape: Bn2dShape,
) {
    let (n, c, hw) = shape.dims();
    let (momentum, eps) = (shape.momentum, shape.eps);
    let BnStats {
        save_mean,
        save_invstd,
        running_mean,
        running_var,
    } = stats;
    let cnt = n * hw;
    for ch in 0..c {
        let plane = |b: usize| (b * c + ch) * hw..(b * c + ch + 1) * hw;
        let s: f64 = (0..n)
            .map(|b| inp[plane(b)].iter().map(|&x| x as f64).sum::<f64>())
            .sum();
        let mean = (s / cnt as f64) as f32;
        let q: f64 = (0..n)
            .map(|b| {
                inp[plane(b)]
                    .iter()
                    .map(|&x| ((x - mean) as f64).powi(2))
                    .sum::<f64>()
            })
            .sum();
        let var = (q / cnt as f64) as f32;
        let invstd = 1.0 / (var + eps).sqrt();
        save_mean[ch] = mean;
        save_invstd[ch] = invstd;
        let unbiased = if cnt > 1 {
            var * cnt as f32 / (cnt - 1) as f32
        } else {
            var
        };
        running_mean[ch] = (1.0 - momentum) * running_mean[ch] + momentum * mean;
        running_var[ch] = (1.0 - momentum) * running_var[ch] + momentum * unbiased;
        let scale = invstd * weight[ch];
        // FMA contraction as the kernel gets it (see the module docs): `bias - mean * scale` and
        // `x * scale + shift` are each one fused multiply-add on the GPU.
        let shift = (-mean).mul_add(scale, bias[ch]);
        for b in 0..n {
            for i in plane(b) {
                out[i] = shape.act(inp[i].mul_add(scale, shift));
            }
        }
    }
}

/// Evaluation-mode BatchNorm2d with the running statistics (optional fused ReLU).
pub fn batchnorm2d_forward_eval_f32(
    out: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    bias: &[f32],
    running_mean: &[f32],
    running_var: &[f32],
    shape: Bn2dShape,
) {
    let (n, c, hw) = shape.dims();
    for i in 0..n * c * hw {
        let ch = (i / hw) % c;
        let invstd = 1.0 / (running_var[ch] + shape.eps).sqrt();
        let y = ((inp[i] - running_mean[ch]) * invstd).mul_add(weight[ch], bias[ch]);
        out[i] = shape.act(y);
    }
}

/// BatchNorm2d backward: `dbias`, `dweight` accumulated, `dinp` overwritten; with the fused ReLU
/// the incoming gradient is masked by `out > 0` (`out`, the forward's output beside its input
/// `inp`, is unused and may be empty without it). `saved` is the forward's `(mean, invstd)`.
pub fn batchnorm2d_backward_f32(
    dinp: &mut [f32],
    (dweight, dbias): (&mut [f32], &mut [f32]),
    dout: &[f32],
    (inp, out): (&[f32], &[f32]),
    weight: &[f32],
    (save_mean, save_invstd): (&[f32], &[f32]),
    shape: Bn2dShape,
) {
    let (n, c, hw) = shape.dims();
    let relu = shape.relu;
    let cnt = (n * hw) as f32;
    // `!(out > 0)`, not `out <= 0`: a NaN output masks its gradient, as in the kernel.
    #[allow(clippy::neg_cmp_op_on_partial_ord)]
    let g = |i: usize| {
        if relu && !(out[i] > 0.0) {
            0.0
        } else {
            dout[i]
        }
    };
    for ch in 0..c {
        let (mean, invstd) = (save_mean[ch], save_invstd[ch]);
        let plane = |b: usize| (b * c + ch) * hw..(b * c + ch + 1) * hw;
        let (mut sg, mut sgx) = (0.0f64, 0.0f64);
        for b in 0..n {
            for i in plane(b) {
                sg += g(i) as f64;
                sgx += (g(i) * (inp[i] - mean) * invstd) as f64;
            }
        }
        let (sg, sgx) = (sg as f32, sgx as f32);
        dbias[ch] += sg;
        dweight[ch] += sgx;
        let k = weight[ch] * invstd;
        let (mg, mgx) = (sg / cnt, sgx / cnt);
        for b in 0..n {
            for i in plane(b) {
                let xhat = (inp[i] - mean) * invstd;
                dinp[i] = k * (-xhat).mul_add(mgx, g(i) - mg);
            }
        }
    }
}
