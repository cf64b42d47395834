//! The guard: a small process between the launcher and each rank, so that nothing a rank started
//! outlives the launcher, however the launcher dies (`kill -9` included).
//!
//! ```text
//! launcher ──fork──▶ guard (child subreaper) ──▶ rank: an exec'd program (clone + execve, as
//!    │                    │                         posix_spawn does), or the rank function (fork)
//!    │  control pipe ──▶ │   signals to forward; end of file = the launcher is gone
//!    │ ◀── report pipe   │   FORKED(rank pid), then START(rank pid) | SPAWN_FAILED(errno)
//!    │                    │   | GROUP_FAILED(errno), then EXIT(wait status)
//! ```
//!
//! * The guard is forked (not exec'd) from the launcher and, like code between fork and exec,
//!   runs only async-signal-safe system calls: no allocation, no locks (the launcher may have
//!   other threads). Everything it needs (argv, envp, paths) is prepared before the fork.
//! * It is a child subreaper (`PR_SET_CHILD_SUBREAPER`): whatever the rank starts and abandons
//!   (double forks, daemons, `setsid`) is re-parented to the guard, not to init, so every
//!   descendant of the rank stays a descendant of the guard.
//! * The rank dies with its guard (`PR_SET_PDEATHSIG`), and the guard notices the launcher's
//!   death through the control pipe: the launcher holds its only write end, so its death, by any
//!   signal, closes it. The guard then SIGKILLs its whole subtree (its direct children, again and
//!   again as orphans are re-parented to it, until it has none) and removes the job's named
//!   shared-memory segment.
//! * When the rank exits, the guard reports its wait status and SIGKILLs whatever the rank left
//!   behind, then exits. A SIGKILL request from the launcher (the end of a grace period) kills
//!   the whole subtree the same way; other signals go to the rank only (the launcher also signals
//!   the ranks' process group, which reaches descendants that stayed in it).
//! * The ranks of `lockstep launch` share one process group, led by rank 0, so one signal to
//!   the group reaches everything they started. A group lives while it has a member, a zombie
//!   included: rank 0's guard keeps its rank unreaped until the launcher says every rank has
//!   joined, so a rank 0 that ends at once cannot take the group with it. A rank that cannot
//!   join is reported (GROUP_FAILED) and does not run.
//! * The guard stays in the launcher's process group and ignores the job-control and
//!   termination signals a terminal or `kill` of the group sends (INT, QUIT, TERM, HUP, TSTP,
//!   TTIN, TTOU): the launcher decides what the ranks get. Its stdio is /dev/null, so it never
//!   keeps the launcher's output pipes open.
//!
//! What escapes: a process handed to someone else (a request to a daemon such as `systemd-run`,
//! `at`, `ssh`, a container runtime), a process that changes its user id so the guard may no
//! longer signal it, a process in uninterruptible sleep (it dies when it wakes up), and the
//! subtree of a guard that is itself SIGKILLed by hand (the rank dies with it; the rank's children
//! are re-parented to init). A descendant that calls `setsid` stays in the subtree: sessions and
//! process groups do not change who its parent is.

use std::ffi::{CStr, CString, OsString};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;

use super::child::{pipe, Exit};

/// Report records, each `[tag, value]` as two native-endian `i32` (one atomic pipe write).
/// FORKED comes first, as soon as the rank process exists (its process group too, when it leads
/// one), so the launcher can start the next ranks without waiting for this one to run. (An exec'd
/// rank exists for the guard once its `execve` has begun: see [`spawn_exec_rank`].)
const FORKED: i32 = 4;
const START: i32 = 1;
const SPAWN_FAILED: i32 = 2;
const EXIT: i32 = 3;
/// The rank could not join the process group it was given (value: errno); it did not start.
const GROUP_FAILED: i32 = 5;
const RECORD: usize = 8;

/// Set in the four bytes an exec'd rank writes to the exec error pipe when the failure was its
/// `setpgid`, not its `execve` (errno values are far below it).
const GROUP_ERR_FLAG: i32 = 1 << 30;

