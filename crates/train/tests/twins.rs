//! The kernels' CPU twins (`lockstep_train::device::kernels::twins`) against the engine's CPU layers, on
//! random inputs with odd shapes (batch 1, 3, 65; channel counts that are not multiples of the
//! 64-wide GEMM tiles), plus the device engine's plan and its CPU-twin executor against the CPU
//! engine. Runs everywhere (no GPU): this is what pins down the semantics the GPU kernels are
//! then checked against (tests/gpu_kernels.rs).
//!
//! Tolerances (|got - want| <= atol + rtol * |want|):
//! - f32 twins vs layers: 1e-4 / 1e-4 (both f32; only the summation order differs), except the
//!   conv weight gradient where the layer uses Winograd: 1e-3 / 1e-3, and the conv output and
//!   input gradient of a Winograd-shaped layer: 2e-3 / 1e-4 (F(4x4,5x5)'s fp32 error);
//! - bf16 twins vs the f32 layers on the same bf16-rounded inputs: 1e-4 / 1e-4 (bf16 products
//!   are exact in f32), and vs unrounded inputs: 0.01*sqrt(K) / 2e-2 for a K-term sum (bf16
//!   input rounding, 2^-9 relative per operand, grows like sqrt(K));
//! - BatchNorm, loss and optimizers: 1e-5 / 1e-5 (the layers reduce in f64, the twins too);
//! - gather, casts, bucket copies, pooling outputs: exact.

#[path = "../../../tests/common/close.rs"]
mod close;
#[path = "common/reference.rs"]
mod reference;

use close::{assert_close, Tol};
use half::{bf16, f16};
use lockstep_train::data::Dataset;
use lockstep_train::device::kernels::twins;
use lockstep_train::device::{plan, CpuExec, Engine, Exec, Precision};
use lockstep_train::model::Model;
use lockstep_train::ops::optim::{Adam, AdamHyper, Sgd};
use lockstep_train::ops::{
    Backward, BatchNorm2d, Bn2dShape, Conv2d, Conv2dParams, Layer, Linear, LinearShape, MaxPool2d,
    Pool2dShape, Relu, SoftmaxCrossEntropy,
};
use lockstep_train::rng::Rng;
use lockstep_train::tensor::Tensor;
use lockstep_train::trainer::load_batch;

const F32: Tol = Tol::new(1e-4, 1e-4);
const TIGHT: Tol = Tol::new(1e-5, 1e-5);
/// The CPU layer runs 5×5 "same" convolutions with 8+ input channels through Winograd F(4×4,5×5)
/// (`train::winograd`), whose weight gradient sums many transformed products: it matches the
/// direct twin to 1e-3.
const WINOGRAD_DW: Tol = Tol::new(1e-3, 1e-3);
/// Output and input gradient of those layers: F(4×4,5×5) in fp32 is off by up to ~1e-5 of the
/// output scale (`train::winograd`'s tests), and this test's conv3 (825-term sums of ±1 values)
/// has outputs up to 38 and input gradients up to 53: measured worst |diff| 2.0e-4 and 4.5e-4,
/// above `F32`'s absolute 1e-4. The bound leaves 4x over that.
const WINOGRAD: Tol = Tol::new(2e-3, 1e-4);
/// bf16 twins vs f32 math on unrounded inputs: each operand carries a relative rounding error of
/// up to 2^-9, so a K-term sum of O(1) products drifts by about 2^-8 * sqrt(K) in absolute terms.
fn bf16_vs_f32(k: usize) -> Tol {
    Tol::new(0.01 * (k as f64).sqrt(), 2e-2)
}

fn rand(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect()
}

fn round_bf16(v: &[f32]) -> (Vec<bf16>, Vec<f32>) {
    let b: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
    let f = b.iter().map(|x| x.to_f32()).collect();
    (b, f)
}

fn ok(r: Result<(), String>) {
    if let Err(e) = r {
        panic!("{e}");
    }
}

/// The weight and bias gradients `(dw, db)` against the reference layer's parameter gradient `dp`
/// (the weights, then the bias), named `dweight<suffix>` and `dbias<suffix>` through `name`.
fn grads_close(
    name: &dyn Fn(&str) -> String,
    suffix: &str,
    (dw, db): (&[f32], &[f32]),
    dp: &[f32],
    dw_tol: Tol,
) {
    let (dp_w, dp_b) = dp.split_at(dw.len());
    ok(assert_close(
        &name(&format!("dweight{suffix}")),
        dw,
        dp_w,
        dw_tol,
    ));
    ok(assert_close(
        &name(&format!("dbias{suffix}")),
        db,
        dp_b,
        F32,
    ));
}

/// (batch, in_c, h, w, out_c, k, stride, pad)
type ConvShape = (usize, usize, usize, usize, usize, usize, usize, usize);
const CONV_SHAPES: &[ConvShape] = &[
    (1, 1, 28, 28, 32, 5, 1, 2),
    (3, 3, 7, 6, 5, 3, 2, 1),
    (65, 2, 5, 5, 3, 3, 1, 1),
    (3, 33, 9, 9, 65, 5, 1, 2),
    (1, 4, 8, 7, 3, 2, 3, 0),
];

