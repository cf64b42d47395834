//! The shared-memory segment: every OS call of the shared-memory backend lives here
//! (`memfd_create`, `shm_open`, `ftruncate`, `mmap`, `shm_unlink`), each retried on `EINTR`.
//!
//! Two ways to get one:
//! * [`Segment::anonymous`]: a memfd mapped `MAP_SHARED` by a parent *before* it forks its ranks;
//!   children inherit the mapping, nothing is ever visible in `/dev/shm`.
//! * [`Segment::create_named`] / [`Segment::open_named`]: for ranks exec'd separately that find each
//!   other by a job id. The name is unlinked as soon as every rank has mapped it (see `shm::bootstrap`),
//!   and the CLI launcher unlinks it again at exit, so a crash leaves nothing behind.
//!
//! Mappings use `MAP_NORESERVE`: the heap region is sized generously but only touched pages cost
//! memory.

use std::ffi::CString;
use std::io;

use crate::comm::CommError;

/// One mapping of a shared segment. Unmapped on drop.
#[derive(Debug)]
pub(crate) struct Segment {
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping is process-wide memory; synchronisation of its contents is the job of the
// protocol in `sync.rs` (atomics with release/acquire ordering).
unsafe impl Send for Segment {}
// SAFETY: as above; `Segment` itself holds no interior state besides the immutable base/len.
unsafe impl Sync for Segment {}

fn os_err(call: impl Into<String>) -> CommError {
    CommError::Os { call: call.into(), source: io::Error::last_os_error() }
}

/// Retry a libc call while it fails with EINTR.
fn retry<F: FnMut() -> libc::c_int>(mut f: F) -> libc::c_int {
    loop {
        let r = f();
        if r == -1 && io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        return r;
    }
}

fn map_fd(fd: libc::c_int, len: usize, what: &str) -> Result<*mut u8, CommError> {
    // SAFETY: mapping a valid fd with a fresh address chosen by the kernel; no existing memory is
    // affected. The result is checked against MAP_FAILED.
    let p =
        unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED | libc::MAP_NORESERVE, fd, 0) };
    if p == libc::MAP_FAILED {
        return Err(os_err(format!("mmap({what}, {len} bytes)")));
    }
    Ok(p as *mut u8)
}

fn close(fd: libc::c_int) {
    // SAFETY: fd is owned by the caller and not used afterwards.
    unsafe { libc::close(fd) };
}

fn truncate(fd: libc::c_int, len: usize, what: &str) -> Result<(), CommError> {
    // SAFETY: plain syscall on an fd we own.
    let r = retry(|| unsafe { libc::ftruncate(fd, len as libc::off_t) });
    if r != 0 {
        return Err(os_err(format!("ftruncate({what}, {len})")));
    }
    Ok(())
}

/// The `/dev/shm` name used for a job id.
pub(crate) fn shm_name(job_id: &str) -> String {
    format!("/lockstep-{job_id}")
}

