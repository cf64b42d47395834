//! [`Communicator`]: the collective methods every backend runs behind.
//!
//! One entry, [`Communicator::run`], takes a type-erased [`Call`], checks it locally with the
//! rules of [`check`](super::check) and hands it to the backend; the typed methods build a `Call`
//! from their buffers and go through it, as the Python package and the C ABI do. A call refused
//! locally is also reported to the peers through [`Backend::reject`], so they fail with a
//! mismatch instead of pairing this rank's next call with their current one.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use std::marker::PhantomData;

use super::arrival::{buffer_kind, Arrival};
use super::backend::{Backend, BackendKind, Completion, P2pOp, ANY_SOURCE};
use super::call::{Call, Splits};
use super::check::{self, InPlace};
use super::error::{rank_name, CommError};
use super::shared::SharedBuffer;
use crate::cuda::{Context, CudaError, DeviceBuffer, ForeignStream};
use crate::trace::{self, CallInfo, CallPath, Tracer};

/// What a split or a new group exchanges with [`Communicator::all_gather_u64`] (named in its
/// errors).
const SPLIT_DATA: &str = "exchanging split data";
use crate::types::{Buffer, BufferMut, CollKind, Dtype, Element, MemSpace, RawMem, ReduceOp};

/// A group of ranks that run collectives together.
///
/// Every rank must issue the same sequence of calls with the same count, dtype, op and root;
/// a disagreement is reported on every rank as [`CommError::Mismatch`] rather than hanging.
pub struct Communicator {
    backend: Box<dyn Backend>,
    /// For a sub-communicator ([`split`](Self::split)): the global rank of each rank; `None` for
    /// a world communicator.
    global: Option<Arc<[usize]>>,
    /// The flight recorder (`LOCKSTEP_TRACE_BUFFER`; `None` when 0): every call through
    /// [`enter`](Self::enter) and [`enter_p2p`](Self::enter_p2p) is recorded.
    trace: Option<Arc<Tracer>>,
    /// The flight recorder while [`set_trace(false)`](Self::set_trace) pauses it: kept aside,
    /// so the calls' path tests only `trace`.
    paused: Option<Arc<Tracer>>,
    /// Collectives made while paused: on resuming, the recorder numbers the next as the
    /// communicator does.
    unrecorded: u64,
}

impl fmt::Debug for Communicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Communicator")
            .field("backend", &self.backend.kind())
            .field("rank", &self.backend.rank())
            .field("world_size", &self.backend.world_size())
            .field("global_ranks", &self.global)
            .finish()
    }
}

impl Communicator {
    /// Wrap a backend.
    ///
    /// Logs one INFO line (target `lockstep::init`), as `NCCL_DEBUG=INFO` does: version, rank,
    /// world, backend, host, pid, and what the backend adds (CPU binding, single-copy threshold,
    /// NCCL version and device).
    pub fn from_backend(backend: Box<dyn Backend>) -> Communicator {
        let global = backend.global_ranks().map(Arc::from);
        let mut c = Communicator {
            backend,
            global,
            trace: None,
            paused: None,
            unrecorded: 0,
        };
        c.trace = c.tracer();
        if tracing::enabled!(target: "lockstep::init", tracing::Level::INFO) {
            tracing::info!(target: "lockstep::init", "{}", c.init_line());
        }
        c
    }

    /// The flight recorder this communicator's settings ask for (see [`crate::trace`]).
    fn tracer(&self) -> Option<Arc<Tracer>> {
        let global = self.global.as_ref().map(|g| g.to_vec());
        let comm = match &global {
            None => "world".to_string(),
            Some(g) => trace::sub_name(g),
        };
        Tracer::from_env(trace::Meta {
            rank: self.rank(),
            world: self.world_size(),
            global,
            backend: self.backend.kind().to_string(),
            comm,
        })
    }

    /// The calls this communicator's flight recorder holds, oldest first (the last
    /// `LOCKSTEP_TRACE_BUFFER` calls, 2000 by default; empty when it is 0). See [`crate::trace`].
    pub fn trace(&self) -> Vec<trace::Record> {
        self.recorder().map_or_else(Vec::new, |t| t.records())
    }

    /// Pause (`false`) or resume (`true`) this communicator's flight recorder: calls made while
    /// it is paused are not recorded, and what it held stays, as do the readers and dumps
    /// (`SIGUSR1`, a failure). For a stretch of calls that must not pay its few nanoseconds, and
    /// for measuring them against the same communicator. Nothing happens when the recorder is
    /// off (`LOCKSTEP_TRACE_BUFFER=0`).
    pub fn set_trace(&mut self, on: bool) {
        if on {
            if let Some(t) = self.paused.take() {
                t.skip_collectives(std::mem::take(&mut self.unrecorded));
                self.trace = Some(t);
            }
        } else if self.paused.is_none() {
            self.paused = self.trace.take();
        }
    }

    /// The flight recorder, running or paused.
    fn recorder(&self) -> Option<&Arc<Tracer>> {
        self.trace.as_ref().or(self.paused.as_ref())
    }

    /// A reader of this communicator's flight recorder that needs no access to the communicator
    /// (`None` when the recorder is off): the records of a call still running on another thread
    /// can be read through it.
    pub fn trace_reader(&self) -> Option<trace::TraceReader> {
        self.recorder().cloned().map(trace::TraceReader)
    }

    /// Write this rank's records into `dir` now (made when missing; one JSON-lines file, replaced
    /// atomically, named for the rank and communicator; `lockstep trace DIR` reads a directory of
    /// them). Returns the file's path. Local: the other ranks write nothing unless they are asked
    /// too.
    pub fn dump_trace(
        &self,
        dir: &std::path::Path,
    ) -> Result<std::path::PathBuf, trace::DumpError> {
        match self.recorder() {
            Some(t) => t.dump(dir, trace::Reason::Request),
            None => Err(trace::DumpError::Off),
        }
    }

    /// Record the start of a call (nothing when the recorder is off; a paused one counts the
    /// collectives it does not record).
    #[inline]
    fn trace_start(&mut self, collective: bool, info: impl FnOnce() -> CallInfo) -> u64 {
        match &self.trace {
            Some(t) => t.start(&info()),
            None => {
                if collective && self.paused.is_some() {
                    self.unrecorded += 1;
                }
                0
            }
        }
    }

    /// Record the end of call `id` with its result; after a failure that ends the job, write the
    /// records to `LOCKSTEP_TRACE_DIR` (once per communicator).
    #[inline]
    fn trace_end<T>(&self, id: u64, r: &Result<T, CommError>) {
        self.trace_end_on(id, None, r)
    }

    /// [`trace_end`](Self::trace_end), with the path the backend gave on arrival (`None`: ask
    /// it now).
    #[inline]
    fn trace_end_on<T>(&self, id: u64, path: Option<CallPath>, r: &Result<T, CommError>) {
        let ends_job = |e: &CommError| {
            matches!(
                e,
                CommError::Timeout { .. }
                    | CommError::PeerLost { .. }
                    | CommError::Aborted { .. }
                    | CommError::Mismatch { .. }
            )
        };
        let Some(t) = &self.trace else {
            // Paused: the call is not recorded, but the calls before it still are written.
            if let (Err(e), Some(t)) = (r, &self.paused) {
                if ends_job(e) {
                    t.on_failure();
                }
            }
            return;
        };
        let path = path.unwrap_or_else(|| self.backend.last_path());
        match r {
            Ok(_) => t.end(id, path, None),
            Err(e) => {
                t.end(id, path, Some(e));
                if ends_job(e) {
                    t.on_failure();
                }
            }
        }
    }

