//! CPU time of one training step (forward + loss + backward) and of one forward pass of the
//! recipe CNN on 64 images, single thread. CPU time rather than wall time, so a loaded machine
//! skews the number less. Run: `cargo bench --bench train_step`.

use lockstep::train::layers::{BatchNorm2d, Conv2d, Conv2dParams, Layer, Linear, MaxPool2d, Relu};
use lockstep::train::model::Model;
use lockstep::train::tensor::Tensor;
use nix::time::{clock_gettime, ClockId};

fn cpu_s() -> f64 {
    clock_gettime(ClockId::CLOCK_PROCESS_CPUTIME_ID).map(|t| t.tv_sec() as f64 + t.tv_nsec() as f64 * 1e-9).unwrap_or(0.0)
}

/// CPU milliseconds of forward and backward of one layer on `dims` input.
fn layer_ms(l: &mut dyn Layer, dims: &[usize], need_dinp: bool) -> (f64, f64) {
    let np: usize = l.param_specs().iter().map(|s| s.numel()).sum();
    let p: Vec<f32> = (0..np).map(|i| ((i % 13) as f32 - 6.0) * 0.01).collect();
    let mut dp = vec![0.0f32; np];
    let n: usize = dims.iter().product();
    let inp = Tensor::from_vec(dims, (0..n).map(|i| ((i * 7919) % 255) as f32 / 255.0 - 0.5).collect()).expect("dims");
    let mut out = Tensor::default();
    l.forward(&p, &inp, &mut out, true);
    let dout = Tensor::from_vec(out.dims(), vec![0.01; out.numel()]).expect("dims");
    let mut dinp = Tensor::default();
    let reps = 20;
    let t = cpu_s();
    for _ in 0..reps {
        l.forward(&p, &inp, &mut out, true);
    }
    let f = (cpu_s() - t) / reps as f64 * 1e3;
    let t = cpu_s();
    for _ in 0..reps {
        l.backward(&p, &mut dp, &inp, &out, &dout, if need_dinp { Some(&mut dinp) } else { None });
    }
    (f, (cpu_s() - t) / reps as f64 * 1e3)
}

/// Name, layer, input dimensions, whether backward computes the input gradient.
type Case = (&'static str, Box<dyn Layer>, Vec<usize>, bool);

fn main() {
    let conv = |i, o| Conv2d::new(Conv2dParams { in_c: i, out_c: o, kh: 5, kw: 5, stride: 1, pad: 2 });
    let layers: Vec<Case> = vec![
        ("conv1", Box::new(conv(1, 32)), vec![64, 1, 28, 28], false),
        ("bn1", Box::new(BatchNorm2d::new(32)), vec![64, 32, 28, 28], true),
        ("relu1", Box::new(Relu), vec![64, 32, 28, 28], true),
        ("pool1", Box::new(MaxPool2d::new(2, 2)), vec![64, 32, 28, 28], true),
        ("conv2", Box::new(conv(32, 64)), vec![64, 32, 14, 14], true),
        ("bn2", Box::new(BatchNorm2d::new(64)), vec![64, 64, 14, 14], true),
        ("linear1", Box::new(Linear::new(3136, 64)), vec![64, 3136], true),
    ];
    for (name, mut l, dims, d) in layers {
        let (f, b) = layer_ms(l.as_mut(), &dims, d);
        println!("layer {name:8} forward {f:6.2} ms  backward {b:6.2} ms");
    }
    let mut m = Model::fashion_cnn(64).expect("the recipe model builds");
    m.init(1);
    for (i, x) in m.input_mut().data_mut().iter_mut().enumerate() {
        *x = ((i * 7919) % 255) as f32 / 255.0;
    }
    let labels: Vec<u8> = (0..64).map(|i| (i % 10) as u8).collect();
    let mut g = vec![0.0f32; m.num_params()];
    let reps = 30;
    for _ in 0..3 {
        m.forward(true);
        m.loss(&labels).expect("labels in range");
        m.backward(&labels, &mut g);
    }
    let t = cpu_s();
    for _ in 0..reps {
        m.forward(false);
    }
    let f = (cpu_s() - t) / reps as f64;
    let t = cpu_s();
    for _ in 0..reps {
        m.forward(true);
        m.loss(&labels).expect("labels in range");
        g.fill(0.0);
        m.backward(&labels, &mut g);
    }
    let s = (cpu_s() - t) / reps as f64;
    println!(
        "train_step_cpu: forward {:.2} ms, step {:.2} ms per 64 images; one rank of a 2-rank epoch (469 steps + 79 eval batches) ~ {:.1} s CPU",
        f * 1e3,
        s * 1e3,
        469.0 * s + 79.0 * f
    );
}
