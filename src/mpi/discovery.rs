//! Finding and loading the MPI library: only an MPI-5 standard ABI library (`libmpi_abi.so.1`)
//! is used, so one lockstep binary works with every MPI that implements the ABI and none is
//! needed at build time.
//!
//! Search order:
//!
//! 1. `LOCKSTEP_MPI_LIBRARY`: a file, or a folder whose `libmpi_abi.so*` (then `libmpi.so*`,
//!    to name what is there) are tried; when set, nothing else is tried;
//! 2. `libmpi_abi.so.1` through the dynamic loader (`LD_LIBRARY_PATH`, ldconfig cache);
//! 3. the `lib` folders of Python environments, where `pip install mpich` puts the library
//!    (`<prefix>/lib` above `<prefix>/lib/python3.X/site-packages`): the site-packages of the
//!    `python3` on `PATH`, `VIRTUAL_ENV`, `CONDA_PREFIX`, `/usr/local/lib`, `~/.local/lib` (the
//!    same environments as the CUDA libraries' search, `cuda::discovery`).
//!
//! A candidate is usable when `MPI_Abi_get_version` answers ABI major version 1. A library
//! without the standard ABI (Open MPI ≤ 5's `libmpi.so.40`, MPICH's `libmpi.so.12`, whose
//! `MPI_Abi_get_version` answers -1) is refused by name: when no ABI library is found, the
//! loader's `libmpi.so.40` and `libmpi.so.12` are looked at only to say which MPI is installed
//! and why it does not do.
//!
//! Loading runs no MPI initialisation: `MPI_Abi_get_version`, `MPI_Get_version` and
//! `MPI_Get_library_version` may be called before `MPI_Init`.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libloading::Library;

use crate::cuda::discovery::{
    dir_entries_with_prefix, python_site_dirs, resolved_path, short_dl_error,
};

use super::error::MpiError;
use super::sys::{
    MPI_Comm, MPI_Count, MPI_Datatype, MPI_Errhandler, MPI_Info, MPI_Op, MPI_Request, MPI_Status,
    MPI_ABI_VERSION, MPI_MAX_LIBRARY_VERSION_STRING,
};

/// The override variable.
pub(crate) const ENV_VAR: &str = "LOCKSTEP_MPI_LIBRARY";
/// The ABI library's soname (MPI-5 standard, ABI version 1).
const ABI_SONAME: &str = "libmpi_abi.so.1";
/// File-name prefix of the ABI library in a folder.
const ABI_PREFIX: &str = "libmpi_abi.so";
/// Sonames of MPIs without the standard ABI: looked at only to name them in the error.
const NON_ABI_SONAMES: &[&str] = &["libmpi.so.40", "libmpi.so.12"];
/// File-name prefix of non-ABI libraries in a folder.
const NON_ABI_PREFIX: &str = "libmpi.so";

fn_table! {
    /// What identifies a candidate; every entry is optional, so any `libmpi` can be asked.
    pub(crate) struct ProbeFns {
        required {}
        optional {
            MPI_Abi_get_version = "MPI_Abi_get_version": fn(*mut c_int, *mut c_int) -> c_int;
            MPI_Get_library_version = "MPI_Get_library_version": fn(*mut c_char, *mut c_int) -> c_int;
        }
    }
}

