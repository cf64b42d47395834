//! `MpiError`: finding and loading the MPI library, and every MPI call that fails, with the
//! library's own error string and what to do next.

use crate::comm::CommError;
use crate::types::env::EnvError;

/// What lockstep accepts, said in every message about a missing or unusable library.
pub(crate) const NEEDS: &str = "lockstep needs MPICH ≥ 5 (pip install mpich) or Open MPI ≥ 6";

/// Errors of the MPI layer.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MpiError {
    /// No MPI library was found at all.
    #[error("no MPI-5 standard ABI library (libmpi_abi.so.1) found; {NEEDS}. Tried:\n  {searched}\nTo fix: `pip install mpich` into the environment whose python3 is on PATH, put the library's folder on LD_LIBRARY_PATH, or set LOCKSTEP_MPI_LIBRARY to its libmpi_abi.so.1 (or its folder)")]
    NotFound {
        /// Every place tried, one per line.
        searched: String,
    },
    /// Only an MPI without the standard ABI was found (Open MPI ≤ 5, MPICH ≤ 4, or the non-ABI
    /// library of a newer MPICH).
    #[error("found {vendor}'s {file} (not the MPI-5 standard ABI); {NEEDS}: {path} reports {version:?}. To fix: install one of those and make its libmpi_abi.so.1 findable (LD_LIBRARY_PATH, the site-packages of the python3 on PATH), or set LOCKSTEP_MPI_LIBRARY to it{also}")]
    NotAbi {
        /// Who made it (`Open MPI`, `MPICH`, or `an MPI`).
        vendor: String,
        /// Its file name (`libmpi.so.40`).
        file: String,
        /// Its full path.
        path: String,
        /// The first line of its `MPI_Get_library_version`.
        version: String,
        /// The other places tried, prefixed with ". Also tried:" when any.
        also: String,
    },
    /// The library speaks an ABI version lockstep does not know.
    #[error("{path} implements MPI ABI {major}.{minor}; lockstep speaks ABI 1.x: point LOCKSTEP_MPI_LIBRARY at an MPI with ABI 1 (MPICH ≥ 5 or Open MPI ≥ 6)")]
    AbiVersion {
        /// The library.
        path: String,
        /// `MPI_Abi_get_version`'s major version.
        major: i32,
        /// Its minor version.
        minor: i32,
    },
    /// The library lacks a function lockstep calls.
    #[error("the MPI library at {path} has no symbol `{symbol}` ({detail}); it is not a complete MPI-5 ABI library: point LOCKSTEP_MPI_LIBRARY at MPICH ≥ 5 or Open MPI ≥ 6")]
    MissingSymbol {
        /// The library.
        path: String,
        /// The missing function.
        symbol: &'static str,
        /// The loader's message.
        detail: String,
    },
    /// An environment variable cannot be used.
    #[error(transparent)]
    Env(#[from] EnvError),
    /// An MPI call failed.
    #[error("{call} failed: {message} (error class {class}, code {code}). To fix: {hint}")]
    Call {
        /// The call and its arguments.
        call: String,
        /// The raw error code.
        code: i32,
        /// `MPI_Error_class` of it.
        class: i32,
        /// `MPI_Error_string` of it.
        message: String,
        /// What to do next.
        hint: &'static str,
    },
    /// Waiting for point-to-point messages took longer than the timeout.
    #[error("{what} on MPI rank {rank} did not finish within {secs:.1} s (a peer is probably dead or stuck); the pending messages were cancelled. Raise LOCKSTEP_TIMEOUT_S if this is expected")]
    Timeout {
        /// What was waited for.
        what: String,
        /// This rank in the communicator.
        rank: usize,
        /// Seconds waited.
        secs: f64,
    },
    /// MPI was initialised by the program with too low a thread level.
    #[error("MPI was initialised with {provided}; lockstep needs MPI_THREAD_SERIALIZED or higher: initialise MPI with MPI_Init_thread(MPI_THREAD_MULTIPLE) (mpi4py does by default), or let lockstep initialise it")]
    ThreadLevel {
        /// The level in force.
        provided: &'static str,
    },
    /// MPI was finalised already in this process; it cannot start again.
    #[error("MPI was already finalised in this process, and MPI cannot be initialised twice: keep one lockstep::mpi::Mpi handle alive for the whole job")]
    Finalized,
    /// An argument lockstep was given cannot be passed to MPI.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// What to do next for an MPI error class.
pub(crate) fn hint(class: i32) -> &'static str {
    match class {
        5 => "the communicator is invalid or freed: a lockstep bug, report it",
        6 => "the peer rank is out of range: every rank must agree on the communicator",
        15 => "a message was longer than the receive buffer: ranks disagree on a message size",
        18 | 19 => "a message failed: see the other ranks' errors, a peer probably died",
        39 => "MPI ran out of memory",
        58 => "a peer process aborted: see that rank's error",
        _ => "see the other ranks' errors; rerun with MPIR_CVAR_DEBUG_SUMMARY=1 (MPICH) for the MPI configuration",
    }
}

impl From<MpiError> for CommError {
    fn from(e: MpiError) -> CommError {
        CommError::Backend {
            backend: "mpi",
            message: e.to_string(),
        }
    }
}
