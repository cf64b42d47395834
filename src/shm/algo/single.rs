//! Single-copy collectives on ordinary buffers: every rank reads what it needs straight out of its
//! peers' user buffers with cross-memory attach (`process_vm_readv`, see `shm::direct`), instead of
//! the peer staging it in its slot and the reader copying it out (two copies, and when the two
//! cores share no cache the staged lines travel through memory twice).
//!
//! * broadcast: the non-roots read the root's send buffer into their output.
//! * all_gather and gather: the receivers read every peer's block.
//! * reduce_scatter: each rank reads its block of every peer's input, piece by piece, into a
//!   scratch buffer that stays in cache, and reduces the pieces with its own in rank order.
//! * all_reduce: the same on its part of the message (as the staged reduce-scatter splits it),
//!   then, after one phase, each rank reads the peers' reduced parts out of their outputs.
//!
//! Every reduction sums its sources in rank order 0..n with the same kernel as the staged paths,
//! so the bits are those of the staged path, on every rank, every run.
//!
//! Who takes this path: each rank offers it in its descriptor (`DIRECT`, with its buffers'
//! addresses) when its buffers are ordinary and the tuner (`tune::direct_for`) picks it for the
//! size; the path runs when every rank offered it from the same pid namespace. When only some
//! offered (another configuration, shared buffers on some ranks), every rank runs the call again
//! staged, with a new first phase: nothing was written yet. The first direct call of a
//! communicator probes every pair once (a one-byte read) and agrees on the result in one phase;
//! a refusal (Yama, seccomp) makes every rank stage from then on. After a successful probe a
//! failed read is an error on every rank (a dead peer is reported as such by the phase).

use std::sync::atomic::Ordering::Relaxed;

use super::part;
use crate::comm::{Call, CollKind, CommError};
use crate::shm::channel::{Channel, Ctx};
use crate::shm::direct::read_direct_io;
use crate::shm::reduce::{reduce_into, Dst};
use crate::shm::sync::{Desc, DIRECT};
use crate::shm::tune::direct_for;

/// Bytes of each peer's piece in a single-copy reduction: small enough that the pieces are still
/// in the core's L2 cache when they are reduced, large enough that the system call and the page
/// pinning of each read are a small share of the copy.
const PIECE: usize = 128 << 10;

/// What the descriptors say about the single-copy path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Agreed {
    /// Nobody offered it: stage.
    No,
    /// Everybody did, from one pid namespace: take it (after the first call's probe).
    Yes,
    /// Some did: every rank runs the call again, staged.
    Mixed,
}

/// Whether this rank offers its buffers for direct reads in this call: `bytes` is the per-rank
/// message size the tuner judges by, `allow` false on the staged re-run of a mixed call. A rank
/// with either buffer in its shared heap does not offer: shared buffers take the zero-copy paths.
pub(crate) fn offer(ch: &Channel, call: &Call, bytes: usize, allow: bool) -> bool {
    let esz = call.dtype.size();
    allow
        && ch.world() > 1
        && !ch.direct_refused
        && direct_for(bytes, ch.config().cma_bytes, ch.small_bytes(), ch.config().nt_bytes)
        && ch.share_flags(call, call.send.len * esz, call.recv.len * esz).0 == 0
}

/// Descriptor flags and offsets of a rank that offers its buffers: their addresses in its own
/// memory.
pub(crate) fn offer_desc(call: &Call, flags: u8) -> (u8, u64, u64) {
    (flags | DIRECT, call.send.addr as u64, call.recv.addr as u64)
}

/// The verdict of every rank's descriptor (the same on every rank: they all read the same ones).
pub(crate) fn agreed(descs: &[Desc]) -> Agreed {
    let offered = descs.iter().filter(|d| d.flags & DIRECT != 0).count();
    if offered == 0 {
        Agreed::No
    } else if offered == descs.len() && descs.iter().all(|d| d.pidns == descs[0].pidns) {
        Agreed::Yes
    } else {
        Agreed::Mixed
    }
}

fn pid(ch: &Channel, r: usize) -> u64 {
    ch.ctrl(r).pid.load(Relaxed) as u64
}

/// One phase in which every rank says whether its reads succeeded; returns the first rank whose
/// did not (the same on every rank).
fn verdicts(ch: &mut Channel, ok: bool, cx: Ctx) -> Result<Option<usize>, CommError> {
    let (n, me) = (ch.world(), ch.rank());
    let p = ch.next_phase();
    // SAFETY: our own slot of the next phase: every peer finished reading it (two phases ago)
    // before publishing the phase we have passed; 8 bytes fit in any slot; nobody reads it
    // before we publish p.
    unsafe { (ch.slot(me, p) as *mut u64).write(ok as u64) };
    ch.phase(cx)?;
    // SAFETY: every rank wrote its verdict in its slot of phase p before publishing it, and
    // writes that slot again only after everyone has published p + 1.
    Ok((0..n).find(|&r| unsafe { (ch.slot(r, p) as *const u64).read() } != 1))
}

