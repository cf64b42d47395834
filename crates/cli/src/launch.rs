//! `lockstep launch`: start the ranks of a job on this node and supervise them.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;
use lockstep::config::{self, BackendChoice, MixedPrecision};
use lockstep::launch::RestartPolicy;

use crate::args::{env_master, parse_backend, parse_precision, parse_procs, Gpus, Procs};

const LAUNCH_HELP: &str = "\
Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT,
LOCKSTEP_JOB_ID, LOCKSTEP_TOKEN, LOCKSTEP_NODE_RANK, LOCKSTEP_NNODES, LOCKSTEP_LAUNCHER_PID,
LOCKSTEP_RDZV_TIMEOUT_S, OMP_NUM_THREADS (CPUs / ranks of the node, unless set), ACCELERATE_MIXED_PRECISION
(with --mixed-precision or the configuration's) (and, for rank 0, LOCKSTEP_CONSOLE_TTY=1 when the launcher's stdout is a terminal,
LOCKSTEP_BACKEND when --backend or the configuration file chooses one, LOCKSTEP_CONFIG when a
configuration file was read); Communicator::from_env() reads them. Output is printed line by line as
`[rank N] ...`, except lines that are JSON objects, which are printed as they are so that `--json`
output parses line by line (--no-prefix: no prefix at all). The first failing rank stops the others
(SIGTERM, SIGKILL after --grace-s) and the launcher exits with its code (128+signal for a signal).

