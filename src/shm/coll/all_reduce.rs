//! all_reduce and reduce, one body per path (`shm::path`):
//!
//! * inline: every rank reduces the peers' payloads from their inline entries.
//! * one-phase (up to `small_bytes`, or on one rank): every rank puts its whole input in its
//!   slot and reduces all of them itself: one round trip instead of two; for small messages
//!   latency, not bandwidth, is the cost.
//! * slots: each rank reduces its own part of the message (reduce-scatter), then every rank
//!   copies the other parts (all-gather), through the slots in rounds of `n × c_max` elements.
//! * registered: the same split, straight on the buffers in the segment.
//! * CMA (all-reduce only: a reduce's non-roots have no output to hold their reduced part):
//!   each rank reads its part of every peer's input piece by piece, reduces it, and pushes each
//!   reduced piece, still in cache, into every peer's output: one pass and one phase.

use super::cma_reduce::reduce_from_peers;
use super::{finite, part, piece_index, put_pieces};
use crate::comm::{Call, CollKind, CommError};
use crate::shm::channel::{Channel, Ctx};
use crate::shm::inline;
use crate::shm::path::{conclude_found, negotiate, Agreement, Offer, Path};
use crate::shm::reduce::{copy_block, reduce_checked, scan_finite, Dst, Found};
use crate::shm::sync::{Desc, SHARED_RECV, SHARED_SEND};

/// Inline: reduce every rank's payload (a reduce: on the root only; under the finite check the
/// non-roots scan the payloads, so that they report what the root finds).
pub(crate) fn inline(ch: &mut Channel, call: &Call, cx: Ctx) -> Result<(), CommError> {
    inline::put_payload(ch, call);
    inline::exchange(ch, call, cx)?;
    if call.count == 0 {
        return Ok(());
    }
    let found = if call.kind == CollKind::Reduce && ch.rank() != call.root {
        if !ch.check_finite() {
            return Ok(());
        }
        inline::scan(ch, call, 0, call.count)
    } else {
        inline::reduce(ch, call, 0)
    };
    finite(ch, call, found)
}

/// One-phase: every rank puts its whole input in its slot and reduces all of them itself.
pub(crate) fn one_phase(ch: &mut Channel, call: &Call, cx: Ctx) -> Result<(), CommError> {
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
    let check = ch.check_finite();
    if count == 0 || !receives(me) && !check {
        return Ok(());
    }
    let srcs: Vec<*const u8> = (0..n)
        .map(|r| {
            if r == me {
                send
            } else {
                ch.slot(r, p) as *const u8
            }
        })
        .collect();
    let found = if receives(me) {
        let dst = Dst {
            ptr: recv,
            nt: false,
        };
        // SAFETY: every source holds `count` elements (descriptors agree on count); recv is
        // valid for count elements on receiving ranks (checked by Communicator) and equals
        // send or does not overlap it.
        unsafe { reduce_checked(check, call.dtype, call.op, n, &srcs, &[dst], count) }
    } else {
        // A reduce's non-root under the finite check: the root's sources, scanned, so that it
        // reports what the root finds.
        // SAFETY: as above.
        unsafe { scan_finite(call.dtype, &srcs, count) }
    };
    finite(ch, call, found)
}

/// all_reduce and reduce above `small_bytes` (`call.kind` tells which; only the root receives a
/// reduce): the ranks agree on the path, then run its body.
pub(crate) fn all_reduce(ch: &mut Channel, call: &Call, cx: Ctx) -> Result<(), CommError> {
    let all = call.kind == CollKind::AllReduce;
    let receives = |r: usize| all || r == call.root;
    let (n, me, esz) = (ch.world(), ch.rank(), call.dtype.size());
    let c_max = c_max(ch, esz, (64 / esz).max(1));
    let (count, send) = (call.count, call.send.addr as *const u8);
    let bytes = count * esz;
    // A rank takes part in a registered call when its send (and, if it receives, its recv) lies
    // in the segment.
    let takes_part =
        |r: usize, f: u8| f & SHARED_SEND != 0 && (!receives(r) || f & SHARED_RECV != 0);
    let offer = Offer {
        send_bytes: bytes,
        recv_bytes: if receives(me) { bytes } else { 0 },
        cma_size: all.then_some(bytes),
        stores_size: bytes,
        registered: &takes_part,
        skip_when_registered: true,
    };
    // The slots path writes its first round in the first phase, so before `begin`.
    let prestage = |ch: &Channel, p: u64, nt: bool, _: u8| {
        stage(ch, call, send, 0, count.min(n * c_max), c_max, p, nt);
        0
    };
    let agreed = negotiate(ch, call, cx, &offer, &prestage)?;
    match agreed.path {
        Path::Cma => cma(ch, call, &agreed.descs, cx),
        Path::Registered => registered(ch, call, &agreed.descs, cx),
        _ => slots(ch, call, &agreed, cx),
    }
}

