//! The guard process, from its fork to its exit (the child's side of the fork in
//! `parent.rs`): it ignores the terminal's signals, becomes a child subreaper, starts the rank
//! (`spawn.rs`), reports it, forwards the launcher's signals to it, and kills the whole subtree
//! when the rank exits, on the launcher's SIGKILL, or when the launcher dies.
//!
//! Async-signal-safe system calls only: no allocation, no locks, no destructors (the launcher
//! may have other threads; the guard is a fork of it that never execs).

use std::ffi::CStr;
use std::os::fd::RawFd;

use super::protocol::{EXIT, FORKED, GROUP_ERR_FLAG, GROUP_FAILED, RELEASE, SPAWN_FAILED, START};
use super::setup::RankSetup;
use super::signal_safe::{
    close_all_but, close_raw, errno, exit_now, report, GuardFds, Saved, IGNORED,
};
use super::spawn::{rank_main, spawn_exec_rank};
use super::tree::kill_children;

extern "C" fn on_sigchld(_: libc::c_int) {}

pub(super) fn guard_main(
    setup: &RankSetup,
    fds: &GuardFds,
    launcher: i32,
    body: impl FnOnce(),
) -> ! {
    // SAFETY: zeroed sigaction/sigset_t are valid plain C structs, filled by the calls below.
    let mut saved: Saved = unsafe { std::mem::zeroed() };
    // SAFETY: sigaction/sigprocmask/prctl with valid pointers and constant arguments, all
    // async-signal-safe; see the module docs for why each is set.
    unsafe {
        let mut ign: libc::sigaction = std::mem::zeroed();
        ign.sa_sigaction = libc::SIG_IGN;
        libc::sigemptyset(&mut ign.sa_mask);
        for (i, &s) in IGNORED.iter().enumerate() {
            libc::sigaction(s, &ign, &mut saved.actions[i]);
        }
        let mut chld: libc::sigaction = std::mem::zeroed();
        chld.sa_sigaction = on_sigchld as *const () as usize;
        chld.sa_flags = libc::SA_NOCLDSTOP;
        libc::sigemptyset(&mut chld.sa_mask);
        libc::sigaction(libc::SIGCHLD, &chld, &mut saved.actions[IGNORED.len()]);
        // SIGCHLD stays blocked except inside ppoll, so none is lost between a check and the wait.
        let mut block: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut block);
        libc::sigaddset(&mut block, libc::SIGCHLD);
        libc::sigprocmask(libc::SIG_BLOCK, &block, &mut saved.mask);
        libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong, 0, 0, 0);
        // Its name in ps/top/pstree (its command line stays the launcher's).
        libc::prctl(
            libc::PR_SET_NAME,
            c"lockstep-guard".as_ptr() as libc::c_ulong,
            0,
            0,
            0,
        );
    }
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    // The launcher died before we were ready: nothing to start.
    // SAFETY: getppid has no preconditions.
    if unsafe { libc::getppid() } != launcher {
        exit_now(1);
    }
    let told;
    let setup = if setup.pgid_from_launcher {
        match read_group(fds.ctl_r) {
            Some(g) => {
                told = RankSetup {
                    pgid: Some(g),
                    pgid_from_launcher: false,
                    ..*setup
                };
                &told
            }
            // The launcher closed the pipe (it gave up starting the job, or died): no rank.
            None => exit_now(1),
        }
    } else {
        setup
    };
    let rank = match setup.exec {
        Some(img) => spawn_exec_rank(setup, img, fds, me, &saved),
        None => {
            // SAFETY: see the spawn's fork; the rank branch never returns.
            let rank = unsafe { libc::fork() };
            if rank == 0 {
                rank_main(setup, fds, me, &saved, body);
            }
            rank
        }
    };
    if rank < 0 {
        report(fds.rep_w, SPAWN_FAILED, errno());
        exit_now(1);
    }
    if setup.pgid == Some(0) && setup.exec.is_none() {
        // The forked rank calls this too; whichever runs first makes the group, so it exists
        // before FORKED lets the launcher start ranks that join it. (An exec'd rank has made its
        // group before the guard resumes.)
        // SAFETY: setpgid of our own child; async-signal-safe.
        unsafe { libc::setpgid(rank, rank) };
    }
    report(fds.rep_w, FORKED, rank);
    // The guard keeps only its report and control pipes (and, until the exec is known to have
    // worked, the exec error pipe); its stdio becomes /dev/null.
    close_raw(fds.exec_w);
    for std_fd in 0..3 {
        // SAFETY: dup2 onto a standard descriptor from a valid fd.
        unsafe { libc::dup2(fds.null, std_fd) };
    }
    close_all_but(&[fds.rep_w, fds.ctl_r, fds.exec_r]);
    if fds.exec_r >= 0 {
        let mut e = [0u8; 4];
        let mut got = 0;
        while got < 4 {
            // SAFETY: reading into the unfilled tail of a valid buffer.
            let n = unsafe {
                libc::read(
                    fds.exec_r,
                    e[got..].as_mut_ptr() as *mut libc::c_void,
                    4 - got,
                )
            };
            if n > 0 {
                got += n as usize;
            } else if n == 0 || errno() != libc::EINTR {
                break;
            }
        }
        close_raw(fds.exec_r);
        if got == 4 {
            // setpgid or execve failed: the rank wrote errno and exits.
            let e = i32::from_ne_bytes(e);
            if e & GROUP_ERR_FLAG != 0 {
                report(fds.rep_w, GROUP_FAILED, e & !GROUP_ERR_FLAG);
            } else {
                report(fds.rep_w, SPAWN_FAILED, e);
            }
            let mut st = 0;
            // SAFETY: waiting for our own child with a valid out-pointer.
            unsafe { libc::waitpid(rank, &mut st, 0) };
            exit_now(0);
        }
    }
    report(fds.rep_w, START, rank);
    supervise_rank(
        fds,
        me,
        rank,
        setup.hold_leader,
        setup.unlink_on_launcher_death,
    )
}

