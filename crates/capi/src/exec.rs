//! Running C calls on a communicator: argument checks, NCCL's in-place forms, the stream rule,
//! and groups (lockstepGroupStart/End).
//!
//! A C call becomes an [`Op`] (the arguments as passed). Outside a group it runs at once; inside,
//! it is recorded per thread and runs at the outermost lockstepGroupEnd, consecutive sends and
//! receives on one communicator together through `Communicator::group`.
//!
//! A collective reaches the communicator as a type-erased [`Call`] through
//! [`Communicator::run`] (and sends and receives as [`P2pOp`]s through
//! [`Communicator::run_p2p`]): buffers are [`RawMem`]s (an address, a length and a memory space),
//! never Rust references, so NCCL's in-place forms (`sendbuff == recvbuff`) alias nothing. The
//! argument rules (root, buffer sizes, in-place forms) are the shared table's,
//! `runtime::comm::check`; what is C's own here is translating codes and checking pointers, and a
//! rule the shared check refuses comes back as lockstepInvalidArgument with its message.

use std::cell::RefCell;
use std::ffi::{c_int, c_void};
use std::sync::Arc;

use super::handle::{self, guard_comm, lockstepComm, lockstepComm_t, Failure};
use super::types::lockstepResult_t;
use runtime::comm::{
    check, Call, CollKind, CommError, Communicator, Dtype, MemSpace, P2pOp, RawMem, ReduceOp,
    Splits,
};

/// One C call on a communicator, with its arguments as passed (checked when it runs).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Op {
    AllReduce {
        send: usize,
        recv: usize,
        count: usize,
        dtype: c_int,
        op: c_int,
    },
    Broadcast {
        send: usize,
        recv: usize,
        count: usize,
        dtype: c_int,
        root: c_int,
    },
    Reduce {
        send: usize,
        recv: usize,
        count: usize,
        dtype: c_int,
        op: c_int,
        root: c_int,
    },
    AllGather {
        send: usize,
        recv: usize,
        count: usize,
        dtype: c_int,
    },
    ReduceScatter {
        send: usize,
        recv: usize,
        count: usize,
        dtype: c_int,
        op: c_int,
    },
    AllToAll {
        send: usize,
        recv: usize,
        count: usize,
        dtype: c_int,
    },
    Gather {
        send: usize,
        recv: usize,
        count: usize,
        dtype: c_int,
        root: c_int,
    },
    Scatter {
        send: usize,
        recv: usize,
        count: usize,
        dtype: c_int,
        root: c_int,
    },
    Send {
        buf: usize,
        count: usize,
        dtype: c_int,
        peer: c_int,
    },
    Recv {
        buf: usize,
        count: usize,
        dtype: c_int,
        peer: c_int,
    },
    Barrier,
}

impl Op {
    fn kind(&self) -> CollKind {
        match self {
            Op::AllReduce { .. } => CollKind::AllReduce,
            Op::Broadcast { .. } => CollKind::Broadcast,
            Op::Reduce { .. } => CollKind::Reduce,
            Op::AllGather { .. } => CollKind::AllGather,
            Op::ReduceScatter { .. } => CollKind::ReduceScatter,
            Op::AllToAll { .. } => CollKind::AllToAll,
            Op::Gather { .. } => CollKind::Gather,
            Op::Scatter { .. } => CollKind::Scatter,
            Op::Send { .. } => CollKind::Send,
            Op::Recv { .. } => CollKind::Recv,
            Op::Barrier => CollKind::Barrier,
        }
    }

    /// The data type argument (barrier: none).
    fn dtype_arg(&self) -> Option<c_int> {
        match *self {
            Op::AllReduce { dtype, .. }
            | Op::Broadcast { dtype, .. }
            | Op::Reduce { dtype, .. }
            | Op::AllGather { dtype, .. }
            | Op::ReduceScatter { dtype, .. }
            | Op::AllToAll { dtype, .. }
            | Op::Gather { dtype, .. }
            | Op::Scatter { dtype, .. }
            | Op::Send { dtype, .. }
            | Op::Recv { dtype, .. } => Some(dtype),
            Op::Barrier => None,
        }
    }
}

