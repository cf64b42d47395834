//! The supervision loop shared by the library launcher and the CLI: one thread polls every rank's
//! output pipes, result pipe and its guard's report pipe (plus the CLI's signal pipe), notes
//! exited ranks, and on the first failure terminates the others (SIGTERM, then SIGKILL after the
//! grace period). With `LOCKSTEP_TRACE_DIR` set, the others first get SIGUSR1 and up to
//! [`TRACE_WAIT`] to write their flight recorders: a rank that was computing, not waiting in a
//! call, when a peer failed has no failure of its own to write its record on, and its record is
//! the one that shows where it was.
//!
//! Signals (CLI only): the first SIGINT, SIGTERM or SIGHUP starts the stop: SIGINT and SIGTERM
//! are forwarded as they are, SIGHUP (a closed terminal or ssh session) as SIGTERM, and SIGKILL
//! follows after the grace period. A further SIGINT or SIGTERM kills every rank at once; further
//! hang-ups do not (a closing terminal may deliver several). SIGUSR1 goes to every live rank, to
//! have it write its flight recorder (`crate::trace`), when `LOCKSTEP_TRACE_DIR` is set.
//!
//! Why one poll loop and no threads: the library launcher runs in the host process that forked
//! the ranks, which must stay free of helper threads between launches, and a single loop makes
//! the order of events (which rank failed first) the order the loop saw them. Each rank's guard
//! (`guard/`) reports the rank's exit through a pipe the moment it happens, even while the
//! rank's output pipes are still held open by a grandchild, on every kernel.

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use super::child::{self, Exit, ReadState};
use super::guard::{self, Guard, Guarded};
use super::output::{RankOutput, Stream};
use super::report::RankFailure;
use super::signals::{Counts, SignalPipe};

/// How long the launcher waits, once every rank has exited, for the guards to finish killing
/// what the ranks left behind.
pub(crate) const GUARD_CLEANUP: Duration = Duration::from_secs(5);

/// How long a stop after a failure waits for the live ranks to write their flight recorders
/// (`LOCKSTEP_TRACE_DIR` set) before it terminates them; it goes on as soon as every one has.
pub(crate) const TRACE_WAIT: Duration = Duration::from_secs(1);

/// The live ranks a stop after a failure asked for their flight recorders (SIGUSR1): when, and
/// each rank's world trace file as it was then (its device and inode: a dump replaces the file,
/// so a new inode means this rank has written; mtimes are too coarse to order against `at`).
struct TraceRequest {
    at: Instant,
    /// Per rank asked: its index in `procs`, its world trace file, and that file's id then.
    files: Vec<(usize, std::path::PathBuf, Option<FileId>)>,
}

/// A file's device and inode.
type FileId = (u64, u64);

impl TraceRequest {
    /// SIGUSR1 to every live rank, when `LOCKSTEP_TRACE_DIR` is set (the ranks have a handler
    /// only then: without it the signal would kill them).
    fn send(procs: &mut [Proc]) -> Option<TraceRequest> {
        if !cfg!(feature = "trace") {
            return None; // the ranks write no files
        }
        let dir = crate::trace::trace_dir()?;
        let mut files = Vec::new();
        for (i, p) in procs.iter_mut().enumerate() {
            if p.status.is_none() {
                let f = dir.join(crate::trace::world_file_name(p.rank));
                files.push((i, f.clone(), file_id(&f)));
                p.terminated = true;
                p.signal(libc::SIGUSR1);
            }
        }
        tracing::info!(
            "asked {} live ranks to write their last calls to {} before stopping them",
            files.len(),
            dir.display()
        );
        Some(TraceRequest {
            at: Instant::now(),
            files,
        })
    }

