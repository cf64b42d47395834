//! The reduction the CMA bodies of all_reduce and reduce_scatter share: read the peers' inputs
//! piece by piece with cross-memory attach (`shm::cma`) into a scratch buffer that stays in
//! cache, and reduce the pieces with our own in rank order, with the same kernel as the other
//! paths, so the bits are those of every other path, on every rank, every run.

use super::piece_index;
use crate::comm::Call;
use crate::shm::channel::Channel;
use crate::shm::cma::{read_io, write_io};
use crate::shm::path::pid;
use crate::shm::reduce::{reduce_checked, Dst, Found};
use crate::shm::sync::Desc;

/// Bytes of each peer's piece in a CMA reduction: small enough that the pieces are still
/// in the core's L2 cache when they are reduced, large enough that the system call and the page
/// pinning of each read are a small share of the copy.
const PIECE: usize = 128 << 10;

/// Read the elements `[shift, shift + len)` of every peer's input piece by piece into the scratch
/// buffer, and reduce them with ours in rank order into `out`. `own` is our input at element
/// `shift`, `out` our output at element `shift`. With `push` (all-reduce) each reduced piece,
/// still in cache, is also written into every peer's output at the same elements. Returns the
/// first non-finite element read under the finite check (its index in the inputs), or the
/// failed copy's error.
#[allow(clippy::too_many_arguments)]
pub(crate) fn reduce_from_peers(
    ch: &mut Channel,
    call: &Call,
    descs: &[Desc],
    shift: usize,
    len: usize,
    own: *const u8,
    out: *mut u8,
    nt: bool,
    push: bool,
) -> Result<Option<Found>, std::io::Error> {
    let check = ch.check_finite();
    let mut found = None;
    let (n, me, esz) = (ch.world(), ch.rank(), call.dtype.size());
    let unit = (64 / esz).max(1);
    let piece = (PIECE / esz / unit * unit).max(unit);
    let need = ((n - 1) * piece * esz).div_ceil(8);
    if ch.cma.scratch.len() < need {
        ch.cma.scratch.resize(need, 0);
    }
    let scratch = ch.cma.scratch.as_mut_ptr() as *mut u8;
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
            let idx = piece_index(me, k);
            let to = if land == Some(k) {
                dst
            } else {
                // SAFETY: (add) within the scratch buffer: (n - 1) pieces of `piece` elements,
                // 8-byte aligned (a Vec<u64>), the alignment of every dtype's kernel.
                unsafe { scratch.add(idx * piece * esz) }
            };
            read_io(pids[k], descs[k].send_off + at, to as usize, m * esz)?;
            srcs[k] = to;
        }
        srcs[me] = src;
        // SAFETY: every source holds m elements (scratch pieces or our output's piece filled
        // above, our own input); `dst` is exactly one source (our input in place, or the piece
        // that landed in it) and disjoint from the others (the scratch is ours alone; output and
        // input are equal or disjoint).
        let f = unsafe {
            reduce_checked(
                check,
                call.dtype,
                call.op,
                n,
                &srcs,
                &[Dst { ptr: dst, nt }],
                m,
            )
        };
        found = Found::first(found, f.map(|f| f.shifted(shift + off)));
        if push {
            // Starting after ourselves spreads the writers over the peers.
            for k in (1..n).map(|s| (me + s) % n) {
                // Peer k's output holds the message; these elements are ours to write, and in
                // place (its output is its input) we have read them above and nobody else reads
                // them. It waits in `conclude` until we have written them.
                write_io(pids[k], descs[k].recv_off + at, dst as usize, m * esz)?;
            }
        }
        off += m;
    }
    Ok(found)
}
