//! Learning-rate schedules, evaluated from the step number so a resumed run gets the same rate.

/// A learning-rate schedule over `total` optimizer steps.
#[derive(Clone, Debug, PartialEq)]
pub enum Schedule {
    /// The base rate throughout.
    Constant,
    /// Cosine annealing from the base rate to `min_lr` over `total` steps (`CosineAnnealingLR`
    /// with `T_max = total`).
    Cosine {
        /// Steps to anneal over.
        total: u64,
        /// Final rate.
        min_lr: f32,
    },
    /// `OneCycleLR` with cosine annealing: warm up from `max/div` to `max` over `pct_start` of
    /// the steps, then anneal to `max/(div*final_div)`.
    OneCycle {
        /// Total steps.
        total: u64,
        /// Fraction of steps spent warming up (PyTorch 0.3).
        pct_start: f32,
        /// `initial = max / div` (PyTorch 25).
        div: f32,
        /// `final = initial / final_div` (PyTorch 1e4).
        final_div: f32,
    },
}

fn cos_anneal(start: f64, end: f64, frac: f64) -> f64 {
    end + (start - end) / 2.0 * (1.0 + (std::f64::consts::PI * frac.clamp(0.0, 1.0)).cos())
}

impl Schedule {
    /// Rate for optimizer step `step` (0-based) given the base (or maximum) rate.
    pub fn lr(&self, base: f32, step: u64) -> f32 {
        match *self {
            Schedule::Constant => base,
            Schedule::Cosine { total, min_lr } => cos_anneal(
                base as f64,
                min_lr as f64,
                step as f64 / total.max(1) as f64,
            ) as f32,
            Schedule::OneCycle {
                total,
                pct_start,
                div,
                final_div,
            } => {
                let initial = base as f64 / div as f64;
                let fin = initial / final_div as f64;
                // PyTorch's phase ends: warm-up ends at pct*total - 1, annealing at total - 1.
                let up_end = (pct_start as f64 * total as f64 - 1.0).max(0.0);
                let end = (total as f64 - 1.0).max(up_end + 1.0);
                let s = step as f64;
                if s <= up_end {
                    cos_anneal(
                        initial,
                        base as f64,
                        if up_end > 0.0 { s / up_end } else { 1.0 },
                    ) as f32
                } else {
                    cos_anneal(base as f64, fin, (s - up_end) / (end - up_end)) as f32
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules_hit_their_ends() {
        assert_eq!(Schedule::Constant.lr(0.1, 77), 0.1);
        let c = Schedule::Cosine {
            total: 100,
            min_lr: 0.0,
        };
        assert!((c.lr(1.0, 0) - 1.0).abs() < 1e-6);
        assert!((c.lr(1.0, 50) - 0.5).abs() < 1e-6);
        assert!(c.lr(1.0, 100).abs() < 1e-6);
        let o = Schedule::OneCycle {
            total: 100,
            pct_start: 0.3,
            div: 25.0,
            final_div: 1e4,
        };
        assert!((o.lr(1.0, 0) - 0.04).abs() < 1e-6);
        assert!((o.lr(1.0, 29) - 1.0).abs() < 1e-6);
        assert!((o.lr(1.0, 99) - 0.04e-4).abs() < 1e-8);
    }
}
