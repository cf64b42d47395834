//! The `lockstep` command: `launch` (start a multi-process job), `selftest` (check a job's
//! communicator), `config` (write the configuration file), `env` (print the environment and the
//! configuration in force), `bench` (collective benchmark).
//!
//! [`main`] (the binary's) and [`run_args`] (the Python package's `lockstep` console script) only
//! parse arguments, run the subcommand and map the result to an exit status. Raw CLI values (the
//! clap structs) are turned into validated settings ([`lockstep::launch::JobSpec`]) before
//! anything starts. One module per concern beside this file: [`bench`](mod@bench) (the measurements behind
//! `lockstep bench`), `logging` (what the user sees of the library's `tracing` events).

use std::ffi::OsString;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use bench::{BenchOptions, Buffers, Format};
use clap::{Parser, Subcommand};
use lockstep::config::{self, BackendChoice, MixedPrecision};
use lockstep::{CollKind, Dtype, ReduceOp};

pub mod bench;
mod logging;

#[derive(Parser, Debug)]
#[command(
    name = "lockstep",
    version,
    about = "Collective-communication runtime: launcher and tools"
)]
struct Cli {
    /// More diagnostics (-v debug, -vv trace); LOCKSTEP_LOG=FILTER overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    /// Only errors.
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    quiet: bool,
    /// Configuration file (default: $LOCKSTEP_CONFIG, else $XDG_CONFIG_HOME/lockstep/config.toml,
    /// else ~/.config/lockstep/config.toml).
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

// Options of `lockstep bench`, turned into `BenchOptions` (a plain comment: clap would show a
// doc comment here as the subcommand's help).
#[derive(Clone, Debug, clap::Args)]
#[command(after_help = BENCH_HELP)]
struct BenchArgs {
    /// Number of ranks.
    #[arg(long, default_value_t = config::DEFAULT_NUM_PROCESSES)]
    nprocs: usize,
    /// Collective to time (all_reduce, broadcast, reduce, all_gather, gather, reduce_scatter,
    /// barrier, all_to_all, scatter), or pingpong: send/recv between ranks 0 and 1, reporting the
    /// one-way latency (half the round trip) and bandwidth, like osu_latency/osu_bw.
    #[arg(long, default_value = "all_reduce", value_parser = parse_bench_op)]
    op: CollKind,
    /// Element type: lockstep's names (f32, bf16, i8, ...) or nccl-tests' (float, half,
    /// bfloat16, double, int8, uint8, int32, uint32, int64, uint64).
    #[arg(long, short = 'd', default_value = "f32", value_parser = parse_bench_dtype)]
    dtype: Dtype,
    /// Reduction operator (for all_reduce, reduce, reduce_scatter).
    #[arg(long, short = 'o', default_value = "sum")]
    redop: ReduceOp,
    /// Root rank of rooted collectives (broadcast, reduce, gather, scatter).
    #[arg(long, short = 'r', default_value_t = 0)]
    root: usize,
    /// Explicit sizes in bytes, comma-separated, e.g. 0,4K,1M (overrides -b/-e/-f).
    #[arg(long, value_delimiter = ',', value_parser = bench::parse_size)]
    sizes: Vec<usize>,
    /// Smallest size in bytes (nccl-tests' -b); 0 times a real zero-byte call.
    #[arg(long, short = 'b', visible_alias = "minbytes", default_value = "8", value_parser = bench::parse_size)]
    min_bytes: usize,
    /// Largest size in bytes (nccl-tests' -e).
    #[arg(long, short = 'e', visible_alias = "maxbytes", default_value = "256M", value_parser = bench::parse_size)]
    max_bytes: usize,
    /// Multiply the size by this factor from one row to the next (nccl-tests' -f).
    #[arg(long, short = 'f', visible_alias = "stepfactor", default_value_t = 2)]
    factor: usize,
    /// Timed iterations per size, 0: chosen from the size (nccl-tests' -n).
    #[arg(long, short = 'n', default_value_t = 0)]
    iters: usize,
    /// Untimed warm-up iterations per size (nccl-tests' -w).
    #[arg(long, short = 'w', visible_alias = "warmup_iters", default_value_t = 5)]
    warmup: usize,
    /// Verify the results, 1 or 0 (nccl-tests' -c); unverified rows show N/A in #wrong.
    #[arg(long, short = 'c', default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=1))]
    check: u8,
    /// Buffer placement: ordinary or shared.
    #[arg(long, default_value = "ordinary")]
    buffers: Buffers,
    /// Device: cpu (shared memory) or cuda (NCCL).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Output: text (nccl-tests' table), csv (one header line, one line per size) or json (one object).
    #[arg(long, default_value = "text")]
    format: Format,
    /// Each rank's time per call: mean (over the timed iterations, as nccl-tests) or median.
    #[arg(long, default_value = "mean", value_parser = ["mean", "median"])]
    stat: String,
    /// How the ranks' times combine, as nccl-tests' -a: 0 rank 0's, 1 the average, 2 the minimum,
    /// 3 the maximum (the slowest rank).
    #[arg(long, short = 'a', visible_alias = "average", default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=3))]
    avg: u8,
}

const BENCH_HELP: &str = "\
Columns, as nccl-tests prints them: size count type redop root | time algbw busbw #wrong, for the
out-of-place call and then the in-place one (N/A where lockstep has no in-place form of the
collective). root is -1 for collectives without one. Times are in microseconds, as nccl-tests reports them: the
mean over the timed iterations of each rank's time per call (--stat median for the median),
averaged over the ranks (-a 1; -a 0 rank 0's, -a 2 the fastest rank's, -a 3 the slowest's); the
header names the statistic. The last lines give the wrong elements found and the average bus
bandwidth. Barrier has no size: one row, its latency.

Examples:
  lockstep bench -b 8 -e 128M -f 2            # all-reduce, f32, 2 ranks
  lockstep bench --nprocs 4 --op broadcast -r 1 --sizes 0,4K,1M
  lockstep bench --op barrier --format json";

impl From<BenchArgs> for BenchOptions {
    fn from(a: BenchArgs) -> BenchOptions {
        BenchOptions {
            nprocs: a.nprocs,
            op: a.op,
            dtype: a.dtype,
            redop: a.redop,
            root: a.root,
            sizes: a.sizes,
            min_bytes: a.min_bytes,
            max_bytes: a.max_bytes,
            factor: a.factor,
            buffers: a.buffers,
            iters: a.iters,
            warmup: a.warmup,
            check: a.check == 1,
            device: a.device,
            stat: if a.stat == "median" {
                bench::Stat::Median
            } else {
                bench::Stat::Mean
            },
            // The parser admits 0 to 3 only.
            average: bench::Average::from_code(a.avg).unwrap_or(bench::Average::Mean),
        }
    }
}

/// `--op`: a collective's name, or `pingpong` (the point-to-point mode, carried as `send`). The
/// collectives of per-rank counts have no benchmark: they are refused here, not in the ranks.
fn parse_bench_op(s: &str) -> Result<CollKind, String> {
    match s {
        "pingpong" | "ping-pong" => Ok(CollKind::Send),
        _ => match s.parse()? {
            k @ (CollKind::AllToAllV | CollKind::AllGatherV | CollKind::GatherV) => Err(format!(
                "{} takes per-rank counts, which the benchmark does not choose: time all_to_all, all_gather or gather instead",
                k.name()
            )),
            k => Ok(k),
        },
    }
}

/// `-d`: lockstep's dtype names, or nccl-tests' (`-d float`). nccl-tests' `all` (every type in
/// one run) is refused with what to run instead.
fn parse_bench_dtype(s: &str) -> Result<Dtype, String> {
    let name = match s.to_ascii_lowercase().as_str() {
        "float" | "float32" => "f32",
        "double" | "float64" => "f64",
        "half" | "float16" => "f16",
        "bfloat16" => "bf16",
        "int8" | "char" => "i8",
        "uint8" => "u8",
        "int32" | "int" => "i32",
        "uint32" => "u32",
        "int64" => "i64",
        "uint64" => "u64",
        "all" => return Err("-d all: the benchmark times one type per run; run it once per type (-d f32, -d bf16, ...)".into()),
        _ => return s.parse(),
    };
    name.parse()
}

/// `lockstep bench`: print the results; exit code 1 if any element was wrong.
fn bench(a: BenchArgs) -> Result<i32, String> {
    let format = a.format;
    let o = BenchOptions::from(a);
    warn_oversubscribed(o.nprocs);
    let rows = bench::measure(&o)?;
    print!("{}", bench::render(&o, &rows, format));
    let wrong = bench::wrong_total(&rows);
    if wrong > 0 {
        eprintln!("lockstep bench: {wrong} wrong elements: results are incorrect");
        return Ok(1);
    }
    Ok(0)
}

/// Warn when more ranks than CPUs would run on this node.
fn warn_oversubscribed(ranks: usize) {
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    if ranks > cpus {
        eprintln!(
            "lockstep: warning: {ranks} ranks on {cpus} available CPU(s): ranks will share CPUs and collectives will be slow; use at most {cpus}"
        );
    }
}

// Deferred: a command builds only the arguments of the subcommand it runs (and `--help` all of
// them). Every rank of `lockstep launch -- lockstep selftest` parses its command line, and
// building all five subcommands' arguments is a measurable part of a rank's start
// (`benches/baselines/startup.sh`).
#[derive(Subcommand, Debug)]
#[command(defer = true)]
enum Cmd {
    /// Start NPROC ranks of a program on this node, supervise them, exit with the first failure's code.
    Launch(LaunchArgs),
    /// Join the job from the environment, run one verified all-reduce and a barrier.
    Selftest(SelftestArgs),
    /// Write the configuration file (the machine's defaults, or answers with --interactive).
    Config(ConfigArgs),
    /// Print version, OS, CPU and accelerator information, and the configuration in force.
    Env,
    /// nccl-tests-style collective benchmark (verifies every result); sizes take K, M and G
    /// suffixes (powers of 1024).
    Bench(BenchArgs),
    // -------------------------------------------------------------------------------------------
}

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

/// A number of ranks as torchrun takes it: a number, `auto` (one per GPU of this machine, else
/// [`config::DEFAULT_NUM_PROCESSES`]), `gpu` (one per GPU) or `cpu` (one per CPU).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Procs {
    Auto,
    Gpu,
    Cpu,
    N(usize),
}

fn parse_procs(s: &str) -> Result<Procs, String> {
    match s.trim() {
        "auto" => Ok(Procs::Auto),
        "gpu" => Ok(Procs::Gpu),
        "cpu" => Ok(Procs::Cpu),
        t => match t.parse::<usize>() {
            Ok(0) => Err("0 ranks cannot run anything: give at least 1, or `auto` (one per GPU, else 2), `gpu` or `cpu`".into()),
            Ok(n) => Ok(Procs::N(n)),
            Err(_) => Err(format!("{t:?} is not a number of ranks: give a whole number of at least 1, or `auto`, `gpu` or `cpu`")),
        },
    }
}

impl Procs {
    /// Ranks per machine.
    fn per_machine(self, gpus: &mut Gpus) -> Result<usize, String> {
        match self {
            Procs::N(n) => Ok(n),
            Procs::Auto => Ok(config::auto_processes_per_machine(gpus.get("`auto` ranks")?)),
            Procs::Gpu => match gpus.get("`gpu` ranks")? {
                0 => Err("`gpu` starts one rank per GPU, but this machine has none: give a number of ranks, or `cpu`".into()),
                n => Ok(n),
            },
            Procs::Cpu => Ok(std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)),
        }
    }
}