/// `lockstepDataType_t` to [`Dtype`] (NCCL's numbering).
fn dtype_of(v: c_int) -> Result<Dtype, Failure> {
    Ok(match v {
        0 => Dtype::I8,
        1 => Dtype::U8,
        2 => Dtype::I32,
        3 => Dtype::U32,
        4 => Dtype::I64,
        5 => Dtype::U64,
        6 => Dtype::F16,
        7 => Dtype::F32,
        8 => Dtype::F64,
        9 => Dtype::BF16,
        10 | 11 => {
            let name = if v == 10 { "lockstepFloat8e4m3" } else { "lockstepFloat8e5m2" };
            return Err(Failure::invalid_argument(format!(
                "datatype {v} ({name}) is reserved at NCCL's value but not supported by lockstep yet: convert the data to lockstepFloat16 or lockstepBfloat16"
            )));
        }
        _ => {
            return Err(Failure::invalid_argument(format!(
                "datatype {v} is not a lockstepDataType_t (0 = lockstepInt8 ... 9 = lockstepBfloat16; 10 and 11, FP8, are reserved)"
            )))
        }
    })
}

/// `lockstepRedOp_t` to [`ReduceOp`] (NCCL's numbering).
fn op_of(v: c_int) -> Result<ReduceOp, Failure> {
    Ok(match v {
        0 => ReduceOp::Sum,
        1 => ReduceOp::Prod,
        2 => ReduceOp::Max,
        3 => ReduceOp::Min,
        4 => ReduceOp::Avg,
        _ => {
            return Err(Failure::invalid_argument(format!(
                "op {v} is not a lockstepRedOp_t (lockstepSum 0, lockstepProd 1, lockstepMax 2, lockstepMin 3, lockstepAvg 4)"
            )))
        }
    })
}

/// Where a call's buffers live, from the stream argument and the communicator's backend.
#[derive(Clone, Copy, Debug)]
enum Place {
    Host,
    /// Device memory of this ordinal, ready on this CUDA stream.
    Device(i32, usize),
}

impl Place {
    fn space(self) -> MemSpace {
        match self {
            Place::Host => MemSpace::Host,
            Place::Device(d, _) => MemSpace::Device(d),
        }
    }
}

fn place(h: &lockstepComm, stream: usize) -> Result<Place, Failure> {
    match (h.device(), stream) {
        (None, 0) => Ok(Place::Host),
        (None, _) => Err(Failure::invalid_usage(
            "stream is not NULL, but this communicator runs the shared-memory backend on host buffers: pass stream = NULL (CUDA streams and device buffers need a communicator made by lockstepCommInitFromEnv with LOCKSTEP_BACKEND=nccl)",
        )),
        (Some(_), 0) => Err(Failure::invalid_usage(
            "stream is NULL, but this communicator runs NCCL on device buffers: pass the CUDA stream (cudaStream_t) the buffers are ready on",
        )),
        (Some(ctx), s) => Ok(Place::Device(ctx.ordinal(), s)),
    }
}

/// Device calls: the buffers are ready once the caller's stream has drained, and the call has
/// completed when this returns (so later work on the caller's stream sees its result).
fn before_device(h: &lockstepComm, p: Place) -> Result<(), Failure> {
    if let (Place::Device(_, stream), Some(ctx)) = (p, h.device()) {
        let cuda = |e: runtime::cuda::CudaError| {
            Failure::new(lockstepResult_t::lockstepUnhandledCudaError, e.to_string())
        };
        // SAFETY: `stream` is the caller's cudaStream_t, which lockstep.h requires to be a live
        // stream of the communicator's device for the duration of the call.
        unsafe { ctx.synchronize_foreign_stream(stream) }.map_err(cuda)?;
    }
    Ok(())
}

fn after_device(c: &mut Communicator, p: Place) -> Result<(), Failure> {
    match p {
        Place::Device(..) => c.synchronize().map_err(Failure::from),
        Place::Host => Ok(()),
    }
}

