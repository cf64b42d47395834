//! Mixed precision: what a run asks for ([`MixedPrecision`], the `--precision` flag and the
//! config's `mixed_precision` key), what each engine can do with it, and dynamic loss scaling
//! ([`LossScaler`], the algorithm of `torch.cuda.amp.GradScaler` that Accelerate's fp16 mode uses).
//!
//! What runs where, never a silent fallback:
//!
//! | asked | CPU engine | CUDA engine |
//! |---|---|---|
//! | `no` (fp32) | fp32 | fp32 (TF32 tensor cores on sm_80+) |
//! | `bf16` | refused: the CPU GEMMs are fp32 only | bf16 operands, f32 accumulation, f32 master weights |
//! | `fp16` | refused: the CPU GEMMs are fp32 only | fp16 operands, f32 accumulation, f32 master weights, dynamic loss scaling |
//!
//! fp16 needs loss scaling because its range is small: gradients below 2^-24 flush to zero. The
//! loss is multiplied by a large scale before backward; the gradients are divided by it before
//! the optimizer; a step whose gradients overflowed (inf or NaN) is skipped and the scale halved,
//! and after `growth_interval` clean steps the scale doubles. [`LossScaler`] is that logic, kept
//! apart from any kernel so it is tested on its own. The CUDA engine drives it
//! (`device::Engine::train_step`): the scale lives in device memory and multiplies the loss
//! gradient inside the captured step; after the gradient all-reduce one kernel unscales the
//! gradients and raises an overflow flag, the host reads that one flag and calls
//! [`LossScaler::update`], and a skipped step changes no parameter and no optimizer state (Adam's
//! step count included). The check runs on the averaged gradients, so every rank decides alike.
//! A checkpoint stores the scaler's whole state ([`ScalerState`]), so `--resume` continues with
//! the same scale and growth count as an uninterrupted run.

/// The precision a run asks for, as Accelerate's `mixed_precision` names it: the config file's
/// type, so `--precision` and the file's key are one thing.
pub use lockstep::config::MixedPrecision;

/// A precision an engine cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PrecisionError {
    /// The CPU engine computes in fp32 only.
    #[error(
        "precision {0} on the CPU: the CPU engine computes in fp32 only (its GEMMs have no 16-bit operands), and lockstep does not silently train in fp32 instead; use precision no (fp32) on the CPU, or --device cuda for bf16 or fp16"
    )]
    CpuFp32Only(MixedPrecision),
    /// Loss-scaler settings that cannot work.
    #[error("loss scaler: {0}")]
    Scaler(String),
}

/// Whether the CPU engine can run this request (fp32 only). The CUDA engine runs every request:
/// its GEMM precision is `device::Precision::from(request)`.
pub fn check_cpu(request: MixedPrecision) -> Result<(), PrecisionError> {
    match request {
        MixedPrecision::No => Ok(()),
        other => Err(PrecisionError::CpuFp32Only(other)),
    }
}

/// What to do with a step after [`LossScaler::update`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepAction {
    /// The gradients are finite: apply the optimizer step.
    Apply,
    /// The gradients overflowed: skip the optimizer step (the scale was lowered).
    Skip,
}

/// Dynamic loss scaling with `torch.cuda.amp.GradScaler`'s algorithm and defaults.
///
/// Per step: multiply the loss (in practice, the gradient of the loss) by [`scale`](Self::scale)
/// before backward; after the gradients are averaged over ranks, [`unscale`](Self::unscale)
/// them, which also reports whether any is inf or NaN; then [`update`](Self::update) with that
/// finding, and apply the optimizer step only on [`StepAction::Apply`]. Because the check runs on
/// the averaged gradients (an inf or NaN on any rank spreads to all through the sum), every rank
/// makes the same decision without a collective of its own.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScaler {
    scale: f32,
    growth_factor: f32,
    backoff_factor: f32,
    growth_interval: u32,
    good_steps: u32,
    skipped: u64,
}

impl Default for LossScaler {
    fn default() -> LossScaler {
        LossScaler {
            scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            good_steps: 0,
            skipped: 0,
        }
    }
}

/// Everything a [`LossScaler`] holds, so that a resumed run continues with the same scale and
/// grows it at the same step as an uninterrupted one: the settings and GradScaler's
/// `state_dict` (`scale`, `_growth_tracker`), plus the steps skipped so far.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScalerState {
    /// The current scale.
    pub scale: f32,
    /// Multiplier after `growth_interval` clean steps.
    pub growth_factor: f32,
    /// Multiplier on an overflow.
    pub backoff_factor: f32,
    /// Clean steps in a row that grow the scale.
    pub growth_interval: u32,
    /// Clean steps since the last growth or overflow (GradScaler's growth tracker).
    pub good_steps: u32,
    /// Steps skipped so far because their gradients overflowed.
    pub skipped: u64,
}

