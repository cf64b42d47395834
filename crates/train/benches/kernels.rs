//! GPU time of every kernel launch in the training step of the FashionMNIST CNN
//! (`Model::fashion_cnn`, batch 64), fp32 and bf16: each launch of `Tensors::train_step` is timed
//! alone, back to back, with CUDA events (criterion `iter_custom`), so the figures are device
//! time, not launch overhead. Throughput is the bytes of
//! every region the launch names (read or written once: a lower bound on its traffic), so
//! criterion's GB/s says how close a memory-bound kernel is to the device's bandwidth.
//!
//! Run on a GPU machine: `cargo bench --bench kernels` (filter with e.g. `-- conv2d`). Without a
//! CUDA driver it prints `skipped: no CUDA driver`; with `LOCKSTEP_REQUIRE_GPU=1` that is a failure.

use std::time::Duration;

use criterion::{Criterion, Throughput};
use lockstep_train::device::plan::{Arg, Precision, Tensors};
use lockstep_train::device::{Exec, GpuExec};
use lockstep_train::model::Model;

const BATCH: usize = 64;

fn main() {
    let ctx = match lockstep::cuda::Context::new(0) {
        Ok(c) => c,
        Err(e) => {
            if std::env::var("LOCKSTEP_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                eprintln!("LOCKSTEP_REQUIRE_GPU=1 but no CUDA device is usable: {e}");
                std::process::exit(1);
            }
            println!("skipped: no CUDA driver ({e})");
            return;
        }
    };
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .configure_from_args();
    for precision in [Precision::Fp32, Precision::Bf16] {
        let model = Model::fashion_cnn(BATCH).expect("fashion_cnn builds");
        let t = Tensors::new(&model, BATCH, precision).expect("tensors");
        let mut g = GpuExec::new(&ctx, t.arena_len, false).expect("device arenas");
        // Small finite values everywhere (zeros would make some kernels take short cuts), and a
        // dataset of blank images for the gather (sample ids are 0).
        let pattern = |n: usize, k: usize| {
            (0..n)
                .map(|i| ((i * 7 + k) % 17) as f32 * 0.01 - 0.08)
                .collect::<Vec<f32>>()
        };
        let f = pattern(t.arena_len.0, 0);
        let b: Vec<half::bf16> = pattern(t.arena_len.2, 3)
            .into_iter()
            .map(half::bf16::from_f32)
            .collect();
        g.load_arenas(&f, &vec![0; t.arena_len.1], &b)
            .expect("arenas");
        g.upload_dataset(&vec![0u8; BATCH * 784], &[0u8; BATCH])
            .expect("dataset");
        let ops = t.train_step(BATCH, precision, g.sm_count());
        let (start, end) = (ctx.event().expect("event"), ctx.event().expect("event"));
        let mut group = c.benchmark_group(format!("kernels/{precision:?}"));
        for (k, op) in ops.iter().enumerate() {
            let bytes: usize = op
                .args
                .iter()
                .map(|a| match a {
                    Arg::In(r) | Arg::Out(r) => r.len * r.arena.dtype().size(),
                    _ => 0,
                })
                .sum();
            group.throughput(Throughput::Bytes(bytes as u64));
            group.bench_function(format!("{k:02}_{}", op.name), |bch| {
                bch.iter_custom(|iters| {
                    start.record(g.stream()).expect("record");
                    for _ in 0..iters {
                        g.run(op).expect("launch");
                    }
                    end.record(g.stream()).expect("record");
                    Duration::from_secs_f64(start.elapsed_ms(&end).expect("elapsed") as f64 / 1e3)
                })
            });
        }
        group.finish();
    }
    c.final_summary();
}
