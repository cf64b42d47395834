//! Several ranks on one GPU: collectives on device buffers through a host backend.
//!
//! NCCL (before 2.30) refuses two ranks of one communicator on the same GPU. When ranks outnumber
//! GPUs (or a lone rank finds no NCCL), [`StagedBackend`] wraps the shared-memory communicator: each call copies the device
//! buffers into page-locked staging memory (D2H), runs the host collective there, and copies the
//! result back (H2D) on the ranks that receive one. It is slower than NCCL (two PCIe copies per
//! call) but correct for every collective, op and dtype the host backend supports.
//!
//! In-place calls stay in place: when one buffer lies inside the other (all-gather and
//! reduce-scatter in place), one staging region is used and the inner buffer maps to its offset.

use std::sync::Arc;
use std::time::Duration;

use crate::comm::{Backend, BackendKind, Call, CommError, Communicator, P2pOp};
use crate::cuda::{
    Context, CudaError, ForeignStream, PinnedBuffer, Producers, Stream, StreamFence,
};
use crate::types::{CollKind, Dtype, MemSpace, RawMem};

/// What went wrong in a staged call: the host collective (its error is passed on unchanged, so
/// `Mismatch`, `PeerLost`, `Timeout` keep their kind) or a CUDA copy around it.
enum StageError {
    Comm(CommError),
    Cuda(CudaError),
}

impl From<CudaError> for StageError {
    fn from(e: CudaError) -> StageError {
        StageError::Cuda(e)
    }
}

/// A host-backend communicator that accepts device buffers by staging them through pinned memory.
pub struct StagedBackend {
    ctx: Arc<Context>,
    stream: Stream,
    inner: Communicator,
    /// Staging for the outer (or receive) region and, when disjoint, the send region.
    stage_a: PinnedBuffer<u8>,
    stage_b: PinnedBuffer<u8>,
    /// Orders the staging copies after the context's other streams (see [`Producers`]).
    producers: Producers,
    /// Orders the staging stream with a caller's (`wait_stream`, `signal_stream`).
    fence: StreamFence,
}

impl StagedBackend {
    /// Wrap `inner` (typically the launcher's shm communicator) for device buffers on `ctx`.
    pub fn new(ctx: &Arc<Context>, inner: Communicator) -> Result<StagedBackend, CudaError> {
        let gpu = ctx.ordinal();
        let why = if inner.world_size() > 1 {
            format!("shares GPU {gpu} with other ranks")
        } else {
            format!("is alone on GPU {gpu}, without NCCL")
        };
        tracing::info!(
            rank = inner.rank(),
            gpu,
            "rank {} {why}: device collectives go through the {} backend, staged via pinned host memory",
            inner.rank(),
            inner.backend_kind()
        );
        Ok(StagedBackend {
            stream: ctx.stream()?,
            ctx: ctx.clone(),
            inner,
            stage_a: PinnedBuffer::zeros(ctx, 0)?,
            stage_b: PinnedBuffer::zeros(ctx, 0)?,
            producers: Producers::new(ctx),
            fence: StreamFence::new(ctx)?,
        })
    }

    /// Wrap in a [`Communicator`].
    pub fn into_communicator(self) -> Communicator {
        Communicator::from_backend(Box::new(self))
    }

    fn ensure(
        ctx: &Arc<Context>,
        buf: &mut PinnedBuffer<u8>,
        bytes: usize,
    ) -> Result<(), CudaError> {
        if buf.len() < bytes {
            *buf = PinnedBuffer::zeros(ctx, bytes.next_power_of_two())?;
        }
        Ok(())
    }

    fn cuda_err(&self, call: &Call, e: CudaError) -> CommError {
        CommError::Backend {
            backend: "staged",
            message: format!("{} on rank {}: {e}", call.kind, self.inner.rank()),
        }
    }

