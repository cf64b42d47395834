//! `lockstep bench`: an nccl-tests-style collective benchmark over the fork launcher.
//!
//! One row per size, with nccl-tests' columns: size (bytes), count, type, redop, root, then time
//! (µs), algbw, busbw (GB/s) and #wrong for the out-of-place call and again for the in-place one
//! (where the communicator has an in-place form). Time is each rank's mean (or median, [`Stat`])
//! per call over the timed iterations, combined over the ranks as nccl-tests' `-a` ([`Average`]:
//! by default their average); every size is verified after timing (unless
//! `check` is off), and any wrong element makes the command fail. Bus bandwidth uses the
//! nccl-tests factors: all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n on the total
//! size, broadcast/reduce 1. The summary gives the wrong elements and the average bus bandwidth;
//! a barrier has no size and reports its latency only. A size of 0 times a real zero-byte call.
//! Output: [`render`] as text (nccl-tests' table), CSV or JSON.

use std::time::Instant;

use lockstep::half::{bf16, f16};

use std::sync::Arc;

use lockstep::comm::{
    Buffer, BufferMut, CollKind, CommError, Communicator, Dtype, Element, ReduceOp,
};
use lockstep::cuda::{Context, DeviceBuffer, Stream};
use lockstep::launch::{launch, LaunchConfig, RankContext, RankResult};

/// Where the benchmark buffers live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Buffers {
    /// Ordinary process memory (`Vec`): the shared-memory backend stages through its segment.
    Ordinary,
    /// Buffers from `alloc_shared`: zero-copy collectives.
    Shared,
}

impl std::str::FromStr for Buffers {
    type Err = String;
    fn from_str(s: &str) -> Result<Buffers, String> {
        match s {
            "ordinary" => Ok(Buffers::Ordinary),
            "shared" => Ok(Buffers::Shared),
            _ => Err(format!(
                "unknown buffer placement '{s}' (expected ordinary or shared)"
            )),
        }
    }
}

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

impl std::str::FromStr for Format {
    type Err = String;
    fn from_str(s: &str) -> Result<Format, String> {
        match s {
            "text" => Ok(Format::Text),
            "csv" => Ok(Format::Csv),
            "json" => Ok(Format::Json),
            _ => Err(format!(
                "unknown output format '{s}' (expected text, csv or json)"
            )),
        }
    }
}

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
    /// Element type.
    pub dtype: Dtype,
    /// Reduction operator (for all_reduce, reduce, reduce_scatter).
    pub redop: ReduceOp,
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

    fn of(self, v: &[f64]) -> f64 {
        match self {
            Average::Rank0 => v.first().copied().unwrap_or(0.0),
            Average::Mean => v.iter().sum::<f64>() / v.len().max(1) as f64,
            Average::Min => v.iter().copied().fold(f64::INFINITY, f64::min),
            Average::Max => v.iter().copied().fold(0.0, f64::max),
        }
    }
}

