//! Finding and loading the CUDA driver, NVRTC and NCCL shared libraries.
//!
//! cudarc's own loader panics when a library or symbol is missing and does not know `libnccl.so.2`,
//! so lockstep loads the libraries itself (with `libloading`) and keeps cudarc only for the C types.
//! Search order for each library:
//!
//! 1. the override variable (`LOCKSTEP_CUDA_LIBRARY`, `LOCKSTEP_NVRTC_LIBRARY`,
//!    `LOCKSTEP_NCCL_LIBRARY`): a file, or a folder to search; when set, nothing else is tried;
//! 2. the standard sonames through the dynamic loader (`LD_LIBRARY_PATH`, ldconfig cache);
//! 3. Python wheel folders (`site-packages/nvidia/*/lib` under `VIRTUAL_ENV`, `CONDA_PREFIX`, the
//!    site-packages of the `python3` on `PATH` (asked once per process, so an un-activated
//!    virtual environment or conda install whose interpreter is on `PATH` counts),
//!    `/usr/local/lib/python3*`, `/usr/lib/python3`, `~/.local/lib/python3*`, and `.ci-deps/*`);
//! 4. CUDA toolkit folders (`CUDA_HOME`, `CUDA_PATH`, `/usr/local/cuda*`, `/opt/cuda`), and for
//!    the driver the distribution and container folders.
//!
//! The driver and NCCL take the first usable candidate in that order. NVRTC takes the newest
//! usable one ([`load_newest`]): several are often installed side by side (a toolkit, PyTorch's
//! wheel, a venv), and an older one found first should not win over a newer one.
//!
//! A failure lists every place tried and says how to point lockstep at the library.

use std::ffi::CStr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libloading::Library;

use super::error::CudaError;

/// The libraries lockstep loads at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LibKind {
    /// The CUDA driver, `libcuda.so.1`.
    Driver,
    /// The NVRTC run-time compiler, `libnvrtc.so.*`.
    Nvrtc,
    /// NCCL, `libnccl.so.2`.
    Nccl,
}

impl LibKind {
    /// Human name used in messages.
    pub const fn name(self) -> &'static str {
        match self {
            LibKind::Driver => "CUDA driver library (libcuda)",
            LibKind::Nvrtc => "NVRTC library (libnvrtc)",
            LibKind::Nccl => "NCCL library (libnccl)",
        }
    }

    /// The error for this library, loaded from `path`, lacking `symbol` (`detail`: the loader's
    /// message): what every table that resolves from it reports.
    pub(crate) fn missing_symbol(
        self,
        path: &str,
        (symbol, detail): (&'static str, String),
    ) -> CudaError {
        CudaError::MissingSymbol {
            library: self.name(),
            path: path.to_string(),
            symbol,
            detail,
            env_var: self.env_var(),
        }
    }

    /// A function table (the `resolve` of a `dyn_fns!` table) from this library as `loaded`,
    /// its first missing symbol named in the error.
    pub(crate) fn resolve<T>(
        self,
        loaded: &Loaded,
        resolve: fn(&Library) -> Result<T, (&'static str, String)>,
    ) -> Result<T, CudaError> {
        resolve(&loaded.lib).map_err(|e| self.missing_symbol(&loaded.path, e))
    }

    /// The override environment variable.
    pub const fn env_var(self) -> &'static str {
        match self {
            LibKind::Driver => "LOCKSTEP_CUDA_LIBRARY",
            LibKind::Nvrtc => "LOCKSTEP_NVRTC_LIBRARY",
            LibKind::Nccl => "LOCKSTEP_NCCL_LIBRARY",
        }
    }

    /// Sonames tried through the dynamic loader, newest first.
    pub const fn sonames(self) -> &'static [&'static str] {
        match self {
            LibKind::Driver => &["libcuda.so.1", "libcuda.so"],
            LibKind::Nvrtc => &[
                "libnvrtc.so.13",
                "libnvrtc.so.12",
                "libnvrtc.so.11.2",
                "libnvrtc.so",
            ],
            LibKind::Nccl => &["libnccl.so.2", "libnccl.so"],
        }
    }

    /// File-name prefix that matches the library in a folder (`libnvrtc.so.12`, not `libnvrtc-builtins`).
    const fn file_prefix(self) -> &'static str {
        match self {
            LibKind::Driver => "libcuda.so",
            LibKind::Nvrtc => "libnvrtc.so",
            LibKind::Nccl => "libnccl.so",
        }
    }

    /// Sub-folders of `site-packages/nvidia` where NVIDIA's wheels put this library.
    const fn wheel_subdirs(self) -> &'static [&'static str] {
        match self {
            LibKind::Driver => &[],
            LibKind::Nvrtc => &["cu13/lib", "cuda_nvrtc/lib"],
            LibKind::Nccl => &["cu13/lib", "nccl/lib"],
        }
    }

    /// What to install when the library is missing.
    pub(crate) const fn install_hint(self) -> &'static str {
        match self {
            LibKind::Driver => "install the NVIDIA driver (it provides libcuda.so.1)",
            LibKind::Nvrtc => "install the CUDA toolkit, or `pip install nvidia-cuda-nvrtc-cu12` (CUDA 12) / `nvidia-cuda-nvrtc` (CUDA 13)",
            LibKind::Nccl => "`pip install nvidia-nccl-cu12` (or nvidia-nccl-cu13), or install the libnccl2 package",
        }
    }
}

