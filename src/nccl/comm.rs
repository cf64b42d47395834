//! The NCCL communicator: [`NcclComm`] implements [`Backend`] on device buffers and one stream,
//! with its settings ([`NcclOptions`]), the native calls (the collectives NCCL has, send, recv,
//! groups) and its teardown.
//!
//! The rest of the communicator is in the files beside this one, one idea each: how it is
//! created (`bootstrap.rs`, `split.rs`), how every wait is watched and aborted (`watchdog.rs`,
//! over the state in `abort.rs`), what is checked before anything is enqueued (`checks.rs`), and
//! the collectives built from grouped send/recv (`composite.rs`).

use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::time::Duration;

use crate::comm::{
    Backend, BackendKind, Call, CollKind, CommError, Communicator, Completion, Dtype, Element,
    P2pOp,
};
use crate::cuda::{Context, DeviceBuffer, ForeignStream, Producers, Stream, StreamFence};

use super::abort::Shared;
use super::error::NcclError;
use super::result::{self, cudaStream_t, ncclComm_t, SUCCESS};

/// A liveness check polled while waiting: `Some(reason)` aborts the communicator.
pub type AbortCheck = Arc<dyn Fn() -> Option<String> + Send + Sync>;

/// Settings of an [`NcclComm`].
#[derive(Clone)]
pub struct NcclOptions {
    /// Longest wait for init or a synchronize before aborting (default 300 s; [`NcclOptions::from_env`]
    /// takes `LOCKSTEP_TIMEOUT_S`).
    pub timeout: Duration,
    /// Create the communicator non-blocking when the library supports it (default true).
    pub nonblocking_init: bool,
    /// Polled while waiting; e.g. the launcher's "is a peer dead?" check.
    pub abort_check: Option<AbortCheck>,
}

impl Default for NcclOptions {
    /// A 300 s timeout, non-blocking init, no liveness check (the environment is not read: see
    /// [`NcclOptions::from_env`]).
    fn default() -> Self {
        NcclOptions {
            timeout: Duration::from_secs(300),
            nonblocking_init: true,
            abort_check: None,
        }
    }
}

impl NcclOptions {
    /// The defaults with the timeout from `LOCKSTEP_TIMEOUT_S` when it is set (a number of seconds
    /// greater than 0; anything else is an error naming the variable).
    pub fn from_env() -> Result<NcclOptions, crate::types::env::EnvError> {
        let mut o = NcclOptions::default();
        if let Some(t) = crate::types::env::TIMEOUT_S.secs()? {
            o.timeout = t;
        }
        Ok(o)
    }
}

/// An NCCL communicator bound to one device and one stream.
pub struct NcclComm {
    pub(super) ctx: Arc<Context>,
    pub(super) stream: Stream,
    pub(super) comm: ncclComm_t,
    /// The handle's abort state, shared with the completion handles of nonblocking calls.
    pub(super) shared: Arc<Shared>,
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) seq: u64,
    pub(super) opts: NcclOptions,
    /// One element for `barrier`.
    pub(super) scratch: DeviceBuffer<f32>,
    /// Orders the stream after the context's other streams before each call, so that buffers
    /// still being written elsewhere are not read early.
    pub(super) producers: Producers,
    /// Orders the stream with a caller's (`wait_stream`, `signal_stream`).
    pub(super) fence: StreamFence,
    /// The last call enqueued, which waits name (a dead peer's error says where it struck).
    pub(super) current: CollKind,
    /// The host communicator this one was bootstrapped through, when it was (see
    /// `membership.rs`): the peer watch, shrink and grow.
    pub(super) membership: Option<super::membership::Membership>,
    /// Across nodes: the shared-memory communicator of this node's ranks, where each call is
    /// shown to `lockstep status` as [`membership`](Self::membership) shows it on one node. Its
    /// ranks are not NCCL's (only this node's), so it watches no peer and shrinks nothing.
    pub(super) node_view: Option<Communicator>,
}

