//! Result layer for NVRTC: our function table over `libnvrtc` and a `compile` that captures the
//! log.
//!
//! Choosing the library: PTX produced by an NVRTC newer than the driver is refused by the driver
//! (`CUDA_ERROR_UNSUPPORTED_PTX_VERSION`), so lockstep compiles CUBIN for the device's own arch and,
//! among the NVRTCs it finds (every candidate of the search, not the first), prefers the newest one
//! *no newer than the driver*. When only newer ones exist, it uses the newest and says so (CUBIN
//! still loads; an NVRTC that does not know the GPU's arch reports that clearly at compile time).
//!
//! The builtins library: `nvrtcCompileProgram` dlopens `libnvrtc-builtins.so.X.Y` by soname. Some
//! wheels (nvidia-cuda-nvrtc 13.0.88, the one PyTorch cu130 pins) ship a `libnvrtc.so.13` without
//! an `$ORIGIN` run path, so when lockstep loads NVRTC by path the loader cannot find the builtins
//! beside it and every compile fails with `NVRTC_ERROR_BUILTIN_OPERATION_FAILURE`. A candidate
//! therefore counts as usable only when its builtins load (from its own folder, else through the
//! loader's search path), and the chosen one's builtins are preloaded `RTLD_NOW | RTLD_GLOBAL`
//! from that file, so NVRTC's own dlopen by soname finds the library already mapped. Checking the
//! builtins stands in for a trial compile, which would initialise CUDA (see below) where
//! `lockstep env` promises not to.
//!
//! Compiling initialises CUDA: NVRTC 12.x loads `libcuda.so.1` and calls `cuInit` (and
//! `cuGetExportTable`) during `nvrtcCompileProgram` when a driver is installed. `compile` therefore
//! goes through the init guard first (see `init::before_nvrtc_compile`): compile kernels inside
//! the ranks, after the fork, never in the launching process.

use std::ffi::{c_char, c_int, CStr, CString};
use std::sync::OnceLock;

use cudarc::nvrtc::sys::nvrtcProgram;

use super::discovery::{self, LibKind, Loaded, Ranked};
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
    /// Why this NVRTC was chosen over the others found.
    pub reason: String,
    /// The builtins library preloaded for it (kept mapped for the life of the process).
    pub builtins: Builtins,
    pub f: NvrtcFns,
}

/// `libnvrtc-builtins` as preloaded for the chosen NVRTC.
pub(crate) struct Builtins {
    /// The file (or soname, when found through the loader's search path).
    pub path: String,
    #[allow(dead_code)]
    lib: libloading::os::unix::Library,
}

/// Soname of the builtins library of NVRTC `version` (`libnvrtc-builtins.so.13.0`).
pub(crate) fn builtins_soname(version: (i32, i32)) -> String {
    format!("libnvrtc-builtins.so.{}.{}", version.0, version.1)
}

/// Load the builtins of the NVRTC at `nvrtc_path` (version `version`): the file beside it, else the
/// soname through the loader's search path. `global` makes its symbols and soname visible to
/// NVRTC's own `dlopen`. The error says where it looked.
pub(crate) fn load_builtins(
    nvrtc_path: &str,
    version: (i32, i32),
    global: bool,
) -> Result<Builtins, String> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_LOCAL, RTLD_NOW};
    let soname = builtins_soname(version);
    let flags = RTLD_NOW | if global { RTLD_GLOBAL } else { RTLD_LOCAL };
    let beside = std::path::Path::new(nvrtc_path)
        .parent()
        .map(|d| d.join(&soname));
    let mut why = Vec::new();
    if let Some(file) = beside.as_ref().filter(|f| f.exists()) {
        // SAFETY: loading the NVRTC builtins runs its initialisers, which have no preconditions.
        match unsafe { Library::open(Some(file), flags) } {
            Ok(lib) => {
                return Ok(Builtins {
                    path: file.display().to_string(),
                    lib,
                })
            }
            Err(e) => why.push(format!("{}: {}", file.display(), discovery::dl_error(&e))),
        }
    } else if let Some(file) = &beside {
        why.push(format!("no {} beside it", file.display()));
    }
    // SAFETY: as above.
    match unsafe { Library::open(Some(&soname), flags) } {
        Ok(lib) => Ok(Builtins {
            path: format!("{soname} (dynamic loader search path)"),
            lib,
        }),
        Err(e) => {
            why.push(format!(
                "{soname} through the dynamic loader: {}",
                discovery::dl_error(&e)
            ));
            Err(format!(
                "its builtins library does not load ({}), so every compile would fail with NVRTC_ERROR_BUILTIN_OPERATION_FAILURE; install the matching {soname} beside it",
                why.join("; ")
            ))
        }
    }
}

static NVRTC: OnceLock<Result<NvrtcLib, CudaError>> = OnceLock::new();

/// Load NVRTC (once per process).
pub(crate) fn api() -> Result<&'static NvrtcLib, CudaError> {
    discovery::cached(&NVRTC, load)
}

fn version_of(f: &NvrtcFns) -> (i32, i32) {
    let (mut a, mut b) = (0, 0);
    // SAFETY: valid out-pointers.
    unsafe { (f.nvrtcVersion)(&mut a, &mut b) };
    (a, b)
}

