//! The flight recorder's cost inside the ranks, paired: what `benches/baselines/env_ab.py`
//! measures between processes, measured within them, where a machine whose speed drifts between
//! runs cannot mistake the drift for the recorder.
//!
//! Two forked ranks run blocks of calls on one communicator, the recorder on in one arm and
//! paused in two (`Communicator::set_trace`; the second "off" arm is an A/A control), the arms'
//! order turned each block. One communicator for all arms: sub-communicators alike differ in
//! speed by more than the recorder costs at 8 B (their segments land on other pages), which an
//! A/A pair of them showed. A block's figure is the slower rank's mean time per call; a ratio is
//! the median over blocks of one arm's figure over the "off" arm's in the same block.
//!
//! ```sh
//! cargo bench --bench recorder              # all_reduce, 8 B and 1 MiB, 2 ranks
//! LOCKSTEP_BENCH_BLOCKS=200 cargo bench --bench recorder
//! ```

use lockstep::comm::ReduceOp;
use lockstep::launch::{launch, LaunchConfig, RankContext, RankResult};

fn main() {
    let blocks: usize = std::env::var("LOCKSTEP_BENCH_BLOCKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60);
    println!("| all_reduce | on µs | off µs | off2 µs | on / off | off2 / off (A/A) |");
    println!("|---|---|---|---|---|---|");
    for bytes in [8usize, 1 << 20] {
        let calls = if bytes <= 64 { 4000 } else { 40 };
        let out = launch(
            &LaunchConfig::new(2),
            move |mut ctx: RankContext| -> RankResult<Vec<[f64; 3]>> {
                if ctx.comm.trace_reader().is_none() {
                    return Err("the flight recorder is off (LOCKSTEP_TRACE_BUFFER=0): unset it to measure its cost".into());
                }
                let send = vec![1f32; bytes / 4];
                let mut recv = vec![0f32; bytes / 4];
                let mut figures = Vec::with_capacity(blocks);
                for b in 0..blocks {
                    let mut fig = [0f64; 3];
                    for k in 0..3 {
                        // Arm 0 records, arms 1 and 2 do not.
                        let arm = (b + k) % 3;
                        ctx.comm.set_trace(arm == 0);
                        ctx.comm.barrier()?;
                        let t = std::time::Instant::now();
                        for _ in 0..calls {
                            ctx.comm.all_reduce(&send, &mut recv, ReduceOp::Sum)?;
                        }
                        fig[arm] = t.elapsed().as_secs_f64() / calls as f64;
                    }
                    // The slower rank's figure, as the ranks wait for each other.
                    ctx.comm.all_reduce_in_place(&mut fig, ReduceOp::Max)?;
                    figures.push(fig);
                }
                Ok(figures)
            },
        )
        .expect("benchmark ranks failed");
        let figs = &out[0];
        let median = |mut v: Vec<f64>| {
            v.sort_by(|a, b| a.total_cmp(b));
            v[v.len() / 2]
        };
        let col = |i: usize| median(figs.iter().map(|f| f[i] * 1e6).collect());
        let ratio = |i: usize| median(figs.iter().map(|f| f[i] / f[1]).collect());
        println!(
            "| {bytes} B | {:.4} | {:.4} | {:.4} | {:.4} | {:.4} |",
            col(0),
            col(1),
            col(2),
            ratio(0),
            ratio(2)
        );
    }
}