Settings come from, first to last: the flag, the environment (MASTER_ADDR, MASTER_PORT,
LOCKSTEP_BACKEND), the configuration file (`lockstep config` writes it; `lockstep env` shows the one
in force), the default. --num_processes counts the ranks of all nodes, as Accelerate's does;
--nproc-per-node (torchrun's --nproc_per_node) those of this node. torchrun's and Accelerate's
spellings are accepted (--nproc_per_node, --node_rank, --master_addr, --master_port, --standalone,
--num_machines, --machine_rank, --main_process_ip, --main_process_port, --mixed_precision). The
program starts at the first argument that is not an option; `--` before it is optional.

Restarts (single node): with --max-restarts N, a failed rank is replaced (--restart-policy rank, the
default: same RANK, LOCKSTEP_REPLACEMENT=1, the other ranks run on) or every rank is stopped and
started again under a new LOCKSTEP_JOB_ID (--restart-policy job, as torchrun), up to N times in all.
Every rank gets LOCKSTEP_RESTART_COUNT and TORCHELASTIC_RESTART_COUNT (0 on the first start),
LOCKSTEP_MAX_RESTARTS, TORCHELASTIC_MAX_RESTARTS, LOCKSTEP_RESTART_POLICY and LOCKSTEP_REPLACEMENT
(1 in a replacement, else 0). Each restart is logged; the summary says how many happened and why.

Stopping: Ctrl-C (SIGINT) and SIGTERM are forwarded to every rank, SIGHUP (a closed terminal or ssh
session) as SIGTERM; ranks still running after --grace-s are killed. A second Ctrl-C or SIGTERM kills
them at once. The launcher then exits with 128 + the signal it got (130, 143, 129), however the ranks
ended. If the launcher itself is killed (kill -9 included), each rank's guard process kills the rank
and everything it started.

A malformed LOCKSTEP_* variable (LOCKSTEP_TIMEOUT_S=3s, LOCKSTEP_BACKEND=gpu, ...) stops the launch
with an error naming it; timeouts are plain numbers of seconds greater than 0.

A multi-node job shares a secret token (at least 16 bytes) that every connection to node 0's
rendezvous store must present. Without one, node 0's launcher generates one and prints how to pass
it on. Give it through LOCKSTEP_TOKEN or --token-file (a file only you can read): --token works too
but puts it on the command line, where every user of the machine can read it with `ps`.

Examples:
  lockstep launch --nproc-per-node 4 ./train --epochs 2
  lockstep launch --nproc_per_node gpu python3 train.py  # one rank per GPU
  lockstep launch --nproc-per-node auto -- ./train       # one rank per GPU, else 2
  # two nodes (or two launchers on one host); node 0 prints the token it generated:
  lockstep launch --nproc-per-node 2 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 -- ./train
  LOCKSTEP_TOKEN=<token> lockstep launch --nproc-per-node 2 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 -- ./train
  # or the same token file (chmod 600) on every node:
  lockstep launch --nproc-per-node 2 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --token-file ~/.lockstep-token -- ./train";

#[derive(Args, Debug)]
#[command(after_help = LAUNCH_HELP)]
pub(crate) struct LaunchArgs {
    /// Ranks to start on this node: a number, `auto` (one per GPU, else 2), `gpu` (one per GPU)
    /// or `cpu` (one per CPU). Default: the configuration file's num_processes / num_machines,
    /// else 2.
    #[arg(long, visible_alias = "nproc_per_node", value_name = "N|auto|gpu|cpu", value_parser = parse_procs)]
    nproc_per_node: Option<Procs>,
    /// Ranks of the whole job, over all nodes (Accelerate's --num_processes; a multiple of
    /// --nnodes), or `auto`, `gpu`, `cpu` (per node, as for --nproc-per-node).
    #[arg(long = "num_processes", visible_alias = "num-processes", value_name = "N|auto|gpu|cpu", value_parser = parse_procs, conflicts_with = "nproc_per_node")]
    num_processes: Option<Procs>,
    /// Number of nodes in the job (Accelerate's --num_machines; default: the configuration's
    /// num_machines, else 1).
    #[arg(long, visible_aliases = ["num_machines", "num-machines"])]
    nnodes: Option<usize>,
    /// This node's index, 0..nnodes (Accelerate's --machine_rank; default: the configuration's
    /// machine_rank, else 0).
    #[arg(long, visible_aliases = ["node_rank", "machine_rank", "machine-rank"])]
    node_rank: Option<usize>,
    /// Address of node 0, whose launcher hosts the rendezvous store (Accelerate's
    /// --main_process_ip; default: $MASTER_ADDR, else the configuration's main_process_ip, else
    /// 127.0.0.1).
    #[arg(long, visible_aliases = ["master_addr", "main_process_ip", "main-process-ip"])]
    master_addr: Option<String>,
    /// Port of the rendezvous store, opened only when nnodes > 1 (Accelerate's
    /// --main_process_port; default: $MASTER_PORT, else the configuration's main_process_port,
    /// else 29500).
    #[arg(long, visible_aliases = ["master_port", "main_process_port", "main-process-port"])]
    master_port: Option<u16>,
    /// A single-node job with its own rendezvous, as torchrun's --standalone: what lockstep
    /// does without --nnodes, so this only refuses --nnodes above 1.
    #[arg(long)]
    standalone: bool,
    /// Mixed precision for Accelerate in the ranks: no, fp16 or bf16, exported as
    /// ACCELERATE_MIXED_PRECISION (default: the configuration's mixed_precision, else not set).
    #[arg(long, visible_alias = "mixed_precision", value_parser = parse_precision)]
    mixed_precision: Option<MixedPrecision>,
    /// How each rank is bound to CPUs when it joins: block (CPUs / ranks of the node each, the
    /// default), core (one CPU each) or none; passed to the ranks as LOCKSTEP_CPU_BIND (default:
    /// $LOCKSTEP_CPU_BIND).
    #[arg(long, visible_alias = "cpu_bind", value_parser = ["block", "core", "none"])]
    cpu_bind: Option<String>,
    /// Backend of the ranks: shm, nccl or auto (nccl when this machine has a GPU); passed to them
    /// as LOCKSTEP_BACKEND (default: $LOCKSTEP_BACKEND, else the configuration's backend, else shm).
    #[arg(long, value_parser = parse_backend)]
    backend: Option<BackendChoice>,
    /// Shared secret of a multi-node job, at least 16 bytes, the same on every node (default:
    /// --token-file, else $LOCKSTEP_TOKEN, else generated on node 0). Visible to every user in
    /// `ps`: prefer LOCKSTEP_TOKEN or --token-file.
    #[arg(long, conflicts_with = "token_file")]
    token: Option<String>,
    /// Read the job token from this file (surrounding whitespace ignored); it should be readable
    /// only by you (chmod 600).
    #[arg(long, value_name = "PATH")]
    token_file: Option<PathBuf>,
    /// Write each rank's output to DIR/rank-N.log as well (torchrun's --tee).
    #[arg(long, value_name = "DIR")]
    log_dir: Option<PathBuf>,
    /// Show only these ranks' output, e.g. `0` or `0,2-3`.
    #[arg(long, value_name = "RANKS")]
    ranks_filter: Option<String>,
    /// Print the ranks' lines as they wrote them, without the `[rank N] ` prefix.
    #[arg(long)]
    no_prefix: bool,
    /// Let the other ranks run on when one fails (they see the failure through the backend).
    #[arg(long)]
    no_fail_fast: bool,
    /// Restart up to N times when a rank fails, as torchrun's --max-restarts (single-node jobs;
    /// default 0: a failure ends the job). Each rank gets LOCKSTEP_RESTART_COUNT and
    /// TORCHELASTIC_RESTART_COUNT (0 on the first start).
    #[arg(long, visible_alias = "max_restarts", value_name = "N", default_value = "0", value_parser = parse_restarts)]
    max_restarts: usize,
    /// What a restart restarts: `rank` (the default: a replacement for the failed rank only,
    /// with LOCKSTEP_REPLACEMENT=1, while the others run on) or `job` (stop every rank and
    /// start them all again, as torchrun; for programs that do not handle a rank's death).
    #[arg(long, visible_alias = "restart_policy", value_name = "job|rank", value_parser = parse_restart_policy)]
    restart_policy: Option<RestartPolicy>,
    /// Seconds between SIGTERM and SIGKILL when stopping ranks.
    #[arg(long, default_value_t = 3.0)]
    grace_s: f64,
    /// Seconds each rendezvous wait may take, on every node: a launcher waiting for the node-0
    /// store, and the ranks waiting for each other (default: $LOCKSTEP_RDZV_TIMEOUT_S, else 60).
    #[arg(long)]
    rdzv_timeout_s: Option<f64>,
    /// The program to run and its arguments: everything from the first argument that is not
    /// an option on (`--` before it is optional, as with torchrun).
    #[arg(trailing_var_arg = true, required = true, value_name = "PROGRAM")]
    pub(crate) program: Vec<OsString>,
}

/// Parse `0,2-3` into sorted ranks.
fn parse_ranks(s: &str) -> Result<Vec<usize>, String> {
    let mut v = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let bad = || format!("--ranks-filter: {part:?} is not a rank or a range like 0-3");
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (
                    a.trim().parse().map_err(|_| bad())?,
                    b.trim().parse().map_err(|_| bad())?,
                );
                if a > b {
                    return Err(bad());
                }
                v.extend(a..=b);
            }
            None => v.push(part.parse().map_err(|_| bad())?),
        }
    }
    v.sort_unstable();
    v.dedup();
    Ok(v)
}

