//! The NCCL communicator: [`NcclComm`] implements [`Backend`] on device buffers and one stream.
//!
//! Set-up: rank 0 creates the unique id (after the fork) and hands it to the other ranks through a
//! caller-provided [`UniqueIdExchange`] (the launcher's pipe, a TCP store, ...). The communicator
//! is created non-blocking (`ncclCommInitRankConfig`, `blocking = 0`) and polled with a timeout.
//!
//! Waiting: [`Backend::synchronize`] polls the stream and `ncclCommGetAsyncError`; on an error, a
//! timeout or a failed liveness check it calls `ncclCommAbort`, so a dead peer becomes a
//! `CommError` instead of a hang. Every argument is checked before anything is enqueued.

use std::ffi::{c_int, c_void};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::comm::{
    Backend, BackendKind, Call, CollKind, CommError, Communicator, Completion, Element, MemSpace,
    P2pOp, ANY_SOURCE,
};
use crate::cuda::{Context, DeviceBuffer, Event, ForeignStream, Producers, Stream, StreamFence};

use super::error::NcclError;
use super::result::{self, cudaStream_t, ncclComm_t, ncclUniqueId, IN_PROGRESS, SUCCESS};

/// Hands the NCCL unique id from rank 0 to every rank.
pub trait UniqueIdExchange {
    /// Rank 0 passes `Some(id)` and gets it back; other ranks pass `None` and receive rank 0's id.
    fn exchange(&mut self, rank: usize, id: Option<&[u8; 128]>) -> Result<[u8; 128], String>;
}

impl<F: FnMut(usize, Option<&[u8; 128]>) -> Result<[u8; 128], String>> UniqueIdExchange for F {
    fn exchange(&mut self, rank: usize, id: Option<&[u8; 128]>) -> Result<[u8; 128], String> {
        self(rank, id)
    }
}

/// Exchange through an existing host communicator (e.g. the launcher's shm `Communicator`):
/// rank 0 broadcasts the id to every rank. This plugs NCCL straight into `lockstep::launch`.
impl UniqueIdExchange for Communicator {
    fn exchange(&mut self, rank: usize, id: Option<&[u8; 128]>) -> Result<[u8; 128], String> {
        if rank != self.rank() {
            return Err(format!(
                "exchange called as rank {rank} on the communicator of rank {}",
                self.rank()
            ));
        }
        let mut buf: Vec<u8> = id.map(|i| i.to_vec()).unwrap_or_else(|| vec![0u8; 128]);
        self.broadcast_in_place(&mut buf, 0)
            .map_err(|e| e.to_string())?;
        let mut out = [0u8; 128];
        out.copy_from_slice(&buf);
        Ok(out)
    }
}

/// Exchange through the rendezvous store, for jobs that span nodes: rank 0 publishes the id under
/// `key`, every other rank waits up to `timeout` for it. Use a fresh key per communicator.
pub struct StoreExchange<'a> {
    /// The job's store (see `lockstep::store`).
    pub store: &'a mut dyn crate::store::Store,
    /// Key of this communicator's id.
    pub key: String,
    /// Longest wait for rank 0's id.
    pub timeout: Duration,
}

impl UniqueIdExchange for StoreExchange<'_> {
    fn exchange(&mut self, rank: usize, id: Option<&[u8; 128]>) -> Result<[u8; 128], String> {
        if let Some(id) = id {
            self.store
                .set(&self.key, id)
                .map_err(|e| format!("publishing the NCCL unique id: {e}"))?;
            return Ok(*id);
        }
        let v = self.store.wait_get(&self.key, self.timeout).map_err(|e| {
            format!(
                "rank {rank} waiting for rank 0's NCCL unique id under {:?}: {e}",
                self.key
            )
        })?;
        v.as_slice().try_into().map_err(|_| {
            format!(
                "the store holds {} bytes under {:?}, not a 128-byte NCCL unique id",
                v.len(),
                self.key
            )
        })
    }
}

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
    ctx: Arc<Context>,
    stream: Stream,
    comm: ncclComm_t,
    /// The handle's abort state, shared with the completion handles of nonblocking calls.
    shared: Arc<Shared>,
    rank: usize,
    world: usize,
    seq: u64,
    opts: NcclOptions,
    /// One element for `barrier`.
    scratch: DeviceBuffer<f32>,
    /// Orders the stream after the context's other streams before each call, so that buffers
    /// still being written elsewhere are not read early.
    producers: Producers,
    /// Orders the stream with a caller's (`wait_stream`, `signal_stream`).
    fence: StreamFence,
}

