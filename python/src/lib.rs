//! `lockstep._native`: the Rust half of the Python package `lockstep` (see `python/lockstep/`
//! for the Python half: `notebook_launcher`, `comm()`, the documented API).
//!
//! What lives here: [`comm::PyComm`] (`lockstep.Communicator`) and the buffer-protocol glue
//! (`buffer.rs`), `init_from_env`, the shared segment a `notebook_launcher` call forks its
//! ranks around ([`ShmJob`]), and the pre-fork checks (CUDA initialised in this process, malformed
//! `LOCKSTEP_*` variables) and post-fork set-up of the Rust library.

// Every `unsafe` block carries a `// SAFETY:` comment in the form clippy recognises.
#![warn(clippy::undocumented_unsafe_blocks)]

use std::sync::Mutex;

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

mod buffer;
mod comm;
mod errors;
mod log;

use comm::PyComm;
use errors::comm_err;

/// Join the job described by the launcher's environment (`lockstep launch`, torchrun, mpirun,
/// srun): the Rust `Communicator::from_env`. Blocks (without the GIL) until every rank of the
/// node has joined.
#[pyfunction]
fn init_from_env(py: Python<'_>) -> PyResult<PyComm> {
    log::install()?;
    let c = py.detach(lockstep::Communicator::from_env);
    log::deliver(py);
    Ok(PyComm::new(c.map_err(comm_err)?))
}

/// Why forking ranks from this process would fail, or None: CUDA already initialised here (by
/// lockstep, or by anyone else: torch, pynvml, cupy; the driver itself is asked), or a malformed
/// `LOCKSTEP_*` variable.
#[pyfunction]
fn fork_refusal() -> Option<String> {
    if let Err(e) = lockstep::cuda::init::check_fork_safe() {
        return Some(e);
    }
    lockstep::types::env::check_all()
        .err()
        .map(|e| e.to_string())
}

/// A shared segment prepared for `world` ranks forked from this process (an anonymous memfd:
/// nothing to clean up in /dev/shm, it goes when the last process mapping it does). Each forked
/// rank calls `communicator(rank)` once.
#[pyclass(frozen, module = "lockstep._native")]
struct ShmJob {
    job: Mutex<Option<lockstep::shm::ShmJob>>,
}

#[pymethods]
impl ShmJob {
    #[new]
    fn new(world: usize) -> PyResult<ShmJob> {
        log::install()?;
        let job = lockstep::shm::ShmJob::new(world).map_err(comm_err)?;
        Ok(ShmJob {
            job: Mutex::new(Some(job)),
        })
    }

    /// Join as `rank` (in a forked child); waits without the GIL until every rank has joined.
    fn communicator(&self, py: Python<'_>, rank: usize) -> PyResult<PyComm> {
        let job = self.job.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let job = job.ok_or_else(|| PyRuntimeError::new_err("this ShmJob was closed"))?;
        let c = py.detach(|| job.communicator(rank));
        log::deliver(py);
        Ok(PyComm::new(c.map_err(comm_err)?))
    }

    /// Drop this process's mapping (the parent, once every rank is forked).
    fn close(&self) {
        drop(self.job.lock().unwrap_or_else(|p| p.into_inner()).take());
    }
}

/// Join the shared segment named after `job_id` as `rank` of `world` ranks of this node, started
/// separately (the torch backend: one segment per process group, its id agreed through torch's
/// store). Rank 0 creates it; the name is removed once every rank has joined. Settings come from
/// the `LOCKSTEP_SHM_*` variables; `timeout` (seconds), when given, replaces `LOCKSTEP_TIMEOUT_S`
/// as the longest a call waits for its peers.
#[pyfunction]
#[pyo3(signature = (job_id, rank, world, timeout=None))]
fn join_named(
    py: Python<'_>,
    job_id: &str,
    rank: usize,
    world: usize,
    timeout: Option<f64>,
) -> PyResult<PyComm> {
    joined(py, "join_named", timeout, |cfg| {
        lockstep::shm::ShmComm::join_named(job_id, rank, world, cfg)
            .map(|c| lockstep::Communicator::from_backend(Box::new(c)))
    })
}

/// Join the job MPI started this process in through the hierarchical backend (`hier`: shared
/// memory in each node, MPI between nodes), whatever `LOCKSTEP_MPI` says: the torch backend's
/// path for a process group that spans nodes. Every rank of `MPI_COMM_WORLD` calls it at once and
/// gets its rank there. `timeout` (seconds) as for `join_named`.
#[pyfunction]
#[pyo3(signature = (timeout=None))]
fn join_mpi(py: Python<'_>, timeout: Option<f64>) -> PyResult<PyComm> {
    joined(py, "join_mpi", timeout, lockstep::rendezvous::join_mpi)
}

/// Build a communicator with `join` (without the GIL) from the `LOCKSTEP_SHM_*` settings, its
/// timeout replaced by `timeout` seconds when given (`what` names the caller in a bad timeout's
/// error).
fn joined(
    py: Python<'_>,
    what: &str,
    timeout: Option<f64>,
    join: impl FnOnce(lockstep::shm::ShmConfig) -> Result<lockstep::Communicator, lockstep::CommError>
        + Send,
) -> PyResult<PyComm> {
    let timeout = timeout
        .map(|t| comm::seconds(t, &format!("{what}: timeout")))
        .transpose()?;
    log::install()?;
    let c = py.detach(|| {
        let mut cfg = lockstep::shm::ShmConfig::from_env()?;
        if let Some(t) = timeout {
            cfg.timeout = t;
        }
        join(cfg)
    });
    log::deliver(py);
    Ok(PyComm::new(c.map_err(comm_err)?))
}

