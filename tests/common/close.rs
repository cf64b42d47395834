//! `assert_close`: llm.c's `validate_result` (dev/cuda/common.h) for Rust tests. A value passes when
//! `|got - want| <= atol + rtol * |want|`; non-finite reference values are skipped (counted), the
//! first mismatches are listed with the tensor's name and index, and the scan stops after 10.
#![allow(dead_code)]

/// Tolerances of one comparison.
#[derive(Clone, Copy, Debug)]
pub struct Tol {
    /// Absolute part.
    pub atol: f64,
    /// Relative part (times |want|).
    pub rtol: f64,
}

impl Tol {
    /// `atol` and `rtol`.
    pub const fn new(atol: f64, rtol: f64) -> Tol {
        Tol { atol, rtol }
    }
}

/// Compare `got` with the reference `want` element by element; `Err` lists the first mismatches.
pub fn assert_close<G: Copy + Into<f64>, W: Copy + Into<f64>>(
    name: &str,
    got: &[G],
    want: &[W],
    tol: Tol,
) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "{name}: length {} but the reference has {}",
            got.len(),
            want.len()
        ));
    }
    let (mut bad, mut skipped, mut worst) = (Vec::new(), 0usize, 0.0f64);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let (g, w): (f64, f64) = (g.into(), w.into());
        if !w.is_finite() {
            skipped += 1;
            continue;
        }
        let err = (g - w).abs();
        let lim = tol.atol + tol.rtol * w.abs();
        // `!(err <= lim)`: a NaN result is a mismatch.
        #[allow(clippy::neg_cmp_op_on_partial_ord)]
        let bad_value = !(err <= lim);
        if bad_value {
            worst = worst.max(err / lim.max(f64::MIN_POSITIVE));
            if bad.len() < 10 {
                bad.push(format!(
                    "  {name}[{i}]: got {g:.8e}, want {w:.8e} (|diff| {err:.3e} > {lim:.3e})"
                ));
            } else {
                break;
            }
        }
    }
    if bad.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{name}: values differ (atol {}, rtol {}; {skipped} non-finite reference values skipped; first {} mismatches, worst {worst:.1}x the tolerance):\n{}",
            tol.atol,
            tol.rtol,
            bad.len(),
            bad.join("\n")
        ))
    }
}

/// bf16 slice as f64 values, for [`assert_close`].
pub fn bf16_f64(v: &[half::bf16]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}