/// How often (ms) the launcher looks at a guard that has not reported its starting rank yet.
const START_CHECK_MS: i32 = 1000;

/// The control byte that releases a held group leader (see [`RankSetup::hold_leader`]). Every
/// other byte is a signal number for the rank, and signal 0 is never one to forward.
const RELEASE: u8 = 0;

/// Signals the guard ignores (see the module docs); restored in the rank.
const IGNORED: [libc::c_int; 8] = [
    libc::SIGINT,
    libc::SIGQUIT,
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGTSTP,
    libc::SIGTTIN,
    libc::SIGTTOU,
    libc::SIGPIPE,
];

/// A program prepared for `execve` in the rank: every string built before the fork.
pub(crate) struct ExecImage {
    path: CString,
    _argv: Vec<CString>,
    argv_ptrs: Vec<*const libc::c_char>,
    _envp: Vec<CString>,
    envp_ptrs: Vec<*const libc::c_char>,
}

impl ExecImage {
    /// `program args`, found on `PATH` when it has no `/`, with this process's environment plus
    /// `env` (which overrides).
    pub fn new(program: &[OsString], env: &[(String, String)]) -> std::io::Result<ExecImage> {
        let (first, _) = program
            .split_first()
            .ok_or_else(|| std::io::Error::other("no program given"))?;
        let cstr = |b: &[u8]| {
            CString::new(b)
                .map_err(|_| std::io::Error::other("an argument or variable contains a NUL byte"))
        };
        let path = cstr(resolve(first)?.as_os_str().as_bytes())?;
        let argv: Vec<CString> = program
            .iter()
            .map(|a| cstr(a.as_bytes()))
            .collect::<Result<_, _>>()?;
        let mut envp = Vec::new();
        for (k, v) in std::env::vars_os() {
            if env.iter().all(|(n, _)| n.as_bytes() != k.as_bytes()) {
                let mut kv = k.as_bytes().to_vec();
                kv.push(b'=');
                kv.extend_from_slice(v.as_bytes());
                envp.push(cstr(&kv)?);
            }
        }
        for (k, v) in env {
            envp.push(cstr(format!("{k}={v}").as_bytes())?);
        }
        let ptrs = |v: &[CString]| {
            v.iter()
                .map(|c| c.as_ptr())
                .chain(std::iter::once(std::ptr::null()))
                .collect()
        };
        Ok(ExecImage {
            argv_ptrs: ptrs(&argv),
            envp_ptrs: ptrs(&envp),
            path,
            _argv: argv,
            _envp: envp,
        })
    }
}

/// `program` as a path: itself when it contains a `/`, else the first executable file of that
/// name on `PATH` (what `execvp` would run).
fn resolve(program: &OsString) -> std::io::Result<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    if program.as_bytes().contains(&b'/') {
        return Ok(program.into());
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
    for dir in std::env::split_paths(&path) {
        let p = if dir.as_os_str().is_empty() {
            std::path::PathBuf::from(".")
        } else {
            dir
        }
        .join(program);
        if std::fs::metadata(&p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0) {
            return Ok(p);
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::NotFound,
        format!("{} not found on PATH", program.to_string_lossy()),
    ))
}

