//! The CLI launcher (`lockstep launch`): start `nproc_per_node` copies of a program on this node
//! with the rendezvous environment, supervise them, and exit with the root-cause rank's code.
//!
//! * Single node: no port is opened; the ranks join a named shared-memory segment by job id
//!   ([`Communicator::from_env`](crate::comm::Communicator::from_env)).
//! * Several nodes: the node-0 launcher hosts the [`StoreServer`] on `master_addr:master_port`
//!   and publishes its job id there; the other launchers fetch it before starting their ranks,
//!   which checks reachability and the token early.
//! * Each rank runs under a guard process (`guard/`) that kills the rank and everything it
//!   started when the launcher dies, `kill -9` included, and removes the job's named segment
//!   then; the ranks share one process group per node, and get SIGINT/SIGTERM forwarded (SIGHUP
//!   as SIGTERM). Otherwise the launcher removes the named segment when it exits.
//! * Every rank gets `LOCKSTEP_RDZV_TIMEOUT_S` = [`JobSpec::rdzv_timeout`], so each wait of the
//!   rendezvous (the launchers' and the ranks', on every node) has the same bound.
//! * Before anything starts, the `LOCKSTEP_*` variables of [`crate::types::env::CHECKED`] are
//!   checked: a malformed one stops the launch with an error naming it.
//! * With [`JobSpec::max_restarts`] (single node), a failed rank gets a replacement while the
//!   others run on ([`RestartPolicy::Rank`]), or every rank is stopped and the job starts again
//!   under a new job id, so a new segment ([`RestartPolicy::Job`]); see docs/launching.md.

use std::cell::RefCell;
use std::ffi::{CString, OsString};
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::child;
use super::guard::{self, ExecImage, RankSetup};
use super::output::{LogDir, RankOutput};
use super::report::{summary_with_notes, LaunchError};
use super::signals::SignalPipe;
use super::supervise::{self, Options, Proc, GUARD_CLEANUP};
use crate::rendezvous::JOB_ID_KEY;
use crate::store::{Store, StoreServer, TcpStore};

/// Store key a launcher sets when its node fails: `"<exit code>\n<what happened>"`.
pub const ABORT_KEY: &str = "lockstep/abort";

/// Store key where node 0's launcher publishes the port its ranks get as `MASTER_PORT` in a
/// multi-node job (decimal): its own store holds `--master-port`, so a rank 0 that hosts a
/// store of its own there (torch's `env://`) needs another one.
const RANK_PORT_KEY: &str = "lockstep/rank-master-port";

/// Store key where node 0's launcher publishes the settings every launcher of the job must share
/// ([`JobSpec::shared_settings`]), one `name=value` per line.
const SETTINGS_KEY: &str = "lockstep/launch-settings";

/// A launcher's link to the other nodes of a multi-node job: a connection to tell them about a
/// local failure, a watcher thread that makes `abort_fd` readable when another node failed, and
/// (with the `json` feature) a thread that answers `lockstep status` for this node's ranks
/// through the store (`status::nodes`).
struct NodeLink {
    notify: RefCell<TcpStore>,
    abort_fd: OwnedFd,
    abort_msg: Arc<Mutex<Option<String>>>,
}

impl NodeLink {
    fn new(spec: &JobSpec, token: &str, job_id: &str) -> Result<NodeLink, LaunchError> {
        let connect = || {
            TcpStore::connect(
                &spec.master_addr,
                spec.master_port,
                token,
                spec.rdzv_timeout,
            )
            .map_err(|e| LaunchError::Setup(e.to_string()))
        };
        let notify = RefCell::new(connect()?);
        let mut watch = connect()?;
        let (abort_fd, wr) =
            child::pipe().map_err(|e| LaunchError::Setup(format!("cannot create a pipe: {e}")))?;
        let abort_msg = Arc::new(Mutex::new(None));
        let msg = abort_msg.clone();
        // The launcher execs its ranks (never forks without exec), so a thread here is safe.
        std::thread::Builder::new()
            .name("lockstep-abort-watch".into())
            .spawn(move || loop {
                match watch.wait(&[ABORT_KEY], Duration::from_secs(24 * 3600)) {
                    Ok(()) => {
                        let v = watch.get(ABORT_KEY).ok().flatten().unwrap_or_default();
                        *msg.lock().unwrap_or_else(|p| p.into_inner()) =
                            Some(String::from_utf8_lossy(&v).into_owned());
                        let _ = std::fs::File::from(wr).write_all(b"!");
                        return;
                    }
                    Err(crate::store::StoreError::Timeout { .. }) => continue,
                    // The store is gone (node 0 finished or died): nothing more to learn.
                    Err(_) => return,
                }
            })
            .map_err(|e| LaunchError::Setup(format!("cannot start the abort watcher: {e}")))?;
        #[cfg(feature = "json")]
        {
            let mut answer = connect()?;
            let host =
                crate::rendezvous::host_id().map_err(|e| LaunchError::Setup(e.to_string()))?;
            let (job, node, world) = (
                job_id.to_string(),
                spec.node_rank,
                spec.nproc_per_node * spec.nnodes,
            );
            std::thread::Builder::new()
                .name("lockstep-status".into())
                .spawn(move || {
                    let shown = host.split('/').next().unwrap_or(&host).to_string();
                    crate::status::answer_asks(&mut answer, node, &shown, |store| {
                        node_segment(store, &job, world, &host)
                    })
                })
                .map_err(|e| {
                    LaunchError::Setup(format!("cannot start the status answerer: {e}"))
                })?;
        }
        #[cfg(not(feature = "json"))]
        let _ = job_id;
        Ok(NodeLink {
            notify,
            abort_fd,
            abort_msg,
        })
    }