/// A checked buffer of `len` elements of `dtype` at `addr` (`what` names it in errors): the
/// pointer checks that only C needs (NULL, alignment, the address space). Empty buffers get a
/// dangling aligned address, whatever was passed.
fn checked_buf(
    addr: usize,
    len: usize,
    dtype: Dtype,
    space: MemSpace,
    what: &str,
) -> Result<RawMem, Failure> {
    let size = dtype.size();
    if len == 0 {
        return Ok(RawMem {
            addr: size,
            len: 0,
            space,
        });
    }
    if addr == 0 {
        return Err(Failure::invalid_argument(format!(
            "{what} is NULL but must hold {len} elements of {dtype}"
        )));
    }
    if !addr.is_multiple_of(size) {
        return Err(Failure::invalid_argument(format!(
            "{what} ({addr:#x}) is not aligned for {dtype} ({size} bytes)"
        )));
    }
    match len.checked_mul(size) {
        Some(b) if b <= isize::MAX as usize && addr.checked_add(b).is_some() => {
            Ok(RawMem { addr, len, space })
        }
        _ => Err(Failure::invalid_argument(format!(
            "{what}: {len} elements of {dtype} do not fit in the address space"
        ))),
    }
}

/// A rank argument (`root`, `peer`) as a rank number: C passes an `int`, which may be negative.
/// Whether it is in range is the shared check's rule (`runtime::comm::check`).
fn rank_of(v: c_int, world: usize, what: &str) -> Result<usize, Failure> {
    usize::try_from(v).map_err(|_| {
        Failure::invalid_argument(format!(
            "{what} {v} is out of range for a communicator of {world} ranks (0..{world})"
        ))
    })
}

/// The [`Call`] of a C collective: its codes translated, and its buffers sized from `count` by
/// the shared table ([`check::need`]: a buffer this rank does not use is empty, so it may be
/// NULL). NCCL's in-place forms need nothing here: the buffers are raw memory, and
/// [`Communicator::run`] recognises the forms and refuses any other overlap.
fn prepare(c: &Communicator, space: MemSpace, op: &Op) -> Result<Call<'static>, Failure> {
    let (rank, world) = (c.rank(), c.world_size());
    let (send, recv, count, dtype, red, root) = match *op {
        Op::AllReduce {
            send,
            recv,
            count,
            dtype,
            op,
        }
        | Op::ReduceScatter {
            send,
            recv,
            count,
            dtype,
            op,
        } => (send, recv, count, dtype, Some(op), None),
        Op::Reduce {
            send,
            recv,
            count,
            dtype,
            op,
            root,
        } => (send, recv, count, dtype, Some(op), Some(root)),
        Op::Broadcast {
            send,
            recv,
            count,
            dtype,
            root,
        }
        | Op::Gather {
            send,
            recv,
            count,
            dtype,
            root,
        }
        | Op::Scatter {
            send,
            recv,
            count,
            dtype,
            root,
        } => (send, recv, count, dtype, None, Some(root)),
        Op::AllGather {
            send,
            recv,
            count,
            dtype,
        }
        | Op::AllToAll {
            send,
            recv,
            count,
            dtype,
        } => (send, recv, count, dtype, None, None),
        Op::Barrier => {
            let none = checked_buf(0, 0, Dtype::U8, space, "buffer")?;
            return Ok(c.call_on(CollKind::Barrier, Dtype::U8, ReduceOp::Sum, 0, none, none));
        }
        Op::Send { .. } | Op::Recv { .. } => {
            return Err(Failure::new(
                lockstepResult_t::lockstepInternalError,
                "a send/recv reached the collective path",
            ))
        }
    };
    let kind = op.kind();
    let d = dtype_of(dtype)?;
    let red = red.map(op_of).transpose()?.unwrap_or(ReduceOp::Sum);
    let root = root.map(|v| rank_of(v, world, "root")).transpose()?;
    let root = root.unwrap_or(0);
    let need = check::need(kind, count, world, rank, root).ok_or_else(|| {
        Failure::invalid_argument(format!("count {count} × {world} ranks overflows"))
    })?;
    Ok(Call {
        kind,
        dtype: d,
        op: red,
        root,
        count,
        send: checked_buf(send, need.send, d, space, "sendbuff")?,
        recv: checked_buf(recv, need.recv, d, space, "recvbuff")?,
        splits: Splits::default(),
    })
}

