//! Single-copy collectives on ordinary buffers: every rank copies what it needs straight between
//! its peers' user buffers and its own with cross-memory attach (`process_vm_readv` and
//! `process_vm_writev`, see `shm::direct`), instead of the peer staging it in its slot and the
//! reader copying it out (two copies, and when the two cores share no cache the staged lines
//! travel through memory twice).
//!
//! * broadcast: the root pushes a share of the message into every non-root's output while the
//!   non-roots pull the rest out of the root's input, so that the root's core copies too instead
//!   of idling (in place: a 1/n share, so every core copies about the same; out of place the root
//!   also copies the message into its own output, so its share is halved).
//! * all_gather and gather: every rank copies its block into its own output and pushes it into
//!   every receiver's: each rank reads its input once and from its own cache, and every core
//!   copies at once.
//! * reduce_scatter: each rank reads its block of every peer's input, piece by piece, into a
//!   scratch buffer that stays in cache, and reduces the pieces with its own in rank order.
//! * all_reduce: the same on its part of the message (as the staged reduce-scatter splits it),
//!   and each reduced piece, still in cache, is pushed into every peer's output at once: one
//!   pass over the data and no second phase.
//!
//! Why push rather than pull (`benches/baselines/cma_floor.c` measures both): reading
//! lines a peer has just written (modified in its cache) is the slowest transfer there is, and
//! writing into a peer's buffer from one's own cache is faster; with the peer's core pulling the
//! rest at the same time, both cores copy.
//!
//! Every reduction sums its sources in rank order 0..n with the same kernel as the staged paths,
//! so the bits are those of the staged path, on every rank, every run.
//!
//! Who takes this path: each rank offers it in its descriptor (`DIRECT`, with its buffers'
//! addresses) when its buffers are ordinary, the size is one where both paths may run
//! (`tune::direct_for`) and rank 0's tuner (`Channel::single`, `LOCKSTEP_SHM_SINGLE_COPY`) picks
//! it: rank 0 times both paths per collective and size class and keeps the faster, and the
//! others offer what rank 0 picked last for the class. The path runs when every rank offered it
//! from the same pid namespace. When only some offered (rank 0 changed its pick, another
//! configuration, shared buffers on some ranks), every rank runs the call again with a new first
//! phase (nothing was written yet), following rank 0's pick, and staged if they still differ. The first direct call of a
//! communicator probes every pair once (a one-byte read, and a one-byte write of the byte it
//! read back where it was) and agrees on the result in one phase; a refusal (Yama, seccomp)
//! makes every rank stage from then on. After a successful probe a failed copy is an error on
//! every rank; a dead peer is reported as such, by the phase, or after the verdict when it died
//! once it had published its own (see `gone_peer`).

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use super::part;
use crate::comm::{Call, CollKind, CommError};
use crate::shm::channel::{stage_group, Channel, Ctx};
use crate::shm::direct::{read_direct_io, write_direct_io};
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

/// Which attempt at a call this is: a call whose ranks offered differently runs again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Attempt {
    /// The first: rank 0's tuner picks the path, the others guess rank 0's last pick for the
    /// class (a wrong guess costs a second attempt, only when rank 0 changes its pick).
    First,
    /// After the ranks offered differently: each follows rank 0's pick, which all have now seen.
    Follow,
    /// Staged: the ranks cannot all take the single-copy path (buffers in the segment on some,
    /// a refused probe, or offers that differed twice).
    Staged,
}

impl Attempt {
    /// The attempt after this one ended with `verdict` (not `No`, and `Yes` only when the probe
    /// was refused).
    pub(crate) fn next(self, verdict: Agreed) -> Attempt {
        match (self, verdict) {
            (Attempt::First, Agreed::Mixed) => Attempt::Follow,
            _ => Attempt::Staged,
        }
    }
}

/// Whether this rank offers its buffers for direct reads in this call: `bytes` is the per-rank
/// message size the tuner judges by. A rank with either buffer in its shared heap does not
/// offer: shared buffers take the zero-copy paths. Where the sizes allow both paths, rank 0's
/// tuner (`Channel::single`) picks one and the others follow (see [`Attempt`], [`verdict`]).
pub(crate) fn offer(ch: &mut Channel, call: &Call, bytes: usize, attempt: Attempt) -> bool {
    let esz = call.dtype.size();
    let eligible = attempt != Attempt::Staged
        && ch.world() > 1
        && !ch.direct_refused
        && direct_for(
            bytes,
            ch.config().cma_bytes,
            ch.small_bytes(),
            ch.config().nt_bytes,
        )
        && ch
            .share_flags(call, call.send.len * esz, call.recv.len * esz)
            .0
            == 0;
    if !eligible {
        ch.single_class = None;
        return false;
    }
    let g = stage_group(call.kind);
    ch.single_class = Some((g, bytes));
    ch.start_clock();
    if ch.rank() == 0 && attempt == Attempt::First {
        ch.single.choose(g, bytes, Instant::now())
    } else {
        ch.single.guess(g, bytes)
    }
}