    /// The communicator's init line (see [`from_backend`](Self::from_backend)).
    fn init_line(&self) -> String {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "?".into());
        let mut line = format!(
            "lockstep {} init: rank {} of {} backend {} host {host} pid {}",
            env!("CARGO_PKG_VERSION"),
            self.backend.rank(),
            self.backend.world_size(),
            self.backend.kind(),
            std::process::id()
        );
        if let Some(g) = &self.global {
            line += &format!(" global_rank {}", g[self.backend.rank()]);
        }
        let more = self.backend.describe();
        if !more.is_empty() {
            line.push(' ');
            line += &more;
        }
        line
    }

    /// This rank, in `0..world_size()`.
    pub fn rank(&self) -> usize {
        self.backend.rank()
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.backend.world_size()
    }

    /// Which backend runs the collectives.
    pub fn backend_kind(&self) -> BackendKind {
        self.backend.kind()
    }

    /// Number of collectives issued so far on this rank.
    pub fn seq(&self) -> u64 {
        self.backend.seq()
    }

    /// The longest a call waits for its peers before it fails with [`CommError::Timeout`]
    /// (`LOCKSTEP_TIMEOUT_S` until [`set_timeout`](Self::set_timeout)); `None` where the backend
    /// has none of its own.
    pub fn timeout(&self) -> Option<Duration> {
        self.backend.timeout()
    }

    /// Set the timeout of the calls that follow on this rank (the shared-memory backend; others
    /// return [`CommError::Unsupported`]). A local setting, not a collective: ranks may wait
    /// differently long, and the first whose wait runs out aborts the call for all (see
    /// [`CommError::Timeout`]).
    pub fn set_timeout(&mut self, timeout: Duration) -> Result<(), CommError> {
        self.backend.set_timeout(timeout)
    }

    /// Whether this rank runs the finite check on its reductions (`LOCKSTEP_CHECK_FINITE` until
    /// [`set_check_finite`](Self::set_check_finite); see [`CommError::NonFinite`]).
    pub fn check_finite(&self) -> bool {
        self.backend.check_finite()
    }

    /// Turn the finite check on or off for the calls that follow on this rank: for the stretch
    /// of a job worth checking (the first steps, or after a loss spike), where
    /// `LOCKSTEP_CHECK_FINITE=1` would check every call. Local, like
    /// [`set_timeout`](Self::set_timeout), but every rank must set it alike before the same
    /// call: a reduction whose ranks differ fails on every rank with [`CommError::Mismatch`]
    /// naming them, never checking on some ranks only. The shared-memory and staged backends
    /// have the check; the others return [`CommError::Unsupported`] when asked to turn it on.
    pub fn set_check_finite(&mut self, on: bool) -> Result<(), CommError> {
        self.backend.set_check_finite(on)
    }

    /// For a device communicator (NCCL, or staging when ranks share a GPU): the CUDA context of
    /// this rank's device, on which its buffers must live. `None` for host backends.
    pub fn device_context(&self) -> Option<Arc<Context>> {
        self.backend.device()
    }

    /// Wait for every call issued so far (a no-op on host backends, which complete each call).
    pub fn synchronize(&mut self) -> Result<(), CommError> {
        self.backend.synchronize()
    }

    /// Device communicators: order later calls after the work enqueued so far on `caller`, the
    /// stream that produced their buffers (a framework's current stream), by an event the
    /// communicator's stream waits on. Nothing blocks the host. With
    /// [`signal_stream`](Self::signal_stream) after the calls, a caller's stream and the
    /// communicator's are ordered as one: the way to call collectives without synchronising the
    /// device (`ProcessGroupNCCL` orders its stream with the caller's the same way).
    /// Host communicators: an `Unsupported` error.
    pub fn wait_stream(&mut self, caller: &ForeignStream) -> Result<(), CommError> {
        self.backend.wait_stream(caller)
    }

    /// Device communicators: make later work on `caller` wait for the calls issued so far (an
    /// event recorded on the communicator's stream, which `caller` waits on), so whatever the
    /// caller enqueues next sees their results. See [`wait_stream`](Self::wait_stream).
    pub fn signal_stream(&mut self, caller: &ForeignStream) -> Result<(), CommError> {
        self.backend.signal_stream(caller)
    }

    /// Allocate a buffer of `len` elements (zeroed) inside the backend's shared segment. Collectives
    /// whose buffers are all shared on every rank skip the staging copies (the analog of NCCL's
    /// registered buffers).
    pub fn alloc_shared<T: Element>(&mut self, len: usize) -> Result<SharedBuffer<T>, CommError> {
        let bytes = len.checked_mul(std::mem::size_of::<T>()).ok_or_else(|| {
            CommError::Unsupported(format!("alloc_shared: {len} elements overflow"))
        })?;
        let alloc = self.backend.alloc_shared(bytes)?;
        Ok(SharedBuffer::new(alloc, len))
    }

    /// Run an already-checked call on the backend. For layered backends (staging wraps a host
    /// communicator): the outer backend checked the call, so the inner one runs it as is.
    pub(crate) fn run_checked(&mut self, call: &Call) -> Result<(), CommError> {
        self.backend.run(call)
    }

    /// Run an already-checked point-to-point group on the backend (see [`run_checked`](Self::run_checked)).
    pub(crate) fn p2p_checked(&mut self, ops: &mut [P2pOp]) -> Result<(), CommError> {
        self.backend.p2p(ops)
    }

    /// Tell the peers that this rank refused a call locally (see [`Backend::reject`]): for
    /// bindings that check arguments of their own before reaching [`run`](Self::run) (the Python
    /// package's buffer exports, the C ABI's pointers), so the peers' matching call fails with a
    /// mismatch naming this rank instead of waiting.
    pub fn reject_call(&mut self, kind: CollKind, dtype: Dtype, reason: &CommError) {
        self.backend.reject(kind, dtype, reason);
    }

    fn invalid(&self, op: CollKind, detail: String) -> CommError {
        match &self.global {
            // Errors name global ranks; the detail speaks of this communicator's ranks, so say
            // which one this is.
            Some(g) => CommError::InvalidArgument {
                op,
                rank: g[self.rank()],
                detail: format!(
                    "{detail} (this is rank {} of a sub-communicator of {} ranks; roots and peers are its ranks)",
                    self.rank(),
                    self.world_size()
                ),
            },
            None => CommError::InvalidArgument { op, rank: self.rank(), detail },
        }
    }

    /// A call refused locally: let the backend tell the peers (so they fail too instead of pairing
    /// this rank's next call with their current one), then return the error.
    fn refused(&mut self, op: CollKind, dtype: Dtype, detail: String) -> CommError {
        let e = self.invalid(op, detail);
        self.backend.reject(op, dtype, &e);
        e
    }

    // --------------------------------------------------------------------------------------------
    // The erased entry

    /// Run one collective described by a type-erased [`Call`]: the entry of the Python package,
    /// the C ABI and any other binding, and of the typed methods, which build a `Call` from their
    /// buffers ([`call_on`](Self::call_on), [`call_in_place`](Self::call_in_place)) and come
    /// here.
    ///
    /// The call is checked locally first, with the rules of [`check`](super::check) (root in
    /// range, buffer lengths for `count`, the per-peer counts of the v-variants, alignment, one
    /// memory space, send and recv disjoint unless in the kind's in-place form); a call that
    /// fails them returns [`CommError::InvalidArgument`] with the message the typed method gives,
    /// and the peers are told ([`Backend::reject`]), so their matching call fails with a
    /// [`CommError::Mismatch`] naming this rank instead of waiting. For `all_gather_v` and
    /// `gather_v`, `splits.recv_displs` may be left empty: the blocks are packed in rank order.
    /// The nonblocking form is [`start`](Self::start): `comm.start(|c| unsafe { c.run(&call) })`.
    ///
    /// # Safety
    ///
    /// A [`RawMem`] is plain data that anything can make, so the caller vouches for it. Until
    /// this returns (device backends: until the call has completed on the device, which
    /// [`synchronize`](Self::synchronize) or the [`Work`] of [`start`](Self::start) waits for):
    ///
    /// * `call.send`, where this rank reads it, is valid for reads of `len` elements of
    ///   `call.dtype` in its memory space (host memory of this process, or device memory of the
    ///   communicator's device);
    /// * `call.recv`, where this rank writes it, is valid for writes of `len` such elements, and
    ///   nothing else reads or writes it (no Rust reference to it is alive);
    /// * `send` and `recv` are disjoint, or in the kind's in-place form (checked: other overlaps
    ///   are refused).
    ///
    /// Lengths, alignment and the in-place forms are checked; the addresses cannot be.
    pub unsafe fn run(&mut self, call: &Call) -> Result<(), CommError> {
        self.enter(call)
    }

    /// The checks of [`run`](Self::run), then the backend, recorded by the flight recorder. Safe
    /// to call with the `RawMem`s of [`Buffer`]/[`BufferMut`] borrows, which carry that contract.
    fn enter(&mut self, call: &Call) -> Result<(), CommError> {
        // Out of `self` for the call, so that the backend can note the start while it runs
        // (`Arrival`); back before anything else can see it (the communicator is `&mut`).
        let Some(t) = self.trace.take() else {
            if self.paused.is_some() {
                self.unrecorded += 1;
            }
            let r = self.enter_untraced(call, None);
            self.trace_end(0, &r);
            return r;
        };
        let arrival = Arrival::new(&t, call);
        let r = self.enter_untraced(call, Some(&arrival));
        if r.is_ok() && arrival.end_quick() {
            self.trace = Some(t);
            return r;
        }
        let (id, path) = arrival.noted();
        self.trace = Some(t);
        self.trace_end_on(id, path, &r);
        r
    }

    /// [`enter`](Self::enter) without the recorder, but for the backend's note of the call's
    /// start (`arrival`, when recording).
    fn enter_untraced(
        &mut self,
        call: &Call,
        arrival: Option<&Arrival<'_>>,
    ) -> Result<(), CommError> {
        let packed = match check::call(call, self.rank(), self.world_size()) {
            Err(detail) => return Err(self.refused(call.kind, call.dtype, detail)),
            Ok(p) => p,
        };
        let splits = match (&packed, call.kind) {
            (Some(displs), _) => Splits {
                recv_displs: displs,
                ..call.splits
            },
            // A gather_v rank other than the root reads no counts: the backend gets none.
            (None, CollKind::GatherV) if self.rank() != call.root => Splits::default(),
            (None, _) => call.splits,
        };
        let call = Call { splits, ..*call };
        match arrival {
            Some(a) => self.backend.run_noting(&call, a),
            None => self.backend.run(&call),
        }
    }

    /// The out-of-place [`Call`] the typed method of `kind` makes on `send` and `recv`: its count
    /// comes from the buffers ([`check::count_of`]); `op` and `root` are ignored where the kind
    /// has none (pass `ReduceOp::Sum` and 0). Nothing is checked until it [`run`](Self::run)s.
    pub fn call_on(
        &self,
        kind: CollKind,
        dtype: Dtype,
        op: ReduceOp,
        root: usize,
        send: RawMem,
        recv: RawMem,
    ) -> Call<'static> {
        Call {
            kind,
            dtype,
            op,
            root,
            count: check::count_of(kind, send.len, recv.len, self.world_size()),
            send,
            recv,
            splits: Splits::default(),
        }
    }

    /// The in-place [`Call`] of `kind` on `buf` (see [`check::InPlace`]): all_reduce, broadcast and
    /// reduce use `buf` as both buffers; all_gather gathers into `buf`, this rank's block already
    /// at `buf[rank*c..(rank+1)*c]` with `c = buf.len / world_size`; reduce_scatter leaves the
    /// result there. Refused (and the peers told, as by [`run`](Self::run)) for a length that is
    /// not a multiple of the world size, and for kinds without an in-place method.
    pub fn call_in_place(
        &mut self,
        kind: CollKind,
        dtype: Dtype,
        op: ReduceOp,
        root: usize,
        buf: RawMem,
    ) -> Result<Call<'static>, CommError> {
        let n = self.world_size();
        let (send, recv, count) = match check::in_place(kind) {
            InPlace::Same => (buf, buf, buf.len),
            InPlace::SendIsOwnBlock | InPlace::RecvIsOwnBlock
                if matches!(kind, CollKind::AllGather | CollKind::ReduceScatter) =>
            {
                if !buf.len.is_multiple_of(n) {
                    return Err(self.refused(
                        kind,
                        dtype,
                        format!(
                            "in-place buffer has {} elements, not a multiple of world size {n}",
                            buf.len
                        ),
                    ));
                }
                let c = buf.len / n;
                let block = RawMem {
                    addr: buf.addr + self.rank() * c * dtype.size(),
                    len: c,
                    space: buf.space,
                };
                if kind == CollKind::AllGather {
                    (block, buf, c)
                } else {
                    (buf, block, c)
                }
            }
            _ => {
                return Err(self.refused(
                    kind,
                    dtype,
                    format!("{kind} has no in-place method; pass separate send and recv buffers"),
                ))
            }
        };
        Ok(Call {
            kind,
            dtype,
            op,
            root,
            count,
            send,
            recv,
            splits: Splits::default(),
        })
    }

    /// A typed out-of-place call: the buffers' `RawMem`s, through [`enter`](Self::enter).
    fn typed(
        &mut self,
        kind: CollKind,
        dtype: Dtype,
        op: ReduceOp,
        root: usize,
        send: RawMem,
        recv: RawMem,
    ) -> Result<(), CommError> {
        let call = self.call_on(kind, dtype, op, root, send, recv);
        self.enter(&call)
    }

    /// A typed in-place call.
    fn typed_in_place(
        &mut self,
        kind: CollKind,
        dtype: Dtype,
        op: ReduceOp,
        root: usize,
        buf: RawMem,
    ) -> Result<(), CommError> {
        let call = self.call_in_place(kind, dtype, op, root, buf)?;
        self.enter(&call)
    }

    // --------------------------------------------------------------------------------------------
    // Typed collectives

    /// Element-wise reduction of every rank's `send` into every rank's `recv` (same length).
    pub fn all_reduce<T: Element, S: Buffer<T> + ?Sized, R: BufferMut<T> + ?Sized>(
        &mut self,
        send: &S,
        recv: &mut R,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let (s, r) = (send.raw(), recv.raw_mut());
        self.typed(CollKind::AllReduce, T::DTYPE, op, 0, s, r)
    }

    /// In-place all-reduce: `buf` is both input and result.
    pub fn all_reduce_in_place<T: Element, B: BufferMut<T> + ?Sized>(
        &mut self,
        buf: &mut B,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.typed_in_place(CollKind::AllReduce, T::DTYPE, op, 0, buf.raw_mut())
    }

    /// Copy `buf` of rank `root` into `buf` of every rank.
    pub fn broadcast_in_place<T: Element, B: BufferMut<T> + ?Sized>(
        &mut self,
        buf: &mut B,
        root: usize,
    ) -> Result<(), CommError> {
        let b = buf.raw_mut();
        self.typed_in_place(CollKind::Broadcast, T::DTYPE, ReduceOp::Sum, root, b)
    }

    /// Out-of-place broadcast: `send` is read on `root` only; every rank's `recv` receives it.
    /// `send` must have `recv`'s length on the root; elsewhere it is not read (it may be empty).
    pub fn broadcast<T: Element, S: Buffer<T> + ?Sized, R: BufferMut<T> + ?Sized>(
        &mut self,
        send: &S,
        recv: &mut R,
        root: usize,
    ) -> Result<(), CommError> {
        let (s, r) = (send.raw(), recv.raw_mut());
        self.typed(CollKind::Broadcast, T::DTYPE, ReduceOp::Sum, root, s, r)
    }

    /// Reduce every rank's `send` into `recv` on `root`. `recv` must have `send.len()` elements on
    /// the root; other ranks' `recv` is not touched (pass an empty slice).
    pub fn reduce<T: Element, S: Buffer<T> + ?Sized, R: BufferMut<T> + ?Sized>(
        &mut self,
        send: &S,
        recv: &mut R,
        op: ReduceOp,
        root: usize,
    ) -> Result<(), CommError> {
        let (s, r) = (send.raw(), recv.raw_mut());
        self.typed(CollKind::Reduce, T::DTYPE, op, root, s, r)
    }

    /// In-place reduce: on `root`, `buf` receives the result; elsewhere it is left unchanged.
    pub fn reduce_in_place<T: Element, B: BufferMut<T> + ?Sized>(
        &mut self,
        buf: &mut B,
        op: ReduceOp,
        root: usize,
    ) -> Result<(), CommError> {
        self.typed_in_place(CollKind::Reduce, T::DTYPE, op, root, buf.raw_mut())
    }

    /// Concatenate every rank's `send` (in rank order) into every rank's `recv`
    /// (`recv.len() == send.len() * world_size`).
    pub fn all_gather<T: Element, S: Buffer<T> + ?Sized, R: BufferMut<T> + ?Sized>(
        &mut self,
        send: &S,
        recv: &mut R,
    ) -> Result<(), CommError> {
        let (s, r) = (send.raw(), recv.raw_mut());
        self.typed(CollKind::AllGather, T::DTYPE, ReduceOp::Sum, 0, s, r)
    }

    /// In-place all-gather: this rank's contribution is already at `buf[rank*c..(rank+1)*c]` with
    /// `c = buf.len() / world_size`.
    pub fn all_gather_in_place<T: Element, B: BufferMut<T> + ?Sized>(
        &mut self,
        buf: &mut B,
    ) -> Result<(), CommError> {
        let b = buf.raw_mut();
        self.typed_in_place(CollKind::AllGather, T::DTYPE, ReduceOp::Sum, 0, b)
    }

    /// Concatenate every rank's `send` into `recv` on `root` (`send.len() * world_size` elements
    /// there; other ranks' `recv` is not touched).
    pub fn gather<T: Element, S: Buffer<T> + ?Sized, R: BufferMut<T> + ?Sized>(
        &mut self,
        send: &S,
        recv: &mut R,
        root: usize,
    ) -> Result<(), CommError> {
        let (s, r) = (send.raw(), recv.raw_mut());
        self.typed(CollKind::Gather, T::DTYPE, ReduceOp::Sum, root, s, r)
    }

    /// Reduce every rank's `send` (`recv.len() * world_size` elements) and leave block `rank` of the
    /// result in `recv`.
    pub fn reduce_scatter<T: Element, S: Buffer<T> + ?Sized, R: BufferMut<T> + ?Sized>(
        &mut self,
        send: &S,
        recv: &mut R,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let (s, r) = (send.raw(), recv.raw_mut());
        self.typed(CollKind::ReduceScatter, T::DTYPE, op, 0, s, r)
    }

    /// In-place reduce-scatter: the result block lands at `buf[rank*c..(rank+1)*c]`,
    /// `c = buf.len() / world_size`.
    pub fn reduce_scatter_in_place<T: Element, B: BufferMut<T> + ?Sized>(
        &mut self,
        buf: &mut B,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.typed_in_place(CollKind::ReduceScatter, T::DTYPE, op, 0, buf.raw_mut())
    }

    /// Personalised exchange with equal blocks: block `j` of this rank's `send` goes to rank `j`,
    /// and block `i` of `recv` comes from rank `i`. `send.len() == recv.len()`, a multiple of the
    /// world size (the same on every rank).
    pub fn all_to_all<T: Element, S: Buffer<T> + ?Sized, R: BufferMut<T> + ?Sized>(
        &mut self,
        send: &S,
        recv: &mut R,
    ) -> Result<(), CommError> {
        let (s, r) = (send.raw(), recv.raw_mut());
        self.typed(CollKind::AllToAll, T::DTYPE, ReduceOp::Sum, 0, s, r)
    }

    /// Personalised exchange with per-peer counts, as `MPI_Alltoallv`: this rank sends
    /// `send[send_displs[j]..][..send_counts[j]]` to rank `j` and receives rank `i`'s block into
    /// `recv[recv_displs[i]..][..recv_counts[i]]` (counts and displacements in elements, one per
    /// rank). Rank `i`'s `send_counts[j]` must equal rank `j`'s `recv_counts[i]`; a disagreement is
    /// a [`CommError::Mismatch`] on every rank naming both. Receive blocks must not overlap.
    #[allow(clippy::too_many_arguments)]
    pub fn all_to_all_v<T: Element, S: Buffer<T> + ?Sized, R: BufferMut<T> + ?Sized>(
        &mut self,
        send: &S,
        send_counts: &[usize],
        send_displs: &[usize],
        recv: &mut R,
        recv_counts: &[usize],
        recv_displs: &[usize],
    ) -> Result<(), CommError> {
        let splits = Splits {
            send_counts,
            send_displs,
            recv_counts,
            recv_displs,
        };
        self.typed_v(
            CollKind::AllToAllV,
            T::DTYPE,
            0,
            send.raw(),
            recv.raw_mut(),
            splits,
        )
    }

    /// A typed v-variant: `splits` as passed (the packed displacements of the gathers are filled
    /// in by [`enter`](Self::enter)).
    fn typed_v(
        &mut self,
        kind: CollKind,
        dtype: Dtype,
        root: usize,
        send: RawMem,
        recv: RawMem,
        splits: Splits,
    ) -> Result<(), CommError> {
        let call = Call {
            splits,
            ..self.call_on(kind, dtype, ReduceOp::Sum, root, send, recv)
        };
        self.enter(&call)
    }

    /// Hand block `j` of the root's `send` (`world_size × recv.len()` elements) to rank `j`'s
    /// `recv`. Other ranks' `send` is not read (pass an empty slice).
    pub fn scatter<T: Element, S: Buffer<T> + ?Sized, R: BufferMut<T> + ?Sized>(
        &mut self,
        send: &S,
        recv: &mut R,
        root: usize,
    ) -> Result<(), CommError> {
        let (s, r) = (send.raw(), recv.raw_mut());
        self.typed(CollKind::Scatter, T::DTYPE, ReduceOp::Sum, root, s, r)
    }

    /// Concatenate every rank's `send` (of per-rank lengths) in rank order into every rank's
    /// `recv`: `recv_counts[i]` is rank `i`'s `send.len()` (the same array on every rank; a
    /// disagreement is a [`CommError::Mismatch`] naming the ranks) and `recv.len()` their sum.
    pub fn all_gather_v<T: Element, S: Buffer<T> + ?Sized, R: BufferMut<T> + ?Sized>(
        &mut self,
        send: &S,
        recv: &mut R,
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        let splits = Splits {
            recv_counts,
            ..Splits::default()
        };
        self.typed_v(
            CollKind::AllGatherV,
            T::DTYPE,
            0,
            send.raw(),
            recv.raw_mut(),
            splits,
        )
    }

    /// Concatenate every rank's `send` (of per-rank lengths) in rank order into `recv` on `root`:
    /// there `recv_counts[i]` is rank `i`'s `send.len()` and `recv.len()` their sum. Other ranks'
    /// `recv` and `recv_counts` are not read (pass empty slices).
    pub fn gather_v<T: Element, S: Buffer<T> + ?Sized, R: BufferMut<T> + ?Sized>(
        &mut self,
        send: &S,
        recv: &mut R,
        recv_counts: &[usize],
        root: usize,
    ) -> Result<(), CommError> {
        let splits = Splits {
            recv_counts,
            ..Splits::default()
        };
        self.typed_v(
            CollKind::GatherV,
            T::DTYPE,
            root,
            send.raw(),
            recv.raw_mut(),
            splits,
        )
    }

    // --------------------------------------------------------------------------------------------
    // Sub-communicators

    /// The global rank of each rank of this communicator: the rank it has in the world
    /// communicator the [`split`](Self::split)s started from (`0..world_size()` for a world
    /// communicator). Errors of a sub-communicator name global ranks, followed by the rank in the
    /// sub-communicator: `rank 3 (rank 1 of this sub-communicator)`.
    pub fn global_ranks(&self) -> Vec<usize> {
        match &self.global {
            Some(g) => g.to_vec(),
            None => (0..self.world_size()).collect(),
        }
    }

    /// This rank's global rank (see [`global_ranks`](Self::global_ranks)).
    pub fn global_rank(&self) -> usize {
        self.global.as_ref().map_or(self.rank(), |g| g[self.rank()])
    }

    /// A watch over the peers' processes that any thread can poll (see
    /// [`PeerCheck`](crate::comm::PeerCheck)): how a device communicator bootstrapped through
    /// this one notices a peer's death. `None` where the backend does not know the processes
    /// (nccl, hier).
    pub fn peer_check(&self) -> Option<crate::comm::PeerCheck> {
        self.backend.peer_check()
    }

    /// Show call `seq` that another transport carries for these ranks where `lockstep status`
    /// reads this communicator's calls (see [`Backend::show_carried`]).
    pub(crate) fn show_carried(&self, call: &Call, seq: u64) {
        self.backend.show_carried(call, seq);
    }

    /// Show that this rank waits in carried call `seq` (see [`Backend::show_carried_wait`]).
    pub(crate) fn show_carried_wait(&self, seq: u64) {
        self.backend.show_carried_wait(seq);
    }

    /// Whether this communicator was made by [`split`](Self::split) or [`new_group`](Self::new_group).
    pub fn is_sub_communicator(&self) -> bool {
        self.global.is_some()
    }

    /// Split this communicator into disjoint sub-communicators, as `ncclCommSplit` and
    /// `MPI_Comm_split` do. Every rank must call it, at the same point of its sequence of calls
    /// (it runs collectives on this communicator, which count in [`seq`](Self::seq)). Ranks that
    /// pass the same `color` form one sub-communicator, in which they are ranked by `key`, ties
    /// broken by their rank here (so `key = 0` everywhere keeps this communicator's order, and
    /// `key = -rank` reverses it); ranks that pass `None` get `Ok(None)`.
    ///
    /// The sub-communicators are independent of this one and of each other: they may run
    /// collectives at the same time (from other threads, each communicator used by one thread at a
    /// time), and this communicator stays usable. Splits nest: a sub-communicator can be split
    /// again, and its [`global_ranks`](Self::global_ranks) still name world ranks.
    ///
    /// Backends: shm (a new shared segment per sub-communicator, see docs/rust.md), nccl
    /// (`ncclCommSplit`; colors up to `i32::MAX` and keys that fit an `i32`), staged (splits its
    /// host communicator).
    pub fn split(
        &mut self,
        color: Option<u32>,
        key: i64,
    ) -> Result<Option<Communicator>, CommError> {
        let Some(backend) = self.backend.split(color, key)? else {
            return Ok(None);
        };
        let mut child = Communicator::from_backend(backend);
        let (n, me) = (child.world_size(), child.rank());
        if child.global.is_none() {
            // The backend does not know who its members are (NCCL): ask them.
            let all = child.all_gather_u64(self.global_rank() as u64, SPLIT_DATA)?;
            child.global = Some(all.iter().map(|&g| g as usize).collect());
            // Its records name the members now.
            child.trace = child.tracer();
        }
        let mine = self.global_rank();
        match &child.global {
            Some(g) if g.len() == n && g[me] == mine => Ok(Some(child)),
            g => Err(CommError::Setup(format!(
                "split: the {} backend made a sub-communicator of {n} ranks in which this rank (global rank {mine}) is rank {me}, but its global ranks are {g:?}; this is a bug in lockstep",
                self.backend_kind()
            ))),
        }
    }

    /// A sub-communicator of the ranks `ranks` (ranks of this communicator), as
    /// `torch.distributed.new_group`: every rank of this communicator must call it with the same
    /// set of ranks (checked: a rank that passes another set makes the call fail on every rank
    /// with [`CommError::Mismatch`]); the members get the new communicator, the others `Ok(None)`.
    /// As in torch, the list is a set: the new ranks follow this communicator's order whatever
    /// the order of `ranks` (use [`split`](Self::split) with a key for another order). An empty
    /// list, a rank out of range or a duplicate is refused on the rank that passed it
    /// ([`CommError::InvalidArgument`]) and on its peers (a mismatch naming it).
    pub fn new_group(&mut self, ranks: &[usize]) -> Result<Option<Communicator>, CommError> {
        let n = self.world_size();
        let mut set = ranks.to_vec();
        set.sort_unstable();
        let problem = if set.is_empty() {
            Some("the rank list is empty; a group needs at least one rank".to_string())
        } else if let Some(r) = set.iter().find(|&&r| r >= n) {
            Some(format!(
                "rank {r} in {ranks:?} is out of range for world size {n}"
            ))
        } else {
            set.windows(2)
                .find(|w| w[0] == w[1])
                .map(|w| format!("rank {} appears more than once in {ranks:?}", w[0]))
        };
        if let Some(p) = problem {
            let e = self.invalid(CollKind::AllGather, format!("new_group: {p}"));
            // The peers' exchange below fails too, naming this rank, instead of waiting for it.
            self.backend.reject(CollKind::AllGather, Dtype::U64, &e);
            return Err(e);
        }
        // Every rank must pass the same set: compare a fingerprint (FNV-1a over the set).
        let fp = set.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &r| {
            (h ^ r as u64).wrapping_mul(0x100_0000_01b3)
        });
        let all = self.all_gather_u64(fp, SPLIT_DATA)?;
        let differ: Vec<String> = (0..n)
            .filter(|&r| all[r] != all[0])
            .map(|r| self.rank_name(r))
            .collect();
        if !differ.is_empty() {
            return Err(CommError::Mismatch {
                seq: self.seq(),
                detail: format!(
                    "new_group: {} passed another set of ranks than {}; every rank must pass the same ranks",
                    differ.join(", "),
                    self.rank_name(0)
                ),
            });
        }
        let member = set.binary_search(&self.rank()).is_ok();
        self.split(member.then_some(0), 0)
    }

    /// How long [`shrink`](Self::shrink) waits for a peer that is alive but has not called it
    /// before it leaves that peer out.
    pub const SHRINK_WAIT: Duration = Duration::from_secs(1);

    /// After a failure (a peer died: [`CommError::PeerLost`]; or one stopped answering:
    /// [`CommError::Timeout`], [`CommError::Aborted`]), the communicator of the ranks that
    /// remain, as `ncclCommShrink`: every surviving rank calls it and gets a communicator whose
    /// ranks are the survivors, numbered `0..` in their order here. Its
    /// [`global_ranks`](Self::global_ranks) still name world ranks, and its errors name them.
    ///
    /// The members are agreed through the shared segment, so every survivor gets the same ones:
    /// a rank whose process is gone is left out at once, a rank that is alive but does not call
    /// shrink within [`SHRINK_WAIT`](Self::SHRINK_WAIT) is left out then (see
    /// [`shrink_excluding`](Self::shrink_excluding) for another wait). A rank left out that
    /// is still running (it was stopped, or slow) gets [`CommError::Excluded`] from its next
    /// call or shrink, and cannot disturb the new communicator, which shares no memory with
    /// this one. A rank blocked in a call on this communicator when a peer starts shrinking it
    /// fails within a peer check (`LOCKSTEP_PEER_CHECK_MS`) and can then call shrink.
    ///
    /// From then on every call on this communicator fails with [`CommError::Shrunk`]; drop it
    /// to free its memory. Shrink again after a later failure: each shrink makes the next
    /// generation. With the ranks gone at once, it returns within a few milliseconds of the
    /// last survivor's call.
    ///
    /// Backends: shm; nccl and staged communicators of one node (made by
    /// [`from_env`](Self::from_env), `lockstep launch` or
    /// [`device_communicator`](crate::rendezvous::device_communicator)), whose host communicator
    /// agrees on the members and under which a new NCCL communicator of the survivors is made
    /// (see `nccl/membership.rs`). The others (hier, NCCL across nodes, a split's NCCL
    /// communicators) return [`CommError::Unsupported`].
    pub fn shrink(&mut self) -> Result<Communicator, CommError> {
        self.shrink_excluding(&[], Self::SHRINK_WAIT)
    }

    /// [`shrink`](Self::shrink), also leaving out the ranks in `exclude` (ranks of this
    /// communicator, as `ncclCommShrink`'s `excludeRanksList`; a listed rank that has already
    /// called shrink stays in), and waiting `wait` for live ranks that have not called it. A
    /// rank listed that is out of range, or this rank itself, is refused
    /// ([`CommError::Unsupported`]).
    pub fn shrink_excluding(
        &mut self,
        exclude: &[usize],
        wait: Duration,
    ) -> Result<Communicator, CommError> {
        let backend = self.backend.shrink(exclude, wait)?;
        Ok(Communicator::from_backend(backend))
    }

    /// After a peer was lost and a launcher started its replacement, the communicator of the
    /// whole world again, with every rank's number from before the loss, as `ncclCommGrow`:
    /// every surviving rank calls it on the communicator whose call failed (a world
    /// communicator, or one [`grow`](Self::grow) or [`shrink`](Self::shrink) made), and the
    /// replacement joins the same communicator through its normal entry,
    /// [`Communicator::from_env`] (which knows it is a replacement from
    /// `LOCKSTEP_REPLACEMENT=1`, and which grow to join from `LOCKSTEP_RESTART_COUNT`), so
    /// `lockstep launch --max-restarts N --restart-policy rank` runs a program that grows on.
    /// Forked ranks join with [`ShmJob::join_replacement`](crate::shm::ShmJob::join_replacement).
    ///
    /// The survivors first shrink (as [`shrink`](Self::shrink), which this does when it is
    /// called on a communicator of the whole world), then wait for the replacements up to the
    /// join timeout (`LOCKSTEP_JOIN_TIMEOUT_S`, 60 s by default; see
    /// [`grow_within`](Self::grow_within)): a replacement that does not come is an error
    /// naming the rank it replaces, on every survivor. The new communicator shares no memory
    /// with the old ones, whose calls fail from then on with [`CommError::Shrunk`]. It holds
    /// nothing of the lost rank's state: the survivors send the replacement what it needs.
    ///
    /// Backends: shm (world communicators and their shrinks and grows; not sub-communicators of
    /// a split), and nccl and staged communicators of one node as for [`shrink`](Self::shrink)
    /// (the replacement's `from_env` makes the same kind of device communicator). The others
    /// return [`CommError::Unsupported`].
    pub fn grow(&mut self) -> Result<Communicator, CommError> {
        let backend = self.backend.grow(None)?;
        Ok(Communicator::from_backend(backend))
    }

    /// [`grow`](Self::grow), waiting at most `wait` for the replacements.
    pub fn grow_within(&mut self, wait: Duration) -> Result<Communicator, CommError> {
        let backend = self.backend.grow(Some(wait))?;
        Ok(Communicator::from_backend(backend))
    }

    /// How errors name rank `r` of this communicator.
    fn rank_name(&self, r: usize) -> String {
        rank_name(self.global.as_deref(), r)
    }

    /// Every rank's `v`, in rank order: an all-gather of one `u64` through host memory, or
    /// through device memory on a device communicator (whose collectives take device buffers
    /// only), for the agreements the ranks reach before a split or a new group. Every rank calls
    /// it, like any collective; `what` names the exchange in the error of a failed CUDA step.
    pub fn all_gather_u64(&mut self, v: u64, what: &str) -> Result<Vec<u64>, CommError> {
        let n = self.world_size();
        let Some(ctx) = self.device_context() else {
            let mut out = vec![0u64; n];
            self.all_gather(&[v][..], &mut out[..])?;
            return Ok(out);
        };
        let cuda = |e: CudaError| CommError::Backend {
            backend: "cuda",
            message: format!("{what} through the device: {e}"),
        };
        let stream = ctx.stream().map_err(cuda)?;
        let send = DeviceBuffer::from_host(&stream, &[v]).map_err(cuda)?;
        let mut recv = DeviceBuffer::<u64>::zeros(&stream, n).map_err(cuda)?;
        // The zeroing must land before the communicator's stream writes the result.
        stream.synchronize().map_err(cuda)?;
        self.all_gather(&send, &mut recv)?;
        self.synchronize()?;
        recv.to_vec(&stream).map_err(cuda)
    }

    // --------------------------------------------------------------------------------------------
    // Point to point

    /// Send `buf` to rank `peer`; it matches the next `recv` from this rank that `peer` posts
    /// (sends and receives between a pair of ranks match in order, separately from collectives).
    /// A count or dtype disagreement with that `recv` is a [`CommError::Mismatch`] on both ranks.
    ///
    /// Blocking: on the shared-memory backend a send returns once the matching `recv` has been
    /// posted on `peer` and the data has been handed over (a message that does not fit the pair's
    /// mailbox is streamed through it while `peer` takes it). So two ranks that both send to each
    /// other before receiving wait forever (until the timeout): post such exchanges in one
    /// [`group`](Self::group). Sending to oneself needs a group with the matching `recv`.
    pub fn send<T: Element, S: Buffer<T> + ?Sized>(
        &mut self,
        buf: &S,
        peer: usize,
    ) -> Result<(), CommError> {
        let op = P2pOp {
            kind: CollKind::Send,
            peer,
            dtype: T::DTYPE,
            mem: buf.raw(),
        };
        self.p2p_single(op)
    }

    /// Receive into `buf` the next message `peer` sends to this rank (blocking; see [`send`](Self::send)).
    /// `buf.len()` must equal the sent count, and the dtypes must agree.
    pub fn recv<T: Element, R: BufferMut<T> + ?Sized>(
        &mut self,
        buf: &mut R,
        peer: usize,
    ) -> Result<(), CommError> {
        let op = P2pOp {
            kind: CollKind::Recv,
            peer,
            dtype: T::DTYPE,
            mem: buf.raw_mut(),
        };
        self.p2p_single(op)
    }

    /// Receive into `buf` the first message any other rank sends to this rank, and return that
    /// rank (MPI's `MPI_ANY_SOURCE`; in a sub-communicator, its rank there). Blocking, as
    /// [`recv`](Self::recv). On the shared-memory backend only (NCCL has no receive from any
    /// source: the NCCL backend refuses it with [`CommError::Unsupported`]).
    ///
    /// Matching: it takes the first message to arrive from a rank that no receive posted before it
    /// still waits on (in a [`group`](Self::group), a receive from a named rank posted after it
    /// waits until it has matched, since any message that one could take, this one could too);
    /// messages from one rank still arrive in the order they were sent, and no rank is favoured
    /// over time. The header check is the same as for [`recv`](Self::recv): a count or dtype that
    /// disagrees with the message it takes is a [`CommError::Mismatch`] on both ranks, naming
    /// them.
    ///
    /// Lost ranks: a rank that died or left the communicator stops being a candidate (messages
    /// it completed before are still received), and the receive goes on waiting for the others,
    /// as MPI's does: a message from another rank may still come. Once no other rank is left, it
    /// fails with [`CommError::PeerLost`] within the peer-check interval, naming them; while
    /// some are left but none sends, it fails with [`CommError::Timeout`] after the timeout
    /// (`LOCKSTEP_TIMEOUT_S`), naming the ranks it waited on and those that are gone. So it never
    /// waits forever; a job whose other ranks keep running without sending learns of a dead rank
    /// at the timeout, not at once (a receive from a named rank fails at once). With a single
    /// rank nothing can arrive: refused locally ([`CommError::InvalidArgument`]).
    pub fn recv_any<T: Element, R: BufferMut<T> + ?Sized>(
        &mut self,
        buf: &mut R,
    ) -> Result<usize, CommError> {
        let mut ops = [P2pOp {
            kind: CollKind::Recv,
            peer: ANY_SOURCE,
            dtype: T::DTYPE,
            mem: buf.raw_mut(),
        }];
        self.enter_p2p(&mut ops)?;
        Ok(ops[0].peer)
    }

    /// Run a group of point-to-point operations described by type-erased [`P2pOp`]s, as
    /// [`group`](Self::group) runs the ones posted on a [`Group`]: all of them progress together,
    /// so sends and receives of one group never wait on one another in a cycle. One operation
    /// alone is a blocking [`send`](Self::send) or [`recv`](Self::recv). A receive whose `peer` is
    /// [`ANY_SOURCE`] takes the first message any other rank sends (see
    /// [`recv_any`](Self::recv_any)); once matched, its `peer` holds that rank.
    ///
    /// Checked locally first ([`CommError::InvalidArgument`], nothing sent): kinds `Send` and
    /// `Recv` only, peers in range, buffers aligned, sends to this rank itself paired with
    /// receives from it in the same group (a single one is refused), and a receive from any
    /// source only with another rank in the communicator.
    ///
    /// # Safety
    ///
    /// Until this returns (device backends: until the group has completed on the device), each
    /// send's `mem` is valid for reads, and each receive's for writes, of `len` elements of its
    /// `dtype` in its memory space; nothing else reads or writes a receive's buffer, and the
    /// buffers of a group's receives are disjoint from each other and from its sends'.
    pub unsafe fn run_p2p(&mut self, ops: &mut [P2pOp]) -> Result<(), CommError> {
        self.enter_p2p(ops)
    }

    /// The checks of [`run_p2p`](Self::run_p2p), then the backend, recorded as one call (its
    /// first operation, and how many there are).
    fn enter_p2p(&mut self, ops: &mut [P2pOp]) -> Result<(), CommError> {
        let Some(first) = ops.first().copied() else {
            return self.enter_p2p_untraced(ops);
        };
        let id = self.trace_start(false, || CallInfo {
            kind: first.kind,
            dtype: first.dtype,
            op: ReduceOp::Sum,
            count: first.mem.len as u64,
            root: (first.peer != ANY_SOURCE).then_some(first.peer as u64),
            ops: u16::try_from(ops.len()).unwrap_or(u16::MAX),
            buffer: buffer_kind(&[first.mem.space]),
        });
        let r = self.enter_p2p_untraced(ops);
        self.trace_end(id, &r);
        r
    }

    /// [`enter_p2p`](Self::enter_p2p) without the recorder.
    fn enter_p2p_untraced(&mut self, ops: &mut [P2pOp]) -> Result<(), CommError> {
        if let Err((kind, detail)) = check::p2p(ops, self.rank(), self.world_size()) {
            return Err(self.invalid(kind, detail));
        }
        if ops.is_empty() {
            return Ok(());
        }
        self.backend.p2p(ops)
    }

    /// A typed send or receive from a named rank ([`ANY_SOURCE`] is no rank there).
    fn p2p_single(&mut self, op: P2pOp) -> Result<(), CommError> {
        check::peer(op.peer, self.world_size()).map_err(|d| self.invalid(op.kind, d))?;
        self.enter_p2p(&mut [op])
    }

    /// Post several sends and receives together (NCCL's group semantics): `f` records them on the
    /// [`Group`], and they all run when it returns, progressed together, so patterns where every
    /// rank sends before it receives (a ring exchange, all pairs, a pipeline) never deadlock. The
    /// buffers stay borrowed until this returns. If `f` fails, nothing is sent and its error is
    /// returned (the peers' matching operations then wait until their timeout).
    pub fn group<'b, F>(&mut self, f: F) -> Result<(), CommError>
    where
        F: FnOnce(&mut Group<'b>) -> Result<(), CommError>,
    {
        let mut g = Group {
            ops: Vec::new(),
            sources: Vec::new(),
            rank: self.rank(),
            world: self.world_size(),
            _bufs: PhantomData,
        };
        f(&mut g)?;
        let r = self.enter_p2p(&mut g.ops);
        for (i, src) in g.sources {
            if g.ops[i].peer != ANY_SOURCE {
                *src = g.ops[i].peer;
            }
        }
        r
    }

    // --------------------------------------------------------------------------------------------
    // Nonblocking form

    /// Start any call without waiting for it: `comm.start(|c| c.all_reduce(&send, &mut recv, op))`
    /// returns a [`Work`] to [`wait`](Work::wait) for the call's result, as c10d's `Work`. The
    /// buffers the call borrows stay borrowed for as long as the `Work` lives, so a device backend
    /// can complete the call later. On host backends the call has completed when this returns
    /// (there is no progress thread). Calls complete in issue order. One call per `Work`: the
    /// handle is on the last call `call` makes.
    ///
    /// ```no_run
    /// # use lockstep::comm::{Communicator, ReduceOp};
    /// # fn f(comm: &mut Communicator) -> Result<(), lockstep::CommError> {
    /// let (send, mut recv) = (vec![1f32; 4], vec![0f32; 4]);
    /// let work = comm.start(|c| c.all_reduce(&send[..], &mut recv[..], ReduceOp::Sum));
    /// work.wait()?;
    /// assert_eq!(recv[0], comm.world_size() as f32);
    /// # Ok(()) }
    /// ```
    ///
    /// The erased entry starts the same way: `comm.start(|c| unsafe { c.run(&call) })` (the
    /// buffers behind `call` then stay valid until the `Work` is waited for; see
    /// [`run`](Self::run)).
    ///
    /// The buffers cannot be touched before the `Work` is done with:
    ///
    /// ```compile_fail
    /// # use lockstep::comm::{Communicator, ReduceOp};
    /// # fn f(comm: &mut Communicator) -> Result<(), lockstep::CommError> {
    /// let (send, mut recv) = (vec![1f32; 4], vec![0f32; 4]);
    /// let work = comm.start(|c| c.all_reduce(&send[..], &mut recv[..], ReduceOp::Sum));
    /// recv[0] = 2.0; // error: `recv` is still borrowed by `work`
    /// work.wait()?;
    /// # Ok(()) }
    /// ```
    pub fn start<'a, F>(&mut self, call: F) -> Work<'a>
    where
        F: FnOnce(&mut Communicator) -> Result<(), CommError> + 'a,
    {
        let r = call(self);
        self.work(r)
    }

    /// The handle of a call that returned `r`: on device backends it waits for the call's
    /// completion on the device; elsewhere the call has completed.
    fn work<'a>(&mut self, r: Result<(), CommError>) -> Work<'a> {
        match r.and_then(|()| self.backend.completion()) {
            Ok(Some(c)) => Work {
                state: WorkState::Pending(c),
                _bufs: PhantomData,
            },
            Ok(None) => Work::finished(Ok(())),
            Err(e) => Work::finished(Err(e)),
        }
    }

    /// Wait until every rank has reached this call.
    pub fn barrier(&mut self) -> Result<(), CommError> {
        let empty = RawMem {
            addr: 0,
            len: 0,
            space: MemSpace::Host,
        };
        self.typed(CollKind::Barrier, Dtype::U8, ReduceOp::Sum, 0, empty, empty)
    }
}

