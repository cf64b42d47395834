//! broadcast, one body per path (`shm::path`):
//!
//! * inline: every rank copies the root's payload out of its inline entry.
//! * slots: the root writes the message chunk by chunk into its slot and every other rank copies
//!   it out.
//! * registered (the root's send buffer lies in the segment): everyone copies from it directly;
//!   in place with every output in the segment too, the root writes a share of every output.
//! * CMA: the root pushes a share of the message into every non-root's output while the
//!   non-roots pull the rest out of the root's input, so that the root's core copies too instead
//!   of idling (in place: a 1/n share, so every core copies about the same; out of place the root
//!   also copies the message into its own output, so its share is halved).
//!
//! Why push rather than pull (`benches/baselines/cma_floor.c` measures both): reading lines a
//! peer has just written (modified in its cache) is the slowest transfer there is, and writing
//! into a peer's buffer from one's own cache is faster; with the peer's core pulling the rest at
//! the same time, both cores copy.

use crate::comm::{Call, CommError};
use crate::shm::channel::{Channel, Ctx};
use crate::shm::cma::{read_io, write_io};
use crate::shm::inline;
use crate::shm::path::{conclude, negotiate, pid, Agreement, Offer, Path};
use crate::shm::reduce::copy_block;
use crate::shm::sync::{Desc, SHARED_RECV, SHARED_SEND};

/// Inline: copy the root's payload (on the root, its own send buffer).
pub(crate) fn inline(ch: &mut Channel, call: &Call, cx: Ctx) -> Result<(), CommError> {
    inline::put_payload(ch, call);
    inline::exchange(ch, call, cx)?;
    let block = call.count * call.dtype.size();
    // SAFETY: the root's entry (the root's send buffer, on the root) holds `block` bytes; recv
    // holds `block` and lies outside the entries, equal to send or disjoint.
    unsafe {
        copy_block(
            inline::src(ch, call, call.root),
            call.recv.addr as *mut u8,
            block,
            false,
        )
    };
    Ok(())
}

/// broadcast beyond the inline path: the ranks agree on the path, then run its body.
pub(crate) fn broadcast(ch: &mut Channel, call: &Call, cx: Ctx) -> Result<(), CommError> {
    let (me, root) = (ch.rank(), call.root);
    let bytes = call.count * call.dtype.size();
    let big = bytes > ch.one_phase_bytes();
    // The root's descriptor alone decides: the call is registered when the root's send buffer
    // lies in the segment.
    let takes_part = |r: usize, f: u8| r != root || f & SHARED_SEND != 0 && big;
    let offer = Offer {
        send_bytes: if me == root { bytes } else { 0 },
        // Every output is offered too: when the root's input and every output lie in the segment
        // and the root broadcasts in place, the root writes a share of each output itself.
        recv_bytes: bytes,
        cma_size: Some(bytes),
        stores_size: bytes,
        registered: &takes_part,
        skip_when_registered: false,
    };
    // The root knows from its own descriptor whether the call will be registered, and then
    // writes nothing into its slot: that first chunk would be copied for nobody (a whole 1 MiB
    // message, which cost a 1 MiB in-place broadcast on shared buffers 3x its time).
    let prestage = |ch: &Channel, p: u64, nt: bool, flags: u8| {
        if me == root && !takes_part(root, flags) {
            // SAFETY: the slot holds `slot_bytes` bytes; send holds `bytes`.
            unsafe {
                copy_block(
                    call.send.addr as *const u8,
                    ch.slot(me, p),
                    bytes.min(ch.slot_bytes()),
                    nt,
                )
            };
        }
        0
    };
    let agreed = negotiate(ch, call, cx, &offer, &prestage)?;
    match agreed.path {
        Path::Cma => cma(ch, call, &agreed.descs, cx),
        Path::Registered => registered(ch, call, &agreed.descs, cx),
        _ => slots(ch, call, &agreed, cx),
    }
}

