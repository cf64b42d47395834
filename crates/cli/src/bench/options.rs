//! What `lockstep bench` measures: the options, their parsers, and the sizes of the rows.

use lockstep::comm::{CollKind, Dtype, ReduceOp};

/// `FromStr` for an option's enum from its table of names: exactly one of the names, or an error
/// that names the setting and lists what it takes.
macro_rules! from_names {
    ($t:ident, $what:literal, [$($name:literal => $v:ident),+ $(,)?]) => {
        impl std::str::FromStr for $t {
            type Err = String;
            fn from_str(s: &str) -> Result<$t, String> {
                match s {
                    $($name => Ok($t::$v),)+
                    _ => Err(format!(
                        "unknown {} '{s}' (expected {})",
                        $what,
                        or_list(&[$($name),+])
                    )),
                }
            }
        }
    };
}

/// `a, b or c`.
fn or_list(names: &[&str]) -> String {
    match names {
        [] => String::new(),
        [one] => one.to_string(),
        [rest @ .., last] => format!("{} or {last}", rest.join(", ")),
    }
}

/// Where the benchmark buffers live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Buffers {
    /// Ordinary process memory (`Vec`): the shared-memory backend stages through its segment.
    Ordinary,
    /// Buffers from `alloc_shared`: zero-copy collectives.
    Shared,
}

from_names!(Buffers, "buffer placement", ["ordinary" => Ordinary, "shared" => Shared]);

/// How [`render`] prints the rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Format {
    /// nccl-tests' table, `#` comment lines around it.
    #[default]
    Text,
    /// A header line, then one line per size (no comments, no summary: [`wrong_total`] and
    /// [`avg_busbw`] are in the JSON form).
    Csv,
    /// One JSON object on one line: the settings, the rows and the summary.
    Json,
}

from_names!(Format, "output format", ["text" => Text, "csv" => Csv, "json" => Json]);

/// A size in bytes: digits with an optional `K`, `M` or `G` suffix (powers of 1024, either
/// case, as nccl-tests' `-b 8 -e 128M` read).
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let (digits, shift) = match t.char_indices().last() {
        Some((i, 'k' | 'K')) => (&t[..i], 10),
        Some((i, 'm' | 'M')) => (&t[..i], 20),
        Some((i, 'g' | 'G')) => (&t[..i], 30),
        _ => (t, 0),
    };
    let bad = || {
        format!("{s:?} is not a size: give bytes as digits with an optional K, M or G suffix (powers of 1024), e.g. 8, 64K, 128M")
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let n: usize = digits.parse().map_err(|_| bad())?;
    n.checked_mul(1usize << shift)
        .ok_or_else(|| format!("{s:?} is too large a size"))
}

/// What to measure (the `lockstep bench` binary fills it from its flags).
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// Number of ranks.
    pub nprocs: usize,
    /// Collective to time; [`CollKind::Send`] is the point-to-point ping-pong between ranks 0 and 1
    /// (`--op pingpong`: one-way latency = half the round trip, bandwidth = size / that time).
    pub op: CollKind,
    /// Element type (the first of the run with `every_dtype`).
    pub dtype: Dtype,
    /// Time every element type in turn (nccl-tests' `-d all`).
    pub every_dtype: bool,
    /// Reduction operator (for all_reduce, reduce, reduce_scatter).
    pub redop: ReduceOp,
    /// Time every reduction operator the benchmark verifies in turn (nccl-tests' `-o all`).
    pub every_redop: bool,
    /// Root of rooted collectives (broadcast, reduce, gather, scatter).
    pub root: usize,
    /// Explicit sizes in bytes (overrides `min_bytes`/`max_bytes`/`factor` when not empty).
    pub sizes: Vec<usize>,
    /// Smallest size in bytes (nccl-tests' `-b`).
    pub min_bytes: usize,
    /// Largest size in bytes (`-e`).
    pub max_bytes: usize,
    /// Each size is the previous one times this (`-f`, at least 2).
    pub factor: usize,
    /// Buffer placement.
    pub buffers: Buffers,
    /// Timed iterations per size (0: chosen from the size; `-n`).
    pub iters: usize,
    /// Untimed warm-up iterations per size (`-w`).
    pub warmup: usize,
    /// Verify the results (`-c 1`).
    pub check: bool,
    /// Device: `cpu` (shared memory) or `cuda` (NCCL).
    pub device: String,
    /// Each rank's time per call: the mean over the timed iterations (nccl-tests' statistic, the
    /// default) or the median (`--stat`).
    pub stat: Stat,
    /// How the ranks' times combine into the reported one (nccl-tests' `-a`).
    pub average: Average,
}