/// Conv forward and the three backward kernels vs the Conv2d layer (f32 and bf16).
#[test]
fn conv2d_twins_match_the_layer() {
    for (t, &(n, ic, h, w, oc, k, s, p)) in CONV_SHAPES.iter().enumerate() {
        let cp = Conv2dParams::new(ic, oc, k, s, p);
        let (oh, ow) = (cp.out_h(h), cp.out_w(w));
        let mut rng = Rng::new(100 + t as u64, 1);
        let wt = rand(&mut rng, oc * ic * k * k);
        let bias = rand(&mut rng, oc);
        let x = rand(&mut rng, n * ic * h * w);
        let dy = rand(&mut rng, n * oc * oh * ow);
        let dp0 = rand(&mut rng, wt.len() + oc); // accumulation: start from non-zero gradients
        let name = |what: &str| {
            format!("conv{t} {what} (n={n} ic={ic} {h}x{w} oc={oc} k={k} s={s} p={p})")
        };
        let layer_run = |wt: &[f32], x: &[f32], dy: &[f32]| {
            let mut layer = Conv2d::new(cp);
            let params: Vec<f32> = wt.iter().chain(&bias).copied().collect();
            let inp = Tensor::from_vec(&[n, ic, h, w], x.to_vec()).unwrap();
            let mut out = Tensor::default();
            layer.forward(&params, &inp, &mut out, true);
            let mut dp = dp0.clone();
            let mut dinp = Tensor::default();
            let dout = Tensor::from_vec(&[n, oc, oh, ow], dy.to_vec()).unwrap();
            layer.backward(Backward {
                p: &params,
                dp: &mut dp,
                inp: &inp,
                out: &out,
                dout: &dout,
                dinp: Some(&mut dinp),
            });
            (out.data().to_vec(), dinp.data().to_vec(), dp)
        };
        let a = cp.for_input(n, h, w);
        // The layer's Winograd path (as `train::winograd::applies` decides) is checked at its bound.
        let fwd = if k == 5 && s == 1 && p == 2 && ic >= 8 {
            WINOGRAD
        } else {
            F32
        };
        // f32
        let (y_ref, dx_ref, dp_ref) = layer_run(&wt, &x, &dy);
        let mut y = vec![0.0; y_ref.len()];
        twins::conv2d_forward_f32(&mut y, &x, &wt, Some(&bias), a);
        ok(assert_close(&name("out"), &y, &y_ref, fwd));
        let mut dx = vec![f32::NAN; x.len()];
        twins::conv2d_backward_input_f32(&mut dx, &dy, &wt, a);
        ok(assert_close(&name("dinp"), &dx, &dx_ref, fwd));
        let (mut dw, mut db) = (dp0[..wt.len()].to_vec(), dp0[wt.len()..].to_vec());
        // Split-K as the device plans it: 3 slices into planes (every one overwritten, NaN
        // would show otherwise), dweight untouched until the reduction adds them in order.
        let mut part = vec![f32::NAN; 3 * wt.len()];
        twins::conv2d_backward_weight_f32(&mut dw, &mut part, &dy, &x, a);
        assert_eq!(
            dw,
            dp0[..wt.len()],
            "{}: split-K must not touch dweight before the reduction",
            name("dweight")
        );
        twins::splitk_reduce_f32(&mut dw, &part, 3, wt.len() as i64);
        twins::conv2d_backward_bias_f32(&mut db, &dy, n as i32, oc as i32, oh as i32, ow as i32);
        grads_close(&name, "", (&dw, &db), &dp_ref, WINOGRAD_DW);
        // bf16: operands rounded; reference = the f32 layer on the same rounded values, and
        // (loosely) on the unrounded ones.
        let ((wb, wr), (xb, xr), (dyb, dyr)) = (round_bf16(&wt), round_bf16(&x), round_bf16(&dy));
        let (yr_ref, dxr_ref, dpr_ref) = layer_run(&wr, &xr, &dyr);
        twins::conv2d_forward_bf16(&mut y, &xb, &wb, Some(&bias), a);
        ok(assert_close(&name("out bf16"), &y, &yr_ref, fwd));
        ok(assert_close(
            &name("out bf16 vs f32"),
            &y,
            &y_ref,
            bf16_vs_f32(ic * k * k),
        ));
        twins::conv2d_backward_input_bf16(&mut dx, &dyb, &wb, a);
        ok(assert_close(&name("dinp bf16"), &dx, &dxr_ref, fwd));
        let (mut dw, mut db) = (dp0[..wt.len()].to_vec(), dp0[wt.len()..].to_vec());
        twins::conv2d_backward_weight_bf16(&mut dw, &mut [], &dyb, &xb, a);
        twins::conv2d_backward_bias_bf16(&mut db, &dyb, n as i32, oc as i32, oh as i32, ow as i32);
        grads_close(&name, " bf16", (&dw, &db), &dpr_ref, WINOGRAD_DW);
        // No bias (the kernel's NULL) is a plain convolution.
        twins::conv2d_forward_f32(&mut y, &x, &wt, None, a);
        let unbiased: Vec<f32> = y_ref
            .iter()
            .enumerate()
            .map(|(i, v)| v - bias[(i / (oh * ow)) % oc])
            .collect();
        ok(assert_close(&name("out, no bias"), &y, &unbiased, fwd));
    }
}

/// Linear (with and without the fused ReLU) vs Linear + Relu layers, f32 and bf16.
#[test]
fn linear_twins_match_the_layers() {
    for (t, &(n, inf, outf)) in [
        (1usize, 5usize, 3usize),
        (3, 3136, 64),
        (65, 17, 10),
        (2, 70, 65),
    ]
    .iter()
    .enumerate()
    {
        let mut rng = Rng::new(200 + t as u64, 1);
        let (wt, bias, x) = (
            rand(&mut rng, outf * inf),
            rand(&mut rng, outf),
            rand(&mut rng, n * inf),
        );
        let dy = rand(&mut rng, n * outf);
        let dp0 = rand(&mut rng, outf * inf + outf);
        let name = |w: &str| format!("linear{t} {w} (n={n} in={inf} out={outf})");
        let layer_run = |wt: &[f32], x: &[f32], dy: &[f32]| {
            let params: Vec<f32> = wt.iter().chain(&bias).copied().collect();
            let mut l = Linear::new(inf, outf);
            let inp = Tensor::from_vec(&[n, inf], x.to_vec()).unwrap();
            let (mut y, mut yr) = (Tensor::default(), Tensor::default());
            l.forward(&params, &inp, &mut y, true);
            Relu.forward(&[], &y, &mut yr, true);
            let dout = Tensor::from_vec(&[n, outf], dy.to_vec()).unwrap();
            let (mut dp, mut dx) = (dp0.clone(), Tensor::default());
            l.backward(Backward {
                p: &params,
                dp: &mut dp,
                inp: &inp,
                out: &y,
                dout: &dout,
                dinp: Some(&mut dx),
            });
            (
                y.data().to_vec(),
                yr.data().to_vec(),
                dx.data().to_vec(),
                dp,
            )
        };
        let (y_ref, yr_ref, dx_ref, dp_ref) = layer_run(&wt, &x, &dy);
        let sh = LinearShape {
            batch: n,
            in_f: inf,
            out_f: outf,
        };
        let (ni, oi) = (n as i32, outf as i32);
        let mut y = vec![0.0; n * outf];
        twins::linear_forward_f32(&mut y, &x, &wt, Some(&bias), sh, 0);
        ok(assert_close(&name("out"), &y, &y_ref, F32));
        twins::linear_forward_f32(&mut y, &x, &wt, Some(&bias), sh, 1);
        ok(assert_close(&name("out+relu"), &y, &yr_ref, F32));
        let mut dx = vec![f32::NAN; n * inf];
        twins::linear_backward_input_f32(&mut dx, &dy, &wt, sh);
        ok(assert_close(&name("dinp"), &dx, &dx_ref, F32));
        let (mut dw, mut db) = (dp0[..outf * inf].to_vec(), dp0[outf * inf..].to_vec());
        let mut part = vec![f32::NAN; 2 * outf * inf];
        twins::linear_backward_weight_f32(&mut dw, &mut part, &dy, &x, sh);
        twins::splitk_reduce_f32(&mut dw, &part, 2, (outf * inf) as i64);
        twins::linear_backward_bias_f32(&mut db, &dy, ni, oi);
        grads_close(&name, "", (&dw, &db), &dp_ref, F32);
        let ((wb, wr), (xb, xr), (dyb, dyr)) = (round_bf16(&wt), round_bf16(&x), round_bf16(&dy));
        let (y2, yr2, dx2, dp2) = layer_run(&wr, &xr, &dyr);
        twins::linear_forward_bf16(&mut y, &xb, &wb, Some(&bias), sh, 0);
        ok(assert_close(&name("out bf16"), &y, &y2, F32));
        ok(assert_close(
            &name("out bf16 vs f32"),
            &y,
            &y_ref,
            bf16_vs_f32(inf),
        ));
        twins::linear_forward_bf16(&mut y, &xb, &wb, Some(&bias), sh, 1);
        ok(assert_close(&name("out+relu bf16"), &y, &yr2, F32));
        twins::linear_backward_input_bf16(&mut dx, &dyb, &wb, sh);
        ok(assert_close(&name("dinp bf16"), &dx, &dx2, F32));
        let (mut dw, mut db) = (dp0[..outf * inf].to_vec(), dp0[outf * inf..].to_vec());
        twins::linear_backward_weight_bf16(&mut dw, &mut [], &dyb, &xb, sh);
        twins::linear_backward_bias_bf16(&mut db, &dyb, ni, oi);
        grads_close(&name, " bf16", (&dw, &db), &dp2, F32);
    }
}

