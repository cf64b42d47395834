//! The collective API: one [`Communicator`] for every backend.
//!
//! Callers use typed methods (`all_reduce`, `broadcast`, ...); each builds a type-erased [`Call`]
//! after checking the buffers locally, and hands it to the backend. Backends (shared memory now,
//! NCCL later) implement the small [`Backend`] trait. Ordering: host backends complete a call
//! before returning; device backends enqueue it on the communicator's stream, and
//! [`Communicator::synchronize`] waits for it. Code written against the `Communicator` runs
//! unchanged on both.

mod buffer;
mod dtype;
mod env;
mod error;

pub use buffer::{Buffer, BufferMut, MemSpace, RawMem};
pub use dtype::{Dtype, Element, ReduceOp};
pub use env::{device_communicator, host_id, EnvInfo};
pub use error::{CollKind, CommError};

use std::fmt;

/// Which backend a communicator runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// The shared-memory backend for the ranks of one node (host buffers).
    Shm,
    /// NCCL (device buffers).
    Nccl,
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendKind::Shm => "shm",
            BackendKind::Nccl => "nccl",
        })
    }
}

/// One collective call, type-erased and checked locally. `count` is the per-rank element count as
/// NCCL defines it: the send count of `all_reduce`/`broadcast`/`reduce`/`all_gather`/`gather`,
/// and the *receive* count of `reduce_scatter`.
#[derive(Clone, Copy, Debug)]
pub struct Call {
    /// The collective.
    pub kind: CollKind,
    /// Element type.
    pub dtype: Dtype,
    /// Reduction operator (`Sum` where none applies).
    pub op: ReduceOp,
    /// Root rank (0 where none applies).
    pub root: usize,
    /// Element count, as above.
    pub count: usize,
    /// Send buffer (for in-place calls, the same address as `recv`).
    pub send: RawMem,
    /// Receive buffer (may be empty on ranks that receive nothing).
    pub recv: RawMem,
}

/// What a backend implements. Callers never see it: they use [`Communicator`].
pub trait Backend: Send {
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// Which backend this is.
    fn kind(&self) -> BackendKind;
    /// Run (or enqueue) one collective.
    fn run(&mut self, call: &Call) -> Result<(), CommError>;
    /// Wait until every call issued so far has completed.
    fn synchronize(&mut self) -> Result<(), CommError>;
    /// Number of collectives this rank has issued.
    fn seq(&self) -> u64;
    /// A call this rank refused locally (bad buffer lengths, root out of range, wrong memory
    /// space): backends that can, make the peers' matching call fail too, so the ranks stay in step.
    fn reject(&mut self, kind: CollKind, dtype: Dtype, reason: &CommError) {
        let _ = (kind, dtype, reason);
    }
    /// The CUDA context whose device memory this backend's collectives take (device backends).
    fn device(&self) -> Option<std::sync::Arc<crate::cuda::Context>> {
        None
    }
    /// Allocate `bytes` of memory that peers can read directly (zero-copy collectives).
    fn alloc_shared(&mut self, bytes: usize) -> Result<crate::shm::SharedAlloc, CommError> {
        let _ = bytes;
        Err(CommError::Unsupported(format!("the {} backend has no shared host buffers", self.kind())))
    }
}

/// A group of ranks that run collectives together.
///
/// Every rank must issue the same sequence of calls with the same count, dtype, op and root;
/// a disagreement is reported on every rank as [`CommError::Mismatch`] rather than hanging.
pub struct Communicator {
    backend: Box<dyn Backend>,
}

impl fmt::Debug for Communicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Communicator")
            .field("backend", &self.backend.kind())
            .field("rank", &self.backend.rank())
            .field("world_size", &self.backend.world_size())
            .finish()
    }
}