    /// Every rank asked has written its file (and is writing no other: one that had just
    /// written its own failure's record writes again) or exited, or the wait is over.
    fn done(&self, procs: &[Proc]) -> bool {
        if self.at.elapsed() >= TRACE_WAIT {
            return true;
        }
        let writing = self.writers();
        self.files.iter().all(|(i, f, before)| {
            let p = &procs[*i];
            p.status.is_some()
                || (file_id(f).is_some_and(|id| Some(id) != *before) && !writing.contains(&p.pid))
        })
    }

    /// The processes with a temporary (a write under way) in the directory.
    fn writers(&self) -> Vec<i32> {
        let dir = self.files.first().and_then(|(_, f, _)| f.parent());
        dir.and_then(|d| std::fs::read_dir(d).ok())
            .map(|rd| {
                rd.flatten()
                    .filter_map(|e| crate::types::durable::temp_writer(&e.file_name()))
                    .collect()
            })
            .unwrap_or_default()
    }
}

fn file_id(f: &std::path::Path) -> Option<FileId> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(f)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

/// How long the launcher waits for a guard's report of a rank that has exited before it looks
/// at the guard (stopped by SIGSTOP or a debugger, a stopped guard never reports), and again
/// after continuing it before it kills the guard.
const GUARD_ANSWER: Duration = Duration::from_secs(1);

/// How often the launcher checks for ranks that exited unreported.
const GUARD_CHECK_EVERY: Duration = Duration::from_millis(200);

/// How long the launcher waits, when a rank fails, for the exit report of another rank that has
/// already exited (its guard reports right after reaping it).
const EXIT_REPORT_WAIT: Duration = Duration::from_millis(200);

/// One supervised rank.
pub(crate) struct Proc {
    pub rank: usize,
    /// The rank's process id.
    pub pid: i32,
    guard: Guard,
    /// stdout, stderr, result pipe, guard report pipe (read ends), closed at end of file.
    fds: [Option<OwnedFd>; 4],
    /// Report bytes not yet decoded.
    report: Vec<u8>,
    /// What the rank wrote to its result pipe.
    pub result_bytes: Vec<u8>,
    pub status: Option<Exit>,
    /// The exit was handled by the loop (time, result, failure).
    noted: bool,
    /// Time from the start of the launch to the rank's exit.
    pub elapsed: Duration,
    /// The launcher signalled this rank before it exited.
    pub terminated: bool,
    pub output: RankOutput,
    /// When the launcher saw the rank's process gone while its guard had not reported it.
    exited_unreported: Option<Instant>,
    /// When the launcher continued the rank's silent guard (SIGCONT).
    guard_continued: Option<Instant>,
    /// The launcher killed the guard, which never reported: the rank's status is unknown.
    guard_killed: bool,
}

impl Proc {
    /// A rank started under its guard; `result_fd` is the library launcher's result pipe.
    pub fn new(rank: usize, g: Guarded, result_fd: Option<OwnedFd>, output: RankOutput) -> Proc {
        let fds = [g.stdout, g.stderr, result_fd, Some(g.report)];
        for fd in fds.iter().flatten() {
            child::set_nonblocking(fd);
        }
        Proc {
            rank,
            pid: g.rank_pid,
            guard: g.guard,
            fds,
            report: Vec::new(),
            result_bytes: Vec::new(),
            status: None,
            noted: false,
            elapsed: Duration::ZERO,
            terminated: false,
            output,
            exited_unreported: None,
            guard_continued: None,
            guard_killed: false,
        }
    }