/// Sends and receives posted together (see [`Communicator::group`]). The buffers are borrowed for
/// `'b`, until the group has run.
pub struct Group<'b> {
    ops: Vec<P2pOp>,
    /// The receives from any source: their index in `ops`, and where to write the sender.
    sources: Vec<(usize, &'b mut usize)>,
    rank: usize,
    world: usize,
    _bufs: PhantomData<&'b mut ()>,
}

impl fmt::Debug for Group<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Group")
            .field("rank", &self.rank)
            .field("ops", &self.ops.len())
            .finish()
    }
}

impl<'b> Group<'b> {
    fn post(&mut self, op: P2pOp) -> Result<(), CommError> {
        check::peer(op.peer, self.world).map_err(|detail| CommError::InvalidArgument {
            op: op.kind,
            rank: self.rank,
            detail,
        })?;
        self.ops.push(op);
        Ok(())
    }

    /// Post a send of `buf` to `peer` (see [`Communicator::send`]).
    pub fn send<T: Element, S: Buffer<T> + ?Sized>(
        &mut self,
        buf: &'b S,
        peer: usize,
    ) -> Result<(), CommError> {
        self.post(P2pOp {
            kind: CollKind::Send,
            peer,
            dtype: T::DTYPE,
            mem: buf.raw(),
        })
    }