/// One place a library may be: a path, or a soname resolved by the dynamic loader.
#[derive(Clone, Debug)]
pub struct Candidate {
    /// Path or soname passed to `dlopen`.
    pub spec: String,
    /// Where the candidate came from (for the report).
    pub origin: String,
}

/// A library loaded for the rest of the process.
#[derive(Debug)]
pub(crate) struct Loaded {
    pub lib: Library,
    /// The file actually mapped (resolved through `dladdr` where possible).
    pub path: String,
    /// Where it was found.
    pub origin: String,
    /// Remarks made while choosing (e.g. "NVRTC newer than the driver").
    pub notes: Vec<String>,
    /// Why this candidate was chosen (for `lockstep env`).
    pub reason: String,
}

/// The outcome kept in `cell`, computed by `init` on first use: a library and its function tables
/// are loaded once per process, and a failure is kept as well, so every later call reports the
/// same error instead of searching again.
pub(crate) fn cached<T>(
    cell: &'static OnceLock<Result<T, CudaError>>,
    init: impl FnOnce() -> Result<T, CudaError>,
) -> Result<&'static T, CudaError> {
    cell.get_or_init(init).as_ref().map_err(Clone::clone)
}

/// What a probe says about a loaded candidate.
pub(crate) enum Verdict {
    /// Use it.
    Accept,
    /// Not usable (reason).
    Reject(String),
}

/// The value of a variable if set and not empty.
fn env_nonempty(var: &str) -> Option<String> {
    std::env::var(var).ok().filter(|v| !v.trim().is_empty())
}

/// Entries of `dir` whose names start with `prefix`, sorted descending (newest version first).
pub(crate) fn dir_entries_with_prefix(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = rd
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
        .map(|e| e.path())
        .collect();
    v.sort();
    v.reverse();
    v
}

/// What the interpreter prints: its site-packages folders (system, user, and any `sys.path`
/// entry that is one), one per line. No CUDA or NVIDIA package is imported.
const PYTHON_SITE_SCRIPT: &str = "import site, sys
p = list(getattr(site, 'getsitepackages', lambda: [])())
try:
    p.append(site.getusersitepackages())
except Exception:
    pass
p += [x for x in sys.path if x.rstrip('/').endswith(('site-packages', 'dist-packages'))]
print('\\n'.join(p))
";

