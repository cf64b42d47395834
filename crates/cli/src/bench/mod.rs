//! `lockstep bench`: an nccl-tests-style collective benchmark. Under a launcher (`lockstep
//! launch`, torchrun, mpirun, srun) every rank runs it and joins the job, so it measures the
//! job's layout, nodes included; on its own it forks `--nprocs` ranks on this node.
//!
//! One row per size, with nccl-tests' columns: size (bytes), count, type, redop, root, then time
//! (µs), algbw, busbw (GB/s) and #wrong for the out-of-place call and again for the in-place one
//! (where the communicator has an in-place form). Time is each rank's mean (or median, `--stat`)
//! per call over the timed iterations (on device buffers the mean is nccl-tests' measurement: the
//! calls enqueued back to back, one wait, total / iterations), combined over the ranks as
//! nccl-tests' `-a` (by default their average); every size is verified after timing (unless
//! `check` is off), and any wrong element makes the command fail. Bus bandwidth uses the
//! nccl-tests factors: all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n on the total
//! size, broadcast/reduce 1. The summary gives the wrong elements and the average bus bandwidth;
//! a barrier has no size and reports its latency only. A size of 0 times a real zero-byte call.
//! Output: `output::render` as text (nccl-tests' table, after a line per rank naming its host,
//! pid and CPUs or GPU), CSV or JSON.

mod measure;
mod options;
mod output;

use clap::Args;
use lockstep::{CollKind, Dtype, ReduceOp};

use options::{parse_size, Average, BenchOptions, Buffers, Format, Stat};

/// A value of `-d` or `-o`: one, or nccl-tests' `all`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OneOrAll<T> {
    One(T),
    All,
}

// Options of `lockstep bench`, turned into `BenchOptions` (a plain comment: clap would show a
// doc comment here as the subcommand's help).
#[derive(Clone, Debug, Args)]
#[command(after_help = BENCH_HELP)]
pub(crate) struct BenchArgs {
    /// Number of ranks to fork on this node (default 2). Under a launcher the job's ranks are the
    /// benchmark's, and this may only repeat their number.
    #[arg(long)]
    nprocs: Option<usize>,
    /// Collective to time (all_reduce, broadcast, reduce, all_gather, gather, reduce_scatter,
    /// barrier, all_to_all, scatter), or pingpong: send/recv between ranks 0 and 1, reporting the
    /// one-way latency (half the round trip) and bandwidth, like osu_latency/osu_bw.
    #[arg(long, default_value = "all_reduce", value_parser = parse_bench_op)]
    op: CollKind,
    /// Element type: lockstep's names (f32, bf16, i8, ...) or nccl-tests' (float, half,
    /// bfloat16, double, int8, uint8, int32, uint32, int64, uint64), or all (each in turn).
    #[arg(long, short = 'd', default_value = "f32", value_parser = parse_bench_dtype)]
    dtype: OneOrAll<Dtype>,
    /// Reduction operator (for all_reduce, reduce, reduce_scatter): sum, prod, min, max, avg, or
    /// all (each in turn).
    #[arg(long, short = 'o', default_value = "sum", value_parser = parse_bench_redop)]
    redop: OneOrAll<ReduceOp>,
    /// Root rank of rooted collectives (broadcast, reduce, gather, scatter).
    #[arg(long, short = 'r', default_value_t = 0)]
    root: usize,
    /// Explicit sizes in bytes, comma-separated, e.g. 0,4K,1M (overrides -b/-e/-f).
    #[arg(long, value_delimiter = ',', value_parser = parse_size)]
    sizes: Vec<usize>,
    /// Smallest size in bytes (nccl-tests' -b); 0 times a real zero-byte call.
    #[arg(long, short = 'b', visible_alias = "minbytes", default_value = "8", value_parser = parse_size)]
    min_bytes: usize,
    /// Largest size in bytes (nccl-tests' -e).
    #[arg(long, short = 'e', visible_alias = "maxbytes", default_value = "256M", value_parser = parse_size)]
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
on device buffers measured as nccl-tests does (the calls enqueued back to back, one wait at the
end, the total divided by the iterations; the median times each call to its completion),
averaged over the ranks (-a 1; -a 0 rank 0's, -a 2 the fastest rank's, -a 3 the slowest's); the
header names the statistic. The last lines give the wrong elements found and the average bus
bandwidth. Barrier has no size: one row, its latency. Under a launcher (lockstep launch, torchrun,
mpirun, srun) every rank runs the benchmark in the launcher's job and rank 0 prints.

Examples:
  lockstep bench -b 8 -e 128M -f 2            # all-reduce, f32, 2 ranks
  lockstep bench --nprocs 4 --op broadcast -r 1 --sizes 0,4K,1M
  lockstep bench --op barrier --format json
  lockstep launch --nproc-per-node 4 -- lockstep bench -d all   # joins the launcher's 4 ranks";

impl From<BenchArgs> for BenchOptions {
    fn from(a: BenchArgs) -> BenchOptions {
        BenchOptions {
            nprocs: a.nprocs.unwrap_or(lockstep::config::DEFAULT_NUM_PROCESSES),
            op: a.op,
            dtype: match a.dtype {
                OneOrAll::One(d) => d,
                OneOrAll::All => options::ALL_DTYPES[0],
            },
            every_dtype: a.dtype == OneOrAll::All,
            redop: match a.redop {
                OneOrAll::One(o) => o,
                OneOrAll::All => options::ALL_REDOPS[0],
            },
            every_redop: a.redop == OneOrAll::All,
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
                Stat::Median
            } else {
                Stat::Mean
            },
            // The parser admits 0 to 3 only.
            average: Average::from_code(a.avg).unwrap_or(Average::Mean),
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

/// `-d`: lockstep's dtype names, nccl-tests' (`-d float`), or `all`.
fn parse_bench_dtype(s: &str) -> Result<OneOrAll<Dtype>, String> {
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
        "all" => return Ok(OneOrAll::All),
        _ => s,
    };
    name.parse().map(OneOrAll::One)
}

/// `-o`: a reduction operator's name, or `all`.
fn parse_bench_redop(s: &str) -> Result<OneOrAll<ReduceOp>, String> {
    match s {
        "all" => Ok(OneOrAll::All),
        _ => s.parse().map(OneOrAll::One),
    }
}

/// `lockstep bench`: print the results; exit code 1 if any element was wrong.
pub(crate) fn run(a: BenchArgs) -> Result<i32, String> {
    let format = a.format;
    let nprocs_given = a.nprocs.is_some();
    let mut o = BenchOptions::from(a);
    let report = measure::measure(&o, nprocs_given, warn_oversubscribed)?;
    o.nprocs = report.ranks.len();
    if report.print {
        print!("{}", output::render(&o, &report, format));
    }
    let wrong = output::wrong_total(&report.rows);
    if wrong > 0 {
        eprintln!(
            "lockstep bench: rank {}: {wrong} wrong elements: results are incorrect",
            report.rank
        );
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
