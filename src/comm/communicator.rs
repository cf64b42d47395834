//! [`Communicator`]: the typed collective methods every backend runs behind.
//!
//! Each method checks its buffers locally (lengths, root, memory space), builds a type-erased
//! [`Call`] and hands it to the backend. A call refused locally is also reported to the peers
//! through [`Backend::reject`], so they fail with a mismatch instead of pairing this rank's next
//! call with their current one.

use std::fmt;
use std::sync::Arc;

use super::backend::{Backend, BackendKind, Call};
use super::error::CommError;
use super::shared::SharedBuffer;
use crate::cuda::Context;
use crate::types::{Buffer, BufferMut, CollKind, Dtype, Element, MemSpace, RawMem, ReduceOp};

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
    pub fn device_context(&self) -> Option<Arc<Context>> {
        self.backend.device()
    }

    /// Wait for every call issued so far (a no-op on host backends, which complete each call).
    pub fn synchronize(&mut self) -> Result<(), CommError> {
        self.backend.synchronize()
    }

    /// Allocate a buffer of `len` elements (zeroed) inside the backend's shared segment. Collectives
    /// whose buffers are all shared on every rank skip the staging copies (the analog of NCCL's
    /// registered buffers).
    pub fn alloc_shared<T: Element>(&mut self, len: usize) -> Result<SharedBuffer<T>, CommError> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| CommError::Unsupported(format!("alloc_shared: {len} elements overflow")))?;
        let alloc = self.backend.alloc_shared(bytes)?;
        Ok(SharedBuffer::new(alloc, len))
    }

    /// Run an already-checked call on the backend. For layered backends (staging wraps a host
    /// communicator): the outer backend checked the call, so the inner one runs it as is.
    pub(crate) fn run_checked(&mut self, call: &Call) -> Result<(), CommError> {
        self.backend.run(call)
    }

    /// Tell the peers that this rank refused a call locally (see [`Backend::reject`]).
    pub(crate) fn reject_call(&mut self, kind: CollKind, dtype: Dtype, reason: &CommError) {
        self.backend.reject(kind, dtype, reason);
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