/// How long the interpreter may take before it is killed (a broken `.pth` hook must not hang
/// library discovery).
const PYTHON_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The site-packages folders that `python` reports, in its order; empty when it cannot be run,
/// fails or times out (said at debug level: a machine without Python is normal).
pub(crate) fn site_dirs_of(python: &Path) -> Vec<PathBuf> {
    use std::io::Read as _;
    use std::process::{Command, Stdio};
    let child = Command::new(python)
        .args(["-c", PYTHON_SITE_SCRIPT])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            tracing::debug!("library discovery: cannot run {}: {e}", python.display());
            return Vec::new();
        }
    };
    let start = std::time::Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break Some(st),
            Ok(None) if start.elapsed() < PYTHON_TIMEOUT => {
                std::thread::sleep(std::time::Duration::from_millis(5))
            }
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
        }
    };
    let mut out = String::new();
    if let Some(mut so) = child.stdout.take() {
        let _ = so.read_to_string(&mut out);
    }
    match status {
        Some(st) if st.success() => out
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(PathBuf::from)
            .collect(),
        Some(st) => {
            tracing::debug!(
                "library discovery: {} exited with {st}; its site-packages are not searched",
                python.display()
            );
            Vec::new()
        }
        None => {
            tracing::debug!(
                "library discovery: {} did not answer within {} s; its site-packages are not searched",
                python.display(),
                PYTHON_TIMEOUT.as_secs()
            );
            Vec::new()
        }
    }
}

/// The site-packages of the `python3` on `PATH`, asked once per process.
fn path_python_site_dirs() -> &'static [PathBuf] {
    static DIRS: std::sync::OnceLock<Vec<PathBuf>> = std::sync::OnceLock::new();
    DIRS.get_or_init(|| site_dirs_of(Path::new("python3")))
}

/// Python `site-packages`/`dist-packages` folders worth scanning.
pub(crate) fn python_site_dirs() -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut roots: Vec<PathBuf> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(p) = env_nonempty(var) {
            roots.push(PathBuf::from(p).join("lib"));
        }
    }
    push_site_dirs(&roots, &mut out);
    // An environment whose interpreter is on PATH without being activated (PyTorch's venv run
    // by its full path, a conda base) sets neither variable: ask that interpreter.
    out.extend(
        path_python_site_dirs()
            .iter()
            .filter(|d| d.is_dir())
            .cloned(),
    );
    let mut roots: Vec<PathBuf> = Vec::new();
    roots.push(PathBuf::from("/usr/local/lib"));
    roots.push(PathBuf::from("/usr/lib"));
    if let Some(home) = env_nonempty("HOME") {
        roots.push(PathBuf::from(home).join(".local/lib"));
    }
    push_site_dirs(&roots, &mut out);
    // `pip install --target .ci-deps/<name>` (see .ci/install-nvrtc.sh), relative to the working
    // directory and to the crate root (tests run in the crate root).
    for base in [
        PathBuf::from(".ci-deps"),
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".ci-deps"),
    ] {
        for d in dir_entries_with_prefix(&base, "") {
            out.push(d);
        }
    }
    let mut seen = Vec::new();
    out.retain(|d| {
        let c = std::fs::canonicalize(d).unwrap_or_else(|_| d.clone());
        let fresh = !seen.contains(&c);
        seen.push(c);
        fresh
    });
    out
}

/// `root/python3*/{site,dist}-packages` folders that exist, for each root.
fn push_site_dirs(roots: &[PathBuf], out: &mut Vec<PathBuf>) {
    for root in roots {
        for py in dir_entries_with_prefix(root, "python3") {
            for leaf in ["site-packages", "dist-packages"] {
                let d = py.join(leaf);
                if d.is_dir() {
                    out.push(d);
                }
            }
        }
    }
}

/// CUDA toolkit roots.
fn toolkit_roots() -> Vec<PathBuf> {
    let mut roots = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"] {
        if let Some(p) = env_nonempty(var) {
            roots.push(PathBuf::from(p));
        }
    }
    roots.extend(dir_entries_with_prefix(Path::new("/usr/local"), "cuda"));
    roots.push(PathBuf::from("/opt/cuda"));
    roots.dedup();
    roots
}

/// Folders searched for `kind` after the sonames.
pub fn search_dirs(kind: LibKind) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    // The driver comes in no wheel: do not run Python for it.
    let sites = if kind.wheel_subdirs().is_empty() {
        Vec::new()
    } else {
        python_site_dirs()
    };
    for site in sites {
        for sub in kind.wheel_subdirs() {
            dirs.push(site.join("nvidia").join(sub));
        }
    }
    let arch = if cfg!(target_arch = "aarch64") {
        "sbsa-linux"
    } else {
        "x86_64-linux"
    };
    for root in toolkit_roots() {
        dirs.push(root.join("lib64"));
        dirs.push(root.join("targets").join(arch).join("lib"));
    }
    if kind == LibKind::Driver {
        for d in [
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib/aarch64-linux-gnu",
            "/usr/lib64",
            "/usr/lib/wsl/lib",
            "/usr/local/nvidia/lib64",
        ] {
            dirs.push(PathBuf::from(d));
        }
    }
    dirs
}

