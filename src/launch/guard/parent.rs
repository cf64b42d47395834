//! The launcher's side of a guard: fork it ([`start`], [`spawn`]), read its reports (the rank
//! exists, runs, could not start, exited), and drive it through the control pipe (signals, the
//! release of a held group leader; closing the pipe is the launcher's death).
//!
//! Ordinary Rust: this runs in the launcher, before the fork and after it in the parent. The
//! child's branch of the fork leaves this file at once for `process.rs`.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use super::process::guard_main;
use super::protocol::{EXIT, FORKED, GROUP_FAILED, RECORD, RELEASE, SPAWN_FAILED, START};
use super::setup::RankSetup;
use super::signal_safe::{close_raw, GuardFds};
use crate::launch::child::{pipe, Exit};

/// How often (ms) the launcher looks at a guard that has not reported its starting rank yet.
const START_CHECK_MS: i32 = 1000;

/// The launcher's handle on a guard.
pub(crate) struct Guard {
    pub pid: i32,
    /// Write end of the control pipe (the guard's lifeline).
    ctl: OwnedFd,
}

impl Guard {
    /// Ask the guard to send `sig` to its rank; SIGKILL kills the rank's whole subtree.
    pub fn signal(&self, sig: i32) {
        let b = sig as u8;
        // SAFETY: a one-byte write from a valid buffer to our pipe (non-blocking; a full pipe,
        // impossible with a few bytes per job, would just drop the byte).
        unsafe {
            libc::write(
                self.ctl.as_raw_fd(),
                &b as *const u8 as *const libc::c_void,
                1,
            )
        };
    }

    /// Let a guard started with [`RankSetup::hold_leader`] reap its rank: every rank that joins
    /// the group has joined it.
    pub fn release(&self) {
        let b = RELEASE;
        // SAFETY: as in `signal`.
        unsafe {
            libc::write(
                self.ctl.as_raw_fd(),
                &b as *const u8 as *const libc::c_void,
                1,
            )
        };
    }

    /// The control pipe's descriptor (which later ranks must not inherit).
    pub fn ctl_fd(&self) -> RawFd {
        self.ctl.as_raw_fd()
    }
}

/// A rank started under its guard.
pub(crate) struct Guarded {
    pub rank_pid: i32,
    pub guard: Guard,
    /// Read end of the report pipe (non-blocking); [`parse_reports`] decodes it.
    pub report: OwnedFd,
    pub stdout: Option<OwnedFd>,
    pub stderr: Option<OwnedFd>,
}

/// What the launcher learned from report bytes.
pub(crate) fn parse_reports(buf: &mut Vec<u8>) -> Option<Exit> {
    let mut exit = None;
    let whole = buf.len() / RECORD * RECORD;
    for rec in buf[..whole].chunks_exact(RECORD) {
        let tag = i32::from_ne_bytes(rec[..4].try_into().expect("4 bytes"));
        let val = i32::from_ne_bytes(rec[4..].try_into().expect("4 bytes"));
        if tag == EXIT {
            exit = Some(Exit::from_status(val));
        }
    }
    buf.drain(..whole);
    exit
}

/// Fork a guard that forks the rank: the rank execs `setup.exec`, or runs `body` (which must not
/// return; if it does, the rank exits with 1). Returns once the rank runs (for an exec: once
/// `execve` succeeded, or with its error).
pub(crate) fn spawn(setup: &RankSetup, body: impl FnOnce()) -> std::io::Result<Guarded> {
    start(setup, body)?.wait()
}

/// A guard forked, whose first report (the rank runs, or could not start) is still to come:
/// several ranks start in parallel when the launcher forks every guard before waiting.
pub(crate) struct Pending {
    pid: i32,
    guard: Guard,
    report: OwnedFd,
    stdout: Option<OwnedFd>,
    stderr: Option<OwnedFd>,
}

