//! The exception a failed collective raises.

use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;
use pyo3::PyErr;

create_exception!(
    lockstep,
    CommError,
    PyRuntimeError,
    "A collective or communicator setup failed: a mismatch between ranks, a dead or departed peer, a timeout, \
or bad arguments caught by the Rust checks. The message is lockstep's, naming the ranks involved and what to do next."
);

/// The Python exception for a Rust communicator error.
pub fn comm_err(e: lockstep::CommError) -> PyErr {
    CommError::new_err(e.to_string())
}