/// --max-restarts: a plain non-negative whole number (no sign, no blanks).
fn parse_restarts(s: &str) -> Result<usize, String> {
    let bad = || {
        format!(
            "{s:?} is not a number of restarts: give a whole number, 0 or more (0: no restarts)"
        )
    };
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    s.parse().map_err(|_| bad())
}

fn parse_restart_policy(s: &str) -> Result<RestartPolicy, String> {
    s.parse()
}

/// The restart policy: the flag's, else `rank` (the in-job path) when there are restarts.
/// `rank` with no restart would replace nothing: refused.
fn restart_policy(max: usize, flag: Option<RestartPolicy>) -> Result<RestartPolicy, String> {
    match (flag, max) {
        (Some(RestartPolicy::Rank), 0) => Err(
            "--restart-policy rank with --max-restarts 0 replaces nothing: give --max-restarts N (N of 1 or more), or leave --restart-policy out"
                .into(),
        ),
        (Some(p), _) => Ok(p),
        (None, 0) => Ok(RestartPolicy::Job),
        (None, _) => Ok(RestartPolicy::Rank),
    }
}

fn secs(name: &str, s: f64) -> Result<Duration, String> {
    if !(s.is_finite() && s >= 0.0) {
        return Err(format!(
            "{name} must be a non-negative number of seconds, got {s}"
        ));
    }
    Ok(Duration::from_secs_f64(s))
}

