//! all_gather and gather, one body per path (`shm::path`):
//!
//! * inline: every receiver copies every rank's payload out of its inline entry.
//! * slots: every rank writes its block chunk by chunk into its slot and the receivers copy every
//!   peer's block out (an all-gather of one chunk out of place writes its slot after the
//!   descriptors, in one pass with its own block: [`late_slots`]).
//! * registered (every send buffer lies in the segment): the receivers copy from them directly.
//! * CMA: every rank copies its block into its own output and pushes it into every receiver's:
//!   each rank reads its input once and from its own cache, and every core copies at once.

use crate::comm::{Call, CollKind, CommError};
use crate::shm::channel::{Channel, Ctx};
use crate::shm::cma::write_io;
use crate::shm::inline;
use crate::shm::path::{conclude, negotiate, pid, Agreement, Offer, Path};
use crate::shm::reduce::copy_block;
use crate::shm::sync::{Desc, LATE_SLOT, SHARED_SEND};

/// Inline: every receiver copies every rank's payload into its block of the output.
pub(crate) fn inline(ch: &mut Channel, call: &Call, cx: Ctx) -> Result<(), CommError> {
    inline::put_payload(ch, call);
    inline::exchange(ch, call, cx)?;
    let (n, me) = (ch.world(), ch.rank());
    if call.count == 0 || call.kind == CollKind::Gather && me != call.root {
        return Ok(());
    }
    let block = call.count * call.dtype.size();
    let recv = call.recv.addr as *mut u8;
    for r in 0..n {
        // SAFETY: entry r (send, for this rank) holds `block` bytes; recv holds n*block on
        // receivers; in place, send is block `me` of recv.
        unsafe { copy_block(inline::src(ch, call, r), recv.add(r * block), block, false) };
    }
    Ok(())
}

/// all_gather and gather beyond the inline path (`call.kind` tells which; only the root receives
/// a gather): the ranks agree on the path, then run its body.
pub(crate) fn all_gather(ch: &mut Channel, call: &Call, cx: Ctx) -> Result<(), CommError> {
    let (n, me, esz) = (ch.world(), ch.rank(), call.dtype.size());
    let all = call.kind == CollKind::AllGather;
    let bytes = call.count * esz;
    let send = call.send.addr as *const u8;
    let recv = call.recv.addr as *mut u8;
    let chunk = ch.slot_bytes();
    let big = bytes > ch.one_phase_bytes();
    let takes_part = |_: usize, f: u8| f & SHARED_SEND != 0 && big;
    let offer = Offer {
        send_bytes: bytes,
        recv_bytes: 0,
        cma_size: Some(bytes),
        stores_size: bytes,
        registered: &takes_part,
        skip_when_registered: true,
    };
    // Out of place, an all-gather of one chunk on the slots writes its slot after the
    // descriptors, in one pass with its own block (see `late_slots`). In place there is nothing
    // to fuse, and writing the slot before `begin` overlaps with the peers' arrival. Ranks may
    // differ; each says which in its descriptor. (wrapping_add: the address is only compared.)
    let own_in_place = std::ptr::eq(send, recv.wrapping_add(me * bytes));
    let late = all && n > 1 && bytes <= chunk && !own_in_place;
    let prestage = |ch: &Channel, p: u64, nt: bool, _: u8| {
        if late {
            return LATE_SLOT;
        }
        // SAFETY: the slot holds `chunk` bytes; send holds `bytes`.
        unsafe { copy_block(send, ch.slot(me, p), bytes.min(chunk), nt) };
        0
    };
    let agreed = negotiate(ch, call, cx, &offer, &prestage)?;
    match agreed.path {
        Path::Cma => cma(ch, call, &agreed.descs, cx),
        Path::Registered => registered(ch, call, &agreed.descs, cx),
        _ if agreed.descs.iter().any(|d| d.flags & LATE_SLOT != 0) => {
            late_slots(ch, call, &agreed, cx)
        }
        _ => slots(ch, call, &agreed, cx),
    }
}

