//! The process plumbing of the launchers: pipes, exit statuses, reading, reaping and killing.
//! The launcher's `unsafe` lives here, in `guard/` (fork, the guard, exec), in `forked.rs` (the
//! library launcher's rank, started under a guard like the CLI's exec'd ones) and in
//! `signals.rs` (the CLI's signal handlers).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

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

    /// Decode a `waitpid` status.
    pub(crate) fn from_status(st: libc::c_int) -> Exit {
        if libc::WIFSIGNALED(st) {
            Exit::Signal(libc::WTERMSIG(st))
        } else {
            Exit::Code(libc::WEXITSTATUS(st))
        }
    }
}

/// Conventional name of a signal.
pub(crate) fn signal_name(s: i32) -> &'static str {
    nix::sys::signal::Signal::try_from(s).map_or("signal", |sig| sig.as_str())
}

/// Refuse to fork when CUDA is initialised in this process (the children could not use it).
pub(crate) fn check_fork_safe() -> Result<(), String> {
    crate::cuda::init::check_fork_safe()
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
        let n = unsafe {
            libc::read(
                fd.as_raw_fd(),
                tmp.as_mut_ptr() as *mut libc::c_void,
                tmp.len(),
            )
        };
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

/// The process group of `pid` (`None` when it is gone).
pub(crate) fn getpgid(pid: i32) -> Option<i32> {
    // SAFETY: plain syscall.
    let g = unsafe { libc::getpgid(pid) };
    (g >= 0).then_some(g)
}

/// Whether process `pid` has exited (a zombie not reaped yet, or gone): `pidfd_open` fails with
/// ESRCH for a reaped process, and a pidfd polls readable once its process exited. `false` when
/// it cannot tell (no pidfd support).
pub(crate) fn has_exited(pid: i32) -> bool {
    // SAFETY: raw syscall with integer arguments.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
    }
    let fd = fd as libc::c_int;
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout; then closing the pidfd we opened.
    unsafe {
        let r = libc::poll(&mut p, 1, 0);
        libc::close(fd);
        r > 0
    }
}

/// The scheduler state of process `pid` from `/proc/<pid>/stat` (`R`, `S`, `T` stopped, `t`
/// stopped by a debugger, `Z` zombie, ...); `None` when it is gone.
pub(crate) fn proc_state(pid: i32) -> Option<char> {
    let stat = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) S ...": the command may hold ')' itself, so look after the last one.
    let close = stat.iter().rposition(|&b| b == b')')?;
    stat.get(close + 2).map(|&b| b as char)
}

/// `poll(2)` on `fds` for at most `timeout_ms` (EINTR, e.g. from a forwarded signal, just returns
/// early: callers loop).
pub(crate) fn poll(fds: &mut [libc::pollfd], timeout_ms: i32) {
    // SAFETY: fds is a valid, exclusively borrowed array of pollfd of the given length.
    unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
}

/// Monotonic clock in nanoseconds (`CLOCK_MONOTONIC`, comparable across processes of one host).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid out-parameter.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