// SAFETY: an NCCL communicator may be used from any thread, one at a time (`&mut self`); the
// context is bound before every call.
unsafe impl Send for NcclComm {}

/// The NCCL handle as the communicator and its pending `Work` handles share it: a `Work` may poll
/// `ncclCommGetAsyncError` and abort the communicator from another thread, and must never touch
/// it after `ncclCommDestroy`, so both happen under `state`'s lock.
struct Shared {
    comm: ncclComm_t,
    rank: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Set once aborted: every later call fails with this reason.
    aborted: Option<String>,
    /// Set once `ncclCommDestroy` ran.
    destroyed: bool,
}

// SAFETY: `ncclCommGetAsyncError` and `ncclCommAbort` may be called from any thread; every use of
// the handle outside `NcclComm`'s `&mut self` methods holds `state`'s lock and checks `destroyed`.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

impl Shared {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn aborted(&self) -> Option<String> {
        self.state().aborted.clone()
    }

    /// Abort the communicator (idempotent) and remember why.
    fn abort(&self, reason: &str) {
        let mut st = self.state();
        if st.aborted.is_some() || st.destroyed {
            return;
        }
        st.aborted = Some(reason.to_string());
        if let Ok(api) = result::api() {
            // SAFETY: live communicator (not destroyed, checked under the lock); after abort it is
            // never used again (checked via `aborted`).
            let rc = unsafe { (api.ncclCommAbort)(self.comm) };
            if rc != SUCCESS {
                tracing::error!("ncclCommAbort on rank {} returned {rc}", self.rank);
            }
        }
    }

    /// `ncclCommGetAsyncError`, or `None` once the communicator is gone (destroyed or aborted).
    fn async_error(&self) -> Result<Option<c_int>, NcclError> {
        let st = self.state();
        if st.destroyed || st.aborted.is_some() {
            return Ok(None);
        }
        let mut code: c_int = 0;
        // SAFETY: live communicator (checked under the lock, held across the call), valid out-pointer.
        let rc = unsafe { (result::api()?.ncclCommGetAsyncError)(self.comm, &mut code) };
        result::check(rc, Some(self.comm), || "ncclCommGetAsyncError".into())?;
        Ok(Some(code))
    }
}

/// The completion of a call enqueued on an [`NcclComm`]: an event recorded after it on the
/// communicator's stream, waited on with the same watchdog as [`NcclComm::wait`].
struct NcclCompletion {
    event: Event,
    shared: Arc<Shared>,
    timeout: Duration,
    abort_check: Option<AbortCheck>,
    what: String,
}

impl NcclCompletion {
    /// One look: `Ok(true)` when done, an error (after aborting) when NCCL reported one or the
    /// liveness check failed.
    fn poll(&self) -> Result<bool, NcclError> {
        if let Some(reason) = self.shared.aborted() {
            return Err(NcclError::Aborted {
                what: self.what.clone(),
                rank: self.shared.rank,
                reason,
            });
        }
        if self.event.query()? {
            return Ok(true);
        }
        if let Some(st) = self.shared.async_error()? {
            if st != SUCCESS && st != IN_PROGRESS {
                let e = result::check(st, Some(self.shared.comm), || {
                    format!("{} (async)", self.what)
                })
                .unwrap_err();
                self.shared.abort(&e.to_string());
                return Err(e);
            }
        }
        if let Some(reason) = self.abort_check.as_ref().and_then(|c| c()) {
            self.shared.abort(&reason);
            return Err(NcclError::Aborted {
                what: self.what.clone(),
                rank: self.shared.rank,
                reason,
            });
        }
        Ok(false)
    }
}

impl Completion for NcclCompletion {
    fn query(&self) -> Result<bool, CommError> {
        self.poll().map_err(CommError::from)
    }

    fn wait(self: Box<Self>) -> Result<(), CommError> {
        let deadline = Instant::now() + self.timeout;
        if wait_until(deadline, || self.poll())? {
            return Ok(());
        }
        self.shared.abort(&format!("{} timed out", self.what));
        Err(NcclError::Timeout {
            what: self.what.clone(),
            rank: self.shared.rank,
            secs: self.timeout.as_secs_f64(),
        }
        .into())
    }
}

