//! The inline path's mechanism: every collective whose per-rank payload is at most
//! `ShmConfig::fast_bytes` (4 KiB by default), and every barrier, in one exchange without a
//! phase, through the ranks' inline entries (see `sync::InlineHdr`). The collectives' inline
//! bodies (`shm::coll`) write nothing but their payload ([`put_payload`]), call [`exchange`], and
//! read the peers' payloads ([`src`]).
//!
//! Why: for small messages the cost is the number of cache lines that cross between cores, one
//! after the other, not the bytes. A path with phases moves a progress line, a descriptor line and
//! the slot's lines; here a rank writes its call's arguments, its payload and the call's number
//! side by side in its own entry, so a peer that sees the number has the arguments and up to 40
//! bytes of data in the same line (hence the name: the data is inline with the arguments). Every rank waits for every peer's entry (even a broadcast's
//! root), because that is what lets every rank compare the arguments and report a disagreement
//! as the same [`CommError::Mismatch`] everywhere, and what keeps an entry unread before its owner
//! rewrites it two calls later.
//!
//! Reductions read the entries in rank order 0..n, so every rank gets the same bits, as on the
//! other paths.
//!
//! After the exchange a rank never reads its own entry back: its own payload comes from the
//! caller's send buffer, its own arguments from the call. Why: a peer that read the entry took
//! the line with it (CPUs that hand a modified line to its reader outright, as a migratory line,
//! do), and reading it back costs one more crossing between cores after the exchange, a large
//! part of the exchange's own cost (`benches/baselines/xfloor.c`'s `own` protocol measures it).

use std::sync::atomic::Ordering::{Acquire, Release};

use crate::comm::{check, Call, CollKind, CommError};
use crate::shm::channel::{Channel, Ctx};
use crate::shm::check::{check_descs, same_call};
use crate::shm::reduce::{copy_block, reduce_checked, scan_finite, Dst, Found};
use crate::shm::sync::{Desc, InlineHdr, FINITE, INLINE_HDR};

/// Bytes of the payload rank `me` of `n` writes into its entry for `call`: what it reads from its
/// send buffer (the shared table's [`check::need`]), or `None` when the call has no inline path
/// (the v-variants, point-to-point) or the size overflows.
fn payload(call: &Call, n: usize, me: usize) -> Option<usize> {
    check::need(call.kind, call.count, n, me, call.root)?
        .send
        .checked_mul(call.dtype.size())
}

/// The size that decides the path: the largest payload any rank writes for this call, the same
/// on every rank when the arguments agree.
fn decisive(call: &Call, n: usize) -> Option<usize> {
    match call.kind {
        CollKind::Broadcast | CollKind::Scatter => payload(call, n, call.root),
        _ => payload(call, n, 0),
    }
}

/// Whether `call` takes the inline path on this channel.
pub(crate) fn eligible(ch: &Channel, call: &Call) -> bool {
    call.kind == CollKind::Barrier
        || decisive(call, ch.world()).is_some_and(|b| b <= ch.inline_bytes())
}

/// The head of rank `r`'s inline entry for collective number `seq`.
#[inline]
fn hdr(ch: &Channel, r: usize, seq: u64) -> *mut InlineHdr {
    // SAFETY: inline entries lie inside the mapping by construction of the layout, 64-aligned.
    unsafe { ch.seg().base().add(ch.layout().inline_entry_off(r, seq)) as *mut InlineHdr }
}

/// The payload of rank `r`'s inline entry for the current collective (`INLINE_MAX` bytes).
/// This rank writes its own before [`exchange`]; peers' entries may be read after it, until
/// this rank's next collective returns.
#[inline]
pub(crate) fn data(ch: &Channel, r: usize) -> *mut u8 {
    // SAFETY: the payload follows the head inside the entry (INLINE_HDR + INLINE_MAX <=
    // INLINE_ENTRY).
    unsafe { (hdr(ch, r, ch.seq()) as *mut u8).add(INLINE_HDR) }
}

#[inline]
fn entry_seq(ch: &Channel, r: usize) -> u64 {
    // SAFETY: the head is in the mapping; `seq` is an atomic that only its owner writes.
    unsafe { (*hdr(ch, r, ch.seq())).seq.load(Acquire) }
}

/// Copy this rank's payload for `call` (see [`payload`]) into its entry: the first step of every
/// inline body, before [`exchange`].
#[inline]
pub(crate) fn put_payload(ch: &Channel, call: &Call) {
    let mine = payload(call, ch.world(), ch.rank()).unwrap_or(0);
    // SAFETY: our entry's payload holds INLINE_MAX >= fast_bytes >= mine bytes (eligible); send
    // holds `mine` bytes (checked by Communicator for the kind) and lies outside the segment's
    // entries.
    unsafe {
        copy_block(
            call.send.addr as *const u8,
            data(ch, ch.rank()),
            mine,
            false,
        )
    };
}

/// Rank `r`'s payload after the exchange: its entry, or for this rank the send buffer it was
/// copied from (never the own entry, see the module docs).
#[inline]
pub(crate) fn src(ch: &Channel, call: &Call, r: usize) -> *const u8 {
    if r == ch.rank() {
        call.send.addr as *const u8
    } else {
        data(ch, r) as *const u8
    }
}

