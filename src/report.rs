//! `lockstep env`: what a bug report needs, gathered from every layer (the CUDA driver and NVRTC
//! from `cuda`, NCCL from `nccl`, MPI from `mpi`), without initialising CUDA or MPI.

use crate::cuda::cuda_report;
use crate::cuda::discovery::{indent, nccl_version_string};

/// A multi-line report of the CUDA driver, NVRTC, NCCL and MPI that lockstep finds: each
/// library, where it was found and why, and its version, plus the overriding variables that are
/// set.
pub fn env_report() -> String {
    let mut s = cuda_report();
    let nccl = match crate::nccl::result::core() {
        Ok(n) => {
            let mut t = format!("  nccl   : {} (found via {})\n", n.path, n.origin);
            t.push_str(&format!("           chosen: {}\n", n.reason));
            t.push_str(&format!(
                "           ncclGetVersion = {} ({})\n",
                n.version,
                nccl_version_string(n.version)
            ));
            if let Err(e) = crate::nccl::check_library() {
                t.push_str(&format!(
                    "           incomplete: {}\n",
                    indent(&e.to_string())
                ));
            }
            t
        }
        Err(e) => format!(
            "  nccl   : not found\n           {}\n",
            indent(&e.to_string())
        ),
    };
    s.push_str(&nccl);
    s.push_str(&crate::mpi::mpi_report());
    for var in [
        "CUDA_VISIBLE_DEVICES",
        "LOCKSTEP_CUDA_LIBRARY",
        "LOCKSTEP_NVRTC_LIBRARY",
        "LOCKSTEP_NCCL_LIBRARY",
        "LOCKSTEP_MPI_LIBRARY",
    ] {
        if let Ok(v) = std::env::var(var) {
            s.push_str(&format!("  {var}={v}\n"));
        }
    }
    s
}
