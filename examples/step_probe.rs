use lockstep::train::model::Model;
use nix::time::{clock_gettime, ClockId};
fn cpu() -> f64 { let t = clock_gettime(ClockId::CLOCK_PROCESS_CPUTIME_ID).unwrap(); t.tv_sec() as f64 + t.tv_nsec() as f64 * 1e-9 }
fn main() {
    let mut m = Model::fashion_cnn(64).unwrap();
    m.init(1);
    for (i, x) in m.input_mut().data_mut().iter_mut().enumerate() { *x = ((i * 7919) % 255) as f32 / 255.0; }
    let labels: Vec<u8> = (0..64).map(|i| (i % 10) as u8).collect();
    let mut g = vec![0.0f32; m.num_params()];
    let reps = 30;
    for _ in 0..3 { m.forward(true); m.loss(&labels).unwrap(); m.backward(&labels, &mut g); }
    let t = cpu();
    for _ in 0..reps { m.forward(true); }
    let f = (cpu() - t) / reps as f64;
    let t = cpu();
    for _ in 0..reps { m.forward(true); m.loss(&labels).unwrap(); g.fill(0.0); m.backward(&labels, &mut g); }
    let s = (cpu() - t) / reps as f64;
    println!("forward {:.2} ms, step {:.2} ms per 64 images; per-rank epoch (469 steps + 79 eval fwd) ~ {:.1} s", f * 1e3, s * 1e3, 469.0 * s + 79.0 * f);
}
