//! The rank's first moments in the guard, until it runs the body (a forked rank) or its
//! program (an exec'd rank, started as `posix_spawn` does: `clone(CLONE_VM | CLONE_VFORK)` then
//! `execve`): process group, parent-death signal, standard descriptors, the launcher's signal
//! state.
//!
//! Async-signal-safe system calls only, on the stack: an exec'd rank shares the guard's memory
//! until its `execve`.

use std::os::fd::RawFd;

use super::protocol::GROUP_ERR_FLAG;
use super::setup::{ExecImage, RankSetup};
use super::signal_safe::{close_raw, errno, exit_now, GuardFds, Saved, IGNORED};

/// The rank process of a forked rank: restore what the guard changed, set up stdio, group and
/// parent-death signal, then run the body.
pub(super) fn rank_main(
    setup: &RankSetup,
    fds: &GuardFds,
    guard: i32,
    saved: &Saved,
    body: impl FnOnce(),
) -> ! {
    if rank_stdio_and_group(setup, fds, guard).is_err() {
        exit_now(127);
    }
    // Its own name in ps/top, apart from its guard's (an exec'd rank takes its program's).
    // SAFETY: prctl with a NUL-terminated name of at most 16 bytes.
    unsafe {
        libc::prctl(
            libc::PR_SET_NAME,
            c"lockstep-rank".as_ptr() as libc::c_ulong,
            0,
            0,
            0,
        )
    };
    // Signals as the launcher had them.
    // SAFETY: restoring saved sigactions and mask through valid pointers.
    unsafe {
        for (i, &s) in IGNORED.iter().enumerate() {
            libc::sigaction(s, &saved.actions[i], std::ptr::null_mut());
        }
        libc::sigaction(
            libc::SIGCHLD,
            &saved.actions[IGNORED.len()],
            std::ptr::null_mut(),
        );
        libc::sigprocmask(libc::SIG_SETMASK, &saved.mask, std::ptr::null_mut());
    }
    close_raw(fds.exec_w);
    body();
    exit_now(1)
}

/// What the rank does first, forked or exec'd: join or lead its process group, die with its
/// guard, take its standard descriptors, and close every descriptor of the guard's.
/// Async-signal-safe system calls only, on the stack: it also runs in a child that shares the
/// guard's memory (see [`spawn_exec_rank`]). Fails with the errno of a `setpgid` that did not
/// work: a rank outside the job's group would escape the launcher's signals, so it must not run.
fn rank_stdio_and_group(setup: &RankSetup, fds: &GuardFds, guard: i32) -> Result<(), i32> {
    // SAFETY: setpgid/prctl/getppid with plain arguments; async-signal-safe.
    unsafe {
        if let Some(g) = setup.pgid {
            // The group exists: its leader's guard holds the leader until every rank has joined
            // (`RankSetup::hold_leader`).
            if libc::setpgid(0, g) != 0 {
                return Err(errno());
            }
        }
        if libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0,
            0,
            0,
        ) != 0
            || libc::getppid() != guard
        {
            libc::_exit(128 + libc::SIGKILL);
        }
    }
    // Standard descriptors: copy the sources above 2 first, so no dup2 clobbers another source.
    let high = |fd: RawFd| -> RawFd {
        // SAFETY: fcntl(F_DUPFD_CLOEXEC) on a valid fd.
        unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) }
    };
    let src = [
        if setup.stdin_null { high(fds.null) } else { -1 },
        if setup.capture { high(fds.out_w) } else { -1 },
        if setup.capture { high(fds.err_w) } else { -1 },
    ];
    for (target, &s) in src.iter().enumerate() {
        if s >= 0 {
            // SAFETY: dup2 from a valid fd onto a standard descriptor (which drops close-on-exec).
            unsafe { libc::dup2(s, target as RawFd) };
            close_raw(s);
        }
    }
    for fd in [
        fds.rep_w, fds.ctl_r, fds.null, fds.out_w, fds.err_w, fds.exec_r,
    ] {
        close_raw(fd);
    }
    Ok(())
}

/// Everything the exec'd rank's first moments need, on the guard's stack.
struct ExecChild<'a> {
    setup: &'a RankSetup<'a>,
    img: &'a ExecImage,
    fds: &'a GuardFds,
    guard: i32,
    saved: &'a Saved,
}