/// A rank's time per call over the timed iterations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Stat {
    /// The mean, as nccl-tests reports.
    Mean,
    /// The median: steadier on a shared machine.
    Median,
}

/// How the ranks' times combine, as nccl-tests' `-a`: 0 rank 0's, 1 the average (its default),
/// 2 the minimum, 3 the maximum (the slowest rank).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Average {
    /// `-a 0`: rank 0's time.
    Rank0,
    /// `-a 1`: the average over the ranks.
    Mean,
    /// `-a 2`: the fastest rank's time.
    Min,
    /// `-a 3`: the slowest rank's time.
    Max,
}

impl Average {
    /// nccl-tests' number for it.
    pub fn code(self) -> u8 {
        match self {
            Average::Rank0 => 0,
            Average::Mean => 1,
            Average::Min => 2,
            Average::Max => 3,
        }
    }

    /// From nccl-tests' number (`-a 0..3`).
    pub fn from_code(c: u8) -> Result<Average, String> {
        Ok(match c {
            0 => Average::Rank0,
            1 => Average::Mean,
            2 => Average::Min,
            3 => Average::Max,
            _ => {
                return Err(format!(
                "-a {c}: expected 0 (rank 0), 1 (average over ranks), 2 (minimum) or 3 (maximum)"
            ))
            }
        })
    }

    /// The ranks' times `v` (rank order) combined.
    pub(crate) fn of(self, v: &[f64]) -> f64 {
        match self {
            Average::Rank0 => v.first().copied().unwrap_or(0.0),
            Average::Mean => v.iter().sum::<f64>() / v.len().max(1) as f64,
            Average::Min => v.iter().copied().fold(f64::INFINITY, f64::min),
            Average::Max => v.iter().copied().fold(0.0, f64::max),
        }
    }
}

/// The element types of `-d all`, in nccl-tests' order.
pub const ALL_DTYPES: [Dtype; 10] = [
    Dtype::I8,
    Dtype::U8,
    Dtype::I32,
    Dtype::U32,
    Dtype::I64,
    Dtype::U64,
    Dtype::F16,
    Dtype::F32,
    Dtype::F64,
    Dtype::BF16,
];

/// The reduction operators of `-o all`, in nccl-tests' order: those the benchmark verifies.
pub const ALL_REDOPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Prod,
    ReduceOp::Max,
    ReduceOp::Min,
    ReduceOp::Avg,
];

impl BenchOptions {
    /// The (type, operator) combinations of the run, each as the options of a one-combination
    /// run. A collective that does not reduce has one operator, whatever `-o` says.
    pub fn combinations(&self) -> Vec<BenchOptions> {
        let dtypes = if self.every_dtype {
            ALL_DTYPES.to_vec()
        } else {
            vec![self.dtype]
        };
        let redops = if self.every_redop && self.op.has_op() {
            ALL_REDOPS.to_vec()
        } else {
            vec![self.redop]
        };
        let mut v = Vec::new();
        for &dtype in &dtypes {
            for &redop in &redops {
                v.push(BenchOptions {
                    dtype,
                    redop,
                    every_dtype: false,
                    every_redop: false,
                    ..self.clone()
                });
            }
        }
        v
    }
}

impl Default for BenchOptions {
    fn default() -> BenchOptions {
        BenchOptions {
            nprocs: 2,
            op: CollKind::AllReduce,
            dtype: Dtype::F32,
            every_dtype: false,
            redop: ReduceOp::Sum,
            every_redop: false,
            root: 0,
            sizes: Vec::new(),
            min_bytes: 8,
            max_bytes: 256 << 20,
            factor: 2,
            buffers: Buffers::Ordinary,
            iters: 0,
            warmup: 5,
            check: true,
            device: "cpu".into(),
            stat: Stat::Mean,
            average: Average::Mean,
        }
    }
}

/// Whether `op` has a root.
pub fn is_rooted(op: CollKind) -> bool {
    matches!(
        op,
        CollKind::Broadcast | CollKind::Reduce | CollKind::Gather | CollKind::Scatter
    )
}

