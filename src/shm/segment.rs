//! The shared-memory segment: every OS call of the shared-memory backend lives here
//! (`memfd_create`, `shm_open`/`open`, `ftruncate`, `posix_fallocate`, `mmap`, `unlink`,
//! `statvfs`, futexes, pidfds, `/proc`), each retried on `EINTR`.
//!
//! Two ways to get one:
//! * [`Segment::anonymous`]: a memfd mapped `MAP_SHARED` by a parent *before* it forks its ranks;
//!   children inherit the mapping, nothing is ever visible in `/dev/shm`. Its pages are charged to
//!   the kernel's internal shmem mount (and the memory cgroup), not to `/dev/shm`.
//! * [`Segment::create_named`] / [`Segment::open_named`]: for ranks exec'd separately that find each
//!   other by a job id ([`SegName`]): `/dev/shm/lockstep-<id>` through `shm_open`, or a file in
//!   `LOCKSTEP_SHM_DIR`. The name is unlinked as soon as every rank has mapped it (see
//!   `shm::bootstrap`), the CLI launcher unlinks it again at exit, and a later launch removes one
//!   whose creator is dead (`shm::stale`), so a crash leaves nothing behind.
//!
//! Mappings use `MAP_NORESERVE` and the file is sized with `ftruncate`, which reserves nothing: a
//! page the file system cannot supply when it is first touched kills the process with SIGBUS.
//! So every range the backend touches is backed first, by [`Segment::reserve`]
//! (`posix_fallocate`) or [`Segment::populate`] (`madvise(MADV_POPULATE_WRITE)`), both of which
//! fail cleanly instead: the control part of the segment at creation, each rank's staging slots
//! and each mailbox on first use (by every rank that touches it), the heap piece by piece as
//! buffers are handed out.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::comm::CommError;

/// Where named segments live unless `LOCKSTEP_SHM_DIR` says otherwise (`shm_open`'s directory).
pub(crate) const SHM_DIR: &str = "/dev/shm";

/// Where a segment's pages come from, for error messages.
#[derive(Debug, Clone)]
enum Backing {
    /// A memfd: the kernel's internal shmem mount, limited by the memory cgroup.
    Anonymous,
    /// A named segment in this directory.
    Dir(PathBuf),
}

/// One mapping of a shared segment, with its file descriptor (kept open to reserve heap ranges
/// later). Unmapped and closed on drop.
#[derive(Debug)]
pub(crate) struct Segment {
    base: *mut u8,
    len: usize,
    fd: Option<OwnedFd>,
    backing: Backing,
}

// SAFETY: the mapping is process-wide memory; synchronisation of its contents is the job of the
// protocol in `sync.rs` (atomics with release/acquire ordering).
unsafe impl Send for Segment {}
// SAFETY: as above; `Segment` itself holds no interior state besides the immutable base/len/fd.
unsafe impl Sync for Segment {}

fn os_err(call: impl Into<String>) -> CommError {
    CommError::Os {
        call: call.into(),
        source: io::Error::last_os_error(),
    }
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

fn map_fd(fd: libc::c_int, len: usize, writable: bool, what: &str) -> Result<*mut u8, CommError> {
    let prot = if writable {
        libc::PROT_READ | libc::PROT_WRITE
    } else {
        libc::PROT_READ
    };
    // SAFETY: mapping a valid fd with a fresh address chosen by the kernel; no existing memory is
    // affected. The result is checked against MAP_FAILED.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            prot,
            libc::MAP_SHARED | libc::MAP_NORESERVE,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(os_err(format!("mmap({what}, {len} bytes)")));
    }
    Ok(p as *mut u8)
}

/// Take ownership of a descriptor a successful libc call returned.
fn owned(fd: libc::c_int) -> OwnedFd {
    // SAFETY: fd is a fresh, valid descriptor (checked non-negative by the caller) owned by nobody else.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

fn truncate(fd: &OwnedFd, len: usize, what: &str) -> Result<(), CommError> {
    // SAFETY: plain syscall on an fd we own.
    let r = retry(|| unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) });
    if r != 0 {
        return Err(os_err(format!("ftruncate({what}, {len})")));
    }
    Ok(())
}