/// First use on this communicator: every rank reads one byte of each peer's offered buffer, and
/// all agree on the outcome. False (for good, on every rank) when a read was refused.
pub(crate) fn verified(ch: &mut Channel, call: &Call, descs: &[Desc], cx: Ctx) -> Result<bool, CommError> {
    if ch.direct_verified {
        return Ok(true);
    }
    let me = ch.rank();
    let mut ok = !ch.config().fault_refuse_direct;
    let mut probe = 0u8;
    for r in (0..ch.world()).filter(|&r| r != me) {
        if !ok {
            break;
        }
        // Every rank offers a buffer of at least one byte (the tuner never picks an empty
        // message): its input, or its output for a broadcast's non-roots.
        let addr = if call.kind == CollKind::Broadcast && r != call.root { descs[r].recv_off } else { descs[r].send_off };
        if let Err(e) = read_direct_io(pid(ch, r), addr, &mut probe as *mut u8 as usize, 1) {
            tracing::debug!("process_vm_readv from {} refused ({e})", ch.who(r));
            ok = false;
        }
    }
    match verdicts(ch, ok, cx)? {
        None => {
            ch.direct_verified = true;
            Ok(true)
        }
        Some(r) => {
            tracing::debug!("{} could not read a peer's memory directly: collectives stage through the slots from now on", ch.who(r));
            ch.direct_refused = true;
            Ok(false)
        }
    }
}

/// The phase that ends a single-copy step: nobody reuses its buffers before every peer has read
/// them, and a failed read fails the call on every rank.
fn conclude(ch: &mut Channel, call: &Call, err: Option<std::io::Error>, cx: Ctx) -> Result<(), CommError> {
    let Some(r) = verdicts(ch, err.is_none(), cx)? else {
        return Ok(());
    };
    let why = match err {
        Some(e) => format!("process_vm_readv from a peer's buffer failed ({e})"),
        None => format!("{} could not read a peer's buffer (process_vm_readv)", ch.who(r)),
    };
    Err(CommError::Aborted {
        by: ch.global(r),
        reason: format!(
            "{why} in {} #{} after the direct-copy probe had succeeded, so the output is incomplete; restart the job, or set LOCKSTEP_SHM_CMA_BYTES=0 to stage every message",
            call.kind, cx.seq
        ),
    })
}

/// broadcast: the non-roots read the root's input into their output.
pub(crate) fn broadcast(ch: &mut Channel, call: &Call, descs: &[Desc], cx: Ctx) -> Result<(), CommError> {
    let (me, root) = (ch.rank(), call.root);
    let bytes = call.count * call.dtype.size();
    let mut err = None;
    if me == root {
        // send and recv hold `bytes` each and are equal or disjoint.
        ch.put(call.send.addr as *const u8, call.recv.addr as *mut u8, bytes, ch.nt_for(bytes));
    } else {
        // The root's send holds `bytes` (its communicator checked it, the descriptors agree on the
        // count); it waits in `conclude` until we have read it.
        err = read_direct_io(pid(ch, root), descs[root].send_off, call.recv.addr, bytes).err();
    }
    conclude(ch, call, err, cx)
}

/// all_gather and gather: the receivers read every peer's block into theirs.
pub(crate) fn all_gather(ch: &mut Channel, call: &Call, descs: &[Desc], cx: Ctx) -> Result<(), CommError> {
    let (n, me) = (ch.world(), ch.rank());
    let bytes = call.count * call.dtype.size();
    let mut err = None;
    if call.kind == CollKind::AllGather || me == call.root {
        // SAFETY: (add) recv holds n × bytes on receivers; send is our block or disjoint from it.
        ch.put(call.send.addr as *const u8, unsafe { (call.recv.addr as *mut u8).add(me * bytes) }, bytes, ch.nt_for(n * bytes));
        // Starting after ourselves spreads the readers over the peers.
        for j in (1..n).map(|s| (me + s) % n) {
            // Peer j's send holds `bytes`; our block j lies in recv.
            if let Err(e) = read_direct_io(pid(ch, j), descs[j].send_off, call.recv.addr + j * bytes, bytes) {
                err = Some(e);
                break;
            }
        }
    }
    conclude(ch, call, err, cx)
}

