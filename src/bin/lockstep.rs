//! The `lockstep` command: `launch` (start a multi-process job), `selftest` (check a job's
//! communicator), `config` (write a default configuration file), `env` (print the environment).
//!
//! `main` only parses arguments, calls [`run`], and maps the result to an exit code. Raw CLI
//! values (the clap structs) are turned into validated settings ([`lockstep::launch::JobSpec`])
//! before anything starts.

use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand, ValueEnum};
use lockstep::bench::{BenchOptions, Buffers};
use lockstep::{CollKind, Dtype, ReduceOp};

mod common;

#[derive(Parser, Debug)]
#[command(name = "lockstep", version, about = "Collective-communication runtime: launcher and tools")]
struct Cli {
    /// More diagnostics (-v debug, -vv trace); LOCKSTEP_LOG=FILTER overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    /// Only errors.
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    quiet: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

/// Options of `lockstep bench` (turned into [`BenchOptions`]).
#[derive(Clone, Debug, clap::Args)]
struct BenchArgs {
    /// Number of ranks.
    #[arg(long, short = 'n', default_value_t = 2)]
    nprocs: usize,
    /// Collective to time (all_reduce, broadcast, reduce, all_gather, gather, reduce_scatter,
    /// barrier, all_to_all, scatter), or pingpong: send/recv between ranks 0 and 1, reporting the
    /// one-way latency (half the round trip) and bandwidth, like osu_latency/osu_bw.
    #[arg(long, default_value = "all_reduce", value_parser = parse_bench_op)]
    op: CollKind,
    /// Element type.
    #[arg(long, default_value = "f32")]
    dtype: Dtype,
    /// Reduction operator (for all_reduce, reduce, reduce_scatter).
    #[arg(long, default_value = "sum")]
    redop: ReduceOp,
    /// Explicit sizes in bytes, comma-separated (overrides --min-bytes/--max-bytes).
    #[arg(long, value_delimiter = ',')]
    sizes: Vec<usize>,
    /// Smallest size in bytes (sizes double up to --max-bytes).
    #[arg(long, default_value_t = 8)]
    min_bytes: usize,
    /// Largest size in bytes.
    #[arg(long, default_value_t = 256 << 20)]
    max_bytes: usize,
    /// Buffer placement: ordinary or shared.
    #[arg(long, default_value = "ordinary")]
    buffers: Buffers,
    /// Timed iterations per size (0: chosen from the size).
    #[arg(long, default_value_t = 0)]
    iters: usize,
    /// Untimed warm-up iterations per size.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Device: cpu (shared memory) or cuda (NCCL).
    #[arg(long, default_value = "cpu")]
    device: String,
}

impl From<BenchArgs> for BenchOptions {
    fn from(a: BenchArgs) -> BenchOptions {
        BenchOptions {
            nprocs: a.nprocs,
            op: a.op,
            dtype: a.dtype,
            redop: a.redop,
            sizes: a.sizes,
            min_bytes: a.min_bytes,
            max_bytes: a.max_bytes,
            buffers: a.buffers,
            iters: a.iters,
            warmup: a.warmup,
            device: a.device,
        }
    }
}

/// `--op`: a collective's name, or `pingpong` (the point-to-point mode, carried as `send`).
fn parse_bench_op(s: &str) -> Result<CollKind, String> {
    match s {
        "pingpong" | "ping-pong" => Ok(CollKind::Send),
        _ => s.parse(),
    }
}

/// `lockstep bench`: print the table; exit code 1 if any element was wrong.
fn bench(a: BenchArgs) -> Result<i32, String> {
    let o = BenchOptions::from(a);
    let rows = lockstep::bench::measure(&o)?;
    print!("{}", lockstep::bench::table(&o, &rows));
    let wrong: u64 = rows.iter().map(|r| r.wrong).sum();
    if wrong > 0 {
        eprintln!("lockstep bench: {wrong} wrong elements: results are incorrect");
        return Ok(1);
    }
    Ok(0)
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Start NPROC ranks of a program on this node, supervise them, exit with the first failure's code.
    Launch(LaunchArgs),
    /// Join the job from the environment, run one verified all-reduce and a barrier.
    Selftest(SelftestArgs),
    /// Write a default configuration file.
    Config(ConfigArgs),
    /// Print version, OS, CPU and accelerator information.
    Env,
    /// nccl-tests-style collective benchmark (verifies every result).
    Bench(BenchArgs),
    // -------------------------------------------------------------------------------------------
}

const LAUNCH_HELP: &str = "\
Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT,
LOCKSTEP_JOB_ID, LOCKSTEP_TOKEN, LOCKSTEP_NODE_RANK, LOCKSTEP_NNODES, LOCKSTEP_LAUNCHER_PID,
LOCKSTEP_RDZV_TIMEOUT_S (and LOCKSTEP_CONSOLE_TTY=1 when the launcher's stderr is a terminal);
Communicator::from_env() reads them. Output is printed line by line as `[rank N] ...`. The first
failing rank stops the others (SIGTERM, SIGKILL after --grace-s) and the launcher exits with its code
(128+signal for a signal).

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
  lockstep launch --nproc-per-node 4 -- ./train --epochs 2
  # two nodes (or two launchers on one host); node 0 prints the token it generated:
  lockstep launch --nproc-per-node 2 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 -- ./train
  LOCKSTEP_TOKEN=<token> lockstep launch --nproc-per-node 2 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 -- ./train
  # or the same token file (chmod 600) on every node:
  lockstep launch --nproc-per-node 2 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --token-file ~/.lockstep-token -- ./train";

#[derive(clap::Args, Debug)]
#[command(after_help = LAUNCH_HELP)]
struct LaunchArgs {
    /// Ranks to start on this node (default: `nproc_per_node` of the config file, else 1).
    #[arg(long)]
    nproc_per_node: Option<usize>,
    /// Number of nodes in the job.
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This node's index, 0..nnodes.
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Address of node 0 (its launcher hosts the rendezvous store).
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of the rendezvous store (only opened when nnodes > 1).
    #[arg(long, default_value_t = 29500)]
    master_port: u16,
    /// Shared secret of a multi-node job, at least 16 bytes, the same on every node (default:
    /// --token-file, else $LOCKSTEP_TOKEN, else generated on node 0). Visible to every user in
    /// `ps`: prefer LOCKSTEP_TOKEN or --token-file.
    #[arg(long, conflicts_with = "token_file")]
    token: Option<String>,
    /// Read the job token from this file (surrounding whitespace ignored); it should be readable
    /// only by you (chmod 600).
    #[arg(long, value_name = "PATH")]
    token_file: Option<PathBuf>,
    /// Write each rank's output to DIR/rank-N.log as well.
    #[arg(long, value_name = "DIR")]
    log_dir: Option<PathBuf>,
    /// Show only these ranks' output, e.g. `0` or `0,2-3`.
    #[arg(long, value_name = "RANKS")]
    ranks_filter: Option<String>,
    /// Let the other ranks run on when one fails (they see the failure through the backend).
    #[arg(long)]
    no_fail_fast: bool,
    /// Seconds between SIGTERM and SIGKILL when stopping ranks.
    #[arg(long, default_value_t = 3.0)]
    grace_s: f64,
    /// Seconds each rendezvous wait may take, on every node: a launcher waiting for the node-0
    /// store, and the ranks waiting for each other (default: $LOCKSTEP_RDZV_TIMEOUT_S, else 60).
    #[arg(long)]
    rdzv_timeout_s: Option<f64>,
    /// The program to run and its arguments (after `--`).
    #[arg(last = true, required = true, value_name = "PROGRAM")]
    program: Vec<OsString>,
}

#[derive(clap::Args, Debug)]
struct SelftestArgs {
    /// All-reduce this many times (each one verified).
    #[arg(long, default_value_t = 1)]
    iters: u64,
    /// Elements per all-reduce.
    #[arg(long, default_value_t = 1024)]
    count: usize,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Backend {
    Shm,
    Nccl,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Precision {
    No,
    Fp16,
    Bf16,
}

#[derive(clap::Args, Debug)]
struct ConfigArgs {
    /// Where to write (default: $LOCKSTEP_CONFIG, else $XDG_CONFIG_HOME/lockstep/config.toml, else ~/.config/lockstep/config.toml).
    #[arg(long)]
    path: Option<PathBuf>,
    /// Overwrite an existing file.
    #[arg(long)]
    force: bool,
    /// Processes per node (default: GPUs listed by `nvidia-smi -L`, else 2).
    #[arg(long)]
    nproc_per_node: Option<usize>,
    /// Backend (default: nccl with GPUs, else shm).
    #[arg(long, value_enum)]
    backend: Option<Backend>,
    /// Mixed precision (default: bf16 with GPUs, else no).
    #[arg(long, value_enum)]
    mixed_precision: Option<Precision>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(e) = common::init_logging(cli.verbose, cli.quiet) {
        eprintln!("lockstep: error: {e}");
        return ExitCode::from(2);
    }
    match run(cli) {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            eprintln!("lockstep: error: {e}");
            ExitCode::from(1)
        }
    }
}

fn run(cli: Cli) -> Result<i32, String> {
    match cli.cmd {
        Cmd::Bench(a) => bench(a),
        Cmd::Launch(a) => launch(a),
        Cmd::Selftest(a) => selftest(a),
        Cmd::Config(a) => config(a),
        Cmd::Env => {
            env_report();
            Ok(0)
        }
    }
}

// ---------------------------------------------------------------------------------------------
// launch

/// Parse `0,2-3` into sorted ranks.
fn parse_ranks(s: &str) -> Result<Vec<usize>, String> {
    let mut v = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let bad = || format!("--ranks-filter: {part:?} is not a rank or a range like 0-3");
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.trim().parse().map_err(|_| bad())?, b.trim().parse().map_err(|_| bad())?);
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

fn secs(name: &str, s: f64) -> Result<Duration, String> {
    if !(s.is_finite() && s >= 0.0) {
        return Err(format!("{name} must be a non-negative number of seconds, got {s}"));
    }
    Ok(Duration::from_secs_f64(s))
}

/// --rdzv-timeout-s, else LOCKSTEP_RDZV_TIMEOUT_S, else 60 s; it must be greater than 0.
fn rdzv_timeout(flag: Option<f64>) -> Result<Duration, String> {
    let Some(s) = flag else {
        let env = lockstep::types::env::RDZV_TIMEOUT_S.secs().map_err(|e| e.to_string())?;
        return Ok(env.unwrap_or(Duration::from_secs(60)));
    };
    if !(s.is_finite() && s > 0.0 && s <= lockstep::types::env::MAX_SECS) {
        return Err(format!("--rdzv-timeout-s must be a number of seconds greater than 0, got {s}"));
    }
    Ok(Duration::from_secs_f64(s))
}

/// The job token from --token, --token-file or LOCKSTEP_TOKEN (in that order), with warnings
/// where other users may read it.
fn job_token(token: Option<String>, token_file: Option<&std::path::Path>) -> Result<Option<String>, String> {
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
    let program: Vec<String> = spec.program.iter().map(|a| a.to_string_lossy().into_owned()).collect();
    let nodes = if spec.nnodes == 2 { "1".to_string() } else { format!("1..{}", spec.nnodes - 1) };
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

fn launch(a: LaunchArgs) -> Result<i32, String> {
    let nproc_per_node = match a.nproc_per_node {
        Some(n) => n,
        None => config_nproc()?.unwrap_or(1),
    };
    let token = job_token(a.token, a.token_file.as_deref())?;
    let mut spec = lockstep::launch::JobSpec {
        nproc_per_node,
        nnodes: a.nnodes,
        node_rank: a.node_rank,
        master_addr: a.master_addr,
        master_port: a.master_port,
        token,
        log_dir: a.log_dir,
        ranks_filter: a.ranks_filter.as_deref().map(parse_ranks).transpose()?,
        fail_fast: !a.no_fail_fast,
        grace: secs("--grace-s", a.grace_s)?,
        rdzv_timeout: rdzv_timeout(a.rdzv_timeout_s)?,
        program: a.program,
    };
    if let Some(t) = spec.ensure_token().map_err(|e| e.to_string())? {
        if spec.nnodes > 1 {
            announce_token(&spec, &t);
        }
    }
    lockstep::launch::run_job(&spec).map_err(|e| e.to_string())
}

// ---------------------------------------------------------------------------------------------
// selftest

fn selftest(a: SelftestArgs) -> Result<i32, String> {
    let t0 = Instant::now();
    let mut comm = lockstep::Communicator::from_env().map_err(|e| e.to_string())?;
    let joined = t0.elapsed();
    let (rank, n) = (comm.rank(), comm.world_size());
    let expect = (n * (n + 1) / 2) as f32;
    let mut buf = vec![0f32; a.count];
    // A device communicator (LOCKSTEP_BACKEND=nccl) reduces device memory.
    let device = match comm.device_context() {
        Some(ctx) => Some(ctx.stream().map_err(|e| e.to_string())?),
        None => None,
    };
    for it in 0..a.iters.max(1) {
        buf.iter_mut().for_each(|x| *x = (rank + 1) as f32);
        match &device {
            Some(stream) => {
                let mut d = lockstep::cuda::DeviceBuffer::from_host(stream, &buf).map_err(|e| e.to_string())?;
                stream.synchronize().map_err(|e| e.to_string())?;
                comm.all_reduce_in_place(&mut d, lockstep::ReduceOp::Sum).map_err(|e| e.to_string())?;
                comm.synchronize().map_err(|e| e.to_string())?;
                buf = d.to_vec(stream).map_err(|e| e.to_string())?;
            }
            None => comm.all_reduce_in_place(&mut buf[..], lockstep::ReduceOp::Sum).map_err(|e| e.to_string())?,
        }
        if let Some(i) = buf.iter().position(|x| *x != expect) {
            return Err(format!("selftest: rank {rank}, all-reduce #{}: element {i} is {} but should be {expect}", it + 1, buf[i]));
        }
    }
    comm.barrier().map_err(|e| e.to_string())?;
    if rank == 0 {
        println!(
            "lockstep selftest ok: {n} ranks, backend {}, {} verified all-reduce(s) of {} f32, joined in {:.1} ms, total {:.1} ms",
            comm.backend_kind(),
            a.iters.max(1),
            a.count,
            joined.as_secs_f64() * 1e3,
            t0.elapsed().as_secs_f64() * 1e3
        );
    }
    Ok(0)
}

// ---------------------------------------------------------------------------------------------
// config

fn default_config_path() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("LOCKSTEP_CONFIG") {
        return Ok(PathBuf::from(p));
    }
    if let Some(x) = std::env::var_os("XDG_CONFIG_HOME").filter(|x| !x.is_empty()) {
        return Ok(PathBuf::from(x).join("lockstep/config.toml"));
    }
    let home = std::env::var_os("HOME").ok_or("HOME is not set: pass --path")?;
    Ok(PathBuf::from(home).join(".config/lockstep/config.toml"))
}

/// `nproc_per_node` from the config file, if there is one.
fn config_nproc() -> Result<Option<usize>, String> {
    let Ok(path) = default_config_path() else { return Ok(None) };
    let Ok(text) = std::fs::read_to_string(&path) else { return Ok(None) };
    for line in text.lines() {
        if let Some((k, v)) = line.split_once('=') {
            if k.trim() == "nproc_per_node" {
                let v = v.trim().trim_matches('"');
                return v.parse().map(Some).map_err(|_| {
                    format!("{}: nproc_per_node = {v:?} is not a number; fix it or rerun `lockstep config --force`", path.display())
                });
            }
        }
    }
    Ok(None)
}

/// GPUs listed by `nvidia-smi -L` (a separate process: CUDA is never initialised here).
fn count_gpus() -> Option<usize> {
    let out = std::process::Command::new("nvidia-smi").arg("-L").stderr(std::process::Stdio::null()).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let n = String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.starts_with("GPU ")).count();
    (n > 0).then_some(n)
}

fn config(a: ConfigArgs) -> Result<i32, String> {
    let path = match a.path {
        Some(p) => p,
        None => default_config_path()?,
    };
    if path.exists() && !a.force {
        return Err(format!("{} already exists; pass --force to overwrite it", path.display()));
    }
    let gpus = count_gpus();
    let nproc = a.nproc_per_node.unwrap_or(gpus.unwrap_or(2));
    if nproc == 0 {
        return Err("--nproc-per-node must be at least 1".into());
    }
    let backend = a.backend.unwrap_or(if gpus.is_some() { Backend::Nccl } else { Backend::Shm });
    let mp = a.mixed_precision.unwrap_or(if gpus.is_some() { Precision::Bf16 } else { Precision::No });
    let name = |v: &dyn ValueEnumName| v.name();
    let text = format!(
        "# lockstep configuration, written by `lockstep config`\n# GPUs found: {}\nnproc_per_node = {nproc}\nbackend = \"{}\"\nmixed_precision = \"{}\"\n",
        gpus.map(|n| n.to_string()).unwrap_or_else(|| "none (nvidia-smi not found or no GPU)".into()),
        name(&backend),
        name(&mp)
    );
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    std::fs::write(&path, &text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    println!("wrote {}:\n{text}", path.display());
    Ok(0)
}

/// The name clap uses for a value.
trait ValueEnumName {
    fn name(&self) -> String;
}

impl<T: ValueEnum> ValueEnumName for T {
    fn name(&self) -> String {
        self.to_possible_value().map(|v| v.get_name().to_string()).unwrap_or_default()
    }
}

// ---------------------------------------------------------------------------------------------
// env

fn env_report() {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let os = read("/etc/os-release")
        .lines()
        .find_map(|l| l.strip_prefix("PRETTY_NAME=").map(|v| v.trim_matches('"').to_string()))
        .unwrap_or_else(|| "unknown".into());
    let kernel = read("/proc/sys/kernel/osrelease").trim().to_string();
    let cpu = read("/proc/cpuinfo")
        .lines()
        .find_map(|l| l.strip_prefix("model name").map(|v| v.trim_start_matches([' ', '\t', ':']).to_string()))
        .unwrap_or_else(|| std::env::consts::ARCH.into());
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let mem = read("/proc/meminfo").lines().find_map(|l| l.strip_prefix("MemTotal:").map(|v| v.trim().to_string())).unwrap_or_default();
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "lockstep {}", env!("CARGO_PKG_VERSION"));
    let _ = writeln!(o, "os:      {os} (Linux {kernel}, {})", std::env::consts::ARCH);
    let _ = writeln!(o, "cpu:     {cpu}, {cpus} available");
    let _ = writeln!(o, "memory:  {mem}");
    let host = lockstep::rendezvous::host_id().unwrap_or_else(|e| format!("unknown: {e}"));
    let _ = writeln!(o, "host id: {host}");
    let _ = writeln!(o, "cuda/nccl:");
    // Library discovery and version queries only: nothing here calls cuInit, so `lockstep env`
    // never leaves CUDA initialised behind a notebook's back.
    let _ = write!(o, "{}", lockstep::report::env_report());
}