#[test]
fn relu_twins_match_the_layer() {
    let mut rng = Rng::new(3, 3);
    for n in [1usize, 3, 65, 1000] {
        let (x, dy) = (rand(&mut rng, n), rand(&mut rng, n));
        let (mut y, mut y_ref) = (vec![0.0; n], vec![0.0; n]);
        twins::relu_forward_f32(&mut y, &x, n as i32);
        lockstep_train::ops::activation::relu_forward(&mut y_ref, &x);
        assert_eq!(y, y_ref);
        let (mut d, mut d_ref) = (vec![0.0; n], vec![0.0; n]);
        twins::relu_backward_f32(&mut d, &y, &dy, n as i32);
        lockstep_train::ops::activation::relu_backward(&mut d_ref, &y_ref, &dy);
        assert_eq!(d, d_ref);
    }
}

/// BatchNorm train/eval forward and backward (with and without the fused ReLU) vs BatchNorm2d
/// (followed by Relu), including running statistics.
#[test]
fn batchnorm_twins_match_the_layer() {
    for (t, &(n, c, h, w)) in [
        (1usize, 3usize, 5usize, 5usize),
        (3, 32, 7, 7),
        (65, 5, 3, 3),
        (2, 4, 1, 1),
        (1, 1, 1, 2),
    ]
    .iter()
    .enumerate()
    {
        for relu in [0, 1] {
            let mut rng = Rng::new(300 + t as u64, relu);
            let hw = h * w;
            let x: Vec<f32> = (0..n * c * hw).map(|_| rng.uniform(-1.0, 3.0)).collect();
            let dy = rand(&mut rng, x.len());
            let (gamma, beta) = (rand(&mut rng, c), rand(&mut rng, c));
            let params: Vec<f32> = gamma.iter().chain(&beta).copied().collect();
            let name = |s: &str| format!("bn{t} relu={relu} {s} (n={n} c={c} {h}x{w})");
            let mut bn = BatchNorm2d::new(c);
            bn.running_mean = rand(&mut rng, c);
            bn.running_var = (0..c).map(|_| rng.uniform(0.5, 2.0)).collect();
            let (rm0, rv0) = (bn.running_mean.clone(), bn.running_var.clone());
            let inp = Tensor::from_vec(&[n, c, h, w], x.clone()).unwrap();
            let (mut y, mut yr) = (Tensor::default(), Tensor::default());
            bn.forward(&params, &inp, &mut y, true);
            Relu.forward(&[], &y, &mut yr, true);
            let out_ref = if relu == 1 { &yr } else { &y };
            // backward through relu then bn
            let dout = Tensor::from_vec(&[n, c, h, w], dy.clone()).unwrap();
            let g = if relu == 1 {
                input_gradient(&mut Relu, &y, &yr, &dout)
            } else {
                dout.clone()
            };
            let dp0 = rand(&mut rng, 2 * c);
            let (mut dp, mut dx_ref) = (dp0.clone(), Tensor::default());
            bn.backward(Backward {
                p: &params,
                dp: &mut dp,
                inp: &inp,
                out: &y,
                dout: &g,
                dinp: Some(&mut dx_ref),
            });
            // twin
            let shape = Bn2dShape {
                batch: n,
                channels: c,
                hw,
                momentum: 0.1,
                eps: 1e-5,
                relu: relu == 1,
            };
            let (mut out, mut sm, mut si, mut rm, mut rv) = (
                vec![0.0; x.len()],
                vec![0.0; c],
                vec![0.0; c],
                rm0.clone(),
                rv0.clone(),
            );
            let stats = twins::BnStats {
                save_mean: &mut sm,
                save_invstd: &mut si,
                running_mean: &mut rm,
                running_var: &mut rv,
            };
            twins::batchnorm2d_forward_train_f32(&mut out, stats, &x, &gamma, &beta, shape);
            ok(assert_close(&name("out"), &out, out_ref.data(), TIGHT));
            ok(assert_close(
                &name("running_mean"),
                &rm,
                &bn.running_mean,
                TIGHT,
            ));
            ok(assert_close(
                &name("running_var"),
                &rv,
                &bn.running_var,
                TIGHT,
            ));
            let (mut dx, mut dw, mut db) = (
                vec![f32::NAN; x.len()],
                dp0[..c].to_vec(),
                dp0[c..].to_vec(),
            );
            twins::batchnorm2d_backward_f32(
                &mut dx,
                (&mut dw, &mut db),
                &dy,
                (&x, &out),
                &gamma,
                (&sm, &si),
                shape,
            );
            ok(assert_close(
                &name("dinp"),
                &dx,
                dx_ref.data(),
                Tol::new(1e-4, 1e-4),
            ));
            ok(assert_close(
                &name("dweight"),
                &dw,
                &dp[..c],
                Tol::new(1e-4, 1e-4),
            ));
            ok(assert_close(
                &name("dbias"),
                &db,
                &dp[c..],
                Tol::new(1e-4, 1e-4),
            ));
            // eval with the updated running statistics
            let (mut ye, mut yer) = (Tensor::default(), Tensor::default());
            bn.forward(&params, &inp, &mut ye, false);
            Relu.forward(&[], &ye, &mut yer, false);
            let mut oe = vec![0.0; x.len()];
            twins::batchnorm2d_forward_eval_f32(&mut oe, &x, &gamma, &beta, &rm, &rv, shape);
            ok(assert_close(
                &name("eval out"),
                &oe,
                if relu == 1 { yer.data() } else { ye.data() },
                TIGHT,
            ));
        }
    }
}

/// The input gradient of a layer without parameters (ReLU, pooling) after a forward pass from
/// `inp` to `out`, for the output gradient `dout`.
fn input_gradient(layer: &mut dyn Layer, inp: &Tensor, out: &Tensor, dout: &Tensor) -> Tensor {
    let mut dinp = Tensor::default();
    layer.backward(Backward {
        p: &[],
        dp: &mut [],
        inp,
        out,
        dout,
        dinp: Some(&mut dinp),
    });
    dinp
}

