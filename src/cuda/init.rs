//! The single door to `cuInit`, and the fork-safety check.
//!
//! CUDA state does not survive `fork`: a child of a process that called `cuInit` gets
//! `CUDA_ERROR_INITIALIZATION_ERROR` (or worse, hangs). The launcher therefore calls
//! [`check_fork_safe`] before forking ranks, and every CUDA entry point of lockstep goes through
//! [`ensure_init`], which records *where* CUDA was first initialised (a backtrace and the pid) so
//! the refusal can point at the culprit.
//!
//! Initialisation by code outside lockstep (a Python extension, another crate) is detected too:
//! when `libcuda` is mapped into the process, `cuDeviceGetCount` answers
//! `CUDA_ERROR_NOT_INITIALIZED` exactly while nobody has called `cuInit`, and asking does not
//! initialise anything.
//!
//! The guard is per process: the record carries the pid, so a forked child starts with a clean
//! state and initialises at most once itself.

use std::backtrace::Backtrace;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Mutex;

use super::driver::{self, ERROR_NOT_INITIALIZED, SUCCESS};
use super::error::CudaError;

/// Where and by whom CUDA was first initialised in this process.
#[derive(Clone, Debug)]
pub struct InitRecord {
    /// The process that called `cuInit`.
    pub pid: i32,
    /// The thread's name (or id).
    pub thread: String,
    /// Backtrace of the first `ensure_init` call.
    pub backtrace: String,
}

/// Pid of the process that initialised CUDA through the guard (0: none). Read lock-free by the
/// fork check, so it cannot deadlock on a lock held by another thread.
static INIT_PID: AtomicI32 = AtomicI32::new(0);
/// The full record (only read to render messages).
static RECORD: Mutex<Option<InitRecord>> = Mutex::new(None);

fn getpid() -> i32 {
    // SAFETY: getpid has no preconditions.
    unsafe { libc::getpid() }
}

/// Initialise CUDA in this process, once. The only caller of `cuInit` in lockstep.
pub fn ensure_init() -> Result<(), CudaError> {
    let pid = getpid();
    if INIT_PID.load(Ordering::Acquire) == pid {
        return Ok(());
    }
    let core = driver::core()?;
    let mut rec = RECORD.lock().unwrap_or_else(|p| p.into_inner());
    // Re-check under the lock: another thread may have won the race.
    if INIT_PID.load(Ordering::Acquire) == pid {
        return Ok(());
    }
    // SAFETY: cuInit takes a flags word that must be 0.
    let rc = unsafe { (core.cuInit)(0) };
    driver::check(rc, || "cuInit(0)".into())?;
    let thread = std::thread::current();
    *rec = Some(InitRecord {
        pid,
        thread: thread
            .name()
            .map(str::to_string)
            .unwrap_or_else(|| format!("{:?}", thread.id())),
        backtrace: trim_backtrace(&Backtrace::force_capture().to_string()),
    });
    INIT_PID.store(pid, Ordering::Release);
    Ok(())
}

/// Called before every NVRTC compilation. NVRTC (12.x) `dlopen`s `libcuda.so.1` and calls
/// `cuInit` while compiling whenever a driver is installed, so compiling kernels initialises CUDA
/// in the calling process. Going through the guard first records *where* (the compile call), so a
/// later fork is refused with a useful location instead of "outside lockstep". Without a driver
/// this does nothing (and NVRTC finds none either).
pub(crate) fn before_nvrtc_compile() {
    if driver::core().is_ok() {
        // A failure here (no device, ...) is NVRTC's to meet too; the compile reports its own errors.
        let _ = ensure_init();
    }
}

