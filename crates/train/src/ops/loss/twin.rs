//! CPU twins of `kernels/loss.cu`: fused softmax + cross-entropy, forward and backward.
//!
//! The conventions every twin follows are in the module documentation (`ops/twins.rs`).

/// Softmax + cross-entropy per row, the mean loss in `mean_loss[0]` and the number of rows whose
/// first maximum is the target in `correct[0]` (both overwritten).
#[allow(clippy::too_many_arguments)]
pub fn softmax_xent_forward_f32(
    losses: &mut [f32],
    probs: &mut [f32],
    mean_loss: &mut [f32],
    correct: &mut [i32],
    logits: &[f32],
    targets: &[i32],
    batch: i32,
    classes: i32,
) {
    let c = classes as usize;
    let (mut total, mut nc) = (0.0f64, 0i32);
    for b in 0..batch as usize {
        let z = &logits[b * c..(b + 1) * c];
        let (mut mx, mut am) = (f32::NEG_INFINITY, c);
        for (j, &v) in z.iter().enumerate() {
            if v > mx {
                mx = v;
                am = j;
            }
        }
        let s: f32 = z.iter().map(|&v| (v - mx).exp()).sum();
        let inv = 1.0 / s;
        for j in 0..c {
            probs[b * c + j] = (z[j] - mx).exp() * inv;
        }
        let t = targets[b] as usize;
        let l = s.ln() - (z[t] - mx);
        losses[b] = l;
        total += l as f64;
        nc += (am == t) as i32;
    }
    mean_loss[0] = if batch > 0 {
        (total / batch as f64) as f32
    } else {
        0.0
    };
    correct[0] = nc;
}

/// `dlogits = (probs - onehot(targets)) * (scale[0] / batch)` (overwritten): the loss-scaled
/// gradient of fp16 training.
pub fn softmax_xent_backward_scaled_f32(
    dlogits: &mut [f32],
    probs: &[f32],
    targets: &[i32],
    batch: i32,
    classes: i32,
    scale: &[f32],
) {
    let c = classes as usize;
    let k = scale[0] / batch as f32;
    for i in 0..batch as usize * c {
        let (b, j) = (i / c, i % c);
        dlogits[i] = (probs[i] - if j as i32 == targets[b] { 1.0 } else { 0.0 }) * k;
    }
}

/// `dlogits = (probs - onehot(targets)) / batch` (overwritten).
pub fn softmax_xent_backward_f32(
    dlogits: &mut [f32],
    probs: &[f32],
    targets: &[i32],
    batch: i32,
    classes: i32,
) {
    // A scale of 1 is exact: `1.0 / batch` is the factor either way.
    softmax_xent_backward_scaled_f32(dlogits, probs, targets, batch, classes, &[1.0]);
}