    fn staged(&mut self, call: &Call) -> Result<(), StageError> {
        let sz = call.dtype.size();
        let (s, r) = (call.send, call.recv);
        let (sb, rb) = (s.len * sz, r.len * sz);
        let within = |inner: RawMem, ib: usize, outer: RawMem, ob: usize| {
            inner.addr >= outer.addr && inner.addr + ib <= outer.addr + ob
        };
        self.ctx.bind()?;
        self.producers.order(&self.stream)?;
        // Which region is staged where: one region when one buffer contains the other.
        let (host_send, host_recv);
        if rb > 0 && sb > 0 && within(s, sb, r, rb) {
            Self::ensure(&self.ctx, &mut self.stage_a, rb)?;
            self.d2h(r.addr, 0, rb)?;
            host_recv = self.stage_a.as_ptr() as usize;
            host_send = host_recv + (s.addr - r.addr);
        } else if rb > 0 && sb > 0 && within(r, rb, s, sb) {
            Self::ensure(&self.ctx, &mut self.stage_a, sb)?;
            self.d2h(s.addr, 0, sb)?;
            host_send = self.stage_a.as_ptr() as usize;
            host_recv = host_send + (r.addr - s.addr);
        } else {
            Self::ensure(&self.ctx, &mut self.stage_a, rb)?;
            Self::ensure(&self.ctx, &mut self.stage_b, sb)?;
            if sb > 0 {
                self.d2h_b(s.addr, sb)?;
            }
            host_send = self.stage_b.as_ptr() as usize;
            host_recv = self.stage_a.as_ptr() as usize;
        }
        self.stream.synchronize()?;
        let host_call = Call {
            send: RawMem {
                addr: host_send,
                len: s.len,
                space: MemSpace::Host,
            },
            recv: RawMem {
                addr: host_recv,
                len: r.len,
                space: MemSpace::Host,
            },
            ..*call
        };
        self.inner
            .run_checked(&host_call)
            .map_err(StageError::Comm)?;
        // Copy back only where the collective wrote: every rank, or the root for reduce/gather.
        let writes = match call.kind {
            CollKind::Reduce | CollKind::Gather | CollKind::GatherV => {
                self.inner.rank() == call.root
            }
            CollKind::Barrier => false,
            _ => true,
        };
        if writes && rb > 0 {
            // SAFETY: `r` is a device range of `rb` bytes on this context (checked by `run`);
            // `host_recv` points into a live pinned staging buffer of at least `rb` bytes.
            unsafe {
                self.stream
                    .memcpy_htod_raw(r.addr as u64, host_recv as *const u8, rb)?
            };
            self.stream.synchronize()?;
        }
        Ok(())
    }

    /// A group of sends and receives: device buffers are staged through one pinned region (sends
    /// copied in before, receives copied out after the host group), host buffers pass as they are.
    fn staged_p2p(&mut self, ops: &mut [P2pOp]) -> Result<(), StageError> {
        let on_device = |op: &P2pOp| op.mem.len > 0 && op.mem.space != MemSpace::Host;
        let mut offsets = Vec::with_capacity(ops.len());
        let mut total = 0usize;
        for op in ops.iter() {
            offsets.push(total);
            if on_device(op) {
                // Keep every block 64-byte aligned for the host backend's copies.
                total += (op.mem.len * op.dtype.size()).next_multiple_of(64);
            }
        }
        self.ctx.bind()?;
        self.producers.order(&self.stream)?;
        Self::ensure(&self.ctx, &mut self.stage_a, total)?;
        let base = self.stage_a.as_mut_ptr() as usize;
        let mut host_ops = Vec::with_capacity(ops.len());
        for (op, off) in ops.iter().zip(&offsets) {
            if !on_device(op) {
                host_ops.push(*op);
                continue;
            }
            if op.kind == CollKind::Send {
                self.d2h(op.mem.addr, *off, op.mem.len * op.dtype.size())?;
            }
            host_ops.push(P2pOp {
                mem: RawMem {
                    addr: base + off,
                    len: op.mem.len,
                    space: MemSpace::Host,
                },
                ..*op
            });
        }
        self.stream.synchronize()?;
        let r = self.inner.p2p_checked(&mut host_ops);
        // Receives from any source: the host backend named their senders.
        for (op, h) in ops.iter_mut().zip(&host_ops) {
            op.peer = h.peer;
        }
        r.map_err(StageError::Comm)?;
        for (op, off) in ops.iter().zip(&offsets) {
            if on_device(op) && op.kind == CollKind::Recv {
                // SAFETY: `op.mem` is a device range of this context (checked by `p2p`); the
                // staging block at `off` holds its `len × size` bytes.
                unsafe {
                    self.stream.memcpy_htod_raw(
                        op.mem.addr as u64,
                        (base + off) as *const u8,
                        op.mem.len * op.dtype.size(),
                    )?
                };
            }
        }
        self.stream.synchronize()?;
        Ok(())
    }

