//! Per-layer profile of the CPU trainer, and the CPU time of one training step (forward + loss +
//! backward) and of one forward pass of the FashionMNIST CNN (`Model::fashion_cnn`) on 64 images,
//! single thread. CPU time rather than wall time, so a loaded machine skews the numbers less.
//!
//! Each layer's forward and backward is timed on its own, with the FLOPs counted from its shape
//! (the convention is in `Flops`), and reported in GFLOP/s and as a share of the single-thread
//! FMA peak measured at start by `examples/fma_peak.rs` (included here, so one command gives both).
//! Convolutions count direct-convolution FLOPs (`2 * N * OC * OH * OW * C * KH * KW` per
//! direction), so the Winograd path of conv2 shows as an *effective* rate that may exceed what the
//! arithmetic could do directly. Element-wise layers are bound by memory, not FMAs: their share of
//! the peak says how far from compute-bound they are, and their bytes moved are printed beside.
//!
//! Last, the engine's GEMM shapes and the training step with lockstep's small-product kernels
//! (`microgemm`) against the `gemm` crate alone, alternating in this process.
//!
//! Run: `cargo bench --bench train_step`.

use lockstep_train::gemm::{matmul_ld, set_small_kernels, Trans};
use lockstep_train::model::Model;
use lockstep_train::ops::optim::Adam;
use lockstep_train::ops::{
    Backward, BatchNorm2d, Conv2d, Conv2dParams, Layer, Linear, MaxPool2d, Relu,
    SoftmaxCrossEntropy,
};
use lockstep_train::tensor::Tensor;
use nix::time::{clock_gettime, ClockId};

#[allow(dead_code)] // its `main` is the example's; the bench only calls `measure`
#[path = "../examples/fma_peak.rs"]
mod fma_peak;

fn cpu_s() -> f64 {
    clock_gettime(ClockId::CLOCK_PROCESS_CPUTIME_ID)
        .map(|t| t.tv_sec() as f64 + t.tv_nsec() as f64 * 1e-9)
        .unwrap_or(0.0)
}

/// Repetitions of each timed call (the best of `ROUNDS` means of `REPS` is kept).
const REPS: usize = 10;
const ROUNDS: usize = 3;

/// Minimum over rounds of the mean CPU milliseconds of `f` (the least disturbed round).
fn time_ms(mut f: impl FnMut()) -> f64 {
    f();
    (0..ROUNDS)
        .map(|_| {
            let t = cpu_s();
            for _ in 0..REPS {
                f();
            }
            (cpu_s() - t) / REPS as f64 * 1e3
        })
        .fold(f64::INFINITY, f64::min)
}

/// CPU milliseconds of forward and backward of one layer on `dims` input.
fn layer_ms(l: &mut dyn Layer, dims: &[usize], need_dinp: bool) -> (f64, f64) {
    let np: usize = l.param_specs().iter().map(|s| s.numel()).sum();
    let p: Vec<f32> = (0..np).map(|i| ((i % 13) as f32 - 6.0) * 0.01).collect();
    let mut dp = vec![0.0f32; np];
    let n: usize = dims.iter().product();
    let inp = Tensor::from_vec(
        dims,
        (0..n)
            .map(|i| ((i * 7919) % 255) as f32 / 255.0 - 0.5)
            .collect(),
    )
    .expect("dims");
    let mut out = Tensor::default();
    l.forward(&p, &inp, &mut out, true);
    let dout = Tensor::from_vec(
        out.dims(),
        (0..out.numel())
            .map(|i| ((i * 31) % 17) as f32 * 0.001 - 0.008)
            .collect(),
    )
    .expect("dims");
    let mut dinp = Tensor::default();
    let f = time_ms(|| l.forward(&p, &inp, &mut out, true));
    let b = time_ms(|| {
        l.backward(Backward {
            p: &p,
            dp: &mut dp,
            inp: &inp,
            out: &out,
            dout: &dout,
            dinp: if need_dinp { Some(&mut dinp) } else { None },
        })
    });
    (f, b)
}

/// FLOPs and bytes of one layer's forward and backward at its input shape.
struct Flops {
    fwd: f64,
    bwd: f64,
    /// Bytes the forward and backward read and write at least once (activations, gradients).
    bytes: f64,
}