/// Slots: chunk by chunk through every rank's slot; the first chunks were written before
/// `begin`.
fn slots(ch: &mut Channel, call: &Call, agreed: &Agreement, cx: Ctx) -> Result<(), CommError> {
    let (n, me, esz) = (ch.world(), ch.rank(), call.dtype.size());
    let receives = call.kind == CollKind::AllGather || me == call.root;
    let bytes = call.count * esz;
    let send = call.send.addr as *const u8;
    let recv = call.recv.addr as *mut u8;
    let chunk = ch.slot_bytes();
    let nt = ch.nt_for(bytes * n);
    let snt = agreed.streaming;
    let mut p = agreed.phase;
    // Our own block: copied chunk by chunk along with the slot writes.
    let own = if receives {
        // SAFETY: (add) recv holds n*bytes on receivers.
        Some(unsafe { recv.add(me * bytes) })
    } else {
        None
    };
    if let Some(own) = own {
        // send is either disjoint from our block or exactly it.
        ch.put(send, own, if n == 1 { bytes } else { bytes.min(chunk) }, nt);
    }
    if n == 1 {
        return Ok(());
    }
    let mut off = 0;
    loop {
        let len = chunk.min(bytes - off);
        if receives {
            for j in (0..n).filter(|&j| j != me) {
                // SAFETY: (add) within recv. Peer j wrote `len` bytes of this chunk in its slot.
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

/// Registered: every receiver copies every block straight from the senders' buffers in the
/// segment, then one phase.
fn registered(ch: &mut Channel, call: &Call, descs: &[Desc], cx: Ctx) -> Result<(), CommError> {
    let (n, me, esz) = (ch.world(), ch.rank(), call.dtype.size());
    let receives = call.kind == CollKind::AllGather || me == call.root;
    let bytes = call.count * esz;
    let recv = call.recv.addr as *mut u8;
    let nt = ch.nt_for(bytes * n);
    if receives {
        // SAFETY: (add) recv holds n*bytes on receivers; send is either disjoint from our block
        // or exactly it.
        ch.put(
            call.send.addr as *const u8,
            unsafe { recv.add(me * bytes) },
            bytes,
            nt,
        );
    }
    if n == 1 {
        return Ok(());
    }
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
    Ok(())
}

/// Slots, for an all-gather of one chunk in which some rank writes its slot after the descriptors
/// (`LATE_SLOT`: its block is out of place). Every rank first copies out the blocks that were
/// written before `begin` (in the slots of phase `p0`, which must be read before this rank
/// publishes another phase) and its own block if it wrote its slot early. Then each late rank writes its
/// block and copies it into its own output in one pass over its input, and after one phase every
/// rank copies the late blocks out.
///
/// Why after the descriptors: the one-pass copy writes the output, which must stay untouched
/// when the call fails its argument check. The phase it costs is a fraction of a microsecond;
/// the pass saves a read of the input (figures at `reduce::copy_block2`).
fn late_slots(ch: &mut Channel, call: &Call, agreed: &Agreement, cx: Ctx) -> Result<(), CommError> {
    let (n, me) = (ch.world(), ch.rank());
    let bytes = call.count * call.dtype.size();
    let (descs, p0, snt) = (&agreed.descs, agreed.phase, agreed.streaming);
    let nt = ch.nt_for(bytes * n);
    let (send, recv) = (call.send.addr as *const u8, call.recv.addr as *mut u8);
    let late = |j: usize| descs[j].flags & LATE_SLOT != 0;
    // Starting after ourselves spreads the readers over the slots.
    let peers = || (1..n).map(move |s| (me + s) % n);
    // SAFETY: (add) recv holds n × bytes on every rank of an all-gather; block j is rank j's.
    let block = |j: usize| unsafe { recv.add(j * bytes) };
    if !late(me) {
        // In place (or exactly our block): nothing to copy.
        ch.put(send, block(me), bytes, nt);
    }
    for j in peers().filter(|&j| !late(j)) {
        // Peer j put its `bytes` in its slot of phase p0 before `begin`.
        ch.put(ch.slot(j, p0), block(j), bytes, nt);
    }
    // The late slots alternate from one call to the next, as the other slots paths do (those
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
        // SAFETY: our block of recv holds `bytes` and is disjoint from send (LATE_SLOT). The
        // slot of phase p holds slot_bytes >= bytes, is disjoint from the user buffers, and
        // every peer finished reading it before it published the phase before p, which we passed.
        unsafe { ch.put2(send, ch.slot(me, p), snt, block(me), nt, bytes) };
    }
    ch.phase(cx)?;
    for j in peers().filter(|&j| late(j)) {
        // Peer j put its `bytes` in its slot of phase p.
        ch.put(ch.slot(j, p), block(j), bytes, nt);
    }
    Ok(())
}

/// CMA: every rank copies its block into its own output (if it receives) and pushes it into every other receiver's.
fn cma(ch: &mut Channel, call: &Call, descs: &[Desc], cx: Ctx) -> Result<(), CommError> {
    let (n, me) = (ch.world(), ch.rank());
    let bytes = call.count * call.dtype.size();
    let all = call.kind == CollKind::AllGather;
    let mut err = None;
    if all || me == call.root {
        // SAFETY: (add) recv holds n × bytes on receivers; send is our block or disjoint from it.
        ch.put(
            call.send.addr as *const u8,
            unsafe { (call.recv.addr as *mut u8).add(me * bytes) },
            bytes,
            ch.nt_for(n * bytes),
        );
    }
    // Starting after ourselves spreads the writers over the receivers.
    for j in (1..n)
        .map(|s| (me + s) % n)
        .filter(|&j| all || j == call.root)
    {
        // Receiver j's output holds n × bytes and block `me` is ours to write; j waits in
        // `conclude` until we have.
        if let Err(e) = write_io(
            pid(ch, j),
            descs[j].recv_off + (me * bytes) as u64,
            call.send.addr,
            bytes,
        ) {
            err = Some(e);
            break;
        }
    }
    conclude(ch, call, err, cx)
}