/// Create a unique id (rank 0, after the fork).
pub fn unique_id() -> Result<[u8; 128], NcclError> {
    let id = result::get_unique_id()?;
    Ok(id.internal.map(|c| c as u8))
}

fn wait_until(
    deadline: Instant,
    mut done: impl FnMut() -> Result<bool, NcclError>,
) -> Result<bool, NcclError> {
    let mut sleep = Duration::from_micros(20);
    loop {
        if done()? {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        std::thread::sleep(sleep);
        sleep = (sleep * 2).min(Duration::from_millis(2));
    }
}

impl NcclComm {
    /// Join the communicator of `world` ranks as `rank` on `ctx`'s device.
    pub fn new(
        ctx: &Arc<Context>,
        rank: usize,
        world: usize,
        exchange: &mut dyn UniqueIdExchange,
        opts: NcclOptions,
    ) -> Result<NcclComm, NcclError> {
        if world == 0 || rank >= world {
            return Err(invalid_arg(format!(
                "rank {rank} out of range for world size {world}"
            )));
        }
        let api = result::api()?;
        ctx.bind()?;
        let id_bytes = if rank == 0 {
            let id = unique_id()?;
            exchange
                .exchange(0, Some(&id))
                .map_err(|detail| NcclError::Exchange { rank, detail })?
        } else {
            exchange
                .exchange(rank, None)
                .map_err(|detail| NcclError::Exchange { rank, detail })?
        };
        let id = ncclUniqueId {
            internal: id_bytes.map(|b| b as _),
        };
        let stream = ctx.stream()?;
        let scratch = DeviceBuffer::<f32>::zeros(&stream, 1)?;
        let mut comm: ncclComm_t = std::ptr::null_mut();
        let what = format!(
            "ncclCommInitRank(rank={rank}, nranks={world}, device={})",
            ctx.ordinal()
        );
        match (opts.nonblocking_init, api.ncclCommInitRankConfig) {
            (true, Some(init_cfg)) => {
                let mut cfg = result::config(false);
                // SAFETY: valid out-pointer, id by value, config initialised as NCCL_CONFIG_INITIALIZER.
                let rc =
                    unsafe { init_cfg(&mut comm, world as c_int, id, rank as c_int, &mut cfg) };
                if rc != IN_PROGRESS {
                    if let Err(e) = result::check(rc, Some(comm), || what.clone()) {
                        if !comm.is_null() {
                            // SAFETY: a communicator NCCL handed back from a failed init; never used again.
                            unsafe { (api.ncclCommAbort)(comm) };
                        }
                        return Err(e);
                    }
                }
            }
            _ => {
                // SAFETY: valid out-pointer, id by value; blocks until every rank has joined.
                let rc =
                    unsafe { (api.ncclCommInitRank)(&mut comm, world as c_int, id, rank as c_int) };
                result::check(rc, None, || what.clone())?;
            }
        }
        let shared = Arc::new(Shared {
            comm,
            rank,
            state: Mutex::new(State::default()),
        });
        let producers = Producers::new(ctx);
        let fence = StreamFence::new(ctx)?;
        let mut me = NcclComm {
            ctx: ctx.clone(),
            stream,
            comm,
            shared,
            rank,
            world,
            seq: 0,
            opts,
            scratch,
            producers,
            fence,
        };
        me.settle(IN_PROGRESS, &what)?;
        Ok(me)
    }

    /// Wrap in a [`Communicator`].
    pub fn into_communicator(self) -> Communicator {
        Communicator::from_backend(Box::new(self))
    }

    /// The stream collectives are enqueued on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The CUDA context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    fn async_error(&self) -> Result<c_int, NcclError> {
        match self.shared.async_error()? {
            Some(code) => Ok(code),
            None => Err(self
                .check_alive("ncclCommGetAsyncError")
                .err()
                .unwrap_or_else(|| invalid_arg("the communicator is gone".into()))),
        }
    }

    /// Abort the communicator (idempotent) and remember why.
    pub fn abort(&mut self, reason: &str) {
        self.shared.abort(reason);
    }

    fn check_alive(&self, op: &str) -> Result<(), NcclError> {
        match self.shared.aborted() {
            Some(r) => Err(NcclError::Aborted {
                what: op.into(),
                rank: self.rank,
                reason: format!("the communicator was aborted earlier: {r}"),
            }),
            None => Ok(()),
        }
    }

    /// After a call that may return `ncclInProgress` (non-blocking communicator), wait until
    /// NCCL settles; abort on an async error, a liveness failure or the timeout.
    fn settle(&mut self, rc: c_int, what: &str) -> Result<(), NcclError> {
        if rc != IN_PROGRESS {
            return result::check(rc, Some(self.comm), || what.to_string());
        }
        let deadline = Instant::now() + self.opts.timeout;
        let mut last = IN_PROGRESS;
        let ok = wait_until(deadline, || {
            last = self.async_error()?;
            Ok(last != IN_PROGRESS)
        })?;
        if !ok {
            self.abort(&format!("{what} timed out"));
            return Err(NcclError::Timeout {
                what: what.into(),
                rank: self.rank,
                secs: self.opts.timeout.as_secs_f64(),
            });
        }
        if last != SUCCESS {
            let e = result::check(last, Some(self.comm), || what.to_string()).unwrap_err();
            self.abort(&e.to_string());
            return Err(e);
        }
        Ok(())
    }

    /// Wait for the stream with the watchdog: poll completion, `ncclCommGetAsyncError` and the
    /// liveness check; abort on any failure or on the timeout.
    pub fn wait(&mut self, what: &str) -> Result<(), NcclError> {
        self.check_alive(what)?;
        self.ctx.bind()?;
        let deadline = Instant::now() + self.opts.timeout;
        let mut failure: Option<NcclError> = None;
        let done = wait_until(deadline, || {
            if self.stream.is_done()? {
                return Ok(true);
            }
            let st = self.async_error()?;
            if st != SUCCESS && st != IN_PROGRESS {
                failure = Some(
                    result::check(st, Some(self.comm), || format!("{what} (async)")).unwrap_err(),
                );
                return Ok(true);
            }
            if let Some(reason) = self.opts.abort_check.as_ref().and_then(|c| c()) {
                failure = Some(NcclError::Aborted {
                    what: what.into(),
                    rank: self.rank,
                    reason,
                });
                return Ok(true);
            }
            Ok(false)
        });
        let done = match done {
            Ok(d) => d,
            Err(e) => {
                self.abort(&e.to_string());
                return Err(e);
            }
        };
        if let Some(e) = failure {
            self.abort(&e.to_string());
            return Err(e);
        }
        if !done {
            self.abort(&format!("{what} timed out"));
            return Err(NcclError::Timeout {
                what: what.into(),
                rank: self.rank,
                secs: self.opts.timeout.as_secs_f64(),
            });
        }
        Ok(())
    }

    fn raw_stream(&self) -> cudaStream_t {
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
        self.check_peer(peer, "send")?;
        self.check_device(buf.device(), "send")?;
        self.producers.order(&self.stream)?;
        self.send_raw(buf.device_ptr() as usize, buf.len(), T::DTYPE, peer)
    }

    /// Receive into `buf` from `peer` (ordered after the other streams' work, as [`send`](Self::send):
    /// e.g. a zero-fill of `buf` on another stream cannot land after the data).
    pub fn recv<T: Element>(
        &mut self,
        buf: &mut DeviceBuffer<T>,
        peer: usize,
    ) -> Result<(), NcclError> {
        self.check_peer(peer, "recv")?;
        self.check_device(buf.device(), "recv")?;
        self.producers.order(&self.stream)?;
        self.recv_raw(buf.device_ptr() as usize, buf.len(), T::DTYPE, peer)
    }

    fn check_peer(&self, peer: usize, op: &str) -> Result<(), NcclError> {
        if peer >= self.world {
            return Err(invalid_arg(format!(
                "{op}: peer {peer} out of range for world size {}",
                self.world
            )));
        }
        Ok(())
    }

    fn check_device(&self, dev: i32, op: &str) -> Result<(), NcclError> {
        if dev != self.ctx.ordinal() {
            return Err(invalid_arg(format!(
                "{op}: buffer is on device {dev} but the communicator on device {}",
                self.ctx.ordinal()
            )));
        }
        Ok(())
    }

    fn send_raw(
        &mut self,
        addr: usize,
        count: usize,
        dtype: crate::comm::Dtype,
        peer: usize,
    ) -> Result<(), NcclError> {
        self.check_alive("ncclSend")?;
        let s = self.raw_stream();
        // SAFETY: `addr` is a live device buffer of `count` elements on this device (checked by the
        // callers); the stream belongs to this communicator's context.
        let rc = unsafe {
            (result::api()?.ncclSend)(
                addr as *const c_void,
                count,
                result::nccl_dtype(dtype),
                peer as c_int,
                self.comm,
                s,
            )
        };
        self.settle(
            rc,
            &format!("ncclSend(count={count}, dtype={dtype}, peer={peer})"),
        )
    }

    fn recv_raw(
        &mut self,
        addr: usize,
        count: usize,
        dtype: crate::comm::Dtype,
        peer: usize,
    ) -> Result<(), NcclError> {
        self.check_alive("ncclRecv")?;
        let s = self.raw_stream();
        // SAFETY: as for `send_raw`; the buffer is writable.
        let rc = unsafe {
            (result::api()?.ncclRecv)(
                addr as *mut c_void,
                count,
                result::nccl_dtype(dtype),
                peer as c_int,
                self.comm,
                s,
            )
        };
        self.settle(
            rc,
            &format!("ncclRecv(count={count}, dtype={dtype}, peer={peer})"),
        )
    }

    /// Check a call's buffers before enqueueing: device buffers of this device, sizes, root.
    fn check_call(&self, call: &Call) -> Result<(), CommError> {
        let invalid = |detail: String| CommError::InvalidArgument {
            op: call.kind,
            rank: self.rank,
            detail,
        };
        for (name, m) in [("send", call.send), ("recv", call.recv)] {
            if m.len == 0 {
                continue;
            }
            match m.space {
                MemSpace::Host => {
                    return Err(CommError::Unsupported(format!(
                        "{} on rank {}: the {name} buffer is host memory, but the NCCL backend works on device memory only; copy it into a lockstep::cuda::DeviceBuffer or use the shm backend",
                        call.kind, self.rank
                    )))
                }
                MemSpace::Device(d) if d != self.ctx.ordinal() => {
                    return Err(invalid(format!("the {name} buffer is on device {d} but this rank's communicator is on device {}", self.ctx.ordinal())))
                }
                _ => {}
            }
        }
        if call.kind.has_root() && call.root >= self.world {
            return Err(invalid(format!(
                "root {} is out of range for world size {}",
                call.root, self.world
            )));
        }
        let n = self.world;
        let is_root = self.rank == call.root;
        let (need_send, need_recv) = match call.kind {
            CollKind::AllReduce | CollKind::Broadcast => {
                (if call.kind == CollKind::Broadcast && !is_root { 0 } else { call.count }, call.count)
            }
            CollKind::Reduce => (call.count, if is_root { call.count } else { 0 }),
            CollKind::AllGather => (call.count, call.count * n),
            CollKind::Gather => (call.count, if is_root { call.count * n } else { 0 }),
            CollKind::ReduceScatter => (call.count * n, call.count),
            CollKind::Barrier => (0, 0),
            CollKind::AllToAll => (call.count * n, call.count * n),
            CollKind::Scatter => (if is_root { call.count * n } else { 0 }, call.count),
            // The communicator checked every block of the per-rank counts against its buffer.
            CollKind::AllToAllV | CollKind::AllGatherV | CollKind::GatherV => (0, 0),
            other => {
                return Err(CommError::Unsupported(format!(
                    "{other} is not supported on the nccl backend yet; use the shm backend (host buffers)"
                )))
            }
        };
        if call.send.len < need_send {
            return Err(invalid(format!(
                "send buffer has {} elements, {} are needed",
                call.send.len, need_send
            )));
        }
        if call.recv.len < need_recv {
            return Err(invalid(format!(
                "recv buffer has {} elements, {} are needed",
                call.recv.len, need_recv
            )));
        }
        Ok(())
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

    /// Gather as grouped send/recv: every rank sends to the root; the root receives each peer's
    /// block and copies its own block locally.
    fn gather(&mut self, call: &Call) -> Result<(), NcclError> {
        let (count, root, dtype) = (call.count, call.root, call.dtype);
        let bytes = count * dtype.size();
        let rank = self.rank;
        let world = self.world;
        let (send, recv) = (call.send, call.recv);
        self.group(|me| {
            if rank == root {
                for peer in 0..world {
                    let dst = recv.addr + peer * bytes;
                    if peer == root {
                        if dst != send.addr && bytes > 0 {
                            me.ctx.bind()?;
                            // SAFETY: both ranges are device memory of this device checked by
                            // `check_call` (send ≥ count, recv ≥ count·world elements).
                            unsafe {
                                crate::cuda::driver::memcpy_dtod_async(
                                    dst as u64,
                                    send.addr as u64,
                                    bytes,
                                    me.stream.raw(),
                                )?
                            };
                        }
                    } else {
                        me.recv_raw(dst, count, dtype, peer)?;
                    }
                }
            } else {
                me.send_raw(send.addr, count, dtype, root)?;
            }
            Ok(())
        })
    }
}

/// One block of an exchange: `count` elements at `addr`, sent to or received from `peer`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Block {
    peer: usize,
    addr: usize,
    count: usize,
}

