//! The post-fork side of the launcher and the process plumbing around it: fork, the result and
//! output pipes, parent-death signal, exec of CLI ranks, pidfds, reaping and killing. All `unsafe`
//! of the launcher lives here (and in `signals.rs` for the CLI's signal handlers).

use std::ffi::OsString;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

use super::wire::encode_outcome;
use std::mem::ManuallyDrop;

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::rank::{RankContext, RankResult};
use crate::shm::ShmJob;

/// A forked or exec'd rank as the parent sees it.
pub(crate) struct Spawned {
    pub pid: i32,
    /// The rank's result pipe (library ranks only).
    pub result_fd: Option<OwnedFd>,
    /// Read ends of the rank's stdout and stderr pipes (when output is captured).
    pub stdout: Option<OwnedFd>,
    pub stderr: Option<OwnedFd>,
}

/// A pipe as (read end, write end), both close-on-exec.
pub(crate) fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: fds is a valid out-array of two ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both fds were just created and are owned here.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Make `fd` non-blocking (the parent reads output pipes only when poll says so, and drains them
/// without blocking once a rank has exited, in case a grandchild still holds the write end).
pub(crate) fn set_nonblocking(fd: &OwnedFd) {
    // SAFETY: fcntl on a valid fd with integer arguments.
    unsafe {
        let fl = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
        if fl >= 0 {
            libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
    }
}

/// A pidfd for `pid` (readable once it exits), where the kernel has `pidfd_open`.
pub(crate) fn pidfd_open(pid: i32) -> Option<OwnedFd> {
    // SAFETY: raw syscall with integer arguments.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    // SAFETY: a non-negative result is a fresh fd we own.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) })
}

/// The parent-death signal, and the check that closes its race: if the parent died between fork
/// and prctl, `getppid` no longer returns it. Async-signal-safe (runs between fork and exec).
fn die_with_parent(parent: i32) -> std::io::Result<()> {
    // SAFETY: prctl with constant arguments; getppid has no preconditions.
    unsafe {
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if libc::getppid() != parent {
            libc::_exit(128 + libc::SIGKILL);
        }
    }
    Ok(())
}

/// Start one CLI rank: `program args` with `env` added, stdin from /dev/null, stdout/stderr
/// through pipes, in process group `pgid` (0: a new group led by this rank), killed if the
/// launcher dies.
pub(crate) fn spawn_exec(program: &[OsString], env: &[(String, String)], pgid: i32, capture: bool) -> std::io::Result<Spawned> {
    let (first, rest) = program.split_first().ok_or_else(|| std::io::Error::other("no program given"))?;
    let mut cmd = Command::new(first);
    cmd.args(rest).envs(env.iter().map(|(k, v)| (k, v))).stdin(Stdio::null()).process_group(pgid);
    if capture {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    }
    // SAFETY: getpid has no preconditions.
    let parent = unsafe { libc::getpid() };
    // SAFETY: the closure runs between fork and exec and calls only async-signal-safe functions
    // (prctl, getppid, _exit).
    unsafe { cmd.pre_exec(move || die_with_parent(parent)) };
    let child = cmd.spawn()?;
    let pid = child.id() as i32;
    let stdout = child.stdout.map(OwnedFd::from);
    let stderr = child.stderr.map(OwnedFd::from);
    // `Child` has no Drop side effects; the supervisor reaps `pid` with waitpid.
    Ok(Spawned { pid, result_fd: None, stdout, stderr })
}

/// How a child process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Exit {
    Code(i32),
    Signal(i32),
    /// The status was collected by someone else (the host process ignores SIGCHLD, so the kernel
    /// reaps children itself); the result pipe still tells success for library ranks.
    Unknown,
}

impl Exit {
    /// Shell-style exit code: the code, or 128 + signal.
    pub fn code(self) -> i32 {
        match self {
            Exit::Code(c) => c,
            Exit::Signal(s) => 128 + s,
            Exit::Unknown => 1,
        }
    }

    pub fn describe(self) -> String {
        match self {
            Exit::Code(c) => format!("exited with code {c}"),
            Exit::Signal(s) => format!("killed by signal {s} ({})", signal_name(s)),
            Exit::Unknown => "ended, but its exit status was collected elsewhere (is SIGCHLD ignored in the launching process?)".into(),
        }
    }

    fn from_status(st: libc::c_int) -> Exit {
        if libc::WIFSIGNALED(st) {
            Exit::Signal(libc::WTERMSIG(st))
        } else {
            Exit::Code(libc::WEXITSTATUS(st))
        }
    }
}

/// Conventional name of a signal.
pub(crate) fn signal_name(s: i32) -> &'static str {
    match s {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGTERM => "SIGTERM",
        _ => "signal",
    }
}

/// Refuse to fork when CUDA is initialised in this process (the children could not use it).
pub(crate) fn check_fork_safe() -> Result<(), String> {
    crate::cuda::init::check_fork_safe()
}