/// The record of lockstep's initialisation in *this* process, if any.
pub fn init_record() -> Option<InitRecord> {
    if INIT_PID.load(Ordering::Acquire) != getpid() {
        return None;
    }
    RECORD.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// Keep the interesting part of a backtrace: drop the capture machinery at the top and the
/// runtime start-up frames at the bottom, cap the length.
fn trim_backtrace(bt: &str) -> String {
    let lines: Vec<&str> = bt.lines().collect();
    // Frames are "  N: symbol" followed by "at file:line" lines; start at our own frame.
    let start = lines
        .iter()
        .position(|l| l.contains("lockstep::cuda::init::ensure_init"))
        .unwrap_or(0);
    let end = lines
        .iter()
        .position(|l| {
            l.contains("__rust_begin_short_backtrace")
                || l.contains("core::ops::function::FnOnce::call_once")
                || l.contains("std::rt::lang_start")
                || l.contains("__libc_start")
        })
        .unwrap_or(lines.len());
    let kept: Vec<&str> = lines[start..end.max(start)]
        .iter()
        .take(60)
        .copied()
        .collect();
    kept.join("\n")
}

/// Is `libcuda` mapped into this process? Returns its path (from `/proc/self/maps`).
fn mapped_driver_path() -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let override_name = std::env::var("LOCKSTEP_CUDA_LIBRARY")
        .ok()
        .and_then(|p| std::fs::canonicalize(p).ok())
        .map(|p| p.display().to_string());
    for line in maps.lines() {
        let Some(path) = line.split_whitespace().nth(5) else {
            continue;
        };
        let file = path.rsplit('/').next().unwrap_or(path);
        if file.starts_with("libcuda.so") || override_name.as_deref() == Some(path) {
            return Some(path.to_string());
        }
    }
    None
}

/// Ask an already-mapped driver whether anyone has called `cuInit`, without initialising it.
/// `Some(true)`: initialised; `Some(false)`: not; `None`: could not tell.
fn foreign_initialised(path: &str) -> Option<bool> {
    // RTLD_NOLOAD: only get a handle if the library is already loaded; never load it ourselves.
    // SAFETY: the library is already mapped, so no initialiser runs.
    let lib = unsafe {
        libloading::os::unix::Library::open(Some(path), libc::RTLD_NOLOAD | libc::RTLD_LAZY)
    }
    .ok()?;
    // SAFETY: the C prototype of cuDeviceGetCount is `CUresult (int*)`.
    let f = unsafe {
        lib.get::<unsafe extern "C" fn(*mut libc::c_int) -> libc::c_int>(b"cuDeviceGetCount\0")
    }
    .ok()?;
    let mut n: libc::c_int = 0;
    // SAFETY: valid out-pointer; before cuInit this only reports NOT_INITIALIZED.
    let rc = unsafe { f(&mut n) };
    match rc {
        ERROR_NOT_INITIALIZED => Some(false),
        SUCCESS => Some(true),
        _ => None,
    }
}

const FIX: &str = "To fix: move all CUDA work into the rank function (each rank initialises CUDA itself after the fork), \
and call lockstep::launch before anything touches CUDA (including libraries that initialise it on import)";

/// Refuse when CUDA is initialised in the calling process: by lockstep (the guard) or by anyone
/// else (the mapped driver answers `cuDeviceGetCount`). The launcher calls this before forking.
pub fn check_fork_safe() -> Result<(), String> {
    let pid = getpid();
    if INIT_PID.load(Ordering::Acquire) == pid {
        let rec = RECORD.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let (thread, bt) = rec.map(|r| (r.thread, r.backtrace)).unwrap_or_default();
        return Err(format!(
            "cannot fork ranks: CUDA was already initialised in this process (pid {pid}) by lockstep, first on thread {thread} at:\n{bt}\n{FIX}"
        ));
    }
    if let Some(path) = mapped_driver_path() {
        if foreign_initialised(&path) == Some(true) {
            return Err(format!(
                "cannot fork ranks: CUDA was initialised in this process (pid {pid}) outside lockstep: {path} is loaded and \
cuDeviceGetCount succeeds, so some code called cuInit (another library, or a CUDA runtime call). {FIX}"
            ));
        }
    }
    if crate::types::env::DEBUG
        .flag()
        .map_err(|e| e.to_string())?
        .unwrap_or(false)
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| match probe_child() {
            Ok(s) => tracing::info!("CUDA probe: {s}"),
            Err(e) => tracing::warn!("CUDA probe: a rank will not be able to use CUDA: {e}"),
        });
    }
    Ok(())
}