/// What this rank sends and receives in one of the exchange collectives (all-to-all, scatter and
/// the v-variants), block by block: NCCL has no native form of them, so they run as grouped
/// send/recv, as `ncclAllToAll` examples and PyTorch's ProcessGroupNCCL build them.
fn exchange_plan(call: &Call, rank: usize, world: usize) -> (Vec<Block>, Vec<Block>) {
    let size = call.dtype.size();
    let (send, recv, c) = (call.send.addr, call.recv.addr, call.count);
    let sp = &call.splits;
    let at = |base: usize, elems: usize| base + elems * size;
    let peers = 0..world;
    match call.kind {
        CollKind::AllToAll => (
            peers
                .clone()
                .map(|p| Block {
                    peer: p,
                    addr: at(send, p * c),
                    count: c,
                })
                .collect(),
            peers
                .map(|p| Block {
                    peer: p,
                    addr: at(recv, p * c),
                    count: c,
                })
                .collect(),
        ),
        CollKind::AllToAllV => (
            peers
                .clone()
                .map(|p| Block {
                    peer: p,
                    addr: at(send, sp.send_displs[p]),
                    count: sp.send_counts[p],
                })
                .collect(),
            peers
                .map(|p| Block {
                    peer: p,
                    addr: at(recv, sp.recv_displs[p]),
                    count: sp.recv_counts[p],
                })
                .collect(),
        ),
        CollKind::Scatter => {
            let sends = if rank == call.root {
                peers
                    .map(|p| Block {
                        peer: p,
                        addr: at(send, p * c),
                        count: c,
                    })
                    .collect()
            } else {
                vec![]
            };
            (
                sends,
                vec![Block {
                    peer: call.root,
                    addr: recv,
                    count: c,
                }],
            )
        }
        CollKind::AllGatherV => (
            peers
                .clone()
                .map(|p| Block {
                    peer: p,
                    addr: send,
                    count: c,
                })
                .collect(),
            peers
                .map(|p| Block {
                    peer: p,
                    addr: at(recv, sp.recv_displs[p]),
                    count: sp.recv_counts[p],
                })
                .collect(),
        ),
        CollKind::GatherV => {
            let recvs = if rank == call.root {
                peers
                    .map(|p| Block {
                        peer: p,
                        addr: at(recv, sp.recv_displs[p]),
                        count: sp.recv_counts[p],
                    })
                    .collect()
            } else {
                vec![]
            };
            (
                vec![Block {
                    peer: call.root,
                    addr: send,
                    count: c,
                }],
                recvs,
            )
        }
        _ => (vec![], vec![]),
    }
}

