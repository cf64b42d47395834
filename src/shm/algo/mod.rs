//! The collective algorithms, one family per file, each a function over a [`Channel`](super::channel::Channel)
//! that every rank of the call runs with the same arguments (the first phase checks that they agree).
//!
//! * [`fast`]: every collective whose per-rank payload fits `fast_bytes` (4 KiB), in one phase
//!   through the ranks' fast entries, where the call's arguments travel with the data.
//! * [`small`]: one-phase paths: the barrier, and all-reduce/reduce of messages up to
//!   `small_bytes`, where every rank stages its whole input and reduces everything itself.
//! * [`allreduce`]: larger all-reduce/reduce: staged reduce-scatter then all-gather through the
//!   slots, or directly on the buffers when they all live in the segment.
//! * [`broadcast`], [`gather`] (all-gather and gather), [`reduce_scatter`]: staged chunk by chunk
//!   through the slots, or zero-copy.
//! * [`single`]: broadcast, all-gather, reduce-scatter and all-reduce on ordinary buffers from
//!   `cma_bytes` up: one copy, straight between the ranks' buffers (cross-memory attach, reads
//!   and writes, so that every core copies).
//! * [`exchange`]: all_to_all, all_to_all_v, scatter, all_gather_v and gather_v, staged in rounds
//!   through the slots after a first phase that checks the per-pair counts.
//! * [`p2p`]: point-to-point sends and receives through the per-pair mailboxes (no phases).

pub(crate) mod allreduce;
pub(crate) mod broadcast;
pub(crate) mod exchange;
pub(crate) mod fast;
pub(crate) mod gather;
pub(crate) mod p2p;
pub(crate) mod reduce_scatter;
pub(crate) mod single;
pub(crate) mod small;

/// Split `len` elements into `n` parts aligned to `unit` elements: part `j` is `[lo, hi)`. The
/// all-reduce's reduce-scatter phase, staged or single-copy, gives part `j` to rank `j`.
pub(crate) fn part(len: usize, n: usize, j: usize, unit: usize) -> (usize, usize) {
    let q = len.div_ceil(n).next_multiple_of(unit);
    let lo = (j * q).min(len);
    let hi = ((j + 1) * q).min(len);
    (lo, hi)
}