    /// A guard that does not report its exited rank (stopped by SIGSTOP or a debugger) would make
    /// the launcher wait forever: continue it, and if it still does not answer, kill it (its
    /// report pipe then closes, see [`Proc::guard_ended`]).
    fn check_guard(&mut self) {
        if self.status.is_some() || self.fds[3].is_none() || self.guard_killed {
            return;
        }
        let Some(since) = self.exited_unreported else {
            if child::has_exited(self.pid) {
                self.exited_unreported = Some(Instant::now());
            }
            return;
        };
        if since.elapsed() < GUARD_ANSWER {
            return;
        }
        let g = self.guard.pid;
        // Only a stopped guard cannot answer: a running one that is merely slow (a loaded
        // machine) reports soon, and killing it would lose the rank's status.
        let state = match child::proc_state(g) {
            Some('T') => "stopped (SIGSTOP or job control)",
            Some('t') => "stopped by a debugger",
            _ => return,
        };
        match self.guard_continued {
            None => {
                tracing::warn!(
                    "rank {} (pid {}) has exited, but its guard (pid {g}) has not reported it: the guard is {state}; continuing it (SIGCONT)",
                    self.rank,
                    self.pid
                );
                child::kill(g, libc::SIGCONT);
                self.guard_continued = Some(Instant::now());
            }
            Some(t) if t.elapsed() >= GUARD_ANSWER => {
                tracing::warn!(
                    "the guard (pid {g}) of rank {} still does not answer ({state}): killing it; the rank's exit status is lost",
                    self.rank
                );
                child::kill(g, libc::SIGKILL);
                self.guard_killed = true;
            }
            Some(_) => {}
        }
    }

    /// Continue the guard if it is stopped, so it reads what the launcher sends it.
    fn wake_guard(&self) {
        if let Some('T') = child::proc_state(self.guard.pid) {
            tracing::warn!(
                "the guard (pid {}) of rank {} is stopped: continuing it (SIGCONT)",
                self.guard.pid,
                self.rank
            );
            child::kill(self.guard.pid, libc::SIGCONT);
        }
    }

    /// Descriptors a rank started after this one must not inherit (the library launcher's ranks
    /// do not exec, so close-on-exec does not remove them).
    pub fn raw_fds(&self) -> Vec<i32> {
        let mut v: Vec<i32> = self.fds.iter().flatten().map(|f| f.as_raw_fd()).collect();
        v.push(self.guard.ctl_fd());
        v.extend(self.output.log_fd());
        v
    }

    /// Let rank 0's guard reap its rank once it exits: every rank has joined its group
    /// ([`guard::RankSetup::hold_leader`]).
    pub fn release_group(&self) {
        self.guard.release();
    }

    /// Ask the guard to signal the rank (SIGKILL: the rank and everything it started).
    pub fn signal(&self, sig: i32) {
        self.guard.signal(sig);
    }

    /// Read what is available on pipe `k` (0 stdout, 1 stderr, 2 result, 3 report); close it at
    /// end of file, flushing a last unterminated output line.
    fn pump(&mut self, k: usize) -> ReadState {
        let Some(fd) = &self.fds[k] else {
            return ReadState::Eof;
        };
        let mut buf = Vec::new();
        let st = child::read_avail(fd, &mut buf);
        match k {
            0 => self.output.feed(Stream::Out, &buf),
            1 => self.output.feed(Stream::Err, &buf),
            2 => self.result_bytes.extend_from_slice(&buf),
            _ => {
                self.report.extend_from_slice(&buf);
                if let (Some(exit), None) = (guard::parse_reports(&mut self.report), self.status) {
                    self.status = Some(exit);
                }
            }
        }
        if st == ReadState::Eof {
            self.fds[k] = None;
            match k {
                0 => self.output.finish(Stream::Out),
                1 => self.output.finish(Stream::Err),
                3 => self.guard_ended(),
                _ => {}
            }
        }
        st
    }

    /// The guard closed its report pipe: it has exited. Reap it; if it never reported the rank's
    /// exit, it was killed, and the rank with it (parent-death signal).
    fn guard_ended(&mut self) {
        child::reap_blocking(self.guard.pid);
        if self.status.is_none() && self.guard_killed {
            self.status = Some(Exit::Signal(libc::SIGKILL));
        } else if self.status.is_none() {
            tracing::warn!(
                "the guard process (pid {}) of rank {} died before its rank; the rank was killed with it (was the guard killed by hand or by the OOM killer?)",
                self.guard.pid,
                self.rank
            );
            self.status = Some(Exit::Signal(libc::SIGKILL));
        }
    }