// SAFETY: an NCCL communicator may be used from any thread, one at a time (`&mut self`); the
// context is bound before every call.
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// Wrap in a [`Communicator`].
    pub fn into_communicator(self) -> Communicator {
        Communicator::from_backend(Box::new(self))
    }

    /// Show each call of this communicator made across nodes to `lockstep status` in `node`,
    /// the shared-memory communicator of this node's ranks (see [`node_view`](Self::node_view)).
    pub(crate) fn show_in(&mut self, node: Communicator) {
        self.node_view = Some(node);
    }

    /// The stream collectives are enqueued on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The CUDA context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    pub(super) fn raw_stream(&self) -> cudaStream_t {
        self.stream.raw() as cudaStream_t
    }

    /// Run `f` between `ncclGroupStart` and `ncclGroupEnd` (fuses the calls it makes).
    pub fn group<R>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<R, NcclError>,
    ) -> Result<R, NcclError> {
        self.check_alive("ncclGroupStart")?;
        let api = result::api()?;
        // SAFETY: no arguments.
        result::check(unsafe { (api.ncclGroupStart)() }, None, || {
            "ncclGroupStart".into()
        })?;
        let r = f(self);
        // SAFETY: no arguments; always closes the group opened above.
        let rc = unsafe { (api.ncclGroupEnd)() };
        let end = self.settle(rc, "ncclGroupEnd");
        let r = r?;
        end?;
        Ok(r)
    }

    /// Send `buf` to `peer` (enqueued on the stream; pair with `recv` on the peer). Ordered after
    /// the work already enqueued on the context's other streams, like every collective (see
    /// `Producers`): a buffer filled on another stream is complete before it is sent.
    pub fn send<T: Element>(
        &mut self,
        buf: &DeviceBuffer<T>,
        peer: usize,
    ) -> Result<(), NcclError> {
        let (device, addr) = (buf.device(), buf.device_ptr() as usize);
        self.p2p_ordered(CollKind::Send, device, addr, buf.len(), T::DTYPE, peer)
    }

    /// Receive into `buf` from `peer` (ordered after the other streams' work, as [`send`](Self::send):
    /// e.g. a zero-fill of `buf` on another stream cannot land after the data).
    pub fn recv<T: Element>(
        &mut self,
        buf: &mut DeviceBuffer<T>,
        peer: usize,
    ) -> Result<(), NcclError> {
        let (device, addr) = (buf.device(), buf.device_ptr() as usize);
        self.p2p_ordered(CollKind::Recv, device, addr, buf.len(), T::DTYPE, peer)
    }

    /// The typed [`send`](Self::send) or [`recv`](Self::recv) (`kind`) of `count` elements at
    /// `addr` on `device`: check the peer and the device, order the stream after the others, then
    /// enqueue it.
    fn p2p_ordered(
        &mut self,
        kind: CollKind,
        device: i32,
        addr: usize,
        count: usize,
        dtype: Dtype,
        peer: usize,
    ) -> Result<(), NcclError> {
        self.check_peer(peer, kind.name())?;
        self.check_device(device, kind.name())?;
        self.producers.order(&self.stream)?;
        self.p2p_raw(kind, addr, count, dtype, peer)
    }

    /// Enqueue one `ncclSend` (`kind` is [`CollKind::Send`]) or `ncclRecv` (any other kind) of
    /// `count` elements at device address `addr` with `peer`: one body for both directions, so
    /// they check, name and settle their calls alike.
    pub(super) fn p2p_raw(
        &mut self,
        kind: CollKind,
        addr: usize,
        count: usize,
        dtype: Dtype,
        peer: usize,
    ) -> Result<(), NcclError> {
        let send = kind == CollKind::Send;
        let name = if send { "ncclSend" } else { "ncclRecv" };
        self.check_alive(name)?;
        let s = self.raw_stream();
        let api = result::api()?;
        let (dt, p, comm) = (result::nccl_dtype(dtype), peer as c_int, self.comm);
        // SAFETY: `addr` is a live device buffer of `count` elements on this device (checked by the
        // callers), writable for a receive; the stream belongs to this communicator's context.
        let rc = unsafe {
            if send {
                (api.ncclSend)(addr as *const c_void, count, dt, p, comm, s)
            } else {
                (api.ncclRecv)(addr as *mut c_void, count, dt, p, comm, s)
            }
        };
        self.settle(
            rc,
            &format!("{name}(count={count}, dtype={dtype}, peer={peer})"),
        )
    }

    fn enqueue(&mut self, call: &Call) -> Result<(), NcclError> {
        let api = result::api()?;
        self.ctx.bind()?;
        let (dt, op, s, comm) = (
            result::nccl_dtype(call.dtype),
            result::nccl_op(call.op),
            self.raw_stream(),
            self.comm,
        );
        let (sp, rp) = (
            call.send.addr as *const c_void,
            call.recv.addr as *mut c_void,
        );
        let root = call.root as c_int;
        let what = format!(
            "nccl {}(count={}, dtype={}, op={}, root={})",
            call.kind, call.count, call.dtype, call.op, call.root
        );
        // SAFETY: (all arms) `check_call` verified that every non-empty buffer is device memory of
        // this communicator's device with at least the elements NCCL will touch; the stream belongs
        // to this context; the communicator is live (not aborted).
        let rc = unsafe {
            match call.kind {
                CollKind::AllReduce => (api.ncclAllReduce)(sp, rp, call.count, dt, op, comm, s),
                CollKind::Broadcast => (api.ncclBroadcast)(sp, rp, call.count, dt, root, comm, s),
                CollKind::Reduce => (api.ncclReduce)(sp, rp, call.count, dt, op, root, comm, s),
                CollKind::AllGather => (api.ncclAllGather)(sp, rp, call.count, dt, comm, s),
                CollKind::ReduceScatter => {
                    (api.ncclReduceScatter)(sp, rp, call.count, dt, op, comm, s)
                }
                CollKind::Gather => return self.gather(call),
                CollKind::AllToAll
                | CollKind::AllToAllV
                | CollKind::Scatter
                | CollKind::AllGatherV
                | CollKind::GatherV => return self.exchange(call),
                CollKind::Barrier => {
                    let p = self.scratch.device_ptr() as *mut c_void;
                    let rc = (api.ncclAllReduce)(
                        p,
                        p,
                        1,
                        result::nccl_dtype(crate::comm::Dtype::F32),
                        result::nccl_op(crate::comm::ReduceOp::Sum),
                        comm,
                        s,
                    );
                    self.settle(rc, &what)?;
                    return self.wait("barrier");
                }
                // `check_call` refuses the rest before anything is enqueued.
                _ => {
                    return Err(NcclError::Call {
                        call: what,
                        code: 5,
                        message: "not supported by the nccl backend yet".into(),
                        last: String::new(),
                        hint: "use the shm backend",
                    })
                }
            }
        };
        self.settle(rc, &what)
    }
}

