//! `lockstep bench`: an nccl-tests-style collective benchmark over the fork launcher.
//!
//! One row per size: size (bytes), count, type, op, time (µs), algbw (GB/s), busbw (GB/s), #wrong.
//! Time is the median over iterations of each rank's per-call time, maxed over ranks; every size is
//! verified after timing, and any wrong element makes the command fail. Bus bandwidth uses the
//! nccl-tests factors: all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n on the total size,
//! broadcast/reduce 1.

use std::time::Instant;

use half::{bf16, f16};

use std::sync::Arc;

use crate::comm::{Buffer, BufferMut, CollKind, CommError, Communicator, Dtype, Element, ReduceOp};
use crate::cuda::{Context, DeviceBuffer, Stream};
use crate::launch::{launch, LaunchConfig, RankContext, RankResult};

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
            _ => Err(format!("unknown buffer placement '{s}' (expected ordinary or shared)")),
        }
    }
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
    /// Explicit sizes in bytes (overrides `min_bytes`/`max_bytes` when not empty).
    pub sizes: Vec<usize>,
    /// Smallest size in bytes (sizes double up to `max_bytes`).
    pub min_bytes: usize,
    /// Largest size in bytes.
    pub max_bytes: usize,
    /// Buffer placement.
    pub buffers: Buffers,
    /// Timed iterations per size (0: chosen from the size).
    pub iters: usize,
    /// Untimed warm-up iterations per size.
    pub warmup: usize,
    /// Device: `cpu` (shared memory) or `cuda` (NCCL).
    pub device: String,
}

impl Default for BenchOptions {
    fn default() -> BenchOptions {
        BenchOptions {
            nprocs: 2,
            op: CollKind::AllReduce,
            dtype: Dtype::F32,
            redop: ReduceOp::Sum,
            sizes: Vec::new(),
            min_bytes: 8,
            max_bytes: 256 << 20,
            buffers: Buffers::Ordinary,
            iters: 0,
            warmup: 5,
            device: "cpu".into(),
        }
    }
}

/// One measured row.
#[derive(Clone, Debug)]
pub struct Row {
    /// Size in bytes, as nccl-tests counts it.
    pub bytes: usize,
    /// Element count, as nccl-tests counts it.
    pub count: usize,
    /// Median time per call in microseconds (max over ranks).
    pub time_us: f64,
    /// Algorithm bandwidth, GB/s.
    pub algbw: f64,
    /// Bus bandwidth, GB/s.
    pub busbw: f64,
    /// Wrong elements found by verification (all ranks).
    pub wrong: u64,
}

/// Bus-bandwidth factor of nccl-tests for a collective on `n` ranks.
pub fn bus_factor(op: CollKind, n: usize) -> f64 {
    let n = n as f64;
    match op {
        CollKind::AllReduce => 2.0 * (n - 1.0) / n,
        CollKind::AllGather | CollKind::ReduceScatter | CollKind::AllToAll | CollKind::Scatter => (n - 1.0) / n,
        _ => 1.0,
    }
}

fn sizes(a: &BenchOptions, esz: usize, n: usize) -> Vec<usize> {
    let quantum = match a.op {
        CollKind::AllGather | CollKind::ReduceScatter | CollKind::Gather | CollKind::AllToAll | CollKind::Scatter => esz * n,
        _ => esz,
    };
    let raw: Vec<usize> = if !a.sizes.is_empty() {
        a.sizes.clone()
    } else {
        let mut v = Vec::new();
        let mut s = a.min_bytes.max(1);
        while s <= a.max_bytes {
            v.push(s);
            s *= 2;
        }
        v
    };
    raw.into_iter().map(|s| (s / quantum).max(1) * quantum).collect()
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
        ReduceOp::Sum => v.iter().sum(),
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
    *any.downcast::<T>().unwrap_or_else(|_| Box::new(T::default()))
}

/// A buffer of any placement.
enum Buf<T: Element> {
    Vec(Vec<T>),
    Shared(crate::comm::SharedBuffer<T>),
    Device(DeviceBuffer<T>),
}