/// --rdzv-timeout-s, else LOCKSTEP_RDZV_TIMEOUT_S, else 60 s; it must be greater than 0.
fn rdzv_timeout(flag: Option<f64>) -> Result<Duration, String> {
    let Some(s) = flag else {
        let env = lockstep::types::env::RDZV_TIMEOUT_S
            .secs()
            .map_err(|e| e.to_string())?;
        return Ok(env.unwrap_or(Duration::from_secs(60)));
    };
    if !(s.is_finite() && s > 0.0 && s <= lockstep::types::env::MAX_SECS) {
        return Err(format!(
            "--rdzv-timeout-s must be a number of seconds greater than 0, got {s}"
        ));
    }
    Ok(Duration::from_secs_f64(s))
}

/// The job token from --token, --token-file or LOCKSTEP_TOKEN (in that order), with warnings
/// where other users may read it.
fn job_token(
    token: Option<String>,
    token_file: Option<&std::path::Path>,
) -> Result<Option<String>, String> {
    if let Some(t) = token {
        eprintln!(
            "lockstep: warning: --token puts the job token on the command line, where every user of this machine can read it (`ps`, /proc/PID/cmdline); pass it through LOCKSTEP_TOKEN or --token-file instead"
        );
        return Ok(Some(t));
    }
    if let Some(p) = token_file {
        let f = lockstep::store::read_token_file(p).map_err(|e| e.to_string())?;
        if f.accessible_by_others() {
            eprintln!(
                "lockstep: warning: token file {} has mode {:o}, so other users may read the job token; make it private with `chmod 600 {}`",
                p.display(),
                f.mode,
                p.display()
            );
        }
        return Ok(Some(f.token));
    }
    // Empty counts as unset, as usual for environment variables; a value that is not UTF-8 is an
    // error naming the variable (not a silently missing token).
    lockstep::types::env::raw("LOCKSTEP_TOKEN").map_err(|e| e.to_string())
}

/// Tell the user how to start the other nodes with the token node 0 generated.
fn announce_token(spec: &lockstep::launch::JobSpec, token: &str) {
    let program: Vec<String> = spec
        .program
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let nodes = if spec.nnodes == 2 {
        "1".to_string()
    } else {
        format!("1..{}", spec.nnodes - 1)
    };
    eprintln!(
        "lockstep: no job token was given, so node 0 generated one. Start the launchers of node(s) {nodes} with it, through the environment (not --token: other users can read command lines with `ps`):
  LOCKSTEP_TOKEN={token} lockstep launch --nproc-per-node {} --nnodes {} --node-rank <N> --master-addr {} --master-port {} -- {}
or save it in a file only you can read and pass --token-file FILE:
  (umask 077; echo {token} > FILE)",
        spec.nproc_per_node,
        spec.nnodes,
        spec.master_addr,
        spec.master_port,
        program.join(" ")
    );
}