/// Slots: chunk by chunk through the root's slot; the first chunk was written before `begin`.
fn slots(ch: &mut Channel, call: &Call, agreed: &Agreement, cx: Ctx) -> Result<(), CommError> {
    let (n, me, root) = (ch.world(), ch.rank(), call.root);
    let bytes = call.count * call.dtype.size();
    let send = call.send.addr as *const u8;
    let recv = call.recv.addr as *mut u8;
    let chunk = ch.slot_bytes();
    let nt = ch.nt_for(bytes);
    let snt = agreed.streaming;
    let mut p = agreed.phase;
    if me == root {
        // The rest is copied chunk by chunk along with the slot writes, reading the send buffer
        // once. send and recv hold `bytes` each and are equal or disjoint.
        let own = if n == 1 { bytes } else { bytes.min(chunk) };
        ch.put(send, recv, own, nt);
    }
    if n == 1 {
        return Ok(());
    }
    let mut off = 0;
    loop {
        let len = chunk.min(bytes - off);
        if me != root {
            // SAFETY: (add) off + len <= bytes. The root wrote `len` bytes of this chunk in its
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

/// Registered: the non-roots copy from the root's send buffer in the segment; in place with
/// every output in the segment, the root writes the tail share of each.
fn registered(ch: &mut Channel, call: &Call, descs: &[Desc], cx: Ctx) -> Result<(), CommError> {
    let (n, me, root) = (ch.world(), ch.rank(), call.root);
    let bytes = call.count * call.dtype.size();
    let send = call.send.addr as *const u8;
    let recv = call.recv.addr as *mut u8;
    let nt = ch.nt_for(bytes);
    if me == root {
        // send and recv hold `bytes` each and are equal or disjoint.
        ch.put(send, recv, bytes, nt);
    }
    if n == 1 {
        return Ok(());
    }
    // In place the root has nothing of its own to copy; when every output lies in the segment
    // it writes the tail share of each (1/n of the message) while the others read the rest, so
    // every core copies (n - 1)/n instead of one core all of it. Out of place the root already
    // copies the whole message into its own output. Every rank decides from the same
    // descriptors, so all agree on the share.
    let outputs_shared = descs.iter().all(|d| d.flags & SHARED_RECV != 0);
    let in_place = descs[root].send_off == descs[root].recv_off;
    let share = if outputs_shared && in_place {
        push_share(bytes, n, true)
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
    Ok(())
}

/// Bytes of a broadcast of `bytes` that the root pushes into every non-root's output (the tail of
/// the message); the non-roots pull the rest. In place the root has nothing else to copy, so a
/// 1/n share gives every core (n - 1)/n of the message. Out of place the root also copies the
/// whole message into its own output, so every core already copies about as much as the others
/// without pushing; but its local copy is quicker than a peer's pull of lines that are in the
/// root's cache, and a 1/(2n) share was faster than none, both on the benchmark's unchanging
/// input and on a freshly written one (`benches/baselines/cma_floor.c`). Rounded down to whole
/// cache lines.
pub(crate) fn push_share(bytes: usize, n: usize, in_place: bool) -> usize {
    let share = if in_place { bytes / n } else { bytes / (2 * n) };
    share / 64 * 64
}

/// CMA: the root pushes the tail share into every non-root's output, the non-roots pull
/// the rest out of the root's input.
fn cma(ch: &mut Channel, call: &Call, descs: &[Desc], cx: Ctx) -> Result<(), CommError> {
    let (n, me, root) = (ch.world(), ch.rank(), call.root);
    let bytes = call.count * call.dtype.size();
    // Every rank reads the root's addresses from its descriptor, so all agree on the share.
    let share = push_share(bytes, n, descs[root].send_off == descs[root].recv_off);
    let head = bytes - share;
    let mut err = None;
    if me == root {
        for j in (1..n).map(|s| (me + s) % n) {
            // Every non-root's output holds `bytes` (the descriptors agree on the count), and it
            // waits in `conclude` until we have written it.
            if let Err(e) = write_io(
                pid(ch, j),
                descs[j].recv_off + head as u64,
                call.send.addr + head,
                share,
            ) {
                err = Some(e);
                break;
            }
        }
        // send and recv hold `bytes` each and are equal or disjoint.
        ch.put(
            call.send.addr as *const u8,
            call.recv.addr as *mut u8,
            bytes,
            ch.nt_for(bytes),
        );
    } else {
        // The root's send holds `bytes`; it waits in `conclude` until we have read it.
        err = read_io(pid(ch, root), descs[root].send_off, call.recv.addr, head).err();
    }
    conclude(ch, call, err, cx)
}
