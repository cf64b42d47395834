//! `train-cnn`: data-parallel training of the FashionMNIST CNN on CPU ranks or CUDA GPUs.
//!
//! `main` only parses arguments, calls `run`, and maps the result to an exit code. Raw CLI
//! values (`Args`) are validated into a [`lockstep_train::trainer::TrainConfig`] in one place.
//! With `--nprocs N` the binary forks its own ranks through `lockstep::launch::launch`; under
//! `lockstep launch` (environment `LOCKSTEP_JOB_ID`, `RANK`, `WORLD_SIZE`) it joins instead.
//! Rank 0 alone prints (`console.rs`): a progress bar on a terminal (also under `lockstep
//! launch`), per-step lines off one (`--log-every`), one line (or, with `--json`, one JSON object)
//! per epoch, and the peak RSS of every rank; `--metrics` and `--plot` write files.
//!
//! The rank function works on a [`RankContext`] (forked, or built from the launcher's
//! environment) and uses its helpers: `set_seed` (every rank must pass the same seed),
//! `is_main_process` for output, and an all-gather of each rank's peak RSS.
//!
//! Precision (`--precision no|fp16|bf16`, the config's `mixed_precision`) is never a silent
//! fallback: the CPU engine trains in fp32 and refuses the others; CUDA trains bf16, and fp16 with
//! dynamic loss scaling (`lockstep_train::precision`): overflowing steps are skipped and counted
//! (`skipped_steps` in the epoch line and the metrics file).
//!
//! `--device cuda` trains with the `kernels/*.cu` kernels (`lockstep_train::device`): each rank
//! initialises CUDA itself after the fork, on GPU `local_rank % device_count`, and averages
//! gradients with NCCL (one GPU per rank) or the staged shared-memory backend (ranks sharing a
//! GPU). `--device auto` picks CUDA when a forked probe process finds a driver and a device, so
//! the parent never initialises CUDA before forking.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, ValueEnum};

mod common;
#[path = "train_cnn/console.rs"]
mod console;
#[path = "train_cnn/plot.rs"]
mod plot;

use console::{Console, ConsoleOptions};
use lockstep::comm::Communicator;
use lockstep::cuda;
use lockstep::launch::{launch, LaunchConfig, RankContext};
use lockstep_train::checkpoint;
use lockstep_train::data::{self, Dataset, DEFAULT_DATA_DIR};
use lockstep_train::device::{self, DeviceOptions, GpuExec};
use lockstep_train::gemm;
use lockstep_train::precision::{self, MixedPrecision};
use lockstep_train::schedule::Schedule;
use lockstep_train::trainer::{self, Observer, OptimizerKind, Silent, TrainConfig};

/// Where to train.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Device {
    /// Shared-memory CPU ranks.
    Cpu,
    /// CUDA GPUs (the kernels in kernels/*.cu).
    Cuda,
    /// CUDA when a driver and a device are found, else CPU.
    Auto,
}

/// Learning-rate schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Sched {
    /// The base rate throughout (the reference PyTorch script's).
    Constant,
    /// Cosine annealing to 0 over the run.
    Cosine,
    /// One-cycle (warm-up then cosine annealing).
    Onecycle,
}

/// Optimizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Optim {
    /// Adam (PyTorch defaults, as the reference PyTorch script).
    Adam,
    /// SGD with momentum (--momentum) and weight decay (--weight-decay).
    Sgd,
}