impl Default for BenchOptions {
    fn default() -> BenchOptions {
        BenchOptions {
            nprocs: 2,
            op: CollKind::AllReduce,
            dtype: Dtype::F32,
            redop: ReduceOp::Sum,
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

/// One timed variant (out-of-place or in-place) of one size.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timing {
    /// Median time per call in microseconds (max over ranks).
    pub time_us: f64,
    /// 99th percentile of the time per call in microseconds (max over ranks): how far the slow
    /// calls stray from the median.
    pub p99_us: f64,
    /// Algorithm bandwidth, GB/s.
    pub algbw: f64,
    /// Bus bandwidth, GB/s.
    pub busbw: f64,
    /// Wrong elements found by verification (all ranks); `None` when not verified.
    pub wrong: Option<u64>,
}

/// One measured row.
#[derive(Clone, Debug)]
pub struct Row {
    /// Size in bytes, as nccl-tests counts it.
    pub bytes: usize,
    /// Element count, as nccl-tests counts it.
    pub count: usize,
    /// Root of a rooted collective.
    pub root: Option<usize>,
    /// The out-of-place call (separate send and receive buffers).
    pub out_of_place: Timing,
    /// The in-place call, for collectives that have one.
    pub in_place: Option<Timing>,
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

/// Wrong elements over every row and variant.
pub fn wrong_total(rows: &[Row]) -> u64 {
    rows.iter()
        .flat_map(|r| std::iter::once(r.out_of_place).chain(r.in_place))
        .filter_map(|t| t.wrong)
        .sum()
}

/// Average bus bandwidth over every row and variant (nccl-tests' `# Avg bus bandwidth`).
pub fn avg_busbw(rows: &[Row]) -> f64 {
    let v: Vec<f64> = rows
        .iter()
        .flat_map(|r| std::iter::once(r.out_of_place).chain(r.in_place))
        .map(|t| t.busbw)
        .collect();
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
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

trait BenchElem: Element {
    fn from_i(v: usize) -> Self;
}
macro_rules! bench_elem {
    ($($t:ty),*) => {$( impl BenchElem for $t { fn from_i(v: usize) -> Self { v as $t } } )*};
}
bench_elem!(f32, f64, i32, i64, u8, i8, u32, u64);
impl BenchElem for f16 {
    fn from_i(v: usize) -> Self {
        f16::from_f32(v as f32)
    }
}
impl BenchElem for bf16 {
    fn from_i(v: usize) -> Self {
        bf16::from_f32(v as f32)
    }
}

/// Input pattern: small integers so sums are exact in every dtype; for prod only 1s and one 2.
fn pattern(op: ReduceOp, rank: usize, i: usize, n: usize) -> usize {
    match op {
        ReduceOp::Prod => 1 + (i % n == rank) as usize,
        _ => (rank + i) % 3,
    }
}

fn expected<T: BenchElem>(op: ReduceOp, i: usize, n: usize) -> T {
    let v: Vec<usize> = (0..n).map(|r| pattern(op, r, i, n)).collect();
    let r = match op {
        ReduceOp::Prod => v.iter().product(),
        ReduceOp::Min => *v.iter().min().unwrap_or(&0),
        ReduceOp::Max => *v.iter().max().unwrap_or(&0),
        ReduceOp::Avg => {
            let s: usize = v.iter().sum();
            if T::DTYPE.is_float() {
                return avg_float::<T>(s, n);
            }
            s / n
        }
        // Sum (`validate` admits no operator but these five: `ReduceOp` may grow).
        _ => v.iter().sum(),
    };
    T::from_i(r)
}

fn avg_float<T: BenchElem>(s: usize, n: usize) -> T {
    // Match the backend: f32 accumulation for halves, division in the accumulator type.
    let v = match T::DTYPE {
        Dtype::F64 => return from_f64::<T>(s as f64 / n as f64),
        _ => s as f32 / n as f32,
    };
    from_f64::<T>(v as f64)
}

fn from_f64<T: BenchElem>(v: f64) -> T {
    let any: Box<dyn std::any::Any> = match T::DTYPE {
        Dtype::F32 => Box::new(v as f32),
        Dtype::F64 => Box::new(v),
        Dtype::F16 => Box::new(f16::from_f32(v as f32)),
        Dtype::BF16 => Box::new(bf16::from_f32(v as f32)),
        _ => Box::new(v as i64),
    };
    *any.downcast::<T>()
        .unwrap_or_else(|_| Box::new(T::default()))
}

/// A buffer of any placement.
enum Buf<T: Element> {
    Vec(Vec<T>),
    Shared(lockstep::comm::SharedBuffer<T>),
    Device(DeviceBuffer<T>),
}

/// Where the ranks' buffers live for this run: host memory, or the device of `ctx`.
struct Place {
    buffers: Buffers,
    device: Option<(Arc<Context>, Stream)>,
}

fn cuda_err(e: lockstep::cuda::CudaError) -> CommError {
    CommError::Backend {
        backend: "cuda",
        message: e.to_string(),
    }
}

impl<T: Element> Buf<T> {
    /// A buffer holding `data`.
    fn new(comm: &mut Communicator, data: Vec<T>, place: &Place) -> Result<Buf<T>, CommError> {
        if let Some((_, stream)) = &place.device {
            let b = DeviceBuffer::from_host(stream, &data).map_err(cuda_err)?;
            stream.synchronize().map_err(cuda_err)?;
            return Ok(Buf::Device(b));
        }
        Ok(match place.buffers {
            Buffers::Ordinary => Buf::Vec(data),
            Buffers::Shared => {
                let mut b = comm.alloc_shared::<T>(data.len())?;
                b.copy_from_slice(&data);
                Buf::Shared(b)
            }
        })
    }
    fn b(&self) -> &dyn Buffer<T> {
        match self {
            Buf::Vec(v) => v,
            Buf::Shared(b) => b,
            Buf::Device(d) => d,
        }
    }
    fn m(&mut self) -> &mut dyn BufferMut<T> {
        match self {
            Buf::Vec(v) => v,
            Buf::Shared(b) => b,
            Buf::Device(d) => d,
        }
    }
    /// The contents, on the host.
    fn host(&self, place: &Place) -> Result<Vec<T>, CommError> {
        match self {
            Buf::Vec(v) => Ok(v.clone()),
            Buf::Shared(b) => Ok(b.to_vec()),
            Buf::Device(d) => {
                let stream = &place
                    .device
                    .as_ref()
                    .expect("device buffer without a device")
                    .1;
                d.to_vec(stream).map_err(cuda_err)
            }
        }
    }
    /// Overwrite the contents with `data` (same length).
    fn fill(&mut self, data: &[T], place: &Place) -> Result<(), CommError> {
        match self {
            Buf::Vec(v) => v.copy_from_slice(data),
            Buf::Shared(b) => b.copy_from_slice(data),
            Buf::Device(d) => {
                let stream = &place
                    .device
                    .as_ref()
                    .expect("device buffer without a device")
                    .1;
                d.copy_from_host(stream, data).map_err(cuda_err)?;
                stream.synchronize().map_err(cuda_err)?;
            }
        }
        Ok(())
    }
}

/// Per-rank element counts of a collective of `bytes`: (send, receive).
fn counts(op: CollKind, bytes: usize, esz: usize, n: usize) -> Result<(usize, usize), CommError> {
    Ok(match op {
        CollKind::AllReduce | CollKind::Broadcast | CollKind::Reduce => (bytes / esz, bytes / esz),
        CollKind::AllGather | CollKind::Gather => (bytes / esz / n, bytes / esz),
        CollKind::ReduceScatter => (bytes / esz, bytes / esz / n),
        CollKind::Barrier => (0, 0),
        CollKind::AllToAll => (bytes / esz, bytes / esz),
        CollKind::Scatter => (bytes / esz, bytes / esz / n),
        // Ping-pong: ranks 0 and 1 bounce one message of `bytes` (the others wait at the barriers).
        CollKind::Send => (bytes / esz, bytes / esz),
        other => {
            return Err(CommError::Unsupported(format!(
                "lockstep bench does not time {other}; see --help for the operations it does"
            )))
        }
    })
}

/// Wrong elements of `r`, this rank's output of the out-of-place form (the in-place forms are
/// checked on the same layout).
fn count_wrong<T: BenchElem>(
    a: &BenchOptions,
    r: &[T],
    me: usize,
    n: usize,
    scount: usize,
) -> usize {
    let (op, root, rcount) = (a.redop, a.root, r.len());
    match a.op {
        CollKind::AllReduce => (0..rcount)
            .filter(|&i| r[i] != expected::<T>(op, i, n))
            .count(),
        CollKind::Reduce if me == root => (0..rcount)
            .filter(|&i| r[i] != expected::<T>(op, i, n))
            .count(),
        CollKind::ReduceScatter => (0..rcount)
            .filter(|&i| r[i] != expected::<T>(op, me * rcount + i, n))
            .count(),
        CollKind::Broadcast => (0..rcount)
            .filter(|&i| r[i] != T::from_i(pattern(op, root, i, n)))
            .count(),
        CollKind::AllGather => (0..rcount)
            .filter(|&i| r[i] != T::from_i(pattern(op, i / scount.max(1), i % scount.max(1), n)))
            .count(),
        CollKind::AllToAll => {
            let c = rcount / n;
            (0..rcount)
                .filter(|&i| r[i] != T::from_i(pattern(op, i / c.max(1), me * c + i % c.max(1), n)))
                .count()
        }
        CollKind::Scatter => (0..rcount)
            .filter(|&i| r[i] != T::from_i(pattern(op, root, me * rcount + i, n)))
            .count(),
        CollKind::Send if me < 2 => (0..rcount)
            .filter(|&i| r[i] != T::from_i(pattern(op, 1 - me, i, n)))
            .count(),
        CollKind::Gather if me == root => (0..rcount)
            .filter(|&i| r[i] != T::from_i(pattern(op, i / scount.max(1), i % scount.max(1), n)))
            .count(),
        _ => 0,
    }
}

/// Time `iters` calls after `warmup` untimed ones; the time per call (the mean or the median,
/// as `a.stat` says) and its 99th percentile, in seconds.
fn time_calls(
    comm: &mut Communicator,
    a: &BenchOptions,
    iters: usize,
    mut call: impl FnMut(&mut Communicator) -> Result<(), CommError>,
) -> Result<(f64, f64), CommError> {
    for _ in 0..a.warmup {
        call(comm)?;
    }
    comm.barrier()?;
    comm.synchronize()?;
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        call(comm)?;
        // Device backends enqueue: the time of a call includes its completion.
        comm.synchronize()?;
        times.push(t.elapsed().as_secs_f64());
    }
    let mean = times.iter().sum::<f64>() / times.len().max(1) as f64;
    times.sort_by(|x, y| x.total_cmp(y));
    let p99 = times[(times.len() * 99 / 100).min(times.len() - 1)];
    let t = match a.stat {
        Stat::Median => times[times.len() / 2],
        _ => mean,
    };
    Ok((t, p99))
}

/// This rank's (time per call µs, as `stat` says; wrong elements; 99th percentile µs) of one
/// variant.
type Measured = (f64, u64, f64);

/// Time and verify one size on this rank: the out-of-place form, and the in-place one where
/// there is one.
fn one_size<T: BenchElem>(
    comm: &mut Communicator,
    place: &Place,
    a: &BenchOptions,
    bytes: usize,
) -> Result<(Measured, Option<Measured>), CommError> {
    let (me, n) = (comm.rank(), comm.world_size());
    let esz = std::mem::size_of::<T>();
    let (op, root) = (a.redop, a.root);
    let (scount, rcount) = counts(a.op, bytes, esz, n)?;
    let iters = if a.iters > 0 {
        a.iters
    } else {
        ((4usize << 30) / bytes.max(1)).clamp(9, 2000)
    };
    // Ping-pong reports the one-way latency: half the round trip (as osu_latency).
    let per_call = if a.op == CollKind::Send { 0.5 } else { 1.0 };

    let send_data: Vec<T> = (0..scount)
        .map(|i| T::from_i(pattern(op, me, i, n)))
        .collect();
    let send: Buf<T> = Buf::new(comm, send_data.clone(), place)?;
    let mut recv: Buf<T> = Buf::new(comm, vec![T::default(); rcount], place)?;
    let call =
        |comm: &mut Communicator, send: &Buf<T>, recv: &mut Buf<T>| -> Result<(), CommError> {
            match a.op {
                CollKind::AllReduce => comm.all_reduce(send.b(), recv.m(), op),
                CollKind::Broadcast => comm.broadcast(send.b(), recv.m(), root),
                CollKind::Reduce => comm.reduce(send.b(), recv.m(), op, root),
                CollKind::AllGather => comm.all_gather(send.b(), recv.m()),
                CollKind::Gather => comm.gather(send.b(), recv.m(), root),
                CollKind::ReduceScatter => comm.reduce_scatter(send.b(), recv.m(), op),
                CollKind::Barrier => comm.barrier(),
                CollKind::AllToAll => comm.all_to_all(send.b(), recv.m()),
                CollKind::Scatter => comm.scatter(send.b(), recv.m(), root),
                CollKind::Send if me == 0 => {
                    comm.send(send.b(), 1).and_then(|_| comm.recv(recv.m(), 1))
                }
                CollKind::Send if me == 1 => {
                    comm.recv(recv.m(), 0).and_then(|_| comm.send(send.b(), 0))
                }
                CollKind::Send => Ok(()),
                other => Err(CommError::Unsupported(format!(
                    "lockstep bench does not time {other}"
                ))),
            }
        };
    let (t, t99) = time_calls(comm, a, iters, |c| call(c, &send, &mut recv))?;
    // The inputs never change, so the last call's output is the one to verify.
    let wrong = if a.check {
        count_wrong(a, &recv.host(place)?, me, n, scount)
    } else {
        0
    };
    let oop = (t * 1e6 * per_call, wrong as u64, t99 * 1e6 * per_call);
    drop(recv);
    drop(send);
    if !has_in_place(a.op) {
        return Ok((oop, None));
    }

    // In place: one buffer of the larger side, laid out as the out-of-place output would be.
    let len = scount.max(rcount);
    let initial: Vec<T> = match a.op {
        CollKind::AllGather => {
            let mut v = vec![T::default(); len];
            v[me * scount..(me + 1) * scount].copy_from_slice(&send_data);
            v
        }
        _ => send_data,
    };
    let mut buf: Buf<T> = Buf::new(comm, initial.clone(), place)?;
    let call_in_place = |comm: &mut Communicator, buf: &mut Buf<T>| -> Result<(), CommError> {
        match a.op {
            CollKind::AllReduce => comm.all_reduce_in_place(buf.m(), op),
            CollKind::Broadcast => comm.broadcast_in_place(buf.m(), root),
            CollKind::Reduce => comm.reduce_in_place(buf.m(), op, root),
            CollKind::AllGather => comm.all_gather_in_place(buf.m()),
            CollKind::ReduceScatter => comm.reduce_scatter_in_place(buf.m(), op),
            other => Err(CommError::Unsupported(format!(
                "lockstep bench has no in-place {other}"
            ))),
        }
    };
    // The timed calls reduce their own outputs again (values drift, as in nccl-tests); the
    // verified call starts from the initial contents.
    let (t, t99) = time_calls(comm, a, iters, |c| call_in_place(c, &mut buf))?;
    let wrong = if a.check {
        buf.fill(&initial, place)?;
        comm.barrier()?;
        call_in_place(comm, &mut buf)?;
        comm.synchronize()?;
        let r = buf.host(place)?;
        let out = if a.op == CollKind::ReduceScatter {
            &r[me * rcount..(me + 1) * rcount]
        } else {
            &r[..]
        };
        count_wrong(a, out, me, n, scount)
    } else {
        0
    };
    Ok((oop, Some((t * 1e6, wrong as u64, t99 * 1e6))))
}

type RankRows = Vec<(Measured, Option<Measured>)>;

fn rank_main<T: BenchElem>(ctx: RankContext, a: &BenchOptions) -> RankResult<RankRows> {
    let n = ctx.world_size;
    let (mut comm, place) = if a.device == "cuda" {
        // NCCL on this rank's device, or staging through shared memory when ranks share a GPU.
        let (dev, cx) = lockstep::rendezvous::device_communicator(ctx.comm, ctx.local_rank)?;
        let stream = cx.stream().map_err(cuda_err)?;
        (
            dev,
            Place {
                buffers: a.buffers,
                device: Some((cx, stream)),
            },
        )
    } else {
        (
            ctx.comm,
            Place {
                buffers: a.buffers,
                device: None,
            },
        )
    };
    let mut out = Vec::new();
    for bytes in sizes(a, std::mem::size_of::<T>(), n) {
        out.push(one_size::<T>(&mut comm, &place, a, bytes)?);
    }
    Ok(out)
}

/// Check the options before anything starts.
fn validate(a: &BenchOptions) -> Result<(), String> {
    if a.device != "cpu" && a.device != "cuda" {
        return Err(format!(
            "--device {}: expected cpu (shared memory) or cuda (NCCL)",
            a.device
        ));
    }
    if a.nprocs == 0 {
        return Err("--nprocs 0: the benchmark needs at least 1 rank".into());
    }
    if !matches!(
        a.redop,
        ReduceOp::Sum | ReduceOp::Prod | ReduceOp::Min | ReduceOp::Max | ReduceOp::Avg
    ) {
        return Err(format!(
            "-o {:?}: lockstep bench verifies sum, prod, min, max and avg only",
            a.redop
        ));
    }
    if a.op == CollKind::Send && a.nprocs < 2 {
        return Err(
            "--op pingpong needs --nprocs 2 (or more: ranks 0 and 1 exchange, the others wait)"
                .into(),
        );
    }
    if a.factor < 2 && a.sizes.is_empty() && a.min_bytes < a.max_bytes {
        return Err(format!(
            "-f {}: the step factor must be at least 2 (sizes grow from -b to -e by it)",
            a.factor
        ));
    }
    if a.sizes.is_empty() && a.min_bytes > a.max_bytes && a.op != CollKind::Barrier {
        return Err(format!(
            "-b {} is larger than -e {}: no size to time",
            a.min_bytes, a.max_bytes
        ));
    }
    if is_rooted(a.op) && a.root >= a.nprocs {
        return Err(format!(
            "--root {} is not a rank of {} (use 0 to {})",
            a.root,
            a.nprocs,
            a.nprocs - 1
        ));
    }
    Ok(())
}

/// Run the benchmark and return the rows (rank results merged).
pub fn measure(a: &BenchOptions) -> Result<Vec<Row>, String> {
    validate(a)?;
    let cfg = LaunchConfig::new(a.nprocs);
    let res = match a.dtype {
        Dtype::F32 => launch(&cfg, |ctx| rank_main::<f32>(ctx, a)),
        Dtype::F64 => launch(&cfg, |ctx| rank_main::<f64>(ctx, a)),
        Dtype::F16 => launch(&cfg, |ctx| rank_main::<f16>(ctx, a)),
        Dtype::BF16 => launch(&cfg, |ctx| rank_main::<bf16>(ctx, a)),
        Dtype::I32 => launch(&cfg, |ctx| rank_main::<i32>(ctx, a)),
        Dtype::I64 => launch(&cfg, |ctx| rank_main::<i64>(ctx, a)),
        Dtype::U8 => launch(&cfg, |ctx| rank_main::<u8>(ctx, a)),
        Dtype::I8 => launch(&cfg, |ctx| rank_main::<i8>(ctx, a)),
        Dtype::U32 => launch(&cfg, |ctx| rank_main::<u32>(ctx, a)),
        Dtype::U64 => launch(&cfg, |ctx| rank_main::<u64>(ctx, a)),
        other => return Err(format!("lockstep bench has no data type {other:?}")),
    }
    .map_err(|e| e.to_string())?;
    let n = a.nprocs;
    let esz = a.dtype.size();
    let timing = |bytes: usize, ms: Vec<Measured>| {
        // The ranks' times combined as `-a` says, and every rank's wrong elements.
        let t = a.average.of(&ms.iter().map(|m| m.0).collect::<Vec<_>>());
        let algbw = if t > 0.0 {
            bytes as f64 / (t * 1e-6) / 1e9
        } else {
            0.0
        };
        let p99_us = ms.iter().map(|m| m.2).fold(0.0, f64::max);
        Timing {
            time_us: t,
            p99_us,
            algbw,
            busbw: algbw * bus_factor(a.op, n),
            wrong: a.check.then(|| ms.iter().map(|m| m.1).sum()),
        }
    };
    let rows = sizes(a, esz, n)
        .into_iter()
        .enumerate()
        .map(|(i, bytes)| {
            let oop = res.iter().map(|r| r[i].0).collect();
            let ip: Option<Vec<Measured>> = res.iter().map(|r| r[i].1).collect();
            Row {
                bytes,
                count: bytes / esz,
                root: is_rooted(a.op).then_some(a.root),
                out_of_place: timing(bytes, oop),
                in_place: ip.map(|ip| timing(bytes, ip)),
            }
        })
        .collect();
    Ok(rows)
}

/// The first comment line: ranks, operation, buffers, backend.
fn title(a: &BenchOptions) -> String {
    format!(
        "lockstep bench: {} ranks, {} on {} buffers, backend {}",
        a.nprocs,
        if a.op == CollKind::Send {
            "pingpong (send/recv between ranks 0 and 1, one-way time)"
        } else {
            a.op.name()
        },
        match (a.device.as_str(), a.buffers) {
            ("cuda", _) => "device",
            (_, Buffers::Ordinary) => "ordinary",
            (_, Buffers::Shared) => "shared",
        },
        if a.device == "cuda" {
            "nccl (or shm staging when ranks share a GPU)"
        } else {
            "shm"
        }
    )
}

/// What the time column holds, for the header.
fn statistic(a: &BenchOptions) -> String {
    let per_rank = match a.stat {
        Stat::Median => "median",
        _ => "mean",
    };
    let over = match a.average {
        Average::Rank0 => "rank 0's",
        Average::Min => "the fastest rank's",
        Average::Max => "the slowest rank's",
        _ => "averaged over the ranks",
    };
    format!(
        "{per_rank} per call over the timed iterations, {over} (-a {})",
        a.average.code()
    )
}

fn redop_name(a: &BenchOptions) -> &'static str {
    if a.op.has_op() {
        a.redop.name()
    } else {
        "none"
    }
}

fn wrong_text(w: Option<u64>) -> String {
    w.map(|w| w.to_string()).unwrap_or_else(|| "N/A".into())
}

/// Print the rows in `format`.
pub fn render(a: &BenchOptions, rows: &[Row], format: Format) -> String {
    match format {
        Format::Text => table(a, rows),
        Format::Csv => csv(a, rows),
        Format::Json => json(a, rows),
    }
}

/// The rows as nccl-tests prints them: out-of-place and in-place columns side by side, then the
/// wrong elements and the average bus bandwidth; a barrier as its latency alone.
pub fn table(a: &BenchOptions, rows: &[Row]) -> String {
    let mut s = format!("# {}\n", title(a));
    let iters = if a.iters > 0 {
        a.iters.to_string()
    } else {
        "auto".into()
    };
    let wrong = wrong_total(rows);
    let ok = if wrong == 0 { "OK" } else { "FAILED" };
    if a.op == CollKind::Barrier {
        s += &format!(
            "# warmup iters: {} iters: {iters} validation: {}\n#\n",
            a.warmup, a.check as u8
        );
        s += &format!("# {:>10}\n# {:>10}\n", "time", "(us)");
        for r in rows {
            s += &format!("  {:>10.2}\n", r.out_of_place.time_us);
        }
        let avg =
            rows.iter().map(|r| r.out_of_place.time_us).sum::<f64>() / rows.len().max(1) as f64;
        s += &format!("# Avg latency          : {avg:.2} us\n");
        return s;
    }
    let range = if a.sizes.is_empty() {
        format!(
            "minBytes {} maxBytes {} step: {}(factor)",
            a.min_bytes, a.max_bytes, a.factor
        )
    } else {
        format!(
            "sizes {}",
            a.sizes
                .iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(",")
        )
    };
    s += &format!(
        "# {range} warmup iters: {} iters: {iters} validation: {}\n# time: {}\n#\n",
        a.warmup,
        a.check as u8,
        statistic(a)
    );
    s += &format!(
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:^31}  {:^31}\n",
        "", "", "", "", "", "out-of-place", "in-place"
    );
    s += &format!(
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}\n",
        "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong"
    );
    s += &format!(
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}\n",
        "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", ""
    );
    let cell = |t: Option<Timing>| match t {
        Some(t) => format!(
            "  {:>7}  {:>6.2}  {:>6.2}  {:>6}",
            time_text(t.time_us),
            t.algbw,
            t.busbw,
            wrong_text(t.wrong)
        ),
        None => format!("  {:>7}  {:>6}  {:>6}  {:>6}", "N/A", "N/A", "N/A", "N/A"),
    };
    for r in rows {
        let root = r.root.map(|x| x as i64).unwrap_or(-1);
        s += &format!(
            "  {:>10}  {:>12}  {:>8}  {:>6}  {:>6}",
            r.bytes,
            r.count,
            a.dtype.to_string(),
            redop_name(a),
            root
        );
        s += &cell(Some(r.out_of_place));
        s += &cell(r.in_place);
        s += "\n";
    }
    s += &format!("# Out of bounds values : {wrong} {ok}\n");
    s += &format!("# Avg bus bandwidth    : {:.4} \n#\n", avg_busbw(rows));
    s
}