impl Communicator {
    /// Wrap a backend.
    pub fn from_backend(backend: Box<dyn Backend>) -> Communicator {
        Communicator { backend }
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

    /// For a device communicator (NCCL, or staging when ranks share a GPU): the CUDA context of
    /// this rank's device, on which its buffers must live. `None` for host backends.
    pub fn device_context(&self) -> Option<std::sync::Arc<crate::cuda::Context>> {
        self.backend.device()
    }

    /// Wait for every call issued so far (a no-op on host backends, which complete each call).
    pub fn synchronize(&mut self) -> Result<(), CommError> {
        self.backend.synchronize()
    }

    /// Allocate a buffer of `len` elements (zeroed) inside the backend's shared segment. Collectives
    /// whose buffers are all shared on every rank skip the staging copies (the analog of NCCL's
    /// registered buffers).
    pub fn alloc_shared<T: Element>(&mut self, len: usize) -> Result<crate::shm::SharedBuffer<T>, CommError> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| CommError::Unsupported(format!("alloc_shared: {len} elements overflow")))?;
        let alloc = self.backend.alloc_shared(bytes)?;
        Ok(crate::shm::SharedBuffer::new(alloc, len))
    }

    /// Mutable access to the backend (for backend-specific features such as shared allocation).
    pub fn backend_mut(&mut self) -> &mut dyn Backend {
        &mut *self.backend
    }

    fn invalid(&self, op: CollKind, detail: String) -> CommError {
        CommError::InvalidArgument { op, rank: self.rank(), detail }
    }

    /// A call refused locally: let the backend tell the peers (so they fail too instead of pairing
    /// this rank's next call with their current one), then return the error.
    fn rejected<T: Element>(&mut self, op: CollKind, e: CommError) -> Result<(), CommError> {
        self.backend.reject(op, T::DTYPE, &e);
        Err(e)
    }

    fn reject_err<T: Element>(&mut self, e: CommError) -> Result<(), CommError> {
        let op = match &e {
            CommError::InvalidArgument { op, .. } => *op,
            _ => CollKind::Barrier,
        };
        self.rejected::<T>(op, e)
    }

    fn check_root(&self, op: CollKind, root: usize) -> Result<(), CommError> {
        if root >= self.world_size() {
            return Err(self.invalid(op, format!("root {root} is out of range for world size {}", self.world_size())));
        }
        Ok(())
    }

    fn check_space(&self, op: CollKind, a: RawMem, b: RawMem) -> Result<(), CommError> {
        if a.space != b.space && a.len > 0 && b.len > 0 {
            return Err(self.invalid(op, format!("send buffer is in {:?} but receive buffer is in {:?}", a.space, b.space)));
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn call<T: Element>(
        &mut self,
        kind: CollKind,
        op: ReduceOp,
        root: usize,
        count: usize,
        send: RawMem,
        recv: RawMem,
    ) -> Result<(), CommError> {
        if let Err(e) = self.check_space(kind, send, recv) {
            return self.rejected::<T>(kind, e);
        }
        let call = Call { kind, dtype: T::DTYPE, op, root, count, send, recv };
        self.backend.run(&call)
    }

    /// Element-wise reduction of every rank's `send` into every rank's `recv` (same length).
    pub fn all_reduce<T: Element, S: Buffer<T> + ?Sized, R: BufferMut<T> + ?Sized>(
        &mut self,
        send: &S,
        recv: &mut R,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let (s, r) = (send.raw(), recv.raw_mut());
        if s.len != r.len {
            return self.reject_err::<T>(
                self.invalid(CollKind::AllReduce, format!("send has {} elements but recv has {}; they must be equal", s.len, r.len)),
            );
        }
        self.call::<T>(CollKind::AllReduce, op, 0, s.len, s, r)
    }

    /// In-place all-reduce: `buf` is both input and result.
    pub fn all_reduce_in_place<T: Element, B: BufferMut<T> + ?Sized>(&mut self, buf: &mut B, op: ReduceOp) -> Result<(), CommError> {
        let r = buf.raw_mut();
        self.call::<T>(CollKind::AllReduce, op, 0, r.len, r, r)
    }

    /// Copy `buf` of rank `root` into `buf` of every rank.
    pub fn broadcast_in_place<T: Element, B: BufferMut<T> + ?Sized>(&mut self, buf: &mut B, root: usize) -> Result<(), CommError> {
        if let Err(e) = self.check_root(CollKind::Broadcast, root) {
            return self.rejected::<T>(CollKind::Broadcast, e);
        }
        let r = buf.raw_mut();
        self.call::<T>(CollKind::Broadcast, ReduceOp::Sum, root, r.len, r, r)
    }

    /// Out-of-place broadcast: `send` is read on `root` only; every rank's `recv` receives it.
    /// `send` and `recv` must have the same length on every rank.
    pub fn broadcast<T: Element, S: Buffer<T> + ?Sized, R: BufferMut<T> + ?Sized>(
        &mut self,
        send: &S,
        recv: &mut R,
        root: usize,
    ) -> Result<(), CommError> {
        if let Err(e) = self.check_root(CollKind::Broadcast, root) {
            return self.rejected::<T>(CollKind::Broadcast, e);
        }
        let (s, r) = (send.raw(), recv.raw_mut());
        if s.len != r.len {
            return self.reject_err::<T>(
                self.invalid(CollKind::Broadcast, format!("send has {} elements but recv has {}; they must be equal", s.len, r.len)),
            );
        }
        self.call::<T>(CollKind::Broadcast, ReduceOp::Sum, root, r.len, s, r)
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
        if let Err(e) = self.check_root(CollKind::Reduce, root) {
            return self.rejected::<T>(CollKind::Reduce, e);
        }
        let (s, r) = (send.raw(), recv.raw_mut());
        if self.rank() == root && s.len != r.len {
            return self.reject_err::<T>(
                self.invalid(
                    CollKind::Reduce,
                    format!("send has {} elements but recv on the root has {}; they must be equal", s.len, r.len),
                ),
            );
        }
        self.call::<T>(CollKind::Reduce, op, root, s.len, s, r)
    }

    /// In-place reduce: on `root`, `buf` receives the result; elsewhere it is left unchanged.
    pub fn reduce_in_place<T: Element, B: BufferMut<T> + ?Sized>(
        &mut self,
        buf: &mut B,
        op: ReduceOp,
        root: usize,
    ) -> Result<(), CommError> {
        if let Err(e) = self.check_root(CollKind::Reduce, root) {
            return self.rejected::<T>(CollKind::Reduce, e);
        }
        let r = buf.raw_mut();
        self.call::<T>(CollKind::Reduce, op, root, r.len, r, r)
    }

    /// Concatenate every rank's `send` (in rank order) into every rank's `recv`
    /// (`recv.len() == send.len() * world_size`).
    pub fn all_gather<T: Element, S: Buffer<T> + ?Sized, R: BufferMut<T> + ?Sized>(
        &mut self,
        send: &S,
        recv: &mut R,
    ) -> Result<(), CommError> {
        let (s, r) = (send.raw(), recv.raw_mut());
        let n = self.world_size();
        if r.len != s.len * n {
            return self.reject_err::<T>(self.invalid(
                CollKind::AllGather,
                format!("recv has {} elements but must have send.len() × world_size = {} × {n} = {}", r.len, s.len, s.len * n),
            ));
        }
        self.call::<T>(CollKind::AllGather, ReduceOp::Sum, 0, s.len, s, r)
    }

    /// In-place all-gather: this rank's contribution is already at `buf[rank*c..(rank+1)*c]` with
    /// `c = buf.len() / world_size`.
    pub fn all_gather_in_place<T: Element, B: BufferMut<T> + ?Sized>(&mut self, buf: &mut B) -> Result<(), CommError> {
        let r = buf.raw_mut();
        let n = self.world_size();
        if r.len % n != 0 {
            return self.reject_err::<T>(
                self.invalid(CollKind::AllGather, format!("in-place buffer has {} elements, not a multiple of world size {n}", r.len)),
            );
        }
        let c = r.len / n;
        let s = RawMem { addr: r.addr + self.rank() * c * std::mem::size_of::<T>(), len: c, space: r.space };
        self.call::<T>(CollKind::AllGather, ReduceOp::Sum, 0, c, s, r)
    }

    /// Concatenate every rank's `send` into `recv` on `root` (`send.len() * world_size` elements
    /// there; other ranks' `recv` is not touched).
    pub fn gather<T: Element, S: Buffer<T> + ?Sized, R: BufferMut<T> + ?Sized>(
        &mut self,
        send: &S,
        recv: &mut R,
        root: usize,
    ) -> Result<(), CommError> {
        if let Err(e) = self.check_root(CollKind::Gather, root) {
            return self.rejected::<T>(CollKind::Gather, e);
        }
        let (s, r) = (send.raw(), recv.raw_mut());
        let n = self.world_size();
        if self.rank() == root && r.len != s.len * n {
            return self.reject_err::<T>(self.invalid(
                CollKind::Gather,
                format!("recv on the root has {} elements but must have send.len() × world_size = {}", r.len, s.len * n),
            ));
        }
        self.call::<T>(CollKind::Gather, ReduceOp::Sum, root, s.len, s, r)
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
        let n = self.world_size();
        if s.len != r.len * n {
            return self.reject_err::<T>(self.invalid(
                CollKind::ReduceScatter,
                format!("send has {} elements but must have recv.len() × world_size = {} × {n} = {}", s.len, r.len, r.len * n),
            ));
        }
        self.call::<T>(CollKind::ReduceScatter, op, 0, r.len, s, r)
    }

    /// In-place reduce-scatter: the result block lands at `buf[rank*c..(rank+1)*c]`,
    /// `c = buf.len() / world_size`.
    pub fn reduce_scatter_in_place<T: Element, B: BufferMut<T> + ?Sized>(&mut self, buf: &mut B, op: ReduceOp) -> Result<(), CommError> {
        let s = buf.raw_mut();
        let n = self.world_size();
        if s.len % n != 0 {
            return self.reject_err::<T>(
                self.invalid(CollKind::ReduceScatter, format!("in-place buffer has {} elements, not a multiple of world size {n}", s.len)),
            );
        }
        let c = s.len / n;
        let r = RawMem { addr: s.addr + self.rank() * c * std::mem::size_of::<T>(), len: c, space: s.space };
        self.call::<T>(CollKind::ReduceScatter, op, 0, c, s, r)
    }

    /// Wait until every rank has reached this call.
    pub fn barrier(&mut self) -> Result<(), CommError> {
        let empty = RawMem { addr: 0, len: 0, space: MemSpace::Host };
        self.call::<u8>(CollKind::Barrier, ReduceOp::Sum, 0, 0, empty, empty)
    }
}
