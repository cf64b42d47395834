//! Running C calls on a communicator: argument checks, NCCL's in-place forms, the stream rule,
//! and groups (lockstepGroupStart/End).
//!
//! A C call becomes an [`Op`] (the arguments as passed). Outside a group it runs at once; inside,
//! it is recorded per thread and runs at the outermost lockstepGroupEnd, consecutive sends and
//! receives on one communicator together through `Communicator::group`.
//!
//! Buffers reach the communicator as [`RawBuf`]s (an address, a length and a memory space), never
//! as Rust references, so NCCL's in-place forms (`sendbuff == recvbuff`) alias nothing.

use std::cell::RefCell;
use std::ffi::{c_int, c_void};
use std::sync::Arc;

use super::handle::{self, guard_comm, lockstepComm, lockstepComm_t, Failure};
use super::types::lockstepResult_t;
use runtime::comm::{
    Buffer, BufferMut, CollKind, CommError, Communicator, Dtype, MemSpace, RawMem, ReduceOp,
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

/// A buffer passed from C: a memory descriptor only.
#[derive(Clone, Copy, Debug)]
struct RawBuf(RawMem);

// SAFETY: a `RawBuf` is made only by `checked_buf` from a pointer the C caller vouches for
// (lockstep.h: valid for `count` elements of `datatype`, aligned, until the call returns; buffers
// equal or disjoint), and handed to the communicator only under the Rust element type of that
// datatype (the `typed!` dispatch), within the C call (or the group end) it came with.
unsafe impl<T: runtime::comm::Element> Buffer<T> for RawBuf {
    fn raw(&self) -> RawMem {
        self.0
    }
}

// SAFETY: as for `Buffer`; a receive buffer is written only through this descriptor, and a send
// buffer that overlaps it is refused unless it is NCCL's in-place form: through the
// communicator's in-place methods (one descriptor), or for gather and scatter, which have none, a
// send block equal to the root's own receive block, which every backend copies onto itself as a
// no-op (raw memory, no Rust references, so the aliasing is no borrow).
unsafe impl<T: runtime::comm::Element> BufferMut<T> for RawBuf {
    fn raw_mut(&mut self) -> RawMem {
        self.0
    }
}

/// Run `$body` with `$T` the Rust element type of `$dtype`.
macro_rules! typed {
    ($dtype:expr, $T:ident, $body:expr) => {
        match $dtype {
            Dtype::F32 => {
                type $T = f32;
                $body
            }
            Dtype::F64 => {
                type $T = f64;
                $body
            }
            Dtype::F16 => {
                type $T = runtime::half::f16;
                $body
            }
            Dtype::BF16 => {
                type $T = runtime::half::bf16;
                $body
            }
            Dtype::I32 => {
                type $T = i32;
                $body
            }
            Dtype::I64 => {
                type $T = i64;
                $body
            }
            Dtype::U8 => {
                type $T = u8;
                $body
            }
            Dtype::I8 => {
                type $T = i8;
                $body
            }
            Dtype::U32 => {
                type $T = u32;
                $body
            }
            Dtype::U64 => {
                type $T = u64;
                $body
            }
            // `Dtype` is non-exhaustive; `dtype_of` only produces the types above.
            other => {
                return Err(
                    CommError::Unsupported(format!("data type {other:?} has no C ABI code")).into(),
                )
            }
        }
    };
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

/// A checked buffer of `len` elements of `dtype` at `addr` (`what` names it in errors). Empty
/// buffers get a dangling aligned address, whatever was passed.
fn checked_buf(
    addr: usize,
    len: usize,
    dtype: Dtype,
    space: MemSpace,
    what: &str,
) -> Result<RawBuf, Failure> {
    let size = dtype.size();
    if len == 0 {
        return Ok(RawBuf(RawMem {
            addr: size,
            len: 0,
            space,
        }));
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
            Ok(RawBuf(RawMem { addr, len, space }))
        }
        _ => Err(Failure::invalid_argument(format!(
            "{what}: {len} elements of {dtype} do not fit in the address space"
        ))),
    }
}

/// Refuse buffers that overlap without being the same (NCCL's in-place forms are handled before).
fn disjoint(a: RawBuf, b: RawBuf, size: usize) -> Result<(), Failure> {
    let (a0, a1) = (a.0.addr, a.0.addr + a.0.len * size);
    let (b0, b1) = (b.0.addr, b.0.addr + b.0.len * size);
    if a.0.len > 0 && b.0.len > 0 && a0 < b1 && b0 < a1 {
        return Err(Failure::invalid_argument(format!(
            "sendbuff [{a0:#x}, {a1:#x}) and recvbuff [{b0:#x}, {b1:#x}) overlap without being the in-place form: use separate buffers or the in-place form"
        )));
    }
    Ok(())
}

fn check_rank(v: c_int, world: usize, what: &str) -> Result<usize, Failure> {
    usize::try_from(v)
        .ok()
        .filter(|&r| r < world)
        .ok_or_else(|| {
            Failure::invalid_argument(format!(
                "{what} {v} is out of range for a communicator of {world} ranks (0..{})",
                world
            ))
        })
}

/// A collective after its local checks: the typed call to make. Gather and scatter have no in-place
/// methods: in place, the root's `s` (gather) or `r` (scatter) is its own block of the other
/// buffer, which every backend copies onto itself as a no-op (as in the in-place all-gather).
enum Coll {
    AllReduce {
        s: RawBuf,
        r: RawBuf,
        op: ReduceOp,
    },
    AllReduceInPlace {
        b: RawBuf,
        op: ReduceOp,
    },
    Broadcast {
        s: RawBuf,
        r: RawBuf,
        root: usize,
    },
    BroadcastInPlace {
        b: RawBuf,
        root: usize,
    },
    Reduce {
        s: RawBuf,
        r: RawBuf,
        op: ReduceOp,
        root: usize,
    },
    ReduceInPlace {
        b: RawBuf,
        op: ReduceOp,
        root: usize,
    },
    AllGather {
        s: RawBuf,
        r: RawBuf,
    },
    AllGatherInPlace {
        b: RawBuf,
    },
    ReduceScatter {
        s: RawBuf,
        r: RawBuf,
        op: ReduceOp,
    },
    ReduceScatterInPlace {
        b: RawBuf,
        op: ReduceOp,
    },
    AllToAll {
        s: RawBuf,
        r: RawBuf,
    },
    Gather {
        s: RawBuf,
        r: RawBuf,
        root: usize,
    },
    Scatter {
        s: RawBuf,
        r: RawBuf,
        root: usize,
    },
    Barrier,
}

/// Local checks of a collective, and NCCL's in-place forms.
fn prepare(c: &Communicator, space: MemSpace, op: &Op) -> Result<(Dtype, Coll), Failure> {
    let (rank, world) = (c.rank(), c.world_size());
    let times_world = |count: usize| {
        count.checked_mul(world).ok_or_else(|| {
            Failure::invalid_argument(format!("count {count} × {world} ranks overflows"))
        })
    };
    Ok(match *op {
        Op::AllReduce {
            send,
            recv,
            count,
            dtype,
            op,
        } => {
            let (d, op) = (dtype_of(dtype)?, op_of(op)?);
            if send == recv {
                (
                    d,
                    Coll::AllReduceInPlace {
                        b: checked_buf(recv, count, d, space, "recvbuff")?,
                        op,
                    },
                )
            } else {
                let s = checked_buf(send, count, d, space, "sendbuff")?;
                let r = checked_buf(recv, count, d, space, "recvbuff")?;
                disjoint(s, r, d.size())?;
                (d, Coll::AllReduce { s, r, op })
            }
        }
        Op::Broadcast {
            send,
            recv,
            count,
            dtype,
            root,
        } => {
            let d = dtype_of(dtype)?;
            let root = check_rank(root, world, "root")?;
            let r = checked_buf(recv, count, d, space, "recvbuff")?;
            // Only the root's sendbuff is read: elsewhere the call is the in-place form.
            if rank != root || send == recv {
                (d, Coll::BroadcastInPlace { b: r, root })
            } else {
                let s = checked_buf(send, count, d, space, "sendbuff")?;
                disjoint(s, r, d.size())?;
                (d, Coll::Broadcast { s, r, root })
            }
        }
        Op::Reduce {
            send,
            recv,
            count,
            dtype,
            op,
            root,
        } => {
            let (d, op) = (dtype_of(dtype)?, op_of(op)?);
            let root = check_rank(root, world, "root")?;
            if send == recv {
                (
                    d,
                    Coll::ReduceInPlace {
                        b: checked_buf(send, count, d, space, "sendbuff")?,
                        op,
                        root,
                    },
                )
            } else {
                let s = checked_buf(send, count, d, space, "sendbuff")?;
                // Only the root's recvbuff is written: elsewhere it may be NULL.
                let r = if rank == root {
                    checked_buf(recv, count, d, space, "recvbuff")?
                } else {
                    checked_buf(0, 0, d, space, "recvbuff")?
                };
                disjoint(s, r, d.size())?;
                (d, Coll::Reduce { s, r, op, root })
            }
        }
        Op::AllGather {
            send,
            recv,
            count,
            dtype,
        } => {
            let d = dtype_of(dtype)?;
            let r = checked_buf(recv, times_world(count)?, d, space, "recvbuff")?;
            // In place: this rank's block already sits at recvbuff + rank * sendcount.
            if count > 0 && send == recv.wrapping_add(rank * count * d.size()) {
                (d, Coll::AllGatherInPlace { b: r })
            } else {
                let s = checked_buf(send, count, d, space, "sendbuff")?;
                disjoint(s, r, d.size())?;
                (d, Coll::AllGather { s, r })
            }
        }
        Op::ReduceScatter {
            send,
            recv,
            count,
            dtype,
            op,
        } => {
            let (d, op) = (dtype_of(dtype)?, op_of(op)?);
            let s = checked_buf(send, times_world(count)?, d, space, "sendbuff")?;
            // In place: the result block lands at sendbuff + rank * recvcount.
            if count > 0 && recv == send.wrapping_add(rank * count * d.size()) {
                (d, Coll::ReduceScatterInPlace { b: s, op })
            } else {
                let r = checked_buf(recv, count, d, space, "recvbuff")?;
                disjoint(s, r, d.size())?;
                (d, Coll::ReduceScatter { s, r, op })
            }
        }
        Op::AllToAll {
            send,
            recv,
            count,
            dtype,
        } => {
            let d = dtype_of(dtype)?;
            let total = times_world(count)?;
            if send == recv && total > 0 {
                return Err(Failure::invalid_argument(
                    "sendbuff == recvbuff: lockstepAlltoAll has no in-place form (nor has ncclAlltoAll); use separate buffers",
                ));
            }
            let s = checked_buf(send, total, d, space, "sendbuff")?;
            let r = checked_buf(recv, total, d, space, "recvbuff")?;
            disjoint(s, r, d.size())?;
            (d, Coll::AllToAll { s, r })
        }
        Op::Gather {
            send,
            recv,
            count,
            dtype,
            root,
        } => {
            let d = dtype_of(dtype)?;
            let root = check_rank(root, world, "root")?;
            let s = checked_buf(send, count, d, space, "sendbuff")?;
            // Only the root's recvbuff is written: elsewhere it may be NULL.
            if rank != root {
                (
                    d,
                    Coll::Gather {
                        s,
                        r: checked_buf(0, 0, d, space, "recvbuff")?,
                        root,
                    },
                )
            } else {
                let r = checked_buf(recv, times_world(count)?, d, space, "recvbuff")?;
                // In place: the root's block already sits at recvbuff + root * count.
                if count == 0 || send != recv.wrapping_add(root * count * d.size()) {
                    disjoint(s, r, d.size())?;
                }
                (d, Coll::Gather { s, r, root })
            }
        }
        Op::Scatter {
            send,
            recv,
            count,
            dtype,
            root,
        } => {
            let d = dtype_of(dtype)?;
            let root = check_rank(root, world, "root")?;
            let r = checked_buf(recv, count, d, space, "recvbuff")?;
            // Only the root's sendbuff is read: elsewhere it may be NULL.
            if rank != root {
                (
                    d,
                    Coll::Scatter {
                        s: checked_buf(0, 0, d, space, "sendbuff")?,
                        r,
                        root,
                    },
                )
            } else {
                let s = checked_buf(send, times_world(count)?, d, space, "sendbuff")?;
                // In place: the root's block is left at sendbuff + root * count.
                if count == 0 || recv != send.wrapping_add(root * count * d.size()) {
                    disjoint(s, r, d.size())?;
                }
                (d, Coll::Scatter { s, r, root })
            }
        }
        Op::Barrier => (Dtype::U8, Coll::Barrier),
        Op::Send { .. } | Op::Recv { .. } => {
            return Err(Failure::new(
                lockstepResult_t::lockstepInternalError,
                "a send/recv reached the collective path",
            ))
        }
    })
}

/// Run one collective. A call refused locally is reported to the peers too (as the Rust API
/// does), so their matching call fails instead of waiting.
fn run_coll(h: &lockstepComm, c: &mut Communicator, stream: usize, op: &Op) -> Result<(), Failure> {
    let prepared = place(h, stream).and_then(|p| prepare(c, p.space(), op).map(|x| (p, x)));
    let (p, (d, coll)) = match prepared {
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
    let r = typed!(
        d,
        T,
        match coll {
            Coll::AllReduce { s, mut r, op } => c.all_reduce::<T, _, _>(&s, &mut r, op),
            Coll::AllReduceInPlace { mut b, op } => c.all_reduce_in_place::<T, _>(&mut b, op),
            Coll::Broadcast { s, mut r, root } => c.broadcast::<T, _, _>(&s, &mut r, root),
            Coll::BroadcastInPlace { mut b, root } => c.broadcast_in_place::<T, _>(&mut b, root),
            Coll::Reduce { s, mut r, op, root } => c.reduce::<T, _, _>(&s, &mut r, op, root),
            Coll::ReduceInPlace { mut b, op, root } => c.reduce_in_place::<T, _>(&mut b, op, root),
            Coll::AllGather { s, mut r } => c.all_gather::<T, _, _>(&s, &mut r),
            Coll::AllGatherInPlace { mut b } => c.all_gather_in_place::<T, _>(&mut b),
            Coll::ReduceScatter { s, mut r, op } => c.reduce_scatter::<T, _, _>(&s, &mut r, op),
            Coll::ReduceScatterInPlace { mut b, op } =>
                c.reduce_scatter_in_place::<T, _>(&mut b, op),
            Coll::AllToAll { s, mut r } => c.all_to_all::<T, _, _>(&s, &mut r),
            Coll::Gather { s, mut r, root } => c.gather::<T, _, _>(&s, &mut r, root),
            Coll::Scatter { s, mut r, root } => c.scatter::<T, _, _>(&s, &mut r, root),
            Coll::Barrier => c.barrier(),
        }
    );
    r.map_err(Failure::from)?;
    after_device(c, p)
}

/// A send or receive after its local checks.
struct P2p {
    send: bool,
    peer: usize,
    dtype: Dtype,
    buf: RawBuf,
    place: Place,
}

fn prepare_p2p(h: &lockstepComm, world: usize, stream: usize, op: &Op) -> Result<P2p, Failure> {
    let (send, buf, count, dtype, peer) = match *op {
        Op::Send {
            buf,
            count,
            dtype,
            peer,
        } => (true, buf, count, dtype, peer),
        Op::Recv {
            buf,
            count,
            dtype,
            peer,
        } => (false, buf, count, dtype, peer),
        _ => {
            return Err(Failure::new(
                lockstepResult_t::lockstepInternalError,
                "a collective reached the send/recv path",
            ))
        }
    };
    let place = place(h, stream)?;
    let dtype = dtype_of(dtype)?;
    let peer = check_rank(peer, world, "peer")?;
    let buf = checked_buf(
        buf,
        count,
        dtype,
        place.space(),
        if send { "sendbuff" } else { "recvbuff" },
    )?;
    Ok(P2p {
        send,
        peer,
        dtype,
        buf,
        place,
    })
}

/// Run sends and receives: one alone (blocking, as Communicator::send/recv), or several together
/// (`grouped`, through Communicator::group). Nothing runs when one of them fails its checks.
fn run_p2p(
    h: &lockstepComm,
    c: &mut Communicator,
    ops: &[(usize, Op)],
    grouped: bool,
) -> Result<(), Failure> {
    let mut items = Vec::with_capacity(ops.len());
    for (stream, op) in ops {
        items.push(prepare_p2p(h, c.world_size(), *stream, op)?);
    }
    for it in &items {
        before_device(h, it.place)?;
    }
    let r = if grouped {
        let items = &mut items;
        c.group(move |g| {
            for it in items {
                let (peer, send) = (it.peer, it.send);
                let buf = &mut it.buf;
                typed!(
                    it.dtype,
                    T,
                    if send {
                        g.send::<T, RawBuf>(buf, peer)?
                    } else {
                        g.recv::<T, RawBuf>(buf, peer)?
                    }
                );
            }
            Ok(())
        })
    } else {
        let mut r = Ok(());
        for it in &mut items {
            let peer = it.peer;
            r = typed!(
                it.dtype,
                T,
                if it.send {
                    c.send::<T, RawBuf>(&it.buf, peer)
                } else {
                    c.recv::<T, RawBuf>(&mut it.buf, peer)
                }
            );
            if r.is_err() {
                break;
            }
        }
        r
    };
    r.map_err(Failure::from)?;
    match items.first() {
        Some(it) => after_device(c, it.place),
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