    /// Tell the other nodes this one failed (best effort: the store may be gone).
    fn tell(&self, code: i32, what: &str) {
        let _ = self
            .notify
            .borrow_mut()
            .set(ABORT_KEY, format!("{code}\n{what}").as_bytes());
    }

    /// The failure another node reported: (exit code, description).
    fn remote(&self) -> Option<(i32, String)> {
        let m = self
            .abort_msg
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()?;
        let (code, what) = m.split_once('\n').unwrap_or(("1", m.as_str()));
        Some((code.trim().parse().unwrap_or(1), what.to_string()))
    }
}

/// The segment that holds this node's ranks of job `job` (`world` ranks), on host `host`, and
/// their global ranks, from the hosts the ranks published in the store.
#[cfg(feature = "json")]
fn node_segment(
    store: &mut TcpStore,
    job: &str,
    world: usize,
    host: &str,
) -> Result<(String, Vec<usize>), String> {
    let mut hosts = Vec::with_capacity(world);
    for r in 0..world {
        match store.get(&crate::rendezvous::host_key(r)) {
            Ok(Some(h)) => hosts.push(String::from_utf8_lossy(&h).into_owned()),
            Ok(None) => return Err(format!("rank {r} has not reached the rendezvous yet")),
            Err(e) => return Err(e.to_string()),
        }
    }
    crate::rendezvous::node_of(job, &hosts, host)
        .map(|n| (n.tag, n.members))
        .ok_or_else(|| "no rank of the job runs on this node's host".to_string())
}

/// What `lockstep launch --max-restarts N` restarts when a rank fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestartPolicy {
    /// Stop every rank, as without restarts, and start them all again under a new job id (so a
    /// new shared segment): torchrun's restarts, for programs that do not handle a peer's death.
    Job,
    /// Start a replacement for the failed rank only (same rank, `LOCKSTEP_REPLACEMENT=1`) while
    /// the other ranks run on and see the death through the backend's lost-peer error.
    Rank,
}

impl std::fmt::Display for RestartPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RestartPolicy::Job => "job",
            RestartPolicy::Rank => "rank",
        })
    }
}

impl std::str::FromStr for RestartPolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<RestartPolicy, String> {
        match s {
            "job" => Ok(RestartPolicy::Job),
            "rank" => Ok(RestartPolicy::Rank),
            _ => Err(format!(
                "{s:?} is not a restart policy: use `job` (restart every rank, as torchrun) or `rank` (replace the failed rank only)"
            )),
        }
    }
}

/// Validated settings of one `lockstep launch`.
#[derive(Clone, Debug)]
pub struct JobSpec {
    /// Ranks started on this node.
    pub nproc_per_node: usize,
    /// Number of nodes (launchers) in the job.
    pub nnodes: usize,
    /// This node's index in `0..nnodes`.
    pub node_rank: usize,
    /// Address of the node-0 launcher's rendezvous store.
    pub master_addr: String,
    /// Its port.
    pub master_port: u16,
    /// Shared secret of the job: at least 16 bytes ([`validate_token`](crate::store::validate_token)),
    /// required when `nnodes > 1` (see [`JobSpec::ensure_token`]), generated otherwise.
    pub token: Option<String>,
    /// Per-rank log files go here.
    pub log_dir: Option<PathBuf>,
    /// Show only these global ranks' output.
    pub ranks_filter: Option<Vec<usize>>,
    /// Terminate the other ranks when one fails (default true; off, survivors see the failure
    /// through the backend, e.g. the shared-memory backend's lost-peer error).
    pub fail_fast: bool,
    /// SIGTERM → SIGKILL grace period.
    pub grace: Duration,
    /// How long each rendezvous wait may take: a non-zero node's launcher waiting for the node-0
    /// store, and every rank (passed as `LOCKSTEP_RDZV_TIMEOUT_S`) waiting for the others.
    pub rdzv_timeout: Duration,
    /// The program and its arguments.
    pub program: Vec<OsString>,
    /// More variables for every rank, set over the launcher's own environment (`lockstep
    /// launch` passes `LOCKSTEP_BACKEND` and `LOCKSTEP_CONFIG` from its configuration this way).
    pub rank_env: Vec<(String, String)>,
    /// Prefix each line of a rank's output with `[rank N] ` (lines that are JSON objects never
    /// are, so `--json` output parses line by line); off: the lines as the ranks wrote them.
    pub prefix: bool,
    /// How many times a failed rank or job is restarted before the job fails (torchrun's
    /// `--max-restarts`); 0: never. Single-node jobs only.
    pub max_restarts: usize,
    /// What a restart restarts (see [`RestartPolicy`]).
    pub restart_policy: RestartPolicy,
}