fn load() -> Result<NvrtcLib, CudaError> {
    // The driver's CUDA version, when a driver is present (loading it does not initialise CUDA).
    let driver = super::driver::core()
        .ok()
        .and_then(|c| c.driver_version().ok());
    let loaded = discovery::load_newest(LibKind::Nvrtc, "nvrtcVersion", |lib, path| {
        match NvrtcFns::resolve(lib) {
            Err((sym, _)) => Ranked::Reject(format!("no symbol {sym}")),
            Ok(f) => {
                let (maj, min) = version_of(&f);
                if let Err(why) = load_builtins(path, (maj, min), false) {
                    return Ranked::Reject(why);
                }
                let code = maj * 1000 + min * 10;
                let mut notes = Vec::new();
                let fits = match driver {
                    Some(d) if code > d => {
                        notes.push(format!(
                        "NVRTC {maj}.{min} is newer than the driver (CUDA {}): its PTX would be refused; lockstep compiles CUBIN instead. \
Install an NVRTC no newer than the driver (or update the driver) if compilation for this GPU fails",
                        discovery::cuda_version_string(d)
                    ));
                        false
                    }
                    _ => true,
                };
                // No newer than the driver first, then the newest.
                Ranked::Usable {
                    rank: ((fits as u64) << 32) | code.max(0) as u64,
                    label: format!("NVRTC {maj}.{min}"),
                    notes,
                }
            }
        }
    })?;
    let f = LibKind::Nvrtc.resolve(&loaded, NvrtcFns::resolve)?;
    let version = version_of(&f);
    // Preloaded for good: NVRTC's dlopen of the soname at compile time then finds this file.
    let builtins =
        load_builtins(&loaded.path, version, true).map_err(|why| CudaError::LibraryNotFound {
            library: LibKind::Nvrtc.name(),
            searched: format!("{}: {why}", loaded.path),
            env_var: LibKind::Nvrtc.env_var(),
            hint: LibKind::Nvrtc.install_hint(),
        })?;
    for note in &loaded.notes {
        // Only newer-than-driver NVRTCs were found: say so once, where the user will see it.
        tracing::warn!("using {} ({note})", loaded.path);
    }
    tracing::debug!(
        "NVRTC {}.{}: {} ({}); builtins {}",
        version.0,
        version.1,
        loaded.path,
        loaded.reason,
        builtins.path
    );
    Ok(NvrtcLib {
        path: loaded.path.clone(),
        origin: loaded.origin.clone(),
        notes: loaded.notes.clone(),
        reason: loaded.reason.clone(),
        builtins,
        loaded,
        version,
        f,
    })
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
        Err(NvrtcError::Call {
            call: call.to_string(),
            code,
            message: self.error_string(code),
        })
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
        let hdr_src: Vec<CString> = headers
            .iter()
            .map(|(_, s)| nul(s))
            .collect::<Result<_, _>>()?;
        let hdr_names: Vec<CString> = headers
            .iter()
            .map(|(n, _)| nul(n))
            .collect::<Result<_, _>>()?;
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
        let rc =
            unsafe { (self.f.nvrtcCompileProgram)(prog, copts_p.len() as c_int, copts_p.as_ptr()) };
        if rc != 0 {
            let log = self.log(prog);
            if rc == 6 {
                return Err(NvrtcError::Compile {
                    program: program.into(),
                    options: options.join(" "),
                    log,
                });
            }
            return Err(NvrtcError::Call {
                call: format!("nvrtcCompileProgram({program}, [{}])", options.join(" ")),
                code: rc,
                message: format!("{}; log: {log}", self.error_string(rc)),
            });
        }
        let (size_fn, get_fn, what) = match out {
            Output::Ptx => (
                Some(self.f.nvrtcGetPTXSize),
                Some(self.f.nvrtcGetPTX),
                "PTX",
            ),
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
        let rc = unsafe { size_fn(prog, &mut n) };
        self.check(rc, &format!("nvrtcGet{what}Size({program})"))?;
        let mut buf = vec![0u8; n];
        // SAFETY: `buf` holds the `n` bytes NVRTC asked for.
        let rc = unsafe { get_fn(prog, buf.as_mut_ptr().cast()) };
        self.check(rc, &format!("nvrtcGet{what}({program})"))?;
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
        String::from_utf8_lossy(&buf)
            .trim_end_matches('\0')
            .trim()
            .to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A version nobody has: the error names the file looked for beside NVRTC, the soname tried
    /// through the loader, and the compile failure it prevents.
    #[test]
    fn missing_builtins_are_named() {
        let e = load_builtins("/nonexistent/lib/libnvrtc.so.99", (99, 7), false)
            .err()
            .expect("no such builtins");
        assert!(
            e.contains("/nonexistent/lib/libnvrtc-builtins.so.99.7"),
            "{e}"
        );
        assert!(
            e.contains("libnvrtc-builtins.so.99.7 through the dynamic loader"),
            "{e}"
        );
        assert!(e.contains("NVRTC_ERROR_BUILTIN_OPERATION_FAILURE"), "{e}");
        assert_eq!(builtins_soname((13, 0)), "libnvrtc-builtins.so.13.0");
    }
}