/// Raw command-line values.
#[derive(Parser, Debug)]
#[command(
    name = "train-cnn",
    version,
    about = "Train the FashionMNIST CNN with data-parallel CPU ranks or CUDA GPUs (lockstep)"
)]
struct Args {
    /// Ranks to fork (ignored when started by `lockstep launch`) [default: the config file's
    /// num_processes / num_machines, else 2].
    #[arg(long = "nprocs", value_name = "N")]
    nprocs_flag: Option<usize>,
    /// `--nprocs`, or what the configuration file or the default says (set by `apply_config`).
    #[arg(skip)]
    nprocs: usize,
    /// The configuration file `lockstep config` writes [default: $LOCKSTEP_CONFIG, else the
    /// user's lockstep/config.toml]; it supplies the defaults of --nprocs and --precision.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Epochs to train.
    #[arg(long, default_value_t = 4)]
    epochs: u64,
    /// Images per rank per step.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 0.005)]
    lr: f32,
    /// Optimizer.
    #[arg(long, value_enum, default_value_t = Optim::Adam)]
    optimizer: Optim,
    /// SGD momentum (with --optimizer sgd).
    #[arg(long, default_value_t = 0.9)]
    momentum: f32,
    /// L2 penalty added to the gradient (Adam and SGD, as PyTorch's weight_decay).
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f32,
    /// Micro-batches of --batch-size per optimizer step; gradients are averaged over ranks once
    /// per step, after the last (DDP's no_sync). CPU only.
    #[arg(long, default_value_t = 1)]
    grad_accum: usize,
    /// Clip the global L2 norm of the averaged gradients to this (clip_grad_norm_; in fp16 after
    /// the unscale). CPU and CUDA.
    #[arg(long)]
    clip_grad_norm: Option<f32>,
    /// Seed for initialisation and shuffling.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// cpu, cuda or auto.
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    /// Directory with the IDX files (gzipped or raw).
    #[arg(long, default_value = DEFAULT_DATA_DIR)]
    data: PathBuf,
    /// Use only the first N training images.
    #[arg(long)]
    limit_train: Option<usize>,
    /// Save a checkpoint (safetensors, PyTorch names) here after every epoch.
    #[arg(long)]
    save: Option<PathBuf>,
    /// Resume from a checkpoint written by --save.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Print one JSON object per epoch on stdout instead of text.
    #[arg(long)]
    json: bool,
    /// A line per N steps (`epoch 1/4 step 100/469 loss 0.4384 ...`; a JSON object with --json).
    /// Default: every 100 steps when stdout is not a terminal, none under the progress bar.
    #[arg(long, value_name = "N")]
    log_every: Option<usize>,
    /// Write JSON lines here: one per reported step, one per epoch, a summary (rewritten
    /// atomically after every epoch).
    #[arg(long, value_name = "FILE")]
    metrics: Option<PathBuf>,
    /// Draw training loss and test accuracy per epoch into this SVG file.
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
    /// More diagnostics (-v debug, -vv trace); LOCKSTEP_LOG=FILTER overrides.
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,
    /// Only errors.
    #[arg(short, long, conflicts_with = "verbose")]
    quiet: bool,
    /// GEMM threads per rank.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Learning-rate schedule.
    #[arg(long, value_enum, default_value_t = Sched::Constant)]
    schedule: Sched,
    /// Synchronise BatchNorm statistics over ranks (SyncBatchNorm).
    #[arg(long)]
    sync_bn: bool,
    /// Gradient bucket size in MiB.
    #[arg(long, default_value_t = 25)]
    bucket_mib: usize,
    /// Mixed precision: no (fp32), bf16 (CUDA: bf16 GEMM operands, f32 accumulation and master
    /// weights) or fp16 (CUDA: fp16 GEMM operands with dynamic loss scaling; a step whose
    /// gradients overflow is skipped and counted). The CPU trains in fp32 only and refuses the
    /// others rather than ignore them.
    /// [default: the config file's mixed_precision, else no]
    #[arg(long = "precision", value_name = "no|fp16|bf16")]
    precision_flag: Option<MixedPrecision>,
    /// `--precision`, or the configuration file's `mixed_precision` (set by `apply_config`).
    #[arg(skip)]
    precision: MixedPrecision,
    /// On CUDA, read the training loss back every N steps.
    #[arg(long, default_value_t = 50)]
    loss_every: usize,
    /// On CUDA, launch kernels one by one instead of replaying a captured CUDA graph (debugging).
    #[arg(long)]
    no_graphs: bool,
}