/// A job id unique on this machine: launcher pid plus wall-clock nanoseconds.
fn new_job_id() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{:x}-{:x}", std::process::id(), t & 0xffff_ffff_ffff)
}

/// Remove named segments that killed jobs left behind: their ranks died before all had joined,
/// so nobody unlinked the name. A segment whose header names a creator (its rank 0) that is gone
/// is removed at once (see [`crate::shm::reclaim_stale_segments`]). One whose creator cannot be
/// checked (no header of this version, or a creator in another pid namespace) is removed only
/// when its name has our job-id format (`lockstep-<launcher pid>-<time>`, both hex), that
/// launcher is gone, and it is older than five minutes (far past any join timeout), so a live job
/// in another pid namespace sharing /dev/shm is safe.
fn sweep_stale_segments() {
    crate::shm::reclaim_stale_segments(&|id, age| {
        let Some((pid, t)) = id.split_once('-') else {
            return false;
        };
        let (Ok(pid), true) = (
            i32::from_str_radix(pid, 16),
            !t.is_empty() && t.chars().all(|c| c.is_ascii_hexdigit()),
        ) else {
            return false;
        };
        let old = age.is_some_and(|a| a > Duration::from_secs(300));
        old && pid > 0 && !std::path::Path::new(&format!("/proc/{pid}")).exists()
    });
}

impl JobSpec {
    /// Generate a token when none is set and this launcher may pick it: a single-node job, or
    /// node 0 of a multi-node job (the other nodes must be given node 0's token). Returns the new
    /// token, which the caller must pass to the other nodes' launchers (`lockstep launch` prints
    /// how); `None` when a token was set already or this node cannot pick one.
    pub fn ensure_token(&mut self) -> Result<Option<String>, LaunchError> {
        if self.token.is_some() || (self.nnodes > 1 && self.node_rank != 0) {
            return Ok(None);
        }
        let t = crate::store::generate_token().map_err(|e| LaunchError::Setup(e.to_string()))?;
        self.token = Some(t.clone());
        Ok(Some(t))
    }

    /// The settings every node's launcher must agree on, as (flag, value): a launcher given other
    /// values would start ranks that wait for peers that never come.
    fn shared_settings(&self) -> Vec<(&'static str, String)> {
        let backend = self
            .rank_env
            .iter()
            .find(|(k, _)| k == "LOCKSTEP_BACKEND")
            .map(|(_, v)| v.clone())
            .or_else(|| std::env::var("LOCKSTEP_BACKEND").ok())
            .unwrap_or_else(|| "auto".into());
        vec![
            ("--nproc-per-node", self.nproc_per_node.to_string()),
            ("--nnodes", self.nnodes.to_string()),
            ("backend", backend),
        ]
    }

    fn validate(&self) -> Result<(), LaunchError> {
        let bad = |m: String| Err(LaunchError::Setup(m));
        if self.nproc_per_node == 0 {
            return bad("--nproc-per-node 0: each node needs at least 1 rank (or `auto`: one per GPU, else 2)".into());
        }
        if self.nnodes == 0 {
            return bad("--nnodes 0: a job runs on at least 1 node (leave --nnodes out for a single-node job)".into());
        }
        if self.node_rank >= self.nnodes {
            return bad(format!(
                "--node-rank {} is out of range for --nnodes {}: nodes are numbered 0 to {}, one launcher each",
                self.node_rank,
                self.nnodes,
                self.nnodes - 1
            ));
        }
        if let Some((k, _)) = self
            .rank_env
            .iter()
            .find(|(k, v)| k.is_empty() || k.contains(['=', '\0']) || v.contains('\0'))
        {
            return bad(format!("the rank variable {k:?} cannot be passed to a program (empty, or contains '=' or a NUL byte)"));
        }
        if self.program.is_empty() {
            return bad(
                "no program given: use `lockstep launch [options] -- program args...`".into(),
            );
        }
        if self.nnodes > 1 {
            match &self.token {
                None if self.node_rank == 0 => {
                    return bad("a multi-node job needs a shared token: give node 0 one (LOCKSTEP_TOKEN or --token-file), or let it generate one (JobSpec::ensure_token, which `lockstep launch` calls)".into())
                }
                None => {
                    return bad(format!(
                        "node {} of a multi-node job needs the job's token: pass the token node 0 uses (or printed, when it generated one) through LOCKSTEP_TOKEN or --token-file",
                        self.node_rank
                    ))
                }
                Some(t) => crate::store::validate_token(t).map_err(|e| LaunchError::Setup(e.to_string()))?,
            }
        }
        if let Some(r) = self
            .ranks_filter
            .as_ref()
            .and_then(|f| f.iter().find(|r| **r >= self.nproc_per_node * self.nnodes))
        {
            return bad(format!(
                "--ranks-filter names rank {r}, but the job has ranks 0..{}",
                self.nproc_per_node * self.nnodes
            ));
        }
        if self.rdzv_timeout.is_zero() {
            return bad("the rendezvous timeout must be greater than 0 seconds".into());
        }
        if self.nnodes > 1 && self.max_restarts > 0 {
            return bad(format!(
                "--max-restarts {} with --nnodes {}: restarts are only supported in single-node jobs (the launchers of several nodes do not agree on restarts yet); leave --max-restarts out, or run one node",
                self.max_restarts, self.nnodes
            ));
        }
        if self.nnodes > 1 && self.master_port == 0 {
            return bad("a multi-node job needs a fixed --master-port (0 would pick a different one on each node)".into());
        }
        Ok(())
    }
}