fn parse_backend(s: &str) -> Result<BackendChoice, String> {
    s.parse()
}

fn parse_precision(s: &str) -> Result<MixedPrecision, String> {
    s.parse()
}

#[derive(clap::Args, Debug)]
#[command(after_help = LAUNCH_HELP)]
struct LaunchArgs {
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

#[derive(clap::Args, Debug)]
struct ConfigArgs {
    /// Where to write (default: --config, else $LOCKSTEP_CONFIG, else
    /// $XDG_CONFIG_HOME/lockstep/config.toml, else ~/.config/lockstep/config.toml).
    #[arg(long)]
    path: Option<PathBuf>,
    /// Overwrite an existing file.
    #[arg(long)]
    force: bool,
    /// Ask Accelerate's questions on standard input (an empty answer takes the default shown).
    #[arg(long, short = 'i')]
    interactive: bool,
    /// Ranks of the whole job, over all machines (default: GPUs of this machine, else 2, times
    /// --num-machines).
    #[arg(long, visible_alias = "num_processes", value_name = "N|auto|gpu|cpu", value_parser = parse_procs)]
    num_processes: Option<Procs>,
    /// Ranks per machine, as `lockstep launch --nproc-per-node` reads it: the job gets this
    /// times --num-machines.
    #[arg(long, visible_alias = "nproc_per_node", value_name = "N|auto|gpu|cpu", value_parser = parse_procs, conflicts_with = "num_processes")]
    nproc_per_node: Option<Procs>,
    /// Machines of the job (default 1).
    #[arg(long, visible_alias = "num_machines")]
    num_machines: Option<usize>,
    /// This machine's index (default 0).
    #[arg(long, visible_alias = "machine_rank")]
    machine_rank: Option<usize>,
    /// Address of machine 0 (default 127.0.0.1).
    #[arg(long, visible_alias = "main_process_ip")]
    main_process_ip: Option<String>,
    /// Port of the rendezvous store (default 29500).
    #[arg(long, visible_alias = "main_process_port")]
    main_process_port: Option<u16>,
    /// Backend: shm, nccl or auto (default: nccl with GPUs, else shm).
    #[arg(long, value_parser = parse_backend)]
    backend: Option<BackendChoice>,
    /// Mixed precision: no, fp16 or bf16 (default: bf16 with GPUs, else no).
    #[arg(long, visible_alias = "mixed_precision", value_parser = parse_precision)]
    mixed_precision: Option<MixedPrecision>,
}

/// The `lockstep` binary: [`run_args`] with the process's arguments.
pub fn main() -> ExitCode {
    ExitCode::from(run_args(std::env::args_os()))
}

/// Run the `lockstep` command with `args` (the first is the program name, as in `argv`) and return
/// its exit status: 0 on success, 2 for a usage error (clap's), 1 when the command failed, or for
/// `launch` the job's own status. It prints what the binary prints (help, reports, errors on
/// stderr) and installs the stderr log subscriber, so it is for a process that is this command:
/// the binary, or the Python package's `lockstep` console script.
pub fn run_args<I, T>(args: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version are "errors" that print to stdout and exit 0.
            let _ = e.print();
            return e.exit_code().clamp(0, 255) as u8;
        }
    };
    if let Err(e) = logging::init_logging(cli.verbose, cli.quiet) {
        eprintln!("lockstep: error: {e}");
        return 2;
    }
    match run(cli) {
        Ok(code) => code.clamp(0, 255) as u8,
        Err(e) => {
            eprintln!("lockstep: error: {e}");
            1
        }
    }
}

