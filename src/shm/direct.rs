//! Direct copies between ranks: cross-memory attach (`process_vm_readv`, `process_vm_writev`)
//! copies between a peer's buffer and ours, one copy instead of two through shared memory. Used
//! by point-to-point messages (`algo::p2p`), the exchanges (`algo::exchange`) and the
//! single-copy collectives (`algo::single`) from `ShmConfig::cma_bytes`; the kernel may refuse
//! (Yama, seccomp, another pid namespace), and then callers stage instead.

/// The pid namespace of this process (its inode), so that a receiver never reads a pid that
/// names another process in its own namespace.
pub(crate) fn pid_namespace() -> u64 {
    use std::os::unix::fs::MetadataExt;
    static NS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *NS.get_or_init(|| {
        std::fs::metadata("/proc/self/ns/pid")
            .map(|m| m.ino())
            .unwrap_or(0)
    })
}

/// Under Yama `ptrace_scope` 1 only ancestors may read a process's memory: let the sibling ranks
/// do it (see `ShmConfig::cma_bytes`).
pub(crate) fn allow_sibling_reads() {
    if std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope").is_ok_and(|v| v.trim() == "1")
    {
        // SAFETY: prctl with constant arguments.
        let rc = unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
        if rc != 0 {
            tracing::debug!(
                "PR_SET_PTRACER failed ({}): large messages go through the mailboxes",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// Copy `bytes` from `addr` in process `pid` into `dst` with `process_vm_readv`; false when the
/// kernel refuses (no permission, no such process, not supported) or the copy comes up short.
pub(crate) fn read_direct(pid: u64, addr: u64, dst: usize, bytes: usize) -> bool {
    match read_direct_io(pid, addr, dst, bytes) {
        Ok(()) => true,
        Err(e) => {
            tracing::debug!("process_vm_readv from pid {pid} failed ({e}); the message goes through the mailbox");
            false
        }
    }
}

/// As [`read_direct`], with the reason of a failure (a short read is `UnexpectedEof`).
pub(crate) fn read_direct_io(pid: u64, addr: u64, dst: usize, bytes: usize) -> std::io::Result<()> {
    copy_direct_io(pid, addr, dst, bytes, false)
}

/// Copy `bytes` from `src` into `addr` in process `pid` with `process_vm_writev` (the single-copy
/// collectives push part of a message into a peer's output, so that both cores copy); the reason
/// of a failure as for [`read_direct_io`].
pub(crate) fn write_direct_io(
    pid: u64,
    addr: u64,
    src: usize,
    bytes: usize,
) -> std::io::Result<()> {
    copy_direct_io(pid, addr, src, bytes, true)
}

/// `process_vm_readv` (`write` false: from `addr` in `pid` into `local`) or `process_vm_writev`
/// (`write`: from `local` into `addr`), resumed after a partial copy or an interrupt.
fn copy_direct_io(
    pid: u64,
    addr: u64,
    local: usize,
    bytes: usize,
    write: bool,
) -> std::io::Result<()> {
    let mut done = 0usize;
    while done < bytes {
        let here = libc::iovec {
            iov_base: (local + done) as *mut libc::c_void,
            iov_len: bytes - done,
        };
        let remote = libc::iovec {
            iov_base: (addr as usize + done) as *mut libc::c_void,
            iov_len: bytes - done,
        };
        let n = if write {
            // SAFETY: `here` is the unsent tail of the caller's source (readable, `bytes - done`
            // bytes); the kernel checks the remote range against the peer's mappings.
            unsafe { libc::process_vm_writev(pid as libc::pid_t, &here, 1, &remote, 1, 0) }
        } else {
            // SAFETY: `here` is the receive buffer's unfilled tail (writable, `bytes - done`
            // bytes); the kernel checks the remote range against the sender's mappings.
            unsafe { libc::process_vm_readv(pid as libc::pid_t, &here, 1, &remote, 1, 0) }
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            let what = if write { "wrote" } else { "read" };
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("{what} {done} of {bytes} bytes"),
            ));
        }
        done += n as usize;
    }
    Ok(())
}