/// A TCP port free on this machine now (the kernel's pick for port 0, on every address, as
/// torch's store binds it). Another process may take it before the rank binds it: torchrun's
/// standalone mode takes the same chance.
fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind(("0.0.0.0", 0))?
        .local_addr()?
        .port())
}

fn encode_settings(settings: &[(&str, String)]) -> String {
    settings.iter().map(|(k, v)| format!("{k}={v}\n")).collect()
}

/// The first setting where this node (`mine`) and node 0 (`theirs`, as [`encode_settings`]
/// wrote it) differ, as the message both launchers report.
fn settings_disagree(node: usize, mine: &[(&str, String)], theirs: &str) -> Option<String> {
    let theirs: Vec<(&str, &str)> = theirs.lines().filter_map(|l| l.split_once('=')).collect();
    mine.iter().find_map(|(k, v)| {
        let t = theirs.iter().find(|(tk, _)| tk == k).map(|(_, tv)| *tv).unwrap_or("(not set: an older lockstep)");
        (t != v).then(|| {
            format!(
                "node {node} and node 0 of this job were started with different {k}: {v} on node {node}, {t} on node 0; \
                 start every node's launcher with the same --nproc-per-node, --nnodes and backend"
            )
        })
    })
}

/// Run the job on this node and return the exit code the CLI should exit with: 0, the root-cause
/// rank's code (128 + signal for a signal), or 128 + the signal that interrupted the launcher.
/// The failure summary is printed to stderr.
pub fn run_job(spec: &JobSpec) -> Result<i32, LaunchError> {
    spec.validate()?;
    // A malformed variable the ranks would read stops the job here, once, not in every rank.
    crate::types::env::check_all().map_err(|e| LaunchError::Setup(e.to_string()))?;
    let start = Instant::now();
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    if spec.nproc_per_node > cpus {
        // Ranks that wait spin, then yield: oversubscribed, every collective waits for a rank
        // that is not running. It works (tests do it), but it is slow.
        tracing::warn!(
            "{} ranks on this node, but only {cpus} CPU(s) are available to this process: ranks will share CPUs and collectives will be slow; \
             start at most {cpus} (--nproc-per-node)",
            spec.nproc_per_node
        );
    }
    sweep_stale_segments();
    let world = spec.nproc_per_node * spec.nnodes;
    // Only a single-node job gets here without a token (`validate`); its ranks never use it.
    let token = match &spec.token {
        Some(t) => t.clone(),
        None => crate::store::generate_token().map_err(|e| LaunchError::Setup(e.to_string()))?,
    };
    let mut job_id = new_job_id();
    // The ranks' MASTER_PORT: --master-port, except in a multi-node job, where the launcher's
    // store holds it (see RANK_PORT_KEY).
    let mut rank_port = spec.master_port;

    // Rendezvous between launchers (multi-node only). Node 0 listens before anything else so a
    // busy port fails fast; the other nodes fetch node 0's job id, which also proves the address,
    // port and token right before any rank starts. Ranks on one host then all use that job id
    // for the shared segment (see `Communicator::from_env`).
    let _server = if spec.nnodes > 1 {
        if spec.node_rank == 0 {
            let server = StoreServer::start(&spec.master_addr, spec.master_port, &token)
                .map_err(|e| LaunchError::Setup(e.to_string()))?;
            server.set_local(
                SETTINGS_KEY,
                encode_settings(&spec.shared_settings()).as_bytes(),
            );
            rank_port = free_port().map_err(|e| {
                LaunchError::Setup(format!(
                    "cannot find a free port for the ranks' MASTER_PORT: {e}"
                ))
            })?;
            server.set_local(RANK_PORT_KEY, rank_port.to_string().as_bytes());
            server.set_local(JOB_ID_KEY, job_id.as_bytes());
            Some(server)
        } else {
            let mut c = TcpStore::connect(
                &spec.master_addr,
                spec.master_port,
                &token,
                spec.rdzv_timeout,
            )
            .map_err(|e| LaunchError::Setup(e.to_string()))?;
            let v = c
                .wait_get(JOB_ID_KEY, spec.rdzv_timeout)
                .map_err(|e| LaunchError::Setup(e.to_string()))?;
            job_id = String::from_utf8(v).map_err(|_| {
                LaunchError::Setup("the job id in the rendezvous store is not UTF-8".into())
            })?;
            // Node 0 publishes its settings and the ranks' port before its job id, so they are there.
            let theirs = c
                .get(SETTINGS_KEY)
                .map_err(|e| LaunchError::Setup(e.to_string()))?
                .unwrap_or_default();
            let port = c
                .get(RANK_PORT_KEY)
                .map_err(|e| LaunchError::Setup(e.to_string()))?
                .unwrap_or_default();
            rank_port = String::from_utf8_lossy(&port).parse().map_err(|_| {
                LaunchError::Setup(
                    "node 0's launcher published no port for the ranks: start every node with the same lockstep version".into(),
                )
            })?;
            if let Some(msg) = settings_disagree(
                spec.node_rank,
                &spec.shared_settings(),
                &String::from_utf8_lossy(&theirs),
            ) {
                // Node 0's ranks have started: stop them through the abort key its launcher watches.
                let _ = c.set(ABORT_KEY, format!("1\n{msg}").as_bytes());
                return Err(LaunchError::Setup(msg));
            }
            None
        }
    } else {
        None
    };

    let link = if spec.nnodes > 1 {
        Some(NodeLink::new(spec, &token, &job_id)?)
    } else {
        None
    };
    let signals = SignalPipe::install()
        .map_err(|e| LaunchError::Setup(format!("cannot install signal handlers: {e}")))?;
    // Every log file is opened (safely, see output.rs) before any rank starts.
    let log_dir = spec.log_dir.as_deref().map(LogDir::prepare).transpose()?;
    let base = spec.node_rank * spec.nproc_per_node;
    let outputs = (base..base + spec.nproc_per_node)
        .map(|rank| {
            let o = RankOutput::new(
                rank,
                spec.ranks_filter.as_ref().is_none_or(|f| f.contains(&rank)),
                log_dir.as_ref(),
            )?;
            Ok::<_, LaunchError>(if spec.prefix { o } else { o.without_prefix() })
        })
        .collect::<Result<Vec<_>, _>>()?;

    // The variables every rank of every attempt gets (the job id and the restart count are
    // added per start).
    let common: Vec<(String, String)> = vec![
        ("WORLD_SIZE".into(), world.to_string()),
        ("LOCAL_WORLD_SIZE".into(), spec.nproc_per_node.to_string()),
        ("MASTER_ADDR".into(), spec.master_addr.clone()),
        ("MASTER_PORT".into(), rank_port.to_string()),
        ("GROUP_RANK".into(), spec.node_rank.to_string()),
        ("LOCKSTEP_TOKEN".into(), token.clone()),
        ("LOCKSTEP_NODE_RANK".into(), spec.node_rank.to_string()),
        ("LOCKSTEP_NNODES".into(), spec.nnodes.to_string()),
        (
            "LOCKSTEP_LAUNCHER_PID".into(),
            std::process::id().to_string(),
        ),
        (
            "LOCKSTEP_RDZV_TIMEOUT_S".into(),
            spec.rdzv_timeout.as_secs_f64().to_string(),
        ),
    ];
    let mut common = common;
    if spec.nnodes > 1 {
        // The launchers' store, which the ranks join (`Communicator::from_env`).
        common.push(("LOCKSTEP_STORE_PORT".into(), spec.master_port.to_string()));
    }
    // As torchrun: ranks that would each start one OpenMP (or BLAS, or torch intra-op) thread
    // per CPU of the node oversubscribe it as many times as there are ranks. Unless the user
    // chose, each rank gets its share of the CPUs.
    if std::env::var_os("OMP_NUM_THREADS").is_none()
        && spec.rank_env.iter().all(|(k, _)| k != "OMP_NUM_THREADS")
    {
        let share = (cpus / spec.nproc_per_node).max(1);
        tracing::debug!(
            "OMP_NUM_THREADS is not set: each rank gets OMP_NUM_THREADS={share} ({cpus} CPUs, {} ranks on this node)",
            spec.nproc_per_node
        );
        common.push(("OMP_NUM_THREADS".into(), share.to_string()));
    }
    common.extend(spec.rank_env.iter().cloned());
    // The ranks' stdout is a pipe, but what they print ends on this terminal: rank 0, the one
    // that reports, may draw progress bars (`\r` redraws are forwarded one by one, see output.rs).
    // Bars are drawn on stdout, so it is stdout that must be the terminal.
    let console_tty = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let starts = Starts {
        spec,
        base,
        console_tty,
    };

    let node = spec.node_rank;
    let tell = |p: &Proc| {
        // Ranks this launcher stopped are consequences, not news for the other nodes.
        if let (Some(l), Some(st), false) = (&link, p.status, p.terminated) {
            l.tell(
                st.code(),
                &format!(
                    "rank {} (pid {}) on node {node} {}",
                    p.rank,
                    p.pid,
                    st.describe()
                ),
            );
        }
    };
    // Every restart so far, in order (`--max-restarts`).
    let mut restarts: Vec<Restart> = Vec::new();
    loop {
        // A job restart starts from nothing the earlier attempt left: a new job id names a new
        // segment, which no process of the earlier attempt (all gone by now) can reach.
        if !restarts.is_empty() {
            job_id = new_job_id();
        }
        let mut job_env = common.clone();
        job_env.push(("LOCKSTEP_JOB_ID".into(), job_id.clone()));
        // Each guard removes the job's named segment if the launcher dies before doing it.
        let segment = crate::shm::named_segment_path(&job_id)
            .and_then(|p| CString::new(p.into_os_string().into_vec()).ok());
        let fresh = outputs
            .iter()
            .map(RankOutput::renewed)
            .collect::<Result<Vec<_>, _>>()?;
        let env = [
            job_env.as_slice(),
            &restart_env(spec, restarts.len(), false),
        ]
        .concat();
        let (mut procs, pgid) = match starts.all(&env, fresh, segment.as_deref()) {
            Ok(started) => started,
            Err((rank, e)) => {
                crate::shm::unlink_named(&job_id);
                let msg = start_failure(spec, rank, &e);
                if let Some(l) = &link {
                    l.tell(1, &format!("node {}: {msg}", spec.node_rank));
                }
                return Err(LaunchError::Setup(msg));
            }
        };
        // Replaced ranks (`--restart-policy rank`), whose guards are reaped at the end.
        let mut retired: Vec<Proc> = Vec::new();
        let outcome = loop {
            let replaceable = match spec.restart_policy {
                RestartPolicy::Rank => spec.max_restarts.saturating_sub(restarts.len()),
                RestartPolicy::Job => 0,
            };
            let opts = Options {
                fail_fast: spec.fail_fast,
                grace: spec.grace,
                pgid: Some(pgid),
                signals: Some(&signals),
                remote_abort: link.as_ref().map(|l| l.abort_fd.as_fd()),
                on_first_failure: Some(&tell),
                start,
                replaceable,
            };
            let outcome = supervise::supervise(&mut procs, &opts, |p| {
                p.status != Some(child::Exit::Code(0))
            });
            if outcome.replace.is_empty() {
                break outcome;
            }
            for i in outcome.replace {
                let r = Restart::of(&procs[i]);
                let k = restarts.len() + 1;
                tracing::warn!(
                    target: "lockstep::launch",
                    "rank {} (pid {}) {}: starting a replacement with the same rank while the other ranks run on (restart {k} of {}, --restart-policy rank)",
                    r.rank,
                    r.pid,
                    r.what,
                    spec.max_restarts
                );
                restarts.push(r);
                let env = [job_env.as_slice(), &restart_env(spec, k, true)].concat();
                let started = procs[i].output.renewed().and_then(|o| {
                    starts
                        .one(&env, procs[i].rank, pgid, o, segment.as_deref())
                        .map_err(|e| LaunchError::Setup(start_failure(spec, procs[i].rank, &e)))
                });
                match started {
                    Ok(p) => retired.push(std::mem::replace(&mut procs[i], p)),
                    Err(e) => {
                        supervise::kill_all(&mut procs);
                        supervise::wait_for_guards(&mut retired, GUARD_CLEANUP);
                        crate::shm::unlink_named(&job_id);
                        return Err(e);
                    }
                }
            }
        };
        supervise::wait_for_guards(&mut retired, GUARD_CLEANUP);
        // Normally the last rank to join has removed the name already; this covers jobs whose
        // ranks died before all joined (across nodes, each host's segment is `<id>.h<k>`, k
        // below the number of nodes).
        crate::shm::unlink_named(&job_id);
        for k in (0..spec.nnodes).filter(|_| spec.nnodes > 1) {
            crate::shm::unlink_named(&format!("{job_id}.h{k}"));
        }

        // Stopped because another node failed: exit with that node's root-cause code.
        if let (true, Some((code, what))) =
            (outcome.remote_abort, link.as_ref().and_then(|l| l.remote()))
        {
            if outcome.root.is_none_or(|r| procs[r].terminated) {
                tracing::error!("node {node} stopped its ranks because {what}");
                return Ok(code);
            }
        }
        // Stopped by SIGINT/SIGTERM/SIGHUP: exit with 128 + that signal (however the ranks
        // ended: forwarded signal, SIGKILL after the grace period), tell the other nodes, and
        // report briefly, unless a rank had already failed on its own, whose code then wins.
        if let Some(sig) = outcome.interrupted {
            let on_its_own = outcome.root.filter(|r| !procs[*r].terminated);
            let code = on_its_own
                .and_then(|r| procs[r].status)
                .map(|st| st.code())
                .unwrap_or(128 + sig);
            if let Some(l) = &link {
                l.tell(
                    code,
                    &format!(
                        "the launcher of node {node} got {}",
                        child::signal_name(sig)
                    ),
                );
            }
            if on_its_own.is_none() {
                let ends: Vec<String> = procs
                    .iter()
                    .filter_map(|p| {
                        p.status
                            .map(|st| format!("rank {} {}", p.rank, st.describe()))
                    })
                    .collect();
                tracing::warn!(
                    "stopped by {}: {}",
                    child::signal_name(sig),
                    ends.join("; ")
                );
                return Ok(code);
            }
        }
        let Some(root) = outcome.root else {
            if !restarts.is_empty() {
                tracing::warn!(
                    target: "lockstep::launch",
                    "the job succeeded after {}",
                    restart_notes(spec, &restarts).concat().trim_end()
                );
            }
            return Ok(0);
        };
        if spec.restart_policy == RestartPolicy::Job
            && restarts.len() < spec.max_restarts
            && outcome.interrupted.is_none()
        {
            let r = Restart::of(&procs[root]);
            tracing::warn!(
                target: "lockstep::launch",
                "rank {} (pid {}) {}: every rank was stopped; starting the whole job again (restart {} of {}, --restart-policy job)",
                r.rank,
                r.pid,
                r.what,
                restarts.len() + 1,
                spec.max_restarts
            );
            restarts.push(r);
            continue;
        }
        let mut failures = Vec::new();
        for (i, p) in procs.iter().enumerate() {
            let st = p.status.expect("all reaped");
            if st != child::Exit::Code(0) {
                failures.push(p.failure(st.describe(), st.code(), i == root));
            }
        }
        failures.sort_by_key(|f| if f.rank == procs[root].rank { 0 } else { 1 });
        let code = failures[0].exit_code;
        let notes = if spec.max_restarts > 0 {
            let mut n = vec![format!(
                "lockstep: gave up: {} of {} restart(s) (--max-restarts {}, --restart-policy {}) used\n",
                restarts.len(),
                spec.max_restarts,
                spec.max_restarts,
                spec.restart_policy
            )];
            n.extend(restart_notes(spec, &restarts).into_iter().skip(1));
            n
        } else {
            Vec::new()
        };
        tracing::error!("{}", summary_with_notes(&failures, &notes));
        return Ok(code);
    }
}

