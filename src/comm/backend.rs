//! The [`Backend`] trait: what a transport implements so that [`Communicator`](super::Communicator)
//! can run on it, and [`Call`], the type-erased, locally checked collective it receives.
//!
//! The trait names no backend type: shared allocations come back as a [`SharedRegion`] trait
//! object and device access as the CUDA [`Context`] (a layer below), so the backends (`shm`,
//! `nccl`, `staged`) depend on this module and never the other way round.

use std::fmt;
use std::sync::Arc;

use super::error::CommError;
use super::shared::SharedRegion;
use crate::cuda::Context;
use crate::types::{CollKind, Dtype, RawMem, ReduceOp};

/// Which backend a communicator runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BackendKind {
    /// The shared-memory backend for the ranks of one node (host buffers).
    Shm,
    /// NCCL (device buffers).
    Nccl,
    /// Device buffers staged through pinned host memory into a host backend (ranks sharing a GPU).
    Staged,
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendKind::Shm => "shm",
            BackendKind::Nccl => "nccl",
            BackendKind::Staged => "staged",
        })
    }
}

/// One collective call, type-erased and checked locally. `count` is the per-rank element count as
/// NCCL defines it: the send count of `all_reduce`/`broadcast`/`reduce`/`all_gather`/`gather`,
/// and the *receive* count of `reduce_scatter`.
#[derive(Clone, Copy, Debug)]
pub struct Call {
    /// The collective.
    pub kind: CollKind,
    /// Element type.
    pub dtype: Dtype,
    /// Reduction operator (`Sum` where none applies).
    pub op: ReduceOp,
    /// Root rank (0 where none applies).
    pub root: usize,
    /// Element count, as above.
    pub count: usize,
    /// Send buffer (for in-place calls, the same address as `recv`).
    pub send: RawMem,
    /// Receive buffer (may be empty on ranks that receive nothing).
    pub recv: RawMem,
}

/// What a backend implements. Callers never see it: they use [`Communicator`](super::Communicator).
pub trait Backend: Send {
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// Which backend this is.
    fn kind(&self) -> BackendKind;
    /// Run (or enqueue) one collective.
    fn run(&mut self, call: &Call) -> Result<(), CommError>;
    /// Wait until every call issued so far has completed.
    fn synchronize(&mut self) -> Result<(), CommError>;
    /// Number of collectives this rank has issued.
    fn seq(&self) -> u64;
    /// A call this rank refused locally (bad buffer lengths, root out of range, wrong memory
    /// space): backends that can, make the peers' matching call fail too, so the ranks stay in step.
    fn reject(&mut self, kind: CollKind, dtype: Dtype, reason: &CommError) {
        let _ = (kind, dtype, reason);
    }
    /// The CUDA context whose device memory this backend's collectives take (device backends).
    fn device(&self) -> Option<Arc<Context>> {
        None
    }
    /// Allocate `bytes` of memory that peers can read directly (zero-copy collectives).
    fn alloc_shared(&mut self, bytes: usize) -> Result<Box<dyn SharedRegion>, CommError> {
        let _ = bytes;
        Err(CommError::Unsupported(format!("the {} backend has no shared host buffers", self.kind())))
    }
}
