//! broadcast: the root stages the message chunk by chunk in its slot and every other rank copies
//! it out; or, when the root's send buffer lives in the segment, everyone copies from it directly.

use super::single::{self, Agreed};
use crate::comm::{Call, CommError};
use crate::shm::channel::{Channel, Ctx};
use crate::shm::reduce::copy_block;
use crate::shm::sync::SHARED_SEND;

pub(crate) fn broadcast(ch: &mut Channel, call: &Call, cx: Ctx) -> Result<(), CommError> {
    run(ch, call, cx, true)
}

/// `allow_direct` false: the staged re-run of a call whose ranks did not all offer direct reads.
fn run(ch: &mut Channel, call: &Call, cx: Ctx, allow_direct: bool) -> Result<(), CommError> {
    let (n, me, esz) = (ch.world(), ch.rank(), call.dtype.size());
    let root = call.root;
    let bytes = call.count * esz;
    let send = call.send.addr as *const u8;
    let recv = call.recv.addr as *mut u8;
    let chunk = ch.slot_bytes();
    let nt = ch.nt_for(bytes);
    let (flags, so, ro) = ch.share_flags(call, if me == root { bytes } else { 0 }, 0);
    let direct = single::offer(ch, call, bytes, allow_direct);
    let (flags, so, ro) = if direct { single::offer_desc(call, flags) } else { (flags, so, ro) };
    let mut p = ch.next_phase();
    let pre = if direct { false } else { ch.stage_pre(call.kind, bytes) };
    if me == root && !direct {
        // SAFETY: the slot holds `chunk` bytes; send holds `bytes`.
        unsafe { copy_block(send, ch.slot(me, p), bytes.min(chunk), pre) };
    }
    let (descs, _) = ch.begin(call, flags | ch.stage_flag(), so, ro, cx)?;
    let zero_copy = descs[root].flags & SHARED_SEND != 0 && bytes > ch.small_bytes();
    match single::agreed(&descs) {
        Agreed::No => {}
        Agreed::Yes if single::verified(ch, call, &descs, cx)? => return single::broadcast(ch, call, &descs, cx),
        // Nothing written yet: run the call again, staged.
        _ => return run(ch, call, cx, false),
    }
    let snt = ch.stage_agreed(call.kind, bytes, &descs, !zero_copy && n > 1);
    if me == root {
        // The staged path copies the rest chunk by chunk along with the staging, reading the
        // send buffer once. send and recv hold `bytes` each and are equal or disjoint.
        let own = if n == 1 || zero_copy { bytes } else { bytes.min(chunk) };
        ch.put(send, recv, own, nt);
    }
    if n == 1 {
        return Ok(());
    }
    if zero_copy {
        if me != root {
            // The root's send buffer lies in the segment and holds `bytes`.
            ch.put(ch.at(descs[root].send_off), recv, bytes, nt);
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
            unsafe { ch.put2(send.add(off), ch.slot(me, p), snt, recv.add(off), nt, chunk.min(bytes - off)) };
        }
        ch.phase(cx)?;
    }
    Ok(())
}