/// The process group the launcher sends through the control pipe (four bytes, one atomic pipe
/// write); `None` when the pipe closes first.
fn read_group(ctl: RawFd) -> Option<i32> {
    let mut b = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        // SAFETY: reading into the unfilled tail of a valid buffer.
        let n = unsafe { libc::read(ctl, b[got..].as_mut_ptr() as *mut libc::c_void, 4 - got) };
        if n > 0 {
            got += n as usize;
        } else if n == 0 || errno() != libc::EINTR {
            return None;
        }
    }
    Some(i32::from_ne_bytes(b))
}

/// Wait for the rank, forwarding the launcher's signals; then (or when the launcher is gone)
/// kill the subtree and exit. With `hold`, an exited rank stays unreaped until the launcher
/// releases it (see [`RankSetup::hold_leader`]).
fn supervise_rank(fds: &GuardFds, me: i32, rank: i32, hold: bool, unlink: Option<&CStr>) -> ! {
    let mut rank_done = false;
    let mut holding = hold;
    // SIGKILL the subtree: after the rank's exit, on the launcher's SIGKILL, or its death.
    let mut killing = false;
    let mut ctl_open = true;
    let mut backoff_ms: i64 = 10;
    loop {
        // Reap whatever ended (the rank, or orphans re-parented to us).
        let children_left = loop {
            if holding {
                // Look before reaping: the rank must stay a zombie, its group alive.
                // SAFETY: zeroed siginfo_t is a valid out-buffer for waitid.
                let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
                // SAFETY: waitid with a valid out-pointer; WNOWAIT leaves the child waitable.
                let r = unsafe {
                    libc::waitid(
                        libc::P_ALL,
                        0,
                        &mut info,
                        libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
                    )
                };
                if r < 0 {
                    if errno() == libc::EINTR {
                        continue;
                    }
                    break false;
                }
                // SAFETY: waitid filled `info` for a child (si_pid 0: none has exited).
                let (pid, code, status) =
                    unsafe { (info.si_pid(), info.si_code, info.si_status()) };
                if pid == 0 {
                    break true;
                }
                if pid != rank {
                    // SAFETY: reaping that exited child, with a valid out-pointer.
                    unsafe { libc::waitpid(pid, &mut 0, libc::WNOHANG) };
                    continue;
                }
                if !rank_done {
                    rank_done = true;
                    report(fds.rep_w, EXIT, wait_status(code, status));
                }
                break true;
            }
            let mut st = 0;
            // SAFETY: waitpid with a valid out-pointer.
            let r = unsafe { libc::waitpid(-1, &mut st, libc::WNOHANG) };
            if r > 0 {
                if r == rank && !rank_done {
                    rank_done = true;
                    report(fds.rep_w, EXIT, st);
                }
                continue;
            }
            if r < 0 && errno() == libc::EINTR {
                continue;
            }
            break r == 0;
        };
        killing |= rank_done;
        if !children_left {
            if !ctl_open {
                if let Some(name) = unlink {
                    // SAFETY: unlink(2) of a NUL-terminated path built before the fork.
                    unsafe { libc::unlink(name.as_ptr()) };
                }
            }
            exit_now(0);
        }
        if killing {
            if !rank_done {
                // Directly as well: /proc may be missing (then only the rank is reached).
                // SAFETY: kill(2) of our own unreaped child.
                unsafe { libc::kill(rank, libc::SIGKILL) };
            }
            kill_children(me);
        }
        let mut pfd = libc::pollfd {
            fd: if ctl_open { fds.ctl_r } else { -1 },
            events: libc::POLLIN,
            revents: 0,
        };
        // While killing, look again soon even without SIGCHLD (a child may be in uninterruptible
        // sleep); otherwise sleep until a child exits or the launcher writes or dies.
        let ts = libc::timespec {
            tv_sec: (backoff_ms / 1000) as libc::time_t,
            tv_nsec: (backoff_ms % 1000) * 1_000_000,
        };
        // SAFETY: zeroed sigset is valid; emptied below.
        let mut open: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: ppoll with one valid pollfd, a valid timespec (or null) and a valid mask that
        // unblocks SIGCHLD for the duration of the wait.
        unsafe {
            libc::sigemptyset(&mut open);
            libc::ppoll(
                &mut pfd,
                1,
                if killing { &ts } else { std::ptr::null() },
                &open,
            );
        }
        if killing {
            backoff_ms = (backoff_ms * 2).min(1000);
        }
        if ctl_open && pfd.revents != 0 {
            let mut buf = [0u8; 64];
            // SAFETY: reading into a valid buffer (poll said it will not block).
            let n =
                unsafe { libc::read(fds.ctl_r, buf.as_mut_ptr() as *mut libc::c_void, buf.len()) };
            if n == 0 || (n < 0 && errno() != libc::EINTR && errno() != libc::EAGAIN) {
                // The launcher is gone.
                ctl_open = false;
                close_raw(fds.ctl_r);
                killing = true;
            }
            if !ctl_open {
                holding = false;
            }
            for &sig in &buf[..n.max(0) as usize] {
                if sig == RELEASE {
                    holding = false;
                } else if sig as i32 == libc::SIGKILL {
                    killing = true;
                    holding = false;
                } else if !rank_done {
                    // SAFETY: kill(2) of our own unreaped child (its pid cannot be reused).
                    unsafe { libc::kill(rank, sig as i32) };
                }
            }
        }
    }
}

/// The `waitpid` status of a child as `waitid` describes it.
fn wait_status(code: i32, status: i32) -> i32 {
    match code {
        libc::CLD_EXITED => (status & 0xff) << 8,
        libc::CLD_DUMPED => (status & 0x7f) | 0x80,
        _ => status & 0x7f,
    }
}
