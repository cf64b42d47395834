//! The ranks' side of `lockstep bench`: buffers, the timed calls, verification, and how the
//! ranks' times come back to the one that prints them.

use std::sync::Arc;
use std::time::Instant;

use lockstep::comm::{
    Buffer, BufferMut, CollKind, CommError, Communicator, Dtype, Element, ReduceOp,
};
use lockstep::cuda::{Context, DeviceBuffer, Stream};
use lockstep::half::{bf16, f16};
use lockstep::launch::{launch, LaunchConfig, RankContext, RankResult};
use serde::{Deserialize, Serialize};

use super::options::{bus_factor, has_in_place, is_rooted, sizes, BenchOptions, Buffers, Stat};
use super::output::{Row, Timing};

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

/// Whether collective `kind` reduces (its in-place outputs are its next call's inputs).
fn has_reduction(kind: CollKind) -> bool {
    matches!(
        kind,
        CollKind::AllReduce | CollKind::Reduce | CollKind::ReduceScatter
    )
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

impl Place {
    /// The stream of the device a device buffer lives on (one exists whenever a buffer is on a
    /// device: `Buf::new` makes device buffers only with it).
    fn stream(&self) -> &Stream {
        &self
            .device
            .as_ref()
            .expect("device buffer without a device")
            .1
    }
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
            Buf::Device(d) => d.to_vec(place.stream()).map_err(cuda_err),
        }
    }
    /// Overwrite the contents with `data` (same length).
    fn fill(&mut self, data: &[T], place: &Place) -> Result<(), CommError> {
        match self {
            Buf::Vec(v) => v.copy_from_slice(data),
            Buf::Shared(b) => b.copy_from_slice(data),
            Buf::Device(d) => {
                let stream = place.stream();
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
/// as `a.stat` says) and, when each call was timed on its own, its 99th percentile, in seconds.
///
/// On a device communicator the mean is nccl-tests' measurement: the calls are enqueued back to
/// back on the stream, completion is awaited once, and the total is divided by `iters`, so the
/// figure is the throughput of calls, not the latency of one launch and its wait. The median (and
/// every host communicator, whose calls return complete) times each call to its completion.
fn time_calls(
    comm: &mut Communicator,
    a: &BenchOptions,
    iters: usize,
    mut call: impl FnMut(&mut Communicator) -> Result<(), CommError>,
) -> Result<(f64, Option<f64>), CommError> {
    for _ in 0..a.warmup {
        call(comm)?;
    }
    comm.barrier()?;
    comm.synchronize()?;
    if a.stat == Stat::Mean && comm.device_context().is_some() {
        let t = Instant::now();
        for _ in 0..iters {
            call(comm)?;
        }
        comm.synchronize()?;
        return Ok((t.elapsed().as_secs_f64() / iters.max(1) as f64, None));
    }
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
    Ok((t, Some(p99)))
}

/// This rank's (time per call µs, as `stat` says; wrong elements; 99th percentile µs, when each
/// call was timed on its own) of one variant.
pub(crate) type Measured = (f64, u64, Option<f64>);

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
    let oop = (
        t * 1e6 * per_call,
        wrong as u64,
        t99.map(|t| t * 1e6 * per_call),
    );
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
    // The timed calls reduce their own outputs again. A sum or a product would grow with every
    // call until floats overflow to infinity (which `LOCKSTEP_CHECK_FINITE=1` rightly refuses),
    // so those calls start from values the op maps to themselves: zeros for a sum, ones for a
    // product. The values do not change the work a call does; the verified call below starts
    // from the pattern.
    let steady = match op {
        ReduceOp::Sum if has_reduction(a.op) => Some(T::from_i(0)),
        ReduceOp::Prod if has_reduction(a.op) => Some(T::from_i(1)),
        _ => None,
    };
    let timed_from = steady.map_or_else(|| initial.clone(), |v| vec![v; len]);
    let mut buf: Buf<T> = Buf::new(comm, timed_from, place)?;
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
    Ok((oop, Some((t * 1e6, wrong as u64, t99.map(|t| t * 1e6)))))
}

/// One size of one combination on this rank: the out-of-place variant, and the in-place one.
type SizeResult = (Measured, Option<Measured>);

/// Who a rank is, for the header (nccl-tests' `#  Rank  0 Group  0 Pid ... on HOST device ...`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct RankInfo {
    /// Global rank.
    pub rank: usize,
    /// Host name.
    pub host: String,
    /// Process id.
    pub pid: u32,
    /// The CPUs the rank may run on, or its GPU.
    pub device: String,
}

/// A rank's whole run: who it is, and per combination (type, operator) per size its figures.
#[derive(Debug, Serialize, Deserialize)]
struct RankOut {
    info: RankInfo,
    results: Vec<Vec<SizeResult>>,
}

/// The ranks and the merged rows of a run; `print` is set on the rank that prints them.
pub(crate) struct Report {
    /// Every rank, in rank order.
    pub ranks: Vec<RankInfo>,
    /// Per combination, per size.
    pub rows: Vec<Row>,
    /// This process prints the report: rank 0 of a joined job, or the forking parent.
    pub print: bool,
    /// This process's rank (0 for the forking parent).
    pub rank: usize,
}

/// `1-3,6`: the CPUs this process may run on.
fn cpu_list() -> String {
    let Ok(set) = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)) else {
        return "cpus unknown".into();
    };
    let cpus: Vec<usize> = (0..nix::sched::CpuSet::count())
        .filter(|&i| set.is_set(i).unwrap_or(false))
        .collect();
    format!("cpus {}", lockstep::types::ranges_text(&cpus, ","))
}