impl Segment {
    /// Create an anonymous segment (memfd) of `len` bytes, zero-filled, to be inherited across fork.
    pub fn anonymous(len: usize) -> Result<Segment, CommError> {
        let name = CString::new("lockstep-shm").expect("static name");
        // SAFETY: name is a valid C string; flags are constants.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(os_err("memfd_create"));
        }
        let res = truncate(fd, len, "memfd").and_then(|_| map_fd(fd, len, "memfd"));
        close(fd);
        Ok(Segment { base: res?, len })
    }

    /// Create the named segment of a job. Fails with `AlreadyExists` (as an `Os` error) when a
    /// segment of that name exists: another job with the same id, or a leftover.
    pub fn create_named(job_id: &str, len: usize) -> Result<Segment, CommError> {
        let name = CString::new(shm_name(job_id)).map_err(|_| CommError::Setup(format!("invalid job id {job_id:?}")))?;
        // SAFETY: valid C string, constant flags and mode.
        let fd = retry(|| unsafe { libc::shm_open(name.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC, 0o600) });
        if fd < 0 {
            return Err(os_err(format!("shm_open({}, O_CREAT|O_EXCL)", shm_name(job_id))));
        }
        let res = truncate(fd, len, &shm_name(job_id)).and_then(|_| map_fd(fd, len, &shm_name(job_id)));
        close(fd);
        match res {
            Ok(base) => Ok(Segment { base, len }),
            Err(e) => {
                unlink_named(job_id);
                Err(e)
            }
        }
    }

    /// Open an existing named segment. Returns `Ok(None)` while it does not exist yet or is not
    /// sized yet (the creator has not finished `ftruncate`).
    pub fn open_named(job_id: &str, min_len: usize) -> Result<Option<Segment>, CommError> {
        let name = CString::new(shm_name(job_id)).map_err(|_| CommError::Setup(format!("invalid job id {job_id:?}")))?;
        // SAFETY: valid C string, constant flags.
        let fd = retry(|| unsafe { libc::shm_open(name.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC, 0) });
        if fd < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENOENT) {
                return Ok(None);
            }
            return Err(CommError::Os { call: format!("shm_open({})", shm_name(job_id)), source: e });
        }
        // SAFETY: zeroed stat is a valid out-parameter for fstat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fd is valid, st is a valid out-parameter.
        if unsafe { libc::fstat(fd, &mut st) } != 0 {
            let e = os_err(format!("fstat({})", shm_name(job_id)));
            close(fd);
            return Err(e);
        }
        let len = st.st_size as usize;
        if len < min_len {
            close(fd);
            return Ok(None);
        }
        let res = map_fd(fd, len, &shm_name(job_id));
        close(fd);
        Ok(Some(Segment { base: res?, len }))
    }

    /// Base address of the mapping.
    pub fn base(&self) -> *mut u8 {
        self.base
    }

    /// Length of the mapping in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Touch `[off, off+len)` so that later accesses do not page-fault.
    pub fn prefault(&self, off: usize, len: usize) {
        let end = (off + len).min(self.len);
        let mut o = off;
        while o < end {
            // SAFETY: o is inside the mapping; a volatile read+write of the same byte does not change it
            // and nobody else uses this region yet (called during setup only).
            unsafe {
                let p = self.base.add(o);
                std::ptr::write_volatile(p, std::ptr::read_volatile(p));
            }
            o += 4096;
        }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: base/len describe a mapping we created and nobody uses after drop (all users hold
        // an Arc<Segment>).
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
    }
}

/// Remove a job's named segment (ignores "does not exist").
pub fn unlink_named(job_id: &str) {
    if let Ok(name) = CString::new(shm_name(job_id)) {
        // SAFETY: valid C string.
        unsafe { libc::shm_unlink(name.as_ptr()) };
    }
}

/// A handle to another process that tells whether it has exited, zombie or not.
#[derive(Debug)]
pub(crate) struct PeerWatch {
    pid: i32,
    pidfd: Option<libc::c_int>,
}

impl PeerWatch {
    /// Watch `pid`. Uses `pidfd_open` (readable once the process exits, even before it is reaped),
    /// falling back to `kill(pid, 0)` and `/proc/<pid>/stat` on old kernels.
    pub fn new(pid: i32) -> PeerWatch {
        // SAFETY: raw syscall with plain integer arguments.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        PeerWatch { pid, pidfd: if fd >= 0 { Some(fd as libc::c_int) } else { None } }
    }

    /// The watched pid.
    #[allow(dead_code)]
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// True once the process has exited (or was never there).
    pub fn is_dead(&self) -> bool {
        if let Some(fd) = self.pidfd {
            let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd, zero timeout.
            let r = unsafe { libc::poll(&mut p, 1, 0) };
            return r > 0 && (p.revents & (libc::POLLIN | libc::POLLHUP)) != 0;
        }
        // SAFETY: signal 0 only checks existence.
        if unsafe { libc::kill(self.pid, 0) } != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
            return true;
        }
        match std::fs::read_to_string(format!("/proc/{}/stat", self.pid)) {
            Ok(s) => s.rsplit_once(')').map(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])).unwrap_or(false),
            Err(_) => true,
        }
    }
}

impl Drop for PeerWatch {
    fn drop(&mut self) {
        if let Some(fd) = self.pidfd {
            close(fd);
        }
    }
}

/// Sleep on a futex word in shared memory until it differs from `expected` or `timeout` passes.
pub(crate) fn futex_wait(word: &std::sync::atomic::AtomicU32, expected: u32, timeout: std::time::Duration) {
    let ts = libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as libc::c_long };
    // SAFETY: word points into a live shared mapping; FUTEX_WAIT (not PRIVATE) because the word is
    // shared between processes; the timeout is a valid timespec. Spurious wake-ups are fine: callers loop.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, expected, &ts as *const libc::timespec, 0usize, 0u32);
    }
}

/// Wake every process sleeping on `word`.
pub(crate) fn futex_wake_all(word: &std::sync::atomic::AtomicU32) {
    // SAFETY: word points into a live shared mapping.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX, 0usize, 0usize, 0u32);
    }
}

/// Number of CPUs this process may run on.
pub(crate) fn available_cpus() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}