/// Size of a file, by descriptor.
fn file_len(fd: &OwnedFd, what: &str) -> Result<usize, CommError> {
    // SAFETY: zeroed stat is a valid out-parameter for fstat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fd is valid, st is a valid out-parameter.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(os_err(format!("fstat({what})")));
    }
    Ok(st.st_size.max(0) as usize)
}

/// Bytes available to unprivileged users in the file system holding `dir` (`statvfs`).
pub(crate) fn free_bytes(dir: &Path) -> Option<u64> {
    let c = CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: zeroed statvfs is a valid out-parameter.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid C string and out-parameter.
    if retry(|| unsafe { libc::statvfs(c.as_ptr(), &mut st) }) != 0 {
        return None;
    }
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// `n` bytes, with a readable unit.
pub(crate) fn show_bytes(n: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = "";
    for u in UNITS {
        if v < 1024.0 {
            break;
        }
        v /= 1024.0;
        unit = u;
    }
    if unit.is_empty() {
        format!("{n} bytes")
    } else {
        format!("{n} bytes ({v:.1} {unit})")
    }
}

/// A reservation the file system (or memory cgroup) refused.
#[derive(Debug)]
pub(crate) struct NoSpace {
    /// The directory of a named segment; `None` for an anonymous one (a memfd).
    pub dir: Option<PathBuf>,
    /// Bytes asked for.
    pub needed: u64,
    /// Bytes free in `dir` (`statvfs`).
    pub free: Option<u64>,
    /// The OS error (ENOSPC from a full tmpfs, ENOMEM from a memory cgroup, ...).
    pub source: io::Error,
}

impl std::fmt::Display for NoSpace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cannot reserve {} of shared memory ",
            show_bytes(self.needed)
        )?;
        match &self.dir {
            Some(d) => write!(f, "in {}", d.display())?,
            None => write!(
                f,
                "for an anonymous segment (a memfd, limited by this process's memory cgroup)"
            )?,
        }
        if let Some(free) = self.free {
            write!(f, ", which has {} free", show_bytes(free))?;
        }
        write!(f, " ({})", self.source)
    }
}

/// The name of a job's named segment: `lockstep-<job id>` in `/dev/shm` (through `shm_open`) or
/// in the directory `LOCKSTEP_SHM_DIR` names (through `open`).
#[derive(Debug, Clone)]
pub(crate) struct SegName {
    dir: Option<PathBuf>,
    file: String,
}

impl SegName {
    /// The segment name of `job_id` in `dir` (`None`: `/dev/shm`). A job id is a file name part:
    /// no `/`, no NUL, and short enough for one path component.
    pub fn new(dir: Option<&Path>, job_id: &str) -> Result<SegName, CommError> {
        let file = format!("lockstep-{job_id}");
        if job_id.is_empty() || job_id.contains(['/', '\0']) || file.len() > 255 {
            return Err(CommError::Setup(format!(
                "invalid job id {job_id:?}: it must be 1 to 246 bytes without '/' or NUL (check LOCKSTEP_JOB_ID)"
            )));
        }
        Ok(SegName {
            dir: dir.map(Path::to_path_buf),
            file,
        })
    }

    /// The directory holding the segment.
    pub fn dir(&self) -> &Path {
        self.dir.as_deref().unwrap_or(Path::new(SHM_DIR))
    }

    /// The segment's full path.
    pub fn path(&self) -> PathBuf {
        self.dir().join(&self.file)
    }

    /// `open`/`shm_open` with `flags` (plus `O_CLOEXEC | O_NOFOLLOW`); the raw result.
    fn open(&self, flags: libc::c_int, mode: libc::mode_t) -> libc::c_int {
        let flags = flags | libc::O_CLOEXEC | libc::O_NOFOLLOW;
        match &self.dir {
            None => {
                let Ok(name) = CString::new(format!("/{}", self.file)) else {
                    return -1;
                };
                // SAFETY: valid C string, constant flags and mode.
                retry(|| unsafe { libc::shm_open(name.as_ptr(), flags, mode) })
            }
            Some(_) => {
                let Ok(path) = CString::new(self.path().as_os_str().as_bytes()) else {
                    return -1;
                };
                // SAFETY: valid C string, constant flags and mode.
                retry(|| unsafe { libc::open(path.as_ptr(), flags, mode as libc::c_uint) })
            }
        }
    }