#[test]
fn maxpool_twins_match_the_layer() {
    for (t, &(n, c, h, w, k, s)) in [
        (1usize, 1usize, 4usize, 5usize, 2usize, 2usize),
        (3, 3, 7, 5, 3, 2),
        (65, 2, 28, 28, 2, 2),
        (2, 3, 5, 5, 2, 1),
    ]
    .iter()
    .enumerate()
    {
        let mut rng = Rng::new(400 + t as u64, 1);
        let x = rand(&mut rng, n * c * h * w);
        let mut mp = MaxPool2d::new(k, s);
        let inp = Tensor::from_vec(&[n, c, h, w], x.clone()).unwrap();
        let mut y = Tensor::default();
        mp.forward(&[], &inp, &mut y, true);
        let (oh, ow) = ((h - k) / s + 1, (w - k) / s + 1);
        let dy = rand(&mut rng, n * c * oh * ow);
        let dout = Tensor::from_vec(&[n, c, oh, ow], dy.clone()).unwrap();
        let dx_ref = input_gradient(&mut mp, &inp, &y, &dout);
        let a = Pool2dShape {
            batch: n,
            channels: c,
            in_h: h,
            in_w: w,
            kernel: k,
            stride: s,
        };
        let (mut out, mut idx) = (vec![0.0; y.numel()], vec![0i32; y.numel()]);
        twins::maxpool2d_forward_f32(&mut out, &mut idx, &x, a);
        assert_eq!(out, y.data(), "maxpool{t} out");
        let mut dx = vec![f32::NAN; x.len()];
        twins::maxpool2d_backward_f32(&mut dx, &dy, &idx, a);
        ok(assert_close(
            &format!("maxpool{t} dinp"),
            &dx,
            dx_ref.data(),
            TIGHT,
        ));
    }
    // NaN propagates and wins the argmax, as PyTorch.
    let (mut out, mut idx) = ([0.0f32], [0i32]);
    twins::maxpool2d_forward_f32(
        &mut out,
        &mut idx,
        &[1.0, f32::NAN, 5.0, 2.0],
        Pool2dShape::from_kernel_args([1, 1, 2, 2, 2, 2]),
    );
    assert!(out[0].is_nan() && idx[0] == 1);
}

#[test]
fn softmax_xent_twins_match_the_layer() {
    for (t, &(n, c)) in [(1usize, 10usize), (3, 7), (65, 10), (2, 40)]
        .iter()
        .enumerate()
    {
        let mut rng = Rng::new(500 + t as u64, 1);
        let z: Vec<f32> = (0..n * c).map(|_| rng.uniform(-4.0, 4.0)).collect();
        let targets: Vec<u8> = (0..n).map(|_| rng.below(c as u32) as u8).collect();
        let ti: Vec<i32> = targets.iter().map(|&x| x as i32).collect();
        let mut ce = SoftmaxCrossEntropy::default();
        let logits = Tensor::from_vec(&[n, c], z.clone()).unwrap();
        let loss_ref = ce.forward(&logits, &targets);
        let mut d_ref = Tensor::default();
        ce.backward(&mut d_ref, &[n, c], &targets);
        let want_correct = (0..n)
            .filter(|&b| {
                let row = &z[b * c..(b + 1) * c];
                let am = (1..c).fold(0, |best, j| if row[j] > row[best] { j } else { best });
                am == ti[b] as usize
            })
            .count() as i32;
        let (mut losses, mut probs, mut mean, mut correct) =
            (vec![0.0; n], vec![0.0; n * c], [0.0f32], [0i32]);
        twins::softmax_xent_forward_f32(
            &mut losses,
            &mut probs,
            &mut mean,
            &mut correct,
            &z,
            &ti,
            n as i32,
            c as i32,
        );
        ok(assert_close(
            &format!("xent{t} mean loss"),
            &mean,
            &[loss_ref],
            TIGHT,
        ));
        assert_eq!(correct[0], want_correct, "xent{t} correct");
        let mut d = vec![0.0; n * c];
        twins::softmax_xent_backward_f32(&mut d, &probs, &ti, n as i32, c as i32);
        ok(assert_close(
            &format!("xent{t} dlogits"),
            &d,
            d_ref.data(),
            TIGHT,
        ));
    }
}

#[test]
fn optimizer_twins_match_the_optimizers() {
    let mut rng = Rng::new(6, 6);
    for n in [1usize, 3, 65, 1001] {
        for wd in [0.0f32, 0.01] {
            let mut p_ref = rand(&mut rng, n);
            let mut p = p_ref.clone();
            let mut adam = Adam::new(n, 0.01);
            adam.weight_decay = wd;
            let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
            for step in 1..=5 {
                let g = rand(&mut rng, n);
                adam.step(&mut p_ref, &g);
                let h = AdamHyper {
                    weight_decay: wd,
                    ..Default::default()
                };
                twins::adam_step_f32(&mut p, &g, (&mut m, &mut v), n as i32, 0.01, &h, step);
                ok(assert_close(
                    &format!("adam n={n} wd={wd} step {step} params"),
                    &p,
                    &p_ref,
                    TIGHT,
                ));
                ok(assert_close(
                    &format!("adam n={n} step {step} exp_avg_sq"),
                    &v,
                    &adam.v,
                    TIGHT,
                ));
            }
        }
        for (mom, nesterov) in [(0.0f32, false), (0.9, false), (0.9, true)] {
            let mut p_ref = rand(&mut rng, n);
            let mut p = p_ref.clone();
            let mut sgd = Sgd::new(0.1, mom, 0.01);
            sgd.nesterov = nesterov;
            let mut buf = vec![0.0; if mom != 0.0 { n } else { 0 }];
            for step in 0..4 {
                let g = rand(&mut rng, n);
                sgd.step(&mut p_ref, &g);
                twins::sgd_step_f32(
                    &mut p,
                    &g,
                    &mut buf,
                    n as i32,
                    0.1,
                    mom,
                    0.0,
                    0.01,
                    nesterov as i32,
                    (step == 0) as i32,
                );
                ok(assert_close(
                    &format!("sgd n={n} momentum={mom} nesterov={nesterov} step {step}"),
                    &p,
                    &p_ref,
                    TIGHT,
                ));
            }
        }
    }
}

/// The 16-bit float types the cast twins convert to and from.
trait Half: Copy + std::fmt::Display {
    const ZERO: Self;
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
    fn to_bits(self) -> u16;
    fn is_nan(self) -> bool;
}

macro_rules! half_type {
    ($($t:ty),*) => {$(
        impl Half for $t {
            const ZERO: Self = <$t>::ZERO;
            fn from_f32(x: f32) -> Self {
                <$t>::from_f32(x)
            }
            fn to_f32(self) -> f32 {
                <$t>::to_f32(self)
            }
            fn to_bits(self) -> u16 {
                <$t>::to_bits(self)
            }
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
        }
    )*};
}
half_type!(bf16, f16);

/// The narrowing twin rounds every value of `x` as the `half` crate does (NaN stays NaN), and the
/// widening twin gives each result back exactly; returns the narrowed values.
fn check_casts<H: Half>(
    x: &[f32],
    narrow: fn(&mut [H], &[f32], i32),
    widen: fn(&mut [f32], &[H], i32),
) -> Vec<H> {
    let mut h = vec![H::ZERO; x.len()];
    narrow(&mut h, x, x.len() as i32);
    for (g, &w) in h.iter().zip(x) {
        assert!(
            g.to_bits() == H::from_f32(w).to_bits() || (w.is_nan() && g.is_nan()),
            "{w} -> {g}"
        );
    }
    let mut back = vec![0.0f32; x.len()];
    widen(&mut back, &h, x.len() as i32);
    for (g, w) in back.iter().zip(&h) {
        assert!(g.to_bits() == w.to_f32().to_bits() || g.is_nan());
    }
    h
}