fn rank_info(rank: usize, device: String) -> RankInfo {
    RankInfo {
        rank,
        host: nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok())
            .unwrap_or_else(|| "unknown".into()),
        pid: std::process::id(),
        device,
    }
}

/// Every size of one combination, with the element type chosen at run time.
fn one_combo(
    comm: &mut Communicator,
    place: &Place,
    c: &BenchOptions,
) -> Result<Vec<SizeResult>, CommError> {
    fn sizes_of<T: BenchElem>(
        comm: &mut Communicator,
        place: &Place,
        c: &BenchOptions,
    ) -> Result<Vec<SizeResult>, CommError> {
        let n = comm.world_size();
        sizes(c, std::mem::size_of::<T>(), n)
            .into_iter()
            .map(|bytes| one_size::<T>(comm, place, c, bytes))
            .collect()
    }
    match c.dtype {
        Dtype::F32 => sizes_of::<f32>(comm, place, c),
        Dtype::F64 => sizes_of::<f64>(comm, place, c),
        Dtype::F16 => sizes_of::<f16>(comm, place, c),
        Dtype::BF16 => sizes_of::<bf16>(comm, place, c),
        Dtype::I32 => sizes_of::<i32>(comm, place, c),
        Dtype::I64 => sizes_of::<i64>(comm, place, c),
        Dtype::U8 => sizes_of::<u8>(comm, place, c),
        Dtype::I8 => sizes_of::<i8>(comm, place, c),
        Dtype::U32 => sizes_of::<u32>(comm, place, c),
        Dtype::U64 => sizes_of::<u64>(comm, place, c),
        other => Err(CommError::Unsupported(format!(
            "lockstep bench has no data type {other}"
        ))),
    }
}

/// One rank's run on `comm` (this node's rank `local_rank`): every combination, every size.
/// Returns its figures and a host communicator of the same ranks (the device one takes device
/// buffers only) to bring them together.
fn run_rank(
    mut comm: Communicator,
    local_rank: usize,
    a: &BenchOptions,
) -> Result<(RankOut, Communicator), CommError> {
    let rank = comm.rank();
    let (mut comm, host, place, device) = if a.device == "cuda" {
        let host = comm.split(Some(0), 0)?.ok_or_else(|| {
            CommError::Unsupported("split with a color returned no communicator".into())
        })?;
        // NCCL on this rank's device, or staging through shared memory when ranks share a GPU
        // (or a lone rank finds no NCCL): the rank's line names which, so a comparison with
        // nccl-tests can tell.
        let (dev, cx) = lockstep::rendezvous::device_communicator(comm, local_rank)?;
        let stream = cx.stream().map_err(cuda_err)?;
        let name = cx.info().map(|i| i.name).unwrap_or_default();
        let device = format!(
            "device {} {name}, backend {}",
            cx.ordinal(),
            dev.backend_kind()
        );
        let place = Place {
            buffers: a.buffers,
            device: Some((cx, stream)),
        };
        (dev, Some(host), place, device)
    } else {
        let place = Place {
            buffers: a.buffers,
            device: None,
        };
        (comm, None, place, cpu_list())
    };
    let mut results = Vec::new();
    for c in a.combinations() {
        results.push(one_combo(&mut comm, &place, &c)?);
    }
    let out = RankOut {
        info: rank_info(rank, device),
        results,
    };
    Ok((out, host.unwrap_or(comm)))
}