/// Where the ranks' buffers live for this run: host memory, or the device of `ctx`.
struct Place {
    buffers: Buffers,
    device: Option<(Arc<Context>, Stream)>,
}

fn cuda_err(e: crate::cuda::CudaError) -> CommError {
    CommError::Backend { backend: "cuda", message: e.to_string() }
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
                let stream = &place.device.as_ref().expect("device buffer without a device").1;
                d.to_vec(stream).map_err(cuda_err)
            }
        }
    }
}

/// Time and verify one size on this rank: returns (median µs, wrong elements).
fn one_size<T: BenchElem>(comm: &mut Communicator, place: &Place, a: &BenchOptions, bytes: usize) -> Result<(f64, u64), CommError> {
    let (me, n) = (comm.rank(), comm.world_size());
    let esz = std::mem::size_of::<T>();
    let op = a.redop;
    let root = 0;
    // Per-rank send and receive element counts.
    let (scount, rcount) = match a.op {
        CollKind::AllReduce | CollKind::Broadcast | CollKind::Reduce => (bytes / esz, bytes / esz),
        CollKind::AllGather | CollKind::Gather => (bytes / esz / n, bytes / esz),
        CollKind::ReduceScatter => (bytes / esz, bytes / esz / n),
        CollKind::Barrier => (0, 0),
        CollKind::AllToAll => (bytes / esz, bytes / esz),
        CollKind::Scatter => (bytes / esz, bytes / esz / n),
        // Ping-pong: ranks 0 and 1 bounce one message of `bytes` (the others wait at the barriers).
        CollKind::Send => (bytes / esz, bytes / esz),
        other => {
            return Err(CommError::Unsupported(format!("lockstep bench does not time {other}; see --help for the operations it does")))
        }
    };
    let send: Buf<T> = Buf::new(comm, (0..scount).map(|i| T::from_i(pattern(op, me, i, n))).collect(), place)?;
    let mut recv: Buf<T> = Buf::new(comm, vec![T::default(); rcount], place)?;
    let call = |comm: &mut Communicator, send: &Buf<T>, recv: &mut Buf<T>| -> Result<(), CommError> {
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
            CollKind::Send if me == 0 => comm.send(send.b(), 1).and_then(|_| comm.recv(recv.m(), 1)),
            CollKind::Send if me == 1 => comm.recv(recv.m(), 0).and_then(|_| comm.send(send.b(), 0)),
            CollKind::Send => Ok(()),
            other => Err(CommError::Unsupported(format!("lockstep bench does not time {other}"))),
        }?;
        // Device backends enqueue: the time of a call includes its completion.
        comm.synchronize()
    };
    let iters = if a.iters > 0 { a.iters } else { ((4usize << 30) / bytes.max(1)).clamp(9, 2000) };
    for _ in 0..a.warmup {
        call(comm, &send, &mut recv)?;
    }
    comm.barrier()?;
    comm.synchronize()?;
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        call(comm, &send, &mut recv)?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(|x, y| x.total_cmp(y));
    // Verify the last call's output.
    let r = recv.host(place)?;
    let wrong = match a.op {
        CollKind::AllReduce => (0..rcount).filter(|&i| r[i] != expected::<T>(op, i, n)).count(),
        CollKind::Reduce if me == root => (0..rcount).filter(|&i| r[i] != expected::<T>(op, i, n)).count(),
        CollKind::ReduceScatter => (0..rcount).filter(|&i| r[i] != expected::<T>(op, me * rcount + i, n)).count(),
        CollKind::Broadcast => (0..rcount).filter(|&i| r[i] != T::from_i(pattern(op, root, i, n))).count(),
        CollKind::AllGather => (0..rcount).filter(|&i| r[i] != T::from_i(pattern(op, i / scount.max(1), i % scount.max(1), n))).count(),
        CollKind::AllToAll => {
            let c = rcount / n;
            (0..rcount).filter(|&i| r[i] != T::from_i(pattern(op, i / c.max(1), me * c + i % c.max(1), n))).count()
        }
        CollKind::Scatter => (0..rcount).filter(|&i| r[i] != T::from_i(pattern(op, root, me * rcount + i, n))).count(),
        CollKind::Send if me < 2 => (0..rcount).filter(|&i| r[i] != T::from_i(pattern(op, 1 - me, i, n))).count(),
        CollKind::Gather if me == root => {
            (0..rcount).filter(|&i| r[i] != T::from_i(pattern(op, i / scount.max(1), i % scount.max(1), n))).count()
        }
        _ => 0,
    };
    // Ping-pong reports the one-way latency: half the round trip (as osu_latency).
    let per_call = if a.op == CollKind::Send { 0.5 } else { 1.0 };
    Ok((times[times.len() / 2] * 1e6 * per_call, wrong as u64))
}

