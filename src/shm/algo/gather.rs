//! all_gather and gather: every rank stages its block chunk by chunk in its slot and the
//! receivers copy every peer's block out; or, when every send buffer lives in the segment, the
//! receivers copy from them directly.

use super::single::{self, Agreed, Attempt};
use crate::comm::{Call, CollKind, CommError};
use crate::shm::channel::{Channel, Ctx};
use crate::shm::reduce::copy_block;
use crate::shm::sync::{Desc, LATE_STAGE, SHARED_SEND};

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
    let (flags, so, ro) = if direct {
        single::offer_desc(call, flags)
    } else {
        (flags, so, ro)
    };
    let mut p = ch.next_phase();
    // A rank whose input lies in the segment expects the call to be zero-copy and stages
    // nothing (its first chunk would be copied for nobody); a peer's ordinary input rules that
    // out, and then every rank sees it below and runs the call again, staged.
    let big = bytes > ch.small_bytes();
    let qualifies = |f: u8| f & SHARED_SEND != 0 && big;
    let skip = attempt == Attempt::First && qualifies(flags);
    // Out of place, a staged all-gather of one chunk stages after the descriptors, in one pass
    // with its own block (see `late_stage`). In place there is nothing to fuse, and staging before
    // `begin` overlaps with the peers' arrival. Ranks may differ; each says which in its
    // descriptor. (wrapping_add: the address is only compared.)
    let own_in_place = std::ptr::eq(send, recv.wrapping_add(me * bytes));
    let late = all && n > 1 && bytes <= chunk && !own_in_place && !direct && !skip;
    if !direct && !skip {
        let pre = ch.stage_pre(call.kind, bytes);
        if !late {
            // SAFETY: the slot holds `chunk` bytes; send holds `bytes`.
            unsafe { copy_block(send, ch.slot(me, p), bytes.min(chunk), pre) };
        }
    }
    let (descs, _) = ch.begin(
        call,
        flags | ch.stage_flag() | if late { LATE_STAGE } else { 0 },
        so,
        ro,
        cx,
    )?;
    let zero_copy = descs.iter().all(|d| qualifies(d.flags));
    match single::verdict(ch, &descs) {
        Agreed::No => {}
        Agreed::Yes if single::verified(ch, call, &descs, cx)? => {
            return single::all_gather(ch, call, &descs, cx)
        }
        // Nothing written yet: run the call again, following rank 0's pick or staged.
        a => return run(ch, call, cx, attempt.next(a)),
    }
    if !zero_copy && attempt == Attempt::First && descs.iter().any(|d| qualifies(d.flags)) {
        // Someone skipped its staging for a zero-copy call that is not one: again, staged.
        return run(ch, call, cx, Attempt::Staged);
    }
    let snt = ch.stage_agreed(call.kind, bytes, &descs, !zero_copy && n > 1);
    if !zero_copy && descs.iter().any(|d| d.flags & LATE_STAGE != 0) {
        return late_stage(ch, call, &descs, p, snt, nt, cx);
    }
    // Our own block: the staged path copies it chunk by chunk along with the staging.
    let own = if receives {
        // SAFETY: (add) recv holds n*bytes on receivers.
        Some(unsafe { recv.add(me * bytes) })
    } else {
        None
    };
    if let Some(own) = own {
        // send is either disjoint from our block or exactly it.
        ch.put(
            send,
            own,
            if n == 1 || zero_copy {
                bytes
            } else {
                bytes.min(chunk)
            },
            nt,
        );
    }
    if n == 1 {
        return Ok(());
    }
    if zero_copy {
        if receives {
            for j in (0..n).filter(|&j| j != me) {
                // SAFETY: (add) within recv. Peer j's send lies in the segment and holds `bytes`.
                ch.put(
                    ch.at(descs[j].send_off),
                    unsafe { recv.add(j * bytes) },
                    bytes,
                    nt,
                );
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

/// A staged all-gather of one chunk in which some rank stages after the descriptors
/// (`LATE_STAGE`: its block is out of place). Every rank first copies out the blocks that were
/// staged before `begin` (in the slots of phase `p0`, which must be read before this rank
/// publishes another phase) and its own block if it staged early. Then each late rank stages its
/// block and copies it into its own output in one pass over its input, and after one phase every
/// rank copies the late blocks out.
///
/// Why after the descriptors: the one-pass copy writes the output, which must stay untouched
/// when the call fails its argument check. The phase it costs is a fraction of a microsecond;
/// the pass saves a read of the input (figures at `reduce::copy_block2`).
fn late_stage(
    ch: &mut Channel,
    call: &Call,
    descs: &[Desc],
    p0: u64,
    snt: bool,
    nt: bool,
    cx: Ctx,
) -> Result<(), CommError> {
    let (n, me) = (ch.world(), ch.rank());
    let bytes = call.count * call.dtype.size();
    let (send, recv) = (call.send.addr as *const u8, call.recv.addr as *mut u8);
    let late = |j: usize| descs[j].flags & LATE_STAGE != 0;
    // Starting after ourselves spreads the readers over the slots.
    let peers = || (1..n).map(move |s| (me + s) % n);
    // SAFETY: (add) recv holds n × bytes on every rank of an all-gather; block j is rank j's.
    let block = |j: usize| unsafe { recv.add(j * bytes) };
    if !late(me) {
        // In place (or exactly our block): nothing to copy.
        ch.put(send, block(me), bytes, nt);
    }
    for j in peers().filter(|&j| !late(j)) {
        // Peer j staged its `bytes` in its slot of phase p0 before `begin`.
        ch.put(ch.slot(j, p0), block(j), bytes, nt);
    }
    // The late slots alternate from one call to the next, as the staged paths' slots do (those
    // stage before `begin` and in the phases after it, which alternate). Here every call would
    // publish two phases and stage in the slot of the same parity every time, and rewriting
    // lines the peers still hold in their caches took twice as long (`cma_floor` with one slot:
    // 60–66 µs against 33 µs at 1 MiB). So the slot's parity follows the call's number, at the
    // cost of an empty phase in every other call. Every rank has the same phase and call
    // numbers, so all agree.
    if ch.next_phase() % 2 != ch.seq() % 2 {
        ch.phase(cx)?;
    }
    let p = ch.next_phase();
    if late(me) {
        // SAFETY: our block of recv holds `bytes` and is disjoint from send (LATE_STAGE). The
        // slot of phase p holds slot_bytes >= bytes, is disjoint from the user buffers, and
        // every peer finished reading it before it published the phase before p, which we passed.
        unsafe { ch.put2(send, ch.slot(me, p), snt, block(me), nt, bytes) };
    }
    ch.phase(cx)?;
    for j in peers().filter(|&j| late(j)) {
        // Peer j staged its `bytes` in its slot of phase p.
        ch.put(ch.slot(j, p), block(j), bytes, nt);
    }
    Ok(())
}