/// Start an exec'd rank the way `posix_spawn` does: `clone(CLONE_VM | CLONE_VFORK)` on a stack
/// of its own, so that the guard's page tables are not copied and none of its pages becomes
/// copy-on-write: in a virtual machine a fork, and each page written afterwards on either side,
/// cost far more than the exec itself (`benches/baselines/startup.sh` times launches).
/// The guard is suspended until the rank has exec'd or failed to. `posix_spawn` itself cannot be
/// used: the rank must set its parent-death signal between the fork and the exec. Returns the
/// rank's pid, or -1 with errno set.
pub(super) fn spawn_exec_rank(
    setup: &RankSetup,
    img: &ExecImage,
    fds: &GuardFds,
    guard: i32,
    saved: &Saved,
) -> i32 {
    // The child uses a few KiB; an overrun hits the inaccessible page below, not the guard's
    // memory.
    const STACK: usize = 64 * 1024;
    const GUARD_PAGE: usize = 4096;
    // SAFETY: an anonymous private mapping, checked below and unmapped before returning; its
    // lowest page is made inaccessible.
    let stack = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            GUARD_PAGE + STACK,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
            -1,
            0,
        )
    };
    if stack == libc::MAP_FAILED {
        return -1;
    }
    // SAFETY: the first page of the mapping made above.
    if unsafe { libc::mprotect(stack, GUARD_PAGE, libc::PROT_NONE) } != 0 {
        let e = errno();
        // SAFETY: the mapping made above; errno restored for the caller.
        unsafe {
            libc::munmap(stack, GUARD_PAGE + STACK);
            *libc::__errno_location() = e;
        }
        return -1;
    }
    let child = ExecChild {
        setup,
        img,
        fds,
        guard,
        saved,
    };
    // No signal handler may run in the child while it shares our memory: block every signal
    // across the clone (the raw system call, as glibc's posix_spawn does: sigfillset leaves out
    // the two glibc keeps for itself); the child resets its handlers before it unblocks.
    let all: u64 = !0;
    let mut mine: u64 = 0;
    // SAFETY: rt_sigprocmask with valid pointers to 8-byte masks (the kernel's sigset size).
    // clone with CLONE_VM | CLONE_VFORK runs `exec_child` on the fresh stack (from its top: the
    // stack grows down; glibc aligns it) with a pointer to `child`, which outlives the call
    // because we are suspended until the child execs or exits; the child only reads `child` and
    // makes async-signal-safe system calls (its descriptor table and signal handlers are its own
    // copies).
    unsafe {
        libc::syscall(
            libc::SYS_rt_sigprocmask,
            libc::SIG_SETMASK,
            &all as *const u64,
            &mut mine as *mut u64,
            8usize,
        );
        let pid = libc::clone(
            exec_child,
            (stack as *mut u8).add(GUARD_PAGE + STACK) as *mut libc::c_void,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            &child as *const ExecChild as *mut libc::c_void,
        );
        let e = errno();
        libc::syscall(
            libc::SYS_rt_sigprocmask,
            libc::SIG_SETMASK,
            &mine as *const u64,
            std::ptr::null_mut::<u64>(),
            8usize,
        );
        libc::munmap(stack, GUARD_PAGE + STACK);
        if pid < 0 {
            *libc::__errno_location() = e;
        }
        pid
    }
}

/// The exec'd rank, from its clone to its `execve`: the signal state an exec of the launcher's
/// would leave (handled signals at their default, ignored ones still ignored), except that,
/// like `std::process::Command`, SIGPIPE is at its default and nothing is blocked (Rust
/// programs ignore SIGPIPE). Every signal with a handler (the guard's, or one the launcher's
/// process installed) is reset before the mask is cleared, so no handler ever runs here, in the
/// guard's memory. On failure it sends errno through the exec error pipe.
extern "C" fn exec_child(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `ExecChild` that `spawn_exec_rank` keeps alive while we run.
    let c = unsafe { &*(arg as *const ExecChild) };
    if let Err(e) = rank_stdio_and_group(c.setup, c.fds, c.guard) {
        let e = (e | GROUP_ERR_FLAG).to_ne_bytes();
        // SAFETY: a 4-byte write from a valid buffer to our pipe, then _exit (no destructors:
        // we share the guard's memory).
        unsafe {
            libc::write(c.fds.exec_w, e.as_ptr() as *const libc::c_void, 4);
            libc::_exit(127)
        }
    }
    // SAFETY: sigaction/sigprocmask with valid pointers; execve with NUL-terminated arrays built
    // before the guard's fork and alive in the guard's memory, which we share.
    unsafe {
        let mut dfl: libc::sigaction = std::mem::zeroed();
        dfl.sa_sigaction = libc::SIG_DFL;
        libc::sigemptyset(&mut dfl.sa_mask);
        let signals = IGNORED
            .iter()
            .copied()
            .chain(std::iter::once(libc::SIGCHLD));
        for (i, s) in signals.enumerate() {
            let was_ignored = c.saved.actions[i].sa_sigaction == libc::SIG_IGN;
            let act = if was_ignored && s != libc::SIGPIPE {
                &c.saved.actions[i]
            } else {
                &dfl
            };
            libc::sigaction(s, act, std::ptr::null_mut());
        }
        // The others, as glibc's posix_spawn does (sigaction refuses glibc's own two).
        let mut cur: libc::sigaction = std::mem::zeroed();
        for s in 1..=libc::SIGRTMAX() {
            if IGNORED.contains(&s)
                || s == libc::SIGCHLD
                || libc::sigaction(s, std::ptr::null(), &mut cur) != 0
            {
                continue;
            }
            if cur.sa_sigaction != libc::SIG_DFL && cur.sa_sigaction != libc::SIG_IGN {
                libc::sigaction(s, &dfl, std::ptr::null_mut());
            }
        }
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
        libc::execve(
            c.img.path.as_ptr(),
            c.img.argv_ptrs.as_ptr(),
            c.img.envp_ptrs.as_ptr(),
        );
        let e = errno().to_ne_bytes();
        libc::write(c.fds.exec_w, e.as_ptr() as *const libc::c_void, 4);
        libc::_exit(127)
    }
}