impl NcclComm {
    /// Run an exchange collective as one group of sends and receives; this rank's own block is a
    /// device-to-device copy. NCCL does not check that a peer's count matches: a disagreement
    /// (possible only in the v-variants) hangs until the timeout aborts the communicator, as with
    /// `ncclSend`/`ncclRecv` themselves.
    fn exchange(&mut self, call: &Call) -> Result<(), NcclError> {
        let (rank, world, dtype, size) = (self.rank, self.world, call.dtype, call.dtype.size());
        let (sends, recvs) = exchange_plan(call, rank, world);
        let own_send = sends.iter().find(|b| b.peer == rank).copied();
        let own_recv = recvs.iter().find(|b| b.peer == rank).copied();
        let own = match (own_send, own_recv) {
            (Some(s), Some(r)) if s.count != r.count => {
                return Err(invalid_arg(format!(
                    "{}: this rank sends {} elements to itself but receives {} from itself; they must be equal",
                    call.kind, s.count, r.count
                )))
            }
            (Some(s), Some(r)) => Some((s, r)),
            _ => None,
        };
        self.group(|me| {
            if let Some((s, r)) = own {
                if s.count > 0 && s.addr != r.addr {
                    me.ctx.bind()?;
                    // SAFETY: both blocks lie within device buffers of this device, as checked by
                    // `check_call` and the communicator's split checks.
                    unsafe {
                        crate::cuda::driver::memcpy_dtod_async(
                            r.addr as u64,
                            s.addr as u64,
                            s.count * size,
                            me.stream.raw(),
                        )?
                    };
                }
            }
            for b in sends.iter().filter(|b| b.peer != rank && b.count > 0) {
                me.send_raw(b.addr, b.count, dtype, b.peer)?;
            }
            for b in recvs.iter().filter(|b| b.peer != rank && b.count > 0) {
                me.recv_raw(b.addr, b.count, dtype, b.peer)?;
            }
            Ok(())
        })
    }