/// Read the elements `[at, at + len)` of every peer's buffer at `base[k] + shift` (in elements)
/// piece by piece into the scratch buffer, and reduce them with ours in rank order into `out`.
/// `own` is our input at element `at`, `out` our output at element `at`.
#[allow(clippy::too_many_arguments)]
fn reduce_from_peers(
    ch: &mut Channel,
    call: &Call,
    descs: &[Desc],
    shift: usize,
    len: usize,
    own: *const u8,
    out: *mut u8,
    nt: bool,
) -> Option<std::io::Error> {
    let (n, me, esz) = (ch.world(), ch.rank(), call.dtype.size());
    let unit = (64 / esz).max(1);
    let piece = (PIECE / esz / unit * unit).max(unit);
    let need = ((n - 1) * piece * esz).div_ceil(8);
    if ch.scratch.len() < need {
        ch.scratch.resize(need, 0);
    }
    let scratch = ch.scratch.as_mut_ptr() as *mut u8;
    let pids: Vec<u64> = (0..n).map(|k| pid(ch, k)).collect();
    let mut srcs = vec![own; n];
    let mut off = 0;
    while off < len {
        let m = piece.min(len - off);
        for k in (0..n).filter(|&k| k != me) {
            let idx = if k < me { k } else { k - 1 };
            // SAFETY: (add) within the scratch buffer: (n - 1) pieces of `piece` elements, 8-byte
            // aligned (a Vec<u64>), the alignment of every dtype's kernel.
            let to = unsafe { scratch.add(idx * piece * esz) };
            let from = descs[k].send_off + ((shift + off) * esz) as u64;
            if let Err(e) = read_direct_io(pids[k], from, to as usize, m * esz) {
                return Some(e);
            }
            srcs[k] = to;
        }
        // SAFETY: (add) `own` and `out` hold `len` elements from here (callers).
        srcs[me] = unsafe { own.add(off * esz) };
        // SAFETY: every source holds m elements (scratch pieces filled above, our own input);
        // `out` holds `len` elements and is either our own source exactly (in place) or disjoint
        // from every source (the scratch is ours alone).
        unsafe { reduce_into(call.dtype, call.op, n, &srcs, &[Dst { ptr: out.add(off * esz), nt }], m) };
        off += m;
    }
    None
}

/// reduce_scatter: each rank reduces its block of every input, reading the peers' blocks.
pub(crate) fn reduce_scatter(ch: &mut Channel, call: &Call, descs: &[Desc], cx: Ctx) -> Result<(), CommError> {
    let (me, esz, c) = (ch.rank(), call.dtype.size(), call.count);
    let nt = ch.nt_for(c * esz);
    // SAFETY: (add) send holds n × c elements; block `me` starts at me × c.
    let own = unsafe { (call.send.addr as *const u8).add(me * c * esz) };
    let err = reduce_from_peers(ch, call, descs, me * c, c, own, call.recv.addr as *mut u8, nt);
    conclude(ch, call, err, cx)
}

/// all_reduce: reduce our part (reduce-scatter), one phase, then read the peers' reduced parts
/// out of their outputs (all-gather).
pub(crate) fn all_reduce(ch: &mut Channel, call: &Call, descs: &[Desc], cx: Ctx) -> Result<(), CommError> {
    let (n, me, esz, count) = (ch.world(), ch.rank(), call.dtype.size(), call.count);
    let unit = (64 / esz).max(1);
    let nt = ch.nt_for(count * esz);
    let (lo, hi) = part(count, n, me, unit);
    // SAFETY: (add) send and recv hold `count` elements; lo <= count.
    let (own, out) = unsafe { ((call.send.addr as *const u8).add(lo * esz), (call.recv.addr as *mut u8).add(lo * esz)) };
    // Peers read only their own parts of our input here, and we write only ours of our output,
    // so an in-place call (send = recv) is safe.
    let err = reduce_from_peers(ch, call, descs, lo, hi - lo, own, out, nt);
    conclude(ch, call, err, cx)?;
    // Every part is reduced; every peer has finished reading our input, so writing its parts of
    // our output (in place: of our input) is safe now.
    let mut err = None;
    for j in (1..n).map(|s| (me + s) % n) {
        let (lo, hi) = part(count, n, j, unit);
        if hi > lo {
            // Peer j's output holds its reduced part [lo, hi); ours has room for it.
            if let Err(e) = read_direct_io(pid(ch, j), descs[j].recv_off + (lo * esz) as u64, call.recv.addr + lo * esz, (hi - lo) * esz) {
                err = Some(e);
                break;
            }
        }
    }
    conclude(ch, call, err, cx)
}
