//! all_reduce and reduce above `small_bytes`: each rank reduces its own part of the message
//! (reduce-scatter), then every rank copies the other parts (all-gather). Through the slots in
//! rounds of `n × c_max` elements, or directly on the user buffers when they all live in the
//! segment (zero-copy).

use super::part;
use super::single::{self, Agreed, Attempt};
use super::small;
use crate::comm::{Call, CollKind, CommError};
use crate::shm::channel::{Channel, Ctx};
use crate::shm::reduce::{copy_block, reduce_into, Dst};
use crate::shm::sync::{Desc, SHARED_RECV, SHARED_SEND};

/// all_reduce and reduce (`call.kind` tells which; only the root receives a reduce).
pub(crate) fn all_reduce(ch: &mut Channel, call: &Call, cx: Ctx) -> Result<(), CommError> {
    run(ch, call, cx, Attempt::First)
}

/// `attempt`: the first, or the re-run of a call whose ranks did not all offer direct reads.
fn run(ch: &mut Channel, call: &Call, cx: Ctx, attempt: Attempt) -> Result<(), CommError> {
    let (n, me, esz) = (ch.world(), ch.rank(), call.dtype.size());
    let count = call.count;
    let bytes = count * esz;
    let all = call.kind == CollKind::AllReduce;
    let receives = |r: usize| all || r == call.root;
    let send = call.send.addr as *const u8;
    let recv = call.recv.addr as *mut u8;

    // Small path, one phase: every rank stages its whole input and reduces everything itself.
    if bytes <= ch.small_bytes() || n == 1 {
        return small::all_reduce(ch, call, cx);
    }

    // Zero-copy path when every rank's send (and the receivers' recv) is in the segment.
    let (flags, so, ro) = ch.share_flags(call, bytes, if receives(me) { bytes } else { 0 });
    // Single-copy on ordinary buffers: all-reduce only (a reduce's non-roots have no output to
    // hold their reduced part).
    let direct = all && single::offer(ch, call, bytes, attempt);
    let (flags, so, ro) = if direct {
        single::offer_desc(call, flags)
    } else {
        (flags, so, ro)
    };
    let mut p = ch.next_phase();
    let unit = (64 / esz).max(1);
    // The staged path stages the first round in this same phase, so write it before `begin`.
    let c_max = (ch.slot_bytes() / (n - 1) / esz) / unit * unit;
    let round = n * c_max;
    let stage = |ch: &Channel, base: usize, len: usize, p: u64, snt: bool| {
        for j in (0..n).filter(|&j| j != me) {
            let (lo, hi) = part(len, n, j, unit);
            let idx = if j < me { j } else { j - 1 };
            // SAFETY: send is valid for count elements and base+hi <= count; the slot has room
            // for (n-1)*c_max elements and hi-lo <= c_max.
            unsafe {
                copy_block(
                    send.add((base + lo) * esz),
                    ch.slot(me, p).add(idx * c_max * esz),
                    (hi - lo) * esz,
                    snt,
                )
            };
        }
    };
    // A rank whose buffers lie in the segment expects the call to be zero-copy and stages
    // nothing (round 0 would be copied for nobody); a peer's ordinary buffer rules that out, and
    // every rank then sees it below and runs the call again, staged.
    let qualifies =
        |r: usize, f: u8| f & SHARED_SEND != 0 && (!receives(r) || f & SHARED_RECV != 0);
    let skip = attempt == Attempt::First && qualifies(me, flags);
    if !direct && !skip {
        let pre = ch.stage_pre(call.kind, bytes);
        stage(ch, 0, count.min(round), p, pre);
    }
    let (descs, _) = ch.begin(call, flags | ch.stage_flag(), so, ro, cx)?;
    match single::verdict(ch, &descs) {
        Agreed::No => {}
        Agreed::Yes if single::verified(ch, call, &descs, cx)? => {
            return single::all_reduce(ch, call, &descs, cx)
        }
        // Nothing written yet: run the call again, following rank 0's pick or staged.
        a => return run(ch, call, cx, attempt.next(a)),
    }
    let zero_copy = descs.iter().enumerate().all(|(r, d)| qualifies(r, d.flags));
    if !zero_copy
        && attempt == Attempt::First
        && descs.iter().enumerate().any(|(r, d)| qualifies(r, d.flags))
    {
        // Someone skipped its staging for a zero-copy call that is not one: again, staged.
        return run(ch, call, cx, Attempt::Staged);
    }
    if zero_copy {
        return all_reduce_zero_copy(ch, call, &descs, cx);
    }
    let snt = ch.stage_agreed(call.kind, bytes, &descs, true);
    let nt = ch.nt_for(bytes);
    let mut base = 0;
    let mut first = true;
    while base < count {
        let len = round.min(count - base);
        if !first {
            p = ch.next_phase();
            stage(ch, base, len, p, snt);
            ch.phase(cx)?;
        }
        first = false;
        // Reduce my part from my input and the peers' staged copies of it; the result goes to
        // my slot of the next phase (for the others) and to my output.
        let (lo, hi) = part(len, n, me, unit);
        let srcs: Vec<*const u8> = (0..n)
            .map(|k| {
                if k == me {
                    // SAFETY: within send's count elements.
                    unsafe { send.add((base + lo) * esz) }
                } else {
                    let idx = if me < k { me } else { me - 1 };
                    // SAFETY: within peer k's slot (see stage).
                    unsafe { ch.slot(k, p).add(idx * c_max * esz) as *const u8 }
                }
            })
            .collect();
        let out_slot = ch.slot(me, p + 1);
        let others_need = all || me != call.root;
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
            unsafe { reduce_into(call.dtype, call.op, n, &srcs, &dsts, hi - lo) };
        }
        p = ch.phase(cx)?;
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

fn all_reduce_zero_copy(
    ch: &mut Channel,
    call: &Call,
    descs: &[Desc],
    cx: Ctx,
) -> Result<(), CommError> {
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
            reduce_into(call.dtype, call.op, n, &srcs, &dsts, len);
        }
        at += len;
    }
    // Nobody returns (and reuses its buffers) before everyone has finished.
    ch.phase(cx)?;
    Ok(())
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