/// Run one collective. A call refused locally is reported to the peers too (as the Rust API
/// does), so their matching call fails instead of waiting.
fn run_coll(h: &lockstepComm, c: &mut Communicator, stream: usize, op: &Op) -> Result<(), Failure> {
    let prepared = place(h, stream).and_then(|p| prepare(c, p.space(), op).map(|x| (p, x)));
    let (p, call) = match prepared {
        Ok(x) => x,
        Err(f) => {
            let kind = op.kind();
            let e = CommError::InvalidArgument {
                op: kind,
                rank: c.rank(),
                detail: f.msg,
            };
            let dtype = op
                .dtype_arg()
                .and_then(|v| dtype_of(v).ok())
                .unwrap_or(Dtype::U8);
            c.reject_call(kind, dtype, &e);
            return Err(Failure {
                msg: e.to_string(),
                ..f
            });
        }
    };
    before_device(h, p)?;
    // SAFETY: the buffers are the C caller's pointers, which lockstep.h requires to be valid for
    // `count` elements of `datatype` as NCCL sizes them (the sizes `prepare` gave them), aligned,
    // and equal, in NCCL's in-place form or disjoint, until the call returns (or the group end it
    // was recorded in); a device call has completed when this returns (`after_device`). `run`
    // checks lengths, alignment and the in-place forms again and refuses any other overlap.
    unsafe { c.run(&call) }.map_err(Failure::from)?;
    after_device(c, p)
}

/// A send or receive after its local checks, and where its buffer lives.
fn prepare_p2p(
    h: &lockstepComm,
    world: usize,
    stream: usize,
    op: &Op,
) -> Result<(P2pOp, Place), Failure> {
    let (kind, buf, count, dtype, peer) = match *op {
        Op::Send {
            buf,
            count,
            dtype,
            peer,
        } => (CollKind::Send, buf, count, dtype, peer),
        Op::Recv {
            buf,
            count,
            dtype,
            peer,
        } => (CollKind::Recv, buf, count, dtype, peer),
        _ => {
            return Err(Failure::new(
                lockstepResult_t::lockstepInternalError,
                "a collective reached the send/recv path",
            ))
        }
    };
    let place = place(h, stream)?;
    let dtype = dtype_of(dtype)?;
    let peer = rank_of(peer, world, "peer")?;
    let what = if kind == CollKind::Send {
        "sendbuff"
    } else {
        "recvbuff"
    };
    let mem = checked_buf(buf, count, dtype, place.space(), what)?;
    Ok((
        P2pOp {
            kind,
            peer,
            dtype,
            mem,
        },
        place,
    ))
}

/// Run sends and receives: one alone (blocking, as Communicator::send/recv), or several together
/// (`grouped`, as Communicator::group). Nothing runs when one of them fails its checks.
fn run_p2p(
    h: &lockstepComm,
    c: &mut Communicator,
    ops: &[(usize, Op)],
    grouped: bool,
) -> Result<(), Failure> {
    let mut posts = Vec::with_capacity(ops.len());
    let mut places = Vec::with_capacity(ops.len());
    for (stream, op) in ops {
        let (post, place) = prepare_p2p(h, c.world_size(), *stream, op)?;
        posts.push(post);
        places.push(place);
    }
    for p in &places {
        before_device(h, *p)?;
    }
    // SAFETY: (both arms) each buffer is the C caller's pointer, which lockstep.h requires to be
    // valid for `count` elements of `datatype`, aligned, until the call (or the group end) returns,
    // a receive's not read or written by anything else meanwhile; a device call has completed when
    // this returns (`after_device`).
    let r = if grouped {
        unsafe { c.run_p2p(&mut posts) }
    } else {
        posts
            .iter_mut()
            .try_for_each(|p| unsafe { c.run_p2p(std::slice::from_mut(p)) })
    };
    r.map_err(Failure::from)?;
    match places.first() {
        Some(p) => after_device(c, *p),
        None => Ok(()),
    }
}