    /// Check the buffers of a point-to-point group: device memory of this device.
    fn check_p2p(&self, ops: &[P2pOp]) -> Result<(), CommError> {
        for op in ops {
            if op.peer == ANY_SOURCE {
                return Err(CommError::Unsupported(format!(
                    "recv from any source on rank {}: the nccl backend has no receive from any source (NCCL matches every receive to a named rank); name the sending rank, or receive on the shm backend (host buffers: Communicator::recv_any there)",
                    self.rank
                )));
            }
            if op.peer >= self.world {
                return Err(CommError::InvalidArgument {
                    op: op.kind,
                    rank: self.rank,
                    detail: format!(
                        "peer {} is out of range for world size {}",
                        op.peer, self.world
                    ),
                });
            }
            if op.mem.len == 0 {
                continue;
            }
            match op.mem.space {
                MemSpace::Host => {
                    return Err(CommError::Unsupported(format!(
                        "{} on rank {}: the buffer is host memory, but the NCCL backend works on device memory only; copy it into a lockstep::cuda::DeviceBuffer or use the shm backend",
                        op.kind, self.rank
                    )))
                }
                MemSpace::Device(d) if d != self.ctx.ordinal() => {
                    return Err(CommError::InvalidArgument {
                        op: op.kind,
                        rank: self.rank,
                        detail: format!("the buffer is on device {d} but this rank's communicator is on device {}", self.ctx.ordinal()),
                    })
                }
                _ => {}
            }
        }
        Ok(())
    }
}