/// Every candidate for `kind`, in search order. With the override variable set, only it (a value
/// that is not UTF-8 stays the only candidate, named as such, so it fails instead of being
/// silently skipped).
pub fn candidates(kind: LibKind) -> Vec<Candidate> {
    if let Err(e) = crate::types::env::raw(kind.env_var()) {
        return vec![Candidate {
            spec: e.value.clone(),
            origin: e.to_string(),
        }];
    }
    if let Some(p) = env_nonempty(kind.env_var()) {
        let path = PathBuf::from(&p);
        if path.is_dir() {
            return dir_entries_with_prefix(&path, kind.file_prefix())
                .into_iter()
                .map(|f| Candidate {
                    spec: f.display().to_string(),
                    origin: format!("{} folder", kind.env_var()),
                })
                .collect();
        }
        return vec![Candidate {
            spec: p,
            origin: kind.env_var().to_string(),
        }];
    }
    let mut out: Vec<Candidate> = kind
        .sonames()
        .iter()
        .map(|s| Candidate {
            spec: s.to_string(),
            origin: "dynamic loader search path".into(),
        })
        .collect();
    for dir in search_dirs(kind) {
        for f in dir_entries_with_prefix(&dir, kind.file_prefix()) {
            // Skip the driver's link-time stub: it answers every call with CUDA_ERROR_STUB_LIBRARY.
            if f.to_string_lossy().contains("/stubs/") {
                continue;
            }
            out.push(Candidate {
                spec: f.display().to_string(),
                origin: dir.display().to_string(),
            });
        }
    }
    out
}

/// The file that `lib` was loaded from, found through `dladdr` on one of its symbols.
pub(crate) fn resolved_path(lib: &Library, symbol: &str, fallback: &str) -> String {
    let name = format!("{symbol}\0");
    // SAFETY: we only take the symbol's address (as an opaque pointer), never call it.
    let addr = unsafe {
        lib.get::<*const libc::c_void>(name.as_bytes())
            .ok()
            .map(|s| *s)
    };
    let Some(addr) = addr else {
        return fallback.to_string();
    };
    let mut info: libc::Dl_info = libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    // SAFETY: `addr` lies in a loaded object; `info` is a valid out-parameter.
    let ok = unsafe { libc::dladdr(addr, &mut info) };
    if ok == 0 || info.dli_fname.is_null() {
        return fallback.to_string();
    }
    // SAFETY: dladdr returned a NUL-terminated path owned by the loader.
    let p = unsafe { CStr::from_ptr(info.dli_fname) }
        .to_string_lossy()
        .into_owned();
    std::fs::canonicalize(&p)
        .map(|c| c.display().to_string())
        .unwrap_or(p)
}

/// Load the first acceptable candidate for `kind`. `probe` gets each loaded library; `symbol` is
/// any symbol the library exports (used to resolve its path).
pub(crate) fn load(
    kind: LibKind,
    symbol: &str,
    mut probe: impl FnMut(&Library, &str) -> Verdict,
) -> Result<Loaded, CudaError> {
    let mut tried: Vec<String> = Vec::new();
    let mut seen: Vec<String> = Vec::new();
    for c in candidates(kind) {
        let Some((lib, path)) = open_candidate(&c, symbol, &mut tried, &mut seen) else {
            continue;
        };
        match probe(&lib, &path) {
            Verdict::Accept => {
                let reason = first_usable_reason(kind, &c);
                return Ok(Loaded {
                    lib,
                    path,
                    origin: c.origin,
                    notes: Vec::new(),
                    reason,
                });
            }
            Verdict::Reject(why) => tried.push(format!("{path} ({}): rejected: {why}", c.origin)),
        }
    }
    Err(not_found(kind, tried))
}

