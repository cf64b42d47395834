//! The post-fork side of the launcher and the process plumbing around it: fork, the result pipe,
//! parent-death signal, reaping and killing. All `unsafe` of the launcher lives here.

use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use super::wire::encode_outcome;
use super::{RankContext, RankResult, Wire};
use crate::shm::ShmJob;

/// A forked rank as the parent sees it.
pub(crate) struct Spawned {
    pub pid: i32,
    pub result_fd: OwnedFd,
}

/// How a child process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Exit {
    Code(i32),
    Signal(i32),
}

impl Exit {
    /// Shell-style exit code: the code, or 128 + signal.
    pub fn code(self) -> i32 {
        match self {
            Exit::Code(c) => c,
            Exit::Signal(s) => 128 + s,
        }
    }

    pub fn describe(self) -> String {
        match self {
            Exit::Code(c) => format!("exited with code {c}"),
            Exit::Signal(s) => format!("killed by signal {s} ({})", signal_name(s)),
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

/// Fork one rank that joins `job` as `rank` and runs `f`.
pub(crate) fn spawn<R, F>(rank: usize, world: usize, job: &ShmJob, f: &F) -> std::io::Result<Spawned>
where
    R: Wire,
    F: Fn(RankContext) -> RankResult<R>,
{
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: fds is a valid out-array of two ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both fds were just created and are owned here.
    let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
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
        run_child(rank, world, job, f, parent, wr);
    }
    drop(wr);
    Ok(Spawned { pid, result_fd: rd })
}

fn run_child<R, F>(rank: usize, world: usize, job: &ShmJob, f: &F, parent: i32, wr: OwnedFd) -> !
where
    R: Wire,
    F: Fn(RankContext) -> RankResult<R>,
{
    // SAFETY: prctl with constant arguments; getppid has no preconditions. Checking getppid after
    // setting the death signal closes the race where the parent died before prctl.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0);
        if libc::getppid() != parent {
            libc::_exit(128 + libc::SIGKILL);
        }
    }
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

/// Non-blocking read of what is available; false at end of file or on error.
pub(crate) fn read_some(fd: &OwnedFd, buf: &mut Vec<u8>) -> bool {
    let mut tmp = [0u8; 65536];
    loop {
        // SAFETY: tmp is a valid writable buffer of the given length.
        let n = unsafe { libc::read(fd.as_raw_fd(), tmp.as_mut_ptr() as *mut libc::c_void, tmp.len()) };
        if n > 0 {
            buf.extend_from_slice(&tmp[..n as usize]);
            return true;
        }
        if n == 0 {
            return false;
        }
        if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        return false;
    }
}

/// Reap `pid` if it has exited.
pub(crate) fn try_reap(pid: i32) -> Option<Exit> {
    let mut st = 0;
    // SAFETY: st is a valid out-parameter; pid is our child.
    let r = unsafe { libc::waitpid(pid, &mut st, libc::WNOHANG) };
    (r == pid).then(|| Exit::from_status(st))
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

/// Send `sig` to `pid` (errors ignored: the process may be gone).
pub(crate) fn kill(pid: i32, sig: i32) {
    // SAFETY: plain syscall.
    unsafe { libc::kill(pid, sig) };
}
