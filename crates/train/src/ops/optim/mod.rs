//! Optimizers over flat parameter and gradient vectors, with PyTorch's semantics.
//!
//! - [`Adam`]: `torch.optim.Adam` defaults (betas 0.9/0.999, eps 1e-8, L2 weight decay added to
//!   the gradient), with bias correction computed exactly as PyTorch's single-tensor path:
//!   `p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)`.
//! - [`Sgd`]: `torch.optim.SGD` with momentum, dampening, Nesterov and weight decay; the first
//!   step seeds the momentum buffer with the gradient, as PyTorch does.

pub mod twin;

/// Adam hyper-parameters other than the learning rate (PyTorch defaults).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamHyper {
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Denominator epsilon.
    pub eps: f32,
    /// L2 penalty.
    pub weight_decay: f32,
}

impl Default for AdamHyper {
    fn default() -> Self {
        AdamHyper {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

/// Adam optimizer state.
#[derive(Clone, Debug, PartialEq)]
pub struct Adam {
    /// Learning rate (overwritten by a schedule each step when one is used).
    pub lr: f32,
    /// Decay of the first moment.
    pub beta1: f32,
    /// Decay of the second moment.
    pub beta2: f32,
    /// Added to the denominator for stability.
    pub eps: f32,
    /// L2 penalty added to the gradient.
    pub weight_decay: f32,
    /// Steps taken.
    pub step: u64,
    /// First moments (`exp_avg`).
    pub m: Vec<f32>,
    /// Second moments (`exp_avg_sq`).
    pub v: Vec<f32>,
}

impl Adam {
    /// Adam for `n` parameters with PyTorch defaults and learning rate `lr`.
    pub fn new(n: usize, lr: f32) -> Adam {
        Adam {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            step: 0,
            m: vec![0.0; n],
            v: vec![0.0; n],
        }
    }

    /// One update of `params` from `grads`.
    pub fn step(&mut self, params: &mut [f32], grads: &[f32]) {
        self.step += 1;
        let t = self.step as i32;
        let bc1 = 1.0 - (self.beta1 as f64).powi(t);
        let bc2 = 1.0 - (self.beta2 as f64).powi(t);
        let step_size = (self.lr as f64 / bc1) as f32;
        let bc2_sqrt = bc2.sqrt() as f32;
        let (b1, b2, eps, wd) = (self.beta1, self.beta2, self.eps, self.weight_decay);
        for (((p, &g0), m), v) in params
            .iter_mut()
            .zip(grads)
            .zip(self.m.iter_mut())
            .zip(self.v.iter_mut())
        {
            let g = if wd != 0.0 { g0 + wd * *p } else { g0 };
            *m = flush(b1 * *m + (1.0 - b1) * g);
            *v = flush(b2 * *v + (1.0 - b2) * g * g);
            let denom = v.sqrt() / bc2_sqrt + eps;
            *p -= step_size * *m / denom;
        }
    }
}

/// `x`, or zero when it is subnormal (`|x| < f32::MIN_POSITIVE`).
///
/// Adam's moments of a parameter whose gradient has become zero (a unit that no longer fires)
/// decay by `beta1` every step and reach the subnormal range after some 700 steps; arithmetic on
/// subnormals takes a slow path on x86 (a microcode assist per operation), which made the whole
/// optimizer step 4-5× slower from the second epoch on. A subnormal moment moves its parameter by
/// less than `lr * 1.2e-38 / eps`, far below one ulp of any parameter, so flushing it to zero
/// changes nothing a model can see, and it is done explicitly (not through the FPU's
/// flush-to-zero mode) so that every rank, the CUDA kernel and its twin flush exactly alike.
#[inline(always)]
pub(crate) fn flush(x: f32) -> f32 {
    if x.abs() < f32::MIN_POSITIVE {
        0.0
    } else {
        x
    }
}

/// SGD with momentum and weight decay.
#[derive(Clone, Debug, PartialEq)]
pub struct Sgd {
    /// Learning rate.
    pub lr: f32,
    /// Momentum factor (0 disables the buffer).
    pub momentum: f32,
    /// Dampening of the gradient added to the buffer.
    pub dampening: f32,
    /// L2 penalty added to the gradient.
    pub weight_decay: f32,
    /// Use Nesterov momentum.
    pub nesterov: bool,
    /// Momentum buffer; empty until the first step.
    pub buf: Vec<f32>,
}

impl Sgd {
    /// SGD with learning rate `lr` and `momentum`.
    pub fn new(lr: f32, momentum: f32, weight_decay: f32) -> Sgd {
        Sgd {
            lr,
            momentum,
            dampening: 0.0,
            weight_decay,
            nesterov: false,
            buf: Vec::new(),
        }
    }

    /// One update of `params` from `grads`.
    pub fn step(&mut self, params: &mut [f32], grads: &[f32]) {
        let first = self.buf.is_empty();
        if first && self.momentum != 0.0 {
            self.buf = vec![0.0; params.len()];
        }
        for (i, (p, &g0)) in params.iter_mut().zip(grads).enumerate() {
            let mut g = g0 + self.weight_decay * *p;
            if self.momentum != 0.0 {
                let b = &mut self.buf[i];
                *b = if first {
                    g
                } else {
                    self.momentum * *b + (1.0 - self.dampening) * g
                };
                g = if self.nesterov {
                    g + self.momentum * *b
                } else {
                    *b
                };
            }
            *p -= self.lr * g;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two Adam steps on p = 1.0 with gradients 0.5 then -0.25, lr 0.1, worked by hand:
    /// step 1: m = 0.05, v = 0.00025, bc1 = 0.1, bc2 = 0.001,
    ///         p = 1 - (0.1/0.1) * 0.05 / (sqrt(0.00025)/sqrt(0.001) + 1e-8) = 1 - 0.1 = 0.9
    /// step 2: m = 0.045 - 0.025 = 0.02, v = 0.00024975 + 0.0000625 = 0.00031225,
    ///         bc1 = 0.19, bc2 = 0.001999, p = 0.9 - (0.1/0.19) * 0.02 / (sqrt(0.00031225/0.001999) + 1e-8)
    #[test]
    fn adam_matches_pytorch_by_hand() {
        let mut a = Adam::new(1, 0.1);
        let mut p = [1.0f32];
        a.step(&mut p, &[0.5]);
        assert!((p[0] - 0.9).abs() < 1e-6, "{}", p[0]);
        a.step(&mut p, &[-0.25]);
        let expect = 0.9 - (0.1 / 0.19) * 0.02 / ((0.00031225f64 / 0.001999).sqrt() + 1e-8);
        assert!((p[0] as f64 - expect).abs() < 1e-6, "{} vs {expect}", p[0]);
        assert_eq!(a.step, 2);
    }

    #[test]
    fn sgd_momentum_and_weight_decay() {
        let mut s = Sgd::new(0.1, 0.9, 0.01);
        let mut p = [1.0f32];
        s.step(&mut p, &[0.5]); // g = 0.51, buf = 0.51, p = 1 - 0.051
        assert!((p[0] - 0.949).abs() < 1e-6);
        s.step(&mut p, &[0.5]); // g = 0.5 + 0.00949, buf = 0.9*0.51 + g
        let g = 0.5 + 0.01 * 0.949;
        let expect = 0.949 - 0.1 * (0.9 * 0.51 + g);
        assert!((p[0] - expect).abs() < 1e-6);
    }

    /// A parameter whose gradient stops: its first moment decays by beta1 per step and would
    /// turn subnormal after about 700 steps. With the flush no moment is ever subnormal, the
    /// moment ends at exactly zero, and the parameter takes the same bits at every step as
    /// unflushed Adam (worked here in plain f32, as the loop did before the flush).
    #[test]
    fn adam_flushes_subnormal_moments_without_moving_parameters() {
        let mut a = Adam::new(3, 0.005);
        let mut p = [0.3f32, -0.02, 1.5];
        let (mut q, mut m, mut v) = (p, [0.0f32; 3], [0.0f32; 3]);
        let mut unflushed_went_subnormal = false;
        for t in 1..=1500u64 {
            let g = if t <= 5 {
                [1e-3f32, -2e-4, 0.1]
            } else {
                [0.0, 0.0, 1e-3]
            };
            a.step(&mut p, &g);
            let bc1 = 1.0 - (0.9f32 as f64).powi(t as i32);
            let bc2 = 1.0 - (0.999f32 as f64).powi(t as i32);
            let (ss, bs) = ((0.005f64 / bc1) as f32, bc2.sqrt() as f32);
            for i in 0..3 {
                m[i] = 0.9 * m[i] + (1.0 - 0.9) * g[i];
                v[i] = 0.999 * v[i] + (1.0 - 0.999) * g[i] * g[i];
                q[i] -= ss * m[i] / (v[i].sqrt() / bs + 1e-8);
                unflushed_went_subnormal |= m[i].is_subnormal();
            }
            assert!(
                a.m.iter().chain(&a.v).all(|x| !x.is_subnormal()),
                "step {t}: a subnormal moment"
            );
            assert_eq!(
                p.map(f32::to_bits),
                q.map(f32::to_bits),
                "step {t}: parameters moved differently"
            );
        }
        assert!(
            unflushed_went_subnormal,
            "the case must reach the subnormal range unflushed"
        );
        assert_eq!((a.m[0], a.m[1]), (0.0, 0.0));
        assert!(
            a.v[0] > 0.0,
            "the second moment decays more slowly and stays normal"
        );
    }
}