/// The scale never leaves `[MIN_SCALE, MAX_SCALE]`: halving forever would reach 0 (and unscaling
/// would divide by it), doubling forever would reach infinity.
const MIN_SCALE: f32 = 1.0 / (1u64 << 24) as f32;
const MAX_SCALE: f32 = (1u64 << 48) as f32;

impl LossScaler {
    /// A scaler starting at `init_scale`, multiplying the scale by `growth_factor` after
    /// `growth_interval` consecutive finite steps and by `backoff_factor` on an overflow.
    /// GradScaler's defaults are 65536, 2, 0.5 and 2000 ([`LossScaler::default`]).
    pub fn new(
        init_scale: f32,
        growth_factor: f32,
        backoff_factor: f32,
        growth_interval: u32,
    ) -> Result<LossScaler, PrecisionError> {
        if !(init_scale.is_finite() && (MIN_SCALE..=MAX_SCALE).contains(&init_scale)) {
            return Err(PrecisionError::Scaler(format!(
                "initial scale {init_scale} must be between 2^-24 and 2^48"
            )));
        }
        if !(growth_factor.is_finite() && growth_factor > 1.0) {
            return Err(PrecisionError::Scaler(format!(
                "growth factor {growth_factor} must be above 1"
            )));
        }
        if !(backoff_factor > 0.0 && backoff_factor < 1.0) {
            return Err(PrecisionError::Scaler(format!(
                "backoff factor {backoff_factor} must be between 0 and 1"
            )));
        }
        if growth_interval == 0 {
            return Err(PrecisionError::Scaler(
                "growth interval must be at least 1 step".into(),
            ));
        }
        Ok(LossScaler {
            scale: init_scale,
            growth_factor,
            backoff_factor,
            growth_interval,
            good_steps: 0,
            skipped: 0,
        })
    }

    /// The current scale.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Steps skipped so far because their gradients overflowed.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// The whole state, as a checkpoint stores it (GradScaler's `state_dict`, plus the count of
    /// skipped steps).
    pub fn state(&self) -> ScalerState {
        ScalerState {
            scale: self.scale,
            growth_factor: self.growth_factor,
            backoff_factor: self.backoff_factor,
            growth_interval: self.growth_interval,
            good_steps: self.good_steps,
            skipped: self.skipped,
        }
    }

    /// A scaler continuing exactly where [`state`](Self::state) left one (a resumed run). The
    /// settings are checked as [`LossScaler::new`] checks them, and the clean-step count must be
    /// below the growth interval (the scaler grows and restarts the count when it reaches it).
    pub fn from_state(s: ScalerState) -> Result<LossScaler, PrecisionError> {
        let mut sc = LossScaler::new(
            s.scale,
            s.growth_factor,
            s.backoff_factor,
            s.growth_interval,
        )?;
        if s.good_steps >= s.growth_interval {
            return Err(PrecisionError::Scaler(format!(
                "{} clean steps counted towards a growth interval of {}: the count is always below the interval",
                s.good_steps, s.growth_interval
            )));
        }
        (sc.good_steps, sc.skipped) = (s.good_steps, s.skipped);
        Ok(sc)
    }

    /// Divide `grads` by the current scale in place; returns whether any gradient is inf or NaN
    /// (then the step must be skipped, whatever the values).
    pub fn unscale(&self, grads: &mut [f32]) -> bool {
        let inv = 1.0 / self.scale;
        let mut found_inf = false;
        for g in grads.iter_mut() {
            *g *= inv;
            found_inf |= !g.is_finite();
        }
        found_inf
    }

