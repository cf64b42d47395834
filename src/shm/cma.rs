//! Cross-memory attach (CMA): `process_vm_readv` and `process_vm_writev` copy between a peer's
//! buffer and ours, one copy instead of two through shared memory. Used from
//! `ShmConfig::cma_bytes` by point-to-point messages (`shm::p2p`), the exchanges
//! (`coll::exchange`) and the collectives' CMA bodies (`shm::coll`, the path chosen by
//! `shm::path`); the kernel may refuse (Yama, seccomp, another pid namespace), and then callers
//! go through the mailboxes or the slots instead.

/// What one communicator has learnt about cross-memory copies, and the buffer its CMA
/// reductions read into.
#[derive(Default)]
pub(crate) struct CmaState {
    /// Cross-memory copies between ranks were refused once: every rank learnt it in the same
    /// phase, so all stop offering them.
    pub(crate) refused: bool,
    /// Every rank read every peer's memory once, in a probe phase (`path::negotiate`): from then
    /// on a failed copy in a collective is an error, not a reason to use the slots.
    pub(crate) verified: bool,
    /// Where the CMA reductions land the peers' pieces before reducing them (reused across
    /// calls, so no allocation or page fault in steady state).
    pub(crate) scratch: Vec<u64>,
}

/// Whether a collective whose per-rank message is `bytes` long may copy once, straight from the
/// peers' ordinary buffers, rather than twice through the slots (rank 0's tuner,
/// `ShmConfig::single_copy`, then chooses between the two).
///
/// Why by size: a cross-memory copy costs a system call and the pinning of the peer's pages (a
/// few microseconds), paid back from a few tens of KiB on, where the slots' second copy costs
/// more, all the more when the two cores share no cache (the lines written into the slots then
/// travel through memory twice). Up to `one_phase_bytes` the one-phase path wins. From
/// `nt_bytes` up the message no longer fits the caches and the slots are written with streaming
/// stores, while the kernel's copy writes through the cache (each destination line is read
/// before it is written), so the CMA path loses there (`lockstep bench` at 64 MiB,
/// `LOCKSTEP_SHM_SINGLE_COPY=always` against `never`), and it stops below `nt_bytes`.
/// `cma_bytes` 0 turns it off.
pub(crate) fn cma_for(
    bytes: usize,
    cma_bytes: usize,
    one_phase_bytes: usize,
    nt_bytes: usize,
) -> bool {
    cma_bytes > 0 && bytes >= cma_bytes && bytes > one_phase_bytes && bytes < nt_bytes
}

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
pub(crate) fn read(pid: u64, addr: u64, dst: usize, bytes: usize) -> bool {
    match read_io(pid, addr, dst, bytes) {
        Ok(()) => true,
        Err(e) => {
            tracing::debug!("process_vm_readv from pid {pid} failed ({e}); the message goes through the mailbox");
            false
        }
    }
}

/// As [`read`], with the reason of a failure (a short read is `UnexpectedEof`).
pub(crate) fn read_io(pid: u64, addr: u64, dst: usize, bytes: usize) -> std::io::Result<()> {
    copy_io(pid, addr, dst, bytes, false)
}

/// Copy `bytes` from `src` into `addr` in process `pid` with `process_vm_writev` (the CMA bodies
/// of the collectives push part of a message into a peer's output, so that both cores copy); the reason
/// of a failure as for [`read_io`].
pub(crate) fn write_io(pid: u64, addr: u64, src: usize, bytes: usize) -> std::io::Result<()> {
    copy_io(pid, addr, src, bytes, true)
}

/// `process_vm_readv` (`write` false: from `addr` in `pid` into `local`) or `process_vm_writev`
/// (`write`: from `local` into `addr`), resumed after a partial copy or an interrupt.
fn copy_io(pid: u64, addr: u64, local: usize, bytes: usize, write: bool) -> std::io::Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cma_from_the_threshold_up() {
        assert!(!cma_for(1 << 20, 0, 16 << 10, 8 << 20), "0 turns it off");
        assert!(
            !cma_for(16 << 10, 4 << 10, 16 << 10, 8 << 20),
            "the one-phase path keeps its sizes"
        );
        assert!(!cma_for((32 << 10) - 1, 32 << 10, 16 << 10, 8 << 20));
        assert!(cma_for(32 << 10, 32 << 10, 16 << 10, 8 << 20));
        assert!(cma_for((8 << 20) - 1, 32 << 10, 16 << 10, 8 << 20));
        assert!(
            !cma_for(8 << 20, 32 << 10, 16 << 10, 8 << 20),
            "the slots with streaming stores from nt_bytes up"
        );
    }
}