/// Why the launcher restarted the job or a rank: the rank that failed and how.
struct Restart {
    rank: usize,
    pid: i32,
    what: String,
}

impl Restart {
    fn of(p: &Proc) -> Restart {
        Restart {
            rank: p.rank,
            pid: p.pid,
            what: p
                .status
                .map(|st| st.describe())
                .unwrap_or_else(|| "failed".into()),
        }
    }
}

/// The restarts for the launcher's summary: a first line counting them, then one line each.
fn restart_notes(spec: &JobSpec, restarts: &[Restart]) -> Vec<String> {
    let mut v = vec![format!(
        "{} restart(s) (--restart-policy {}):\n",
        restarts.len(),
        spec.restart_policy
    )];
    v.extend(restarts.iter().enumerate().map(|(k, r)| {
        format!(
            "  restart {}: rank {} (pid {}) {}\n",
            k + 1,
            r.rank,
            r.pid,
            r.what
        )
    }));
    v
}

/// The variables that tell a rank which start it is: `count` restarts happened before it
/// (0 on the first attempt), and whether it replaces a failed rank of a running job.
fn restart_env(spec: &JobSpec, count: usize, replacement: bool) -> Vec<(String, String)> {
    let n = count.to_string();
    let max = spec.max_restarts.to_string();
    vec![
        ("LOCKSTEP_RESTART_COUNT".into(), n.clone()),
        ("TORCHELASTIC_RESTART_COUNT".into(), n),
        ("LOCKSTEP_MAX_RESTARTS".into(), max.clone()),
        ("TORCHELASTIC_MAX_RESTARTS".into(), max),
        (
            "LOCKSTEP_RESTART_POLICY".into(),
            spec.restart_policy.to_string(),
        ),
        // Set either way, so a value the launcher inherited never reaches a first start.
        (
            "LOCKSTEP_REPLACEMENT".into(),
            u8::from(replacement).to_string(),
        ),
    ]
}