/// Fork one rank that joins `job` as `rank` and runs `f`; with `capture`, its stdout and stderr
/// go through pipes to the parent. The child takes `f` out of its copy of `*f` and calls it once;
/// the parent's `f` is untouched (the caller drops it after its last fork).
pub(crate) fn spawn<R, F>(rank: usize, world: usize, job: &ShmJob, f: &mut ManuallyDrop<F>, capture: bool) -> std::io::Result<Spawned>
where
    R: Serialize + DeserializeOwned,
    F: FnOnce(RankContext) -> RankResult<R>,
{
    let (rd, wr) = pipe()?;
    let out = if capture { Some((pipe()?, pipe()?)) } else { None };
    // SAFETY: getpid has no preconditions.
    let parent = unsafe { libc::getpid() };
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: fork in a process whose other threads (if any) hold no lock the child needs: the
    // child only runs the rank function and exits with _exit (see module docs on fork safety).
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if pid == 0 {
        drop(rd);
        if let Some(((out_r, out_w), (err_r, err_w))) = out {
            drop(out_r);
            drop(err_r);
            // SAFETY: dup2 onto the standard descriptors; the pipe ends are valid fds we own (the
            // originals close on drop; the dup2'd copies do not carry O_CLOEXEC).
            unsafe {
                libc::dup2(out_w.as_raw_fd(), 1);
                libc::dup2(err_w.as_raw_fd(), 2);
            }
        }
        // SAFETY: this is the child's own copy of the parent's memory: nothing else in this process
        // reads `*f` after this point (the child ends in `_exit` inside `run_child`), so taking the
        // value out of the ManuallyDrop moves the closure to its single call.
        let f = unsafe { ManuallyDrop::take(f) };
        run_child(rank, world, job, f, parent, wr);
    }
    drop(wr);
    let (stdout, stderr) = match out {
        Some(((out_r, _), (err_r, _))) => (Some(out_r), Some(err_r)),
        None => (None, None),
    };
    Ok(Spawned { pid, result_fd: Some(rd), stdout, stderr })
}

fn run_child<R, F>(rank: usize, world: usize, job: &ShmJob, f: F, parent: i32, wr: OwnedFd) -> !
where
    R: Serialize + DeserializeOwned,
    F: FnOnce(RankContext) -> RankResult<R>,
{
    let _ = die_with_parent(parent);
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<R, String> {
        let comm = job.communicator(rank).map_err(|e| e.to_string())?;
        f(RankContext { rank, local_rank: rank, world_size: world, comm }).map_err(|e| e.to_string())
    }));
    let (outcome, code) = match outcome {
        Ok(Ok(v)) => (Ok(v), 0),
        Ok(Err(m)) => (Err(m), 1),
        Err(p) => {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "panicked".into());
            (Err(format!("panicked: {msg}")), 101)
        }
    };
    let bytes = encode_outcome(&outcome);
    let mut file = std::fs::File::from(wr);
    let _ = file.write_all(&bytes);
    drop(file);
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: _exit skips the parent's atexit handlers and destructors, which must not run twice.
    unsafe { libc::_exit(code) }
}

/// What one read of a non-blocking pipe found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReadState {
    /// Bytes were appended.
    Data,
    /// Nothing available right now.
    Again,
    /// End of file (or an error: treated the same).
    Eof,
}

/// One read of what is available, appended to `buf`.
pub(crate) fn read_avail(fd: &impl AsRawFd, buf: &mut Vec<u8>) -> ReadState {
    let mut tmp = [0u8; 65536];
    loop {
        // SAFETY: tmp is a valid writable buffer of the given length.
        let n = unsafe { libc::read(fd.as_raw_fd(), tmp.as_mut_ptr() as *mut libc::c_void, tmp.len()) };
        if n > 0 {
            buf.extend_from_slice(&tmp[..n as usize]);
            return ReadState::Data;
        }
        if n == 0 {
            return ReadState::Eof;
        }
        match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EAGAIN) => return ReadState::Again,
            _ => return ReadState::Eof,
        }
    }
}

/// Reap `pid` if it has exited.
pub(crate) fn try_reap(pid: i32) -> Option<Exit> {
    let mut st = 0;
    // SAFETY: st is a valid out-parameter; pid is our child.
    let r = unsafe { libc::waitpid(pid, &mut st, libc::WNOHANG) };
    if r == pid {
        return Some(Exit::from_status(st));
    }
    // ECHILD: not (or no longer) our child to wait for; it is gone.
    (r < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD)).then_some(Exit::Unknown)
}

/// Wait for `pid` to exit.
pub(crate) fn reap_blocking(pid: i32) -> Option<Exit> {
    let mut st = 0;
    loop {
        // SAFETY: as in try_reap.
        let r = unsafe { libc::waitpid(pid, &mut st, 0) };
        if r == pid {
            return Some(Exit::from_status(st));
        }
        if r < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        return None;
    }
}

/// Send `sig` to `pid` (errors ignored: the process may be gone). A negative `pid` names a
/// process group.
pub(crate) fn kill(pid: i32, sig: i32) {
    // SAFETY: plain syscall.
    unsafe { libc::kill(pid, sig) };
}

/// `poll(2)` on `fds` for at most `timeout_ms` (EINTR, e.g. from a forwarded signal, just returns
/// early: callers loop).
pub(crate) fn poll(fds: &mut [libc::pollfd], timeout_ms: i32) {
    // SAFETY: fds is a valid, exclusively borrowed array of pollfd of the given length.
    unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
}

/// Monotonic clock in nanoseconds (`CLOCK_MONOTONIC`, comparable across processes of one host).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: ts is a valid out-parameter.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
