//! [`launch`]: fork ranks that each run a function with a ready communicator (the
//! `notebook_launcher` analog), supervise them, and collect their results.

use std::collections::BTreeMap;
use std::mem::ManuallyDrop;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::child;
use super::forked;
use super::output::rank_outputs;
use super::rank::{RankContext, RankResult};
use super::report::LaunchError;
use super::supervise::{self, Options, Proc};
use super::wire;
use crate::shm::{ShmConfig, ShmJob};

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
    /// `nprocs` ranks with defaults (shared-memory settings from the environment). A malformed
    /// `LOCKSTEP_*` variable leaves `shm` at its defaults here, but is no silent fallback:
    /// [`launch`] checks every variable first and refuses to start, naming it.
    pub fn new(nprocs: usize) -> LaunchConfig {
        LaunchConfig {
            nprocs,
            fail_fast: true,
            grace: Duration::from_secs(3),
            shm: ShmConfig::from_env().unwrap_or_default(),
            capture_output: true,
            log_dir: None,
            ranks_filter: None,
        }
    }
}

/// Fork `cfg.nprocs` ranks, run `f` in each with a ready communicator, and return the results in
/// rank order. The host process can call `launch` again afterwards.
///
/// Refuses to fork when CUDA is already initialised in this process, and when a `LOCKSTEP_*`
/// variable is malformed (see [`crate::types::env`]).
///
/// `f` is called once in each rank (each forked child owns its own copy, so `FnOnce` closures
/// that move their captures work). Its result may be any serde-serialisable type; it travels back
/// to this process through a pipe.
pub fn launch<R, F>(cfg: &LaunchConfig, f: F) -> Result<Vec<R>, LaunchError>
where
    R: Serialize + DeserializeOwned,
    F: FnOnce(RankContext) -> RankResult<R>,
{
    child::check_fork_safe().map_err(LaunchError::Setup)?;
    // A malformed variable the ranks (or `LaunchConfig::new`) would read stops the launch here.
    crate::types::env::check_all().map_err(|e| LaunchError::Setup(e.to_string()))?;
    if cfg.nprocs == 0 {
        return Err(LaunchError::Setup("nprocs must be at least 1".into()));
    }
    let start = Instant::now();
    let mut outputs = rank_outputs(
        cfg.nprocs,
        cfg.log_dir.as_deref(),
        cfg.ranks_filter.as_deref(),
    )?
    .into_iter();
    let job = ShmJob::with_config(cfg.nprocs, cfg.shm.clone())
        .map_err(|e| LaunchError::Setup(e.to_string()))?;
    let mut ranks: Vec<Proc> = Vec::with_capacity(cfg.nprocs);
    // Each child takes `f` out of its own copy of this frame and calls it once; this process
    // never calls it and drops it after the last fork.
    let mut f = ManuallyDrop::new(f);
    for rank in 0..cfg.nprocs {
        // A forked rank does not exec, so close-on-exec does not keep the other ranks' pipes and
        // log files out of it: it closes them itself.
        let mut close: Vec<i32> = ranks.iter().flat_map(Proc::raw_fds).collect();
        close.extend(outputs.as_slice().iter().filter_map(|o| o.log_fd()));
        match forked::spawn(rank, cfg.nprocs, &job, &mut f, cfg.capture_output, &close) {
            Ok((g, rd)) => ranks.push(Proc::new(
                rank,
                g,
                Some(rd),
                outputs.next().expect("one output per rank"),
            )),
            Err(e) => {
                supervise::kill_all(&mut ranks);
                drop(ManuallyDrop::into_inner(f));
                return Err(LaunchError::Setup(format!(
                    "fork of rank {rank} failed: {e}"
                )));
            }
        }
    }
    drop(ManuallyDrop::into_inner(f));
    drop(job);
    let opts = Options {
        fail_fast: cfg.fail_fast,
        grace: cfg.grace,
        pgid: None,
        signals: None,
        remote_abort: None,
        on_first_failure: None,
        start,
        replaceable: 0,
    };
    let ok = |p: &Proc| {
        p.status == Some(child::Exit::Code(0))
            && wire::decode_outcome::<R>(&p.result_bytes).is_some_and(|o| o.is_ok())
    };
    let outcome = supervise::supervise(&mut ranks, &opts, |p| !ok(p));
    let mut results: BTreeMap<usize, R> = BTreeMap::new();
    let mut failures = Vec::new();
    for (i, p) in ranks.iter().enumerate() {
        let st = p.status.expect("all reaped");
        match (st, wire::decode_outcome::<R>(&p.result_bytes)) {
            (child::Exit::Code(0), Some(Ok(v))) => {
                results.insert(i, v);
            }
            (st, decoded) => {
                let message = match decoded {
                    Some(Err(m)) => m,
                    Some(Ok(_)) => format!("returned a result but then {}", st.describe()),
                    None => st.describe(),
                };
                let code = match st {
                    child::Exit::Code(0) => 1,
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
