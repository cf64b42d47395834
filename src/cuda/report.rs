//! The CUDA part of `lockstep env`: which driver and NVRTC were found, where, and their versions.

use super::discovery::{cuda_version_string, indent};
use super::{driver, init, nvrtc};

/// The CUDA part of `lockstep env`: the driver and NVRTC lockstep finds, where, and their versions.
/// Loading a library does not initialise CUDA (no `cuInit`), so this is safe to call before forking.
pub fn cuda_report() -> String {
    let mut s = String::new();
    s.push_str("lockstep CUDA environment\n");
    match driver::core() {
        Ok(core) => {
            s.push_str(&format!(
                "  driver : {} (found via {})\n",
                core.path, core.origin
            ));
            s.push_str(&format!("           chosen: {}\n", core.loaded.reason));
            match core.driver_version() {
                Ok(v) => s.push_str(&format!(
                    "           cuDriverGetVersion = {v} (CUDA {})\n",
                    cuda_version_string(v)
                )),
                Err(e) => s.push_str(&format!("           cuDriverGetVersion failed: {e}\n")),
            }
            s.push_str(&format!(
                "           initialised in this process: {}\n",
                init::describe_state()
            ));
        }
        Err(e) => s.push_str(&format!(
            "  driver : not found\n           {}\n",
            indent(&e.to_string())
        )),
    }
    match nvrtc::api() {
        Ok(n) => {
            s.push_str(&format!("  nvrtc  : {} (found via {})\n", n.path, n.origin));
            s.push_str(&format!(
                "           nvrtcVersion = {}.{}\n",
                n.version.0, n.version.1
            ));
            s.push_str(&format!("           chosen: {}\n", n.reason));
            s.push_str(&format!(
                "           builtins: {} (preloaded)\n",
                n.builtins.path
            ));
            for note in &n.notes {
                s.push_str(&format!("           note: {note}\n"));
            }
        }
        Err(e) => s.push_str(&format!(
            "  nvrtc  : not found\n           {}\n",
            indent(&e.to_string())
        )),
    }
    s
}
