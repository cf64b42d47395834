//! `NcclError`: every NCCL failure with the call, NCCL's own error string (`ncclGetErrorString`,
//! `ncclGetLastError`) and what to do next.

use crate::comm::{CollKind, CommError, LostPeer};
use crate::cuda::CudaError;

/// What to do next for an `ncclResult_t`.
pub(crate) fn hint(code: i32) -> &'static str {
    match code {
        1 => "a CUDA call inside NCCL failed: check the device and the CUDA error before it",
        2 => "a system call failed (sockets, shared memory): check /dev/shm size and NCCL_DEBUG=WARN output",
        3 => "NCCL hit an internal error: rerun with NCCL_DEBUG=INFO and report it",
        4 => "an argument is invalid (pointer not on this device, count, root): check the buffers",
        5 => "calls were made in the wrong order or ranks disagree: every rank must issue the same collectives",
        6 => "a remote rank failed or disconnected: see that rank's error",
        8 => "the operation timed out inside NCCL",
        _ => "rerun with NCCL_DEBUG=WARN for details",
    }
}

/// Errors of the NCCL layer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NcclError {
    /// An NCCL call failed.
    #[error("{call} failed: {message} (ncclResult_t {code}){last}. To fix: {hint}")]
    Call {
        /// The call and its arguments.
        call: String,
        /// Raw `ncclResult_t`.
        code: i32,
        /// `ncclGetErrorString`.
        message: String,
        /// `ncclGetLastError` text, prefixed with "; " when present.
        last: String,
        /// What to do next.
        hint: &'static str,
    },
    /// Waiting for NCCL took longer than the timeout; the communicator was aborted.
    #[error("{what} on rank {rank} did not finish within {secs:.1} s; the communicator was aborted (a peer is probably dead or stuck). Raise LOCKSTEP_TIMEOUT_S if this is expected")]
    Timeout {
        /// What was waited for.
        what: String,
        /// This rank.
        rank: usize,
        /// Seconds waited.
        secs: f64,
    },
    /// An asynchronous error (or the caller's liveness check) ended the communicator.
    #[error("{what} on rank {rank} failed asynchronously: {reason}; the communicator was aborted")]
    Aborted {
        /// What was in progress.
        what: String,
        /// This rank.
        rank: usize,
        /// The async error or liveness report.
        reason: String,
    },
    /// The liveness watch saw a peer's process exit while this rank waited (see
    /// [`PeerCheck`](crate::comm::PeerCheck)); the communicator was aborted.
    #[error("rank {} (pid {}) died while rank {rank} was in {op} #{seq}; the communicator was aborted", lost.global, lost.pid)]
    PeerLost {
        /// This rank (its global rank, in a shrunk communicator).
        rank: usize,
        /// The peer that is gone.
        lost: LostPeer,
        /// The call waited on (the last one enqueued).
        op: CollKind,
        /// Its sequence number.
        seq: u64,
    },
    /// The communicator was shrunk or grown: its successor takes the calls.
    #[error(
        "this communicator was shrunk (rank {rank} is in its generation-{generation} successor)"
    )]
    Replaced {
        /// This rank (its global rank).
        rank: usize,
        /// The generation of the successor.
        generation: u64,
    },
    /// The unique-id exchange failed.
    #[error("exchanging the NCCL unique id for rank {rank} failed: {detail}")]
    Exchange {
        /// This rank.
        rank: usize,
        /// What the exchange reported.
        detail: String,
    },
    /// A CUDA call (context, stream, memory) failed, or a library could not be loaded.
    #[error(transparent)]
    Cuda(#[from] CudaError),
}

impl From<NcclError> for CommError {
    fn from(e: NcclError) -> CommError {
        match e {
            // The kinds every backend reports alike, so that callers (shrink-and-continue code,
            // Python's exception classes, the C ABI's result codes) tell them apart.
            NcclError::PeerLost {
                rank,
                lost,
                op,
                seq,
            } => CommError::PeerLost {
                rank,
                lost_rank: lost.global,
                pid: lost.pid,
                how: "died",
                op,
                seq,
                group: String::new(),
            },
            NcclError::Replaced { rank, generation } => CommError::Shrunk { rank, generation },
            e => CommError::Backend {
                backend: "nccl",
                message: e.to_string(),
            },
        }
    }
}

/// An invalid argument to the communicator, as the CUDA layer reports its own.
pub(super) fn invalid_arg(detail: String) -> NcclError {
    NcclError::Cuda(crate::cuda::CudaError::InvalidArgument {
        op: "NcclComm".into(),
        detail,
    })
}