    /// Remove the name. Returns whether it existed.
    pub fn unlink(&self) -> bool {
        let r = match &self.dir {
            None => match CString::new(format!("/{}", self.file)) {
                // SAFETY: valid C string.
                Ok(name) => unsafe { libc::shm_unlink(name.as_ptr()) },
                Err(_) => return false,
            },
            Some(_) => match CString::new(self.path().as_os_str().as_bytes()) {
                // SAFETY: valid C string.
                Ok(path) => unsafe { libc::unlink(path.as_ptr()) },
                Err(_) => return false,
            },
        };
        r == 0
    }
}

impl std::fmt::Display for SegName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.path().display())
    }
}

impl Segment {
    /// Create an anonymous segment (memfd) of `len` bytes, zero-filled, to be inherited across
    /// fork. Nothing is reserved yet: see [`reserve`](Self::reserve).
    pub fn anonymous(len: usize) -> Result<Segment, CommError> {
        let name = CString::new("lockstep-shm").expect("static name");
        // SAFETY: name is a valid C string; flags are constants.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(os_err("memfd_create"));
        }
        let fd = owned(fd);
        truncate(&fd, len, "memfd")?;
        let base = map_fd(fd.as_raw_fd(), len, true, "memfd")?;
        Ok(Segment {
            base,
            len,
            fd: Some(fd),
            backing: Backing::Anonymous,
        })
    }

    /// Create the named segment `name` of `len` bytes (`O_CREAT | O_EXCL | O_NOFOLLOW`, mode 0600).
    /// Fails with an `Os` error of kind `AlreadyExists` when that name exists: another job with the
    /// same id, or a leftover. On any other failure the name is removed again. Nothing is reserved
    /// yet: see [`reserve`](Self::reserve).
    pub fn create_named(name: &SegName, len: usize) -> Result<Segment, CommError> {
        let fd = name.open(libc::O_RDWR | libc::O_CREAT | libc::O_EXCL, 0o600);
        if fd < 0 {
            return Err(os_err(format!("creating {name} (O_CREAT|O_EXCL)")));
        }
        let fd = owned(fd);
        let made = truncate(&fd, len, &name.to_string())
            .and_then(|_| map_fd(fd.as_raw_fd(), len, true, &name.to_string()));
        match made {
            Ok(base) => Ok(Segment {
                base,
                len,
                fd: Some(fd),
                backing: Backing::Dir(name.dir().to_path_buf()),
            }),
            Err(e) => {
                name.unlink();
                Err(e)
            }
        }
    }

    /// Open an existing named segment read-write, mapping all of it. Returns `Ok(None)` while it
    /// does not exist yet or is shorter than `min_len` (the creator has not finished `ftruncate`).
    pub fn open_named(name: &SegName, min_len: usize) -> Result<Option<Segment>, CommError> {
        Segment::open_existing(name, min_len, true)
    }

    /// Map the first `len` bytes of an existing named segment read-only (to read its header
    /// without joining). `Ok(None)` when it does not exist or is shorter.
    pub fn peek_named(name: &SegName, len: usize) -> Result<Option<Segment>, CommError> {
        Segment::open_existing(name, len, false)
    }

    fn open_existing(
        name: &SegName,
        min_len: usize,
        join: bool,
    ) -> Result<Option<Segment>, CommError> {
        let fd = name.open(if join { libc::O_RDWR } else { libc::O_RDONLY }, 0);
        if fd < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENOENT) {
                return Ok(None);
            }
            return Err(CommError::Os {
                call: format!("opening {name}"),
                source: e,
            });
        }
        let fd = owned(fd);
        let len = file_len(&fd, &name.to_string())?;
        if len < min_len {
            return Ok(None);
        }
        let map_len = if join { len } else { min_len };
        let base = map_fd(fd.as_raw_fd(), map_len, join, &name.to_string())?;
        // A peek never reserves: it lets its descriptor go at once.
        let fd = if join { Some(fd) } else { None };
        Ok(Some(Segment {
            base,
            len: map_len,
            fd,
            backing: Backing::Dir(name.dir().to_path_buf()),
        }))
    }

    /// Back `[off, off+len)` of the segment with memory now (`posix_fallocate`), so touching it
    /// later cannot raise SIGBUS. Already reserved pages cost nothing.
    pub fn reserve(&self, off: usize, len: usize) -> Result<(), NoSpace> {
        let end = (off.saturating_add(len))
            .min(self.len)
            .next_multiple_of(4096);
        let off = off - off % 4096;
        if end <= off {
            return Ok(());
        }
        let no_fd = || {
            io::Error::new(
                io::ErrorKind::Unsupported,
                "the segment was mapped without its descriptor",
            )
        };
        let r = match &self.fd {
            Some(fd) => loop {
                // SAFETY: plain syscall on an fd we own; posix_fallocate returns the error number.
                let r = unsafe {
                    libc::posix_fallocate(
                        fd.as_raw_fd(),
                        off as libc::off_t,
                        (end - off) as libc::off_t,
                    )
                };
                if r != libc::EINTR {
                    break if r == 0 {
                        Ok(())
                    } else {
                        Err(io::Error::from_raw_os_error(r))
                    };
                }
            },
            None => Err(no_fd()),
        };
        r.map_err(|source| {
            let dir = match &self.backing {
                Backing::Anonymous => None,
                Backing::Dir(d) => Some(d.clone()),
            };
            let free = dir.as_deref().and_then(free_bytes);
            NoSpace {
                dir,
                needed: (end - off) as u64,
                free,
                source,
            }
        })
    }

    /// Whether the file system holding this named segment has `needed` bytes free (`fstatvfs`),
    /// without allocating them: a refusal names the directory and what it has free. Creation
    /// checks the whole fixed part this way and reserves only what every rank touches at once,
    /// so that a job never pays for memory it does not use (slots and mailboxes are mapped, and
    /// so allocated, on first use: see [`populate`](Self::populate)). Nothing is checked for an
    /// anonymous segment, nor for a file system that reports no size (a tmpfs mounted with
    /// `size=0`, which has no limit): the caller reserves what it needs instead.
    pub fn check_room(&self, needed: usize) -> Result<(), NoSpace> {
        let (Backing::Dir(dir), Some(fd)) = (&self.backing, &self.fd) else {
            return Ok(());
        };
        // SAFETY: zeroed statvfs is a valid out-parameter.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: a descriptor we own and a valid out-parameter.
        if retry(|| unsafe { libc::fstatvfs(fd.as_raw_fd(), &mut st) }) != 0 || st.f_blocks == 0 {
            // No answer, or no limit: the first use of a range reports a shortage (populate).
            return Ok(());
        }
        let free = (st.f_bavail as u64).saturating_mul(st.f_frsize as u64);
        if free >= needed as u64 {
            return Ok(());
        }
        Err(NoSpace {
            dir: Some(dir.clone()),
            needed: needed as u64,
            free: Some(free),
            source: io::Error::from_raw_os_error(libc::ENOSPC),
        })
    }

    /// Whether this is a named segment (in `/dev/shm` or `LOCKSTEP_SHM_DIR`), not a memfd.
    pub fn is_named(&self) -> bool {
        matches!(self.backing, Backing::Dir(_))
    }

    /// A read-only descriptor of the same file, through `/proc/self/fd` (what `lockstep status`
    /// opens from another process).
    #[cfg(test)]
    pub fn reopen_read_only(&self) -> Option<std::fs::File> {
        let fd = self.fd.as_ref()?;
        std::fs::File::open(format!("/proc/self/fd/{}", fd.as_raw_fd())).ok()
    }

    /// Base address of the mapping.
    pub fn base(&self) -> *mut u8 {
        self.base
    }

    /// Length of the mapping in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Back `[off, off+len)` with memory and map it writable in this process now, so neither a
    /// SIGBUS (no room) nor a page fault can happen there later; an error (no room) instead.
    /// Safe to call while other processes use the range (nothing is written), and again (pages
    /// already there cost little).
    ///
    /// One `madvise(MADV_POPULATE_WRITE)` (Linux 5.14+) maps the pages (allocating those not
    /// reserved yet) in one pass, and fails with an error rather than a SIGBUS. Touching the pages
    /// instead took a read fault (with fault-around) and then a write-protect fault per page:
    /// with 8 ranks about 4 000 faults, the largest part of a job's start-up CPU time. Older
    /// kernels, and any failure (whose cause [`reserve`](Self::reserve) then reports), only
    /// reserve the range: no SIGBUS either, and the pages fault in on first touch. (Touching them
    /// here is not safe once the range is in use: a peer's store could fall between the read and
    /// the write back of a byte.)
    pub fn populate(&self, off: usize, len: usize) -> Result<(), NoSpace> {
        let end = (off.saturating_add(len))
            .min(self.len)
            .next_multiple_of(4096)
            .min(self.len);
        let start = off - off % 4096;
        if end <= start {
            return Ok(());
        }
        // SAFETY: [start, end) lies inside our mapping (page-aligned: the mapping is); populating
        // changes no byte (new pages of a shared file mapping read as zero either way).
        let r = unsafe {
            libc::madvise(
                self.base.add(start) as *mut libc::c_void,
                end - start,
                libc::MADV_POPULATE_WRITE,
            )
        };
        if r == 0 {
            return Ok(());
        }
        self.reserve(start, end - start)
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: base/len describe a mapping we created and nobody uses after drop (all users hold
        // an Arc<Segment>). The descriptor closes with `fd`.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
    }
}