fn rank_main<T: BenchElem>(ctx: RankContext, a: &BenchOptions) -> RankResult<Vec<(f64, u64)>> {
    let n = ctx.world_size;
    let (mut comm, place) = if a.device == "cuda" {
        // NCCL on this rank's device, or staging through shared memory when ranks share a GPU.
        let (dev, cx) = crate::rendezvous::device_communicator(ctx.comm, ctx.local_rank)?;
        let stream = cx.stream().map_err(cuda_err)?;
        (dev, Place { buffers: a.buffers, device: Some((cx, stream)) })
    } else {
        (ctx.comm, Place { buffers: a.buffers, device: None })
    };
    let mut out = Vec::new();
    for bytes in sizes(a, std::mem::size_of::<T>(), n) {
        out.push(one_size::<T>(&mut comm, &place, a, bytes)?);
    }
    Ok(out)
}

/// Run the benchmark and return the rows (rank results merged).
pub fn measure(a: &BenchOptions) -> Result<Vec<Row>, String> {
    if a.device != "cpu" && a.device != "cuda" {
        return Err(format!("--device {}: expected cpu (shared memory) or cuda (NCCL)", a.device));
    }
    if a.nprocs == 0 {
        return Err("--nprocs must be at least 1".into());
    }
    if a.op == CollKind::Send && a.nprocs < 2 {
        return Err("--op pingpong needs --nprocs 2 (or more: ranks 0 and 1 exchange, the others wait)".into());
    }
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
    }
    .map_err(|e| e.to_string())?;
    let n = a.nprocs;
    let esz = a.dtype.size();
    // Slowest rank's median time, and every rank's wrong elements.
    let merged: Vec<(f64, u64)> =
        (0..res[0].len()).map(|i| (res.iter().map(|r| r[i].0).fold(0.0, f64::max), res.iter().map(|r| r[i].1).sum())).collect();
    let rows = sizes(a, esz, n)
        .into_iter()
        .zip(&merged)
        .map(|(bytes, &(t, wrong))| {
            let algbw = bytes as f64 / (t * 1e-6) / 1e9;
            Row { bytes, count: bytes / esz, time_us: t, algbw, busbw: algbw * bus_factor(a.op, n), wrong }
        })
        .collect();
    Ok(rows)
}

/// Format rows as an nccl-tests-style table.
pub fn table(a: &BenchOptions, rows: &[Row]) -> String {
    let mut s = format!(
        "# lockstep bench: {} ranks, {} on {} buffers, backend {}\n",
        a.nprocs,
        if a.op == CollKind::Send { "pingpong (send/recv between ranks 0 and 1, one-way time)" } else { a.op.name() },
        match (a.device.as_str(), a.buffers) {
            ("cuda", _) => "device",
            (_, Buffers::Ordinary) => "ordinary",
            (_, Buffers::Shared) => "shared",
        },
        if a.device == "cuda" { "nccl (or shm staging when ranks share a GPU)" } else { "shm" }
    );
    s += &format!(
        "{:>12} {:>12} {:>6} {:>6} {:>10} {:>8} {:>8} {:>7}\n",
        "size(B)", "count", "type", "redop", "time(us)", "algbw", "busbw", "#wrong"
    );
    for r in rows {
        let redop = if a.op.has_op() { a.redop.name() } else { "none" };
        s += &format!(
            "{:>12} {:>12} {:>6} {:>6} {:>10.2} {:>8.2} {:>8.2} {:>7}\n",
            r.bytes, r.count, a.dtype, redop, r.time_us, r.algbw, r.busbw, r.wrong
        );
    }
    s
}
