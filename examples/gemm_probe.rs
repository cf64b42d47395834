use lockstep::train::kernels::{matmul, Trans};
use std::time::Instant;
fn bench(name: &str, m: usize, n: usize, k: usize, ta: Trans, tb: Trans, acc: bool, reps: usize) -> f64 {
    let a = vec![0.5f32; m * k];
    let b = vec![0.25f32; k * n];
    let mut d = vec![0.0f32; m * n];
    matmul(m, n, k, &mut d, &a, ta, &b, tb, acc);
    let t = Instant::now();
    for _ in 0..reps { matmul(m, n, k, &mut d, &a, ta, &b, tb, acc); }
    let s = t.elapsed().as_secs_f64();
    println!("{name:50} {:.1} GFLOP/s", 2.0 * (m * n * k * reps) as f64 / s / 1e9);
    s / reps as f64
}
fn main() {
    use Trans::*;
    for s in [1usize, 2, 4, 8, 16] {
        let r = 196 * s;
        let reps = 1200 / s;
        println!("--- S={s}");
        let a = bench("CN fwd W[64,800]·col[800,r]", 64, r, 800, No, No, false, reps);
        let b = bench("CN dW += dY[64,r]·col^T", 64, 800, r, No, Yes, true, reps);
        let c = bench("CN dcol[800,r] = W^T·dY", 800, r, 64, Yes, No, false, reps);
        let d = bench("NC fwd Y[r,64] = col^T[r,800](stored [800,r])·W^T", r, 64, 800, Yes, Yes, false, reps);
        let e = bench("NC fwd Y[r,64] = col[r,800]·W^T", r, 64, 800, No, Yes, false, reps);
        let f = bench("NC dW += dY^T·col[r,800]", 64, 800, r, Yes, No, true, reps);
        let g = bench("NC dcol[r,800] = dY·W", r, 800, 64, No, No, false, reps);
        println!("CN total per img {:.3} ms; NC total per img {:.3} ms", (a + b + c) / s as f64 * 1e3, (e.min(d) + f + g) / s as f64 * 1e3);
    }
}