    /// Record a step's finding and adjust the scale: an overflow halves it (backoff) and skips
    /// the step; `growth_interval` finite steps in a row double it (growth).
    pub fn update(&mut self, found_inf: bool) -> StepAction {
        if found_inf {
            self.scale = (self.scale * self.backoff_factor).max(MIN_SCALE);
            self.good_steps = 0;
            self.skipped += 1;
            return StepAction::Skip;
        }
        self.good_steps += 1;
        if self.good_steps == self.growth_interval {
            self.scale = (self.scale * self.growth_factor).min(MAX_SCALE);
            self.good_steps = 0;
        }
        StepAction::Apply
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_map() {
        assert_eq!("no".parse(), Ok(MixedPrecision::No));
        assert_eq!("fp32".parse(), Ok(MixedPrecision::No));
        assert_eq!("fp16".parse(), Ok(MixedPrecision::Fp16));
        assert_eq!("bf16".parse(), Ok(MixedPrecision::Bf16));
        let e = "half".parse::<MixedPrecision>().unwrap_err().to_string();
        assert!(
            e.contains("\"half\"") && e.contains("no (fp32), fp16 or bf16"),
            "{e}"
        );
        for p in [
            MixedPrecision::No,
            MixedPrecision::Fp16,
            MixedPrecision::Bf16,
        ] {
            assert_eq!(p.to_string().parse(), Ok(p));
        }
        use crate::device::Precision;
        assert_eq!(Precision::from(MixedPrecision::No), Precision::Fp32);
        assert_eq!(Precision::from(MixedPrecision::Bf16), Precision::Bf16);
        assert_eq!(Precision::from(MixedPrecision::Fp16), Precision::Fp16);
        assert!(check_cpu(MixedPrecision::No).is_ok());
        let e = check_cpu(MixedPrecision::Bf16).unwrap_err().to_string();
        assert!(
            e.contains("bf16 on the CPU") && e.contains("fp32 only"),
            "{e}"
        );
        let e = check_cpu(MixedPrecision::Fp16).unwrap_err().to_string();
        assert!(
            e.contains("fp16 on the CPU") && e.contains("--device cuda for bf16 or fp16"),
            "{e}"
        );
    }

    #[test]
    fn overflow_skips_the_step_and_halves_the_scale() {
        let mut s = LossScaler::default();
        assert_eq!(s.scale(), 65536.0);
        let mut g = [65536.0f32, -131072.0, 0.5];
        assert!(!s.unscale(&mut g));
        assert_eq!(g, [1.0, -2.0, 0.5 / 65536.0]);
        assert_eq!(s.update(false), StepAction::Apply);
        for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
            let mut g = [1.0f32, bad, 2.0];
            assert!(s.unscale(&mut g), "{bad} must be found");
        }
        assert_eq!(s.update(true), StepAction::Skip);
        assert_eq!((s.scale(), s.skipped()), (32768.0, 1));
        assert_eq!(s.update(true), StepAction::Skip);
        assert_eq!((s.scale(), s.skipped()), (16384.0, 2));
    }

    #[test]
    fn grows_after_the_interval_of_clean_steps_and_an_overflow_restarts_the_count() {
        let mut s = LossScaler::new(8.0, 2.0, 0.5, 3).unwrap();
        for _ in 0..2 {
            assert_eq!(s.update(false), StepAction::Apply);
        }
        assert_eq!(s.scale(), 8.0);
        s.update(false);
        assert_eq!(s.scale(), 16.0, "3 clean steps double it");
        s.update(false);
        s.update(false);
        s.update(true);
        assert_eq!(s.scale(), 8.0, "the overflow halves it");
        s.update(false);
        s.update(false);
        assert_eq!(
            s.scale(),
            8.0,
            "two clean steps after an overflow are not three"
        );
        s.update(false);
        assert_eq!(s.scale(), 16.0);
    }

    #[test]
    fn state_round_trips_and_the_restored_scaler_continues_alike() {
        let mut a = LossScaler::new(1024.0, 2.0, 0.5, 3).unwrap();
        for found_inf in [true, false, false] {
            a.update(found_inf);
        }
        let st = a.state();
        assert_eq!(
            (st.scale, st.good_steps, st.skipped, st.growth_interval),
            (512.0, 2, 1, 3)
        );
        let mut b = LossScaler::from_state(st).unwrap();
        assert_eq!(b, a);
        // The next clean step grows both (the restored count is 2 of 3), not only the original.
        a.update(false);
        b.update(false);
        assert_eq!((a.scale(), b.scale()), (1024.0, 1024.0));
        assert!(LossScaler::from_state(ScalerState {
            good_steps: 3,
            ..st
        })
        .is_err());
        assert!(LossScaler::from_state(ScalerState {
            scale: f32::NAN,
            ..st
        })
        .is_err());
    }

    #[test]
    fn scale_stays_in_range_and_bad_settings_are_refused() {
        let mut s = LossScaler::new(1.0, 2.0, 0.5, 1).unwrap();
        for _ in 0..100 {
            s.update(true);
        }
        assert_eq!(s.scale(), MIN_SCALE);
        let mut g = [MIN_SCALE];
        assert!(!s.unscale(&mut g));
        assert_eq!(g, [1.0]);
        for _ in 0..100 {
            s.update(false);
        }
        assert_eq!(s.scale(), MAX_SCALE);
        assert!(LossScaler::new(0.0, 2.0, 0.5, 1).is_err());
        assert!(LossScaler::new(f32::INFINITY, 2.0, 0.5, 1).is_err());
        assert!(LossScaler::new(1.0, 1.0, 0.5, 1).is_err());
        assert!(LossScaler::new(1.0, 2.0, 1.0, 1).is_err());
        assert!(LossScaler::new(1.0, 2.0, 0.5, 0).is_err());
    }
}
