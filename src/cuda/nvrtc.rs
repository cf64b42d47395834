//! Result layer for NVRTC: our function table over `libnvrtc` and a `compile` that captures the
//! log.
//!
//! Choosing the library: PTX produced by an NVRTC newer than the driver is refused by the driver
//! (`CUDA_ERROR_UNSUPPORTED_PTX_VERSION`), so lockstep compiles CUBIN for the device's own arch and,
//! among the NVRTCs it finds, prefers the newest one *no newer than the driver*. When only newer
//! ones exist, it uses one and says so (CUBIN still loads; an NVRTC that does not know the GPU's
//! arch reports that clearly at compile time).
//!
//! Compiling initialises CUDA: NVRTC 12.x loads `libcuda.so.1` and calls `cuInit` (and
//! `cuGetExportTable`) during `nvrtcCompileProgram` when a driver is installed. `compile` therefore
//! goes through the init guard first (see `init::before_nvrtc_compile`): compile kernels inside
//! the ranks, after the fork, never in the launching process.

use std::ffi::{c_char, c_int, CStr, CString};
use std::sync::OnceLock;

use cudarc::nvrtc::sys::nvrtcProgram;

use super::discovery::{self, LibKind, Loaded, Verdict};
use super::error::{CudaError, NvrtcError};

fn_table! {
    /// NVRTC entry points.
    pub(crate) struct NvrtcFns {
        required {
            nvrtcVersion = "nvrtcVersion": fn(*mut c_int, *mut c_int) -> c_int;
            nvrtcGetErrorString = "nvrtcGetErrorString": fn(c_int) -> *const c_char;
            nvrtcCreateProgram = "nvrtcCreateProgram": fn(*mut nvrtcProgram, *const c_char, *const c_char, c_int, *const *const c_char, *const *const c_char) -> c_int;
            nvrtcDestroyProgram = "nvrtcDestroyProgram": fn(*mut nvrtcProgram) -> c_int;
            nvrtcCompileProgram = "nvrtcCompileProgram": fn(nvrtcProgram, c_int, *const *const c_char) -> c_int;
            nvrtcGetProgramLogSize = "nvrtcGetProgramLogSize": fn(nvrtcProgram, *mut usize) -> c_int;
            nvrtcGetProgramLog = "nvrtcGetProgramLog": fn(nvrtcProgram, *mut c_char) -> c_int;
            nvrtcGetPTXSize = "nvrtcGetPTXSize": fn(nvrtcProgram, *mut usize) -> c_int;
            nvrtcGetPTX = "nvrtcGetPTX": fn(nvrtcProgram, *mut c_char) -> c_int;
        }
        optional {
            nvrtcGetCUBINSize = "nvrtcGetCUBINSize": fn(nvrtcProgram, *mut usize) -> c_int;
            nvrtcGetCUBIN = "nvrtcGetCUBIN": fn(nvrtcProgram, *mut c_char) -> c_int;
        }
    }
}

/// The loaded NVRTC.
pub(crate) struct NvrtcLib {
    #[allow(dead_code)]
    pub loaded: Loaded,
    pub path: String,
    pub origin: String,
    /// (major, minor).
    pub version: (i32, i32),
    pub notes: Vec<String>,
    pub f: NvrtcFns,
}

static NVRTC: OnceLock<Result<NvrtcLib, CudaError>> = OnceLock::new();

/// Load NVRTC (once per process).
pub(crate) fn api() -> Result<&'static NvrtcLib, CudaError> {
    NVRTC.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn version_of(f: &NvrtcFns) -> (i32, i32) {
    let (mut a, mut b) = (0, 0);
    // SAFETY: valid out-pointers.
    unsafe { (f.nvrtcVersion)(&mut a, &mut b) };
    (a, b)
}

fn load() -> Result<NvrtcLib, CudaError> {
    // The driver's CUDA version, when a driver is present (loading it does not initialise CUDA).
    let driver = super::driver::core().ok().and_then(|c| c.driver_version().ok());
    let loaded = discovery::load(LibKind::Nvrtc, "nvrtcVersion", |lib, _path| match NvrtcFns::resolve(lib) {
        Err((sym, _)) => Verdict::Reject(format!("no symbol {sym}")),
        Ok(f) => {
            let (maj, min) = version_of(&f);
            match driver {
                Some(d) if maj * 1000 + min * 10 > d => Verdict::Fallback(format!(
                    "NVRTC {maj}.{min} is newer than the driver (CUDA {}): its PTX would be refused; lockstep compiles CUBIN instead. \
Install an NVRTC no newer than the driver (or update the driver) if compilation for this GPU fails",
                    discovery::cuda_version_string(d)
                )),
                _ => Verdict::Accept,
            }
        }
    })?;
    let f = NvrtcFns::resolve(&loaded.lib).map_err(|(sym, detail)| CudaError::MissingSymbol {
        library: LibKind::Nvrtc.name(),
        path: loaded.path.clone(),
        symbol: sym,
        detail,
        env_var: LibKind::Nvrtc.env_var(),
    })?;
    let version = version_of(&f);
    for note in &loaded.notes {
        // Only newer-than-driver NVRTCs were found: say so once, where the user will see it.
        tracing::warn!("using {} ({note})", loaded.path);
    }
    Ok(NvrtcLib { path: loaded.path.clone(), origin: loaded.origin.clone(), notes: loaded.notes.clone(), loaded, version, f })
}

