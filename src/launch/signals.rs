//! SIGINT/SIGTERM/SIGHUP (and SIGUSR1, forwarded for the flight recorder) handling for the CLI launcher: the handlers only count the signal and
//! write one byte to a self-pipe (both async-signal-safe); the supervisor polls the pipe's read
//! end and stops the ranks from ordinary code (see `supervise.rs` for what each signal does).

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

/// Write end of the self-pipe (-1 while no handler is installed).
static WAKE_FD: AtomicI32 = AtomicI32::new(-1);
/// SIGINT, SIGTERM and SIGHUP received so far.
static INTS: AtomicUsize = AtomicUsize::new(0);
static TERMS: AtomicUsize = AtomicUsize::new(0);
static HUPS: AtomicUsize = AtomicUsize::new(0);
static USR1S: AtomicUsize = AtomicUsize::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    match sig {
        libc::SIGINT => INTS.fetch_add(1, Ordering::SeqCst),
        libc::SIGHUP => HUPS.fetch_add(1, Ordering::SeqCst),
        libc::SIGUSR1 => USR1S.fetch_add(1, Ordering::SeqCst),
        _ => TERMS.fetch_add(1, Ordering::SeqCst),
    };
    let fd = WAKE_FD.load(Ordering::SeqCst);
    if fd >= 0 {
        let b = 1u8;
        // SAFETY: write(2) is async-signal-safe; fd is the non-blocking write end of our pipe
        // (a full pipe just drops the byte: the counters carry the information).
        unsafe { libc::write(fd, &b as *const u8 as *const libc::c_void, 1) };
    }
}

/// Installed handlers; the read end of the self-pipe for `poll`.
pub(crate) struct SignalPipe {
    read: OwnedFd,
}

/// Signals received so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Counts {
    pub int: usize,
    pub term: usize,
    pub hup: usize,
    pub usr1: usize,
}

/// Whether `sig` is ignored (`SIG_IGN`) in this process.
fn ignored(sig: libc::c_int) -> bool {
    // SAFETY: a null new action only reads the current one into a valid, zeroed out-struct.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        libc::sigaction(sig, std::ptr::null(), &mut old) == 0 && old.sa_sigaction == libc::SIG_IGN
    }
}

impl SignalPipe {
    /// Install SIGINT, SIGTERM, SIGHUP and SIGUSR1 handlers (for the rest of the process's life: the CLI
    /// launcher exits after one job).
    pub fn install() -> std::io::Result<SignalPipe> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: valid out-array of two ints.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // The write end lives as long as the process (the handler may run at any time).
        WAKE_FD.store(fds[1], Ordering::SeqCst);
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGUSR1] {
            // An ignored SIGUSR1 stays ignored, in the launcher and (inherited across exec) in
            // the ranks: whoever started the job chose it, and a rank's flight recorder then
            // must not be asked to dump by a signal its parent turned off.
            if sig == libc::SIGUSR1 && ignored(sig) {
                continue;
            }
            // SAFETY: a zeroed sigaction is valid; we set a plain handler with SA_RESTART off so
            // poll returns EINTR promptly, and an empty mask.
            unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_signal as *const () as usize;
                libc::sigemptyset(&mut sa.sa_mask);
                if libc::sigaction(sig, &sa, std::ptr::null_mut()) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
        }
        // SAFETY: fds[0] was just created and is owned here.
        let read = unsafe { OwnedFd::from_raw_fd(fds[0]) };
        Ok(SignalPipe { read })
    }

    /// The fd to poll.
    pub fn fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the fd lives as long as self.
        unsafe { BorrowedFd::borrow_raw(self.read.as_raw_fd()) }
    }

    /// Empty the pipe and return the counts.
    pub fn take(&self) -> Counts {
        let mut buf = [0u8; 64];
        // SAFETY: reading into a valid buffer from our non-blocking fd.
        while unsafe {
            libc::read(
                self.read.as_raw_fd(),
                buf.as_mut_ptr() as *mut libc::c_void,
                buf.len(),
            )
        } > 0
        {}
        Counts {
            int: INTS.load(Ordering::SeqCst),
            term: TERMS.load(Ordering::SeqCst),
            hup: HUPS.load(Ordering::SeqCst),
            usr1: USR1S.load(Ordering::SeqCst),
        }
    }
}
