//! CUDA driver + NVRTC, loaded at run time, behind a safe layer.
//!
//! Layers (as in cudarc: sys, result, safe): cudarc's `sys` modules give the C types; `discovery` finds and loads
//! the shared libraries (never panicking, unlike cudarc's own loader); `driver` and `nvrtc` hold
//! our function-pointer tables and one `Result`-returning wrapper per C call; `context`, `memory`,
//! `module` and `graph` are the RAII owners that callers use. A kernel file is described by a
//! [`KernelSource`] (`source`), compiled to CUBIN with a disk cache (`compile`) and loaded per
//! context (`module`); the CUDA layer knows no particular kernels. [`init`] is the single door to
//! `cuInit`, and the fork-safety check the launcher runs before forking ranks.
//!
//! Environment:
//!
//! | variable | effect |
//! |---|---|
//! | `LOCKSTEP_CUDA_LIBRARY`, `LOCKSTEP_NVRTC_LIBRARY`, `LOCKSTEP_NCCL_LIBRARY` | use this library file (or folder) instead of searching |
//! | `LOCKSTEP_DEBUG=1` | the launcher's fork check also forks a probe child that reports whether a rank can initialise CUDA |
//! | `LOCKSTEP_TIMEOUT_S` | NCCL init / synchronize timeout before `ncclCommAbort` (default 300) |
//! | `LOCKSTEP_NVRTC_OPTIONS` | extra NVRTC options for every kernel file, e.g. `-DLOCKSTEP_NO_TF32` (part of the cache key) |
//! | `XDG_CACHE_HOME` | kernel cache under `$XDG_CACHE_HOME/lockstep` (else `~/.cache/lockstep`) |
//! | `CUDA_VISIBLE_DEVICES` | applied by the driver itself |
//!
//! Fork rule: CUDA (including NVRTC compilation, which calls `cuInit` itself) belongs inside the
//! rank function. [`init::check_fork_safe`] refuses to fork otherwise, naming where CUDA was
//! initialised.
//!
//! Nothing here needs CUDA at build time: a machine without a driver builds, links and runs the
//! CPU paths; CUDA calls then return [`CudaError::LibraryNotFound`].

/// Declare a table of C function pointers resolved from one `libloading::Library`.
///
/// Each entry is `field = "symbol": fn(args) -> ret;`. Entries under `required` make loading fail
/// with the missing symbol's name; entries under `optional` become `Option`s.
macro_rules! fn_table {
    (
        $(#[$meta:meta])*
        $vis:vis struct $T:ident {
            required { $( $f:ident = $sym:literal : fn($($a:ty),* $(,)?) -> $r:ty; )* }
            optional { $( $of:ident = $osym:literal : fn($($oa:ty),* $(,)?) -> $or:ty; )* }
        }
    ) => {
        $(#[$meta])*
        #[allow(non_snake_case, dead_code)]
        $vis struct $T {
            $( pub(crate) $f: unsafe extern "C" fn($($a),*) -> $r, )*
            $( pub(crate) $of: Option<unsafe extern "C" fn($($oa),*) -> $or>, )*
        }

        impl $T {
            /// Resolve every symbol from `lib`. Returns the name of the first required symbol that
            /// is missing.
            #[allow(non_snake_case)]
            pub(crate) fn resolve(lib: &libloading::Library) -> Result<$T, (&'static str, String)> {
                $(
                    // SAFETY: the declared signature is the C prototype of `$sym` in the library's
                    // header (CUDA, NCCL, MPI-5 `mpi_abi.h`); the pointer is copied out and only
                    // used while `lib` stays loaded (libraries are kept loaded for the life of the
                    // process).
                    let $f = unsafe {
                        *lib.get::<unsafe extern "C" fn($($a),*) -> $r>(concat!($sym, "\0").as_bytes())
                            .map_err(|e| ($sym, $crate::cuda::discovery::dl_error(&e)))?
                    };
                )*
                $(
                    // SAFETY: as above; a missing optional symbol is `None`.
                    let $of = unsafe {
                        lib.get::<unsafe extern "C" fn($($oa),*) -> $or>(concat!($osym, "\0").as_bytes()).ok().map(|s| *s)
                    };
                )*
                Ok($T { $( $f, )* $( $of, )* })
            }
        }
    };
}

mod compile;
mod context;
pub(crate) mod discovery;
pub(crate) mod driver;
mod error;
mod graph;
pub mod init;
mod memory;
mod module;
pub(crate) mod nvrtc;
mod report;
mod source;

pub use compile::{cache_dir, compile_cubin_cached, compile_ptx, extra_nvrtc_options, NvrtcInfo};
pub(crate) use context::StreamFence;
pub use context::{
    device_count, device_for_local_rank, Context, DeviceInfo, Event, ForeignStream, Producers,
    Stream,
};
pub use discovery::{cuda_version_string, nccl_version_string, LibKind};
pub use error::{CudaError, NvrtcError};
pub use graph::Graph;
pub use memory::{DeviceBuffer, DeviceView, DeviceViewMut, HostReadback, PinnedBuffer};
pub use module::{Function, KernelGrid, KernelScalar, Launch, Module};
pub use report::cuda_report;
pub use source::{ArgKind, KernelSig, KernelSource};

/// True when a CUDA driver library can be loaded (does not initialise CUDA).
pub fn driver_present() -> bool {
    driver::core().is_ok()
}
