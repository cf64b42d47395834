//! `CommError`: what a collective reports, with the rank, the operation and what to do next.

use crate::types::{CollKind, Dtype};

/// Errors of the collective API, on every backend.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CommError {
    /// Buffers of a call do not fit the call (checked locally, before any rank waits).
    #[error("{op} on rank {rank}: {detail}")]
    InvalidArgument {
        /// The collective.
        op: CollKind,
        /// The calling rank (its global rank, in a sub-communicator).
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
    #[error("rank {lost_rank} (pid {pid}) {how} while rank {rank} was in {op} #{seq}{group}; the job cannot continue on this communicator: restart it (the launcher reports the lost rank's exit status), or call shrink to go on without that rank (the shm backend, and the nccl and staged backends of one node)")]
    PeerLost {
        /// This rank (its global rank, in a sub-communicator).
        rank: usize,
        /// The rank that is gone (its global rank, in a sub-communicator).
        lost_rank: usize,
        /// Its process id.
        pid: i32,
        /// "died" or "left the communicator".
        how: &'static str,
        /// The collective that was waiting.
        op: CollKind,
        /// Its sequence number.
        seq: u64,
        /// Empty on a world communicator; on a sub-communicator (see
        /// [`Communicator::split`](super::Communicator::split)), where the two ranks sit in it;
        /// for a receive from any source, that it was one and which ranks are gone.
        group: String,
    },
    /// The peers shrank the communicator without this rank (see
    /// [`Communicator::shrink`](super::Communicator::shrink)): it was stopped or slow past their
    /// wait, or a peer listed it. It cannot rejoin.
    #[error("rank {rank} was excluded from this communicator (shrink to generation {generation}): {detail}; it cannot rejoin: end this process (a launcher with restarts replaces it)")]
    Excluded {
        /// This rank (its global rank, in a sub-communicator).
        rank: usize,
        /// The generation of the communicator the shrink made (1 for the first shrink).
        generation: u64,
        /// Why it was left out.
        detail: String,
    },
    /// The communicator was shrunk or grown (see
    /// [`Communicator::shrink`](super::Communicator::shrink),
    /// [`Communicator::grow`](super::Communicator::grow)): its calls fail, the communicator
    /// shrink or grow returned takes them.
    #[error("this communicator was shrunk (rank {rank} is in its generation-{generation} successor): use the communicator shrink or grow returned")]
    Shrunk {
        /// This rank (its global rank, in a sub-communicator).
        rank: usize,
        /// The generation of the communicator the shrink (or grow) made.
        generation: u64,
    },
    /// Another rank detected a failure and aborted the communicator.
    #[error("communicator aborted by rank {by}: {reason}")]
    Aborted {
        /// The rank that aborted (its global rank, in a sub-communicator).
        by: usize,
        /// Why.
        reason: String,
    },
    /// Some ranks did not arrive within the timeout.
    #[error("{op} #{seq} on rank {rank} timed out after {secs:.1} s: {detail} ({hint})", hint = TIMEOUT_HINT)]
    Timeout {
        /// This rank (its global rank, in a sub-communicator).
        rank: usize,
        /// The collective.
        op: CollKind,
        /// Its sequence number.
        seq: u64,
        /// Seconds waited.
        secs: f64,
        /// Which ranks are missing and where they are.
        detail: String,
        /// The ranks this rank was still waiting for (global ranks, in a sub-communicator), in
        /// increasing order.
        missing: Vec<usize>,
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
    /// A reduction's input held a NaN or an infinity, with the finite check on (`LOCKSTEP_CHECK_FINITE=1`,
    /// [`ShmConfig::check_finite`](crate::shm::ShmConfig::check_finite)). Every rank of the call
    /// returns this same error, naming the first non-finite input element: the lowest element
    /// index, and of the ranks with a non-finite value there, the lowest rank. The output buffers
    /// may hold partial or non-finite results; the communicator stays usable.
    #[error("rank {rank} contributed {kind} at element {element} of {op} #{seq} ({dtype}, {count} elements); check that rank's inputs at that element (a diverging loss, an overflowing loss scale, uninitialised memory), or set LOCKSTEP_CHECK_FINITE=0 to let non-finite values propagate", count = group_digits(*count))]
    NonFinite {
        /// The rank whose input held the value (its global rank, in a sub-communicator).
        rank: usize,
        /// Sequence number of the collective (counted from 1 on each rank).
        seq: u64,
        /// NaN, +Inf or -Inf.
        kind: NonFiniteKind,
        /// The collective: all_reduce, reduce or reduce_scatter.
        op: CollKind,
        /// Index of the element in that rank's input (its send buffer; for reduce_scatter the
        /// whole input of `world × count` elements).
        element: usize,
        /// The element type.
        dtype: Dtype,
        /// Elements of that rank's input.
        count: usize,
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

/// The class of a non-finite value that [`CommError::NonFinite`] reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NonFiniteKind {
    /// Not a number.
    NaN,
    /// Positive infinity.
    PosInf,
    /// Negative infinity.
    NegInf,
}

impl std::fmt::Display for NonFiniteKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            NonFiniteKind::NaN => "NaN",
            NonFiniteKind::PosInf => "+Inf",
            NonFiniteKind::NegInf => "-Inf",
        })
    }
}

/// `n` with a comma every three digits (262,144), as error messages show element counts.
fn group_digits(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// What a timeout report suggests. The timeout is `LOCKSTEP_TIMEOUT_S` unless the program set
/// one ([`Communicator::set_timeout`](super::Communicator::set_timeout), which torch's process
/// group timeout reaches through the Python package).
pub(crate) const TIMEOUT_HINT: &str =
    "if this is expected, raise the timeout: LOCKSTEP_TIMEOUT_S, or the one the program set";

/// How errors name rank `r` of a communicator whose rank `i` is global rank `global[i]` (`None`:
/// a world communicator, whose ranks are the global ranks): `rank 3 (rank 1 of this
/// sub-communicator)`, so a report names the process the launcher knows, and the rank the
/// program used.
pub(crate) fn rank_name(global: Option<&[usize]>, r: usize) -> String {
    match global.and_then(|g| g.get(r)) {
        Some(g) => format!("rank {g} (rank {r} of this sub-communicator)"),
        None => format!("rank {r}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_finite_message() {
        let e = CommError::NonFinite {
            rank: 1,
            seq: 41,
            kind: NonFiniteKind::NaN,
            op: CollKind::AllReduce,
            element: 17,
            dtype: Dtype::F32,
            count: 262_144,
        };
        assert!(e.to_string().starts_with(
            "rank 1 contributed NaN at element 17 of all_reduce #41 (f32, 262,144 elements); "
        ));
        assert_eq!(group_digits(0), "0");
        assert_eq!(group_digits(999), "999");
        assert_eq!(group_digits(1000), "1,000");
        assert_eq!(group_digits(1_234_567), "1,234,567");
    }
}
