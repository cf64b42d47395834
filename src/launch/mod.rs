//! The fork-based launcher (the `notebook_launcher` analog): [`launch`] forks `nprocs` ranks that
//! each run a function with a ready [`Communicator`], and returns every rank's result.
//!
//! The parent creates the shared segment, forks, and supervises: the first rank that fails (error,
//! panic, non-zero exit or signal) gets the others terminated (SIGTERM, then SIGKILL after a grace
//! period) unless [`LaunchConfig::fail_fast`] is off. Children die with the parent
//! (`PR_SET_PDEATHSIG`), and the host process can call [`launch`] again afterwards.
//!
//! Fork safety: the child runs only the user's function and lockstep code that takes no lock the
//! parent's other threads could hold. Call `launch` from a single-threaded host (a `harness = false`
//! test, a CLI, a notebook kernel) to be safe.

mod child;
mod wire;

pub use wire::Wire;

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::{Duration, Instant};

use crate::comm::Communicator;
use crate::shm::{ShmConfig, ShmJob};

/// What a rank's function returns: a value, or any error (converted with `?`).
pub type RankResult<R> = Result<R, Box<dyn std::error::Error + Send + Sync>>;

/// Settings of one [`launch`].
#[derive(Clone, Debug)]
pub struct LaunchConfig {
    /// Number of ranks to fork.
    pub nprocs: usize,
    /// Terminate the other ranks as soon as one fails (default true).
    pub fail_fast: bool,
    /// Time between SIGTERM and SIGKILL when terminating ranks (default 3 s).
    pub grace: Duration,
    /// Shared-memory backend settings.
    pub shm: ShmConfig,
}

impl LaunchConfig {
    /// `nprocs` ranks with defaults (shared-memory settings from the environment).
    pub fn new(nprocs: usize) -> LaunchConfig {
        LaunchConfig { nprocs, fail_fast: true, grace: Duration::from_secs(3), shm: ShmConfig::from_env() }
    }
}

/// What each rank's function receives.
#[derive(Debug)]
pub struct RankContext {
    /// Global rank.
    pub rank: usize,
    /// Rank within this node.
    pub local_rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// A communicator joined by every rank.
    pub comm: Communicator,
}

/// How one rank ended, when it did not succeed.
#[derive(Debug, Clone)]
pub struct RankFailure {
    /// The rank.
    pub rank: usize,
    /// Its process id.
    pub pid: i32,
    /// Exit code (`128 + signal` for a signal), as a shell reports it.
    pub exit_code: i32,
    /// What happened, in words: the rank's error, panic message, or how the process ended.
    pub message: String,
    /// Whether the launcher terminated this rank after another failed.
    pub terminated_by_launcher: bool,
}

/// A launch whose ranks did not all succeed.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// Setting up the job failed before any rank ran.
    #[error("launch failed before starting ranks: {0}")]
    Setup(String),
    /// Some ranks failed; the first entry is the root cause.
    #[error("{}", describe_failures(.0))]
    RanksFailed(Vec<RankFailure>),
}

impl LaunchError {
    /// The failures, root cause first (empty for setup errors).
    pub fn failures(&self) -> &[RankFailure] {
        match self {
            LaunchError::RanksFailed(f) => f,
            LaunchError::Setup(_) => &[],
        }
    }

    /// The exit code a CLI should return: the root-cause rank's.
    pub fn exit_code(&self) -> i32 {
        self.failures().first().map(|f| f.exit_code).filter(|c| *c != 0).unwrap_or(1)
    }
}

fn describe_failures(f: &[RankFailure]) -> String {
    let mut s = String::new();
    let root: Vec<&RankFailure> = f.iter().filter(|x| !x.terminated_by_launcher).collect();
    s += &format!(
        "{} of the ranks failed (root cause: rank {})",
        root.len().max(1),
        f.first().map(|x| x.rank.to_string()).unwrap_or_else(|| "?".into())
    );
    for x in f {
        s += &format!(
            "\n  rank {} (pid {}): exit {}{}: {}",
            x.rank,
            x.pid,
            x.exit_code,
            if x.terminated_by_launcher { ", terminated by the launcher" } else { "" },
            x.message
        );
    }
    s
}