    fn d2h(&mut self, src: usize, offset: usize, bytes: usize) -> Result<(), CudaError> {
        // SAFETY: `src` is a device range of `bytes` bytes on this context; `stage_a` holds at
        // least `offset + bytes` bytes and is not touched until the stream is synchronized.
        unsafe {
            self.stream
                .memcpy_dtoh_raw(self.stage_a.as_mut_ptr().add(offset), src as u64, bytes)
        }
    }

    fn d2h_b(&mut self, src: usize, bytes: usize) -> Result<(), CudaError> {
        // SAFETY: as in `d2h`, for `stage_b`.
        unsafe {
            self.stream
                .memcpy_dtoh_raw(self.stage_b.as_mut_ptr(), src as u64, bytes)
        }
    }
}

impl Backend for StagedBackend {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn kind(&self) -> BackendKind {
        BackendKind::Staged
    }

    fn describe(&self) -> String {
        // The host communicator logged its own line when it was made.
        format!(
            "device {} staged through host backend {}",
            self.ctx.ordinal(),
            self.inner.backend_kind()
        )
    }

    fn device(&self) -> Option<Arc<Context>> {
        Some(self.ctx.clone())
    }

    fn run(&mut self, call: &Call) -> Result<(), CommError> {
        let dev = [call.send, call.recv]
            .iter()
            .filter(|m| m.len > 0)
            .find_map(|m| match m.space {
                MemSpace::Device(d) => Some(d),
                MemSpace::Host => None,
            });
        let Some(dev) = dev else {
            // Host buffers: straight to the host backend.
            return self.inner.run_checked(call);
        };
        if dev != self.ctx.ordinal() {
            return Err(CommError::InvalidArgument {
                op: call.kind,
                rank: self.inner.rank(),
                detail: format!(
                    "buffer is on device {dev} but this rank stages through device {}",
                    self.ctx.ordinal()
                ),
            });
        }
        self.staged(call).map_err(|e| match e {
            StageError::Comm(e) => e,
            StageError::Cuda(e) => self.cuda_err(call, e),
        })
    }

    fn p2p(&mut self, ops: &mut [P2pOp]) -> Result<(), CommError> {
        let wrong = ops.iter().find(|op| {
            op.mem.len > 0 && matches!(op.mem.space, MemSpace::Device(d) if d != self.ctx.ordinal())
        });
        if let Some(op) = wrong {
            return Err(CommError::InvalidArgument {
                op: op.kind,
                rank: self.inner.rank(),
                detail: format!(
                    "buffer is on {:?} but this rank stages through device {}",
                    op.mem.space,
                    self.ctx.ordinal()
                ),
            });
        }
        self.staged_p2p(ops).map_err(|e| match e {
            StageError::Comm(e) => e,
            StageError::Cuda(e) => CommError::Backend {
                backend: "staged",
                message: format!("send/recv on rank {}: {e}", self.inner.rank()),
            },
        })
    }

