//! Composites: the collectives NCCL has no native form of (gather, scatter, all-to-all and the
//! v-variants), built from `ncclSend`/`ncclRecv` in one group, as `ncclAllToAll` examples and
//! PyTorch's ProcessGroupNCCL build them; this rank's own block is a device-to-device copy.
//!
//! Separate from the native calls because here lockstep, not NCCL, decides the data layout: which
//! block goes to which peer ([`exchange_plan`]).

use crate::comm::{Call, CollKind};

use super::comm::NcclComm;
use super::error::{invalid_arg, NcclError};

impl NcclComm {
    /// Gather as grouped send/recv: every rank sends to the root; the root receives each peer's
    /// block and copies its own block locally.
    pub(super) fn gather(&mut self, call: &Call) -> Result<(), NcclError> {
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
    pub(super) fn exchange(&mut self, call: &Call) -> Result<(), NcclError> {
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
}