/// The first half of [`spawn`]: fork the guard and return without waiting for its report.
pub(crate) fn start(setup: &RankSetup, body: impl FnOnce()) -> std::io::Result<Pending> {
    let (rep_r, rep_w) = pipe()?;
    let (ctl_r, ctl_w) = pipe()?;
    let out = if setup.capture {
        Some((pipe()?, pipe()?))
    } else {
        None
    };
    let exec_err = if setup.exec.is_some() {
        Some(pipe()?)
    } else {
        None
    };
    let devnull = CString::new("/dev/null").expect("no NUL");
    // SAFETY: valid C string; the fd is owned below.
    let null = unsafe { libc::open(devnull.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if null < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh fd we own.
    let null = unsafe { OwnedFd::from_raw_fd(null) };
    // SAFETY: getpid has no preconditions.
    let launcher = unsafe { libc::getpid() };
    {
        use std::io::Write;
        let _ = std::io::stdout().flush();
        let _ = std::io::stderr().flush();
    }
    // SAFETY: the child runs only async-signal-safe system calls until it execs or calls `body`
    // in the rank (the library launcher's documented fork contract), see the module docs.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if pid == 0 {
        // The guard. The launcher's ends of the pipes are not ours to hold.
        let mut fds = GuardFds {
            rep_w: rep_w.as_raw_fd(),
            ctl_r: ctl_r.as_raw_fd(),
            null: null.as_raw_fd(),
            out_w: -1,
            err_w: -1,
            exec_r: -1,
            exec_w: -1,
        };
        close_raw(rep_r.as_raw_fd());
        close_raw(ctl_w.as_raw_fd());
        if let Some(((out_r, out_w), (err_r, err_w))) = &out {
            close_raw(out_r.as_raw_fd());
            close_raw(err_r.as_raw_fd());
            fds.out_w = out_w.as_raw_fd();
            fds.err_w = err_w.as_raw_fd();
        }
        if let Some((r, w)) = &exec_err {
            fds.exec_r = r.as_raw_fd();
            fds.exec_w = w.as_raw_fd();
        }
        for &fd in setup.close {
            close_raw(fd);
        }
        guard_main(setup, &fds, launcher, body);
    }
    drop((rep_w, ctl_r, null));
    let (stdout, stderr) = match out {
        Some(((out_r, _), (err_r, _))) => (Some(out_r), Some(err_r)),
        None => (None, None),
    };
    drop(exec_err);
    let guard = Guard { pid, ctl: ctl_w };
    set_nonblocking(&guard.ctl);
    Ok(Pending {
        pid,
        guard,
        report: rep_r,
        stdout,
        stderr,
    })
}

impl Pending {
    /// Read one whole report record (blocking): `None` when the guard closed the pipe first.
    /// A guard that stays silent is looked at every [`START_CHECK_MS`]: a stopped one (its rank
    /// may stop it before it reports, `kill -STOP $PPID`) is continued, and one that still does
    /// not answer after that is killed, so the launcher never waits on a process that cannot
    /// answer.
    fn record(&self) -> Option<(i32, i32)> {
        let mut rec = [0u8; RECORD];
        let mut got = 0;
        let mut continued = false;
        while got < RECORD {
            let mut pfd = libc::pollfd {
                fd: self.report.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: poll on one valid pollfd.
            let ready = unsafe { libc::poll(&mut pfd, 1, START_CHECK_MS) };
            if ready < 0 {
                // A signal to the launcher (EINTR): its handler counted it; look again.
                continue;
            }
            if ready == 0 {
                // Only a stopped guard cannot answer; a slow one is left to report.
                match crate::launch::child::proc_state(self.pid) {
                    Some('T') | Some('t') if !continued => {
                        tracing::warn!("the guard (pid {}) of a starting rank is stopped: continuing it (SIGCONT)", self.pid);
                        crate::launch::child::kill(self.pid, libc::SIGCONT);
                        continued = true;
                    }
                    Some('T') | Some('t') => {
                        tracing::warn!("the guard (pid {}) of a starting rank still does not answer: killing it", self.pid);
                        crate::launch::child::kill(self.pid, libc::SIGKILL);
                    }
                    _ => {}
                }
                continue;
            }
            // SAFETY: reading into the unfilled tail of a valid buffer.
            let n = unsafe {
                libc::read(
                    self.report.as_raw_fd(),
                    rec[got..].as_mut_ptr() as *mut libc::c_void,
                    RECORD - got,
                )
            };
            if n > 0 {
                got += n as usize;
            } else if n == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR)
            {
                return None;
            }
        }
        Some((
            i32::from_ne_bytes(rec[..4].try_into().expect("4 bytes")),
            i32::from_ne_bytes(rec[4..].try_into().expect("4 bytes")),
        ))
    }

    /// The rank's pid as soon as its guard has forked it, before its exec is known to have
    /// worked: the process group a rank with `pgid: Some(0)` leads exists from then on, so the
    /// launcher can start the ranks that join it right away. [`wait`](Self::wait) still reports
    /// whether the exec worked.
    pub fn rank_pid(&mut self) -> std::io::Result<i32> {
        match self.record() {
            Some((FORKED, pid)) => Ok(pid),
            r => Err(self.failed(r)),
        }
    }

    /// Tell a guard started with `pgid_from_launcher` the process group its rank joins.
    pub fn tell_group(&self, pgid: i32) {
        let b = pgid.to_ne_bytes();
        // SAFETY: a four-byte write from a valid buffer to our pipe, empty until now (the
        // control pipe carries nothing before the group), so it neither blocks nor splits.
        unsafe {
            libc::write(
                self.guard.ctl.as_raw_fd(),
                b.as_ptr() as *const libc::c_void,
                b.len(),
            )
        };
    }

    /// Give up on a guard that waits for its group (`pgid_from_launcher`): closing the control
    /// pipe makes it exit without starting its rank; then reap it.
    pub fn abandon(self) {
        let Pending { pid, guard, .. } = self;
        drop(guard);
        crate::launch::child::reap_blocking(pid);
    }

    /// The guard reported a failure or closed its report pipe: reap it, and say why.
    fn failed(&self, r: Option<(i32, i32)>) -> std::io::Error {
        // The guard exits right after a failure report (or died).
        crate::launch::child::reap_blocking(self.pid);
        match r {
            Some((SPAWN_FAILED, errno)) => std::io::Error::from_raw_os_error(errno),
            Some((GROUP_FAILED, errno)) => std::io::Error::other(format!(
                "it could not join the job's process group ({}), so the launcher could not signal what it starts",
                std::io::Error::from_raw_os_error(errno)
            )),
            _ => std::io::Error::other("the rank's guard process died before starting the rank"),
        }
    }

    /// Wait for the guard's report that the rank runs (its exec worked), or why it could not start.
    pub fn wait(self) -> std::io::Result<Guarded> {
        let mut r = self.record();
        while let Some((FORKED, _)) = r {
            r = self.record();
        }
        if let Some((START, val)) = r {
            set_nonblocking(&self.report);
            return Ok(Guarded {
                rank_pid: val,
                guard: self.guard,
                report: self.report,
                stdout: self.stdout,
                stderr: self.stderr,
            });
        }
        Err(self.failed(r))
    }
}

fn set_nonblocking(fd: &OwnedFd) {
    crate::launch::child::set_nonblocking(fd);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports() {
        let mut buf = Vec::new();
        for (t, v) in [(START, 42i32), (EXIT, 3 << 8)] {
            buf.extend_from_slice(&t.to_ne_bytes());
            buf.extend_from_slice(&v.to_ne_bytes());
        }
        buf.push(7); // half a record waits
        assert_eq!(parse_reports(&mut buf), Some(Exit::Code(3)));
        assert_eq!(buf, vec![7]);
    }
}