impl Backend for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn kind(&self) -> BackendKind {
        BackendKind::Nccl
    }

    fn device(&self) -> Option<Arc<Context>> {
        Some(self.ctx.clone())
    }

    fn describe(&self) -> String {
        let v = result::core()
            .map(|c| crate::cuda::nccl_version_string(c.version))
            .unwrap_or_else(|_| "?".into());
        format!("nccl {v} device {}", self.ctx.ordinal())
    }

    fn run(&mut self, call: &Call) -> Result<(), CommError> {
        self.check_call(call)?;
        self.check_alive(call.kind.name())?;
        self.seq += 1;
        self.current = call.kind;
        if let Some(m) = &self.membership {
            m.show(call, self.seq);
        } else if let Some(v) = &self.node_view {
            v.show_carried(call, self.seq);
        }
        self.producers
            .order(&self.stream)
            .map_err(NcclError::from)?;
        self.enqueue(call).map_err(CommError::from)
    }

    fn completion(&mut self) -> Result<Option<Box<dyn Completion>>, CommError> {
        self.watched_completion().map(Some)
    }

    fn last_path(&self) -> crate::trace::CallPath {
        crate::trace::CallPath::Nccl
    }

    fn synchronize(&mut self) -> Result<(), CommError> {
        self.wait("synchronize").map_err(CommError::from)
    }

    fn wait_stream(&mut self, caller: &ForeignStream) -> Result<(), CommError> {
        self.check_alive("wait_stream")?;
        self.fence
            .enter(caller, &self.stream)
            .map_err(|e| CommError::from(NcclError::from(e)))
    }

    fn signal_stream(&mut self, caller: &ForeignStream) -> Result<(), CommError> {
        self.check_alive("signal_stream")?;
        self.fence
            .leave(&self.stream, caller)
            .map_err(|e| CommError::from(NcclError::from(e)))
    }

    fn seq(&self) -> u64 {
        self.seq
    }

    /// Sends and receives as one NCCL group (`ncclGroupStart` … `ncclGroupEnd`), enqueued on the
    /// communicator's stream; NCCL matches them per peer in order, a send to this rank itself
    /// included. Complete with [`synchronize`](Backend::synchronize) or a `Work` handle.
    fn p2p(&mut self, ops: &mut [P2pOp]) -> Result<(), CommError> {
        self.check_p2p(ops)?;
        self.check_alive("send/recv")?;
        self.ctx.bind().map_err(NcclError::from)?;
        self.seq += 1;
        self.current = ops.first().map_or(CollKind::Send, |op| op.kind);
        self.producers
            .order(&self.stream)
            .map_err(NcclError::from)?;
        self.group(|me| {
            for op in ops {
                me.p2p_raw(op.kind, op.mem.addr, op.mem.len, op.dtype, op.peer)?;
            }
            Ok(())
        })
        .map_err(CommError::from)
    }

    fn split(
        &mut self,
        color: Option<u32>,
        key: i64,
    ) -> Result<Option<Box<dyn Backend>>, CommError> {
        Ok(self
            .split_comm(color, key)?
            .map(|c| Box::new(c) as Box<dyn Backend>))
    }

    fn shrink(&mut self, exclude: &[usize], wait: Duration) -> Result<Box<dyn Backend>, CommError> {
        Ok(Box::new(self.shrink_comm(exclude, wait)?))
    }

    fn grow(&mut self, wait: Option<Duration>) -> Result<Box<dyn Backend>, CommError> {
        Ok(Box::new(self.grow_comm(wait)?))
    }

    fn global_ranks(&self) -> Option<Vec<usize>> {
        self.membership.as_ref().and_then(|m| m.global_ranks())
    }

    fn peer_check(&self) -> Option<crate::comm::PeerCheck> {
        self.membership.as_ref().and_then(|m| m.peers.clone())
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if self.shared.aborted().is_some() {
            return;
        }
        let Ok(api) = result::api() else { return };
        let _ = self.ctx.bind();
        // Finalize (flushes pending work, may be in progress on a non-blocking communicator),
        // then destroy; on any failure abort instead. Failures are recorded on the context.
        let mut ok = true;
        if let Some(fin) = api.ncclCommFinalize {
            // SAFETY: live communicator.
            let rc = unsafe { fin(self.comm) };
            if let Err(e) = self.settle(rc, "ncclCommFinalize") {
                self.ctx.record_err(
                    "an NCCL communicator".into(),
                    crate::cuda::CudaError::Io(e.to_string()),
                );
                ok = false;
            }
        }
        // Destroy under the lock, so that no pending `Work` uses the handle during or after it.
        let mut st = self.shared.state();
        if ok && st.aborted.is_none() {
            // SAFETY: live, finalized communicator; never used again (`destroyed` is set).
            let rc = unsafe { (api.ncclCommDestroy)(self.comm) };
            st.destroyed = true;
            if rc != SUCCESS {
                self.ctx.record_err(
                    "an NCCL communicator".into(),
                    crate::cuda::CudaError::Io(format!("ncclCommDestroy returned {rc}")),
                );
            }
        }
    }
}