/// The message of a rank that could not be started.
fn start_failure(spec: &JobSpec, rank: usize, e: &std::io::Error) -> String {
    // An errno is execve's (or fork's); other errors explain themselves.
    let hint = if e.raw_os_error().is_some() {
        "; check the program path and permissions"
    } else {
        ""
    };
    format!(
        "cannot start rank {rank} ({}): {e}{hint}",
        spec.program[0].to_string_lossy()
    )
}

/// What starting this node's ranks needs besides their environment.
struct Starts<'a> {
    spec: &'a JobSpec,
    /// Global rank of this node's first rank.
    base: usize,
    /// The launcher's stdout is a terminal (rank 0 gets `LOCKSTEP_CONSOLE_TTY=1`).
    console_tty: bool,
}

impl Starts<'_> {
    /// `env` plus the variables of global rank `rank`.
    fn rank_env(&self, env: &[(String, String)], rank: usize) -> Vec<(String, String)> {
        let mut env = env.to_vec();
        env.push(("RANK".into(), rank.to_string()));
        env.push(("LOCAL_RANK".into(), (rank - self.base).to_string()));
        if self.console_tty && rank == 0 {
            env.push(("LOCKSTEP_CONSOLE_TTY".into(), "1".into()));
        }
        env
    }

    /// Start one replacement rank in process group `pgid` (a new group of its own when that
    /// one is gone).
    fn one(
        &self,
        env: &[(String, String)],
        rank: usize,
        pgid: i32,
        output: RankOutput,
        segment: Option<&std::ffi::CStr>,
    ) -> std::io::Result<Proc> {
        let image = ExecImage::new(&self.spec.program, &self.rank_env(env, rank))?;
        let setup = RankSetup {
            pgid: Some(pgid),
            pgid_from_launcher: false,
            hold_leader: false,
            capture: true,
            stdin_null: true,
            close: &[],
            exec: Some(&image),
            unlink_on_launcher_death: segment,
        };
        let g = guard::spawn(&setup, || {})?;
        Ok(Proc::new(rank, g, None, output))
    }

    /// Start every rank of this node with `env`, the first one leading a new process group;
    /// returns them and the group, or the rank that could not start (the others are killed).
    fn all(
        &self,
        env: &[(String, String)],
        outputs: Vec<RankOutput>,
        segment: Option<&std::ffi::CStr>,
    ) -> Result<(Vec<Proc>, i32), (usize, std::io::Error)> {
        let spec = self.spec;
        let base = self.base;
        let mut procs: Vec<Proc> = Vec::with_capacity(spec.nproc_per_node);
        // Rank 0 leads the node's process group, which the others join (its guard holds it
        // unreaped until they have: `RankSetup::hold_leader`); its pid is known once its
        // guard has started it (for an exec'd rank, once its execve has begun). Every guard is forked
        // before any is waited for, rank 0's first; the others wait for the group, which they learn
        // through their control pipes as soon as rank 0's guard reports the pid, so their forks
        // overlap rank 0's start instead of following it (0.16–0.37 ms with 8 ranks on the project
        // machine, one CPU idle meanwhile).
        let mut pgid = 0;
        let mut pending = Vec::new();
        let mut failure: Option<(usize, std::io::Error)> = None;
        // Every rank's exec image is built before the first guard is forked, and freed after the
        // last one: each fork makes the launcher's heap copy-on-write again, so allocating or freeing
        // between two forks costs the launcher page faults (expensive in virtual machines) that
        // building them all first does not.
        let mut images = Vec::with_capacity(spec.nproc_per_node);
        for local in 0..spec.nproc_per_node {
            let rank = base + local;
            match ExecImage::new(&spec.program, &self.rank_env(env, rank)) {
                Ok(image) => images.push(image),
                Err(e) => {
                    failure = Some((rank, e));
                    break;
                }
            }
        }
        let outputs = if failure.is_some() {
            Vec::new()
        } else {
            outputs
        };
        for (local, (o, image)) in outputs.into_iter().zip(&images).enumerate() {
            let rank = base + local;
            let setup = RankSetup {
                pgid: if local == 0 { Some(0) } else { None },
                pgid_from_launcher: local > 0,
                hold_leader: local == 0 && spec.nproc_per_node > 1,
                capture: true,
                stdin_null: true,
                close: &[],
                exec: Some(image),
                unlink_on_launcher_death: segment,
            };
            match guard::start(&setup, || {}) {
                Ok(p) => pending.push((rank, p, o)),
                Err(e) => {
                    failure = Some((rank, e));
                    break;
                }
            }
        }
        let leader = match pending.first_mut() {
            Some((rank, p, _)) if failure.is_none() => Some(p.rank_pid().map_err(|e| (*rank, e))),
            _ => None,
        };
        // (told the others the group, rank 0's guard already reaped by its failed report)
        let (told, leader_reaped) = match leader {
            Some(Ok(pid)) => {
                pgid = pid;
                for (_, p, _) in &pending[1..] {
                    p.tell_group(pid);
                }
                (true, false)
            }
            Some(Err((rank, e))) => {
                failure = Some((rank, e));
                (false, true)
            }
            None => (false, false),
        };
        for (i, (rank, p, o)) in pending.into_iter().enumerate() {
            if i == 0 && leader_reaped {
                // Nothing left to wait for: `rank_pid` reaped the guard when it failed.
                continue;
            }
            if i > 0 && !told {
                // Waiting for a group that will not come: let it go without starting its rank.
                p.abandon();
                continue;
            }
            match p.wait() {
                Ok(g) => procs.push(Proc::new(rank, g, None, o)),
                Err(e) if failure.is_none() => failure = Some((rank, e)),
                Err(_) => {}
            }
        }
        drop(images);
        // Every rank that started has joined rank 0's group (its guard reports START only after the
        // rank's setpgid and exec): rank 0's guard may reap it now. On a failure, `kill_all` below
        // releases it with its SIGKILL.
        if let (None, Some(p)) = (&failure, procs.first()) {
            p.release_group();
        }
        if let Some(f) = failure {
            supervise::kill_all(&mut procs);
            return Err(f);
        }
        Ok((procs, pgid))
    }
}
