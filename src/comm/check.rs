//! The argument rules of every call, in one table (NCCL's `argcheck.cc`/`enqueue.cc` is the
//! model): for each [`CollKind`], how many elements the send and receive buffers hold for a count
//! at a world size, which rank reads or writes which buffer, which root and peer are valid, and
//! which in-place form the call has.
//!
//! Every entry point applies them: [`Communicator::run`](super::Communicator::run) (which the
//! typed methods, the Python package and the C ABI go through) checks a whole [`Call`] with
//! `call`; the NCCL backend sizes its device buffers with [`need`]; the C ABI sizes the buffers
//! behind NCCL-style pointers with [`need`]; the shared-memory fast path sizes its payloads with
//! [`need`]. Every [`ReduceOp`](crate::types::ReduceOp) applies to every
//! [`Dtype`](crate::types::Dtype) (`Avg` divides integers as `ncclAvg` does), so no rule pairs them.
//!
//! The messages are the ones the typed methods have always given: a [`Call`] built from typed
//! buffers fails with the same text whichever entry it came through.

use super::backend::{P2pOp, ANY_SOURCE};
use super::call::Call;
use crate::types::{CollKind, RawMem};

/// How many elements a rank's buffers hold for one call (see [`need`]): what it reads from
/// `send` and writes into `recv`. Zero for a buffer the rank does not use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Need {
    /// Elements read from the send buffer.
    pub send: usize,
    /// Elements written into the receive buffer.
    pub recv: usize,
}

/// The elements rank `rank` of `world` reads and writes in a `kind` call of `count` (the count as
/// [`Call::count`] defines it) with root `root`: NCCL's buffer sizes. `None` when the sizes
/// overflow, and for the kinds whose sizes are not a function of the count: the v-variants (their
/// [`Splits`](super::Splits) say) and point-to-point (one buffer of its own length).
///
/// | kind | send | recv |
/// |---|---|---|
/// | all_reduce | count | count |
/// | broadcast | count on the root, else 0 | count |
/// | reduce | count | count on the root, else 0 |
/// | all_gather | count | count × world |
/// | gather | count | count × world on the root, else 0 |
/// | reduce_scatter | count × world | count |
/// | all_to_all | count × world | count × world |
/// | scatter | count × world on the root, else 0 | count |
/// | barrier | 0 | 0 |
pub fn need(kind: CollKind, count: usize, world: usize, rank: usize, root: usize) -> Option<Need> {
    let all = || count.checked_mul(world);
    let (send_used, recv_used) = uses(kind, rank, root);
    let (send, recv) = match kind {
        CollKind::AllReduce | CollKind::Broadcast | CollKind::Reduce => (count, count),
        CollKind::AllGather | CollKind::Gather => (count, all()?),
        CollKind::ReduceScatter | CollKind::Scatter => (all()?, count),
        CollKind::AllToAll => (all()?, all()?),
        CollKind::Barrier => (0, 0),
        _ => return None,
    };
    Some(Need {
        send: if send_used { send } else { 0 },
        recv: if recv_used { recv } else { 0 },
    })
}

/// Whether rank `rank` reads its send buffer and writes its receive buffer in a `kind` call with
/// root `root` (the rooted calls leave one of them alone on the other ranks).
pub const fn uses(kind: CollKind, rank: usize, root: usize) -> (bool, bool) {
    let at_root = rank == root;
    match kind {
        CollKind::Broadcast | CollKind::Scatter => (at_root, true),
        CollKind::Reduce | CollKind::Gather | CollKind::GatherV => (true, at_root),
        CollKind::Barrier => (false, false),
        _ => (true, true),
    }
}

/// The in-place form of a collective: how its send and receive buffers share memory when the
/// call works in place (NCCL's convention). Any other overlap of the two is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum InPlace {
    /// `send` and `recv` are the same buffer (all_reduce, broadcast, reduce).
    Same,
    /// `send` is block `rank` of `recv`, `count` elements at `rank × count` (all_gather; gather on
    /// the root).
    SendIsOwnBlock,
    /// `recv` is block `rank` of `send` (reduce_scatter; scatter on the root).
    RecvIsOwnBlock,
    /// No in-place form (all_to_all and the v-variants, barrier, point-to-point).
    None,
}

/// The in-place form of `kind`.
pub const fn in_place(kind: CollKind) -> InPlace {
    match kind {
        CollKind::AllReduce | CollKind::Broadcast | CollKind::Reduce => InPlace::Same,
        CollKind::AllGather | CollKind::Gather => InPlace::SendIsOwnBlock,
        CollKind::ReduceScatter | CollKind::Scatter => InPlace::RecvIsOwnBlock,
        _ => InPlace::None,
    }
}

