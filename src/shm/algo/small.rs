//! One-phase collectives: the barrier, and the small all-reduce/reduce path, where every rank
//! stages its whole input in its slot and reduces all of them itself (one round trip instead of
//! two; for small messages latency, not bandwidth, is the cost).

use crate::comm::{Call, CollKind, CommError};
use crate::shm::channel::{Channel, Ctx};
use crate::shm::reduce::{copy_block, reduce_raw};

/// Barrier: the first phase (descriptor exchange) alone.
pub(crate) fn barrier(ch: &mut Channel, call: &Call, cx: Ctx) -> Result<(), CommError> {
    ch.begin(call, 0, 0, 0, cx).map(|_| ())
}

/// all_reduce and reduce of at most `small_bytes` (or on one rank), in one phase.
pub(crate) fn all_reduce(ch: &mut Channel, call: &Call, cx: Ctx) -> Result<(), CommError> {
    let (n, me, esz) = (ch.world(), ch.rank(), call.dtype.size());
    let count = call.count;
    let bytes = count * esz;
    let all = call.kind == CollKind::AllReduce;
    let receives = |r: usize| all || r == call.root;
    let send = call.send.addr as *const u8;
    let recv = call.recv.addr as *mut u8;

    let p = ch.next_phase();
    if n > 1 {
        // SAFETY: the slot holds slot_bytes >= small_bytes >= bytes; send is valid for bytes.
        unsafe { copy_block(send, ch.slot(me, p), bytes, false) };
    }
    let (flags, so, ro) = (0, 0, 0);
    ch.begin(call, flags, so, ro, cx)?;
    if receives(me) && count > 0 {
        let srcs: Vec<*const u8> = (0..n)
            .map(|r| {
                if r == me {
                    send
                } else {
                    ch.slot(r, p) as *const u8
                }
            })
            .collect();
        // SAFETY: every source holds `count` elements (descriptors agree on count); recv is
        // valid for count elements on receiving ranks (checked by Communicator) and equals
        // send or does not overlap it.
        unsafe { reduce_raw(call.dtype, call.op, n, &srcs, recv, count) };
    }
    Ok(())
}