fn run(cli: Cli) -> Result<i32, String> {
    let file = cli.config.as_deref();
    match cli.cmd {
        Cmd::Bench(a) => bench(a),
        Cmd::Launch(a) => launch(a, file),
        Cmd::Selftest(a) => selftest(a),
        Cmd::Config(a) => write_config(a, file),
        Cmd::Env => Ok(env_report(file)),
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

/// GPUs of this machine, probed once (a forked child counts them: this process never
/// initialises CUDA, so it may still fork and exec ranks).
struct Gpus(Option<usize>);

impl Gpus {
    fn get(&mut self, why: &str) -> Result<usize, String> {
        if let Some(n) = self.0 {
            return Ok(n);
        }
        let n = config::count_gpus()
            .map_err(|e| format!("{why} needs the number of GPUs, but the CUDA probe failed: {e}; give the value explicitly instead"))?;
        self.0 = Some(n);
        Ok(n)
    }
}

/// `MASTER_ADDR` / `MASTER_PORT` of the launcher's environment, parsed strictly (a malformed
/// value is an error naming it, never ignored).
fn env_master() -> Result<(Option<String>, Option<u16>), String> {
    use lockstep::types::env;
    let addr = env::raw("MASTER_ADDR")
        .map_err(|e| e.to_string())?
        .map(|v| env::parse_text("MASTER_ADDR", &v))
        .transpose();
    let port = env::raw("MASTER_PORT")
        .map_err(|e| e.to_string())?
        .map(|v| env::parse_count("MASTER_PORT", &v, 1, 65535))
        .transpose();
    Ok((
        addr.map_err(|e| e.to_string())?,
        port.map_err(|e| e.to_string())?.map(|p| p as u16),
    ))
}

fn launch(a: LaunchArgs, file: Option<&Path>) -> Result<i32, String> {
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
                let mut d = lockstep::cuda::DeviceBuffer::from_host(stream, &buf)
                    .map_err(|e| e.to_string())?;
                stream.synchronize().map_err(|e| e.to_string())?;
                comm.all_reduce_in_place(&mut d, lockstep::ReduceOp::Sum)
                    .map_err(|e| e.to_string())?;
                comm.synchronize().map_err(|e| e.to_string())?;
                buf = d.to_vec(stream).map_err(|e| e.to_string())?;
            }
            None => comm
                .all_reduce_in_place(&mut buf[..], lockstep::ReduceOp::Sum)
                .map_err(|e| e.to_string())?,
        }
        if let Some(i) = buf.iter().position(|x| *x != expect) {
            return Err(format!(
                "selftest: rank {rank}, all-reduce #{}: element {i} is {} but should be {expect}",
                it + 1,
                buf[i]
            ));
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

/// Questions on standard input, answers checked; a wrong answer is asked again.
struct Asker<R: BufRead> {
    input: R,
}

impl<R: BufRead> Asker<R> {
    /// Ask `question` with `default` shown; an empty answer takes it.
    fn ask<T: std::fmt::Display>(
        &mut self,
        question: &str,
        default: T,
        parse: impl Fn(&str) -> Result<T, String>,
    ) -> Result<T, String> {
        loop {
            print!("{question} [{default}]: ");
            let _ = std::io::stdout().flush();
            let mut line = String::new();
            let n = self
                .input
                .read_line(&mut line)
                .map_err(|e| format!("cannot read the answer from standard input: {e}"))?;
            if n == 0 {
                println!();
                return Err(format!(
                    "standard input ended before the answer to {question:?}; nothing was written"
                ));
            }
            let t = line.trim();
            if t.is_empty() {
                return Ok(default);
            }
            match parse(t) {
                Ok(v) => return Ok(v),
                Err(e) => println!("  {e}; try again"),
            }
        }
    }
}

fn count_at_least(min: usize) -> impl Fn(&str) -> Result<usize, String> {
    move |s| match s.parse::<usize>() {
        Ok(n) if n >= min => Ok(n),
        _ => Err(format!("{s:?} is not a whole number of at least {min}")),
    }
}

/// Accelerate's questions (`accelerate config`), for the keys lockstep has.
fn interview(input: impl BufRead, d: config::Config) -> Result<config::Config, String> {
    let mut q = Asker { input };
    let backend = q.ask(
        "Which backend will the ranks use? (shm: CPU shared memory, nccl: GPUs, auto: nccl when the machine has a GPU)",
        d.backend.unwrap_or_default(),
        parse_backend,
    )?;
    let machines = q.ask(
        "How many different machines will you use (use more than 1 for multi-node training)?",
        d.num_machines.unwrap_or(1),
        count_at_least(1),
    )?;
    let (mut rank, mut ip, mut port) = (0, d.main_process_ip.clone(), d.main_process_port);
    if machines > 1 {
        rank = q.ask(
            "What is the rank of this machine?",
            d.machine_rank.unwrap_or(0).min(machines - 1),
            |s| match s.parse::<usize>() {
                Ok(r) if r < machines => Ok(r),
                _ => Err(format!(
                    "{s:?} is not a machine rank from 0 to {}",
                    machines - 1
                )),
            },
        )?;
        ip = Some(q.ask(
            "What is the IP address of the machine that will host the main process?",
            ip.unwrap_or_else(|| config::DEFAULT_MAIN_PROCESS_IP.into()),
            |s| {
                if s.chars().any(char::is_whitespace) {
                    Err(format!("{s:?} is not an address"))
                } else {
                    Ok(s.to_string())
                }
            },
        )?);
        port = Some(q.ask(
            "What is the port you will use to communicate with the main process?",
            port.unwrap_or(config::DEFAULT_MAIN_PROCESS_PORT),
            |s| match s.parse::<u16>() {
                Ok(p) if p > 0 => Ok(p),
                _ => Err(format!("{s:?} is not a port from 1 to 65535")),
            },
        )?);
    }
    let per_machine = d
        .processes_per_machine()
        .unwrap_or(config::DEFAULT_NUM_PROCESSES);
    let total = q.ask(
        "How many processes in total will you use (all machines together)?",
        per_machine * machines,
        move |s| match count_at_least(1)(s)? {
            n if n % machines == 0 => Ok(n),
            n => Err(format!(
                "{n} processes cannot be shared evenly by {machines} machines"
            )),
        },
    )?;
    let mp = q.ask(
        "Do you wish to use mixed precision? (no, fp16, bf16)",
        d.mixed_precision.unwrap_or_default(),
        parse_precision,
    )?;
    Ok(config::Config {
        num_processes: Some(total),
        num_machines: Some(machines),
        machine_rank: Some(rank),
        main_process_ip: Some(ip.unwrap_or_else(|| config::DEFAULT_MAIN_PROCESS_IP.into())),
        main_process_port: Some(port.unwrap_or(config::DEFAULT_MAIN_PROCESS_PORT)),
        mixed_precision: Some(mp),
        backend: Some(backend),
    })
}

/// `lockstep config`: the machine's defaults (flags override them), or the answers to the
/// questions with `--interactive` (the flags' values are the defaults offered).
fn write_config(a: ConfigArgs, file: Option<&Path>) -> Result<i32, String> {
    let path = match a.path.as_deref().or(file) {
        Some(p) => p.to_path_buf(),
        None => config::locate(None).map_err(|e| e.to_string())?.0,
    };
    if !a.force && std::fs::symlink_metadata(&path).is_ok() {
        return Err(config::ConfigError::Exists { path }.to_string());
    }
    // A forked probe counts the GPUs: this process never initialises CUDA.
    let probe = config::count_gpus();
    let gpus = *probe.as_ref().unwrap_or(&0);
    if let Err(e) = &probe {
        eprintln!("lockstep: warning: the CUDA probe failed ({e}); writing the defaults of a machine without GPUs");
    }
    let machines = a.num_machines.unwrap_or(1);
    if machines == 0 {
        return Err("--num-machines 0: a job runs on at least 1 machine".into());
    }
    let mut known = Gpus(Some(gpus));
    let total = match (a.num_processes, a.nproc_per_node) {
        (Some(Procs::N(n)), _) => n,
        (Some(p), _) | (None, Some(p)) => p.per_machine(&mut known)? * machines,
        (None, None) => config::auto_processes_per_machine(gpus) * machines,
    };
    let defaults = config::Config {
        num_processes: Some(total),
        num_machines: Some(machines),
        machine_rank: Some(a.machine_rank.unwrap_or(0)),
        main_process_ip: Some(
            a.main_process_ip
                .unwrap_or_else(|| config::DEFAULT_MAIN_PROCESS_IP.into()),
        ),
        main_process_port: Some(
            a.main_process_port
                .unwrap_or(config::DEFAULT_MAIN_PROCESS_PORT),
        ),
        mixed_precision: Some(a.mixed_precision.unwrap_or(if gpus > 0 {
            MixedPrecision::Bf16
        } else {
            MixedPrecision::No
        })),
        backend: Some(a.backend.unwrap_or(if gpus > 0 {
            BackendChoice::Nccl
        } else {
            BackendChoice::Shm
        })),
    };
    let c = if a.interactive {
        interview(std::io::stdin().lock(), defaults)?
    } else {
        defaults
    };
    // The same checks as reading it back: what is written always loads.
    let text = c.to_toml();
    config::Config::from_toml(&text, &path).map_err(|e| e.to_string())?;
    c.write(&path, a.force).map_err(|e| e.to_string())?;
    let found = match &probe {
        Ok(0) => "no GPU found".to_string(),
        Ok(n) => format!("{n} GPU(s) found"),
        Err(_) => "GPU probe failed".to_string(),
    };
    println!("wrote {} ({found}):\n{text}", path.display());
    Ok(0)
}

// ---------------------------------------------------------------------------------------------
// env

/// Print the report; 1 when the configuration file cannot be used (the report says why).
fn env_report(file: Option<&Path>) -> i32 {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let os = read("/etc/os-release")
        .lines()
        .find_map(|l| {
            l.strip_prefix("PRETTY_NAME=")
                .map(|v| v.trim_matches('"').to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let kernel = read("/proc/sys/kernel/osrelease").trim().to_string();
    let cpu = read("/proc/cpuinfo")
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.into());
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let mem = read("/proc/meminfo")
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:").map(|v| v.trim().to_string()))
        .unwrap_or_default();
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "lockstep {}", env!("CARGO_PKG_VERSION"));
    let _ = writeln!(
        o,
        "os:      {os} (Linux {kernel}, {})",
        std::env::consts::ARCH
    );
    let _ = writeln!(o, "cpu:     {cpu}, {cpus} available");
    let _ = writeln!(o, "memory:  {mem}");
    let host = lockstep::rendezvous::host_id().unwrap_or_else(|e| format!("unknown: {e}"));
    let _ = writeln!(o, "host id: {host}");
    let code = match config_report(file) {
        Ok(text) => {
            let _ = write!(o, "{text}");
            0
        }
        Err(e) => {
            let _ = writeln!(o, "config:  error: {e}");
            1
        }
    };
    let _ = writeln!(o, "cuda/nccl:");
    // Library discovery and version queries only: nothing here calls cuInit, so `lockstep env`
    // never leaves CUDA initialised behind a notebook's back.
    let _ = write!(o, "{}", lockstep::report::env_report());
    code
}

/// The configuration in force: the file, and each setting with where it comes from (the
/// environment overrides the file, which overrides the default).
fn config_report(file: Option<&Path>) -> Result<String, String> {
    let l = config::load(file).map_err(|e| e.to_string())?;
    let c = &l.config;
    let mut s = format!(
        "config:  {} ({}{})\n",
        l.path.display(),
        l.origin,
        if l.exists {
            ""
        } else {
            "; not found: defaults in force; write one with `lockstep config`"
        }
    );
    let (env_addr, env_port) = env_master()?;
    let env_backend = lockstep::types::env::BACKEND
        .choice()
        .map_err(|e| e.to_string())?;
    let from = |set: bool| if set { "file" } else { "default" };
    let mut row = |key: &str, value: String, source: String| {
        s += &format!("  {key:<18} = {value:<12} ({source})\n")
    };
    let per = c.processes_per_machine();
    row(
        "num_processes",
        c.num_processes
            .unwrap_or(config::DEFAULT_NUM_PROCESSES * c.num_machines.unwrap_or(1))
            .to_string(),
        format!(
            "{}; {} per machine",
            from(c.num_processes.is_some()),
            per.unwrap_or(config::DEFAULT_NUM_PROCESSES)
        ),
    );
    row(
        "num_machines",
        c.num_machines.unwrap_or(1).to_string(),
        from(c.num_machines.is_some()).into(),
    );
    row(
        "machine_rank",
        c.machine_rank.unwrap_or(0).to_string(),
        from(c.machine_rank.is_some()).into(),
    );
    let (ip, ip_from) = match (&env_addr, &c.main_process_ip) {
        (Some(e), _) => (e.clone(), "environment: MASTER_ADDR".to_string()),
        (None, Some(f)) => (f.clone(), "file".into()),
        (None, None) => (config::DEFAULT_MAIN_PROCESS_IP.into(), "default".into()),
    };
    row("main_process_ip", format!("{ip:?}"), ip_from);
    let (port, port_from) = match (env_port, c.main_process_port) {
        (Some(e), _) => (e, "environment: MASTER_PORT"),
        (None, Some(f)) => (f, "file"),
        (None, None) => (config::DEFAULT_MAIN_PROCESS_PORT, "default"),
    };
    row("main_process_port", port.to_string(), port_from.into());
    row(
        "mixed_precision",
        format!("{:?}", c.mixed_precision.unwrap_or_default().name()),
        from(c.mixed_precision.is_some()).into(),
    );
    let (b, b_from) = match (env_backend, c.backend) {
        (Some(e), _) => (e.to_string(), "environment: LOCKSTEP_BACKEND"),
        (None, Some(f)) => (f.name().to_string(), "file"),
        (None, None) => ("shm".into(), "default"),
    };
    row("backend", format!("{b:?}"), b_from.into());
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// The subcommands' arguments are deferred (`#[command(defer = true)]`): each is still
    /// parsed, with its defaults, when its subcommand runs, and listed in that subcommand's help.
    #[test]
    fn deferred_subcommands_parse_and_document_their_arguments() {
        let cli = Cli::try_parse_from(["lockstep", "-q", "selftest", "--iters", "3"]).unwrap();
        assert!(cli.quiet);
        match cli.cmd {
            Cmd::Selftest(a) => assert_eq!((a.iters, a.count), (3, 1024)),
            other => panic!("parsed as {other:?}"),
        }
        let cli =
            Cli::try_parse_from(["lockstep", "launch", "--nproc-per-node", "2", "--", "true"])
                .unwrap();
        assert!(matches!(cli.cmd, Cmd::Launch(ref a) if a.program == ["true"]));
        assert!(Cli::try_parse_from(["lockstep", "selftest", "--nproc-per-node", "2"]).is_err());
        let mut cmd = Cli::command();
        cmd.build();
        let launch = cmd.find_subcommand_mut("launch").unwrap();
        let help = launch.render_help().to_string();
        assert!(help.contains("--nproc-per-node"), "{help}");
    }
}
