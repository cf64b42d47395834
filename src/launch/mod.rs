//! The launchers.
//!
//! * [`launch`] (the `notebook_launcher` analog) forks `nprocs` ranks that each run a function
//!   with a ready [`Communicator`], and returns every rank's result. The parent creates the shared
//!   segment, forks, and supervises. The host process can call it again afterwards.
//! * [`run_job`] backs `lockstep launch`: it execs `nproc_per_node` copies of a program with the
//!   rendezvous environment (`RANK`, `WORLD_SIZE`, `LOCKSTEP_JOB_ID`, ...) that
//!   [`Communicator::from_env`] reads, hosting the rendezvous store on node 0 of multi-node jobs.
//!
//! Both share the supervisor (`supervise.rs`): the first rank that fails (error, panic, non-zero
//! exit or signal) gets the others terminated (SIGTERM, then SIGKILL after a grace period) unless
//! fail-fast is off; children die with the parent (`PR_SET_PDEATHSIG`, race closed by a `getppid`
//! check). Each rank's stdout/stderr comes back through pipes and is printed line by line with a
//! `[rank N]` prefix (`output.rs`), optionally also to per-rank log files; failures are reported
//! with the tail of the rank's stderr between divider lines (`report.rs`).
//!
//! | file | what lives there |
//! |---|---|
//! | `child.rs` | fork, exec, pipes, pidfds, reaping, killing: all of the launcher's `unsafe` but the signal handler |
//! | `signals.rs` | the CLI's SIGINT/SIGTERM handlers (counters plus a self-pipe) |
//! | `supervise.rs` | the poll loop: output, results, exits, fail-fast, signal forwarding |
//! | `output.rs` | line splitting, `[rank N]` prefixes, log files, rank filter, stderr tails |
//! | `report.rs` | [`RankFailure`], [`LaunchError`], the failure summary |
//! | `exec.rs` | [`JobSpec`] and [`run_job`] (the CLI launcher) |
//! | `wire.rs` | encoding of rank results |
//!
//! Fork safety: the child runs only the user's function and lockstep code that takes no lock the
//! parent's other threads could hold. Call `launch` from a single-threaded host (a `harness = false`
//! test, a CLI, a notebook kernel) to be safe.

mod child;
mod exec;
mod output;
mod report;
mod signals;
mod supervise;
mod wire;

pub use child::monotonic_ns;
pub use exec::{run_job, JobSpec};
pub use report::{summary, LaunchError, RankFailure};
pub use wire::Wire;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::comm::Communicator;
use crate::shm::{ShmConfig, ShmJob};
use output::RankOutput;
use supervise::{Options, Proc};

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
    /// Capture each rank's stdout/stderr and re-emit it line by line with a `[rank N]` prefix
    /// (default true). When false, ranks write straight to the host's stdout/stderr.
    pub capture_output: bool,
    /// Also write each rank's output, unprefixed, to `rank-N.log` in this directory (created if
    /// missing).
    pub log_dir: Option<PathBuf>,
    /// Show only these ranks' output on the console (`None`: all). Logs and the stderr tails in
    /// failure reports still cover every rank.
    pub ranks_filter: Option<Vec<usize>>,
}

impl LaunchConfig {
    /// `nprocs` ranks with defaults (shared-memory settings from the environment).
    pub fn new(nprocs: usize) -> LaunchConfig {
        LaunchConfig {
            nprocs,
            fail_fast: true,
            grace: Duration::from_secs(3),
            shm: ShmConfig::from_env(),
            capture_output: true,
            log_dir: None,
            ranks_filter: None,
        }
    }
}

/// Per-rank console/log output set up for `world` ranks.
pub(crate) fn rank_outputs(
    world: usize,
    log_dir: Option<&std::path::Path>,
    filter: Option<&[usize]>,
) -> Result<Vec<RankOutput>, LaunchError> {
    if let Some(d) = log_dir {
        std::fs::create_dir_all(d).map_err(|e| LaunchError::Setup(format!("cannot create log directory {}: {e}", d.display())))?;
    }
    (0..world)
        .map(|r| {
            let show = filter.is_none_or(|f| f.contains(&r));
            RankOutput::new(r, show, log_dir).map_err(|e| LaunchError::Setup(format!("cannot create the log file of rank {r}: {e}")))
        })
        .collect()
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

/// Fork `cfg.nprocs` ranks, run `f` in each with a ready communicator, and return the results in
/// rank order. The host process can call `launch` again afterwards.
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
    let start = Instant::now();
    let mut outputs = rank_outputs(cfg.nprocs, cfg.log_dir.as_deref(), cfg.ranks_filter.as_deref())?.into_iter();
    let job = ShmJob::with_config(cfg.nprocs, cfg.shm.clone()).map_err(|e| LaunchError::Setup(e.to_string()))?;
    let mut ranks: Vec<Proc> = Vec::with_capacity(cfg.nprocs);
    for rank in 0..cfg.nprocs {
        match child::spawn(rank, cfg.nprocs, &job, &f, cfg.capture_output) {
            Ok(s) => ranks.push(Proc::new(rank, s, outputs.next().expect("one output per rank"))),
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
    let opts = Options {
        fail_fast: cfg.fail_fast,
        grace: cfg.grace,
        pgid: None,
        signals: None,
        remote_abort: None,
        on_first_failure: None,
        start,
    };
    let ok = |p: &Proc| {
        matches!(p.status, Some(child::Exit::Code(0) | child::Exit::Unknown))
            && wire::decode_outcome::<R>(&p.result_bytes).is_some_and(|o| o.is_ok())
    };
    let outcome = supervise::supervise(&mut ranks, &opts, |p| !ok(p));
    let mut results: BTreeMap<usize, R> = BTreeMap::new();
    let mut failures = Vec::new();
    for (i, p) in ranks.iter().enumerate() {
        let st = p.status.expect("all reaped");
        match (st, wire::decode_outcome::<R>(&p.result_bytes)) {
            (child::Exit::Code(0) | child::Exit::Unknown, Some(Ok(v))) => {
                results.insert(i, v);
            }
            (st, decoded) => {
                let message = match decoded {
                    Some(Err(m)) => m,
                    Some(Ok(_)) => format!("returned a result but then {}", st.describe()),
                    None => st.describe(),
                };
                let code = match st {
                    child::Exit::Code(0) | child::Exit::Unknown => 1,
                    s => s.code(),
                };
                failures.push(p.failure(message, code, outcome.root == Some(i)));
            }
        }
    }
    if failures.is_empty() {
        return Ok(results.into_values().collect());
    }
    // Root cause first: the first rank seen failing.
    if let Some(first) = outcome.root {
        failures.sort_by_key(|f| if f.rank == first { 0 } else { 1 });
    }
    Err(LaunchError::RanksFailed(failures))
}
