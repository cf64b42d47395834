//! Collectives and the launcher only: builds with `--no-default-features` (no training engine,
//! no CLI), which is what a framework that links lockstep for its communicator needs.
//!
//! ```sh
//! cargo run --release --no-default-features --example collectives
//! ```
//!
//! Forks 3 ranks, averages a gradient-sized buffer in a shared segment (zero-copy), gathers each
//! rank's summary as a serde value, and checks the results in the parent.

use lockstep::launch::{launch, LaunchConfig, RankContext, RankResult};
use lockstep::ReduceOp;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let world = 3;
    let len = 1 << 20;
    // A captured value moved into the rank function: each forked rank gets its own copy.
    let label = String::from("grad");
    let results = launch(
        &LaunchConfig::new(world),
        move |mut ctx: RankContext| -> RankResult<(String, usize, f32)> {
            let mut grad = ctx.comm.alloc_shared::<f32>(len)?;
            grad.fill(ctx.rank as f32);
            ctx.comm.all_reduce_in_place(&mut grad, ReduceOp::Avg)?;
            // Ordinary Vecs work too (staged through the segment).
            let mut everyone = vec![0i32; ctx.world_size];
            ctx.comm.all_gather(&[ctx.rank as i32], &mut everyone)?;
            ctx.comm.barrier()?;
            Ok((label, everyone.iter().sum::<i32>() as usize, grad[len - 1]))
        },
    )?;
    let mean = (0..world).sum::<usize>() as f32 / world as f32;
    for (rank, (label, ranks_sum, value)) in results.iter().enumerate() {
        println!("rank {rank}: {label} mean {value} (expected {mean}), sum of ranks {ranks_sum}");
        if *value != mean || *ranks_sum != (0..world).sum::<usize>() {
            return Err(format!("rank {rank} got a wrong result").into());
        }
    }
    Ok(())
}