#[test]
fn data_twins_are_exact() {
    // gather: x / 255 exactly as the CPU trainer's load_batch, labels widened.
    let mut rng = Rng::new(7, 7);
    let (num, sz) = (9usize, 13usize);
    let ds: Vec<u8> = (0..num * sz).map(|_| rng.below(256) as u8).collect();
    let lb: Vec<u8> = (0..num).map(|_| rng.below(10) as u8).collect();
    let idx = [4i32, 0, 8, 4];
    let (mut im, mut l) = (vec![0.0; idx.len() * sz], vec![0; idx.len()]);
    twins::gather_batch_f32(&mut im, &mut l, &ds, &lb, &idx, idx.len() as i32, sz as i32);
    for (b, &i) in idx.iter().enumerate() {
        assert_eq!(l[b], lb[i as usize] as i32);
        for j in 0..sz {
            assert_eq!(im[b * sz + j], ds[i as usize * sz + j] as f32 / 255.0);
        }
    }
    // casts: round to nearest even like half, NaN stays NaN, widening exact.
    let x = [
        1.0f32,
        -2.5,
        1.0 + 1.0 / 256.0,
        3.0e38,
        f32::NAN,
        f32::INFINITY,
        1e-40,
    ];
    check_casts(&x, twins::cast_f32_bf16, twins::cast_bf16_f32);
    // fp16 casts against half::f16: the largest finite value, the first value that rounds to
    // infinity (65520), a tie below it, subnormals, a tie at half the smallest subnormal (to 0),
    // NaN and infinity; widening exact.
    let x = [
        1.0f32,
        -2.5,
        65504.0,
        65519.0,
        65520.0,
        -7e4,
        1.0 + 1.0 / 2048.0,
        1e-7,
        -3.0 * 2f32.powi(-26),
        2f32.powi(-25),
        6.1e-5,
        f32::NAN,
        f32::NEG_INFINITY,
        1e-40,
    ];
    let h = check_casts(&x, twins::cast_f32_f16, twins::cast_f16_f32);
    assert_eq!(
        (h[3].to_f32(), h[4].to_f32(), h[9].to_bits()),
        (65504.0, f32::INFINITY, 0),
        "rounding at the edges"
    );
    // Loss scaling: the scaled loss gradient is the unscaled one times the (power-of-two) scale,
    // bit for bit; unscaling restores it and flags inf/NaN only when there is one.
    let (probs, targets) = (
        rand(&mut rng, 12)
            .iter()
            .map(|v| v.abs())
            .collect::<Vec<f32>>(),
        [2i32, 0, 3],
    );
    let (mut d, mut ds) = (vec![0.0f32; 12], vec![0.0f32; 12]);
    twins::softmax_xent_backward_f32(&mut d, &probs, &targets, 3, 4);
    twins::softmax_xent_backward_scaled_f32(&mut ds, &probs, &targets, 3, 4, &[1024.0]);
    assert!(
        d.iter()
            .zip(&ds)
            .all(|(a, b)| (a * 1024.0).to_bits() == b.to_bits()),
        "{d:?} vs {ds:?}"
    );
    let mut flag = [0.0f32];
    twins::amp_unscale_f32(&mut ds, &mut flag, &[1024.0], 12);
    assert_eq!(
        (ds.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), flag[0]),
        (d.iter().map(|v| v.to_bits()).collect(), 0.0)
    );
    for bad in [f32::INFINITY, f32::NAN] {
        let mut g = vec![1.0f32, bad, 2.0];
        let mut flag = [0.0f32];
        twins::amp_unscale_f32(&mut g, &mut flag, &[4.0], 3);
        assert_eq!((g[0], g[2], flag[0]), (0.25, 0.5, 1.0), "{bad}");
    }
    // bucket: flatten then unflatten with 1/world is the mean of one rank's copy.
    let (t0, t1) = (rand(&mut rng, 5), rand(&mut rng, 3));
    let mut bucket = vec![0.0; 8];
    twins::bucket_flatten_f32(
        &mut bucket,
        &[
            twins::BucketSrc {
                tensor: &t0,
                offset: 3,
                len: 5,
            },
            twins::BucketSrc {
                tensor: &t1,
                offset: 0,
                len: 3,
            },
        ],
        2,
    );
    assert_eq!(&bucket[3..], &t0[..]);
    assert_eq!(&bucket[..3], &t1[..]);
    let (mut u0, mut u1) = (vec![0.0; 5], vec![0.0; 3]);
    twins::bucket_unflatten_f32(
        &mut [
            twins::BucketDst {
                tensor: &mut u0,
                offset: 3,
                len: 5,
            },
            twins::BucketDst {
                tensor: &mut u1,
                offset: 0,
                len: 3,
            },
        ],
        &bucket,
        2,
        0.5,
    );
    assert_eq!(u0, t0.iter().map(|v| v * 0.5).collect::<Vec<_>>());
    assert_eq!(u1, t1.iter().map(|v| v * 0.5).collect::<Vec<_>>());
}

/// Every launch of the device step passes arguments that match the kernel's registered
/// signature, and no launch writes a tensor it also reads (what `split_views` enforces on a GPU).
#[test]
fn device_plan_matches_kernel_signatures() {
    let model = Model::fashion_cnn(64).unwrap();
    for precision in [Precision::Fp32, Precision::Bf16, Precision::Fp16] {
        let t = plan::Tensors::new(&model, 64, precision).unwrap();
        for b in [1usize, 7, 64] {
            for ops in [
                t.train_step(b, precision, 132),
                t.eval_step(b, precision, 132),
            ] {
                for op in &ops {
                    op.check_signature()
                        .unwrap_or_else(|e| panic!("{precision:?} batch {b}: {e}"));
                    let ranges = |out: bool| {
                        op.args.iter().filter_map(move |a| match (a, out) {
                            (plan::Arg::Out(r), true) | (plan::Arg::In(r), false) => Some(*r),
                            _ => None,
                        })
                    };
                    for w in ranges(true) {
                        for o in ranges(true).chain(ranges(false)) {
                            let overlap = w.arena == o.arena
                                && w != o
                                && w.off < o.off + o.len
                                && o.off < w.off + w.len
                                && w.len > 0
                                && o.len > 0;
                            assert!(
                                !overlap && !(ranges(false).any(|r| r == w)),
                                "{}: written {w:?} overlaps {o:?}",
                                op.name
                            );
                        }
                    }
                    let (g, bl) = (op.cfg.grid, op.cfg.block);
                    assert!(
                        g.0 >= 1 && g.1 >= 1 && g.2 >= 1 && bl.0 * bl.1 * bl.2 <= 1024,
                        "{}: geometry {g:?} {bl:?}",
                        op.name
                    );
                }
            }
        }
    }
}