/// Every rank's `RankOut`, on every rank, through `comm` (JSON of any length: the lengths first).
fn gather_outs(comm: &mut Communicator, mine: &RankOut) -> Result<Vec<RankOut>, String> {
    let err = |e: CommError| format!("gathering the ranks' figures failed: {e}");
    let bytes = serde_json::to_vec(mine).map_err(|e| e.to_string())?;
    let n = comm.world_size();
    let mut lens = vec![0u64; n];
    comm.all_gather(&[bytes.len() as u64][..], &mut lens[..])
        .map_err(err)?;
    let max = lens.iter().copied().max().unwrap_or(0) as usize;
    let mut padded = bytes;
    padded.resize(max, 0);
    let mut all = vec![0u8; max * n];
    comm.all_gather(&padded[..], &mut all[..]).map_err(err)?;
    all.chunks(max.max(1))
        .zip(&lens)
        .map(|(c, &l)| {
            serde_json::from_slice(&c[..l as usize])
                .map_err(|e| format!("a rank's figures did not decode: {e}"))
        })
        .collect()
}

/// Whether a launcher (lockstep launch, torchrun, mpirun, srun) started this process with a job
/// to join. A one-task Slurm allocation (`srun lockstep bench`, an sbatch script) is no job: the
/// benchmark forks its own ranks there.
fn joining() -> bool {
    use lockstep::rendezvous::{launched, EnvInfo, Launcher};
    launched()
        && !EnvInfo::from_env().is_ok_and(|i| i.world_size == 1 && i.launcher != Launcher::Lockstep)
}

/// Run the benchmark: join the launcher's job when there is one (every rank runs this, rank 0
/// prints), else fork `a.nprocs` ranks here. `nprocs_given`: --nprocs was on the command line,
/// which a joined job must agree with.
/// `before_fork` runs only when this process forks the ranks.
pub(crate) fn measure(
    a: &BenchOptions,
    nprocs_given: bool,
    before_fork: impl FnOnce(usize),
) -> Result<Report, String> {
    if joining() {
        let info = lockstep::rendezvous::EnvInfo::from_env().map_err(|e| e.to_string())?;
        if nprocs_given && a.nprocs != info.world_size {
            return Err(format!(
                "--nprocs {} but the {} job has {} ranks: under a launcher the job's ranks are the benchmark's; leave --nprocs out",
                a.nprocs,
                info.launcher.name(),
                info.world_size
            ));
        }
        let a = BenchOptions {
            nprocs: info.world_size,
            ..a.clone()
        };
        validate(&a)?;
        let comm = Communicator::from_env().map_err(|e| e.to_string())?;
        let (mine, mut host) = run_rank(comm, info.local_rank, &a).map_err(|e| e.to_string())?;
        let outs = gather_outs(&mut host, &mine)?;
        return Ok(merge(&a, outs, host.rank()));
    }
    validate(a)?;
    before_fork(a.nprocs);
    let cfg = LaunchConfig::new(a.nprocs);
    let outs = launch(&cfg, |ctx: RankContext| -> RankResult<RankOut> {
        let (out, _) = run_rank(ctx.comm, ctx.local_rank, a)?;
        Ok(out)
    })
    .map_err(|e| e.to_string())?;
    Ok(merge(a, outs, 0))
}

/// The rows: per combination and size, the ranks' figures combined as `-a` says.
fn merge(a: &BenchOptions, outs: Vec<RankOut>, rank: usize) -> Report {
    let n = a.nprocs;
    let timing = |bytes: usize, ms: Vec<Measured>| {
        // The ranks' times combined as `-a` says, and every rank's wrong elements.
        let t = a.average.of(&ms.iter().map(|m| m.0).collect::<Vec<_>>());
        let algbw = if t > 0.0 {
            bytes as f64 / (t * 1e-6) / 1e9
        } else {
            0.0
        };
        let p99_us = ms
            .iter()
            .map(|m| m.2)
            .try_fold(0.0, |acc: f64, p| p.map(|p| acc.max(p)));
        Timing {
            time_us: t,
            p99_us,
            algbw,
            busbw: algbw * bus_factor(a.op, n),
            wrong: a.check.then(|| ms.iter().map(|m| m.1).sum()),
        }
    };
    let mut rows = Vec::new();
    for (k, c) in a.combinations().iter().enumerate() {
        let esz = c.dtype.size();
        for (i, bytes) in sizes(c, esz, n).into_iter().enumerate() {
            let oop = outs.iter().map(|r| r.results[k][i].0).collect();
            let ip: Option<Vec<Measured>> = outs.iter().map(|r| r.results[k][i].1).collect();
            rows.push(Row {
                bytes,
                count: bytes / esz,
                dtype: c.dtype,
                redop: c.op.has_op().then_some(c.redop),
                root: is_rooted(a.op).then_some(a.root),
                out_of_place: timing(bytes, oop),
                in_place: ip.map(|ip| timing(bytes, ip)),
            });
        }
    }
    Report {
        ranks: outs.into_iter().map(|o| o.info).collect(),
        rows,
        print: rank == 0,
        rank,
    }
}

/// Check the options before anything starts.
pub(crate) fn validate(a: &BenchOptions) -> Result<(), String> {
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