/// How to set up the rank process.
pub(crate) struct RankSetup<'a> {
    /// Process group: `Some(0)` leads a new one, `Some(g)` joins `g` (or leads a new one when
    /// `g` is gone), `None` stays in the guard's.
    pub pgid: Option<i32>,
    /// The group to join comes later, through the control pipe ([`Pending::tell_group`]): the
    /// guard waits for it before it starts the rank, so that the launcher can fork this guard
    /// while the group's leader (rank 0) is still being started.
    pub pgid_from_launcher: bool,
    /// The rank leads a group that other ranks join after it has started: the guard keeps it
    /// unreaped once it exits (a zombie still holds its process group) until the launcher
    /// releases it ([`Guard::release`]), asks for a SIGKILL, or dies. Its exit is still reported
    /// at once. Without this, a rank 0 that ends at once takes the group with it and the ranks
    /// that join later find none.
    pub hold_leader: bool,
    /// stdout and stderr through pipes to the launcher.
    pub capture: bool,
    /// stdin from /dev/null.
    pub stdin_null: bool,
    /// Descriptors of the launcher that neither the guard nor the rank may keep: other ranks'
    /// pipes and log files, the launcher's own ends of this rank's pipes (needed by the library
    /// launcher, whose ranks do not exec and so keep what close-on-exec would close).
    pub close: &'a [RawFd],
    /// The program to exec; `None` runs the body instead.
    pub exec: Option<&'a ExecImage>,
    /// Path of the job's named shared-memory segment, removed when the launcher dies.
    pub unlink_on_launcher_death: Option<&'a CStr>,
}

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
                match super::child::proc_state(self.pid) {
                    Some('T') | Some('t') if !continued => {
                        tracing::warn!("the guard (pid {}) of a starting rank is stopped: continuing it (SIGCONT)", self.pid);
                        super::child::kill(self.pid, libc::SIGCONT);
                        continued = true;
                    }
                    Some('T') | Some('t') => {
                        tracing::warn!("the guard (pid {}) of a starting rank still does not answer: killing it", self.pid);
                        super::child::kill(self.pid, libc::SIGKILL);
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
        super::child::reap_blocking(pid);
    }

    /// The guard reported a failure or closed its report pipe: reap it, and say why.
    fn failed(&self, r: Option<(i32, i32)>) -> std::io::Error {
        // The guard exits right after a failure report (or died).
        super::child::reap_blocking(self.pid);
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
    super::child::set_nonblocking(fd);
}

/// The guard's descriptors (raw numbers: the guard must not run destructors).
struct GuardFds {
    rep_w: RawFd,
    ctl_r: RawFd,
    null: RawFd,
    out_w: RawFd,
    err_w: RawFd,
    exec_r: RawFd,
    exec_w: RawFd,
}

fn close_raw(fd: RawFd) {
    if fd >= 0 {
        // SAFETY: close(2) on a descriptor number; async-signal-safe.
        unsafe { libc::close(fd) };
    }
}

fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// Write one report record (EINTR retried; errors ignored: the launcher may be gone).
fn report(fd: RawFd, tag: i32, val: i32) {
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
fn exit_now(code: i32) -> ! {
    // SAFETY: _exit is async-signal-safe and ends the process.
    unsafe { libc::_exit(code) }
}

extern "C" fn on_sigchld(_: libc::c_int) {}

/// Saved signal state of the launcher, restored in the rank.
struct Saved {
    actions: [libc::sigaction; IGNORED.len() + 1],
    mask: libc::sigset_t,
}

fn guard_main(setup: &RankSetup, fds: &GuardFds, launcher: i32, body: impl FnOnce()) -> ! {
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

/// The rank process of a forked rank: restore what the guard changed, set up stdio, group and
/// parent-death signal, then run the body.
fn rank_main(
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
fn spawn_exec_rank(
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

/// SIGKILL every direct child of `me` (found in /proc); returns how many were signalled.
/// Children's children become ours when their parents die, so calling this until no child is
/// left reaches the whole subtree.
fn kill_children(me: i32) -> usize {
    // SAFETY: open/getdents64/close on our own buffers; async-signal-safe system calls.
    let dir = unsafe {
        libc::open(
            c"/proc".as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if dir < 0 {
        return 0;
    }
    let mut killed = 0;
    let mut buf = [0u8; 4096];
    loop {
        // SAFETY: getdents64 into a valid buffer of the given length.
        let n = unsafe { libc::syscall(libc::SYS_getdents64, dir, buf.as_mut_ptr(), buf.len()) };
        if n <= 0 {
            break;
        }
        let mut off = 0usize;
        while off + 19 < n as usize {
            // struct linux_dirent64 { u64 d_ino; i64 d_off; u16 d_reclen; u8 d_type; char d_name[]; }
            let reclen = u16::from_ne_bytes([buf[off + 16], buf[off + 17]]) as usize;
            if reclen == 0 {
                break;
            }
            let name = &buf[off + 19..(off + reclen).min(n as usize)];
            if let Some(pid) = parse_pid(name) {
                if pid != me && ppid_of(pid) == Some(me) {
                    // SAFETY: kill(2); the pid is our child (a zombie at worst), so not reused.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                    killed += 1;
                }
            }
            off += reclen;
        }
    }
    close_raw(dir);
    killed
}

/// A NUL-terminated decimal pid.
fn parse_pid(name: &[u8]) -> Option<i32> {
    let mut v: i32 = 0;
    let mut any = false;
    for &b in name {
        match b {
            0 => break,
            b'0'..=b'9' => {
                v = v.checked_mul(10)?.checked_add((b - b'0') as i32)?;
                any = true;
            }
            _ => return None,
        }
    }
    any.then_some(v)
}

/// The parent pid in `/proc/<pid>/stat` (the field after the state, after the last `)`).
fn ppid_of(pid: i32) -> Option<i32> {
    let mut path = [0u8; 32];
    let prefix = b"/proc/";
    path[..prefix.len()].copy_from_slice(prefix);
    let mut i = prefix.len();
    let mut digits = [0u8; 11];
    let mut nd = 0;
    let mut p = pid;
    loop {
        digits[nd] = b'0' + (p % 10) as u8;
        nd += 1;
        p /= 10;
        if p == 0 {
            break;
        }
    }
    for k in (0..nd).rev() {
        path[i] = digits[k];
        i += 1;
    }
    path[i..i + 5].copy_from_slice(b"/stat");
    // (path[i + 5] is the terminating NUL.)
    // SAFETY: open/read/close with a NUL-terminated path and a valid buffer.
    let (n, buf) = unsafe {
        let fd = libc::open(
            path.as_ptr() as *const libc::c_char,
            libc::O_RDONLY | libc::O_CLOEXEC,
        );
        if fd < 0 {
            return None;
        }
        let mut buf = [0u8; 512];
        let n = libc::read(fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len());
        libc::close(fd);
        (n, buf)
    };
    if n <= 0 {
        return None;
    }
    let s = &buf[..n as usize];
    let close = s.iter().rposition(|&b| b == b')')?;
    // ") S 1234 ..."
    let rest = s.get(close + 4..)?;
    let end = rest.iter().position(|&b| b == b' ')?;
    parse_pid(&rest[..end])
}

/// Close every descriptor from 3 up except those in `keep` (negative entries ignored).
fn close_all_but(keep: &[RawFd]) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pids_and_reports() {
        assert_eq!(parse_pid(b"1234\0junk"), Some(1234));
        assert_eq!(parse_pid(b"self\0"), None);
        assert_eq!(parse_pid(b"\0"), None);
        // SAFETY: getpid/getppid have no preconditions.
        let (me, parent) = unsafe { (libc::getpid(), libc::getppid()) };
        assert_eq!(ppid_of(me), Some(parent));
        let mut buf = Vec::new();
        for (t, v) in [(START, 42i32), (EXIT, 3 << 8)] {
            buf.extend_from_slice(&t.to_ne_bytes());
            buf.extend_from_slice(&v.to_ne_bytes());
        }
        buf.push(7); // half a record waits
        assert_eq!(parse_reports(&mut buf), Some(Exit::Code(3)));
        assert_eq!(buf, vec![7]);
    }

    #[test]
    fn resolve_finds_programs_on_path() {
        assert!(resolve(&"sh".into()).is_ok_and(|p| p.is_absolute() || p.starts_with(".")));
        assert!(resolve(&"no-such-program-lockstep".into()).is_err());
        assert_eq!(
            resolve(&"./x".into()).unwrap(),
            std::path::PathBuf::from("./x")
        );
    }
}