/// Elements of each peer's piece in a slot: the slot split evenly between the peers, in whole
/// `unit`s (cache lines).
fn c_max(ch: &Channel, esz: usize, unit: usize) -> usize {
    (ch.slot_bytes() / (ch.world() - 1) / esz) / unit * unit
}

/// Put round `base..base + len` of our input into our slot of phase `p`: for each peer `j`, the
/// part `j` reduces, at index `j` (our own part skipped) of `c_max` elements.
#[allow(clippy::too_many_arguments)]
fn stage(
    ch: &Channel,
    call: &Call,
    send: *const u8,
    base: usize,
    len: usize,
    c_max: usize,
    p: u64,
    nt: bool,
) {
    let (n, esz) = (ch.world(), call.dtype.size());
    let unit = (64 / esz).max(1);
    // SAFETY: send is valid for count elements and base + hi <= count; the slot has room for
    // (n - 1) × c_max elements and hi - lo <= c_max.
    unsafe {
        put_pieces(ch, p, c_max * esz, nt, |j| {
            let (lo, hi) = part(len, n, j, unit);
            (send.add((base + lo) * esz), (hi - lo) * esz)
        })
    };
}

/// Slots: reduce-scatter then all-gather, round by round; the first round was written before
/// `begin`, in the first phase.
fn slots(ch: &mut Channel, call: &Call, agreed: &Agreement, cx: Ctx) -> Result<(), CommError> {
    let (n, me, esz) = (ch.world(), ch.rank(), call.dtype.size());
    let unit = (64 / esz).max(1);
    let c_max = c_max(ch, esz, unit);
    let round = n * c_max;
    let all = call.kind == CollKind::AllReduce;
    let receives = |r: usize| all || r == call.root;
    let (send, recv) = (call.send.addr as *const u8, call.recv.addr as *mut u8);
    let count = call.count;
    let bytes = count * esz;
    let snt = agreed.streaming;
    let mut p = agreed.phase;
    let nt = ch.nt_for(bytes);
    let check = ch.check_finite();
    let mut base = 0;
    let mut first = true;
    while base < count {
        let len = round.min(count - base);
        if !first {
            p = ch.next_phase();
            stage(ch, call, send, base, len, c_max, p, snt);
            ch.phase(cx)?;
        }
        first = false;
        // Reduce my part from my input and the peers' copies of it in their slots; the result goes to
        // my slot of the next phase (for the others) and to my output.
        let (lo, hi) = part(len, n, me, unit);
        let srcs: Vec<*const u8> = (0..n)
            .map(|k| {
                if k == me {
                    // SAFETY: within send's count elements.
                    unsafe { send.add((base + lo) * esz) }
                } else {
                    // SAFETY: within peer k's slot (see stage).
                    unsafe { ch.slot(k, p).add(piece_index(k, me) * c_max * esz) as *const u8 }
                }
            })
            .collect();
        let out_slot = ch.slot(me, p + 1);
        let others_need = all || me != call.root;
        let mut found = None;
        if hi > lo {
            let mut dsts = Vec::with_capacity(2);
            if others_need {
                dsts.push(Dst {
                    ptr: out_slot,
                    nt: snt,
                });
            }
            if receives(me) {
                // SAFETY: recv holds count elements on receivers.
                let ptr = unsafe { recv.add((base + lo) * esz) };
                dsts.push(Dst { ptr, nt });
            }
            // SAFETY: out_slot holds slot_bytes >= c_max elements >= hi-lo; sources valid; recv
            // may equal our own source exactly (in place).
            found = unsafe { reduce_checked(check, call.dtype, call.op, n, &srcs, &dsts, hi - lo) }
                .map(|f| f.shifted(base + lo));
        }
        if check {
            // Every rank learns the round's first non-finite element with the phase; a later
            // round holds only later elements, so the call ends here on every rank.
            let (q, first_found) = ch.phase_found(found, cx)?;
            if first_found.is_some() {
                return finite(ch, call, first_found);
            }
            p = q;
        } else {
            p = ch.phase(cx)?;
        }
        if receives(me) {
            for j in (0..n).filter(|&j| j != me) {
                let (lo, hi) = part(len, n, j, unit);
                // SAFETY: peer j wrote hi-lo elements of its part into its slot of phase p;
                // recv holds count elements.
                ch.put(
                    ch.slot(j, p),
                    unsafe { recv.add((base + lo) * esz) },
                    (hi - lo) * esz,
                    nt,
                );
            }
        }
        base += len;
    }
    Ok(())
}

