//! The fast path: every collective whose per-rank payload is at most `fast_bytes` (4 KiB by
//! default) in one phase, through the ranks' fast entries (see `sync::FastHdr`).
//!
//! Why: for small messages the cost is the number of cache lines that cross between cores, one
//! after the other, not the bytes. The phased path moves a progress line, a descriptor line and
//! the slot's lines; here a rank writes its call's arguments, its payload and the call's number
//! side by side in its own entry, so a peer that sees the number has the arguments and up to 40
//! bytes of data in the same line. Every rank waits for every peer's entry (even a broadcast's
//! root), because that is what lets every rank compare the arguments and report a disagreement
//! as the same [`CommError::Mismatch`] everywhere, and what keeps an entry unread before its owner
//! rewrites it two calls later.
//!
//! Reductions read the entries in rank order 0..n, so every rank gets the same bits, as on the
//! other paths.
//!
//! After the exchange a rank never reads its own entry back: its own payload comes from the
//! caller's send buffer, its own arguments from the call. Why: a peer that read the entry took
//! the line with it (CPUs that hand a modified line to its reader outright, as a migratory line,
//! do), and reading it back costs one more crossing between cores after the exchange, a large
//! part of the exchange's own cost (`benches/baselines/xfloor.c`'s `own` protocol measures it).

use crate::comm::{check, Call, CollKind, CommError};
use crate::shm::channel::{Channel, Ctx};
use crate::shm::reduce::{copy_block, reduce_raw};

/// Bytes of the payload rank `me` of `n` writes into its entry for `call`: what it reads from its
/// send buffer (the shared table's [`check::need`]), or `None` when the call has no fast path
/// (the v-variants, point-to-point) or the size overflows.
fn payload(call: &Call, n: usize, me: usize) -> Option<usize> {
    check::need(call.kind, call.count, n, me, call.root)?
        .send
        .checked_mul(call.dtype.size())
}

/// The size that decides the path: the largest payload any rank writes for this call, the same
/// on every rank when the arguments agree.
fn decisive(call: &Call, n: usize) -> Option<usize> {
    match call.kind {
        CollKind::Broadcast | CollKind::Scatter => payload(call, n, call.root),
        _ => payload(call, n, 0),
    }
}

/// Whether `call` takes the fast path on this channel.
pub(crate) fn eligible(ch: &Channel, call: &Call) -> bool {
    call.kind == CollKind::Barrier
        || decisive(call, ch.world()).is_some_and(|b| b <= ch.fast_bytes())
}

/// Run `call` on the fast path (the caller checked [`eligible`]).
pub(crate) fn run(ch: &mut Channel, call: &Call, cx: Ctx) -> Result<(), CommError> {
    let (n, me, esz) = (ch.world(), ch.rank(), call.dtype.size());
    let c = call.count;
    let block = c * esz;
    let send = call.send.addr as *const u8;
    let recv = call.recv.addr as *mut u8;
    let mine = payload(call, n, me).unwrap_or(0);
    // SAFETY: our entry's payload holds FAST_MAX >= fast_bytes >= mine bytes (eligible); send
    // holds `mine` bytes (checked by Communicator for the kind) and lies outside the segment's
    // entries.
    unsafe { copy_block(send, ch.fast_data(me), mine, false) };
    ch.fast_exchange(call, cx)?;
    if c == 0 {
        return Ok(());
    }
    // Rank r's payload: its entry, or for this rank the send buffer it was copied from.
    let src = |r: usize| {
        if r == me {
            send
        } else {
            ch.fast_data(r) as *const u8
        }
    };
    let receives =
        |r: usize| !matches!(call.kind, CollKind::Reduce | CollKind::Gather) || r == call.root;
    match call.kind {
        CollKind::AllReduce | CollKind::Reduce | CollKind::ReduceScatter => {
            if !receives(me) {
                return Ok(());
            }
            // Reduce-scatter reduces block `me` of every input.
            let off = if call.kind == CollKind::ReduceScatter {
                me * block
            } else {
                0
            };
            let mut buf = [std::ptr::null::<u8>(); 16];
            let mut big = Vec::new();
            let srcs: &mut [*const u8] = if n <= buf.len() {
                &mut buf[..n]
            } else {
                big.resize(n, std::ptr::null());
                &mut big
            };
            for (r, s) in srcs.iter_mut().enumerate() {
                // SAFETY: (add) every entry and the send buffer hold the rank's whole input,
                // off + block <= its size.
                *s = unsafe { src(r).add(off) };
            }
            // SAFETY: every source holds `c` elements (the arguments agree, checked above);
            // recv holds `c` elements on receiving ranks (checked by Communicator) and lies
            // outside the entries; in place it equals this rank's source (the reduction allows
            // a destination equal to a source).
            unsafe { reduce_raw(call.dtype, call.op, n, srcs, recv, c) };
        }
        CollKind::Broadcast => {
            // SAFETY: the root's entry (the root's send buffer, on the root) holds `block` bytes;
            // recv holds `block` and lies outside the entries, equal to send or disjoint.
            unsafe { copy_block(src(call.root), recv, block, false) };
        }
        CollKind::AllGather | CollKind::Gather if receives(me) => {
            for r in 0..n {
                // SAFETY: entry r (send, for this rank) holds `block` bytes; recv holds n*block
                // on receivers; in place, send is block `me` of recv.
                unsafe { copy_block(src(r), recv.add(r * block), block, false) };
            }
        }
        CollKind::Scatter => {
            // SAFETY: the root's entry (send, on the root) holds n*block bytes; recv holds
            // `block`, equal to block `me` of send in place or disjoint.
            unsafe { copy_block(src(call.root).add(me * block), recv, block, false) };
        }
        CollKind::AllToAll => {
            for r in 0..n {
                // SAFETY: entry r (send, for this rank) holds n*block bytes, block `me` is ours;
                // recv holds n*block, disjoint from send (the shared checks refuse overlapping
                // buffers for all-to-all, which has no in-place form).
                unsafe { copy_block(src(r).add(me * block), recv.add(r * block), block, false) };
            }
        }
        _ => {}
    }
    Ok(())
}
