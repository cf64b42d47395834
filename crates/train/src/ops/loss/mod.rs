//! Fused softmax + cross-entropy (mean over the batch), like `F.cross_entropy`.
//!
//! Forward keeps the probabilities; backward is `dlogits = (probs - onehot(target)) / N`.

pub mod twin;

use crate::tensor::Tensor;

/// Softmax cross-entropy with its saved probabilities.
#[derive(Clone, Debug, Default)]
pub struct SoftmaxCrossEntropy {
    probs: Vec<f32>, // (N, C)
}

impl SoftmaxCrossEntropy {
    /// Mean loss of `logits[N, C]` against `targets` (class indices < C).
    pub fn forward(&mut self, logits: &Tensor, targets: &[u8]) -> f32 {
        let (n, c) = (logits.dims()[0], logits.dims()[1]);
        self.probs.resize(n * c, 0.0);
        let mut total = 0.0f64;
        for (i, (row, pr)) in logits
            .data()
            .chunks_exact(c)
            .zip(self.probs.chunks_exact_mut(c))
            .enumerate()
        {
            // Subtract the max before exp so large logits cannot overflow.
            let mx = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let mut s = 0.0f32;
            for (p, &z) in pr.iter_mut().zip(row) {
                *p = (z - mx).exp();
                s += *p;
            }
            let inv = 1.0 / s;
            pr.iter_mut().for_each(|p| *p *= inv);
            let t = targets[i] as usize;
            total += (s.ln() - (row[t] - mx)) as f64;
        }
        (total / n.max(1) as f64) as f32
    }

    /// `dlogits = (probs - onehot) / N` (overwrites).
    pub fn backward(&self, dlogits: &mut Tensor, logits_dims: &[usize], targets: &[u8]) {
        let (n, c) = (logits_dims[0], logits_dims[1]);
        dlogits.resize(logits_dims);
        let inv_n = 1.0 / n as f32;
        for (i, (d, p)) in dlogits
            .data_mut()
            .chunks_exact_mut(c)
            .zip(self.probs.chunks_exact(c))
            .enumerate()
        {
            for (j, (dv, &pv)) in d.iter_mut().zip(p).enumerate() {
                *dv = (pv - if j == targets[i] as usize { 1.0 } else { 0.0 }) * inv_n;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn loss_gradcheck() {
        let mut rng = Rng::new(1, 2);
        let dims = [4, 5];
        let mut logits =
            Tensor::from_vec(&dims, (0..20).map(|_| rng.uniform(-3.0, 3.0)).collect()).unwrap();
        let targets = [0u8, 4, 2, 2];
        let mut ce = SoftmaxCrossEntropy::default();
        ce.forward(&logits, &targets);
        let mut d = Tensor::default();
        ce.backward(&mut d, &dims, &targets);
        let h = 1e-2;
        for i in 0..20 {
            let o = logits.data()[i];
            logits.data_mut()[i] = o + h;
            let lp = ce.forward(&logits, &targets) as f64;
            logits.data_mut()[i] = o - h;
            let lm = ce.forward(&logits, &targets) as f64;
            logits.data_mut()[i] = o;
            let num = (lp - lm) / (2.0 * h as f64);
            assert!(
                (num - d.data()[i] as f64).abs() < 1e-3,
                "dlogits[{i}]: numeric {num} vs analytic {}",
                d.data()[i]
            );
        }
        // Uniform logits give ln(C).
        let z = Tensor::zeros(&[1, 10]);
        assert!((ce.forward(&z, &[3]) - 10f32.ln()).abs() < 1e-6);
    }
}