fn synthetic(n: usize, seed: u64) -> Dataset {
    let dir = std::env::temp_dir().join(format!("lockstep-twins-{}-{seed}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    lockstep_train::data::write_synthetic(&dir, n, 16, seed).unwrap();
    let d = lockstep_train::data::load_split(&dir, true).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    d
}

/// `fashion_cnn` at `batch`, initialised from `seed`.
fn fashion_cnn(batch: usize, seed: u64) -> Model {
    let mut model = Model::fashion_cnn(batch).unwrap();
    model.init(seed);
    model
}

/// The device engine on the CPU twins for `model` at `batch` and `precision`: `configure` runs
/// on it before `data` (its image size the model's) is uploaded, to be read in the order `idx`.
fn twin_engine(
    (model, batch, precision): (&Model, usize, Precision),
    data: &Dataset,
    idx: &[usize],
    configure: impl FnOnce(&mut Engine<CpuExec>),
) -> Engine<CpuExec> {
    let t = plan::Tensors::new(model, batch, precision).unwrap();
    let mut eng = Engine::new(CpuExec::new(t.arena_len), model, batch, precision).unwrap();
    configure(&mut eng);
    let no_test_set = Dataset {
        rows: data.rows,
        cols: data.cols,
        ..Default::default()
    };
    eng.upload_dataset(data, &no_test_set).unwrap();
    eng.set_index_list(idx, false).unwrap();
    eng
}

/// The run the device-step tests compare with the CPU engine's (with and without clipping):
/// (batch 5, 20 steps, the synthetic images, `fashion_cnn` initialised with seed 42, the order
/// the images are read in: reversed).
fn step_run() -> (usize, usize, Dataset, Model, Vec<usize>) {
    let (batch, steps) = (5usize, 20usize);
    let data = synthetic(batch * steps, 11);
    let idx = (0..data.len()).rev().collect();
    (batch, steps, data, fashion_cnn(batch, 42), idx)
}

/// The device engine's parameters `p` against the CPU engine's model, tensor by tensor (each
/// named with `when`), within the step tests' tolerance. Conv biases feed BatchNorm, which
/// cancels them: their gradient is rounding noise, and Adam normalises noise to full-size steps,
/// so they are left out.
fn params_close(p: &[f32], cpu_model: &Model, when: &str) {
    for e in cpu_model
        .entries
        .iter()
        .filter(|e| !e.name.ends_with(".0.bias"))
    {
        ok(assert_close(
            &format!("{} {when}", e.name),
            &p[e.range.clone()],
            &cpu_model.params[e.range.clone()],
            Tol::new(1e-3, 1e-2),
        ));
    }
}

/// The device engine's whole step, run with the CPU twins, against the CPU engine: 20 steps
/// from the same initialisation on the same batches give the same losses (and parameters).
#[test]
fn device_step_on_twins_matches_the_cpu_engine() {
    let (batch, steps, data, model, idx) = step_run();
    for precision in [Precision::Fp32, Precision::Bf16, Precision::Fp16] {
        let mut eng = twin_engine((&model, batch, precision), &data, &idx, |_| {});
        let mut cpu_model = Model::fashion_cnn(batch).unwrap();
        cpu_model.params.copy_from_slice(&model.params);
        let mut opt = Adam::new(cpu_model.num_params(), 0.005);
        let mut grads = vec![0.0f32; cpu_model.num_params()];
        let (mut dev_losses, mut cpu_losses) = (Vec::new(), Vec::new());
        for s in 0..steps {
            eng.train_step(s * batch, batch, 0.005, None).unwrap();
            dev_losses.push(eng.last_loss().unwrap());
            let chunk = &idx[s * batch..(s + 1) * batch];
            let mut labels = Vec::new();
            load_batch(&mut cpu_model, &data, chunk, &mut labels);
            cpu_model.forward(true);
            cpu_losses.push(cpu_model.loss(&labels).unwrap());
            grads.fill(0.0);
            cpu_model.backward(&labels, &mut grads);
            opt.step(&mut cpu_model.params, &grads);
        }
        if precision == Precision::Fp32 {
            ok(assert_close(
                &format!("fp32 losses over {steps} steps"),
                &dev_losses,
                &cpu_losses,
                Tol::new(1e-4, 1e-3),
            ));
        } else {
            // bf16/fp16 GEMM operands: the first steps agree to rounding; after that the
            // trajectories (lr 0.005 on batches of 5 is a bumpy ride) only have to learn alike.
            // fp16 (11-bit significands, loss scale 65536) is held to the same bound as bf16.
            let what = format!("{precision:?} losses, first 2 steps");
            ok(assert_close(
                &what,
                &dev_losses[..2],
                &cpu_losses[..2],
                Tol::new(2e-2, 5e-2),
            ));
            let tail = |v: &[f32]| v[steps - 5..].iter().sum::<f32>() / 5.0;
            assert!(
                dev_losses.iter().all(|l| l.is_finite()) && tail(&dev_losses) < dev_losses[0],
                "{precision:?} should learn: {dev_losses:?}"
            );
            if precision == Precision::Fp16 {
                let sc = eng.loss_scaler().expect("fp16 has a loss scaler");
                assert_eq!(
                    (sc.skipped(), eng.step),
                    (0, steps as u64),
                    "no overflow at the default scale"
                );
            }
        }
        if precision == Precision::Fp32 {
            let p = eng.params().unwrap();
            params_close(&p, &cpu_model, &format!("after {steps} steps"));
        }
        assert!(
            cpu_losses[steps - 1] < cpu_losses[0],
            "the model should learn: {cpu_losses:?}"
        );
    }
}

/// The schedule is derived from the model, not written for `fashion_cnn`: a different network
/// (strided, padded 3x3 conv, standalone ReLU, overlapping pooling, BatchNorm without ReLU, two
/// linear layers, 5 classes, 12x10 images) run on the twins follows the CPU engine step by step.
#[test]
fn device_step_on_twins_matches_the_cpu_engine_for_another_model() {
    let build = || {
        let layers: Vec<(&str, Box<dyn Layer>)> = vec![
            ("c", Box::new(Conv2d::new(Conv2dParams::new(1, 6, 3, 2, 1)))),
            ("r", Box::new(Relu)),
            ("p", Box::new(MaxPool2d::new(3, 1))),
            ("bn", Box::new(BatchNorm2d::new(6))),
            ("f", Box::new(lockstep_train::ops::Flatten)),
            ("l1", Box::new(Linear::new(72, 16))),
            ("r1", Box::new(Relu)),
            ("l2", Box::new(Linear::new(16, 5))),
        ];
        Model::new(
            layers
                .into_iter()
                .map(|(n, l)| (n.to_string(), l))
                .collect(),
            &[4, 1, 12, 10],
        )
        .unwrap()
    };
    let (batch, steps) = (4usize, 6usize);
    let mut rng = Rng::new(5, 5);
    let data = Dataset {
        images: (0..batch * steps * 120)
            .map(|_| rng.below(256) as u8)
            .collect(),
        labels: (0..batch * steps).map(|_| rng.below(5) as u8).collect(),
        rows: 12,
        cols: 10,
    };
    let mut model = build();
    model.init(7);
    let idx: Vec<usize> = (0..data.len()).collect();
    let mut eng = twin_engine((&model, batch, Precision::Fp32), &data, &idx, |_| {});
    let mut cpu_model = build();
    cpu_model.params.copy_from_slice(&model.params);
    // Adam turns gradients that should cancel to zero (a conv bias whose channel stays on the
    // positive side of the ReLU feeds BatchNorm) into full-size steps of random sign: a large eps
    // on both sides keeps that rounding noise from steering the two trajectories apart.
    eng.adam.eps = 1e-3;
    let mut opt = Adam::new(cpu_model.num_params(), 0.01);
    opt.eps = 1e-3;
    let mut grads = vec![0.0f32; cpu_model.num_params()];
    let (mut dev_losses, mut cpu_losses) = (Vec::new(), Vec::new());
    for s in 0..steps {
        eng.train_step(s * batch, batch, 0.01, None).unwrap();
        dev_losses.push(eng.last_loss().unwrap());
        let input = cpu_model.input_mut();
        input.resize(&[batch, 1, 12, 10]);
        let mut labels = Vec::new();
        for (dst, i) in input
            .data_mut()
            .chunks_exact_mut(120)
            .zip(s * batch..(s + 1) * batch)
        {
            for (d, &p) in dst.iter_mut().zip(data.image(i)) {
                *d = p as f32 / 255.0;
            }
            labels.push(data.labels[i]);
        }
        cpu_model.forward(true);
        cpu_losses.push(cpu_model.loss(&labels).unwrap());
        grads.fill(0.0);
        cpu_model.backward(&labels, &mut grads);
        opt.step(&mut cpu_model.params, &grads);
    }
    ok(assert_close(
        &format!("losses over {steps} steps"),
        &dev_losses,
        &cpu_losses,
        Tol::new(1e-4, 1e-3),
    ));
    let p = eng.params().unwrap();
    for e in &cpu_model.entries {
        ok(assert_close(
            &format!("{} after {steps} steps", e.name),
            &p[e.range.clone()],
            &cpu_model.params[e.range.clone()],
            Tol::new(1e-3, 1e-2),
        ));
    }
    // Evaluation uses the running statistics the device updated.
    let st = eng.exec.read_f32(eng.t.bn_state).unwrap();
    let mut cpu_st = Vec::new();
    for s in cpu_model.state_mut() {
        if let lockstep_train::model::StateMut::F32(_, v) = s {
            cpu_st.extend_from_slice(v);
        }
    }
    ok(assert_close(
        "running statistics",
        &st,
        &cpu_st,
        Tol::new(1e-5, 1e-4),
    ));
}

/// `train_device` end to end on the twins: one short epoch with a partial last batch and an
/// evaluation, reporting sane numbers.
#[test]
fn train_device_runs_an_epoch_on_twins() {
    let data = synthetic(45, 12);
    let test = synthetic(13, 13);
    let cfg = lockstep_train::trainer::TrainConfig {
        epochs: 1,
        batch_size: 8,
        ..Default::default()
    };
    let opts = lockstep_train::device::DeviceOptions {
        loss_every: 2,
        ..Default::default()
    };
    let out = lockstep_train::device::train_device(
        &cfg,
        &opts,
        &data,
        &test,
        |len| Ok(CpuExec::new(len)),
        None,
        &mut lockstep_train::trainer::Silent,
    )
    .unwrap();
    let r = &out.reports[0];
    assert_eq!((r.steps, r.test_count), (6, 13), "{r:?}");
    assert!(
        r.train_loss.is_finite() && r.train_loss > 0.0 && (0.0..=100.0).contains(&r.test_acc),
        "{r:?}"
    );
}

/// fp16's dynamic loss scaling on the twins: a scale of 2^40 overflows the fp16 gradient copies,
/// so the first steps are skipped with the parameters, the Adam moments and the step count
/// bit-unchanged while the scale halves each time; once it is small enough, training proceeds.
#[test]
fn fp16_overflow_skips_steps_then_trains() {
    use lockstep_train::precision::{LossScaler, StepAction};
    let (batch, steps) = (4usize, 50usize);
    let data = synthetic(batch * steps, 13);
    let model = fashion_cnn(batch, 7);
    let init = (1u64 << 40) as f32;
    let idx: Vec<usize> = (0..data.len()).collect();
    let mut eng = twin_engine((&model, batch, Precision::Fp16), &data, &idx, |eng| {
        eng.set_loss_scaler(LossScaler::new(init, 2.0, 0.5, 2000).unwrap())
            .unwrap()
    });
    let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let (mut skipped, mut losses) = (0u64, Vec::new());
    for s in 0..steps {
        let before = (
            bits(eng.params().unwrap()),
            bits(eng.exec.read_f32(eng.t.m).unwrap()),
            eng.step,
        );
        let scale = eng.loss_scaler().unwrap().scale();
        let action = eng.train_step(s * batch, batch, 0.005, None).unwrap();
        losses.push(eng.last_loss().unwrap());
        let sc = *eng.loss_scaler().unwrap();
        if action == StepAction::Skip {
            skipped += 1;
            let after = (
                bits(eng.params().unwrap()),
                bits(eng.exec.read_f32(eng.t.m).unwrap()),
                eng.step,
            );
            assert!(
                after == before,
                "step {s}: a skipped step changed the parameters, the moments or the step count"
            );
            assert_eq!(
                sc.scale(),
                scale / 2.0,
                "step {s}: the scale halves on overflow"
            );
        } else {
            assert_eq!(
                sc.scale(),
                scale,
                "step {s}: no growth within 2000 clean steps"
            );
            assert_eq!(eng.step, before.2 + 1);
        }
    }
    let sc = *eng.loss_scaler().unwrap();
    assert!(
        skipped >= 10,
        "2^40 must overflow fp16 for many steps, {skipped} skipped"
    );
    assert_eq!((sc.skipped(), eng.step), (skipped, steps as u64 - skipped));
    assert!(
        eng.step >= 10,
        "training must proceed once the scale is small enough: {} steps applied",
        eng.step
    );
    let mean5 = |v: &[f32]| v.iter().sum::<f32>() / 5.0;
    assert!(
        losses.iter().all(|l| l.is_finite()) && mean5(&losses[steps - 5..]) < mean5(&losses[..5]),
        "fp16 should learn after the skips: {losses:?}"
    );
}

/// The clipping twins (partial norms, coefficient, scale) against the CPU engine's
/// `clip_grad_norm`: the same norm up to the f32 rounding of the partial norms, gradients scaled
/// only when the norm exceeds the threshold (bit-unchanged otherwise), and a non-finite norm
/// leaves the gradients alone and records the first step it happened at.
#[test]
fn clip_twins_match_clip_grad_norm() {
    use lockstep_train::trainer::clip_grad_norm;
    let np = plan::CLIP_PARTIALS;
    let mut rng = Rng::new(8, 8);
    for n in [1usize, 3, 65, 1001, 70_001, 300_007] {
        for max_norm in [0.5f32, 1e9] {
            let g = rand(&mut rng, n);
            let mut want = g.clone();
            let norm = clip_grad_norm(&mut want, max_norm);
            let (mut parts, mut coef, mut got_norm, mut bad) =
                (vec![0.0f32; np], [0.0f32], [0.0f32], [0i32]);
            twins::grad_norm_partials_f32(&mut parts, &g, n as i32, np as i32);
            twins::grad_norm_coef_f32(
                &mut coef,
                &mut got_norm,
                &mut bad,
                &parts,
                np as i32,
                max_norm,
                3,
            );
            let mut got = g.clone();
            twins::clip_grad_scale_f32(&mut got, &coef, n as i32);
            let what = format!("n={n} max_norm={max_norm}");
            assert!(
                (got_norm[0] as f64 - norm).abs() <= 1e-6 * norm,
                "{what}: norm {} vs {norm}",
                got_norm[0]
            );
            assert_eq!(bad[0], 0, "{what}: a finite norm records no step");
            if norm > max_norm as f64 {
                assert!(coef[0] < 1.0, "{what}: norm {norm} must clip");
                ok(assert_close(&format!("{what} clipped"), &got, &want, TIGHT));
            } else {
                assert_eq!(coef[0], 1.0, "{what}");
                assert!(
                    got.iter().zip(&g).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}: unclipped gradients must not change"
                );
            }
        }
    }
    // inf and NaN: coefficient 1, gradients untouched, the first step kept.
    for bad_value in [f32::INFINITY, f32::NAN] {
        let g = vec![1.0f32, bad_value, -2.0];
        let (mut parts, mut coef, mut nm, mut bad) = (vec![0.0f32; np], [0.0f32], [0.0f32], [0i32]);
        for step in [7, 9] {
            twins::grad_norm_partials_f32(&mut parts, &g, 3, np as i32);
            twins::grad_norm_coef_f32(&mut coef, &mut nm, &mut bad, &parts, np as i32, 1.0, step);
        }
        let mut got = g.clone();
        twins::clip_grad_scale_f32(&mut got, &coef, 3);
        assert_eq!(
            (coef[0], bad[0], got[0], got[2]),
            (1.0, 7, 1.0, -2.0),
            "{bad_value}"
        );
        assert!(
            !nm[0].is_finite(),
            "{bad_value}: the norm is reported as it is"
        );
    }
}

/// The device step with `--clip-grad-norm` on the twins against the CPU engine with the same
/// clipping: a small threshold that clips most steps and a large one that never does, both
/// within the tolerances of `device_step_on_twins_matches_the_cpu_engine`. Without clipping at
/// work the device parameters are bit-identical to a run without clipping (the coefficient is 1).
#[test]
fn device_step_with_clipping_on_twins_matches_the_cpu_engine() {
    // The data, order and length of `device_step_on_twins_matches_the_cpu_engine`.
    let (batch, steps, data, model, idx) = step_run();
    let device = |clip: Option<f32>| {
        let mut eng = twin_engine((&model, batch, Precision::Fp32), &data, &idx, |eng| {
            eng.set_clip_grad_norm(clip).unwrap()
        });
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        for s in 0..steps {
            eng.train_step(s * batch, batch, 0.005, None).unwrap();
            losses.push(eng.last_loss().unwrap());
            norms.extend(eng.last_grad_norm().unwrap());
        }
        eng.check_grad_norm().unwrap();
        (losses, norms, eng.params().unwrap())
    };
    let (_, _, unclipped) = device(None);
    for max_norm in [0.05f32, 1e6] {
        let (dev_losses, dev_norms, p) = device(Some(max_norm));
        let (cpu_losses, cpu_norms, cpu_model) =
            reference::cpu_engine_run(&model, &data, &idx, batch, steps, Some(max_norm));
        let what = format!("clip {max_norm}");
        ok(assert_close(
            &format!("{what}: losses"),
            &dev_losses,
            &cpu_losses,
            Tol::new(1e-4, 1e-3),
        ));
        ok(assert_close(
            &format!("{what}: gradient norms"),
            &dev_norms,
            &cpu_norms,
            Tol::new(1e-5, 1e-3),
        ));
        params_close(&p, &cpu_model, &what);
        let same = p
            .iter()
            .zip(&unclipped)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        if max_norm < 1.0 {
            let clipped = cpu_norms.iter().filter(|&&n| n > max_norm as f64).count();
            assert!(
                clipped >= steps / 2,
                "{what} must clip most steps, clipped {clipped}: norms {cpu_norms:?}"
            );
            assert!(!same, "{what}: clipping changed nothing");
        } else {
            assert!(
                cpu_norms.iter().all(|&n| n < max_norm as f64),
                "{what} must never clip: norms {cpu_norms:?}"
            );
            assert!(same, "{what}: a threshold never reached must leave the parameters bit-identical to no clipping");
        }
    }
}

/// fp16 with clipping: steps that overflow are skipped before any clipping (a clipped inf would
/// record a non-finite norm), and applied steps clip the unscaled gradients (the norm is the
/// fp32 one, not 2^k times it).
#[test]
fn fp16_clipping_runs_after_the_unscale_and_not_on_skipped_steps() {
    use lockstep_train::precision::{LossScaler, StepAction};
    let (batch, steps) = (4usize, 30usize);
    let data = synthetic(batch * steps, 23);
    let model = fashion_cnn(batch, 7);
    let idx: Vec<usize> = (0..data.len()).collect();
    let mut eng = twin_engine((&model, batch, Precision::Fp16), &data, &idx, |eng| {
        eng.set_loss_scaler(LossScaler::new((1u64 << 40) as f32, 2.0, 0.5, 2000).unwrap())
            .unwrap();
        eng.set_clip_grad_norm(Some(0.1)).unwrap();
    });
    let (mut skipped, mut applied_norms) = (0, Vec::new());
    for s in 0..steps {
        match eng.train_step(s * batch, batch, 0.005, None).unwrap() {
            StepAction::Skip => skipped += 1,
            StepAction::Apply => applied_norms.push(eng.last_grad_norm().unwrap().unwrap()),
        }
    }
    eng.check_grad_norm().expect(
        "no clipped step saw a non-finite norm: overflowed steps are skipped before clipping",
    );
    assert!(
        skipped >= 10 && applied_norms.len() >= 5,
        "{skipped} skipped, {} applied",
        applied_norms.len()
    );
    // Norms of the size of the fp32 CPU engine's at the start, not `scale` (>= 2^10) times it:
    // the scale was divided out before the norm.
    let scale = eng.loss_scaler().unwrap().scale();
    let (_, cpu_norms, _) = reference::cpu_engine_run(&model, &data, &idx, batch, 1, Some(0.1));
    assert!(
        scale >= 1024.0
            && applied_norms
                .iter()
                .all(|&n| n.is_finite() && (n as f64) < 10.0 * cpu_norms[0]),
        "unscaled norms expected (fp32 norm at the start {}, scale {scale}): {applied_norms:?}",
        cpu_norms[0]
    );
}

/// A non-finite gradient norm under clipping is reported with the first step it happened at
/// (the CPU engine stops there too); the gradients are left alone, as the CPU engine leaves them.
#[test]
fn clipping_reports_a_non_finite_norm() {
    let batch = 4usize;
    let data = synthetic(batch * 3, 25);
    let model = fashion_cnn(batch, 7);
    let idx: Vec<usize> = (0..data.len()).collect();
    let mut eng = twin_engine((&model, batch, Precision::Fp32), &data, &idx, |eng| {
        assert!(
            eng.set_clip_grad_norm(Some(0.0)).is_err()
                && eng.set_clip_grad_norm(Some(f32::NAN)).is_err()
        );
        eng.set_clip_grad_norm(Some(1.0)).unwrap();
    });
    eng.train_step(0, batch, 0.005, None).unwrap();
    eng.check_grad_norm().unwrap();
    // A NaN weight of the last layer makes its gradients NaN from the next step on.
    let last = model
        .entries
        .iter()
        .rev()
        .find(|e| e.name.ends_with("weight"))
        .unwrap()
        .range
        .start;
    let mut p = eng.params().unwrap();
    p[last] = f32::NAN;
    eng.exec.write_f32(eng.t.params, &p).unwrap();
    eng.train_step(batch, batch, 0.005, None).unwrap();
    eng.train_step(2 * batch, batch, 0.005, None).unwrap();
    let e = eng.check_grad_norm().unwrap_err().to_string();
    assert!(
        e.contains("not finite at optimizer step 2") && e.contains("lower --lr"),
        "{e}"
    );
}