/// FLOP counts: a multiply-add is 2; BatchNorm forward 5 per element (sum, square-sum, then
/// `x * scale + shift` after the centring) and backward 8; ReLU 1 each way; max-pool 3 compares
/// per output forward and 1 per input backward; softmax cross-entropy 5 per logit; Adam 12 per
/// parameter (moments, square root, divide, update).
fn flops(
    kind: &str,
    inp: &[usize],
    out: &[usize],
    conv: Option<&Conv2dParams>,
    dinp: bool,
) -> Flops {
    let (ni, no) = (
        inp.iter().product::<usize>() as f64,
        out.iter().product::<usize>() as f64,
    );
    let bytes = 4.0 * (2.0 * ni + 2.0 * no);
    let (fwd, bwd) = match (kind, conv) {
        ("conv2d", Some(cp)) => {
            let d = 2.0 * no * cp.k() as f64;
            (d, if dinp { 2.0 * d } else { d })
        }
        ("linear", _) => {
            let d = 2.0 * ni * out[1] as f64;
            (d, if dinp { 2.0 * d } else { d })
        }
        ("batchnorm2d", _) => (5.0 * ni, 8.0 * ni),
        ("relu", _) => (ni, ni),
        ("maxpool2d", _) => (3.0 * no, ni),
        _ => (0.0, 0.0),
    };
    Flops { fwd, bwd, bytes }
}

