//! reduce_scatter: every rank stages, for each peer, that peer's block of its input in its slot,
//! and reduces its own block from its input and the peers' staged copies; or, when every send
//! buffer lives in the segment, reduces its block straight from them.

use super::single::{self, Agreed, Attempt};
use crate::comm::{Call, CommError};
use crate::shm::channel::{Channel, Ctx};
use crate::shm::reduce::{copy_block, reduce_into, reduce_raw, Dst};
use crate::shm::sync::SHARED_SEND;

pub(crate) fn reduce_scatter(ch: &mut Channel, call: &Call, cx: Ctx) -> Result<(), CommError> {
    run(ch, call, cx, Attempt::First)
}

/// `attempt`: the first, or the re-run of a call whose ranks did not all offer direct reads.
fn run(ch: &mut Channel, call: &Call, cx: Ctx, attempt: Attempt) -> Result<(), CommError> {
    let (n, me, esz) = (ch.world(), ch.rank(), call.dtype.size());
    let c = call.count;
    let send = call.send.addr as *const u8;
    let recv = call.recv.addr as *mut u8;
    let (flags, so, ro) = ch.share_flags(call, n * c * esz, 0);
    if n == 1 {
        ch.begin(call, flags, so, ro, cx)?;
        // SAFETY: single source, c elements, recv equal or disjoint.
        unsafe { reduce_raw(call.dtype, call.op, 1, &[send], recv, c) };
        return Ok(());
    }
    let unit = (64 / esz).max(1);
    let nt = ch.nt_for(c * esz);
    let c_max = ((ch.slot_bytes() / (n - 1) / esz) / unit * unit).max(unit);
    let stage = |ch: &Channel, off: usize, len: usize, p: u64, snt: bool| {
        for j in (0..n).filter(|&j| j != me) {
            let idx = if j < me { j } else { j - 1 };
            // SAFETY: send holds n*c elements; the slot holds (n-1)*c_max elements; len <= c_max.
            unsafe {
                copy_block(
                    send.add((j * c + off) * esz),
                    ch.slot(me, p).add(idx * c_max * esz),
                    len * esz,
                    snt,
                )
            };
        }
    };
    let direct = single::offer(ch, call, c * esz, attempt);
    let (flags, so, ro) = if direct {
        single::offer_desc(call, flags)
    } else {
        (flags, so, ro)
    };
    let mut p = ch.next_phase();
    // A rank whose input lies in the segment expects the call to be zero-copy and stages
    // nothing; a peer's ordinary input rules that out, and every rank then runs it again, staged.
    let big = c * esz > ch.small_bytes();
    let qualifies = |f: u8| f & SHARED_SEND != 0 && big;
    let skip = attempt == Attempt::First && qualifies(flags);
    if !direct && !skip {
        let pre = ch.stage_pre(call.kind, n * c * esz);
        stage(ch, 0, c.min(c_max), p, pre);
    }
    let (descs, _) = ch.begin(call, flags | ch.stage_flag(), so, ro, cx)?;
    let zero_copy = descs.iter().all(|d| qualifies(d.flags));
    match single::verdict(ch, &descs) {
        Agreed::No => {}
        Agreed::Yes if single::verified(ch, call, &descs, cx)? => {
            return single::reduce_scatter(ch, call, &descs, cx)
        }
        // Nothing written yet: run the call again, following rank 0's pick or staged.
        a => return run(ch, call, cx, attempt.next(a)),
    }
    if !zero_copy && attempt == Attempt::First && descs.iter().any(|d| qualifies(d.flags)) {
        // Someone skipped its staging for a zero-copy call that is not one: again, staged.
        return run(ch, call, cx, Attempt::Staged);
    }
    let snt = ch.stage_agreed(call.kind, n * c * esz, &descs, !zero_copy);
    if zero_copy {
        let sends: Vec<*const u8> = descs
            .iter()
            .map(|d| ch.at(d.send_off) as *const u8)
            .collect();
        let srcs: Vec<*const u8> = sends
            .iter()
            .map(|s| {
                // SAFETY: every send holds n*c elements in the segment.
                unsafe { s.add(me * c * esz) }
            })
            .collect();
        // SAFETY: block `me` of every send is read only by this rank; recv holds c elements and
        // is either our own block `me` (in place, same address as srcs[me]) or disjoint.
        unsafe { reduce_into(call.dtype, call.op, n, &srcs, &[Dst { ptr: recv, nt }], c) };
        ch.phase(cx)?;
        return Ok(());
    }
    let mut off = 0;
    loop {
        let len = c_max.min(c - off);
        let srcs: Vec<*const u8> = (0..n)
            .map(|k| {
                if k == me {
                    // SAFETY: within send.
                    unsafe { send.add((me * c + off) * esz) }
                } else {
                    let idx = if me < k { me } else { me - 1 };
                    // SAFETY: within peer k's slot of phase p.
                    unsafe { ch.slot(k, p).add(idx * c_max * esz) as *const u8 }
                }
            })
            .collect();
        // SAFETY: recv holds c elements; len elements from off.
        unsafe {
            reduce_into(
                call.dtype,
                call.op,
                n,
                &srcs,
                &[Dst {
                    ptr: recv.add(off * esz),
                    nt,
                }],
                len,
            )
        };
        off += len;
        if off >= c {
            break;
        }
        p = ch.next_phase();
        stage(ch, off, c_max.min(c - off), p, snt);
        ch.phase(cx)?;
    }
    Ok(())
}
