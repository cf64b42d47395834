//! `train-cnn`: data-parallel training of the FashionMNIST CNN recipe on CPU ranks or CUDA GPUs.
//!
//! `main` only parses arguments, calls `run`, and maps the result to an exit code. Raw CLI
//! values (`Args`) are validated into a [`lockstep::train::trainer::TrainConfig`] in one place.
//! With `--nprocs N` the binary forks its own ranks through `lockstep::launch::launch`; under
//! `lockstep launch` (environment `LOCKSTEP_JOB_ID`, `RANK`, `WORLD_SIZE`) it joins instead.
//! Rank 0 alone prints: a progress bar per epoch on a terminal, then one line (or, with
//! `--json`, one JSON object) per epoch.
//!
//! `--device cuda` trains with the `kernels/*.cu` kernels (`lockstep::train::device`): each rank
//! initialises CUDA itself after the fork, on GPU `local_rank % device_count`, and averages
//! gradients with NCCL (one GPU per rank) or the staged shared-memory backend (ranks sharing a
//! GPU). `--device auto` picks CUDA when a forked probe process finds a driver and a device, so
//! the parent never initialises CUDA before forking.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, ValueEnum};

mod common;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use lockstep::comm::Communicator;
use lockstep::cuda;
use lockstep::launch::{launch, LaunchConfig, RankContext};
use lockstep::train::checkpoint;
use lockstep::train::data::{self, Dataset, DEFAULT_DATA_DIR};
use lockstep::train::device::{self, DeviceOptions, GpuExec, Precision};
use lockstep::train::kernels;
use lockstep::train::schedule::Schedule;
use lockstep::train::trainer::{self, EpochReport, Observer, Silent, TrainConfig};

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
    /// The base rate throughout (the recipe).
    Constant,
    /// Cosine annealing to 0 over the run.
    Cosine,
    /// One-cycle (warm-up then cosine annealing).
    Onecycle,
}

/// Raw command-line values.
#[derive(Parser, Debug)]
#[command(name = "train-cnn", version, about = "Train the FashionMNIST CNN with data-parallel CPU ranks or CUDA GPUs (lockstep)")]
struct Args {
    /// Ranks to fork (ignored when started by `lockstep launch`).
    #[arg(long, default_value_t = 2)]
    nprocs: usize,
    /// Epochs to train.
    #[arg(long, default_value_t = 4)]
    epochs: u64,
    /// Images per rank per step.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Adam learning rate.
    #[arg(long, default_value_t = 0.005)]
    lr: f32,
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
    /// GEMM precision on CUDA: fp32 or bf16 (f32 master weights and optimizer state either way).
    #[arg(long, default_value = "fp32")]
    precision: Precision,
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
    json: bool,
}

fn validate(a: &Args, train_len: usize, cuda: bool) -> Result<Config, CliError> {
    if cuda && a.sync_bn {
        return Err(CliError::Usage("--sync-bn is CPU-only for now; drop it or use --device cpu".into()));
    }
    if a.loss_every == 0 {
        return Err(CliError::Usage("--loss-every must be at least 1".into()));
    }
    if a.nprocs == 0 || a.batch_size == 0 || a.threads == 0 {
        return Err(CliError::Usage("--nprocs, --batch-size and --threads must be at least 1".into()));
    }
    if a.epochs == 0 {
        return Err(CliError::Usage("--epochs 0 would train nothing; pass at least 1".into()));
    }
    if train_len == 0 {
        return Err(CliError::Usage("--limit-train 0 leaves no training images; pass at least 1 (or drop the flag)".into()));
    }
    if !(a.lr.is_finite() && a.lr > 0.0) {
        return Err(CliError::Usage(format!("--lr must be a positive number, got {}", a.lr)));
    }
    // Catch path mistakes before an epoch of work, not after it: the directory exists and takes
    // a new file, no checkpoint name is a directory, and one checkpoint fits.
    let fault = checkpoint::fault_from_env().map_err(|e| CliError::Usage(e.to_string()))?;
    if let Some(save) = &a.save {
        let params = lockstep::train::model::Model::fashion_cnn(1).map_err(trainer::TrainError::from)?.num_params();
        checkpoint::check_target(save, checkpoint::estimate_bytes(params)).map_err(|e| CliError::Usage(format!("--save: {e}")))?;
    } else if let Some(step) = fault {
        return Err(CliError::Usage(format!("{}={step} needs --save (it kills a save)", checkpoint::FAULT_ENV)));
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
    let steps_per_epoch = train_len.div_ceil(a.nprocs).div_ceil(a.batch_size) as u64;
    let total = steps_per_epoch * a.epochs;
    let schedule = match a.schedule {
        Sched::Constant => Schedule::Constant,
        Sched::Cosine => Schedule::Cosine { total, min_lr: 0.0 },
        Sched::Onecycle => Schedule::OneCycle { total, pct_start: 0.3, div: 25.0, final_div: 1e4 },
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
        },
        cuda,
        device: DeviceOptions { precision: a.precision, loss_every: a.loss_every },
        graphs: !a.no_graphs,
        nprocs: a.nprocs,
        threads: a.threads,
        json: a.json,
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

/// Rank 0's output: progress bar on a terminal, and one line or JSON object per epoch.
struct Printer {
    json: bool,
    bar: Option<ProgressBar>,
}

impl Observer for Printer {
    fn epoch_start(&mut self, epoch: u64, epochs: u64, steps: usize) {
        if !std::io::stdout().is_terminal() {
            return;
        }
        let bar = ProgressBar::with_draw_target(Some(steps as u64), ProgressDrawTarget::stdout());
        if let Ok(style) = ProgressStyle::default_bar().template("epoch {prefix} [{bar:30}] {pos}/{len} {msg}") {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_prefix(format!("{epoch}/{epochs}"));
        self.bar = Some(bar);
    }
    fn step(&mut self, step: usize, loss: f32, images_per_s: f64) {
        if let Some(bar) = &self.bar {
            bar.set_position(step as u64);
            if step.is_multiple_of(10) {
                bar.set_message(format!("loss {loss:.3}  {images_per_s:.0} img/s"));
            }
        }
    }
    fn epoch_end(&mut self, r: &EpochReport) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        let mut out = std::io::stdout().lock();
        let _ = if self.json {
            writeln!(
                out,
                "{{\"epoch\":{},\"epochs\":{},\"train_loss\":{:.6},\"test_acc\":{:.4},\"test_count\":{},\"epoch_s\":{:.3},\"images_per_s\":{:.1},\"steps\":{}}}",
                r.epoch, r.epochs, r.train_loss, r.test_acc, r.test_count, r.epoch_s, r.images_per_s, r.steps
            )
        } else {
            writeln!(
                out,
                "epoch {}/{}  loss {:.4}  test acc {:.2} %  {:.1} s  ({:.0} img/s)",
                r.epoch, r.epochs, r.train_loss, r.test_acc, r.epoch_s, r.images_per_s
            )
        };
        let _ = out.flush();
    }
}

/// Peak resident set size of this process in KiB (VmHWM), if readable.
fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok()))
        .unwrap_or(0)
}

