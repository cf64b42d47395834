#![allow(clippy::needless_range_loop)] // the checks index parameters, gradients and probes together
//! Finite-difference gradient checks shared by the layer tests.

use super::layer::{Backward, Layer};
use crate::rng::Rng;
use crate::tensor::Tensor;

/// Check `backward` of `layer` against central differences of `L = sum(out * w)` for a fixed
/// random `w`, for every parameter and (optionally) input element. Uses f64-free f32 math
/// with a step and tolerance suited to f32.
pub fn check(layer: &mut dyn Layer, inp_dims: &[usize], check_input: bool, seed: u64) {
    check_with_step(layer, inp_dims, check_input, seed, 1e-2)
}

/// [`check`] with an explicit finite-difference step (smaller for layers with kinks, where a
/// large step could move an input across a max or zero).
pub fn check_with_step(
    layer: &mut dyn Layer,
    inp_dims: &[usize],
    check_input: bool,
    seed: u64,
    h: f32,
) {
    let mut rng = Rng::new(seed, 99);
    let specs = layer.param_specs();
    let np: usize = specs.iter().map(|s| s.numel()).sum();
    let mut p: Vec<f32> = (0..np).map(|_| rng.uniform(-1.0, 1.0)).collect();
    let inp_n: usize = inp_dims.iter().product();
    let mut inp = Tensor::from_vec(
        inp_dims,
        (0..inp_n).map(|_| rng.uniform(-1.0, 1.0)).collect(),
    )
    .unwrap();
    let od = layer.out_dims(inp_dims).unwrap();
    let on: usize = od.iter().product();
    let w: Vec<f32> = (0..on).map(|_| rng.uniform(-1.0, 1.0)).collect();
    let loss = |layer: &mut dyn Layer, p: &[f32], inp: &Tensor| -> f64 {
        let mut out = Tensor::zeros(&od);
        layer.forward(p, inp, &mut out, true);
        out.data()
            .iter()
            .zip(&w)
            .map(|(a, b)| *a as f64 * *b as f64)
            .sum()
    };
    let mut out = Tensor::zeros(&od);
    layer.forward(&p, &inp, &mut out, true);
    let dout = Tensor::from_vec(&od, w.clone()).unwrap();
    let mut dp = vec![0.0f32; np];
    let mut dinp = Tensor::zeros(inp_dims);
    layer.backward(Backward {
        p: &p,
        dp: &mut dp,
        inp: &inp,
        out: &out,
        dout: &dout,
        dinp: if check_input { Some(&mut dinp) } else { None },
    });
    let kind = layer.kind();
    let mut num_dp = vec![0.0f64; np];
    for i in 0..np {
        let orig = p[i];
        p[i] = orig + h;
        let lp = loss(layer, &p, &inp);
        p[i] = orig - h;
        let lm = loss(layer, &p, &inp);
        p[i] = orig;
        num_dp[i] = (lp - lm) / (2.0 * h as f64);
    }
    assert_close(&format!("{kind} dparam"), &dp, &num_dp, 2e-2, 2e-2);
    if check_input {
        let mut num_dinp = vec![0.0f64; inp_n];
        for i in 0..inp_n {
            let orig = inp.data()[i];
            inp.data_mut()[i] = orig + h;
            let lp = loss(layer, &p, &inp);
            inp.data_mut()[i] = orig - h;
            let lm = loss(layer, &p, &inp);
            inp.data_mut()[i] = orig;
            num_dinp[i] = (lp - lm) / (2.0 * h as f64);
        }
        assert_close(&format!("{kind} dinp"), dinp.data(), &num_dinp, 2e-2, 2e-2);
    }
}

/// llm.c-style checker: `|got - want| <= atol + rtol * |want|`, non-finite references
/// skipped, the first mismatches printed with tensor name and index, at most 10 listed.
pub fn assert_close(name: &str, got: &[f32], want: &[f64], atol: f64, rtol: f64) {
    let mut bad = Vec::new();
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w.is_finite() && (g as f64 - w).abs() > atol + rtol * w.abs() {
            bad.push(format!("  {name}[{i}]: got {g}, want {w}"));
            if bad.len() == 10 {
                break;
            }
        }
    }
    assert!(
        bad.is_empty(),
        "{name}: mismatches (first {}):\n{}",
        bad.len(),
        bad.join("\n")
    );
}
