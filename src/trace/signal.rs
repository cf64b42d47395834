//! SIGUSR1 → trace files, without doing anything unsafe in the handler: the handler writes one
//! byte to a pipe (async-signal-safe) and calls the handler it replaced, if any; the thread
//! `lockstep-trace` reads the pipe and runs the dump from ordinary code. Installed once per
//! process, on the first recording communicator made while `LOCKSTEP_TRACE_DIR` is set.

use std::fs::File;
use std::io::Read;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering::SeqCst};
use std::sync::Once;

static INSTALL: Once = Once::new();
/// Write end of the pipe (-1 until installed).
static WAKE_FD: AtomicI32 = AtomicI32::new(-1);
/// The SIGUSR1 handler replaced (`sa_sigaction`) and its flags, to chain to.
static PREV: AtomicUsize = AtomicUsize::new(libc::SIG_DFL);
static PREV_FLAGS: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_usr1(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let fd = WAKE_FD.load(SeqCst);
    if fd >= 0 {
        let b = 1u8;
        // SAFETY: write(2) is async-signal-safe; fd is the non-blocking write end of the pipe,
        // open for the life of the process (a full pipe drops the byte: a dump is pending).
        unsafe { libc::write(fd, &b as *const u8 as *const libc::c_void, 1) };
    }
    let prev = PREV.load(SeqCst);
    if prev == libc::SIG_DFL || prev == libc::SIG_IGN {
        // The default action of SIGUSR1 terminates: never chain to it.
        return;
    }
    if PREV_FLAGS.load(SeqCst) & libc::SA_SIGINFO != 0 {
        // SAFETY: the program installed `prev` as an SA_SIGINFO handler of this signature.
        let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
            unsafe { std::mem::transmute(prev) };
        f(sig, info, ctx);
    } else {
        // SAFETY: the program installed `prev` as a plain handler of this signature.
        let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(prev) };
        f(sig);
    }
}

/// Run `on_signal` on the thread `lockstep-trace` after each SIGUSR1 from now on (the first
/// call installs the handler and starts the thread; later ones do nothing).
pub(super) fn install_once(on_signal: fn()) {
    INSTALL.call_once(|| {
        if let Err(e) = install(on_signal) {
            tracing::warn!("flight recorder: SIGUSR1 will not write traces: {e}");
        }
    });
}

fn install(on_signal: fn()) -> std::io::Result<()> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: a valid out-array of two ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fds[0] was just created and is owned here.
    let read = File::from(unsafe { OwnedFd::from_raw_fd(fds[0]) });
    // SAFETY: fds[1] is ours; only the handler writes it, and it must never block.
    unsafe {
        let fl = libc::fcntl(fds[1], libc::F_GETFL);
        libc::fcntl(fds[1], libc::F_SETFL, fl | libc::O_NONBLOCK);
    }
    std::thread::Builder::new()
        .name("lockstep-trace".into())
        .spawn(move || wait(read, on_signal))?;
    // The write end lives as long as the process (the handler may run at any time).
    WAKE_FD.store(fds[1], SeqCst);
    // SAFETY: a zeroed sigaction is valid; an SA_SIGINFO handler with SA_RESTART (interrupted
    // system calls of the program resume), an empty mask; the old action is read into `old`.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_usr1 as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
        libc::sigemptyset(&mut sa.sa_mask);
        let mut old: libc::sigaction = std::mem::zeroed();
        // Record the previous handler before ours can run.
        if libc::sigaction(libc::SIGUSR1, std::ptr::null(), &mut old) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        PREV.store(old.sa_sigaction, SeqCst);
        PREV_FLAGS.store(old.sa_flags, SeqCst);
        if libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    tracing::debug!("flight recorder: SIGUSR1 writes the trace of every communicator");
    Ok(())
}

/// The thread: each wake-up (one or more signals) runs `on_signal` once.
fn wait(mut pipe: File, on_signal: fn()) {
    let mut buf = [0u8; 64];
    while matches!(pipe.read(&mut buf), Ok(n) if n > 0) {
        on_signal();
    }
}
