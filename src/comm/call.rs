//! [`Call`]: one collective, type-erased and checked locally, as a backend receives it.

use crate::types::{CollKind, Dtype, RawMem, ReduceOp};

/// One collective call, type-erased and checked locally. `count` is the per-rank element count as
/// NCCL defines it: the send count of `all_reduce`/`broadcast`/`reduce`/`all_gather`/`gather`,
/// the *receive* count of `reduce_scatter` and `scatter`, the per-peer block of `all_to_all`, and
/// this rank's send count of `all_gather_v`/`gather_v` (for the v-variants the counts differ
/// between ranks: [`Splits`] carries them and backends check them pair by pair).
#[derive(Clone, Copy, Debug)]
pub struct Call<'a> {
    /// The collective.
    pub kind: CollKind,
    /// Element type.
    pub dtype: Dtype,
    /// Reduction operator (`Sum` where none applies).
    pub op: ReduceOp,
    /// Root rank (0 where none applies).
    pub root: usize,
    /// Element count, as above.
    pub count: usize,
    /// Send buffer (for in-place calls, the same address as `recv`).
    pub send: RawMem,
    /// Receive buffer (may be empty on ranks that receive nothing).
    pub recv: RawMem,
    /// Per-peer counts and displacements of the v-variants (empty slices otherwise).
    pub splits: Splits<'a>,
}

/// Per-peer element counts and displacements (in elements) of the v-variants, one entry per rank,
/// as `MPI_Alltoallv` takes them. Empty where the call has none: `all_to_all_v` fills all four,
/// `all_gather_v` and `gather_v` (on the root) the receive pair (displacements = prefix sums).
/// The communicator checked locally that every `displ + count` lies within its buffer.
#[derive(Clone, Copy, Debug, Default)]
pub struct Splits<'a> {
    /// Elements this rank sends to each rank.
    pub send_counts: &'a [usize],
    /// Where, in the send buffer, the block for each rank starts.
    pub send_displs: &'a [usize],
    /// Elements this rank receives from each rank.
    pub recv_counts: &'a [usize],
    /// Where, in the receive buffer, the block from each rank starts.
    pub recv_displs: &'a [usize],
}