    /// Read every pipe until it would block or ends; then close them (used once the rank and,
    /// for the result pipe, its only writer, have exited).
    fn drain(&mut self, ks: &[usize], close: bool) {
        for &k in ks {
            while self.pump(k) == ReadState::Data {}
            if close && self.fds[k].take().is_some() {
                match k {
                    0 => self.output.finish(Stream::Out),
                    1 => self.output.finish(Stream::Err),
                    _ => {}
                }
            }
        }
    }

    /// The failure record of this rank (message supplied by the caller).
    pub fn failure(&self, message: String, exit_code: i32, root: bool) -> RankFailure {
        RankFailure {
            rank: self.rank,
            pid: self.pid,
            exit_code,
            message,
            terminated_by_launcher: self.terminated && !root,
            elapsed: self.elapsed,
            stderr_tail: self.output.stderr_tail(),
        }
    }
}

/// Wait (at most `limit`) for the guards of exited ranks to finish their clean-up and exit, and
/// reap them; a guard still busy (a leftover in uninterruptible sleep) is left to finish alone.
pub(crate) fn wait_for_guards(procs: &mut [Proc], limit: Duration) {
    let t = Instant::now();
    loop {
        let mut pfds: Vec<libc::pollfd> = Vec::new();
        let mut who = Vec::new();
        for (i, p) in procs.iter().enumerate() {
            if let Some(fd) = &p.fds[3] {
                pfds.push(libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                });
                who.push(i);
            }
        }
        let left = limit.saturating_sub(t.elapsed());
        if pfds.is_empty() {
            return;
        }
        if left.is_zero() {
            for &i in &who {
                tracing::warn!(
                    "the guard (pid {}) of rank {} is still killing what the rank left behind; it finishes on its own",
                    procs[i].guard.pid,
                    procs[i].rank
                );
            }
            return;
        }
        child::poll(&mut pfds, left.as_millis().min(200) as i32 + 1);
        for (n, pfd) in pfds.iter().enumerate() {
            if pfd.revents != 0 {
                procs[who[n]].pump(3);
            }
        }
    }
}

/// Kill every rank and its subtree at once and wait for the guards (setup failures).
/// SIGUSR1 to the launcher: every live rank writes its flight recorder's records
/// (`crate::trace`). Ranks have a handler only when `LOCKSTEP_TRACE_DIR` is set (they inherit
/// the launcher's environment); without it the signal would kill them, so it is not forwarded.
fn forward_usr1(procs: &mut [Proc]) {
    if crate::trace::trace_dir().is_none() {
        tracing::warn!(
            "got SIGUSR1: not forwarded, the ranks write no trace without {}=DIR (and SIGUSR1 would kill them)",
            crate::trace::TRACE_DIR
        );
        return;
    }
    tracing::info!(
        "got SIGUSR1: every rank writes its last calls to {}",
        crate::trace::TRACE_DIR
    );
    for p in procs.iter_mut().filter(|p| p.status.is_none()) {
        p.signal(libc::SIGUSR1);
    }
}

pub(crate) fn kill_all(procs: &mut [Proc]) {
    for p in procs.iter_mut() {
        p.signal(libc::SIGKILL);
        p.terminated = true;
    }
    wait_for_guards(procs, GUARD_CLEANUP);
}

/// Settings of one supervision.
pub(crate) struct Options<'a> {
    pub fail_fast: bool,
    pub grace: Duration,
    /// The ranks' process group, signalled too (reaches their children).
    pub pgid: Option<i32>,
    pub signals: Option<&'a SignalPipe>,
    /// Readable when another node of the job failed: terminate this node's ranks.
    pub remote_abort: Option<BorrowedFd<'a>>,
    /// Called once, when the first rank fails (the CLI tells the other nodes from here).
    pub on_first_failure: Option<&'a dyn Fn(&Proc)>,
    pub start: Instant,
    /// How many failed ranks the caller may still replace (`--restart-policy rank`): when the
    /// ranks that fail together are no more than this, supervision returns them in
    /// [`Outcome::replace`] instead of stopping the others. 0: every failure is final.
    pub replaceable: usize,
}