/// One CUDA rank: its own context (CUDA is first initialised here, after the fork), a device
/// communicator built from the host one, then the device engine.
fn run_rank_cuda(
    host: Communicator,
    local_rank: usize,
    cfg: &Config,
    train_set: &Dataset,
    test_set: &Dataset,
) -> Result<(f64, u64), Box<dyn std::error::Error + Send + Sync>> {
    let rank = host.rank();
    // The same backend policy as every other entry point (NCCL, NCCL's multi-rank mode, or
    // staging), so `train-cnn` and `lockstep` never disagree about a job.
    let (mut comm, ctx) = lockstep::rendezvous::device_communicator(host, local_rank)?;
    let make = |len| Ok(GpuExec::new(&ctx, len, cfg.graphs)?);
    let out = if rank == 0 {
        device::train_device(
            &cfg.train,
            &cfg.device,
            train_set,
            test_set,
            make,
            Some(&mut comm),
            &mut Printer { json: cfg.json, bar: None },
        )?
    } else {
        device::train_device(&cfg.train, &cfg.device, train_set, test_set, make, Some(&mut comm), &mut Silent)?
    };
    Ok((out.reports.last().map(|r| r.test_acc).unwrap_or(0.0), peak_rss_kib()))
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

/// One rank's work; returns (final test accuracy, peak RSS KiB).
fn run_rank(comm: &mut Communicator, cfg: &Config, train_set: &Dataset, test_set: &Dataset) -> Result<(f64, u64), trainer::TrainError> {
    kernels::set_threads(cfg.threads);
    let rank = comm.rank();
    let out = if rank == 0 {
        trainer::train(&cfg.train, train_set, test_set, comm, &mut Printer { json: cfg.json, bar: None })?
    } else {
        trainer::train(&cfg.train, train_set, test_set, comm, &mut Silent)?
    };
    Ok((out.reports.last().map(|r| r.test_acc).unwrap_or(0.0), peak_rss_kib()))
}

fn print_rss(json: bool, rss: &[u64]) {
    let mib: Vec<String> = rss.iter().map(|k| format!("{:.1}", *k as f64 / 1024.0)).collect();
    if json {
        println!("{{\"peak_rss_mib\":[{}]}}", mib.join(","));
    } else {
        println!("peak RSS per rank: {} MiB", mib.join(", "));
    }
}

fn run() -> Result<(), CliError> {
    let args = Args::parse();
    common::init_logging(args.verbose, args.quiet).map_err(CliError::Usage)?;
    let cuda = match args.device {
        Device::Cpu => false,
        Device::Cuda => {
            cuda_usable().map_err(CliError::NoCuda)?;
            true
        }
        // CPU-only features keep `auto` on the CPU instead of failing.
        Device::Auto => !args.sync_bn && cuda_usable().is_ok(),
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
        let mut comm = joined.map_err(CliError::Join)?;
        let cfg = validate(&args, train_set.len(), cuda)?;
        let cfg = Config { nprocs: comm.world_size(), ..cfg };
        let rank0 = comm.rank() == 0;
        let rss = if cfg.cuda {
            let local = std::env::var("LOCAL_RANK").ok().and_then(|v| v.parse().ok()).unwrap_or(comm.rank());
            run_rank_cuda(comm, local, &cfg, &train_set, &test_set).map_err(|e| CliError::Join(format!("CUDA rank: {e}")))?.1
        } else {
            run_rank(&mut comm, &cfg, &train_set, &test_set)?.1
        };
        if rank0 {
            print_rss(cfg.json, &[rss]);
        }
        return Ok(());
    }
    let cfg = validate(&args, train_set.len(), cuda)?;
    let mut lc = LaunchConfig::new(cfg.nprocs);
    // JSON lines must reach stdout as they are, without the launcher's `[rank N]` prefix (only
    // rank 0 prints).
    lc.capture_output = !cfg.json;
    let results = launch(&lc, |mut ctx: RankContext| {
        if cfg.cuda {
            run_rank_cuda(ctx.comm, ctx.local_rank, &cfg, &train_set, &test_set)
        } else {
            run_rank(&mut ctx.comm, &cfg, &train_set, &test_set).map_err(|e| e.into())
        }
    })?;
    print_rss(cfg.json, &results.iter().map(|r| r.1).collect::<Vec<_>>());
    Ok(())
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