/// One line on this process's CUDA state, for `env_report`.
pub fn describe_state() -> String {
    match init_record() {
        Some(r) => format!("yes, by lockstep (pid {}, thread {})", r.pid, r.thread),
        None => match mapped_driver_path().and_then(|p| foreign_initialised(&p)) {
            Some(true) => "yes, outside lockstep".into(),
            _ => "no".into(),
        },
    }
}

/// Fork a child that initialises CUDA the way a rank would and reports (device count, driver
/// version) through a pipe. Leaves this process uninitialised. Used for `LOCKSTEP_DEBUG=1`.
pub fn probe_child() -> Result<String, String> {
    fork_probe(probe_in_this_process)
}

/// The number of CUDA devices a rank would see, counted by a forked child (this process stays
/// uninitialised, so it may still fork ranks). `Ok(0)` without a driver library; an error when
/// the driver is there but cannot be initialised. Backs `--nproc-per-node auto` and `backend = "auto"`.
pub fn probe_device_count_child() -> Result<usize, String> {
    if !super::driver_present() {
        return Ok(0);
    }
    let s = fork_probe(|| {
        ensure_init()?;
        Ok(driver::device_get_count()?.to_string())
    })?;
    s.trim().parse().map_err(|_| {
        format!("the CUDA probe process reported {s:?} instead of a device count (lockstep bug)")
    })
}

/// Run `probe` in a forked child and return what it reported through a pipe.
fn fork_probe(probe: fn() -> Result<String, CudaError>) -> Result<String, String> {
    check_fork_safe_no_probe()?;
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` is a valid array of two ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(format!("pipe2 failed: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: both descriptors were just created and are owned here.
    let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: the child only runs the CUDA probe, writes to the pipe and calls _exit.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(format!("fork failed: {}", std::io::Error::last_os_error()));
    }
    if pid == 0 {
        drop(rd);
        let msg = match probe() {
            Ok(s) => format!("ok {s}"),
            Err(e) => format!("err {e}"),
        };
        let mut f = std::fs::File::from(wr);
        let _ = f.write_all(msg.as_bytes());
        drop(f);
        // SAFETY: _exit skips atexit handlers and destructors that belong to the parent.
        unsafe { libc::_exit(0) };
    }
    drop(wr);
    let mut out = String::new();
    let _ = std::fs::File::from(rd).read_to_string(&mut out);
    let mut status: libc::c_int = 0;
    // SAFETY: `pid` is our child; `status` is a valid out-pointer.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    if let Some(s) = out.strip_prefix("ok ") {
        Ok(s.to_string())
    } else if let Some(e) = out.strip_prefix("err ") {
        Err(e.to_string())
    } else {
        Err(format!(
            "the probe process (pid {pid}) died without reporting (wait status {status})"
        ))
    }
}

fn check_fork_safe_no_probe() -> Result<(), String> {
    let pid = getpid();
    if INIT_PID.load(Ordering::Acquire) == pid
        || mapped_driver_path().and_then(|p| foreign_initialised(&p)) == Some(true)
    {
        return Err(format!("CUDA is already initialised in this process (pid {pid}); a forked probe could not use it. {FIX}"));
    }
    Ok(())
}

fn probe_in_this_process() -> Result<String, CudaError> {
    ensure_init()?;
    let core = driver::core()?;
    let n = driver::device_get_count()?;
    let v = core.driver_version()?;
    Ok(format!(
        "a rank can initialise CUDA: {n} device(s) visible, driver CUDA {} ({}), pid {}",
        super::discovery::cuda_version_string(v),
        core.path,
        getpid()
    ))
}