fn_table! {
    /// Every function lockstep calls, with its prototype from `mpi_abi.h`.
    pub(crate) struct MpiFns {
        required {
            MPI_Abi_get_version = "MPI_Abi_get_version": fn(*mut c_int, *mut c_int) -> c_int;
            MPI_Get_version = "MPI_Get_version": fn(*mut c_int, *mut c_int) -> c_int;
            MPI_Get_library_version = "MPI_Get_library_version": fn(*mut c_char, *mut c_int) -> c_int;
            MPI_Initialized = "MPI_Initialized": fn(*mut c_int) -> c_int;
            MPI_Finalized = "MPI_Finalized": fn(*mut c_int) -> c_int;
            MPI_Init_thread = "MPI_Init_thread": fn(*mut c_int, *mut *mut *mut c_char, c_int, *mut c_int) -> c_int;
            MPI_Query_thread = "MPI_Query_thread": fn(*mut c_int) -> c_int;
            MPI_Finalize = "MPI_Finalize": fn() -> c_int;
            MPI_Error_string = "MPI_Error_string": fn(c_int, *mut c_char, *mut c_int) -> c_int;
            MPI_Error_class = "MPI_Error_class": fn(c_int, *mut c_int) -> c_int;
            MPI_Comm_rank = "MPI_Comm_rank": fn(MPI_Comm, *mut c_int) -> c_int;
            MPI_Comm_size = "MPI_Comm_size": fn(MPI_Comm, *mut c_int) -> c_int;
            MPI_Comm_dup = "MPI_Comm_dup": fn(MPI_Comm, *mut MPI_Comm) -> c_int;
            MPI_Comm_split = "MPI_Comm_split": fn(MPI_Comm, c_int, c_int, *mut MPI_Comm) -> c_int;
            MPI_Comm_split_type = "MPI_Comm_split_type": fn(MPI_Comm, c_int, c_int, MPI_Info, *mut MPI_Comm) -> c_int;
            MPI_Comm_free = "MPI_Comm_free": fn(*mut MPI_Comm) -> c_int;
            MPI_Comm_set_errhandler = "MPI_Comm_set_errhandler": fn(MPI_Comm, MPI_Errhandler) -> c_int;
            MPI_Isend_c = "MPI_Isend_c": fn(*const c_void, MPI_Count, MPI_Datatype, c_int, c_int, MPI_Comm, *mut MPI_Request) -> c_int;
            MPI_Irecv_c = "MPI_Irecv_c": fn(*mut c_void, MPI_Count, MPI_Datatype, c_int, c_int, MPI_Comm, *mut MPI_Request) -> c_int;
            MPI_Ibarrier = "MPI_Ibarrier": fn(MPI_Comm, *mut MPI_Request) -> c_int;
            MPI_Iallreduce_c = "MPI_Iallreduce_c": fn(*const c_void, *mut c_void, MPI_Count, MPI_Datatype, MPI_Op, MPI_Comm, *mut MPI_Request) -> c_int;
            MPI_Iallgather_c = "MPI_Iallgather_c": fn(*const c_void, MPI_Count, MPI_Datatype, *mut c_void, MPI_Count, MPI_Datatype, MPI_Comm, *mut MPI_Request) -> c_int;
            MPI_Test = "MPI_Test": fn(*mut MPI_Request, *mut c_int, *mut MPI_Status) -> c_int;
            MPI_Cancel = "MPI_Cancel": fn(*mut MPI_Request) -> c_int;
            MPI_Request_free = "MPI_Request_free": fn(*mut MPI_Request) -> c_int;
            MPI_Get_count_c = "MPI_Get_count_c": fn(*const MPI_Status, MPI_Datatype, *mut MPI_Count) -> c_int;
        }
        optional {}
    }
}

/// The MPI library lockstep found: where, why, and what it says about itself.
#[derive(Clone, Debug)]
pub struct LibraryInfo {
    /// The file loaded (symbolic links resolved).
    pub path: String,
    /// Where it was found (`LOCKSTEP_MPI_LIBRARY`, the dynamic loader, a Python environment).
    pub origin: String,
    /// Why this candidate was chosen.
    pub reason: String,
    /// `MPI_Abi_get_version`: the standard ABI's (major, minor) version.
    pub abi_version: (i32, i32),
    /// `MPI_Get_version`: the MPI standard's (major, minor) version.
    pub mpi_version: (i32, i32),
    /// The first line of `MPI_Get_library_version` (e.g. `MPICH Version: 5.0.2`).
    pub library_version: String,
    /// The `mpiexec` installed with the library (`<prefix>/bin/mpiexec` for `<prefix>/lib`), if
    /// there is one.
    pub mpiexec: Option<PathBuf>,
}