/// What to produce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Output {
    /// PTX text (for `compute_XY` targets).
    Ptx,
    /// CUBIN for a real `sm_XY` arch.
    Cubin,
}

impl NvrtcLib {
    fn error_string(&self, code: c_int) -> String {
        // SAFETY: nvrtcGetErrorString returns a static NUL-terminated string for any code.
        let p = unsafe { (self.f.nvrtcGetErrorString)(code) };
        if p.is_null() {
            return format!("nvrtcResult {code}");
        }
        // SAFETY: see above.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    fn check(&self, code: c_int, call: &str) -> Result<(), NvrtcError> {
        if code == 0 {
            return Ok(());
        }
        Err(NvrtcError::Call { call: call.to_string(), code, message: self.error_string(code) })
    }

    /// Compile `source` (named `program`) with in-memory `headers` (name, text) and `options`.
    pub fn compile(
        &self,
        program: &str,
        source: &str,
        headers: &[(&str, &str)],
        options: &[String],
        out: Output,
    ) -> Result<Vec<u8>, NvrtcError> {
        super::init::before_nvrtc_compile();
        let nul = |s: &str| {
            CString::new(s).map_err(|_| NvrtcError::Call {
                call: "nvrtcCreateProgram".into(),
                code: 3,
                message: format!("{program}: text contains a NUL byte"),
            })
        };
        let csrc = nul(source)?;
        let cname = nul(program)?;
        let hdr_src: Vec<CString> = headers.iter().map(|(_, s)| nul(s)).collect::<Result<_, _>>()?;
        let hdr_names: Vec<CString> = headers.iter().map(|(n, _)| nul(n)).collect::<Result<_, _>>()?;
        let hdr_src_p: Vec<*const c_char> = hdr_src.iter().map(|c| c.as_ptr()).collect();
        let hdr_names_p: Vec<*const c_char> = hdr_names.iter().map(|c| c.as_ptr()).collect();
        let copts: Vec<CString> = options.iter().map(|o| nul(o)).collect::<Result<_, _>>()?;
        let copts_p: Vec<*const c_char> = copts.iter().map(|c| c.as_ptr()).collect();

        let mut prog: nvrtcProgram = std::ptr::null_mut();
        // SAFETY: all strings are NUL-terminated and outlive the call; the header arrays have
        // `headers.len()` entries each.
        let rc = unsafe {
            (self.f.nvrtcCreateProgram)(
                &mut prog,
                csrc.as_ptr(),
                cname.as_ptr(),
                headers.len() as c_int,
                hdr_src_p.as_ptr(),
                hdr_names_p.as_ptr(),
            )
        };
        self.check(rc, &format!("nvrtcCreateProgram({program})"))?;
        let result = self.compile_program(prog, program, &copts_p, options, out);
        // SAFETY: `prog` was created above and is not used after this.
        unsafe { (self.f.nvrtcDestroyProgram)(&mut prog) };
        result
    }

    fn compile_program(
        &self,
        prog: nvrtcProgram,
        program: &str,
        copts_p: &[*const c_char],
        options: &[String],
        out: Output,
    ) -> Result<Vec<u8>, NvrtcError> {
        // SAFETY: `prog` is live; the option pointers are valid NUL-terminated strings.
        let rc = unsafe { (self.f.nvrtcCompileProgram)(prog, copts_p.len() as c_int, copts_p.as_ptr()) };
        if rc != 0 {
            let log = self.log(prog);
            if rc == 6 {
                return Err(NvrtcError::Compile { program: program.into(), options: options.join(" "), log });
            }
            return Err(NvrtcError::Call {
                call: format!("nvrtcCompileProgram({program}, [{}])", options.join(" ")),
                code: rc,
                message: format!("{}; log: {log}", self.error_string(rc)),
            });
        }
        let (size_fn, get_fn, what) = match out {
            Output::Ptx => (Some(self.f.nvrtcGetPTXSize), Some(self.f.nvrtcGetPTX), "PTX"),
            Output::Cubin => (self.f.nvrtcGetCUBINSize, self.f.nvrtcGetCUBIN, "CUBIN"),
        };
        let (Some(size_fn), Some(get_fn)) = (size_fn, get_fn) else {
            return Err(NvrtcError::Call {
                call: "nvrtcGetCUBIN".into(),
                code: -1,
                message: "this NVRTC cannot emit CUBIN (needs CUDA ≥ 11.1)".into(),
            });
        };
        let mut n = 0usize;
        // SAFETY: live, compiled program; valid out-pointer.
        self.check(unsafe { size_fn(prog, &mut n) }, &format!("nvrtcGet{what}Size({program})"))?;
        let mut buf = vec![0u8; n];
        // SAFETY: `buf` holds the `n` bytes NVRTC asked for.
        self.check(unsafe { get_fn(prog, buf.as_mut_ptr().cast()) }, &format!("nvrtcGet{what}({program})"))?;
        Ok(buf)
    }

    fn log(&self, prog: nvrtcProgram) -> String {
        let mut n = 0usize;
        // SAFETY: live program, valid out-pointer.
        if unsafe { (self.f.nvrtcGetProgramLogSize)(prog, &mut n) } != 0 || n == 0 {
            return String::new();
        }
        let mut buf = vec![0u8; n];
        // SAFETY: `buf` holds `n` bytes.
        unsafe { (self.f.nvrtcGetProgramLog)(prog, buf.as_mut_ptr().cast()) };
        String::from_utf8_lossy(&buf).trim_end_matches('\0').trim().to_string()
    }
}