/// Registered: each rank reduces its part straight from every rank's send into the receivers'
/// recv buffers, then one phase.
fn registered(ch: &mut Channel, call: &Call, descs: &[Desc], cx: Ctx) -> Result<(), CommError> {
    let (n, me, esz) = (ch.world(), ch.rank(), call.dtype.size());
    let count = call.count;
    let unit = (64 / esz).max(1);
    // Rounds small enough that the reduced chunk is still in cache when it is copied out.
    let sub = ((32 << 10) / esz).max(unit);
    let dests: Vec<usize> = if call.kind == CollKind::AllReduce {
        (0..n).collect()
    } else {
        vec![call.root]
    };
    let sends: Vec<*const u8> = descs
        .iter()
        .map(|d| ch.at(d.send_off) as *const u8)
        .collect();
    let recvs: Vec<*mut u8> = descs.iter().map(|d| ch.at(d.recv_off)).collect();
    let nt = ch.nt_for(count * esz);
    let check = ch.check_finite();
    let mut found = None;
    let (mlo, mhi) = part(count, n, me, unit);
    let mut at = mlo;
    while at < mhi {
        let len = sub.min(mhi - at);
        // SAFETY: every rank's send holds `count` elements (descriptors agree) and lies in the
        // segment; [at, at+len) is inside my part, which no other rank reads or writes in any
        // receive buffer during this collective.
        unsafe {
            let srcs: Vec<*const u8> = sends.iter().map(|s| s.add(at * esz)).collect();
            let dsts: Vec<Dst> = dests
                .iter()
                .map(|&d| Dst {
                    ptr: recvs[d].add(at * esz),
                    nt,
                })
                .collect();
            let f = reduce_checked(check, call.dtype, call.op, n, &srcs, &dsts, len);
            found = Found::first(found, f.map(|f| f.shifted(at)));
        }
        at += len;
    }
    // Nobody returns (and reuses its buffers) before everyone has finished.
    if check {
        let (_, first_found) = ch.phase_found(found, cx)?;
        return finite(ch, call, first_found);
    }
    ch.phase(cx)?;
    Ok(())
}

/// CMA: reduce our part (reduce-scatter), pushing every reduced piece into the peers' outputs as
/// it is done (all-gather), then one phase.
fn cma(ch: &mut Channel, call: &Call, descs: &[Desc], cx: Ctx) -> Result<(), CommError> {
    let (n, me, esz, count) = (ch.world(), ch.rank(), call.dtype.size(), call.count);
    let unit = (64 / esz).max(1);
    let nt = ch.nt_for(count * esz);
    let (lo, hi) = part(count, n, me, unit);
    // SAFETY: (add) send and recv hold `count` elements; lo <= count.
    let (own, out) = unsafe {
        (
            (call.send.addr as *const u8).add(lo * esz),
            (call.recv.addr as *mut u8).add(lo * esz),
        )
    };
    // Peers read only their own parts of our input and write only their own parts of our output,
    // and we write only ours of our output, so an in-place call (send = recv) is safe.
    let r = reduce_from_peers(ch, call, descs, lo, hi - lo, own, out, nt, true);
    let found = conclude_found(ch, call, r, cx)?;
    finite(ch, call, found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_and_align() {
        for len in [0usize, 1, 7, 63, 64, 65, 1000, 4097] {
            for n in 1..9 {
                let mut end = 0;
                for j in 0..n {
                    let (lo, hi) = part(len, n, j, 16);
                    assert_eq!(lo, end.min(len));
                    assert!(lo % 16 == 0 || lo == len);
                    end = hi;
                }
                assert_eq!(end, len);
            }
        }
    }
}
