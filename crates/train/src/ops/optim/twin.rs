//! CPU twins of `kernels/optim.cu`: the fused Adam and SGD steps, AMP unscaling and gradient
//! clipping by global norm (with the kernels' fixed reduction order).
//!
//! The conventions every twin follows are in the module documentation (`ops/twins.rs`).

use super::AdamHyper;

/// One Adam step (L2 weight decay added to the gradient; `step` is 1-based and includes this one)
/// on the parameters and their moments `(m, v)`; `h` holds the kernel's `beta1, beta2, eps,
/// weight_decay` arguments.
pub fn adam_step_f32(
    params: &mut [f32],
    grads: &[f32],
    (m, v): (&mut [f32], &mut [f32]),
    n: i32,
    lr: f32,
    h: &AdamHyper,
    step: i32,
) {
    let AdamHyper {
        beta1,
        beta2,
        eps,
        weight_decay,
    } = *h;
    let bc1 = 1.0 - (beta1 as f64).powf(step as f64);
    let bc2 = 1.0 - (beta2 as f64).powf(step as f64);
    let step_size = (lr as f64 / bc1) as f32;
    let bc2_sqrt = bc2.sqrt() as f32;
    for i in 0..n as usize {
        let p = params[i];
        let mut g = grads[i];
        if weight_decay != 0.0 {
            g += weight_decay * p;
        }
        let mi = crate::ops::optim::flush(beta1 * m[i] + (1.0 - beta1) * g);
        let vi = crate::ops::optim::flush(beta2 * v[i] + (1.0 - beta2) * g * g);
        m[i] = mi;
        v[i] = vi;
        let denom = vi.sqrt() / bc2_sqrt + eps;
        params[i] = p - step_size * mi / denom;
    }
}

/// `grads *= 1 / scale[0]`; `found_inf[0] = 1` when any unscaled gradient is inf or NaN (left
/// as it was otherwise: the step zeroes it first).
pub fn amp_unscale_f32(grads: &mut [f32], found_inf: &mut [f32], scale: &[f32], n: i32) {
    let inv = 1.0 / scale[0];
    let mut bad = false;
    for g in &mut grads[..n as usize] {
        *g *= inv;
        bad |= !g.is_finite();
    }
    if bad {
        found_inf[0] = 1.0;
    }
}

/// Threads per block of the clipping reductions (`CLIP_THREADS` in optim.cu): the width of their
/// fixed summation tree.
pub const CLIP_THREADS: usize = 256;

/// The kernels' pairwise tree over one block's thread sums (`clip_tree_sum` in optim.cu):
/// `s[t] += s[t + stride]` for stride 128, 64, ..., 1.
fn clip_tree_sum(mut s: [f64; CLIP_THREADS]) -> f64 {
    let mut stride = CLIP_THREADS / 2;
    while stride > 0 {
        for t in 0..stride {
            s[t] += s[t + stride];
        }
        stride /= 2;
    }
    s[0]
}

/// Partial gradient norms, in the kernel's exact order (so bit-identical to it): partial `k` is
/// `sqrt` of the tree sum over threads `t` of the f64 sums of `g²` over elements
/// `k*256 + t + j*num_partials*256`.
pub fn grad_norm_partials_f32(partials: &mut [f32], grads: &[f32], n: i32, num_partials: i32) {
    let (n, np) = (n.max(0) as usize, num_partials.max(0) as usize);
    for (k, out) in partials[..np].iter_mut().enumerate() {
        let mut s = [0.0f64; CLIP_THREADS];
        for (t, acc) in s.iter_mut().enumerate() {
            for &g in grads[..n]
                .iter()
                .skip(k * CLIP_THREADS + t)
                .step_by(np * CLIP_THREADS)
            {
                *acc += g as f64 * g as f64;
            }
        }
        *out = clip_tree_sum(s).sqrt() as f32;
    }
}

/// The clipping coefficient from the partial norms: `total = sqrt(Σ partials²)` (thread `t` sums
/// partials `t, t + 256, ...` in f64, then the tree); `coef[0] = max_norm / (total + 1e-6)` when
/// `total` is finite and that is below 1, else 1; `norm[0] = total`; a non-finite total records
/// `step` in `nonfinite_step[0]` unless it already holds an earlier one (non-zero).
pub fn grad_norm_coef_f32(
    coef: &mut [f32],
    norm: &mut [f32],
    nonfinite_step: &mut [i32],
    partials: &[f32],
    num_partials: i32,
    max_norm: f32,
    step: i32,
) {
    let mut s = [0.0f64; CLIP_THREADS];
    for (t, acc) in s.iter_mut().enumerate() {
        for &p in partials[..num_partials.max(0) as usize]
            .iter()
            .skip(t)
            .step_by(CLIP_THREADS)
        {
            *acc += p as f64 * p as f64;
        }
    }
    let total = clip_tree_sum(s).sqrt();
    let c = max_norm as f64 / (total + 1e-6);
    coef[0] = if total.is_finite() && c < 1.0 {
        c as f32
    } else {
        1.0
    };
    norm[0] = total as f32;
    if !total.is_finite() && nonfinite_step[0] == 0 {
        nonfinite_step[0] = step;
    }
}

/// `grads[i] *= coef[0]` (the clipping coefficient, 1 when no clipping is needed).
pub fn clip_grad_scale_f32(grads: &mut [f32], coef: &[f32], n: i32) {
    let c = coef[0];
    for g in &mut grads[..n.max(0) as usize] {
        *g *= c;
    }
}

/// One SGD step (momentum, dampening, Nesterov, L2 weight decay); `first != 0` seeds the buffer
/// with the gradient. `buf` may be empty when `momentum == 0`.
#[allow(clippy::too_many_arguments)]
pub fn sgd_step_f32(
    params: &mut [f32],
    grads: &[f32],
    buf: &mut [f32],
    n: i32,
    lr: f32,
    momentum: f32,
    dampening: f32,
    weight_decay: f32,
    nesterov: i32,
    first: i32,
) {
    for i in 0..n as usize {
        let p = params[i];
        let mut g = grads[i] + weight_decay * p;
        if momentum != 0.0 {
            let b = if first != 0 {
                g
            } else {
                momentum * buf[i] + (1.0 - dampening) * g
            };
            buf[i] = b;
            g = if nesterov != 0 { g + momentum * b } else { b };
        }
        params[i] = p - lr * g;
    }
}
