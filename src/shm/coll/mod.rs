//! The collectives, one file per collective, each with one body per path (as NCCL's
//! `RunWorkColl<…, ALGO, PROTO>` and gloo's `allreduce_ring.h`): its inline body, then the entry
//! that lets the ranks agree on the path ([`negotiate`](crate::shm::path) in `shm::path`) and its
//! slots, registered and CMA bodies. Every rank of a call runs the same function with the same
//! arguments (the first phase, or the inline exchange, checks that they agree).
//!
//! * [`all_reduce`]: all_reduce and reduce (and their one-phase body).
//! * [`broadcast`].
//! * [`gather`]: all_gather and gather.
//! * [`reduce_scatter`].
//! * [`exchange`]: all_to_all, all_to_all_v, scatter, all_gather_v and gather_v, through the
//!   slots in rounds after a first phase that checks the per-pair counts, or straight from
//!   registered or CMA-offered send buffers.
//! * [`cma_reduce`]: the piecewise reduction the CMA bodies of all_reduce and reduce_scatter
//!   share.
//!
//! The mechanisms they use are files of `shm` named for them: `inline` (the inline entries),
//! `cma` (cross-memory attach), `channel` (phases and slots), `path` (which path a call takes).

pub(crate) mod all_reduce;
pub(crate) mod broadcast;
pub(crate) mod cma_reduce;
pub(crate) mod exchange;
pub(crate) mod gather;
pub(crate) mod reduce_scatter;

use crate::comm::{Call, CollKind, CommError};
use crate::shm::channel::{Channel, Ctx};
use crate::shm::reduce::{copy_block, Found};

/// The end of a reduction under the finite check: `found`, the first non-finite input element of
/// the call (the same on every rank: every rank computes it from the same data, or learns it
/// with `Channel::phase_found`), becomes [`CommError::NonFinite`] naming its rank, its index in
/// that rank's input, and the call.
pub(crate) fn finite(ch: &Channel, call: &Call, found: Option<Found>) -> Result<(), CommError> {
    let Some(f) = found else {
        return Ok(());
    };
    let count = if call.kind == CollKind::ReduceScatter {
        call.count * ch.world()
    } else {
        call.count
    };
    Err(CommError::NonFinite {
        rank: ch.global(f.src),
        seq: ch.seq(),
        kind: f.kind,
        op: call.kind,
        element: f.elem,
        dtype: call.dtype,
        count,
    })
}

/// Split `len` elements into `n` parts aligned to `unit` elements: part `j` is `[lo, hi)`. The
/// all-reduce's reduce-scatter step, on the slots or with CMA, gives part `j` to rank `j`.
pub(crate) fn part(len: usize, n: usize, j: usize, unit: usize) -> (usize, usize) {
    let q = len.div_ceil(n).next_multiple_of(unit);
    let lo = (j * q).min(len);
    let hi = ((j + 1) * q).min(len);
    (lo, hi)
}

/// Where peer `j`'s piece sits in rank `me`'s slot, in pieces of one size: the slot holds one
/// piece per peer, in rank order, skipping `me`.
pub(crate) fn piece_index(me: usize, j: usize) -> usize {
    if j < me {
        j
    } else {
        j - 1
    }
}

/// Write into this rank's slot of phase `p`, for every peer `j`, the piece `piece(j)` = (source,
/// bytes) at `piece_index(me, j)` × `piece_bytes` (the slots paths of all_reduce and
/// reduce_scatter, which put in each peer's piece what that peer reduces).
///
/// # Safety
/// Every source is valid for its bytes, which are at most `piece_bytes`, and
/// `(n - 1) × piece_bytes` fits in a slot.
pub(crate) unsafe fn put_pieces(
    ch: &Channel,
    p: u64,
    piece_bytes: usize,
    nt: bool,
    piece: impl Fn(usize) -> (*const u8, usize),
) {
    let (n, me) = (ch.world(), ch.rank());
    for j in (0..n).filter(|&j| j != me) {
        let (src, bytes) = piece(j);
        // SAFETY: (callers) the source holds `bytes` <= piece_bytes; the slot holds (n - 1)
        // pieces and is disjoint from the user buffers.
        unsafe {
            copy_block(
                src,
                ch.slot(me, p).add(piece_index(me, j) * piece_bytes),
                bytes,
                nt,
            )
        };
    }
}

/// A barrier with phases: the first phase (descriptor exchange) alone. Barriers take the inline
/// path (`shm::inline`), which needs no data; this is the body should a barrier ever not.
pub(crate) fn barrier(ch: &mut Channel, call: &Call, cx: Ctx) -> Result<(), CommError> {
    ch.begin(call, 0, 0, 0, cx).map(|_| ())
}
