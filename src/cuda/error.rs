//! Errors of the CUDA layer: [`CudaError`] for the driver and loading, [`NvrtcError`] for the
//! run-time compiler. Every message names the call, carries the library's own error string
//! (`cuGetErrorName`/`cuGetErrorString`, `nvrtcGetErrorString`, the NVRTC log) and says what to do.

/// A driver call's status, with the driver's own name and description of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverStatus {
    /// The raw `CUresult`.
    pub code: i32,
    /// `cuGetErrorName`, e.g. `CUDA_ERROR_OUT_OF_MEMORY`.
    pub name: String,
    /// `cuGetErrorString`.
    pub message: String,
}

impl std::fmt::Display for DriverStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({}): {}", self.name, self.code, self.message)
    }
}

/// What to do next for common driver errors.
pub(crate) fn driver_hint(code: i32) -> &'static str {
    match code {
        2 => "free device memory or use smaller buffers",
        3 => "CUDA was not initialised through lockstep::cuda::init (internal error: report it)",
        34 => "the installed libcuda is a link-time stub: install the NVIDIA driver",
        35 => "the NVIDIA driver is older than this CUDA library: update the driver",
        100 => "no GPU is visible: check nvidia-smi and CUDA_VISIBLE_DEVICES",
        101 => "the device ordinal is out of range: check CUDA_VISIBLE_DEVICES and the local rank",
        201 | 202 => "the CUDA context is unusable; was it created before a fork? create CUDA state inside the rank function",
        209 => "no kernel image for this GPU: the module was compiled for another architecture",
        218 | 222 => "the PTX was produced by an NVRTC newer than the driver: lockstep compiles CUBIN for the device arch; update the driver or use an NVRTC no newer than it",
        700 | 716 | 719 => "a kernel faulted; the context is lost: rerun with compute-sanitizer to find it",
        _ => "see the CUDA driver API documentation for this error",
    }
}

/// Errors of the CUDA driver layer.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// A shared library could not be found or loaded.
    #[error("{library} not found. Tried:\n  {searched}\nTo fix: {hint}; or set {env_var} to the library file (or its folder)")]
    LibraryNotFound {
        /// Which library.
        library: &'static str,
        /// Every place tried, one per line.
        searched: String,
        /// The override variable.
        env_var: &'static str,
        /// What to install.
        hint: &'static str,
    },
    /// A loaded library lacks a function lockstep needs.
    #[error(
        "{library} at {path} has no symbol `{symbol}` ({detail}); it is too old or not the real library: point {env_var} at a newer one"
    )]
    MissingSymbol {
        /// Which library.
        library: &'static str,
        /// Its file.
        path: String,
        /// The missing function.
        symbol: &'static str,
        /// The loader's message.
        detail: String,
        /// The override variable.
        env_var: &'static str,
    },
    /// A driver call failed.
    #[error("{call} failed: {status}. To fix: {hint}")]
    Driver {
        /// The call with its arguments.
        call: String,
        /// The driver's status.
        status: DriverStatus,
        /// What to do next.
        hint: &'static str,
    },
    /// CUDA was (or would be) initialised where that breaks the fork-based launcher.
    #[error("{0}")]
    ForkUnsafe(String),
    /// A caller's argument does not fit the call (checked before calling the driver).
    #[error("{op}: {detail}")]
    InvalidArgument {
        /// The operation.
        op: String,
        /// What is wrong and what was expected.
        detail: String,
    },
    /// An error recorded while dropping a CUDA object, reported at the next call.
    #[error("an earlier release of {what} failed: {source}")]
    Deferred {
        /// What was being released.
        what: String,
        /// The failure.
        #[source]
        source: Box<CudaError>,
    },
    /// Kernel compilation failed.
    #[error(transparent)]
    Nvrtc(#[from] NvrtcError),
    /// Reading or writing the kernel cache failed (the cache is an optimisation: reported, not fatal
    /// where avoidable).
    #[error("{0}")]
    Io(String),
}

/// Errors of NVRTC.
#[derive(Clone, Debug, thiserror::Error)]
pub enum NvrtcError {
    /// An NVRTC call failed.
    #[error("{call} failed: {message} ({code})")]
    Call {
        /// The call.
        call: String,
        /// The raw `nvrtcResult`.
        code: i32,
        /// `nvrtcGetErrorString`.
        message: String,
    },
    /// The program did not compile.
    #[error("NVRTC could not compile {program} with options [{options}]:\n{log}\nTo fix: correct the kernel source (kernels/{program}); the NVRTC log above names the line")]
    Compile {
        /// The program (file name).
        program: String,
        /// Options passed.
        options: String,
        /// The compiler log.
        log: String,
    },
    /// The NVRTC library is missing or unusable.
    #[error("{0}")]
    Load(Box<CudaError>),
}