/// The result of supervision.
pub(crate) struct Outcome {
    /// Index (into the ranks) of the first rank seen failing.
    pub root: Option<usize>,
    /// The signal that interrupted the launcher, if one did.
    pub interrupted: Option<i32>,
    /// Another node's failure stopped this node's ranks.
    pub remote_abort: bool,
    /// Indices of ranks that failed and are to be replaced ([`Options::replaceable`]); the
    /// others were left running and supervision is not over: the caller replaces these and
    /// supervises again. Empty when supervision ended.
    pub replace: Vec<usize>,
}

/// Supervise `procs` until all have exited; `failed` tells whether an exited rank failed.
pub(crate) fn supervise(
    procs: &mut [Proc],
    opts: &Options,
    failed: impl Fn(&Proc) -> bool,
) -> Outcome {
    // Index of the root-cause rank, once one has failed.
    let mut root: Option<usize> = None;
    let mut interrupted: Option<i32> = None;
    let mut seen = Counts::default();
    // When SIGTERM (or a forwarded signal) went out; SIGKILL follows `grace` later, once.
    let mut term_at: Option<Instant> = None;
    // The flight recorders asked for before the stop after a failure (`None` inside when
    // LOCKSTEP_TRACE_DIR is unset).
    let mut traces: Option<Option<TraceRequest>> = None;
    let mut killed = false;
    let mut remote_abort = false;
    let mut abort_closed = false;
    let mut guards_checked = Instant::now();
    // Signal the process group first (reaches what the ranks started and kept in it), then,
    // through its guard, each live rank outside that group (one that left it, or every rank of
    // the library launcher, which has no group of its own): a rank gets each signal once, so a
    // handler is not interrupted by a duplicate. A SIGKILL goes to every guard, which kills its
    // rank's whole subtree.
    let signal_all = |procs: &mut [Proc], sig: i32| {
        if let Some(g) = opts.pgid {
            child::kill(-g, sig);
        }
        for p in procs.iter_mut() {
            if p.status.is_none() {
                p.terminated = true;
                p.wake_guard();
                if sig == libc::SIGKILL || opts.pgid.is_none() || child::getpgid(p.pid) != opts.pgid
                {
                    p.signal(sig);
                }
            } else if sig == libc::SIGKILL {
                p.signal(sig);
            }
        }
    };
    loop {
        // 1. Wait for output, exits, or signals.
        let mut pfds: Vec<libc::pollfd> = Vec::new();
        let mut who: Vec<(usize, usize)> = Vec::new(); // (proc, 0..=3 pipe | 4 signal | 5 remote abort)
        for (i, p) in procs.iter().enumerate() {
            for k in 0..4 {
                if let Some(fd) = &p.fds[k] {
                    pfds.push(libc::pollfd {
                        fd: fd.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    });
                    who.push((i, k));
                }
            }
        }
        if let Some(s) = opts.signals {
            pfds.push(libc::pollfd {
                fd: s.fd().as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
            who.push((usize::MAX, 4));
        }
        if let (Some(fd), false) = (opts.remote_abort, remote_abort || abort_closed) {
            pfds.push(libc::pollfd {
                fd: fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
            who.push((usize::MAX, 5));
        }
        // Wake at least every 200 ms (harmless), and in time for the SIGKILL deadline.
        let mut timeout_ms: i64 = 200;
        if let (Some(t), false) = (term_at, killed) {
            timeout_ms =
                timeout_ms.min(opts.grace.saturating_sub(t.elapsed()).as_millis() as i64 + 1);
        }
        if let (Some(Some(_)), None) = (&traces, term_at) {
            // Waiting for the ranks' trace files, which no descriptor announces.
            timeout_ms = timeout_ms.min(10);
        }
        child::poll(&mut pfds, timeout_ms as i32);
        for (n, pfd) in pfds.iter().enumerate() {
            if pfd.revents == 0 {
                continue;
            }
            let (i, k) = who[n];
            if k <= 3 {
                procs[i].pump(k);
            }
            if k == 5 {
                // A byte: another node failed. End of file: the watcher ended (store gone).
                let mut b = Vec::new();
                let st = child::read_avail(&opts.remote_abort.expect("polled"), &mut b);
                if st != ReadState::Data || root.is_some() {
                    // Closed, or our own failure report coming back: nothing to do.
                    abort_closed = true;
                    continue;
                }
                remote_abort = true;
                tracing::warn!("another node of this job failed: stopping this node's ranks");
                signal_all(procs, libc::SIGTERM);
                term_at.get_or_insert_with(Instant::now);
            }
        }

        // 2. Signals to the launcher: the first starts the stop, a further SIGINT/SIGTERM kills.
        if let Some(s) = opts.signals {
            let c = s.take();
            let new_insist = (c.int - seen.int) + (c.term - seen.term);
            let new_hup = c.hup - seen.hup;
            if new_insist + new_hup > 0 && !killed {
                if interrupted.is_none() {
                    let sig = if c.int > seen.int {
                        libc::SIGINT
                    } else if c.term > seen.term {
                        libc::SIGTERM
                    } else {
                        libc::SIGHUP
                    };
                    // Ranks may not expect a hang-up (or ignore it, as under nohup): they get
                    // the ordinary request to stop.
                    let fwd = if sig == libc::SIGHUP {
                        libc::SIGTERM
                    } else {
                        sig
                    };
                    tracing::warn!(
                        "got {}: sending {} to every rank (SIGKILL after {:.1} s; a further Ctrl-C or SIGTERM kills them at once)",
                        child::signal_name(sig),
                        child::signal_name(fwd),
                        opts.grace.as_secs_f64()
                    );
                    interrupted = Some(sig);
                    signal_all(procs, fwd);
                    term_at.get_or_insert_with(Instant::now);
                }
                // A hang-up never escalates; a SIGINT/SIGTERM after any first signal does.
                let insist = c.int + c.term + usize::from(interrupted == Some(libc::SIGHUP));
                if new_insist > 0 && insist >= 2 {
                    tracing::warn!("second interrupt: killing every rank");
                    signal_all(procs, libc::SIGKILL);
                    killed = true;
                }
            }
            if c.usr1 > seen.usr1 {
                forward_usr1(procs);
            }
            seen = c;
        }

        // 2b. Guards that stay silent about an exited rank.
        if guards_checked.elapsed() >= GUARD_CHECK_EVERY {
            guards_checked = Instant::now();
            for p in procs.iter_mut() {
                p.check_guard();
            }
        }

        // 3. Exits. Ranks that ended since the last pass are seen together, so when a rank dies
        // and a peer exits on noticing it (the shm backend's lost-peer error), both can show up
        // here at once: a rank killed by a signal the launcher did not send is the more likely
        // root cause than one that exited with an error code.
        let mut batch: Vec<usize> = Vec::new();
        for (i, p) in procs.iter_mut().enumerate() {
            if p.status.is_none() || p.noted {
                continue;
            }
            p.noted = true;
            p.elapsed = opts.start.elapsed();
            // The rank is the only writer of its result pipe: read it to the end.
            p.drain(&[2], true);
            if failed(p) {
                batch.push(i);
            }
        }
        if root.is_none() && !batch.is_empty() {
            // A peer that died first is often reported second: the survivor notices the death
            // (the shm backend's lost-peer error) and exits before the dead rank's guard has
            // reported it. Ranks whose process has already exited have their report on the way:
            // wait for it (briefly, and only then) so the one killed by a signal is the root.
            let in_flight: Vec<usize> = (0..procs.len())
                .filter(|&i| procs[i].status.is_none() && child::has_exited(procs[i].pid))
                .collect();
            let t = Instant::now();
            for i in in_flight {
                while procs[i].status.is_none()
                    && procs[i].fds[3].is_some()
                    && t.elapsed() < EXIT_REPORT_WAIT
                {
                    let fd = procs[i].fds[3]
                        .as_ref()
                        .map(|f| f.as_raw_fd())
                        .unwrap_or(-1);
                    let mut p = [libc::pollfd {
                        fd,
                        events: libc::POLLIN,
                        revents: 0,
                    }];
                    child::poll(
                        &mut p,
                        EXIT_REPORT_WAIT.saturating_sub(t.elapsed()).as_millis() as i32 + 1,
                    );
                    procs[i].pump(3);
                }
                let p = &mut procs[i];
                if p.status.is_some() && !p.noted {
                    p.noted = true;
                    p.elapsed = opts.start.elapsed();
                    p.drain(&[2], true);
                    if failed(p) {
                        batch.push(i);
                    }
                }
            }
        }
        if root.is_none()
            && !batch.is_empty()
            && batch.len() <= opts.replaceable
            && interrupted.is_none()
            && !remote_abort
        {
            // Nothing was signalled (no failure, no interrupt so far): the survivors run on
            // while the caller replaces the failed ranks. Their output is read to the end now,
            // as their guards kill what they left behind.
            for &i in &batch {
                procs[i].drain(&[0, 1], true);
            }
            return Outcome {
                root: None,
                interrupted: None,
                remote_abort: false,
                replace: batch,
            };
        }
        if root.is_none() {
            let by_signal = |i: &usize| {
                matches!(procs[*i].status, Some(Exit::Signal(_))) && !procs[*i].terminated
            };
            root = batch
                .iter()
                .copied()
                .find(by_signal)
                .or_else(|| batch.first().copied());
            if let (Some(r), Some(f)) = (root, opts.on_first_failure) {
                f(&procs[r]);
            }
        }
        if procs.iter().all(|p| p.status.is_some()) {
            // Output a grandchild still holds open is not waited for (the guards kill such
            // leftovers now).
            for p in procs.iter_mut() {
                p.drain(&[0, 1, 2], true);
            }
            break;
        }

        // 4. Fail fast, then escalate after the grace period.
        if opts.fail_fast && root.is_some() && term_at.is_none() {
            let asked = traces.get_or_insert_with(|| TraceRequest::send(procs));
            if asked.as_ref().is_none_or(|t| t.done(procs)) {
                signal_all(procs, libc::SIGTERM);
                term_at = Some(Instant::now());
            }
        }
        if let Some(t) = term_at {
            if !killed && t.elapsed() >= opts.grace {
                signal_all(procs, libc::SIGKILL);
                killed = true;
            }
        }
    }
    // Whatever the ranks left in their group goes too when the job was cut short.
    if let (Some(g), true) = (opts.pgid, term_at.is_some()) {
        child::kill(-g, libc::SIGKILL);
    }
    wait_for_guards(procs, GUARD_CLEANUP);
    // A rank killed while it wrote its flight recorder leaves the write's temporary.
    if let (Some(dir), true) = (crate::trace::trace_dir(), term_at.is_some()) {
        let pids: Vec<i32> = procs.iter().map(|p| p.pid).collect();
        let n = crate::types::durable::remove_temps_of(&dir, &pids);
        if n > 0 {
            tracing::debug!(
                "removed {n} partly written trace files from {}",
                dir.display()
            );
        }
    }
    Outcome {
        root,
        interrupted,
        remote_abort,
        replace: Vec::new(),
    }
}
