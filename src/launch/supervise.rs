//! The supervision loop shared by the library launcher and the CLI: one thread polls every rank's
//! output pipes, result pipe and pidfd (plus the CLI's signal pipe), reaps exited ranks, and on
//! the first failure terminates the others (SIGTERM, then SIGKILL after the grace period).
//!
//! Signals (CLI only): the first SIGINT/SIGTERM is forwarded to every rank and starts the grace
//! period; a second one kills every rank at once.
//!
//! Why one poll loop and no threads: the library launcher runs in the host process that forked
//! the ranks, which must stay free of helper threads between launches, and a single loop makes
//! the order of events (which rank failed first) the order the loop saw them. A pidfd per rank
//! wakes the loop the moment a rank exits, even while its pipes are still held open by a
//! grandchild; without pidfds (kernels before 5.3) the loop polls every 5 ms instead.

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use super::child::{self, Exit, ReadState};
use super::output::{RankOutput, Stream};
use super::report::RankFailure;
use super::signals::{Counts, SignalPipe};

/// One supervised rank.
pub(crate) struct Proc {
    pub rank: usize,
    pub pid: i32,
    /// stdout, stderr, result pipe (read ends), closed at end of file.
    fds: [Option<OwnedFd>; 3],
    pidfd: Option<OwnedFd>,
    /// What the rank wrote to its result pipe.
    pub result_bytes: Vec<u8>,
    pub status: Option<Exit>,
    /// Time from the start of the launch to the rank's exit.
    pub elapsed: Duration,
    /// The launcher signalled this rank before it exited.
    pub terminated: bool,
    pub output: RankOutput,
}

impl Proc {
    pub fn new(rank: usize, s: child::Spawned, output: RankOutput) -> Proc {
        let fds = [s.stdout, s.stderr, s.result_fd];
        for fd in fds.iter().flatten() {
            child::set_nonblocking(fd);
        }
        Proc {
            rank,
            pid: s.pid,
            fds,
            pidfd: child::pidfd_open(s.pid),
            result_bytes: Vec::new(),
            status: None,
            elapsed: Duration::ZERO,
            terminated: false,
            output,
        }
    }