/// Whether `lockstep bench` times an in-place form of `op`.
pub fn has_in_place(op: CollKind) -> bool {
    matches!(
        op,
        CollKind::AllReduce
            | CollKind::Broadcast
            | CollKind::Reduce
            | CollKind::AllGather
            | CollKind::ReduceScatter
    )
}

/// Bus-bandwidth factor of nccl-tests for a collective on `n` ranks.
pub fn bus_factor(op: CollKind, n: usize) -> f64 {
    let n = n as f64;
    match op {
        CollKind::AllReduce => 2.0 * (n - 1.0) / n,
        CollKind::AllGather | CollKind::ReduceScatter | CollKind::AllToAll | CollKind::Scatter => {
            (n - 1.0) / n
        }
        _ => 1.0,
    }
}

/// The sizes in bytes of the rows: rounded down to whole elements (per rank, for collectives
/// that split the buffer), at least one unit unless 0; a barrier has one row of size 0.
pub fn sizes(a: &BenchOptions, esz: usize, n: usize) -> Vec<usize> {
    if a.op == CollKind::Barrier {
        return vec![0];
    }
    let quantum = match a.op {
        CollKind::AllGather
        | CollKind::ReduceScatter
        | CollKind::Gather
        | CollKind::AllToAll
        | CollKind::Scatter => esz * n,
        _ => esz,
    };
    let raw: Vec<usize> = if !a.sizes.is_empty() {
        a.sizes.clone()
    } else {
        let mut v = Vec::new();
        let mut s = a.min_bytes;
        while s <= a.max_bytes {
            v.push(s);
            // From 0, the next size is the smallest real one.
            s = match if s == 0 {
                Some(1)
            } else {
                s.checked_mul(a.factor.max(2))
            } {
                Some(next) => next,
                None => break,
            };
        }
        v
    };
    let mut out: Vec<usize> = raw
        .into_iter()
        .map(|s| {
            if s == 0 {
                0
            } else {
                (s / quantum).max(1) * quantum
            }
        })
        .collect();
    out.dedup();
    out
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn option_names_parse_exactly_and_errors_list_them() {
        assert_eq!("shared".parse::<Buffers>(), Ok(Buffers::Shared));
        assert_eq!("csv".parse::<Format>(), Ok(Format::Csv));
        assert_eq!(
            "x".parse::<Buffers>().unwrap_err(),
            "unknown buffer placement 'x' (expected ordinary or shared)"
        );
        assert_eq!(
            "Text".parse::<Format>().unwrap_err(),
            "unknown output format 'Text' (expected text, csv or json)"
        );
    }

    #[test]
    fn sizes_take_suffixes() {
        assert_eq!(parse_size("8"), Ok(8));
        assert_eq!(parse_size("0"), Ok(0));
        assert_eq!(parse_size("64K"), Ok(64 << 10));
        assert_eq!(parse_size("128m"), Ok(128 << 20));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        for bad in ["", "M", "1.5M", "-8", "8KB", "8 K", "0x10"] {
            assert!(
                parse_size(bad).unwrap_err().contains("is not a size"),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn size_rows() {
        let a = BenchOptions {
            min_bytes: 0,
            max_bytes: 64,
            factor: 4,
            ..Default::default()
        };
        assert_eq!(sizes(&a, 4, 2), vec![0, 4, 16, 64]);
        let a = BenchOptions {
            min_bytes: 8,
            max_bytes: 1 << 20,
            factor: 32,
            ..Default::default()
        };
        assert_eq!(sizes(&a, 4, 2), vec![8, 256, 8192, 262144]);
        let a = BenchOptions {
            op: CollKind::AllGather,
            sizes: vec![0, 1, 100],
            ..Default::default()
        };
        assert_eq!(sizes(&a, 4, 4), vec![0, 16, 96]);
        let a = BenchOptions {
            op: CollKind::Barrier,
            sizes: vec![8, 16],
            ..Default::default()
        };
        assert_eq!(sizes(&a, 4, 2), vec![0]);
        let a = BenchOptions {
            min_bytes: 8,
            max_bytes: usize::MAX,
            ..Default::default()
        };
        assert!(sizes(&a, 4, 2).len() < 70);
    }
}
