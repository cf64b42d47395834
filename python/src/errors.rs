//! The exception a failed collective raises.

use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::PyErr;

create_exception!(
    lockstep,
    CommError,
    PyRuntimeError,
    "A collective or communicator setup failed: a mismatch between ranks, a dead or departed peer, a timeout, \
or bad arguments caught by the Rust checks. The message is lockstep's, naming the ranks involved and what to do next. \
Attributes: `kind` (\"invalid_argument\", \"mismatch\", \"peer_lost\", \"aborted\", \"timeout\", \"excluded\", \"shrunk\", \"unsupported\", \
\"setup\", \"os\", \"backend\", \"non_finite\": a NaN or infinity in a reduction's input under LOCKSTEP_CHECK_FINITE=1), `follows` (the global rank whose failure this error is a consequence of: \
the lost peer, or the rank that aborted the communicator; None otherwise) and `missing` (for a timeout, the global \
ranks this rank was still waiting for; empty otherwise)."
);

/// The Python exception for a Rust communicator error, with its `kind`, `follows` and `missing`
/// attributes: `notebook_launcher` reads `follows` to report the rank that failed first rather
/// than a peer that only saw it go (both reach the launcher at about the same moment).
pub fn comm_err(e: lockstep::CommError) -> PyErr {
    use lockstep::CommError as E;
    let (kind, follows) = match &e {
        E::InvalidArgument { .. } => ("invalid_argument", None),
        E::Mismatch { .. } => ("mismatch", None),
        E::PeerLost { lost_rank, .. } => ("peer_lost", Some(*lost_rank)),
        E::Aborted { by, .. } => ("aborted", Some(*by)),
        E::Timeout { .. } => ("timeout", None),
        E::Excluded { .. } => ("excluded", None),
        E::Shrunk { .. } => ("shrunk", None),
        E::Unsupported(_) => ("unsupported", None),
        E::Setup(_) => ("setup", None),
        E::Os { .. } => ("os", None),
        E::Backend { .. } => ("backend", None),
        E::NonFinite { .. } => ("non_finite", None),
        _ => ("other", None),
    };
    let missing = match &e {
        E::Timeout { missing, .. } => missing.clone(),
        _ => Vec::new(),
    };
    let err = CommError::new_err(e.to_string());
    Python::attach(|py| {
        let v = err.value(py);
        // Setting attributes on a fresh exception instance cannot fail short of memory; if it
        // does, the exception still carries its message.
        let _ = v.setattr("kind", kind);
        let _ = v.setattr("follows", follows);
        let _ = v.setattr("missing", missing);
    });
    err
}