/// Why the first usable candidate `c` was taken.
fn first_usable_reason(kind: LibKind, c: &Candidate) -> String {
    if c.origin.starts_with(kind.env_var()) {
        format!("set by {}", kind.env_var())
    } else {
        "the first usable candidate in the search order".to_string()
    }
}

/// What a probe of [`load_newest`] says about one loaded candidate.
pub(crate) enum Ranked {
    /// Usable: higher `rank` wins, ties go to the earlier candidate; `label` names it in the
    /// report (e.g. its version); `notes` are remarks kept if it is chosen.
    Usable {
        rank: u64,
        label: String,
        notes: Vec<String>,
    },
    /// Not usable (reason).
    Reject(String),
}

/// Load every candidate for `kind`, keep the one its probe ranks highest (the earliest on ties),
/// unload the others. The chosen library's `reason` names the ones passed over.
pub(crate) fn load_newest(
    kind: LibKind,
    symbol: &str,
    mut probe: impl FnMut(&Library, &str) -> Ranked,
) -> Result<Loaded, CudaError> {
    let mut tried: Vec<String> = Vec::new();
    let mut seen: Vec<String> = Vec::new();
    // (rank, label, loaded) of the best so far; the others' (label, path).
    let mut best: Option<(u64, String, Loaded)> = None;
    let mut others: Vec<String> = Vec::new();
    for c in candidates(kind) {
        let Some((lib, path)) = open_candidate(&c, symbol, &mut tried, &mut seen) else {
            continue;
        };
        match probe(&lib, &path) {
            Ranked::Usable { rank, label, notes } => {
                if best.as_ref().is_some_and(|(r, _, _)| *r >= rank) {
                    others.push(format!("{label} at {path}"));
                    continue;
                }
                if let Some((_, l, old)) = best.take() {
                    others.push(format!("{l} at {}", old.path));
                }
                let reason = first_usable_reason(kind, &c);
                best = Some((
                    rank,
                    label,
                    Loaded {
                        lib,
                        path,
                        origin: c.origin,
                        notes,
                        reason,
                    },
                ));
            }
            Ranked::Reject(why) => {
                tried.push(format!("{path} ({}): rejected: {why}", c.origin));
                others.push(format!("{path} (rejected: {why})"));
            }
        }
    }
    let Some((_, label, mut loaded)) = best else {
        return Err(not_found(kind, tried));
    };
    if !others.is_empty() {
        loaded.reason = format!(
            "the newest usable one ({label}); also found: {}",
            others.join("; ")
        );
    } else if !loaded.reason.starts_with("set by") {
        loaded.reason = format!("the only usable one found ({label})");
    }
    Ok(loaded)
}

/// `dlopen` one candidate and resolve the file it maps; `None` (with the reason in `tried`) when
/// it does not load, or when it is a file already seen under another name.
fn open_candidate(
    c: &Candidate,
    symbol: &str,
    tried: &mut Vec<String>,
    seen: &mut Vec<String>,
) -> Option<(Library, String)> {
    // SAFETY: loading a shared library runs its initialisers; the CUDA, NVRTC and NCCL
    // libraries have no initialiser with preconditions on the caller.
    let lib = match unsafe { Library::new(&c.spec) } {
        Ok(l) => l,
        Err(e) => {
            tried.push(format!(
                "{} ({}): {}",
                c.spec,
                c.origin,
                short_dl_error(&e, &c.spec)
            ));
            return None;
        }
    };
    let path = resolved_path(&lib, symbol, &c.spec);
    if seen.contains(&path) {
        return None;
    }
    seen.push(path.clone());
    Some((lib, path))
}