/// The verdict of every rank's descriptor, as [`agreed`]; for a call that could take either
/// path, every rank also learns rank 0's pick for the class and starts timing the call under the
/// path it takes (for rank 0's tuner, see `Channel::end_call`).
pub(crate) fn verdict(ch: &mut Channel, descs: &[Desc]) -> Agreed {
    let a = agreed(descs);
    if let Some((g, bytes)) = ch.single_class.take() {
        ch.single.seen(g, bytes, descs[0].flags & DIRECT != 0);
        if a != Agreed::Mixed {
            ch.single_timing = Some((g, bytes, a == Agreed::Yes, ch.pre_begin()));
        }
    }
    a
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
/// writes one byte of the peer's output back as it read it, and all agree on the outcome. False
/// (for good, on every rank) when a copy was refused.
///
/// Why both directions, whatever this call does: a seccomp filter may allow one of the two
/// system calls and not the other, and a later call of another kind may need the other. The
/// write puts back the value just read, while no rank writes that byte (data moves only after
/// the verdict), so the output is unchanged.
pub(crate) fn verified(
    ch: &mut Channel,
    call: &Call,
    descs: &[Desc],
    cx: Ctx,
) -> Result<bool, CommError> {
    if ch.direct_verified {
        return Ok(true);
    }
    let me = ch.rank();
    let mut ok = !ch.config().fault_refuse_direct;
    let mut probe = 0u8;
    let at = &mut probe as *mut u8 as usize;
    for r in (0..ch.world()).filter(|&r| r != me) {
        if !ok {
            break;
        }
        // Every rank offers a buffer of at least one byte (the tuner never picks an empty
        // message): its input, or its output for a broadcast's non-roots; and every rank has an
        // output of at least one byte but a gather's non-roots.
        let addr = if call.kind == CollKind::Broadcast && r != call.root {
            descs[r].recv_off
        } else {
            descs[r].send_off
        };
        let out = (call.kind != CollKind::Gather || r == call.root).then_some(descs[r].recv_off);
        let pid = pid(ch, r);
        let res = read_direct_io(pid, addr, at, 1).and_then(|_| {
            out.map_or(Ok(()), |o| {
                read_direct_io(pid, o, at, 1).and_then(|_| write_direct_io(pid, o, at, 1))
            })
        });
        if let Err(e) = res {
            tracing::debug!("a direct copy to or from {} was refused ({e})", ch.who(r));
            ok = false;
        }
    }
    match verdicts(ch, ok, cx)? {
        None => {
            ch.direct_verified = true;
            Ok(true)
        }
        Some(r) => {
            tracing::debug!(
                "{} could not copy to or from a peer's memory directly: collectives stage through the slots from now on",
                ch.who(r)
            );
            ch.direct_refused = true;
            // The call runs again, staged, and is not timed for the choice there is no more.
            ch.single_timing = None;
            Ok(false)
        }
    }
}

/// How long a rank whose copy failed waits to see whether a peer is gone.
const GONE_WAIT: Duration = Duration::from_millis(100);

/// A peer that is gone (`died` or left), waiting up to `GONE_WAIT` for one. Why wait: a copy that
/// fails after a successful probe almost always met a peer that is exiting. Its memory goes
/// (the copy fails with ESRCH) a moment before its process is seen dead, and it may have
/// published its verdict before it died, so the verdict phase completes: without the wait, the
/// ranks would report the failed copy instead of the death.
fn gone_peer(ch: &Channel) -> Option<(usize, bool)> {
    let until = Instant::now() + GONE_WAIT;
    loop {
        if let Some(gone) = (0..ch.world())
            .filter(|&k| k != ch.rank())
            .find_map(|k| ch.peer_gone(k).map(|died| (k, died)))
        {
            return Some(gone);
        }
        if Instant::now() >= until {
            return None;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The phase that ends a single-copy step: nobody reuses its buffers before every peer has read
/// them and written into them, and a failed copy fails the call on every rank.
fn conclude(
    ch: &mut Channel,
    call: &Call,
    err: Option<std::io::Error>,
    cx: Ctx,
) -> Result<(), CommError> {
    let Some(r) = verdicts(ch, err.is_none(), cx)? else {
        return Ok(());
    };
    if let Some((k, died)) = gone_peer(ch) {
        return Err(ch.peer_lost(k, died, cx.op, cx.seq));
    }
    let why = match err {
        Some(e) => format!(
            "a direct copy to or from a peer's buffer (process_vm_readv/writev) failed ({e})"
        ),
        None => format!(
            "{} could not copy to or from a peer's buffer (process_vm_readv/writev)",
            ch.who(r)
        ),
    };
    Err(CommError::Aborted {
        by: ch.global(r),
        reason: format!(
            "{why} in {} #{} after the direct-copy probe had succeeded, so the output is incomplete; restart the job, or set LOCKSTEP_SHM_CMA_BYTES=0 to stage every message",
            call.kind, cx.seq
        ),
    })
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

/// broadcast: the root pushes the tail share into every non-root's output, the non-roots pull
/// the rest out of the root's input.
pub(crate) fn broadcast(
    ch: &mut Channel,
    call: &Call,
    descs: &[Desc],
    cx: Ctx,
) -> Result<(), CommError> {
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
            if let Err(e) = write_direct_io(
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
        err = read_direct_io(pid(ch, root), descs[root].send_off, call.recv.addr, head).err();
    }
    conclude(ch, call, err, cx)
}

/// all_gather and gather: every rank copies its block into its own output (if it receives) and
/// pushes it into every other receiver's.
pub(crate) fn all_gather(
    ch: &mut Channel,
    call: &Call,
    descs: &[Desc],
    cx: Ctx,
) -> Result<(), CommError> {
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
        if let Err(e) = write_direct_io(
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

/// Read the elements `[shift, shift + len)` of every peer's input piece by piece into the scratch
/// buffer, and reduce them with ours in rank order into `out`. `own` is our input at element
/// `shift`, `out` our output at element `shift`. With `push` (all-reduce) each reduced piece,
/// still in cache, is also written into every peer's output at the same elements.
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
    push: bool,
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
    // Out of place, the first peer's piece lands in our output, where its result goes: one buffer
    // less in cache, and the reduction reads and writes the same lines. In place the output is
    // our own input, which must not be overwritten before it is reduced.
    let land = (!std::ptr::eq(own, out))
        .then(|| (0..n).find(|&k| k != me))
        .flatten();
    let mut srcs = vec![own; n];
    let mut off = 0;
    while off < len {
        let m = piece.min(len - off);
        let at = ((shift + off) * esz) as u64;
        // SAFETY: (add) `own` and `out` hold `len` elements from here (callers).
        let (src, dst) = unsafe { (own.add(off * esz), out.add(off * esz)) };
        for k in (0..n).filter(|&k| k != me) {
            let idx = if k < me { k } else { k - 1 };
            let to = if land == Some(k) {
                dst
            } else {
                // SAFETY: (add) within the scratch buffer: (n - 1) pieces of `piece` elements,
                // 8-byte aligned (a Vec<u64>), the alignment of every dtype's kernel.
                unsafe { scratch.add(idx * piece * esz) }
            };
            if let Err(e) = read_direct_io(pids[k], descs[k].send_off + at, to as usize, m * esz) {
                return Some(e);
            }
            srcs[k] = to;
        }
        srcs[me] = src;
        // SAFETY: every source holds m elements (scratch pieces or our output's piece filled
        // above, our own input); `dst` is exactly one source (our input in place, or the piece
        // that landed in it) and disjoint from the others (the scratch is ours alone; output and
        // input are equal or disjoint).
        unsafe { reduce_into(call.dtype, call.op, n, &srcs, &[Dst { ptr: dst, nt }], m) };
        if push {
            // Starting after ourselves spreads the writers over the peers.
            for k in (1..n).map(|s| (me + s) % n) {
                // Peer k's output holds the message; these elements are ours to write, and in
                // place (its output is its input) we have read them above and nobody else reads
                // them. It waits in `conclude` until we have written them.
                if let Err(e) =
                    write_direct_io(pids[k], descs[k].recv_off + at, dst as usize, m * esz)
                {
                    return Some(e);
                }
            }
        }
        off += m;
    }
    None
}

/// reduce_scatter: each rank reduces its block of every input, reading the peers' blocks.
pub(crate) fn reduce_scatter(
    ch: &mut Channel,
    call: &Call,
    descs: &[Desc],
    cx: Ctx,
) -> Result<(), CommError> {
    let (me, esz, c) = (ch.rank(), call.dtype.size(), call.count);
    let nt = ch.nt_for(c * esz);
    // SAFETY: (add) send holds n × c elements; block `me` starts at me × c.
    let own = unsafe { (call.send.addr as *const u8).add(me * c * esz) };
    let err = reduce_from_peers(
        ch,
        call,
        descs,
        me * c,
        c,
        own,
        call.recv.addr as *mut u8,
        nt,
        false,
    );
    conclude(ch, call, err, cx)
}

/// all_reduce: reduce our part (reduce-scatter), pushing every reduced piece into the peers'
/// outputs as it is done (all-gather), then one phase.
pub(crate) fn all_reduce(
    ch: &mut Channel,
    call: &Call,
    descs: &[Desc],
    cx: Ctx,
) -> Result<(), CommError> {
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
    let err = reduce_from_peers(ch, call, descs, lo, hi - lo, own, out, nt, true);
    conclude(ch, call, err, cx)
}