/// Start time of process `pid` in clock ticks since boot (field 22 of `/proc/<pid>/stat`), and
/// whether it has exited (zombie). `None` when there is no such process (in this pid namespace).
pub(crate) fn proc_start(pid: i32) -> Option<(u64, bool)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = s.rsplit_once(')')?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // `rest` starts at field 3 (state); field 22 is starttime.
    let start = f.get(19)?.parse().ok()?;
    Some((
        start,
        f.first().is_some_and(|st| st.starts_with(['Z', 'X'])),
    ))
}

/// Inode of this process's pid namespace (`/proc/self/ns/pid`): pids mean the same thing to two
/// processes only when theirs are equal. 0 when unknown.
pub(crate) fn pid_namespace() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid")
        .map(|m| m.ino())
        .unwrap_or(0)
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
        PeerWatch {
            pid,
            pidfd: if fd >= 0 {
                Some(fd as libc::c_int)
            } else {
                None
            },
        }
    }

    /// The watched pid.
    #[allow(dead_code)]
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// True once the process has exited (or was never there).
    pub fn is_dead(&self) -> bool {
        if let Some(fd) = self.pidfd {
            let mut p = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd, zero timeout.
            let r = unsafe { libc::poll(&mut p, 1, 0) };
            return r > 0 && (p.revents & (libc::POLLIN | libc::POLLHUP)) != 0;
        }
        // SAFETY: signal 0 only checks existence.
        if unsafe { libc::kill(self.pid, 0) } != 0
            && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
        {
            return true;
        }
        match std::fs::read_to_string(format!("/proc/{}/stat", self.pid)) {
            Ok(s) => s
                .rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with(['Z', 'X']))
                .unwrap_or(false),
            Err(_) => true,
        }
    }
}