    fn reject(&mut self, kind: CollKind, dtype: Dtype, reason: &CommError) {
        // The host backend carries the refusal to the peers, whose matching call then fails
        // with `Mismatch` instead of waiting for this rank until it times out or exits.
        self.inner.reject_call(kind, dtype, reason);
    }

    fn last_path(&self) -> crate::trace::CallPath {
        crate::trace::CallPath::Staged
    }

    fn synchronize(&mut self) -> Result<(), CommError> {
        self.inner.synchronize()?;
        self.stream.synchronize().map_err(|e| CommError::Backend {
            backend: "staged",
            message: e.to_string(),
        })
    }

    fn seq(&self) -> u64 {
        self.inner.seq()
    }

    // The waits are the host communicator's: so is the timeout.
    fn timeout(&self) -> Option<std::time::Duration> {
        self.inner.timeout()
    }

    fn set_timeout(&mut self, timeout: std::time::Duration) -> Result<(), CommError> {
        self.inner.set_timeout(timeout)
    }

    // The staged data is reduced by the host communicator's kernels: so is it checked.
    fn check_finite(&self) -> bool {
        self.inner.check_finite()
    }

    fn set_check_finite(&mut self, on: bool) -> Result<(), CommError> {
        self.inner.set_check_finite(on)
    }

    // The staging copies run on the staging stream, and the host waits for that stream (not the
    // device) before the host collective reads the staged data: ordering the staging stream with
    // the caller's is all a call needs.
    fn wait_stream(&mut self, caller: &ForeignStream) -> Result<(), CommError> {
        self.fence
            .enter(caller, &self.stream)
            .map_err(|e| CommError::Backend {
                backend: "staged",
                message: e.to_string(),
            })
    }

    fn signal_stream(&mut self, caller: &ForeignStream) -> Result<(), CommError> {
        self.fence
            .leave(&self.stream, caller)
            .map_err(|e| CommError::Backend {
                backend: "staged",
                message: e.to_string(),
            })
    }

    fn split(
        &mut self,
        color: Option<u32>,
        key: i64,
    ) -> Result<Option<Box<dyn Backend>>, CommError> {
        // The host communicator splits; the sub-communicator stages through the same device.
        let Some(inner) = self.inner.split(color, key)? else {
            return Ok(None);
        };
        let rank = inner.global_rank();
        let child = StagedBackend::new(&self.ctx, inner).map_err(|e| CommError::Backend {
            backend: "staged",
            message: format!(
                "split on rank {rank}: setting up the sub-communicator's staging on device {}: {e}",
                self.ctx.ordinal()
            ),
        })?;
        Ok(Some(Box::new(child)))
    }

    fn shrink(&mut self, exclude: &[usize], wait: Duration) -> Result<Box<dyn Backend>, CommError> {
        // The host communicator agrees on the members; the new one stages through the same device.
        let inner = self.inner.shrink_excluding(exclude, wait)?;
        self.successor("shrink", inner)
    }

    fn grow(&mut self, wait: Option<Duration>) -> Result<Box<dyn Backend>, CommError> {
        let inner = match wait {
            Some(w) => self.inner.grow_within(w)?,
            None => self.inner.grow()?,
        };
        self.successor("grow", inner)
    }

    fn global_ranks(&self) -> Option<Vec<usize>> {
        self.inner
            .is_sub_communicator()
            .then(|| self.inner.global_ranks())
    }

    fn peer_check(&self) -> Option<crate::comm::PeerCheck> {
        self.inner.peer_check()
    }
}

impl StagedBackend {
    /// The staged communicator over `inner`, the host communicator a shrink or grow made.
    fn successor(&self, verb: &str, inner: Communicator) -> Result<Box<dyn Backend>, CommError> {
        let rank = inner.global_rank();
        let next = StagedBackend::new(&self.ctx, inner).map_err(|e| CommError::Backend {
            backend: "staged",
            message: format!(
                "{verb} on rank {rank}: setting up the new communicator's staging on device {}: {e}",
                self.ctx.ordinal()
            ),
        })?;
        Ok(Box::new(next))
    }
}