/// The count of a `kind` call on buffers of `send_len` and `recv_len` elements at `world` ranks,
/// as the typed methods derive it: the length of the buffer every rank passes (send, or recv for
/// broadcast, reduce_scatter and scatter; a block of send for all_to_all; this rank's send for the
/// v-variants), 0 for barrier.
pub fn count_of(kind: CollKind, send_len: usize, recv_len: usize, world: usize) -> usize {
    match kind {
        CollKind::Broadcast | CollKind::ReduceScatter | CollKind::Scatter => recv_len,
        CollKind::AllToAll => send_len / world.max(1),
        CollKind::Barrier => 0,
        _ => send_len,
    }
}

/// A root must be a rank of the communicator.
pub fn root(root: usize, world: usize) -> Result<(), String> {
    if root >= world {
        return Err(format!(
            "root {root} is out of range for world size {world}"
        ));
    }
    Ok(())
}

/// A peer must be a rank of the communicator.
pub fn peer(peer: usize, world: usize) -> Result<(), String> {
    if peer >= world {
        return Err(format!(
            "peer {peer} is out of range for world size {world}"
        ));
    }
    Ok(())
}

/// `a × n` for a message (saturating: only absurd lengths overflow, and they are refused anyway).
fn times(a: usize, n: usize) -> usize {
    a.saturating_mul(n)
}

/// The local checks of a collective (every rule above, with the messages of the typed methods),
/// for rank `rank` of `world`. `Err` holds what is wrong and what was expected, for a
/// [`CommError::InvalidArgument`](super::CommError::InvalidArgument). `Ok(Some(displs))`: the
/// call is an `all_gather_v`/`gather_v` receive without displacements, whose packed ones
/// (prefix sums of the counts) are `displs`.
pub(crate) fn call(call: &Call, rank: usize, world: usize) -> Result<Option<Vec<usize>>, String> {
    let (k, s, r, n, me) = (call.kind, call.send, call.recv, world, rank);
    if k.is_p2p() {
        return Err(format!(
            "{k} is point-to-point, not a collective: run it with run_p2p (or send/recv)"
        ));
    }
    if k.has_root() {
        root(call.root, n)?;
    }
    let at_root = me == call.root;
    let mut displs = None;
    match k {
        CollKind::AllReduce if s.len != r.len => return Err(equal(s.len, r.len)),
        // Off the root, the send buffer is not read: it may be empty.
        CollKind::Broadcast if (at_root || s.len != 0) && s.len != r.len => {
            return Err(equal(s.len, r.len))
        }
        CollKind::Reduce if at_root && s.len != r.len => {
            return Err(format!(
                "send has {} elements but recv on the root has {}; they must be equal",
                s.len, r.len
            ))
        }
        CollKind::AllGather if s.len.checked_mul(n) != Some(r.len) => {
            return Err(format!(
                "recv has {} elements but must have send.len() × world_size = {} × {n} = {}",
                r.len,
                s.len,
                times(s.len, n)
            ))
        }
        CollKind::Gather if at_root && s.len.checked_mul(n) != Some(r.len) => {
            return Err(format!(
                "recv on the root has {} elements but must have send.len() × world_size = {}",
                r.len,
                times(s.len, n)
            ))
        }
        CollKind::ReduceScatter if r.len.checked_mul(n) != Some(s.len) => {
            return Err(format!(
                "send has {} elements but must have recv.len() × world_size = {} × {n} = {}",
                s.len,
                r.len,
                times(r.len, n)
            ))
        }
        CollKind::AllToAll if s.len != r.len || !s.len.is_multiple_of(n) => {
            return Err(format!("send has {} elements and recv {}; they must be equal and a multiple of world size {n}", s.len, r.len))
        }
        CollKind::Scatter if at_root && r.len.checked_mul(n) != Some(s.len) => {
            return Err(format!("send on the root has {} elements but must have recv.len() × world_size = {} × {n} = {}", s.len, r.len, times(r.len, n)))
        }
        CollKind::AllToAllV => {
            let sp = &call.splits;
            splits("send", sp.send_counts, sp.send_displs, s.len, n)?;
            splits("recv", sp.recv_counts, sp.recv_displs, r.len, n)?;
        }
        CollKind::AllGatherV | CollKind::GatherV if uses(k, me, call.root).1 => {
            displs = gather_v(call, me, n)?;
        }
        _ => {}
    }
    let count = count_of(k, s.len, r.len, n);
    if !k.is_v() && call.count != count {
        return Err(format!(
            "count is {} but the buffers (send {} elements, recv {}) hold a call of count {count}; pass that count, or buffers of the count's size",
            call.count, s.len, r.len
        ));
    }
    memory(call, me)?;
    Ok(displs)
}

fn equal(s: usize, r: usize) -> String {
    format!("send has {s} elements but recv has {r}; they must be equal")
}