/// nccl-tests' time cell: two decimals below 10 000 µs, one above, none from 1 s.
fn time_text(us: f64) -> String {
    if us < 1e4 {
        format!("{us:.2}")
    } else if us < 1e6 {
        format!("{us:.1}")
    } else {
        format!("{us:.0}")
    }
}

/// The rows as CSV: a header line, then one line per size; empty cells where there is no
/// in-place form or no verification.
pub fn csv(a: &BenchOptions, rows: &[Row]) -> String {
    let mut s = String::from(
        "op,ranks,size_bytes,count,type,redop,root,oop_time_us,oop_algbw_gbs,oop_busbw_gbs,oop_wrong,ip_time_us,ip_algbw_gbs,ip_busbw_gbs,ip_wrong,oop_p99_us,ip_p99_us\n",
    );
    let cells = |t: Option<Timing>| match t {
        Some(t) => format!(
            "{:.3},{:.4},{:.4},{}",
            t.time_us,
            t.algbw,
            t.busbw,
            t.wrong.map(|w| w.to_string()).unwrap_or_default()
        ),
        None => ",,,".into(),
    };
    let p99 = |t: Option<Timing>| t.map(|t| format!("{:.3}", t.p99_us)).unwrap_or_default();
    let op = if a.op == CollKind::Send {
        "pingpong"
    } else {
        a.op.name()
    };
    for r in rows {
        let root = r.root.map(|x| x.to_string()).unwrap_or_default();
        s += &format!(
            "{op},{},{},{},{},{},{root},{},{},{},{}\n",
            a.nprocs,
            r.bytes,
            r.count,
            a.dtype,
            redop_name(a),
            cells(Some(r.out_of_place)),
            cells(r.in_place),
            p99(Some(r.out_of_place)),
            p99(r.in_place)
        );
    }
    s
}

