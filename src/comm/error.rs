//! `CommError`: what a collective reports, with the rank, the operation and what to do next.

use std::fmt;

/// Which collective a call was (carried in errors and in the cross-rank argument check).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum CollKind {
    /// `all_reduce`.
    AllReduce = 1,
    /// `broadcast`.
    Broadcast = 2,
    /// `reduce`.
    Reduce = 3,
    /// `all_gather`.
    AllGather = 4,
    /// `gather`.
    Gather = 5,
    /// `reduce_scatter`.
    ReduceScatter = 6,
    /// `barrier`.
    Barrier = 7,
}

impl CollKind {
    /// Every kind.
    pub const ALL: [CollKind; 7] = [
        CollKind::AllReduce,
        CollKind::Broadcast,
        CollKind::Reduce,
        CollKind::AllGather,
        CollKind::Gather,
        CollKind::ReduceScatter,
        CollKind::Barrier,
    ];

    /// snake_case name, as the method is called.
    pub const fn name(self) -> &'static str {
        match self {
            CollKind::AllReduce => "all_reduce",
            CollKind::Broadcast => "broadcast",
            CollKind::Reduce => "reduce",
            CollKind::AllGather => "all_gather",
            CollKind::Gather => "gather",
            CollKind::ReduceScatter => "reduce_scatter",
            CollKind::Barrier => "barrier",
        }
    }

    /// Whether the call has a root rank.
    pub const fn has_root(self) -> bool {
        matches!(self, CollKind::Broadcast | CollKind::Reduce | CollKind::Gather)
    }

    /// Whether the call has a reduction operator.
    pub const fn has_op(self) -> bool {
        matches!(self, CollKind::AllReduce | CollKind::Reduce | CollKind::ReduceScatter)
    }

    pub(crate) fn from_u8(v: u8) -> Option<CollKind> {
        CollKind::ALL.iter().copied().find(|k| *k as u8 == v)
    }
}

impl fmt::Display for CollKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for CollKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.replace('-', "_").to_ascii_lowercase();
        CollKind::ALL.iter().copied().find(|k| k.name() == s).ok_or_else(|| {
            format!("unknown collective '{s}' (expected all_reduce, broadcast, reduce, all_gather, gather, reduce_scatter or barrier)")
        })
    }
}

/// Errors of the collective API, on every backend.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// Buffers of a call do not fit the call (checked locally, before any rank waits).
    #[error("{op} on rank {rank}: {detail}")]
    InvalidArgument {
        /// The collective.
        op: CollKind,
        /// The calling rank.
        rank: usize,
        /// What is wrong and what was expected.
        detail: String,
    },
    /// Ranks called different collectives, or the same one with different arguments.
    #[error("collective #{seq} mismatch across ranks: {detail}. Every rank must make the same sequence of collective calls with the same count, dtype, op and root")]
    Mismatch {
        /// Sequence number of the collective (counted from 1 on each rank).
        seq: u64,
        /// Which rank passed what.
        detail: String,
    },
    /// A peer process died or left the communicator while others waited for it.
    #[error("rank {lost_rank} (pid {pid}) {how} while rank {rank} was in {op} #{seq}; the job cannot continue: restart it (the launcher reports the lost rank's exit status)")]
    PeerLost {
        /// This rank.
        rank: usize,
        /// The rank that is gone.
        lost_rank: usize,
        /// Its process id.
        pid: i32,
        /// "died" or "left the communicator".
        how: &'static str,
        /// The collective that was waiting.
        op: CollKind,
        /// Its sequence number.
        seq: u64,
    },
    /// Another rank detected a failure and aborted the communicator.
    #[error("communicator aborted by rank {by}: {reason}")]
    Aborted {
        /// The rank that aborted.
        by: usize,
        /// Why.
        reason: String,
    },
    /// Some ranks did not arrive within the timeout.
    #[error("{op} #{seq} on rank {rank} timed out after {secs:.1} s: {detail} (raise LOCKSTEP_TIMEOUT_S if this is expected)")]
    Timeout {
        /// This rank.
        rank: usize,
        /// The collective.
        op: CollKind,
        /// Its sequence number.
        seq: u64,
        /// Seconds waited.
        secs: f64,
        /// Which ranks are missing and where they are.
        detail: String,
    },
    /// The operation is not available on this backend or with these buffers.
    #[error("{0}")]
    Unsupported(String),
    /// Setting up the communicator failed.
    #[error("communicator setup failed: {0}")]
    Setup(String),
    /// An operating-system call failed.
    #[error("{call} failed: {source}")]
    Os {
        /// The call and its arguments.
        call: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A backend-specific failure (NCCL, CUDA).
    #[error("{backend}: {message}")]
    Backend {
        /// Which backend.
        backend: &'static str,
        /// Its message.
        message: String,
    },
}