impl NcclComm {
    /// Split this communicator with `ncclCommSplit` (NCCL 2.18 or newer; see
    /// [`Backend::split`]): `None` is `NCCL_SPLIT_NOCOLOR`. Colors above `i32::MAX` and keys
    /// outside `i32` are refused (NCCL takes C ints). The new communicator has its own stream and
    /// this one's options.
    pub fn split_comm(
        &mut self,
        color: Option<u32>,
        key: i64,
    ) -> Result<Option<NcclComm>, CommError> {
        let color = match color {
            None => result::SPLIT_NOCOLOR,
            Some(c) => c_int::try_from(c).map_err(|_| {
                CommError::Unsupported(format!(
                    "split: NCCL takes colors up to {}, not {c}",
                    c_int::MAX
                ))
            })?,
        };
        let key = c_int::try_from(key).map_err(|_| {
            CommError::Unsupported(format!(
                "split: NCCL takes keys that fit a C int, not {key}"
            ))
        })?;
        let Some(split) = result::api().map_err(NcclError::from)?.ncclCommSplit else {
            let lib = result::core()
                .map(|c| {
                    format!(
                        "{} (NCCL {})",
                        c.path,
                        crate::cuda::nccl_version_string(c.version)
                    )
                })
                .unwrap_or_default();
            return Err(CommError::Unsupported(format!(
                "split needs ncclCommSplit, which NCCL has since 2.18, but the loaded library {lib} lacks it; point LOCKSTEP_NCCL_LIBRARY at NCCL 2.18 or newer"
            )));
        };
        Ok(self.split_with(split, color, key)?)
    }

