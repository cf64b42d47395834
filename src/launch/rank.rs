//! What a rank's function receives ([`RankContext`]) and returns ([`RankResult`]), and the
//! per-rank helpers of Accelerate's `Accelerator` on it: who is main, print and save on the main
//! process only, main-process-first sections, `wait_for_everyone`, scalar `reduce` and
//! `gather_for_metrics`. Accelerate's `set_seed` belongs to the training engine
//! (`lockstep_train::set_seed`, crates/train), beside the generators it seeds.
//!
//! The helpers are collective exactly where Accelerate's are: `main_process_first`,
//! `local_main_process_first`, `wait_for_everyone`, `reduce` and `gather_for_metrics` must be
//! called by every rank at the same point of its sequence of collective calls; `print` and `save`
//! are local (they do nothing off the main process) and never wait.

use std::fmt::Display;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::comm::{CommError, Communicator, Element, ReduceOp};
use crate::types::CollKind;

/// What a rank's function returns: a value, or any error (converted with `?`).
pub type RankResult<R> = Result<R, Box<dyn std::error::Error + Send + Sync>>;

/// What each rank's function receives.
#[derive(Debug)]
pub struct RankContext {
    /// Global rank.
    pub rank: usize,
    /// Rank within this node.
    pub local_rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// A communicator joined by every rank.
    pub comm: Communicator,
}

/// A file the main process could not save.
#[derive(Debug, thiserror::Error)]
#[error("saving {}: {source}; check that its directory exists and is writable, and that the path names a file", .path.display())]
pub struct SaveError {
    /// The path asked for.
    pub path: PathBuf,
    /// What the file system said, and at which step.
    #[source]
    pub source: crate::types::WriteError,
}

impl RankContext {
    /// Whether this is the main process of the job (global rank 0): the one that prints, saves
    /// and downloads.
    pub fn is_main_process(&self) -> bool {
        self.rank == 0
    }

    /// Whether this is the main process of its node (local rank 0): the one that prepares
    /// node-local files, such as a dataset in a node-local cache.
    pub fn is_local_main_process(&self) -> bool {
        self.local_rank == 0
    }

    /// Write `msg` and a newline to standard output on the main process only (Accelerate's
    /// `accelerator.print`); other ranks do nothing.
    ///
    /// The library never prints on its own account: its diagnostics go through `tracing`. This
    /// method is the exception because printing is what the caller asked for, as with
    /// `println!`, and the point of the helper is to do it once per job instead of once per rank.
    /// A write error (standard output closed) is returned rather than panicking as `println!`
    /// would; use [`print_to`](Self::print_to) to write elsewhere.
    pub fn print(&self, msg: impl Display) -> std::io::Result<()> {
        if !self.is_main_process() {
            return Ok(());
        }
        let mut out = std::io::stdout().lock();
        self.print_to(&mut out, msg)?;
        out.flush()
    }

    /// [`print`](Self::print) to any writer: `msg` and a newline on the main process only.
    pub fn print_to(&self, w: &mut dyn Write, msg: impl Display) -> std::io::Result<()> {
        if self.is_main_process() {
            writeln!(w, "{msg}")?;
        }
        Ok(())
    }

