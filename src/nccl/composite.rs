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
                        me.p2p_raw(CollKind::Recv, dst, count, dtype, peer)?;
                    }
                }
            } else {
                me.p2p_raw(CollKind::Send, send.addr, count, dtype, root)?;
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
    // One block per peer in the buffer at `base`: `place(p)` is its (displacement, count).
    let per_peer = |base: usize, place: &dyn Fn(usize) -> (usize, usize)| -> Vec<Block> {
        (0..world)
            .map(|peer| {
                let (displ, count) = place(peer);
                Block {
                    peer,
                    addr: base + displ * size,
                    count,
                }
            })
            .collect()
    };
    let even = |p: usize| (p * c, c);
    let sent_v = |p: usize| (sp.send_displs[p], sp.send_counts[p]);
    let received_v = |p: usize| (sp.recv_displs[p], sp.recv_counts[p]);
    // The root's side of a rooted collective: every peer's block there, nothing elsewhere.
    let at_root = |base: usize, place: &dyn Fn(usize) -> (usize, usize)| {
        if rank == call.root {
            per_peer(base, place)
        } else {
            vec![]
        }
    };
    // The other side: one block of `count` to or from the root.
    let with_root = |addr: usize| {
        vec![Block {
            peer: call.root,
            addr,
            count: c,
        }]
    };
    match call.kind {
        CollKind::AllToAll => (per_peer(send, &even), per_peer(recv, &even)),
        CollKind::AllToAllV => (per_peer(send, &sent_v), per_peer(recv, &received_v)),
        CollKind::Scatter => (at_root(send, &even), with_root(recv)),
        CollKind::AllGatherV => (per_peer(send, &|_| (0, c)), per_peer(recv, &received_v)),
        CollKind::GatherV => (with_root(send), at_root(recv, &received_v)),
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
                me.p2p_raw(CollKind::Send, b.addr, b.count, dtype, b.peer)?;
            }
            for b in recvs.iter().filter(|b| b.peer != rank && b.count > 0) {
                me.p2p_raw(CollKind::Recv, b.addr, b.count, dtype, b.peer)?;
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::Splits;
    use crate::types::{Dtype, MemSpace, RawMem, ReduceOp};

    fn mem(addr: usize) -> RawMem {
        RawMem {
            addr,
            len: 64,
            space: MemSpace::Device(0),
        }
    }

    /// `(peer, byte offset from its buffer, count)` of each block.
    fn blocks(b: &[Block], base: usize) -> Vec<(usize, usize, usize)> {
        b.iter().map(|b| (b.peer, b.addr - base, b.count)).collect()
    }

    #[test]
    fn exchange_plans_place_every_peer_block() {
        let (send, recv) = (1000, 5000);
        let (counts, displs) = ([2, 0, 3], [0, 2, 2]);
        let (rcounts, rdispls) = ([1, 4, 2], [5, 0, 9]);
        let splits = Splits {
            send_counts: &counts,
            send_displs: &displs,
            recv_counts: &rcounts,
            recv_displs: &rdispls,
        };
        let plan = |kind, rank| {
            let call = Call {
                kind,
                dtype: Dtype::F32,
                op: ReduceOp::Sum,
                root: 1,
                count: 3,
                send: mem(send),
                recv: mem(recv),
                splits,
            };
            let (s, r) = exchange_plan(&call, rank, 3);
            (blocks(&s, send), blocks(&r, recv))
        };
        let even = vec![(0, 0, 3), (1, 12, 3), (2, 24, 3)];
        assert_eq!(plan(CollKind::AllToAll, 0), (even.clone(), even.clone()));
        assert_eq!(
            plan(CollKind::AllToAllV, 2),
            (
                vec![(0, 0, 2), (1, 8, 0), (2, 8, 3)],
                vec![(0, 20, 1), (1, 0, 4), (2, 36, 2)]
            )
        );
        assert_eq!(plan(CollKind::Scatter, 1), (even.clone(), vec![(1, 0, 3)]));
        assert_eq!(plan(CollKind::Scatter, 0), (vec![], vec![(1, 0, 3)]));
        let vrecv = vec![(0, 20, 1), (1, 0, 4), (2, 36, 2)];
        assert_eq!(
            plan(CollKind::AllGatherV, 0),
            (vec![(0, 0, 3), (1, 0, 3), (2, 0, 3)], vrecv.clone())
        );
        assert_eq!(plan(CollKind::GatherV, 1), (vec![(1, 0, 3)], vrecv));
        assert_eq!(plan(CollKind::GatherV, 2), (vec![(1, 0, 3)], vec![]));
        assert_eq!(plan(CollKind::AllReduce, 0), (vec![], vec![]));
    }
}
