//! MPI through the MPI-5 standard ABI, loaded at run time (`libmpi_abi.so.1`): the transport
//! between the nodes of a CPU job started by `mpiexec` or `srun` on several hosts, while the ranks
//! of each node talk through lockstep's shared memory.
//!
//! Layers as in `cuda` and `nccl`: `sys` holds the ABI's C types and constants (fixed by the
//! standard, so identical in every ABI library), `discovery` finds and loads the library and its
//! function table, `result` one `Result`-returning wrapper per call, `comm` the RAII owners
//! ([`Mpi`], [`MpiComm`], [`Request`]).
//!
//! Only the standard ABI is used: MPICH ≥ 5 (`pip install mpich` ships it) or Open MPI ≥ 6. An
//! MPI without it (Debian's Open MPI 4.1, `libmpi.so.40`; MPICH's `libmpi.so.12`) is refused with
//! [`MpiError::NotAbi`], naming what was found. Nothing about MPI is needed at build time.
//!
//! Environment:
//!
//! | variable | effect |
//! |---|---|
//! | `LOCKSTEP_MPI_LIBRARY` | use this library file (or folder) instead of searching |
//! | `LOCKSTEP_TIMEOUT_S` | how long a wait on MPI messages may take (default 300 s) |

mod comm;
mod discovery;
mod error;
mod result;
mod stage;
mod sys;

pub use comm::{Mpi, MpiComm, Request, Waited};
pub use discovery::LibraryInfo;
pub use error::MpiError;
pub(crate) use stage::{
    bytes_of, elems, elems_mut, from_bytes, read_mem, read_mem_into, to_bytes, with_host_elems_mut,
    write_mem,
};

/// Find and load the MPI library (once per process), without initialising MPI.
pub fn library() -> Result<&'static LibraryInfo, MpiError> {
    Ok(&discovery::loaded()?.info)
}

/// The MPI part of `lockstep env`: which library was found, where, why, and its versions; or why
/// none can be used.
pub fn mpi_report() -> String {
    match library() {
        Ok(l) => {
            let mut s = format!("  mpi    : {} (found via {})\n", l.path, l.origin);
            s.push_str(&format!("           chosen: {}\n", l.reason));
            s.push_str(&format!(
                "           MPI_Abi_get_version = {}.{}, MPI_Get_version = {}.{}\n",
                l.abi_version.0, l.abi_version.1, l.mpi_version.0, l.mpi_version.1
            ));
            if !l.library_version.is_empty() {
                s.push_str(&format!("           library: {}\n", l.library_version));
            }
            match &l.mpiexec {
                Some(m) => s.push_str(&format!("           mpiexec: {}\n", m.display())),
                None => s.push_str("           mpiexec: none beside the library\n"),
            }
            s
        }
        Err(e) => format!(
            "  mpi    : not usable\n           {}\n",
            crate::cuda::discovery::indent(&e.to_string())
        ),
    }
}