/// Name, layer, input dimensions, whether backward computes the input gradient.
type Case = (&'static str, Box<dyn Layer>, Vec<usize>, bool);

/// A [`Case`] from a layer value.
fn case(name: &'static str, l: impl Layer, dims: &[usize], need_dinp: bool) -> Case {
    (name, Box::new(l), dims.to_vec(), need_dinp)
}

/// One training step of `m` on its current input: forward, loss, backward into `g` (zeroed
/// first).
fn step(m: &mut Model, labels: &[u8], g: &mut [f32]) {
    m.forward(true);
    m.loss(labels).expect("labels in range");
    g.fill(0.0);
    m.backward(labels, g);
}

/// CPU seconds of one evaluation forward pass and of one training [`step`] of `m`.
fn forward_and_step_s(m: &mut Model, labels: &[u8], g: &mut [f32]) -> (f64, f64) {
    let f = time_ms(|| m.forward(false)) * 1e-3;
    let s = time_ms(|| step(m, labels, g)) * 1e-3;
    (f, s)
}

fn main() {
    // The peak first, on an idle-as-possible core: best of 9 rounds of 0.2 s.
    let peak = fma_peak::measure(0.2);
    println!(
        "fma peak: {} {:.1} GFLOP/s best, {:.1} median (1 thread)",
        peak.kind, peak.best, peak.median
    );
    let conv = |i, o| Conv2dParams::new(i, o, 5, 1, 2);
    let (c1, c2) = (conv(1, 32), conv(32, 64));
    // Backward as in the model: the first layer needs no input gradient. conv2 is also timed
    // without it, which isolates the weight gradient (the difference is the input gradient).
    let layers: Vec<Case> = vec![
        case("conv1", Conv2d::new(c1), &[64, 1, 28, 28], false),
        case("bn1", BatchNorm2d::new(32), &[64, 32, 28, 28], true),
        case("relu1", Relu, &[64, 32, 28, 28], true),
        case("pool1", MaxPool2d::new(2, 2), &[64, 32, 28, 28], true),
        case("conv2", Conv2d::new(c2), &[64, 32, 14, 14], true),
        case("conv2.wgrad", Conv2d::new(c2), &[64, 32, 14, 14], false),
        case("bn2", BatchNorm2d::new(64), &[64, 64, 14, 14], true),
        case("relu2", Relu, &[64, 64, 14, 14], true),
        case("pool2", MaxPool2d::new(2, 2), &[64, 64, 14, 14], true),
        case("linear1", Linear::new(3136, 64), &[64, 3136], true),
        case("relu3", Relu, &[64, 64], true),
        case("linear2", Linear::new(64, 10), &[64, 64], true),
    ];
    println!(
        "{:12} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>7} {:>7} {:>8}",
        "layer",
        "fwd ms",
        "bwd ms",
        "fwd MFLOP",
        "bwd MFLOP",
        "fwd GF/s",
        "bwd GF/s",
        "fwd %pk",
        "bwd %pk",
        "fwd GB/s"
    );
    let (mut tf, mut tb, mut ff, mut fb) = (0.0, 0.0, 0.0, 0.0);
    for (name, mut l, dims, d) in layers {
        let (f, b) = layer_ms(l.as_mut(), &dims, d);
        let out = l.out_dims(&dims).expect("the fashion_cnn shapes chain");
        let cp = if name.starts_with("conv1") {
            Some(&c1)
        } else if name.starts_with("conv2") {
            Some(&c2)
        } else {
            None
        };
        let fl = flops(l.kind(), &dims, &out, cp, d);
        let (gf, gb) = (fl.fwd / f * 1e-6, fl.bwd / b * 1e-6);
        println!(
            "{name:12} {f:9.3} {b:9.3} {:9.1} {:9.1} {gf:8.1} {gb:8.1} {:6.1}% {:6.1}% {:8.1}",
            fl.fwd * 1e-6,
            fl.bwd * 1e-6,
            100.0 * gf / peak.best,
            100.0 * gb / peak.best,
            fl.bytes / 2.0 / f * 1e-6
        );
        if name != "conv2.wgrad" {
            (tf, tb, ff, fb) = (tf + f, tb + b, ff + fl.fwd, fb + fl.bwd);
        }
    }
    // Loss and optimizer, at fashion_cnn's sizes.
    let logits = Tensor::from_vec(
        &[64, 10],
        (0..640).map(|i| ((i * 13) % 7) as f32 * 0.3).collect(),
    )
    .expect("dims");
    let labels: Vec<u8> = (0..64).map(|i| (i % 10) as u8).collect();
    let mut ce = SoftmaxCrossEntropy::default();
    let mut dl = Tensor::default();
    let lf = time_ms(|| {
        std::hint::black_box(ce.forward(&logits, &labels));
    });
    let lb = time_ms(|| ce.backward(&mut dl, logits.dims(), &labels));
    println!(
        "{:12} {lf:9.3} {lb:9.3} {:9.3} {:9.3}",
        "loss",
        5.0 * 640.0 * 1e-6,
        640.0 * 1e-6
    );
    let mut m = Model::fashion_cnn(64).expect("fashion_cnn builds");
    m.init(1);
    let np = m.num_params();
    let mut adam = Adam::new(np, 0.005);
    let (mut params, grads) = (m.params.clone(), vec![1e-3f32; np]);
    let ad = time_ms(|| adam.step(&mut params, &grads));
    println!(
        "{:12} {ad:9.3} {:>9} {:9.2} {:>9} {:8.1} ({np} parameters)",
        "adam",
        "-",
        12.0 * np as f64 * 1e-6,
        "-",
        12.0 * np as f64 / ad * 1e-6
    );
    let all = ff + fb;
    println!(
        "layers total: forward {tf:.2} ms, backward {tb:.2} ms; {:.1} MFLOP (direct-convolution count) per 64 images, {:.1} GFLOP/s effective = {:.1}% of peak",
        all * 1e-6,
        all / (tf + tb) * 1e-6,
        100.0 * all / (tf + tb) * 1e-6 / peak.best
    );

    for (i, x) in m.input_mut().data_mut().iter_mut().enumerate() {
        *x = ((i * 7919) % 255) as f32 / 255.0;
    }
    let mut g = vec![0.0f32; np];
    for _ in 0..3 {
        step(&mut m, &labels, &mut g);
    }
    let (f, s) = forward_and_step_s(&mut m, &labels, &mut g);
    println!(
        "train_step_cpu: forward {:.2} ms, step {:.2} ms per 64 images; one rank of a 2-rank epoch (469 steps + 79 eval batches) ~ {:.1} s CPU",
        f * 1e3,
        s * 1e3,
        469.0 * s + 79.0 * f
    );
    // The same with BatchNorm + ReLU + pool as three separate layers, right after, for the
    // fusion's before/after in one machine state.
    m.set_fusion(false);
    let (fu, su) = forward_and_step_s(&mut m, &labels, &mut g);
    println!(
        "train_step_cpu unfused: forward {:.2} ms, step {:.2} ms (fused saves {:.1} %)",
        fu * 1e3,
        su * 1e3,
        100.0 * (1.0 - s / su)
    );

    m.set_fusion(true);
    gemm_paths(&mut m, &labels, &mut g, peak.best);
}

/// A GEMM of the engine: name, m, n, k, how A and B are stored, row strides of dst, A, B.
type Shape = (
    &'static str,
    usize,
    usize,
    usize,
    Trans,
    Trans,
    usize,
    usize,
    usize,
);

/// The engine's GEMM shapes (per call) and the whole step, with the small-product kernels on and
/// off in turn: 5 alternations, min and median of each.
fn gemm_paths(m: &mut Model, labels: &[u8], g: &mut [f32], peak: f64) {
    let ts = |c: usize| 64 * c + 16; // Winograd tile stride (64 positions + a cache line)
    let shapes: [Shape; 5] = [
        (
            "winograd fwd 32x64x32",
            32,
            64,
            32,
            Trans::No,
            Trans::No,
            ts(64),
            ts(32),
            64,
        ),
        (
            "winograd dW 32x64x32",
            32,
            64,
            32,
            Trans::Yes,
            Trans::No,
            64,
            ts(32),
            ts(64),
        ),
        (
            "winograd dX 32x32x64",
            32,
            32,
            64,
            Trans::No,
            Trans::No,
            ts(32),
            ts(64),
            32,
        ),
        (
            "conv1 fwd 32x784x25",
            32,
            784,
            25,
            Trans::No,
            Trans::No,
            784,
            25,
            784,
        ),
        (
            "conv1 dW 25x32x784",
            25,
            32,
            784,
            Trans::No,
            Trans::Yes,
            32,
            784,
            784,
        ),
    ];
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        (v[0], v[v.len() / 2])
    };
    println!(
        "{:24} {:>14} {:>14} {:>8}",
        "gemm shape (us/call)", "microgemm", "gemm crate", "ratio"
    );
    for (name, mm, n, k, ta, tb, ldd, lda, ldb) in shapes {
        let (ar, br) = (
            if ta == Trans::No { mm } else { k },
            if tb == Trans::No { k } else { n },
        );
        let a: Vec<f32> = (0..ar * lda)
            .map(|i| ((i % 7) as f32 - 3.0) * 0.1)
            .collect();
        let b: Vec<f32> = (0..br * ldb)
            .map(|i| ((i % 5) as f32 - 2.0) * 0.1)
            .collect();
        let mut d = vec![0.0f32; mm * ldd];
        let reps = (20_000_000 / (mm * n * k)).max(10);
        let (mut on, mut off) = (Vec::new(), Vec::new());
        for round in 0..10 {
            set_small_kernels(round % 2 == 0);
            let t = cpu_s();
            for _ in 0..reps {
                matmul_ld(
                    (mm, n, k),
                    (&mut d, ldd),
                    (&a, lda, ta),
                    (&b, ldb, tb),
                    true,
                );
            }
            let us = (cpu_s() - t) / reps as f64 * 1e6;
            if round % 2 == 0 {
                on.push(us)
            } else {
                off.push(us)
            }
        }
        let (fl, (on_min, _), (off_min, _)) =
            (2.0 * (mm * n * k) as f64, med(&mut on), med(&mut off));
        println!(
            "{name:24} {on_min:6.2} {:5.1}% {off_min:6.2} {:5.1}% {:7.2}x",
            100.0 * fl / on_min * 1e-3 / peak,
            100.0 * fl / off_min * 1e-3 / peak,
            off_min / on_min
        );
    }
    let (mut on, mut off) = (Vec::new(), Vec::new());
    for round in 0..10 {
        set_small_kernels(round % 2 == 0);
        let s = time_ms(|| step(m, labels, g));
        if round % 2 == 0 {
            on.push(s)
        } else {
            off.push(s)
        }
    }
    set_small_kernels(true);
    let ((a0, a1), (b0, b1)) = (med(&mut on), med(&mut off));
    println!("train_step_cpu microgemm: step {a0:.2} / {a1:.2} ms (min / median of 5), gemm crate alone {b0:.2} / {b1:.2} ms ({:.1} % less by the medians)", 100.0 * (1.0 - a1 / b1));
}