/// The loaded library: its information and its function table.
pub(crate) struct Loaded {
    // Kept loaded for the life of the process: the function pointers point into it.
    #[allow(dead_code)]
    lib: Library,
    pub info: LibraryInfo,
    pub f: MpiFns,
}

static LOADED: OnceLock<Result<Loaded, MpiError>> = OnceLock::new();

/// Load the MPI library (once per process).
pub(crate) fn loaded() -> Result<&'static Loaded, MpiError> {
    LOADED.get_or_init(load).as_ref().map_err(Clone::clone)
}

/// One place the library may be.
struct Candidate {
    /// Path or soname passed to `dlopen`.
    spec: String,
    /// Where it came from.
    origin: String,
}

/// What a loaded candidate turned out to be.
enum Probe {
    /// An ABI library of a version lockstep speaks.
    Abi { version: (i32, i32) },
    /// An ABI library of another major version.
    OtherAbi { version: (i32, i32) },
    /// An MPI without the standard ABI.
    NotAbi {
        vendor: &'static str,
        version: String,
    },
}

/// The `lib` folders of the Python environments: `<prefix>/lib` for each
/// `<prefix>/lib/python3.X/{site,dist}-packages`, where pip puts a wheel's `../../` files.
pub(crate) fn python_lib_dirs() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    for site in python_site_dirs() {
        let Some(py) = site.parent() else { continue };
        if !py
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("python3"))
        {
            continue;
        }
        if let Some(lib) = py.parent() {
            let lib = lib.to_path_buf();
            if lib.is_dir() && !out.contains(&lib) {
                out.push(lib);
            }
        }
    }
    out
}

/// The candidates in search order: ABI ones first, then (`false` in the pair) the non-ABI ones
/// that are only looked at to name them. With `LOCKSTEP_MPI_LIBRARY` set, only it.
fn candidates() -> Result<Vec<(Candidate, bool)>, MpiError> {
    if let Some(p) = crate::types::env::raw(ENV_VAR)? {
        let p = p.trim().to_string();
        let path = PathBuf::from(&p);
        if path.is_dir() {
            let mut v = Vec::new();
            for (prefix, abi) in [(ABI_PREFIX, true), (NON_ABI_PREFIX, false)] {
                for f in dir_entries_with_prefix(&path, prefix) {
                    v.push((
                        Candidate {
                            spec: f.display().to_string(),
                            origin: format!("{ENV_VAR} folder"),
                        },
                        abi,
                    ));
                }
            }
            if v.is_empty() {
                v.push((
                    Candidate {
                        spec: path.join(ABI_SONAME).display().to_string(),
                        origin: format!("{ENV_VAR} folder"),
                    },
                    true,
                ));
            }
            return Ok(v);
        }
        // A file given by hand is probed whatever its name: the probe says what it is.
        return Ok(vec![(
            Candidate {
                spec: p,
                origin: ENV_VAR.to_string(),
            },
            true,
        )]);
    }
    // The ABI library first (by soname, then in Python environments), then the others, only to
    // be named in the error.
    let dirs = python_lib_dirs();
    let mut v = Vec::new();
    for (sonames, prefix, abi) in [
        (&[ABI_SONAME][..], ABI_PREFIX, true),
        (NON_ABI_SONAMES, NON_ABI_PREFIX, false),
    ] {
        for s in sonames {
            let origin = "dynamic loader search path".to_string();
            v.push((
                Candidate {
                    spec: s.to_string(),
                    origin,
                },
                abi,
            ));
        }
        for d in &dirs {
            for f in dir_entries_with_prefix(d, prefix) {
                let origin = format!("Python environment {}", d.display());
                v.push((
                    Candidate {
                        spec: f.display().to_string(),
                        origin,
                    },
                    abi,
                ));
            }
        }
    }
    Ok(v)
}

