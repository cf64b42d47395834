//! all_gather and gather: every rank stages its block chunk by chunk in its slot and the
//! receivers copy every peer's block out; or, when every send buffer lives in the segment, the
//! receivers copy from them directly.

use super::single::{self, Agreed, Attempt};
use crate::comm::{Call, CollKind, CommError};
use crate::shm::channel::{Channel, Ctx};
use crate::shm::reduce::copy_block;
use crate::shm::sync::SHARED_SEND;

/// all_gather and gather (`call.kind` tells which; only the root receives a gather).
pub(crate) fn all_gather(ch: &mut Channel, call: &Call, cx: Ctx) -> Result<(), CommError> {
    run(ch, call, cx, Attempt::First)
}

/// `attempt`: the first, or the re-run of a call whose ranks did not all offer direct reads.
fn run(ch: &mut Channel, call: &Call, cx: Ctx, attempt: Attempt) -> Result<(), CommError> {
    let (n, me, esz) = (ch.world(), ch.rank(), call.dtype.size());
    let all = call.kind == CollKind::AllGather;
    let receives = all || me == call.root;
    let bytes = call.count * esz;
    let send = call.send.addr as *const u8;
    let recv = call.recv.addr as *mut u8;
    let chunk = ch.slot_bytes();
    let nt = ch.nt_for(bytes * n);
    let (flags, so, ro) = ch.share_flags(call, bytes, 0);
    let direct = single::offer(ch, call, bytes, attempt);
    let (flags, so, ro) = if direct { single::offer_desc(call, flags) } else { (flags, so, ro) };
    let mut p = ch.next_phase();
    // A rank whose input lies in the segment expects the call to be zero-copy and stages
    // nothing (its first chunk would be copied for nobody); a peer's ordinary input rules that
    // out, and then every rank sees it below and runs the call again, staged.
    let big = bytes > ch.small_bytes();
    let qualifies = |f: u8| f & SHARED_SEND != 0 && big;
    let skip = attempt == Attempt::First && qualifies(flags);
    if !direct && !skip {
        let pre = ch.stage_pre(call.kind, bytes);
        // SAFETY: the slot holds `chunk` bytes; send holds `bytes`.
        unsafe { copy_block(send, ch.slot(me, p), bytes.min(chunk), pre) };
    }
    let (descs, _) = ch.begin(call, flags | ch.stage_flag(), so, ro, cx)?;
    let zero_copy = descs.iter().all(|d| qualifies(d.flags));
    match single::verdict(ch, &descs) {
        Agreed::No => {}
        Agreed::Yes if single::verified(ch, call, &descs, cx)? => return single::all_gather(ch, call, &descs, cx),
        // Nothing written yet: run the call again, following rank 0's pick or staged.
        a => return run(ch, call, cx, attempt.next(a)),
    }
    if !zero_copy && attempt == Attempt::First && descs.iter().any(|d| qualifies(d.flags)) {
        // Someone skipped its staging for a zero-copy call that is not one: again, staged.
        return run(ch, call, cx, Attempt::Staged);
    }
    let snt = ch.stage_agreed(call.kind, bytes, &descs, !zero_copy && n > 1);
    // Our own block: the staged path copies it chunk by chunk along with the staging.
    // SAFETY: (add) recv holds n*bytes on receivers.
    let own = if receives { Some(unsafe { recv.add(me * bytes) }) } else { None };
    if let Some(own) = own {
        // send is either disjoint from our block or exactly it.
        ch.put(send, own, if n == 1 || zero_copy { bytes } else { bytes.min(chunk) }, nt);
    }
    if n == 1 {
        return Ok(());
    }
    if zero_copy {
        if receives {
            for j in (0..n).filter(|&j| j != me) {
                // SAFETY: (add) within recv. Peer j's send lies in the segment and holds `bytes`.
                ch.put(ch.at(descs[j].send_off), unsafe { recv.add(j * bytes) }, bytes, nt);
            }
        }
        ch.phase(cx)?;
        return Ok(());
    }
    let mut off = 0;
    loop {
        let len = chunk.min(bytes - off);
        if receives {
            for j in (0..n).filter(|&j| j != me) {
                // SAFETY: (add) within recv. Peer j staged `len` bytes of this chunk in its slot.
                ch.put(ch.slot(j, p), unsafe { recv.add(j * bytes + off) }, len, nt);
            }
        }
        off += len;
        if off >= bytes {
            break;
        }
        p = ch.next_phase();
        let len = chunk.min(bytes - off);
        // SAFETY: next chunk of our own send into our slot (and our own block of recv, which
        // holds `bytes` from `own`); the slot is disjoint from the user buffers.
        unsafe {
            match own {
                Some(own) => ch.put2(send.add(off), ch.slot(me, p), snt, own.add(off), nt, len),
                None => copy_block(send.add(off), ch.slot(me, p), len, snt),
            }
        }
        ch.phase(cx)?;
    }
    Ok(())
}