/// `LOCKSTEP_MPI`, checked (`"auto"`, also when unset; `"on"`; `"off"`), and this machine's id
/// as `lockstep.init_from_env` compares hosts (`LOCKSTEP_HOST_ID`, else the host name and boot
/// id): what the torch backend needs to tell whether a group spans hosts.
#[pyfunction]
fn mpi_placement() -> PyResult<(&'static str, String)> {
    let mode = lockstep::rendezvous::mpi_mode().map_err(comm_err)?;
    let host = lockstep::rendezvous::host_id()
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
    Ok((mode, host))
}

/// In a freshly forked rank: ask the kernel to SIGKILL this process when the thread that forked
/// it dies (a killed notebook kernel leaves no rank behind). Returns False when the parent is
/// already gone (`parent_pid` is not our parent any more): the rank should exit at once.
#[pyfunction]
fn die_with_parent(parent_pid: i32) -> bool {
    // SAFETY: prctl(PR_SET_PDEATHSIG) takes an integer signal number; no pointers.
    let rc = unsafe {
        libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    // SAFETY: getppid has no preconditions.
    let ppid = unsafe { libc::getppid() };
    rc == 0 && ppid == parent_pid
}

/// The `lockstep` command (`lockstep launch`, `bench`, `env`, `config`, `selftest`) run in this
/// process with `argv` (the program name first), returning its exit status: the `lockstep`
/// console script and `python -m lockstep`. It prints as the binary does and installs the stderr
/// log subscriber, so it is only for a process that is this command. The GIL is released for the
/// whole run (a `launch` waits for its job).
#[pyfunction]
fn cli_main(py: Python<'_>, argv: Vec<std::ffi::OsString>) -> u8 {
    py.detach(|| lockstep_cli::run_args(argv))
}

/// What `lockstep status --json` prints: with `job` None this user's running jobs on this
/// machine, otherwise the job `job` names (its id or the pid of any of its processes). Read
/// without the GIL and without disturbing the jobs. A job that is not found is a `ValueError`.
#[pyfunction]
#[pyo3(signature = (job=None))]
fn status_json(py: Python<'_>, job: Option<String>) -> PyResult<String> {
    use lockstep::status::{job_status, list_jobs, StatusError};
    let r = py.detach(|| match job.as_deref() {
        None => list_jobs().map(|l| l.to_json()),
        Some(j) => job_status(j).map(|s| s.to_json()),
    });
    r.map_err(|e| match e {
        StatusError::NotFound { .. } | StatusError::OtherUser { .. } => {
            pyo3::exceptions::PyValueError::new_err(e.to_string())
        }
        _ => PyRuntimeError::new_err(e.to_string()),
    })
}

/// Have every `SIGUSR1` that writes lockstep's trace files (`LOCKSTEP_TRACE_DIR`) also call
/// `lockstep._flight.on_signal()`, which writes torch's Flight Recorder format
/// (`lockstep.torch` calls this where lockstep records itself for torch).
#[pyfunction]
fn _torch_fr_on_sigusr1() {
    lockstep::trace::on_signal(torch_fr_signal);
}

/// On the thread `lockstep-trace`, after a SIGUSR1: take the GIL as any thread does (a rank
/// stuck in a collective has released it) and write torch's dump. Nothing once the interpreter
/// is shutting down.
fn torch_fr_signal() {
    Python::try_attach(|py| {
        let r = py
            .import("lockstep._flight")
            .and_then(|m| m.call_method0("on_signal"));
        if let Err(e) = r {
            tracing::warn!("flight recorder: SIGUSR1: torch's dump was not written: {e}");
        }
    });
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Embedded in a Python program, which owns its threads' placement: bind nothing unless
    // LOCKSTEP_CPU_BIND asks.
    lockstep::shm::set_default_cpu_bind(lockstep::shm::CpuBind::None);
    m.add_class::<PyComm>()?;
    m.add_class::<ShmJob>()?;
    m.add_class::<comm::TorchAllReduce>()?;
    m.add_class::<comm::SharedMemory>()?;
    m.add("CommError", m.py().get_type::<errors::CommError>())?;
    m.add_function(wrap_pyfunction!(init_from_env, m)?)?;
    m.add_function(wrap_pyfunction!(cli_main, m)?)?;
    m.add_function(wrap_pyfunction!(log::_deliver_logs, m)?)?;
    m.add_function(wrap_pyfunction!(fork_refusal, m)?)?;
    m.add_function(wrap_pyfunction!(die_with_parent, m)?)?;
    m.add_function(wrap_pyfunction!(join_named, m)?)?;
    m.add_function(wrap_pyfunction!(join_mpi, m)?)?;
    m.add_function(wrap_pyfunction!(mpi_placement, m)?)?;
    m.add_function(wrap_pyfunction!(status_json, m)?)?;
    m.add_function(wrap_pyfunction!(buffer::_register_torch, m)?)?;
    m.add_function(wrap_pyfunction!(_torch_fr_on_sigusr1, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
