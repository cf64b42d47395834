//! Argument checks of the NCCL communicator: every buffer, size, peer and root is checked before
//! anything is enqueued, so a wrong argument is an error naming it rather than an NCCL failure
//! (or a hang) later.
//!
//! Separate from the calls because they are the communicator's contract with its callers: what
//! each collective needs of its buffers on this backend (device memory of this device). The
//! per-kind rules (root, buffer sizes for a count) are the shared table's, [`crate::comm::check`];
//! what is NCCL's own here is the memory: device buffers of this communicator's device.

use crate::comm::{check, Call, CommError, MemSpace, P2pOp, ANY_SOURCE};

use super::comm::NcclComm;
use super::error::{invalid_arg, NcclError};

impl NcclComm {
    pub(super) fn check_peer(&self, peer: usize, op: &str) -> Result<(), NcclError> {
        if peer >= self.world {
            return Err(invalid_arg(format!(
                "{op}: peer {peer} out of range for world size {}",
                self.world
            )));
        }
        Ok(())
    }

    pub(super) fn check_device(&self, dev: i32, op: &str) -> Result<(), NcclError> {
        if dev != self.ctx.ordinal() {
            return Err(invalid_arg(format!(
                "{op}: buffer is on device {dev} but the communicator on device {}",
                self.ctx.ordinal()
            )));
        }
        Ok(())
    }

    /// Check a call's buffers before enqueueing: device buffers of this device, sizes, root.
    pub(super) fn check_call(&self, call: &Call) -> Result<(), CommError> {
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
        if call.kind.has_root() {
            check::root(call.root, self.world).map_err(invalid)?;
        }
        // The buffer sizes of the shared table (the communicator checked every block of the
        // v-variants' per-rank counts against its buffer, so they need nothing more here).
        let need = if call.kind.is_v() {
            Some(check::Need { send: 0, recv: 0 })
        } else {
            check::need(call.kind, call.count, self.world, self.rank, call.root)
        };
        let Some(check::Need {
            send: need_send,
            recv: need_recv,
        }) = need
        else {
            return Err(if call.kind.is_p2p() {
                CommError::Unsupported(format!(
                    "{} is not a collective: the nccl backend runs it through p2p",
                    call.kind
                ))
            } else {
                invalid(format!(
                    "count {} × world size {} overflows",
                    call.count, self.world
                ))
            });
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

    /// Check the buffers of a point-to-point group: device memory of this device.
    pub(super) fn check_p2p(&self, ops: &[P2pOp]) -> Result<(), CommError> {
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