/// Run `f` on every rank's payload at byte `off`, in rank order.
fn with_srcs<R>(ch: &Channel, call: &Call, off: usize, f: impl FnOnce(&[*const u8]) -> R) -> R {
    let n = ch.world();
    let mut buf = [std::ptr::null::<u8>(); 16];
    let mut big = Vec::new();
    let srcs: &mut [*const u8] = if n <= buf.len() {
        &mut buf[..n]
    } else {
        big.resize(n, std::ptr::null());
        &mut big
    };
    for (r, s) in srcs.iter_mut().enumerate() {
        // SAFETY: (add) every entry and the send buffer hold the rank's whole input,
        // off + block <= its size.
        *s = unsafe { src(ch, call, r).add(off) };
    }
    f(srcs)
}

/// Reduce, in rank order, `call.count` elements at byte `off` of every rank's payload into
/// `call.recv` (all-reduce and reduce: `off` 0; reduce-scatter: this rank's block). With the
/// finite check, returns the first non-finite element read (its index from `off`).
pub(crate) fn reduce(ch: &Channel, call: &Call, off: usize) -> Option<Found> {
    with_srcs(ch, call, off, |srcs| {
        // SAFETY: every source holds `count` elements (the arguments agree, checked by the
        // exchange); recv holds `count` elements on receiving ranks (checked by Communicator)
        // and lies outside the entries; in place it equals this rank's source (the reduction
        // allows a destination equal to a source).
        unsafe {
            reduce_checked(
                ch.check_finite(),
                call.dtype,
                call.op,
                srcs.len(),
                srcs,
                &[Dst {
                    ptr: call.recv.addr as *mut u8,
                    nt: false,
                }],
                call.count,
            )
        }
    })
}

/// The first non-finite element of `count` elements at byte `off` of every rank's payload (its
/// index from `off`), for the parts of a reduction this rank does not compute.
pub(crate) fn scan(ch: &Channel, call: &Call, off: usize, count: usize) -> Option<Found> {
    // SAFETY: every payload holds off + count elements (callers), the arguments agree.
    with_srcs(ch, call, off, |srcs| unsafe {
        scan_finite(call.dtype, srcs, count)
    })
}

/// The exchange of an inline call: publish this rank's entry (its payload is already in
/// [`data`]) with the call's arguments and number, wait until every
/// peer has published its entry for the same call, and compare the arguments as
/// `Channel::begin` does. A peer that took a path with phases for this call (its
/// arguments put it above the threshold, or it refused the call) publishes a phase instead;
/// this rank then joins it through `begin`, so every rank reports the same mismatch and the
/// counters stay aligned.
pub(crate) fn exchange(ch: &mut Channel, call: &Call, cx: Ctx) -> Result<(), CommError> {
    let seq = ch.seq();
    // This rank's call as its entry carries it (root in 32 bits), and as the check below
    // compares it: the own entry is never read back (see the module docs).
    let own = Desc {
        kind: call.kind as u8,
        dtype: call.dtype as u8,
        op: call.op as u8,
        flags: if ch.check_finite() { FINITE } else { 0 },
        root: call.root as u32 as u64,
        count: call.count as u64,
        seq,
        ..Desc::default()
    };
    let h = hdr(ch, ch.rank(), seq);
    // SAFETY: only this rank writes its own entry; peers read this parity's head only after
    // the `seq` store below and stop before their next collective, which this rank's next
    // collective waits for, so nobody reads it now (see `InlineHdr`).
    unsafe {
        (*h).kind = own.kind;
        (*h).dtype = own.dtype;
        (*h).op = own.op;
        (*h).flags = own.flags;
        (*h).root = own.root as u32;
        (*h).count = own.count;
        // Release: the sleepers are checked after the wait (`wait_published`).
        (*h).seq.store(seq, Release);
    }
    let mine = ch.next_phase() - 1;
    // A peer whose progress passed ours entered a phased call: it will not publish an entry.
    let arrived = |ch: &Channel, r: usize| {
        entry_seq(ch, r) == seq || ch.ctrl(r).progress.load(Acquire) > mine
    };
    ch.wait_published(&arrived, cx)?;
    let (n, me) = (ch.world(), ch.rank());
    if (0..n).any(|r| r != me && entry_seq(ch, r) != seq) {
        ch.begin(call, 0, 0, 0, cx)?;
        // `begin` reports the disagreement that sent the peer there; equal arguments never
        // take different paths, but should they, this is still a disagreement.
        return Err(CommError::Mismatch {
            seq,
            detail: format!(
                "the ranks took different paths for {}: their settings (fast_bytes, the inline path's threshold) differ",
                call.kind
            ),
        });
    }
    let desc = |r: usize| {
        if r == me {
            return own;
        }
        // SAFETY: rank r published this entry (its seq equals ours, acquire above) and does
        // not rewrite it before this rank's next collective.
        let h = unsafe { &*hdr(ch, r, seq) };
        Desc {
            kind: h.kind,
            dtype: h.dtype,
            op: h.op,
            flags: h.flags,
            root: h.root as u64,
            count: h.count,
            seq,
            ..Desc::default()
        }
    };
    // Compare every rank with rank 0 (as `check_descs` does) without allocating; build the
    // report only when one differs.
    let d0 = desc(0);
    if (1..n).all(|r| {
        let d = desc(r);
        same_call(&d0, &d) && d.flags == d0.flags
    }) {
        return Ok(());
    }
    let descs: Vec<Desc> = (0..n).map(desc).collect();
    check_descs(&descs, seq, &|r| ch.who(r))
}