    /// Read what is available on pipe `k` (0 stdout, 1 stderr, 2 result); close it at end of
    /// file, flushing a last unterminated output line.
    fn pump(&mut self, k: usize) -> ReadState {
        let Some(fd) = &self.fds[k] else { return ReadState::Eof };
        let mut buf = Vec::new();
        let st = child::read_avail(fd, &mut buf);
        match k {
            0 => self.output.feed(Stream::Out, &buf),
            1 => self.output.feed(Stream::Err, &buf),
            _ => self.result_bytes.extend_from_slice(&buf),
        }
        if st == ReadState::Eof {
            self.fds[k] = None;
            match k {
                0 => self.output.finish(Stream::Out),
                1 => self.output.finish(Stream::Err),
                _ => {}
            }
        }
        st
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
}

/// The result of supervision.
pub(crate) struct Outcome {
    /// Index (into the ranks) of the first rank seen failing.
    pub root: Option<usize>,
    /// The signal that interrupted the launcher, if one did.
    pub interrupted: Option<i32>,
    /// Another node's failure stopped this node's ranks.
    pub remote_abort: bool,
}

/// Supervise `procs` until all have exited; `failed` tells whether an exited rank failed.
pub(crate) fn supervise(procs: &mut [Proc], opts: &Options, failed: impl Fn(&Proc) -> bool) -> Outcome {
    // Index of the root-cause rank, once one has failed.
    let mut root: Option<usize> = None;
    let mut interrupted = None;
    let mut seen = Counts::default();
    // When SIGTERM (or a forwarded signal) went out; SIGKILL follows `grace` later, once.
    let mut term_at: Option<Instant> = None;
    let mut killed = false;
    let mut remote_abort = false;
    let mut abort_closed = false;
    // Signal the process group first (reaches what the ranks started), then each live rank (a
    // rank may have left the group, or the library launcher has no group of its own).
    let signal_all = |procs: &mut [Proc], sig: i32| {
        if let Some(g) = opts.pgid {
            child::kill(-g, sig);
        }
        for p in procs.iter_mut().filter(|p| p.status.is_none()) {
            child::kill(p.pid, sig);
            p.terminated = true;
        }
    };
    loop {
        // 1. Wait for output, exits, or signals.
        let mut pfds: Vec<libc::pollfd> = Vec::new();
        let mut who: Vec<(usize, usize)> = Vec::new(); // (proc, 0..=2 pipe | 3 pidfd | 4 signal | 5 remote abort)
        let mut blind = false; // some live rank has no pidfd: poll with a short timeout
        for (i, p) in procs.iter().enumerate() {
            for k in 0..3 {
                if let Some(fd) = &p.fds[k] {
                    pfds.push(libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 });
                    who.push((i, k));
                }
            }
            if p.status.is_none() {
                match &p.pidfd {
                    Some(fd) => {
                        pfds.push(libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 });
                        who.push((i, 3));
                    }
                    None => blind = true,
                }
            }
        }
        if let Some(s) = opts.signals {
            pfds.push(libc::pollfd { fd: s.fd().as_raw_fd(), events: libc::POLLIN, revents: 0 });
            who.push((usize::MAX, 4));
        }
        if let (Some(fd), false) = (opts.remote_abort, remote_abort || abort_closed) {
            pfds.push(libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 });
            who.push((usize::MAX, 5));
        }
        // Wake at least every 200 ms (harmless), and in time for the SIGKILL deadline.
        let mut timeout_ms: i64 = if blind { 5 } else { 200 };
        if let (Some(t), false) = (term_at, killed) {
            timeout_ms = timeout_ms.min(opts.grace.saturating_sub(t.elapsed()).as_millis() as i64 + 1);
        }
        child::poll(&mut pfds, timeout_ms as i32);
        for (n, pfd) in pfds.iter().enumerate() {
            if pfd.revents == 0 {
                continue;
            }
            let (i, k) = who[n];
            if k <= 2 {
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

        // 2. Signals to the launcher: forward the first, kill on the second.
        if let Some(s) = opts.signals {
            let c = s.take();
            let new = (c.int - seen.int) + (c.term - seen.term);
            if new > 0 {
                let total = c.int + c.term;
                let sig = if c.int > seen.int { libc::SIGINT } else { libc::SIGTERM };
                if total >= 2 || killed {
                    tracing::warn!("second interrupt: killing every rank");
                    signal_all(procs, libc::SIGKILL);
                    killed = true;
                } else {
                    tracing::warn!("got {}: forwarding it to every rank (again to kill them at once)", child::signal_name(sig));
                    interrupted = Some(sig);
                    signal_all(procs, sig);
                    term_at.get_or_insert_with(Instant::now);
                }
                seen = c;
            }
        }

        // 3. Reap. Ranks that ended since the last pass are seen together, so when a rank dies
        // and a peer exits on noticing it (the shm backend's lost-peer error), both can show up
        // here at once: a rank killed by a signal the launcher did not send is the more likely
        // root cause than one that exited with an error code.
        let mut batch: Vec<usize> = Vec::new();
        for (i, p) in procs.iter_mut().enumerate() {
            if p.status.is_some() {
                continue;
            }
            if let Some(st) = child::try_reap(p.pid) {
                p.status = Some(st);
                p.elapsed = opts.start.elapsed();
                p.pidfd = None;
                // The rank is the only writer of its result pipe: read it to the end.
                p.drain(&[2], true);
                if failed(p) {
                    batch.push(i);
                }
            }
        }
        if root.is_none() {
            let by_signal = |i: &usize| matches!(procs[*i].status, Some(Exit::Signal(_))) && !procs[*i].terminated;
            root = batch.iter().copied().find(by_signal).or_else(|| batch.first().copied());
            if let (Some(r), Some(f)) = (root, opts.on_first_failure) {
                f(&procs[r]);
            }
        }
        if procs.iter().all(|p| p.status.is_some()) {
            // Output a grandchild still holds open is not waited for.
            for p in procs.iter_mut() {
                p.drain(&[0, 1, 2], true);
            }
            break;
        }

        // 4. Fail fast, then escalate after the grace period.
        if opts.fail_fast && root.is_some() && term_at.is_none() {
            signal_all(procs, libc::SIGTERM);
            term_at = Some(Instant::now());
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
    Outcome { root, interrupted, remote_abort }
}
