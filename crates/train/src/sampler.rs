//! Sharding a dataset across ranks, and counting metrics so every sample counts exactly once.
//!
//! [`DistributedSampler`] mirrors PyTorch's: every epoch a permutation seeded by `seed + epoch`
//! (the same on all ranks), padded by wrapping around to a multiple of the world size, and rank
//! `r` takes positions `r, r + world, ...`. Padding means a few samples are seen twice per epoch
//! in training; for metrics, [`counts_for_metrics`] skips the padded positions (what accelerate's
//! `gather_for_metrics` achieves by truncating the gathered tensor), so the test set counts
//! 10 000 samples whatever the world size.

use super::rng::Rng;
use lockstep::comm::{CommError, Communicator, ReduceOp};

/// PyTorch-style distributed sampler (`drop_last = false`).
#[derive(Clone, Debug)]
pub struct DistributedSampler {
    /// Dataset length.
    pub len: usize,
    /// Number of ranks.
    pub world: usize,
    /// This rank.
    pub rank: usize,
    /// Shuffle every epoch (training) or keep order (evaluation).
    pub shuffle: bool,
    /// Base seed; epoch `e` shuffles with `seed + e`.
    pub seed: u64,
    perm: Vec<usize>,
}

impl DistributedSampler {
    /// A sampler for `rank` of `world` over `len` samples.
    pub fn new(
        len: usize,
        world: usize,
        rank: usize,
        shuffle: bool,
        seed: u64,
    ) -> DistributedSampler {
        DistributedSampler {
            len,
            world: world.max(1),
            rank,
            shuffle,
            seed,
            perm: Vec::with_capacity(len),
        }
    }

    /// Samples per rank: `ceil(len / world)`.
    pub fn num_samples(&self) -> usize {
        self.len.div_ceil(self.world)
    }

    /// This rank's indices for `epoch`, written into `out` (reuses its allocation).
    pub fn indices(&mut self, epoch: u64, out: &mut Vec<usize>) {
        self.perm.clear();
        self.perm.extend(0..self.len);
        if self.shuffle {
            Rng::new(self.seed.wrapping_add(epoch), 0x5a4d).shuffle(&mut self.perm);
        }
        out.clear();
        if self.len == 0 {
            return;
        }
        let total = self.num_samples() * self.world;
        out.extend(
            (self.rank..total)
                .step_by(self.world)
                .map(|pos| self.perm[pos % self.len]),
        );
    }

    /// Whether this rank's `i`-th sample is a real one rather than padding (position < len).
    pub fn is_real(&self, i: usize) -> bool {
        i * self.world + self.rank < self.len
    }
}

/// Sum `(correct, counted)` over ranks, where each rank counted only its real (non-padding)
/// samples. Every rank gets the totals.
pub fn counts_for_metrics(
    comm: &mut Communicator,
    correct: u64,
    counted: u64,
) -> Result<(u64, u64), CommError> {
    let mut buf = [correct as i64, counted as i64];
    comm.all_reduce_in_place(&mut buf[..], ReduceOp::Sum)?;
    Ok((buf[0] as u64, buf[1] as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_sample_counted_once_for_any_world() {
        for len in [0, 1, 7, 10, 64, 10_000, 10_001, 9_999] {
            for world in 1..=4 {
                let mut seen = vec![0u32; len];
                let mut counted = 0;
                for rank in 0..world {
                    let mut s = DistributedSampler::new(len, world, rank, true, 3);
                    let mut idx = Vec::new();
                    s.indices(2, &mut idx);
                    assert_eq!(idx.len(), if len == 0 { 0 } else { s.num_samples() });
                    for (i, &j) in idx.iter().enumerate() {
                        if s.is_real(i) {
                            seen[j] += 1;
                            counted += 1;
                        }
                    }
                }
                assert_eq!(counted, len, "len {len} world {world}");
                assert!(seen.iter().all(|&c| c == 1), "len {len} world {world}");
            }
        }
    }

    #[test]
    fn shuffle_depends_on_epoch_and_matches_across_ranks() {
        let mut a = DistributedSampler::new(100, 2, 0, true, 1);
        let (mut e0, mut e1) = (Vec::new(), Vec::new());
        a.indices(0, &mut e0);
        a.indices(1, &mut e1);
        assert_ne!(e0, e1);
        let mut b = DistributedSampler::new(100, 2, 1, true, 1);
        let mut f0 = Vec::new();
        b.indices(0, &mut f0);
        let mut all: Vec<usize> = e0.iter().chain(&f0).copied().collect();
        all.sort();
        assert_eq!(all, (0..100).collect::<Vec<_>>());
    }
}