/// `counts`/`displs` have one entry per rank and every block lies in a buffer of `len` elements;
/// `what` names them ("send" or "recv").
fn splits(
    what: &str,
    counts: &[usize],
    displs: &[usize],
    len: usize,
    n: usize,
) -> Result<(), String> {
    if counts.len() != n || displs.len() != n {
        return Err(format!(
            "{what}_counts has {} entries and {what}_displs {}; both need one per rank ({n})",
            counts.len(),
            displs.len()
        ));
    }
    for r in 0..n {
        if displs[r].checked_add(counts[r]).is_none_or(|end| end > len) {
            return Err(format!(
                "the {what} block of rank {r} ({what}_displs[{r}] = {} + {what}_counts[{r}] = {}) ends past the {what} buffer ({len} elements)",
                displs[r], counts[r]
            ));
        }
    }
    Ok(())
}

/// A receiving rank of `all_gather_v`/`gather_v`: one count per rank, this rank's equal to its
/// send, the counts adding up to the receive buffer, and the blocks packed in rank order.
/// Returns the packed displacements when the call has none.
fn gather_v(call: &Call, me: usize, n: usize) -> Result<Option<Vec<usize>>, String> {
    let (counts, given) = (call.splits.recv_counts, call.splits.recv_displs);
    if counts.len() != n {
        return Err(format!(
            "recv_counts has {} entries; it needs one per rank ({n})",
            counts.len()
        ));
    }
    if counts[me] != call.send.len {
        return Err(format!(
            "recv_counts[{me}] = {} but this rank's send has {} elements",
            counts[me], call.send.len
        ));
    }
    let mut displs = Vec::with_capacity(n);
    let mut at = 0usize;
    for &c in counts {
        displs.push(at);
        at = at
            .checked_add(c)
            .ok_or("recv_counts add up to more than usize::MAX")?;
    }
    if at != call.recv.len {
        return Err(format!(
            "recv has {} elements but recv_counts add up to {at}; they must be equal",
            call.recv.len
        ));
    }
    match given {
        [] => Ok(Some(displs)),
        d if d == displs => Ok(None),
        d => Err(format!(
            "recv_displs are {d:?} but the blocks of {} are packed in rank order ({displs:?}); pass those, or none",
            call.kind
        )),
    }
}

/// Where the buffers are: aligned for the element type, in one memory space, and either disjoint
/// or in the call's in-place form.
fn memory(call: &Call, me: usize) -> Result<(), String> {
    let (s, r, esz) = (call.send, call.recv, call.dtype.size());
    aligned("send", s, call)?;
    aligned("recv", r, call)?;
    if s.space != r.space && s.len > 0 && r.len > 0 {
        return Err(format!(
            "send buffer is in {:?} but receive buffer is in {:?}",
            s.space, r.space
        ));
    }
    let (send_used, recv_used) = uses(call.kind, me, call.root);
    if !(send_used && recv_used && overlap(s, r, esz)) {
        return Ok(());
    }
    let own = (me as u128) * (call.count as u128) * (esz as u128);
    let placed = match in_place(call.kind) {
        InPlace::Same => s.addr == r.addr,
        InPlace::SendIsOwnBlock => s.addr as u128 == r.addr as u128 + own,
        InPlace::RecvIsOwnBlock => r.addr as u128 == s.addr as u128 + own,
        InPlace::None => {
            return Err(format!(
                "send and recv overlap, but {} has no in-place form (nor has NCCL's); use separate buffers",
                call.kind
            ))
        }
    };
    if !placed {
        let (s1, r1) = (end(s, esz), end(r, esz));
        return Err(format!(
            "send [{:#x}, {s1:#x}) and recv [{:#x}, {r1:#x}) overlap without being the in-place form of {}: use separate buffers or the in-place form",
            s.addr, r.addr, call.kind
        ));
    }
    Ok(())
}

fn aligned(what: &str, m: RawMem, call: &Call) -> Result<(), String> {
    let size = call.dtype.size();
    if m.len > 0 && !m.addr.is_multiple_of(size) {
        return Err(format!(
            "the {what} buffer ({:#x}) is not aligned for {} ({size} bytes)",
            m.addr, call.dtype
        ));
    }
    Ok(())
}

/// One past the last byte of `m` (as u128: a raw call's lengths are not trusted yet).
fn end(m: RawMem, esz: usize) -> u128 {
    m.addr as u128 + m.len as u128 * esz as u128
}

/// Whether two non-empty buffers share a byte.
fn overlap(a: RawMem, b: RawMem, esz: usize) -> bool {
    a.len > 0 && b.len > 0 && (a.addr as u128) < end(b, esz) && (b.addr as u128) < end(a, esz)
}