    /// Post a receive into `buf` from `peer` (see [`Communicator::recv`]).
    pub fn recv<T: Element, R: BufferMut<T> + ?Sized>(
        &mut self,
        buf: &'b mut R,
        peer: usize,
    ) -> Result<(), CommError> {
        self.post(P2pOp {
            kind: CollKind::Recv,
            peer,
            dtype: T::DTYPE,
            mem: buf.raw_mut(),
        })
    }

    /// Post a receive into `buf` from any other rank (see [`Communicator::recv_any`]); once the
    /// group has run, `source` holds the rank whose message it took (it is left as it was if the
    /// receive did not match).
    pub fn recv_any<T: Element, R: BufferMut<T> + ?Sized>(
        &mut self,
        buf: &'b mut R,
        source: &'b mut usize,
    ) -> Result<(), CommError> {
        self.sources.push((self.ops.len(), source));
        self.ops.push(P2pOp {
            kind: CollKind::Recv,
            peer: ANY_SOURCE,
            dtype: T::DTYPE,
            mem: buf.raw_mut(),
        });
        Ok(())
    }
}

/// The handle of a nonblocking call ([`Communicator::start`]): [`wait`](Self::wait) for its
/// result. It keeps the call's buffers borrowed for `'a`, so they cannot be touched before the
/// call has completed.
///
/// * Host backends (shm): the call has already completed when the handle is made (there is no
///   progress thread); the handle carries its result.
/// * Device backends (NCCL): the call returns once enqueued on the communicator's stream, after
///   the work already enqueued on the context's other streams (so buffers produced there need no
///   synchronisation first); the handle wraps a CUDA event recorded after it, and `wait` polls it
///   with the communicator's timeout and liveness checks (a failure aborts the communicator).
///
/// Calls complete in issue order on every rank. Dropping a handle unwaited discards the result
/// (the call still completes).
#[must_use = "wait() on the Work to see whether the call succeeded"]
pub struct Work<'a> {
    state: WorkState,
    _bufs: PhantomData<&'a mut ()>,
}

enum WorkState {
    Done(Result<(), CommError>),
    Pending(Box<dyn Completion>),
}

impl fmt::Debug for Work<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.state {
            WorkState::Done(r) => f.debug_struct("Work").field("done", r).finish(),
            WorkState::Pending(_) => f.debug_struct("Work").field("pending", &true).finish(),
        }
    }
}

impl Work<'_> {
    /// A handle for a call that has already completed with `result`.
    pub(crate) fn finished(result: Result<(), CommError>) -> Self {
        Work {
            state: WorkState::Done(result),
            _bufs: PhantomData,
        }
    }

    /// Whether the call has completed (always, on host backends); a failed call counts as
    /// completed, and [`wait`](Self::wait) returns its error.
    pub fn is_completed(&self) -> bool {
        match &self.state {
            WorkState::Done(_) => true,
            WorkState::Pending(c) => c.query().unwrap_or(true),
        }
    }

    /// Wait for the call to complete and return its result.
    pub fn wait(self) -> Result<(), CommError> {
        match self.state {
            WorkState::Done(r) => r,
            WorkState::Pending(c) => c.wait(),
        }
    }
}
