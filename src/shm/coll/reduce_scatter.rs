//! reduce_scatter, one body per path (`shm::path`):
//!
//! * inline: every rank reduces its block of every rank's payload from the inline entries.
//! * slots: every rank writes, for each peer, that peer's block of its input into its slot, and
//!   reduces its own block from its input and the peers' copies of it, chunk by chunk.
//! * registered (every send buffer lies in the segment): each rank reduces its block straight
//!   from them.
//! * CMA: each rank reads its block of every peer's input piece by piece and reduces the pieces
//!   with its own (`coll::cma_reduce`).

use super::cma_reduce::reduce_from_peers;
use super::{finite, piece_index, put_pieces};
use crate::comm::{Call, CommError};
use crate::shm::channel::{Channel, Ctx};
use crate::shm::inline;
use crate::shm::path::{conclude_found, negotiate, Agreement, Offer, Path};
use crate::shm::reduce::{reduce_checked, Dst, Found};
use crate::shm::sync::{Desc, SHARED_SEND};

/// Inline: reduce block `me` of every rank's payload (under the finite check, scan the other
/// blocks too, so that every rank finds the same first non-finite element).
pub(crate) fn inline(ch: &mut Channel, call: &Call, cx: Ctx) -> Result<(), CommError> {
    inline::put_payload(ch, call);
    inline::exchange(ch, call, cx)?;
    if call.count == 0 {
        return Ok(());
    }
    let (n, me, c, esz) = (ch.world(), ch.rank(), call.count, call.dtype.size());
    let mine = inline::reduce(ch, call, me * c * esz).map(|f| f.shifted(me * c));
    if !ch.check_finite() {
        return Ok(());
    }
    let before = inline::scan(ch, call, 0, me * c);
    let after = inline::scan(ch, call, (me + 1) * c * esz, (n - me - 1) * c)
        .map(|f| f.shifted((me + 1) * c));
    finite(ch, call, Found::first(Found::first(before, mine), after))
}

/// reduce_scatter beyond the inline path: the ranks agree on the path, then run its body.
pub(crate) fn reduce_scatter(ch: &mut Channel, call: &Call, cx: Ctx) -> Result<(), CommError> {
    let (n, esz) = (ch.world(), call.dtype.size());
    let c = call.count;
    if n == 1 {
        let (flags, so, ro) = ch.share_flags(call, c * esz, 0);
        ch.begin(call, flags, so, ro, cx)?;
        let dst = Dst {
            ptr: call.recv.addr as *mut u8,
            nt: false,
        };
        // SAFETY: single source, c elements, recv equal or disjoint.
        let found = unsafe {
            reduce_checked(
                ch.check_finite(),
                call.dtype,
                call.op,
                1,
                &[call.send.addr as *const u8],
                &[dst],
                c,
            )
        };
        return finite(ch, call, found);
    }
    let c_max = c_max(ch, esz);
    let big = c * esz > ch.one_phase_bytes();
    let takes_part = |_: usize, f: u8| f & SHARED_SEND != 0 && big;
    let offer = Offer {
        send_bytes: n * c * esz,
        recv_bytes: 0,
        cma_size: Some(c * esz),
        stores_size: n * c * esz,
        registered: &takes_part,
        skip_when_registered: true,
    };
    let prestage = |ch: &Channel, p: u64, nt: bool, _: u8| {
        stage(ch, call, 0, c.min(c_max), c_max, p, nt);
        0
    };
    let agreed = negotiate(ch, call, cx, &offer, &prestage)?;
    match agreed.path {
        Path::Cma => cma(ch, call, &agreed.descs, cx),
        Path::Registered => registered(ch, call, &agreed.descs, cx),
        _ => slots(ch, call, &agreed, cx),
    }
}

/// Elements of each peer's piece in a slot: the slot split evenly between the peers, in whole
/// cache lines, at least one.
fn c_max(ch: &Channel, esz: usize) -> usize {
    let unit = (64 / esz).max(1);
    ((ch.slot_bytes() / (ch.world() - 1) / esz) / unit * unit).max(unit)
}