/// The local checks of a point-to-point group for rank `rank` of `world`: kinds, peers (a receive
/// may name [`ANY_SOURCE`] when another rank exists), alignment, and sends to this rank itself
/// paired with receives from it in the same group. `Err`: the kind it concerns and the detail.
pub(crate) fn p2p(ops: &[P2pOp], rank: usize, world: usize) -> Result<(), (CollKind, String)> {
    for op in ops {
        if !op.kind.is_p2p() {
            return Err((
                op.kind,
                format!(
                    "{} is a collective, not point-to-point: run it with run",
                    op.kind
                ),
            ));
        }
        let any = op.peer == ANY_SOURCE && op.kind == CollKind::Recv;
        if any && world < 2 {
            return Err((op.kind, ANY_ALONE.into()));
        }
        if !any {
            peer(op.peer, world).map_err(|d| (op.kind, d))?;
        }
        let size = op.dtype.size();
        if op.mem.len > 0 && !op.mem.addr.is_multiple_of(size) {
            return Err((
                op.kind,
                format!(
                    "the buffer ({:#x}) is not aligned for {} ({size} bytes)",
                    op.mem.addr, op.dtype
                ),
            ));
        }
    }
    if let [op] = ops {
        if op.peer == rank {
            let other = if op.kind == CollKind::Send {
                "recv"
            } else {
                "send"
            };
            return Err((
                op.kind,
                format!(
                    "a {} to or from this rank itself only completes inside a group with the matching {other}",
                    op.kind
                ),
            ));
        }
    }
    let selfs = |k: CollKind| ops.iter().filter(|o| o.peer == rank && o.kind == k).count();
    let (ss, sr) = (selfs(CollKind::Send), selfs(CollKind::Recv));
    if ss != sr {
        return Err((
            CollKind::Send,
            format!("the group posts {ss} send(s) to this rank itself but {sr} recv(s) from it; they must pair up"),
        ));
    }
    Ok(())
}

/// Why a receive from any source is refused on a communicator of one rank.
pub(crate) const ANY_ALONE: &str = "a receive from any source needs another rank, but this communicator has one rank only, so no message can ever arrive";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::Splits;
    use crate::types::{Dtype, MemSpace, ReduceOp};

    fn mem(addr: usize, len: usize) -> RawMem {
        RawMem {
            addr,
            len,
            space: MemSpace::Host,
        }
    }

    fn call(kind: CollKind, count: usize, send: RawMem, recv: RawMem) -> Call<'static> {
        Call {
            kind,
            dtype: Dtype::F32,
            op: ReduceOp::Sum,
            root: 0,
            count,
            send,
            recv,
            splits: Splits::default(),
        }
    }

    #[test]
    fn sizes_follow_the_table() {
        let n = |k, rank| need(k, 3, 4, rank, 1).map(|x| (x.send, x.recv));
        assert_eq!(n(CollKind::AllReduce, 0), Some((3, 3)));
        assert_eq!(n(CollKind::Broadcast, 0), Some((0, 3)));
        assert_eq!(n(CollKind::Broadcast, 1), Some((3, 3)));
        assert_eq!(n(CollKind::Gather, 0), Some((3, 0)));
        assert_eq!(n(CollKind::Gather, 1), Some((3, 12)));
        assert_eq!(n(CollKind::Scatter, 1), Some((12, 3)));
        assert_eq!(n(CollKind::AllToAll, 2), Some((12, 12)));
        assert_eq!(n(CollKind::AllToAllV, 0), None);
        assert_eq!(need(CollKind::AllGather, usize::MAX, 2, 0, 0), None);
    }

    #[test]
    fn raw_calls_are_checked() {
        let a = 0x1000;
        // Wrong recv length: the typed method's message.
        let e = super::call(
            &call(CollKind::AllReduce, 4, mem(a, 4), mem(a + 64, 3)),
            0,
            2,
        );
        assert_eq!(e.unwrap_err(), equal(4, 3));
        // A count that disagrees with the buffers.
        let e = super::call(
            &call(CollKind::AllReduce, 5, mem(a, 4), mem(a + 64, 4)),
            0,
            2,
        );
        assert!(e.unwrap_err().contains("count is 5"));
        // In-place all-gather on rank 1: send is block 1 of recv.
        let c = call(CollKind::AllGather, 2, mem(a + 8, 2), mem(a, 4));
        assert_eq!(super::call(&c, 1, 2), Ok(None));
        // The same addresses on rank 0 are an overlap, not the in-place form.
        assert!(super::call(&c, 0, 2).unwrap_err().contains("overlap"));
        // All-to-all has no in-place form.
        let c = call(CollKind::AllToAll, 2, mem(a, 4), mem(a, 4));
        assert!(super::call(&c, 0, 2)
            .unwrap_err()
            .contains("no in-place form"));
        // Misaligned.
        let c = call(CollKind::AllReduce, 1, mem(a + 1, 1), mem(a + 64, 1));
        assert!(super::call(&c, 0, 2).unwrap_err().contains("not aligned"));
    }
}
