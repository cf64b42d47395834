//! The pieces every part of the post-fork code shares (the guard process, the rank's first
//! moments, the subtree kill): the guard's descriptors, the launcher's saved signal state, the
//! signals the guard ignores, and thin wrappers of async-signal-safe system calls.
//!
//! Everything here is async-signal-safe: raw descriptor numbers (no destructor may run), no
//! allocation, no lock.

use std::os::fd::RawFd;

use super::protocol::RECORD;

/// Signals the guard ignores (see the module docs); restored in the rank.
pub(super) const IGNORED: [libc::c_int; 8] = [
    libc::SIGINT,
    libc::SIGQUIT,
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGTSTP,
    libc::SIGTTIN,
    libc::SIGTTOU,
    libc::SIGPIPE,
];

/// The guard's descriptors (raw numbers: the guard must not run destructors).
pub(super) struct GuardFds {
    pub(super) rep_w: RawFd,
    pub(super) ctl_r: RawFd,
    pub(super) null: RawFd,
    pub(super) out_w: RawFd,
    pub(super) err_w: RawFd,
    pub(super) exec_r: RawFd,
    pub(super) exec_w: RawFd,
}

pub(super) fn close_raw(fd: RawFd) {
    if fd >= 0 {
        // SAFETY: close(2) on a descriptor number; async-signal-safe.
        unsafe { libc::close(fd) };
    }
}

pub(super) fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// Write one report record (EINTR retried; errors ignored: the launcher may be gone).
pub(super) fn report(fd: RawFd, tag: i32, val: i32) {
    let mut rec = [0u8; RECORD];
    rec[..4].copy_from_slice(&tag.to_ne_bytes());
    rec[4..].copy_from_slice(&val.to_ne_bytes());
    loop {
        // SAFETY: writing a valid 8-byte buffer (atomic on a pipe).
        let n = unsafe { libc::write(fd, rec.as_ptr() as *const libc::c_void, RECORD) };
        if n >= 0 || errno() != libc::EINTR {
            return;
        }
    }
}

/// Exit the guard (or a rank that could not start) without running any destructor or atexit
/// handler of the launcher's copy.
pub(super) fn exit_now(code: i32) -> ! {
    // SAFETY: _exit is async-signal-safe and ends the process.
    unsafe { libc::_exit(code) }
}

/// Saved signal state of the launcher, restored in the rank.
pub(super) struct Saved {
    pub(super) actions: [libc::sigaction; IGNORED.len() + 1],
    pub(super) mask: libc::sigset_t,
}

/// Close every descriptor from 3 up except those in `keep` (negative entries ignored).
pub(super) fn close_all_but(keep: &[RawFd]) {
    let mut k = [i32::MAX; 4];
    let mut nk = 0;
    for &fd in keep {
        if fd >= 3 && nk < k.len() {
            k[nk] = fd;
            nk += 1;
        }
    }
    k[..nk].sort_unstable();
    let mut lo: u32 = 3;
    for &fd in &k[..nk] {
        if fd as u32 > lo {
            close_range(lo, fd as u32 - 1);
        }
        lo = fd as u32 + 1;
    }
    close_range(lo, u32::MAX);
}

/// close_range(2), or a loop of close(2) up to the descriptor limit on kernels without it.
fn close_range(lo: u32, hi: u32) {
    // SAFETY: raw syscall with integer arguments.
    let r = unsafe { libc::syscall(libc::SYS_close_range, lo, hi, 0) };
    if r == 0 {
        return;
    }
    // SAFETY: getrlimit with a valid out-pointer.
    let limit = unsafe {
        let mut rl: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) == 0 {
            rl.rlim_cur.min(1 << 16) as u32
        } else {
            1 << 16
        }
    };
    for fd in lo..hi.min(limit.saturating_sub(1)).saturating_add(1) {
        close_raw(fd as RawFd);
    }
}