    /// Save `contents` at `path` from the main process only (Accelerate's `accelerator.save`);
    /// other ranks do nothing and return `Ok(false)` at once. The main process returns `Ok(true)`
    /// once the file is complete and durable.
    ///
    /// The write is atomic: readers see the old file or the whole new one, never a part
    /// ([`write_atomic`](crate::types::write_atomic)). Not collective: a rank that reads the file afterwards calls
    /// [`wait_for_everyone`](Self::wait_for_everyone) after the save first.
    pub fn save(
        &self,
        path: impl AsRef<Path>,
        contents: impl AsRef<[u8]>,
    ) -> Result<bool, SaveError> {
        if !self.is_main_process() {
            return Ok(false);
        }
        let path = path.as_ref();
        crate::types::write_atomic(path, contents.as_ref(), 0o644).map_err(|source| SaveError {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(true)
    }

    /// Run `f` on the main process first, then on every other rank (Accelerate's
    /// `main_process_first`): the main process downloads or preprocesses, the others then find
    /// the result in place. Collective: every rank calls it. The others wait at a barrier while
    /// the main process runs `f`; after `f`, every rank meets at a second barrier, so when this
    /// returns on any rank, `f` has finished on all of them.
    ///
    /// If `f` fails on the main process, return its error from `f` (as `R`) rather than leaving
    /// the process: the others still get their turn, and the caller decides. A rank that dies in
    /// `f` makes the others' barrier fail with [`CommError::PeerLost`].
    pub fn main_process_first<R>(&mut self, f: impl FnOnce() -> R) -> Result<R, CommError> {
        let first = self.is_main_process();
        self.goes_first(first, f)
    }

    /// [`main_process_first`](Self::main_process_first) per node: local rank 0 of every node runs
    /// `f` first (for node-local files), then the other ranks. Collective over the whole job.
    pub fn local_main_process_first<R>(&mut self, f: impl FnOnce() -> R) -> Result<R, CommError> {
        let first = self.is_local_main_process();
        self.goes_first(first, f)
    }

    fn goes_first<R>(&mut self, first: bool, f: impl FnOnce() -> R) -> Result<R, CommError> {
        let r = if first {
            let r = f();
            self.comm.barrier()?;
            r
        } else {
            self.comm.barrier()?;
            f()
        };
        self.comm.barrier()?;
        Ok(r)
    }

    /// Wait until every rank has reached this call (Accelerate's `wait_for_everyone`, a barrier).
    pub fn wait_for_everyone(&mut self) -> Result<(), CommError> {
        self.comm.barrier()
    }

    /// Reduce a scalar metric over all ranks; every rank gets the result (Accelerate's
    /// `reduce`, e.g. a loss summed or averaged over ranks). Collective.
    pub fn reduce<T: Element>(&mut self, value: T, op: ReduceOp) -> Result<T, CommError> {
        let mut v = [value];
        self.comm.all_reduce_in_place(&mut v[..], op)?;
        Ok(v[0])
    }

    /// Gather a per-sample metric tensor from every rank for the whole evaluation set, without
    /// the sampler's padding (Accelerate's `gather_for_metrics`). Collective.
    ///
    /// The data must be sharded as `lockstep_train::sampler::DistributedSampler` (and PyTorch's) does it:
    /// the `dataset_len` positions of the epoch's order are padded by wrapping around to a
    /// multiple of the world size, and rank `r` takes positions `r, r + world, r + 2 world, ...`
    /// (`ceil(dataset_len / world)` per rank, the same on every rank). `local` holds `item_len`
    /// values per sample for this rank's shard positions `first, first + 1, ...` (the whole shard
    /// with `first = 0`, or one batch of it). The result holds the values of every real sample
    /// of those positions of every rank, in the order of the epoch (dataset order for an
    /// unshuffled sampler): each sample exactly once, the padded duplicates dropped. Every rank
    /// gets the same result. Uses one `all_gather_v`.
    pub fn gather_for_metrics<T: Element>(
        &mut self,
        local: &[T],
        item_len: usize,
        dataset_len: usize,
        first: usize,
    ) -> Result<Vec<T>, CommError> {
        let world = self.world_size.max(1);
        let per_rank = dataset_len.div_ceil(world);
        let bad = |detail: String| CommError::InvalidArgument {
            op: CollKind::AllGatherV,
            rank: self.rank,
            detail,
        };
        let m = if item_len == 0 {
            Err(bad("gather_for_metrics: item_len is 0; pass the number of values per sample (1 for a label or a loss)".into()))
        } else if !local.len().is_multiple_of(item_len) {
            Err(bad(format!(
                "gather_for_metrics: {} values are not whole samples of {item_len} values each; pass item_len values per sample",
                local.len()
            )))
        } else if first + local.len() / item_len > per_rank {
            Err(bad(format!(
                "gather_for_metrics: samples {first}..{} of this rank's shard do not exist: a dataset of {dataset_len} on {world} ranks gives each rank {per_rank}",
                first + local.len() / item_len
            )))
        } else {
            Ok(local.len() / item_len)
        };
        let m = match m {
            Ok(m) => m,
            Err(e) => {
                // The peers' matching call fails with a mismatch naming this rank, instead of
                // waiting for it.
                self.comm.reject_call(CollKind::AllGatherV, T::DTYPE, &e);
                return Err(e);
            }
        };
        // Real samples of rank r: its shard positions i with i * world + r < dataset_len, a
        // prefix of the shard; the same arithmetic on every rank (all_gather_v checks that the
        // ranks agree on the counts).
        let real = |r: usize| -> usize {
            let total = if dataset_len > r {
                (dataset_len - r).div_ceil(world)
            } else {
                0
            };
            total.saturating_sub(first).min(m)
        };
        let counts: Vec<usize> = (0..world).map(|r| real(r) * item_len).collect();
        let mine = &local[..counts[self.rank]];
        let mut all = vec![T::default(); counts.iter().sum()];
        self.comm.all_gather_v(mine, &mut all[..], &counts)?;
        // Back to epoch order: position (first + i) * world + r is rank r's sample i.
        let mut displs = Vec::with_capacity(world);
        let mut at = 0;
        for c in &counts {
            displs.push(at);
            at += c;
        }
        let mut out = Vec::with_capacity(all.len());
        for i in 0..m {
            for (r, &d) in displs.iter().enumerate() {
                if i < real(r) {
                    let s = d + i * item_len;
                    out.extend_from_slice(&all[s..s + item_len]);
                }
            }
        }
        Ok(out)
    }
}
