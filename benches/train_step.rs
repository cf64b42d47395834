//! CPU time of one training step (forward + loss + backward) and of one forward pass of the
//! recipe CNN on 64 images, single thread. CPU time rather than wall time, so a loaded machine
//! skews the number less. Run: `cargo bench --bench train_step`.

use lockstep::train::model::Model;
use nix::time::{clock_gettime, ClockId};

fn cpu_s() -> f64 {
    clock_gettime(ClockId::CLOCK_PROCESS_CPUTIME_ID).map(|t| t.tv_sec() as f64 + t.tv_nsec() as f64 * 1e-9).unwrap_or(0.0)
}

fn main() {
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
