//! broadcast: the root stages the message chunk by chunk in its slot and every other rank copies
//! it out; or, when the root's send buffer lives in the segment, everyone copies from it directly
//! (in place with every output in the segment too, the root writes a share of every output).

use super::single::{self, Agreed, Attempt};
use crate::comm::{Call, CommError};
use crate::shm::channel::{Channel, Ctx};
use crate::shm::reduce::copy_block;
use crate::shm::sync::{SHARED_RECV, SHARED_SEND};

pub(crate) fn broadcast(ch: &mut Channel, call: &Call, cx: Ctx) -> Result<(), CommError> {
    run(ch, call, cx, Attempt::First)
}

/// `attempt`: the first, or the re-run of a call whose ranks did not all offer direct reads.
fn run(ch: &mut Channel, call: &Call, cx: Ctx, attempt: Attempt) -> Result<(), CommError> {
    let (n, me, esz) = (ch.world(), ch.rank(), call.dtype.size());
    let root = call.root;
    let bytes = call.count * esz;
    let send = call.send.addr as *const u8;
    let recv = call.recv.addr as *mut u8;
    let chunk = ch.slot_bytes();
    let nt = ch.nt_for(bytes);
    // Every output is offered too: when the root's input and every output lie in the segment and
    // the root broadcasts in place, the root writes a share of each output itself (below).
    let (flags, so, ro) = ch.share_flags(call, if me == root { bytes } else { 0 }, bytes);
    let direct = single::offer(ch, call, bytes, attempt);
    let (flags, so, ro) = if direct {
        single::offer_desc(call, flags)
    } else {
        (flags, so, ro)
    };
    let mut p = ch.next_phase();
    let pre = if direct {
        false
    } else {
        ch.stage_pre(call.kind, bytes)
    };
    // Whether the call will be zero-copy depends on the root's descriptor alone (below), so the
    // root knows it now and stages nothing: that first chunk would be copied for nobody (a
    // whole 1 MiB message, which cost a 1 MiB in-place broadcast on shared buffers 3x its time).
    let root_zero_copy = flags & SHARED_SEND != 0 && bytes > ch.small_bytes();
    if me == root && !direct && !root_zero_copy {
        // SAFETY: the slot holds `chunk` bytes; send holds `bytes`.
        unsafe { copy_block(send, ch.slot(me, p), bytes.min(chunk), pre) };
    }
    let (descs, _) = ch.begin(call, flags | ch.stage_flag(), so, ro, cx)?;
    let zero_copy = descs[root].flags & SHARED_SEND != 0 && bytes > ch.small_bytes();
    match single::verdict(ch, &descs) {
        Agreed::No => {}
        Agreed::Yes if single::verified(ch, call, &descs, cx)? => {
            return single::broadcast(ch, call, &descs, cx)
        }
        // Nothing written yet: run the call again, following rank 0's pick or staged.
        a => return run(ch, call, cx, attempt.next(a)),
    }
    let snt = ch.stage_agreed(call.kind, bytes, &descs, !zero_copy && n > 1);
    if me == root {
        // The staged path copies the rest chunk by chunk along with the staging, reading the
        // send buffer once. send and recv hold `bytes` each and are equal or disjoint.
        let own = if n == 1 || zero_copy {
            bytes
        } else {
            bytes.min(chunk)
        };
        ch.put(send, recv, own, nt);
    }
    if n == 1 {
        return Ok(());
    }
    if zero_copy {
        // In place the root has nothing of its own to copy; when every output lies in the
        // segment it writes the tail share of each (1/n of the message) while the others read
        // the rest, so every core copies (n - 1)/n instead of one core all of it. Out of place
        // the root already copies the whole message into its own output. Every rank decides
        // from the same descriptors, so all agree on the share.
        let outputs_shared = descs.iter().all(|d| d.flags & SHARED_RECV != 0);
        let in_place = descs[root].send_off == descs[root].recv_off;
        let share = if outputs_shared && in_place {
            single::push_share(bytes, n, true)
        } else {
            0
        };
        let head = bytes - share;
        if me == root {
            for j in (1..n).map(|s| (me + s) % n) {
                // SAFETY: (add) head + share = bytes, which the root's input and every output
                // (the descriptors agree on the count) hold; rank j's output lies in the segment
                // and nobody else writes its tail until the phase below.
                unsafe {
                    ch.put(
                        send.add(head),
                        ch.at(descs[j].recv_off).add(head),
                        share,
                        nt,
                    )
                };
            }
        } else {
            // The root's send buffer lies in the segment and holds `bytes`.
            ch.put(ch.at(descs[root].send_off), recv, head, nt);
        }
        ch.phase(cx)?;
        return Ok(());
    }
    let mut off = 0;
    loop {
        let len = chunk.min(bytes - off);
        if me != root {
            // SAFETY: (add) off + len <= bytes. The root staged `len` bytes of this chunk in its
            // slot of phase p.
            ch.put(ch.slot(root, p), unsafe { recv.add(off) }, len, nt);
        }
        off += len;
        if off >= bytes {
            break;
        }
        p = ch.next_phase();
        if me == root {
            // SAFETY: as above, next chunk, into the slot and the root's own output at once;
            // the slot is disjoint from both user buffers.
            unsafe {
                ch.put2(
                    send.add(off),
                    ch.slot(me, p),
                    snt,
                    recv.add(off),
                    nt,
                    chunk.min(bytes - off),
                )
            };
        }
        ch.phase(cx)?;
    }
    Ok(())
}