/// Run `op` on `h` now.
fn run_now(h: &lockstepComm, stream: usize, op: &Op) -> Result<(), Failure> {
    h.with_comm(|c| match op {
        Op::Send { .. } | Op::Recv { .. } => run_p2p(h, c, &[(stream, *op)], false),
        _ => run_coll(h, c, stream, op),
    })
}

/// A call recorded in a group.
struct Pending {
    name: &'static str,
    comm: Arc<lockstepComm>,
    stream: usize,
    op: Op,
}

#[derive(Default)]
struct GroupState {
    depth: u32,
    ops: Vec<Pending>,
}

thread_local! {
    static GROUP: RefCell<GroupState> = RefCell::new(GroupState::default());
}

/// Whether this thread has a group open (lockstepGroupStart without its lockstepGroupEnd yet).
pub(crate) fn in_group() -> bool {
    GROUP.with(|g| g.borrow().depth > 0)
}

/// The entry point of every call on a communicator: run it, or record it in the open group.
pub(crate) fn submit(
    name: &'static str,
    comm: lockstepComm_t,
    stream: *mut c_void,
    op: Op,
) -> lockstepResult_t {
    guard_comm(name, comm, |h| {
        let stream = stream as usize;
        let recorded = GROUP.with(|g| {
            let mut g = g.borrow_mut();
            if g.depth == 0 {
                return false;
            }
            g.ops.push(Pending {
                name,
                comm: h.clone(),
                stream,
                op,
            });
            true
        });
        if recorded {
            return Ok(());
        }
        run_now(h, stream, &op)
    })
}

/// lockstepGroupStart.
pub(crate) fn group_start() -> Result<(), Failure> {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        g.depth = g
            .depth
            .checked_add(1)
            .ok_or_else(|| Failure::invalid_usage("too many nested lockstepGroupStart calls"))?;
        Ok(())
    })
}

/// lockstepGroupEnd: at the outermost one, run what was recorded, in order; consecutive sends and
/// receives on one communicator run together. Every call runs even after one fails (the peers
/// run theirs too, so the ranks stay in step); the first failure is returned.
pub(crate) fn group_end() -> Result<(), Failure> {
    let ops = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return Err(Failure::invalid_usage(
                "lockstepGroupEnd without a matching lockstepGroupStart",
            ));
        }
        g.depth -= 1;
        Ok(if g.depth == 0 {
            std::mem::take(&mut g.ops)
        } else {
            Vec::new()
        })
    })?;
    let mut first: Option<Failure> = None;
    let mut i = 0;
    while i < ops.len() {
        let p = &ops[i];
        let is_p2p = |q: &Pending| matches!(q.op, Op::Send { .. } | Op::Recv { .. });
        let (r, name) = if is_p2p(p) {
            let mut j = i + 1;
            while j < ops.len() && is_p2p(&ops[j]) && Arc::ptr_eq(&ops[j].comm, &p.comm) {
                j += 1;
            }
            let batch: Vec<(usize, Op)> = ops[i..j].iter().map(|q| (q.stream, q.op)).collect();
            i = j;
            (
                p.comm.with_comm(|c| run_p2p(&p.comm, c, &batch, true)),
                "lockstepSend/lockstepRecv",
            )
        } else {
            i += 1;
            (
                p.comm.with_comm(|c| run_coll(&p.comm, c, p.stream, &p.op)),
                p.name,
            )
        };
        if let Err(f) = r {
            let msg = handle::record(name, Some(&p.comm), &f);
            first.get_or_insert(Failure { msg, ..f });
        }
    }
    match first {
        Some(f) => Err(f),
        None => Ok(()),
    }
}