/// Errors of the command, each telling the user what to do.
#[derive(Debug, thiserror::Error)]
enum CliError {
    #[error("--device cuda: {0}; use --device cpu (or auto)")]
    NoCuda(String),
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    Output(String),
    #[error(transparent)]
    Data(#[from] data::DataError),
    #[error("joining the job from the environment failed: {0}")]
    Join(String),
    #[error(transparent)]
    Train(#[from] trainer::TrainError),
    #[error("{0}")]
    Launch(#[from] lockstep::launch::LaunchError),
}

/// Validated configuration.
struct Config {
    train: TrainConfig,
    cuda: bool,
    device: DeviceOptions,
    graphs: bool,
    nprocs: usize,
    threads: usize,
    console: ConsoleOptions,
}

/// The flags that only the CPU engine implements, as given.
fn cpu_only_flags(a: &Args) -> Vec<&'static str> {
    let mut v = Vec::new();
    if a.sync_bn {
        v.push("--sync-bn");
    }
    if a.optimizer != Optim::Adam {
        v.push("--optimizer sgd");
    }
    if a.grad_accum != 1 {
        v.push("--grad-accum");
    }
    v
}

fn validate(a: &Args, train_len: usize, cuda: bool) -> Result<Config, CliError> {
    let cpu_only = cpu_only_flags(a);
    if cuda && !cpu_only.is_empty() {
        return Err(CliError::Usage(format!(
            "{} {} CPU-only for now; drop them or use --device cpu",
            cpu_only.join(", "),
            if cpu_only.len() == 1 { "is" } else { "are" }
        )));
    }
    let precision = if cuda {
        device::Precision::from(a.precision)
    } else {
        precision::check_cpu(a.precision)
            .map_err(|e| CliError::Usage(format!("--precision: {e}")))?;
        device::Precision::Fp32
    };
    if a.loss_every == 0 {
        return Err(CliError::Usage("--loss-every must be at least 1".into()));
    }
    if a.log_every == Some(0) {
        return Err(CliError::Usage(
            "--log-every 0 would log nothing; pass at least 1 (or drop the flag)".into(),
        ));
    }
    if a.nprocs == 0 || a.batch_size == 0 || a.threads == 0 {
        return Err(CliError::Usage(
            "--nprocs, --batch-size and --threads must be at least 1".into(),
        ));
    }
    if a.grad_accum == 0 {
        return Err(CliError::Usage(
            "--grad-accum 0 would never step; pass at least 1 (1 = no accumulation)".into(),
        ));
    }
    if a.epochs == 0 {
        return Err(CliError::Usage(
            "--epochs 0 would train nothing; pass at least 1".into(),
        ));
    }
    if train_len == 0 {
        return Err(CliError::Usage(
            "--limit-train 0 leaves no training images; pass at least 1 (or drop the flag)".into(),
        ));
    }
    if !(a.lr.is_finite() && a.lr > 0.0) {
        return Err(CliError::Usage(format!(
            "--lr must be a positive number, got {}",
            a.lr
        )));
    }
    if !(a.weight_decay.is_finite() && a.weight_decay >= 0.0) {
        return Err(CliError::Usage(format!(
            "--weight-decay must be 0 or a positive number, got {}",
            a.weight_decay
        )));
    }
    if a.optimizer == Optim::Sgd && !(a.momentum.is_finite() && (0.0..1.0).contains(&a.momentum)) {
        return Err(CliError::Usage(format!(
            "--momentum must be in [0, 1), got {}",
            a.momentum
        )));
    }
    if let Some(c) = a.clip_grad_norm {
        if !(c.is_finite() && c > 0.0) {
            return Err(CliError::Usage(format!(
                "--clip-grad-norm must be a positive number, got {c}"
            )));
        }
    }
    if a.optimizer == Optim::Sgd && (a.save.is_some() || a.resume.is_some()) {
        return Err(CliError::Usage("--save and --resume keep Adam's state only; use --optimizer adam with them, or drop them".into()));
    }
    if let Some(p) = &a.metrics {
        console::check_output_path("--metrics", p).map_err(CliError::Usage)?;
    }
    if let Some(p) = &a.plot {
        console::check_output_path("--plot", p).map_err(CliError::Usage)?;
        plot::check_format(p).map_err(CliError::Usage)?;
    }
    // Catch path mistakes before an epoch of work, not after it: the directory exists and takes
    // a new file, no checkpoint name is a directory, and one checkpoint fits.
    let fault = checkpoint::fault::fault_from_env().map_err(|e| CliError::Usage(e.to_string()))?;
    if let Some(save) = &a.save {
        let params = lockstep_train::model::Model::fashion_cnn(1)
            .map_err(trainer::TrainError::from)?
            .num_params();
        checkpoint::check_target(save, checkpoint::estimate_bytes(params))
            .map_err(|e| CliError::Usage(format!("--save: {e}")))?;
    } else if let Some(step) = fault {
        return Err(CliError::Usage(format!(
            "{}={step} needs --save (it kills a save)",
            checkpoint::fault::FAULT_ENV
        )));
    }
    if let Some(resume) = &a.resume {
        // The live model file, or the kept previous one, must be there; `checkpoint::resume`
        // picks the newest complete pair.
        if !resume.is_file() && !checkpoint::prev_path(resume).is_file() {
            return Err(CliError::Usage(format!(
                "--resume {}: no such file (nor {}); pass the file written by --save (its .optim.safetensors companion must sit beside it)",
                resume.display(),
                checkpoint::prev_path(resume).display()
            )));
        }
    }
    let steps_per_epoch = train_len
        .div_ceil(a.nprocs)
        .div_ceil(a.batch_size)
        .div_ceil(a.grad_accum) as u64;
    let total = steps_per_epoch * a.epochs;
    let schedule = match a.schedule {
        Sched::Constant => Schedule::Constant,
        Sched::Cosine => Schedule::Cosine { total, min_lr: 0.0 },
        Sched::Onecycle => Schedule::OneCycle {
            total,
            pct_start: 0.3,
            div: 25.0,
            final_div: 1e4,
        },
    };
    Ok(Config {
        train: TrainConfig {
            epochs: a.epochs,
            batch_size: a.batch_size,
            lr: a.lr,
            seed: a.seed,
            schedule,
            bucket_bytes: a.bucket_mib.max(1) << 20,
            save: a.save.clone(),
            resume: a.resume.clone(),
            sync_bn: a.sync_bn,
            optimizer: match a.optimizer {
                Optim::Adam => OptimizerKind::Adam,
                Optim::Sgd => OptimizerKind::Sgd {
                    momentum: a.momentum,
                },
            },
            weight_decay: a.weight_decay,
            grad_accum: a.grad_accum,
            clip_grad_norm: a.clip_grad_norm,
        },
        cuda,
        device: DeviceOptions {
            precision,
            loss_every: a.loss_every,
            ..Default::default()
        },
        graphs: !a.no_graphs,
        nprocs: a.nprocs,
        threads: a.threads,
        console: ConsoleOptions {
            json: a.json,
            log_every: a.log_every,
            bar: console::bar_wanted(a.json).map_err(CliError::Usage)?,
            metrics: a.metrics.clone(),
            plot: a.plot.clone(),
        },
    })
}

/// Join the job's communicator from `lockstep launch`'s environment, if it set one.
///
/// `None` when no launcher (`lockstep launch`, torchrun, mpirun, srun) started this process: then
/// we fork our own ranks.
fn comm_from_env() -> Option<Result<Communicator, String>> {
    use lockstep::rendezvous::{launched, EnvInfo, Launcher};
    if !launched() {
        return None;
    }
    // A one-task Slurm allocation (an sbatch script running train-cnn directly) is no job to
    // join: fork our own ranks as asked.
    if let Ok(i) = EnvInfo::from_env() {
        if i.world_size == 1 && i.launcher != Launcher::Lockstep {
            return None;
        }
    }
    Some(Communicator::from_env().map_err(|e| e.to_string()))
}

/// Whether `lockstep launch --restart-policy rank` started this process to replace a lost rank
/// (it then receives the survivors' training state: `trainer`'s in-job recovery).
fn is_replacement() -> bool {
    std::env::var("LOCKSTEP_REPLACEMENT").as_deref() == Ok("1")
}

/// Peak resident set size of this process in KiB (VmHWM), if readable.
fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// Rank 0's console, or nothing on the other ranks.
fn console_for(ctx: &RankContext, cfg: &Config) -> Option<Console> {
    ctx.is_main_process()
        .then(|| Console::new(cfg.console.clone()))
}

/// Every rank's peak RSS (KiB, rank order) through `comm`, at the end of the run.
fn gather_rss(comm: &mut Communicator) -> Result<Vec<u64>, lockstep::CommError> {
    let mut all = vec![0u64; comm.world_size()];
    comm.all_gather(&[peak_rss_kib()][..], &mut all[..])?;
    Ok(all)
}

/// What a rank returns: its final test accuracy.
type RankOut = Result<f64, Box<dyn std::error::Error + Send + Sync>>;

/// One CUDA rank: its own context (CUDA is first initialised here, after the fork), a device
/// communicator built from the host one, then the device engine.
fn run_rank_cuda(
    mut ctx: RankContext,
    cfg: &Config,
    train_set: &Dataset,
    test_set: &Dataset,
) -> RankOut {
    if is_replacement() {
        // As on the CPU: the survivors checked the seed at the start; the recovery exchange
        // checks this rank's against theirs.
        lockstep_train::rng::set_global_seed(cfg.train.seed);
    } else {
        lockstep_train::set_seed(&mut ctx.comm, cfg.train.seed)?;
    }
    let mut console = console_for(&ctx, cfg);
    // The same backend policy as every other entry point (NCCL, NCCL's multi-rank mode, or
    // staging), so `train-cnn` and `lockstep` never disagree about a job.
    let (mut comm, dctx) = lockstep::rendezvous::device_communicator(ctx.comm, ctx.local_rank)?;
    let make = |len| Ok(GpuExec::new(&dctx, len, cfg.graphs)?);
    let obs: &mut dyn Observer = match console.as_mut() {
        Some(c) => c,
        None => &mut Silent,
    };
    let out = device::train_device(
        &cfg.train,
        &cfg.device,
        train_set,
        test_set,
        make,
        Some(&mut comm),
        obs,
    )?;
    // Through the device communicator (which a recovery may have grown): device buffers.
    let rss = comm.all_gather_u64(peak_rss_kib(), "the peak-RSS summary")?;
    if let Some(c) = console.as_mut() {
        c.finish(&rss).map_err(CliError::Output)?;
    }
    Ok(out.reports.last().map(|r| r.test_acc).unwrap_or(0.0))
}

/// Whether `--device auto` should use CUDA: a driver library loads and a forked probe process
/// (this one stays uninitialised, so forking ranks stays allowed) sees at least one device.
fn cuda_usable() -> Result<(), String> {
    if !cuda::driver_present() {
        return Err("no CUDA driver library".into());
    }
    let s = cuda::init::probe_child()?;
    if s.contains(" 0 device(s)") {
        return Err(s);
    }
    Ok(())
}

/// One CPU rank's work; returns its final test accuracy.
fn run_rank(
    mut ctx: RankContext,
    cfg: &Config,
    train_set: &Dataset,
    test_set: &Dataset,
) -> RankOut {
    gemm::set_threads(cfg.threads);
    if is_replacement() {
        // The survivors checked the seed when the job started and do not take part again; the
        // recovery exchange checks this rank's against theirs.
        lockstep_train::rng::set_global_seed(cfg.train.seed);
    } else {
        lockstep_train::set_seed(&mut ctx.comm, cfg.train.seed)?;
    }
    let mut console = console_for(&ctx, cfg);
    let obs: &mut dyn Observer = match console.as_mut() {
        Some(c) => c,
        None => &mut Silent,
    };
    let out = trainer::train(&cfg.train, train_set, test_set, &mut ctx.comm, obs)?;
    let rss = gather_rss(&mut ctx.comm)?;
    if let Some(c) = console.as_mut() {
        c.finish(&rss).map_err(CliError::Output)?;
    }
    Ok(out.reports.last().map(|r| r.test_acc).unwrap_or(0.0))
}

/// Fill in what the command line left to the configuration file (`lockstep config`): flags win,
/// then the file, then the defaults `lockstep launch` uses too. Under `lockstep launch` the
/// launcher passes the file it read as LOCKSTEP_CONFIG, so both read the same one.
fn apply_config(args: &mut Args) -> Result<(), CliError> {
    let loaded = lockstep::config::load(args.config.as_deref())
        .map_err(|e| CliError::Usage(e.to_string()))?;
    let file = &loaded.config;
    args.nprocs = args
        .nprocs_flag
        .or(file.processes_per_machine())
        .unwrap_or(lockstep::config::DEFAULT_NUM_PROCESSES);
    args.precision = args
        .precision_flag
        .or(file.mixed_precision)
        .unwrap_or_default();
    if loaded.exists {
        tracing::debug!(
            "configuration file {}: {} ranks, precision {}",
            loaded.path.display(),
            args.nprocs,
            args.precision
        );
    }
    Ok(())
}

fn run() -> Result<(), CliError> {
    let mut args = Args::parse();
    common::init_logging(args.verbose, args.quiet).map_err(CliError::Usage)?;
    apply_config(&mut args)?;
    let cuda = match args.device {
        Device::Cpu => false,
        Device::Cuda => {
            cuda_usable().map_err(CliError::NoCuda)?;
            true
        }
        // CPU-only features keep `auto` on the CPU instead of failing.
        Device::Auto => cpu_only_flags(&args).is_empty() && cuda_usable().is_ok(),
    };
    // Load before forking: the ranks share the parent's pages instead of each decompressing.
    let (mut train_set, test_set) = data::load_splits(&args.data)?;
    if let Some(n) = args.limit_train {
        train_set.truncate(n);
    }
    if args.threads > 1 {
        // Several GEMM threads per rank: do not pin each rank to a single CPU.
        std::env::set_var("LOCKSTEP_CPU_BIND", "none");
    }
    if let Some(joined) = comm_from_env() {
        let comm = joined.map_err(CliError::Join)?;
        let cfg = validate(&args, train_set.len(), cuda)?;
        let cfg = Config {
            nprocs: comm.world_size(),
            ..cfg
        };
        let info =
            lockstep::rendezvous::EnvInfo::from_env().map_err(|e| CliError::Join(e.to_string()))?;
        let ctx = RankContext {
            rank: comm.rank(),
            local_rank: info.local_rank,
            world_size: comm.world_size(),
            comm,
        };
        let run = if cfg.cuda { run_rank_cuda } else { run_rank };
        return run(ctx, &cfg, &train_set, &test_set)
            .map(drop)
            .map_err(rank_error);
    }
    let cfg = validate(&args, train_set.len(), cuda)?;
    if cfg.console.bar {
        // The forked ranks' stdout is a pipe to this process, which forwards it to the terminal:
        // tell rank 0 it may draw.
        std::env::set_var(lockstep::types::env::CONSOLE_TTY.name, "1");
    }
    let mut lc = LaunchConfig::new(cfg.nprocs);
    // JSON lines must reach stdout as they are, without the launcher's `[rank N]` prefix (only
    // rank 0 prints).
    lc.capture_output = !cfg.console.json;
    launch(&lc, |ctx: RankContext| {
        if cfg.cuda {
            run_rank_cuda(ctx, &cfg, &train_set, &test_set)
        } else {
            run_rank(ctx, &cfg, &train_set, &test_set)
        }
    })?;
    Ok(())
}

/// A rank's error as the command's: a file that could not be written stays an output error,
/// anything else is the training's.
fn rank_error(e: Box<dyn std::error::Error + Send + Sync>) -> CliError {
    match e.downcast::<CliError>() {
        Ok(c) => *c,
        Err(e) => match e.downcast::<trainer::TrainError>() {
            Ok(t) => CliError::Train(*t),
            Err(e) => CliError::Join(e.to_string()),
        },
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("train-cnn: error: {e}");
            match e {
                CliError::Launch(l) => ExitCode::from(l.exit_code().clamp(1, 255) as u8),
                CliError::Usage(_) => ExitCode::from(2),
                _ => ExitCode::FAILURE,
            }
        }
    }
}