impl Drop for PeerWatch {
    fn drop(&mut self) {
        if let Some(fd) = self.pidfd {
            // SAFETY: the pidfd is ours and not used after drop.
            unsafe { libc::close(fd) };
        }
    }
}

/// Sleep on a futex word in shared memory until it differs from `expected` or `timeout` passes.
pub(crate) fn futex_wait(
    word: &std::sync::atomic::AtomicU32,
    expected: u32,
    timeout: std::time::Duration,
) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: word points into a live shared mapping; FUTEX_WAIT (not PRIVATE) because the word is
    // shared between processes; the timeout is a valid timespec. Spurious wake-ups are fine: callers loop.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            0usize,
            0u32,
        );
    }
}

/// `CLOCK_MONOTONIC_COARSE` in nanoseconds: the kernel's last tick, read from the vDSO page
/// without a system call or a counter read (a few nanoseconds), to the tick's resolution (1 to
/// 4 ms). The same clock in every process of the machine. 0 if the clock is unavailable.
pub(crate) fn coarse_now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-parameter; the clock id is a constant.
    if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) } != 0 {
        return 0;
    }
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// Wake every process sleeping on `word`.
pub(crate) fn futex_wake_all(word: &std::sync::atomic::AtomicU32) {
    // SAFETY: word points into a live shared mapping.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            0usize,
            0usize,
            0u32,
        );
    }
}