/// Who made a non-ABI library, from its version string or else its file name.
fn vendor_of(version: &str, file: &str) -> &'static str {
    if version.contains("Open MPI") {
        "Open MPI"
    } else if version.contains("Intel") {
        "Intel MPI"
    } else if version.contains("MVAPICH") {
        "MVAPICH"
    } else if version.contains("MPICH") {
        "MPICH"
    } else if file.starts_with("libmpi.so.40") {
        "Open MPI"
    } else if file.starts_with("libmpi.so.12") {
        "MPICH"
    } else {
        "an unidentified MPI"
    }
}

/// The first non-empty line of `MPI_Get_library_version`, or `""` when the library lacks it.
fn library_version(f: Option<unsafe extern "C" fn(*mut c_char, *mut c_int) -> c_int>) -> String {
    let Some(get) = f else {
        return String::new();
    };
    let mut buf = vec![0 as c_char; MPI_MAX_LIBRARY_VERSION_STRING + 1];
    let mut len: c_int = 0;
    // SAFETY: the buffer holds MPI_MAX_LIBRARY_VERSION_STRING characters, the largest any MPI
    // writes (MPICH's value; Open MPI's is smaller); the call may precede MPI_Init. The extra
    // element stays 0, so the text is terminated whatever the library wrote.
    let rc = unsafe { get(buf.as_mut_ptr(), &mut len) };
    if rc != 0 {
        return String::new();
    }
    // SAFETY: `buf` is NUL-terminated (its last element is never written).
    let s = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy();
    // The first line, its runs of blanks made one (MPICH aligns its fields with spaces).
    s.lines()
        .find(|l| !l.trim().is_empty())
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// What `lib` (at `path`) is.
fn probe(lib: &Library, path: &str) -> Probe {
    let file = Path::new(path)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    // Every entry is optional: resolving cannot fail, but the type says it could.
    let Ok(p) = ProbeFns::resolve(lib) else {
        return Probe::NotAbi {
            vendor: vendor_of("", &file),
            version: String::new(),
        };
    };
    let version = library_version(p.MPI_Get_library_version);
    let not_abi = |version: String| Probe::NotAbi {
        vendor: vendor_of(&version, &file),
        version,
    };
    let Some(get_abi) = p.MPI_Abi_get_version else {
        return not_abi(version);
    };
    let (mut major, mut minor) = (-1, -1);
    // SAFETY: valid out-pointers; MPI_Abi_get_version may be called before MPI_Init.
    let rc = unsafe { get_abi(&mut major, &mut minor) };
    // A library built without the ABI (MPICH's libmpi.so.12) exports the function and answers -1.
    if rc != 0 || major < 1 {
        not_abi(version)
    } else if major != MPI_ABI_VERSION {
        Probe::OtherAbi {
            version: (major, minor),
        }
    } else {
        Probe::Abi {
            version: (major, minor),
        }
    }
}

/// The `mpiexec` of the installation that holds `lib_path` (`<prefix>/lib/x.so` → `<prefix>/bin`).
fn mpiexec_near(lib_path: &str) -> Option<PathBuf> {
    let exe = Path::new(lib_path).parent()?.parent()?.join("bin/mpiexec");
    exe.is_file().then_some(exe)
}

fn load() -> Result<Loaded, MpiError> {
    let mut tried: Vec<String> = Vec::new();
    let mut seen: Vec<String> = Vec::new();
    // The first non-ABI library met: (vendor, file, path, version).
    let mut non_abi: Option<(&'static str, String, String, String)> = None;
    let mut other_abi: Option<MpiError> = None;
    let cands = candidates()?;
    let overridden = cands
        .first()
        .is_some_and(|(c, _)| c.origin.starts_with(ENV_VAR));
    for (c, abi_expected) in cands {
        // Non-ABI names are only worth a look when no ABI library was found.
        if !abi_expected && (non_abi.is_some() || other_abi.is_some()) {
            continue;
        }
        // SAFETY: loading a shared library runs its initialisers; MPI libraries' initialisers
        // have no preconditions on the caller (MPI itself starts only in MPI_Init).
        let lib = match unsafe { Library::new(&c.spec) } {
            Ok(l) => l,
            Err(e) => {
                if abi_expected || overridden {
                    tried.push(format!(
                        "{} ({}): {}",
                        c.spec,
                        c.origin,
                        short_dl_error(&e, &c.spec)
                    ));
                }
                continue;
            }
        };
        let path = resolved_path(&lib, "MPI_Get_library_version", &c.spec);
        if seen.contains(&path) {
            continue;
        }
        seen.push(path.clone());
        match probe(&lib, &path) {
            Probe::Abi { version } => {
                let f =
                    MpiFns::resolve(&lib).map_err(|(symbol, detail)| MpiError::MissingSymbol {
                        path: path.clone(),
                        symbol,
                        detail,
                    })?;
                let (mut vmaj, mut vmin) = (0, 0);
                // SAFETY: valid out-pointers; MPI_Get_version may be called before MPI_Init.
                unsafe { (f.MPI_Get_version)(&mut vmaj, &mut vmin) };
                let reason = if overridden {
                    format!("set by {ENV_VAR}")
                } else if tried.is_empty() {
                    "the first candidate in the search order".to_string()
                } else {
                    format!(
                        "the first usable candidate in the search order; passed over: {}",
                        tried.join("; ")
                    )
                };
                let info = LibraryInfo {
                    mpiexec: mpiexec_near(&path),
                    path,
                    origin: c.origin,
                    reason,
                    abi_version: version,
                    mpi_version: (vmaj, vmin),
                    library_version: library_version(Some(f.MPI_Get_library_version)),
                };
                tracing::debug!(
                    "MPI: {} ({}) from {}",
                    info.path,
                    info.library_version,
                    info.origin
                );
                return Ok(Loaded { lib, info, f });
            }
            Probe::OtherAbi { version } => {
                tried.push(format!(
                    "{path} ({}): MPI ABI {}.{}, not 1.x",
                    c.origin, version.0, version.1
                ));
                other_abi.get_or_insert(MpiError::AbiVersion {
                    path,
                    major: version.0,
                    minor: version.1,
                });
            }
            Probe::NotAbi { vendor, version } => {
                let file = Path::new(&c.spec)
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_else(|| c.spec.clone());
                tried.push(format!("{path} ({}): {vendor}, not the ABI", c.origin));
                non_abi.get_or_insert((vendor, file, path, version));
            }
        }
    }
    if !overridden {
        let dirs = python_lib_dirs();
        tried.push(format!(
            "Python environments with no {ABI_PREFIX}*: {}",
            if dirs.is_empty() {
                "none found".to_string()
            } else {
                dirs.iter()
                    .map(|d| d.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        ));
    }
    if let Some(e) = other_abi {
        return Err(e);
    }
    if let Some((vendor, file, path, version)) = non_abi {
        let others: Vec<&String> = tried.iter().filter(|t| !t.starts_with(&path)).collect();
        let also = if others.is_empty() {
            String::new()
        } else {
            format!(
                ". Also tried:\n  {}",
                others
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join("\n  ")
            )
        };
        return Err(MpiError::NotAbi {
            vendor: vendor.to_string(),
            file,
            path,
            version,
            also,
        });
    }
    Err(MpiError::NotFound {
        searched: tried.join("\n  "),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vendors_are_named_from_the_version_or_the_file() {
        assert_eq!(
            vendor_of("Open MPI v4.1.4, package: Debian OpenMPI", "x"),
            "Open MPI"
        );
        assert_eq!(vendor_of("MPICH Version:      4.0", "x"), "MPICH");
        assert_eq!(vendor_of("", "libmpi.so.40.30.4"), "Open MPI");
        assert_eq!(vendor_of("", "libmpi.so.12"), "MPICH");
        assert_eq!(vendor_of("", "libfoo.so"), "an unidentified MPI");
    }

    #[test]
    fn mpiexec_is_looked_for_beside_the_lib_folder() {
        assert_eq!(mpiexec_near("/nonexistent/lib/libmpi_abi.so.1"), None);
        assert_eq!(mpiexec_near("libmpi_abi.so.1"), None);
    }
}