/// The error when no candidate of `kind` is usable: every place tried, and how to point lockstep
/// at the library.
fn not_found(kind: LibKind, mut searched: Vec<String>) -> CudaError {
    if env_nonempty(kind.env_var()).is_none() {
        searched.push(format!(
            "folders with no {}*: {}",
            kind.file_prefix(),
            search_dirs(kind)
                .iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    CudaError::LibraryNotFound {
        library: kind.name(),
        searched: searched.join("\n  "),
        env_var: kind.env_var(),
        hint: kind.install_hint(),
    }
}

/// The loader's own message for a `libloading` error (libloading keeps it in `source()`).
pub(crate) fn dl_error(e: &libloading::Error) -> String {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(x) = src {
        msg = x.to_string();
        src = x.source();
    }
    msg
}

/// `dlopen` errors start with the path that was tried; drop it, keep the reason.
pub(crate) fn short_dl_error(e: &libloading::Error, spec: &str) -> String {
    let m = dl_error(e);
    m.strip_prefix(spec)
        .map(|r| r.trim_start_matches(':').trim().to_string())
        .unwrap_or(m)
}

/// Format a CUDA-style version number (`12040` → `12.4`).
pub fn cuda_version_string(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// Format an NCCL version code (`21803` → `2.18.3`; codes from NCCL ≥ 2.9 use `X*10000+Y*100+Z`).
pub fn nccl_version_string(v: i32) -> String {
    if v >= 10000 {
        format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100)
    } else {
        format!("{}.{}.{}", v / 1000, (v % 1000) / 100, v % 100)
    }
}

pub(crate) fn indent(s: &str) -> String {
    s.replace('\n', "\n           ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_format() {
        assert_eq!(cuda_version_string(12040), "12.4");
        assert_eq!(cuda_version_string(13000), "13.0");
        assert_eq!(nccl_version_string(21803), "2.18.3");
        assert_eq!(nccl_version_string(22703), "2.27.3");
    }

    #[test]
    fn nccl_sonames_include_so_2() {
        assert!(LibKind::Nccl.sonames().contains(&"libnccl.so.2"));
        assert!(LibKind::Driver.sonames().contains(&"libcuda.so.1"));
    }

    /// The interpreter's answer is read line by line; a failing or missing interpreter gives
    /// nothing (no error: a machine without Python is normal).
    #[test]
    fn site_dirs_come_from_the_interpreter() {
        let dir = std::env::temp_dir().join(format!("lockstep-fake-python-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let script = |name: &str, body: &str| {
            use std::os::unix::fs::PermissionsExt as _;
            let p = dir.join(name);
            std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
            p
        };
        // The fake checks it was given the site script, as python3 would run it.
        let ok = script("python-ok", "case \"$2\" in *getsitepackages*) ;; *) exit 3;; esac\nprintf '/venv/lib/python3.12/site-packages\\n\\n  /home/u/.local/lib/python3.12/site-packages  \\n'");
        assert_eq!(
            site_dirs_of(&ok),
            [
                PathBuf::from("/venv/lib/python3.12/site-packages"),
                PathBuf::from("/home/u/.local/lib/python3.12/site-packages")
            ]
        );
        assert!(site_dirs_of(&script("python-fails", "echo /x; exit 1")).is_empty());
        assert!(site_dirs_of(&dir.join("no-such-python")).is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The real interpreter (when there is one) names folders that exist or at least look like
    /// site-packages, and runs in well under the timeout.
    #[test]
    fn python3_on_path_is_asked() {
        let t = std::time::Instant::now();
        let dirs = site_dirs_of(Path::new("python3"));
        assert!(t.elapsed() < PYTHON_TIMEOUT);
        for d in &dirs {
            let s = d.to_string_lossy();
            assert!(s.contains("packages"), "{s}");
        }
    }

    #[test]
    fn search_dirs_cover_toolkit_and_wheels() {
        let d: Vec<String> = search_dirs(LibKind::Nvrtc)
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        assert!(d.iter().any(|p| p == "/opt/cuda/lib64"), "{d:?}");
        assert!(
            d.iter().any(|p| p.ends_with("targets/x86_64-linux/lib")
                || p.ends_with("targets/sbsa-linux/lib")),
            "{d:?}"
        );
        if !python_site_dirs().is_empty() {
            assert!(
                d.iter().any(|p| p.ends_with("nvidia/cuda_nvrtc/lib")),
                "{d:?}"
            );
            assert!(d.iter().any(|p| p.ends_with("nvidia/cu13/lib")), "{d:?}");
        }
        let drv: Vec<String> = search_dirs(LibKind::Driver)
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        assert!(
            drv.iter().any(|p| p == "/usr/lib/x86_64-linux-gnu")
                && !drv.iter().any(|p| p.contains("stubs")),
            "{drv:?}"
        );
    }
}