/// Number of CPUs this process may run on: its affinity mask, one system call. Not std's
/// `available_parallelism`, which also reads the cgroup's CPU quota: under cgroup v1 that parses
/// `/proc/self/mountinfo`, far dearer than the one system call, and paid by every rank of a
/// launch (`benches/baselines/startup.sh` times launches). Ranks use the count only to choose how long to spin; the launcher, which
/// reads the quota once, warns when ranks outnumber the CPUs.
pub(crate) fn available_cpus() -> usize {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity writes at most its size.
    let counted = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        (libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0)
            .then(|| libc::CPU_COUNT(&set) as usize)
    };
    match counted {
        Some(n) if n > 0 => n,
        // More CPUs than a cpu_set_t holds (EINVAL): std asks with a larger set.
        _ => std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
    }
}

/// The CPUs this thread may run on, as a list of ranges (`0-3,8`), or `?` when it cannot tell:
/// what the rank was bound to (`LOCKSTEP_CPU_BIND`), for the init line.
pub(crate) fn affinity_text() -> String {
    // SAFETY: as in `available_cpus`.
    let set = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return "?".into();
        }
        set
    };
    // SAFETY: CPU_ISSET reads a valid set for indexes below CPU_SETSIZE.
    let on: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect();
    crate::types::ranges_text(&on, ",")
}

/// What to change when a segment's file system (or cgroup) has no room: named for `e`'s place.
pub(crate) fn room_hint(e: &NoSpace) -> String {
    match &e.dir {
        Some(d) if d == Path::new(SHM_DIR) => {
            format!("give {SHM_DIR} more room (Docker: --shm-size=1g), or set LOCKSTEP_SHM_DIR to a directory on a larger tmpfs")
        }
        Some(d) => format!(
            "give {} more room (a larger tmpfs), or point LOCKSTEP_SHM_DIR elsewhere",
            d.display()
        ),
        None => "raise the memory limit of this process's cgroup".to_string(),
    }
}

/// The error for memory of the fixed part that could not be mapped on first use (`what`: the
/// rank's staging slots, a mailbox), although there was room at creation: something else has
/// filled the file system (or the memory cgroup) since.
pub(crate) fn no_room_now(e: &NoSpace, what: &str) -> CommError {
    CommError::Unsupported(format!(
        "{e}: {what} are mapped on first use and there is no room for them any more (the file system had room when the segment was created; something else has filled it since). Free shared memory, or {}",
        room_hint(e)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The affinity count is what std reports, or more when a cgroup quota lowers std's figure
    /// (std reads the quota, the affinity mask does not); never zero.
    #[test]
    fn available_cpus_counts_the_affinity_mask() {
        let std_count = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        let n = available_cpus();
        assert!(
            n >= 1 && n >= std_count,
            "available_cpus {n}, std {std_count}"
        );
    }

    /// Minor page faults of the calling thread so far (of this thread only: the unit tests run
    /// in parallel threads of one process, whose faults must not count).
    fn minor_faults() -> i64 {
        // SAFETY: getrusage with a valid out-pointer to a zeroed struct.
        unsafe {
            let mut u: libc::rusage = std::mem::zeroed();
            libc::getrusage(libc::RUSAGE_THREAD, &mut u);
            u.ru_minflt
        }
    }

    #[test]
    fn populated_pages_are_backed_mapped_and_zero() {
        let seg = Segment::anonymous(64 << 20).unwrap();
        let (off, len) = (8 << 20, 4 << 20);
        seg.populate(off + 100, len - 100).unwrap();
        let before = minor_faults();
        let mut sum = 0u64;
        for o in (off..off + len).step_by(4096) {
            // SAFETY: inside the mapping, populated above; nobody else uses it.
            unsafe {
                let p = seg.base().add(o);
                sum += std::ptr::read_volatile(p) as u64;
                std::ptr::write_volatile(p, 1);
            }
        }
        // 1024 pages written without faulting (a few faults of this thread's own stack or allocator are noise).
        assert!(
            minor_faults() - before < 64,
            "{} faults on populated pages",
            minor_faults() - before
        );
        assert_eq!(sum, 0);
        // Out-of-range and empty requests are clamped, not errors.
        seg.populate(seg.len() - 10, 4096).unwrap();
        seg.populate(0, 0).unwrap();
    }
}