/// Put elements `off..off + len` of every peer's block of our input into our slot of phase `p`,
/// peer `j`'s at index `j` (our own block skipped) of `c_max` elements.
fn stage(ch: &Channel, call: &Call, off: usize, len: usize, c_max: usize, p: u64, nt: bool) {
    let (esz, c, send) = (call.dtype.size(), call.count, call.send.addr as *const u8);
    // SAFETY: send holds n × c elements; the slot holds (n - 1) × c_max elements; len <= c_max.
    unsafe {
        put_pieces(ch, p, c_max * esz, nt, |j| {
            (send.add((j * c + off) * esz), len * esz)
        })
    };
}

/// Slots: reduce our block chunk by chunk from our input and the peers' slots; the first chunk
/// was written before `begin`.
fn slots(ch: &mut Channel, call: &Call, agreed: &Agreement, cx: Ctx) -> Result<(), CommError> {
    let (n, me, esz) = (ch.world(), ch.rank(), call.dtype.size());
    let c_max = c_max(ch, esz);
    let c = call.count;
    let send = call.send.addr as *const u8;
    let recv = call.recv.addr as *mut u8;
    let nt = ch.nt_for(c * esz);
    let snt = agreed.streaming;
    let check = ch.check_finite();
    let mut found = None;
    let mut p = agreed.phase;
    let mut off = 0;
    loop {
        let len = c_max.min(c - off);
        let srcs: Vec<*const u8> = (0..n)
            .map(|k| {
                if k == me {
                    // SAFETY: within send.
                    unsafe { send.add((me * c + off) * esz) }
                } else {
                    // SAFETY: within peer k's slot of phase p.
                    unsafe { ch.slot(k, p).add(piece_index(k, me) * c_max * esz) as *const u8 }
                }
            })
            .collect();
        // SAFETY: recv holds c elements; len elements from off.
        let f = unsafe {
            reduce_checked(
                check,
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
        found = Found::first(found, f.map(|f| f.shifted(me * c + off)));
        off += len;
        if off >= c {
            break;
        }
        p = ch.next_phase();
        stage(ch, call, off, c_max.min(c - off), c_max, p, snt);
        ch.phase(cx)?;
    }
    if check {
        // One more phase under the finite check: the blocks are reduced chunk by chunk in
        // parallel, so the first non-finite element is known only once every block is done.
        let (_, first) = ch.phase_found(found, cx)?;
        return finite(ch, call, first);
    }
    Ok(())
}

/// Registered: reduce block `me` straight from every rank's send in the segment, then one phase.
fn registered(ch: &mut Channel, call: &Call, descs: &[Desc], cx: Ctx) -> Result<(), CommError> {
    let (n, me, esz) = (ch.world(), ch.rank(), call.dtype.size());
    let c = call.count;
    let recv = call.recv.addr as *mut u8;
    let nt = ch.nt_for(c * esz);
    let srcs: Vec<*const u8> = descs
        .iter()
        .map(|d| {
            // SAFETY: every send holds n*c elements in the segment.
            unsafe { (ch.at(d.send_off) as *const u8).add(me * c * esz) }
        })
        .collect();
    let check = ch.check_finite();
    // SAFETY: block `me` of every send is read only by this rank; recv holds c elements and is
    // either our own block `me` (in place, same address as srcs[me]) or disjoint.
    let found = unsafe {
        reduce_checked(
            check,
            call.dtype,
            call.op,
            n,
            &srcs,
            &[Dst { ptr: recv, nt }],
            c,
        )
    }
    .map(|f| f.shifted(me * c));
    if check {
        let (_, first) = ch.phase_found(found, cx)?;
        return finite(ch, call, first);
    }
    ch.phase(cx)?;
    Ok(())
}

/// CMA: each rank reduces its block of every input, reading the peers' blocks.
fn cma(ch: &mut Channel, call: &Call, descs: &[Desc], cx: Ctx) -> Result<(), CommError> {
    let (me, esz, c) = (ch.rank(), call.dtype.size(), call.count);
    let nt = ch.nt_for(c * esz);
    // SAFETY: (add) send holds n × c elements; block `me` starts at me × c.
    let own = unsafe { (call.send.addr as *const u8).add(me * c * esz) };
    let r = reduce_from_peers(
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
    let found = conclude_found(ch, call, r, cx)?;
    finite(ch, call, found)
}