pub(crate) fn run(a: LaunchArgs, file: Option<&Path>) -> Result<i32, String> {
    let loaded = config::load(file).map_err(|e| e.to_string())?;
    let cfg = &loaded.config;
    let mut gpus = Gpus(None);
    let nnodes = a.nnodes.or(cfg.num_machines).unwrap_or(1);
    if nnodes == 0 {
        return Err(
            "--nnodes 0: a job runs on at least 1 node (leave --nnodes out for a single-node job)"
                .into(),
        );
    }
    if a.standalone && nnodes > 1 {
        return Err(format!(
            "--standalone is a single-node job, but --nnodes (or the configuration) asks for {nnodes} nodes: leave one out"
        ));
    }
    let node_rank = a.node_rank.or(cfg.machine_rank).unwrap_or(0);
    let nproc_per_node = match (a.nproc_per_node, a.num_processes) {
        (Some(p), _) => p.per_machine(&mut gpus)?,
        (None, Some(Procs::N(total))) => {
            if total % nnodes != 0 {
                return Err(format!(
                    "--num_processes {total} counts the ranks of all {nnodes} nodes, so it must be a multiple of --nnodes {nnodes} (or give --nproc-per-node, the ranks of this node)"
                ));
            }
            total / nnodes
        }
        (None, Some(p)) => p.per_machine(&mut gpus)?,
        (None, None) => cfg
            .processes_per_machine()
            .unwrap_or(config::DEFAULT_NUM_PROCESSES),
    };
    let (env_addr, env_port) = env_master()?;
    let master_addr = a
        .master_addr
        .or(env_addr)
        .or(cfg.main_process_ip.clone())
        .unwrap_or_else(|| config::DEFAULT_MAIN_PROCESS_IP.into());
    let master_port = a
        .master_port
        .or(env_port)
        .or(cfg.main_process_port)
        .unwrap_or(config::DEFAULT_MAIN_PROCESS_PORT);

    let mut rank_env = Vec::new();
    // The backend: the flag, else LOCKSTEP_BACKEND (the ranks inherit it), else the file's.
    let env_backend = lockstep::types::env::BACKEND
        .choice()
        .map_err(|e| e.to_string())?;
    let chosen = match (a.backend, env_backend, cfg.backend) {
        (Some(b), _, _) => Some((b, "--backend".to_string())),
        (None, Some(e), file_backend) => {
            if let Some(f) = file_backend.filter(|f| f.name() != e) {
                tracing::info!(
                    "LOCKSTEP_BACKEND={e} overrides backend = \"{f}\" of {}",
                    loaded.path.display()
                );
            }
            None
        }
        (None, None, Some(b)) => {
            Some((b, format!("backend = \"{b}\" of {}", loaded.path.display())))
        }
        (None, None, None) => None,
    };
    if let Some((b, from)) = chosen {
        let n = if b == BackendChoice::Auto {
            gpus.get(&format!("{from} (auto)"))?
        } else {
            0
        };
        let resolved = b.resolve(n);
        tracing::debug!("the ranks use the {resolved} backend ({from})");
        rank_env.push(("LOCKSTEP_BACKEND".to_string(), resolved.to_string()));
    }
    if let Some(b) = &a.cpu_bind {
        rank_env.push(("LOCKSTEP_CPU_BIND".to_string(), b.clone()));
    }
    // Accelerate in the ranks reads its precision from here, as under `accelerate launch`.
    if let Some(mp) = a.mixed_precision.or(cfg.mixed_precision) {
        rank_env.push((
            "ACCELERATE_MIXED_PRECISION".to_string(),
            mp.name().to_string(),
        ));
    }
    // The ranks (train-cnn) read the same file, wherever it was named.
    if loaded.exists {
        let abs = std::path::absolute(&loaded.path)
            .map_err(|e| format!("cannot resolve {}: {e}", loaded.path.display()))?;
        let abs = abs.to_str().ok_or_else(|| {
            format!(
                "the config file path {} is not UTF-8; use another path",
                abs.display()
            )
        })?;
        rank_env.push(("LOCKSTEP_CONFIG".to_string(), abs.to_string()));
    }
    let token = job_token(a.token, a.token_file.as_deref())?;
    let mut spec = lockstep::launch::JobSpec {
        nproc_per_node,
        nnodes,
        node_rank,
        master_addr,
        master_port,
        token,
        log_dir: a.log_dir,
        ranks_filter: a.ranks_filter.as_deref().map(parse_ranks).transpose()?,
        fail_fast: !a.no_fail_fast,
        grace: secs("--grace-s", a.grace_s)?,
        rdzv_timeout: rdzv_timeout(a.rdzv_timeout_s)?,
        program: a.program,
        rank_env,
        prefix: !a.no_prefix,
        max_restarts: a.max_restarts,
        restart_policy: restart_policy(a.max_restarts, a.restart_policy)?,
    };
    if let Some(t) = spec.ensure_token().map_err(|e| e.to_string())? {
        if spec.nnodes > 1 {
            announce_token(&spec, &t);
        }
    }
    lockstep::launch::run_job(&spec).map_err(|e| e.to_string())
}
