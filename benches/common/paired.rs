//! A per-call feature's cost measured inside the ranks, paired: what
//! `benches/baselines/env_ab.py` measures between processes, measured within them, where a
//! machine whose speed drifts between runs cannot mistake the drift for the feature.
//!
//! Two forked ranks run blocks of all-reduces on one communicator, the feature on in one arm and
//! off in two (the second "off" arm is an A/A control), the arms' order turned each block. One
//! communicator for all arms: sub-communicators alike differ in speed by more than the features
//! cost at 8 B (their segments land on other pages), which an A/A pair of them showed. A block's
//! figure is the slower rank's mean time per call; a ratio is the median over blocks of one
//! arm's figure over the "off" arm's in the same block.

use lockstep::comm::{Communicator, ReduceOp};
use lockstep::launch::{launch, LaunchConfig, RankContext, RankResult};

/// How a bench turns its feature on or off on one rank, or why it cannot measure it.
pub type Toggle = fn(&mut Communicator, bool) -> Result<(), String>;

/// The buffers a row's calls pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(dead_code)] // Each bench measures the buffers its feature's cost depends on.
pub enum Bufs {
    /// Ordinary vectors, send and recv apart.
    Ordinary,
    /// One ordinary vector, in place.
    OrdinaryInPlace,
    /// Send and recv in the shared heap (`Communicator::alloc_shared`): the registered path.
    Shared,
    /// One buffer in the shared heap, in place.
    SharedInPlace,
}

impl Bufs {
    fn name(self) -> &'static str {
        match self {
            Bufs::Ordinary => "ordinary",
            Bufs::OrdinaryInPlace => "ordinary in place",
            Bufs::Shared => "shared",
            Bufs::SharedInPlace => "shared in place",
        }
    }
}

/// Blocks per size: `LOCKSTEP_BENCH_BLOCKS` (60 by default).
pub fn blocks() -> usize {
    match std::env::var("LOCKSTEP_BENCH_BLOCKS") {
        Err(_) => 60,
        Ok(v) => match v.parse::<usize>() {
            Ok(b) if b > 0 => b,
            _ => panic!("LOCKSTEP_BENCH_BLOCKS={v:?}: expected a count of blocks, 1 or more"),
        },
    }
}

/// Print one table of the feature's cost in 2-rank f32 sum all-reduces of `sizes` bytes in each
/// of `bufs`. The data are zeros, which a sum in place keeps finite however many calls run.
pub fn run(feature: &str, sizes: &[usize], bufs: &[Bufs], set: Toggle) {
    let blocks = blocks();
    println!(
        "| all_reduce | buffers | {feature} on µs | off µs | off2 µs | on / off | off2 / off (A/A) |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (&bytes, &kind) in sizes.iter().flat_map(|b| bufs.iter().map(move |k| (b, k))) {
        // About the same time per block at every size.
        let calls = ((40 << 20) / bytes.max(1)).clamp(40, 4000);
        let out = launch(
            &LaunchConfig::new(2),
            move |mut ctx: RankContext| -> RankResult<Vec<[f64; 3]>> {
                let len = bytes / 4;
                let c = &mut ctx.comm;
                let shared = matches!(kind, Bufs::Shared | Bufs::SharedInPlace);
                let (mut send, mut recv) = (vec![0f32; len], vec![0f32; len]);
                let (mut ssend, mut srecv) = match shared {
                    true => (
                        Some(c.alloc_shared::<f32>(len)?),
                        Some(c.alloc_shared::<f32>(len)?),
                    ),
                    false => (None, None),
                };
                let mut figures = Vec::with_capacity(blocks);
                for b in 0..blocks {
                    let mut fig = [0f64; 3];
                    for k in 0..3 {
                        // Arm 0 runs the feature, arms 1 and 2 do not.
                        let arm = (b + k) % 3;
                        set(c, arm == 0)?;
                        c.barrier()?;
                        let t = std::time::Instant::now();
                        for _ in 0..calls {
                            match (kind, &mut ssend, &mut srecv) {
                                (Bufs::Ordinary, _, _) => {
                                    c.all_reduce(&send, &mut recv, ReduceOp::Sum)?
                                }
                                (Bufs::OrdinaryInPlace, _, _) => {
                                    c.all_reduce_in_place(&mut send, ReduceOp::Sum)?
                                }
                                (Bufs::Shared, Some(s), Some(r)) => {
                                    c.all_reduce(s, r, ReduceOp::Sum)?
                                }
                                (_, Some(s), _) => c.all_reduce_in_place(s, ReduceOp::Sum)?,
                                _ => unreachable!("shared rows allocate their buffers"),
                            }
                        }
                        fig[arm] = t.elapsed().as_secs_f64() / calls as f64;
                    }
                    // The slower rank's figure, as the ranks wait for each other.
                    c.all_reduce_in_place(&mut fig, ReduceOp::Max)?;
                    figures.push(fig);
                }
                set(c, false)?;
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
            "| {bytes} B | {} | {:.4} | {:.4} | {:.4} | {:.4} | {:.4} |",
            kind.name(),
            col(0),
            col(1),
            col(2),
            ratio(0),
            ratio(2)
        );
    }
}