/// A finite number as JSON (`null` otherwise: JSON has no infinities).
/// A figure as JSON: a number, or null when it is not finite (JSON has no NaN or infinity).
fn json_num(v: f64) -> serde_json::Value {
    serde_json::Number::from_f64(v).map_or(serde_json::Value::Null, serde_json::Value::Number)
}

/// The run as one JSON object on one line: settings, rows, wrong elements, average bus bandwidth.
pub fn json(a: &BenchOptions, rows: &[Row]) -> String {
    use serde_json::{json, Value};
    let timing = |t: Option<Timing>| match t {
        Some(t) => json!({
            "time_us": json_num(t.time_us),
            "p99_us": json_num(t.p99_us),
            "algbw_gbs": json_num(t.algbw),
            "busbw_gbs": json_num(t.busbw),
            "wrong": t.wrong,
        }),
        None => Value::Null,
    };
    let items: Vec<Value> = rows
        .iter()
        .map(|r| {
            json!({
                "size_bytes": r.bytes,
                "count": r.count,
                "root": r.root,
                "out_of_place": timing(Some(r.out_of_place)),
                "in_place": timing(r.in_place),
            })
        })
        .collect();
    let op = if a.op == CollKind::Send {
        "pingpong"
    } else {
        a.op.name()
    };
    let doc = json!({
        "op": op,
        "ranks": a.nprocs,
        "type": a.dtype.to_string(),
        "redop": redop_name(a),
        "device": if a.device == "cuda" { "cuda" } else { "cpu" },
        "warmup": a.warmup,
        "iters": a.iters,
        "check": a.check,
        "stat": match a.stat {
            Stat::Median => "median",
            _ => "mean",
        },
        "average": a.average.code(),
        "rows": items,
        "wrong": wrong_total(rows),
        "avg_busbw_gbs": json_num(avg_busbw(rows)),
    });
    format!("{doc}\n")
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn rendering() {
        let t = Timing {
            time_us: 10.0,
            p99_us: 12.0,
            algbw: 1.0,
            busbw: 2.0,
            wrong: Some(0),
        };
        let rows = vec![
            Row {
                bytes: 0,
                count: 0,
                root: Some(1),
                out_of_place: Timing {
                    algbw: 0.0,
                    busbw: 0.0,
                    ..t
                },
                in_place: None,
            },
            Row {
                bytes: 1024,
                count: 256,
                root: Some(1),
                out_of_place: t,
                in_place: Some(Timing {
                    busbw: 4.0,
                    wrong: None,
                    ..t
                }),
            },
        ];
        let a = BenchOptions {
            op: CollKind::Broadcast,
            root: 1,
            ..Default::default()
        };
        assert_eq!(avg_busbw(&rows), 2.0);
        let text = table(&a, &rows);
        assert!(
            text.contains("out-of-place") && text.contains("in-place") && text.contains("root"),
            "{text}"
        );
        assert!(text.contains("# Avg bus bandwidth    : 2.0000"), "{text}");
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with("1024"))
            .unwrap();
        let cols: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(
            cols,
            [
                "1024", "256", "f32", "none", "1", "10.00", "1.00", "2.00", "0", "10.00", "1.00",
                "4.00", "N/A"
            ],
            "{line}"
        );
        let csv = csv(&a, &rows);
        assert_eq!(csv.lines().count(), 3);
        assert_eq!(
            csv.lines().nth(1).unwrap().split(',').count(),
            csv.lines().next().unwrap().split(',').count()
        );
        assert!(
            csv.lines().nth(2).unwrap().ends_with(",12.000,12.000"),
            "{csv}"
        );
        let j = json(&a, &rows);
        let v: serde_json::Value = serde_json::from_str(&j).expect("valid JSON");
        assert!(
            j.starts_with("{\"op\":\"broadcast\"")
                && j.ends_with("}\n")
                && v["rows"][0]["in_place"].is_null()
                && v["avg_busbw_gbs"] == 2.0
                && v["stat"] == "mean"
                && v["average"] == 1,
            "{j}"
        );
        let t = &v["rows"][1]["out_of_place"];
        assert!(t["time_us"] == 10.0 && t["p99_us"] == 12.0, "{j}");
        let b = BenchOptions {
            op: CollKind::Barrier,
            ..Default::default()
        };
        let text = table(&b, &rows[..1]);
        assert!(
            !text.contains("busbw") && !text.contains("size") && text.contains("Avg latency"),
            "{text}"
        );
    }
}