/// Fork `cfg.nprocs` ranks, run `f` in each with a ready communicator, and return the results in
/// rank order.
///
/// Refuses to fork when CUDA is already initialised in this process.
pub fn launch<R, F>(cfg: &LaunchConfig, f: F) -> Result<Vec<R>, LaunchError>
where
    R: Wire,
    F: Fn(RankContext) -> RankResult<R>,
{
    crate::launch::child::check_fork_safe().map_err(LaunchError::Setup)?;
    if cfg.nprocs == 0 {
        return Err(LaunchError::Setup("nprocs must be at least 1".into()));
    }
    let job = ShmJob::with_config(cfg.nprocs, cfg.shm.clone()).map_err(|e| LaunchError::Setup(e.to_string()))?;
    let mut ranks: Vec<child::Spawned> = Vec::with_capacity(cfg.nprocs);
    for rank in 0..cfg.nprocs {
        match child::spawn(rank, cfg.nprocs, &job, &f) {
            Ok(s) => ranks.push(s),
            Err(e) => {
                for s in &ranks {
                    child::kill(s.pid, libc::SIGKILL);
                }
                for s in &ranks {
                    child::reap_blocking(s.pid);
                }
                return Err(LaunchError::Setup(format!("fork of rank {rank} failed: {e}")));
            }
        }
    }
    drop(job);
    supervise(cfg, ranks)
}

/// Per-rank bookkeeping while supervising.
struct Running {
    pid: i32,
    fd: Option<OwnedFd>,
    bytes: Vec<u8>,
    status: Option<child::Exit>,
    terminated: bool,
}

fn supervise<R: Wire>(cfg: &LaunchConfig, spawned: Vec<child::Spawned>) -> Result<Vec<R>, LaunchError> {
    let mut ranks: Vec<Running> = spawned
        .into_iter()
        .map(|s| Running { pid: s.pid, fd: Some(s.result_fd), bytes: Vec::new(), status: None, terminated: false })
        .collect();
    let mut failed_order: Vec<usize> = Vec::new();
    let mut term_sent: Option<Instant> = None;
    let mut killed = false;
    loop {
        // Drain result pipes (a rank writes its result just before exiting).
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut owners = Vec::new();
        for (i, r) in ranks.iter().enumerate() {
            if let Some(fd) = &r.fd {
                fds.push(libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 });
                owners.push(i);
            }
        }
        if !fds.is_empty() {
            // SAFETY: fds is a valid array of pollfd of the given length.
            unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 5) };
            for (k, p) in fds.iter().enumerate() {
                if p.revents != 0 {
                    let r = &mut ranks[owners[k]];
                    if !child::read_some(r.fd.as_ref().expect("polled fd"), &mut r.bytes) {
                        r.fd = None;
                    }
                }
            }
        } else {
            std::thread::sleep(Duration::from_millis(1));
        }
        // Reap exited ranks.
        for (i, r) in ranks.iter_mut().enumerate() {
            if r.status.is_none() {
                if let Some(st) = child::try_reap(r.pid) {
                    r.status = Some(st);
                    // Read whatever is left in the pipe.
                    if let Some(fd) = r.fd.take() {
                        while child::read_some(&fd, &mut r.bytes) {}
                    }
                    let ok = st == child::Exit::Code(0) && wire::decode_outcome::<R>(&r.bytes).is_some_and(|o| o.is_ok());
                    if !ok {
                        failed_order.push(i);
                    }
                }
            }
        }
        let all_done = ranks.iter().all(|r| r.status.is_some());
        if all_done {
            break;
        }
        if cfg.fail_fast && !failed_order.is_empty() {
            match term_sent {
                None => {
                    for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
                        child::kill(r.pid, libc::SIGTERM);
                        r.terminated = true;
                    }
                    term_sent = Some(Instant::now());
                }
                Some(t) if !killed && t.elapsed() >= cfg.grace => {
                    for r in ranks.iter().filter(|r| r.status.is_none()) {
                        child::kill(r.pid, libc::SIGKILL);
                    }
                    killed = true;
                }
                _ => {}
            }
        }
    }
    let mut results: BTreeMap<usize, R> = BTreeMap::new();
    let mut failures = Vec::new();
    for (i, r) in ranks.iter().enumerate() {
        let st = r.status.expect("all reaped");
        match (st, wire::decode_outcome::<R>(&r.bytes)) {
            (child::Exit::Code(0), Some(Ok(v))) => {
                results.insert(i, v);
            }
            (st, outcome) => {
                let message = match outcome {
                    Some(Err(m)) => m,
                    Some(Ok(_)) => format!("returned a result but then {}", st.describe()),
                    None => st.describe(),
                };
                let code = match st {
                    child::Exit::Code(0) => 1,
                    s => s.code(),
                };
                failures.push(RankFailure {
                    rank: i,
                    pid: r.pid,
                    exit_code: code,
                    message,
                    terminated_by_launcher: r.terminated && !failed_order.first().is_some_and(|f| *f == i),
                });
            }
        }
    }
    if failures.is_empty() {
        return Ok(results.into_values().collect());
    }
    // Root cause first: the first rank seen failing.
    if let Some(&first) = failed_order.first() {
        failures.sort_by_key(|f| if f.rank == first { 0 } else { 1 });
    }
    Err(LaunchError::RanksFailed(failures))
}
