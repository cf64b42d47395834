//! Criterion benchmarks of the shared-memory collectives: all_reduce, broadcast, all_gather and
//! reduce_scatter from 8 B to 256 MiB on 2 and 4 ranks, timed inside the ranks.
//!
//! Each sample forks the ranks through the launcher; the ranks warm up, meet at a barrier, run the
//! requested iterations and report the slowest rank's elapsed time, so process start-up and buffer
//! allocation never enter the measurement. Throughput is the per-rank message size (nccl-tests'
//! "size"). Run: `cargo bench --bench collectives` (filter with e.g. `-- shm_all_reduce_2r`).
//! Set `LOCKSTEP_BENCH_QUICK=1` for a reduced size list.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use lockstep::comm::{CollKind, ReduceOp};
use lockstep::launch::{launch, LaunchConfig, RankContext, RankResult};

fn time_in_ranks(nranks: usize, op: CollKind, bytes: usize, iters: u64) -> Duration {
    let cfg = LaunchConfig::new(nranks);
    let out = launch(&cfg, |mut ctx: RankContext| -> RankResult<f64> {
        let n = ctx.world_size;
        let count = (bytes / 4).max(1);
        let (scount, rcount) = match op {
            CollKind::AllGather => (count.div_ceil(n), count.div_ceil(n) * n),
            CollKind::ReduceScatter => (count.div_ceil(n) * n, count.div_ceil(n)),
            _ => (count, count),
        };
        let send = vec![1f32; scount];
        let mut recv = vec![0f32; rcount];
        let c = &mut ctx.comm;
        let mut once = |c: &mut lockstep::Communicator| match op {
            CollKind::AllReduce => c.all_reduce(&send, &mut recv, ReduceOp::Sum),
            CollKind::Broadcast => c.broadcast(&send, &mut recv, 0),
            CollKind::AllGather => c.all_gather(&send, &mut recv),
            CollKind::ReduceScatter => c.reduce_scatter(&send, &mut recv, ReduceOp::Sum),
            _ => c.barrier(),
        };
        once(c)?;
        once(c)?;
        c.barrier()?;
        let t = std::time::Instant::now();
        for _ in 0..iters {
            once(c)?;
        }
        let mut e = [t.elapsed().as_secs_f64()];
        c.all_reduce_in_place(&mut e, ReduceOp::Max)?;
        Ok(e[0])
    })
    .expect("benchmark ranks failed");
    Duration::from_secs_f64(out[0])
}

fn collectives(c: &mut Criterion) {
    let quick = std::env::var("LOCKSTEP_BENCH_QUICK").is_ok_and(|v| v == "1");
    let sizes: Vec<usize> = if quick {
        vec![8, 1 << 20, 64 << 20]
    } else {
        vec![8, 1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
    };
    for nranks in [2usize, 4] {
        for op in [
            CollKind::AllReduce,
            CollKind::Broadcast,
            CollKind::AllGather,
            CollKind::ReduceScatter,
        ] {
            let mut g = c.benchmark_group(format!("shm_{op}_{nranks}r"));
            g.sample_size(10);
            g.warm_up_time(Duration::from_millis(300));
            g.measurement_time(Duration::from_secs(1));
            for &bytes in &sizes {
                g.throughput(Throughput::Bytes(bytes as u64));
                g.bench_with_input(BenchmarkId::from_parameter(bytes), &bytes, |b, &bytes| {
                    b.iter_custom(|iters| time_in_ranks(nranks, op, bytes, iters))
                });
            }
            g.finish();
        }
    }
}

criterion_group!(benches, collectives);
criterion_main!(benches);