    fn split_with(
        &mut self,
        split: unsafe extern "C" fn(
            ncclComm_t,
            c_int,
            c_int,
            *mut ncclComm_t,
            *mut result::ncclConfig_t,
        ) -> c_int,
        color: c_int,
        key: c_int,
    ) -> Result<Option<NcclComm>, NcclError> {
        self.check_alive("ncclCommSplit")?;
        let api = result::api()?;
        self.ctx.bind()?;
        let what = format!(
            "ncclCommSplit(color={color}, key={key}) on rank {}",
            self.rank
        );
        let mut cfg = result::config(!self.opts.nonblocking_init);
        let mut child: ncclComm_t = std::ptr::null_mut();
        // SAFETY: live parent communicator (not aborted), valid out-pointer, config laid out as
        // NCCL_CONFIG_INITIALIZER makes it.
        let rc = unsafe { split(self.comm, color, key, &mut child, &mut cfg) };
        if child.is_null() {
            // No new communicator (no color, or the call failed): settle the parent's part.
            self.settle(rc, &what)?;
            if color == result::SPLIT_NOCOLOR {
                return Ok(None);
            }
            return Err(NcclError::Call {
                call: what,
                code: 3,
                message: "it returned no communicator for a rank with a color".into(),
                last: String::new(),
                hint: super::error::hint(3),
            });
        }
        let parts = self
            .ctx
            .stream()
            .and_then(|s| DeviceBuffer::<f32>::zeros(&s, 1).map(|b| (s, b)));
        let (stream, scratch) = match parts {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: the communicator NCCL just made; never used again.
                unsafe { (api.ncclCommAbort)(child) };
                return Err(e.into());
            }
        };
        // Until the new ranks are known, failures name this rank (of the parent).
        let shared = Arc::new(Shared {
            comm: child,
            rank: self.rank,
            state: Mutex::new(State::default()),
        });
        let producers = Producers::new(&self.ctx);
        let fence = StreamFence::new(&self.ctx).map_err(NcclError::from)?;
        let mut c = NcclComm {
            ctx: self.ctx.clone(),
            stream,
            comm: child,
            shared,
            rank: self.rank,
            world: 0,
            seq: 0,
            opts: self.opts.clone(),
            scratch,
            producers,
            fence,
        };
        // A failed child is aborted (idempotent), so its drop leaves it alone.
        if let Err(e) = c.settle(rc, &what) {
            c.abort(&e.to_string());
            return Err(e);
        }
        let (mut n, mut r): (c_int, c_int) = (0, 0);
        // SAFETY: live, initialised communicator; valid out-pointers.
        let rc = unsafe { (api.ncclCommCount)(child, &mut n) };
        result::check(rc, Some(child), || "ncclCommCount".into())?;
        // SAFETY: as above.
        let rc = unsafe { (api.ncclCommUserRank)(child, &mut r) };
        result::check(rc, Some(child), || "ncclCommUserRank".into())?;
        (c.rank, c.world) = (r as usize, n as usize);
        Ok(Some(c))
    }
}

fn invalid_arg(detail: String) -> NcclError {
    NcclError::Cuda(crate::cuda::CudaError::InvalidArgument {
        op: "NcclComm".into(),
        detail,
    })
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
        self.producers
            .order(&self.stream)
            .map_err(NcclError::from)?;
        self.enqueue(call).map_err(CommError::from)
    }

    fn completion(&mut self) -> Result<Option<Box<dyn Completion>>, CommError> {
        self.check_alive("a nonblocking call")?;
        let event = self.ctx.sync_event().map_err(NcclError::from)?;
        event.record(&self.stream).map_err(NcclError::from)?;
        Ok(Some(Box::new(NcclCompletion {
            event,
            shared: self.shared.clone(),
            timeout: self.opts.timeout,
            abort_check: self.opts.abort_check.clone(),
            what: format!("nonblocking call {} on rank {}", self.seq, self.rank),
        })))
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
        self.producers
            .order(&self.stream)
            .map_err(NcclError::from)?;
        self.group(|me| {
            for op in ops {
                match op.kind {
                    CollKind::Send => me.send_raw(op.mem.addr, op.mem.len, op.dtype, op.peer)?,
                    _ => me.recv_raw(op.mem.addr, op.mem.len, op.dtype, op.peer)?,
                }
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
