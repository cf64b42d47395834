//! The flight recorder's cost inside the ranks, paired: what `benches/baselines/env_ab.py`
//! measures between processes, measured within them, where a machine whose speed drifts between
//! runs cannot mistake the drift for the recorder.
//!
//! Two forked ranks make three sub-communicators of the same ranks alike (`split`): one with the
//! recorder on (`LOCKSTEP_TRACE_BUFFER` unset: the default) and two with it off (`0`, the second
//! an A/A control), an "off" one made first (the first sub-communicator made was the slowest at
//! 1 MiB whatever its recorder). Blocks of calls then alternate between them, the order turned
//! each block; a block's figure is the slower rank's mean time per call. A ratio is the median
//! over blocks of one communicator's figure over the "off" one's in the same block.
//!
//! ```sh
//! cargo bench --bench recorder              # all_reduce, 8 B and 1 MiB, 2 ranks
//! LOCKSTEP_BENCH_BLOCKS=200 cargo bench --bench recorder
//! ```

use lockstep::comm::{Communicator, ReduceOp};
use lockstep::launch::{launch, LaunchConfig, RankContext, RankResult};

/// A sub-communicator of all of `c`'s ranks, its recorder as `buffer` says (`None`: the default).
fn alike(c: &mut Communicator, buffer: Option<&str>) -> RankResult<Communicator> {
    match buffer {
        // The ranks are forked and single-threaded: nothing reads the environment meanwhile.
        Some(v) => std::env::set_var("LOCKSTEP_TRACE_BUFFER", v),
        None => std::env::remove_var("LOCKSTEP_TRACE_BUFFER"),
    }
    let rank = c.rank() as i64;
    let sub = c.split(Some(0), rank)?;
    std::env::remove_var("LOCKSTEP_TRACE_BUFFER");
    Ok(sub.ok_or("split with a color returned no communicator")?)
}

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
                // Made "off" first: the first sub-communicator must not be the one measured.
                let off = alike(&mut ctx.comm, Some("0"))?;
                let on = alike(&mut ctx.comm, None)?;
                let off2 = alike(&mut ctx.comm, Some("0"))?;
                let mut comms = [on, off, off2];
                let send = vec![1f32; bytes / 4];
                let mut recv = vec![0f32; bytes / 4];
                let mut figures = Vec::with_capacity(blocks);
                for b in 0..blocks {
                    let mut fig = [0f64; 3];
                    for k in 0..3 {
                        let i = (b + k) % 3;
                        let c = &mut comms[i];
                        c.barrier()?;
                        let t = std::time::Instant::now();
                        for _ in 0..calls {
                            c.all_reduce(&send, &mut recv, ReduceOp::Sum)?;
                        }
                        fig[i] = t.elapsed().as_secs_f64() / calls as f64;
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
