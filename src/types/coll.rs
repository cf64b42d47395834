//! [`CollKind`]: the names of the collectives, shared by the API, the backends and error messages.

use std::fmt;

/// Which collective a call was (carried in errors and in the cross-rank argument check).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
#[non_exhaustive]
pub enum CollKind {
    /// `all_reduce`.
    AllReduce = 1,
    /// `broadcast`.
    Broadcast = 2,
    /// `reduce`.
    Reduce = 3,
    /// `all_gather`.
    AllGather = 4,
    /// `gather`.
    Gather = 5,
    /// `reduce_scatter`.
    ReduceScatter = 6,
    /// `barrier`.
    Barrier = 7,
    /// `all_to_all`: block `j` of every rank's send goes to rank `j` (equal blocks).
    AllToAll = 8,
    /// `all_to_all_v`: per-peer counts and displacements (as `MPI_Alltoallv`).
    AllToAllV = 9,
    /// `scatter`: block `j` of the root's send goes to rank `j`.
    Scatter = 10,
    /// `all_gather_v`: every rank's send, of per-rank lengths, concatenated on every rank.
    AllGatherV = 11,
    /// `gather_v`: every rank's send, of per-rank lengths, concatenated on the root.
    GatherV = 12,
    /// Point-to-point `send` (not a collective: named in its errors).
    Send = 13,
    /// Point-to-point `recv` (not a collective: named in its errors).
    Recv = 14,
}

impl CollKind {
    /// Every kind.
    pub const ALL: [CollKind; 14] = [
        CollKind::AllReduce,
        CollKind::Broadcast,
        CollKind::Reduce,
        CollKind::AllGather,
        CollKind::Gather,
        CollKind::ReduceScatter,
        CollKind::Barrier,
        CollKind::AllToAll,
        CollKind::AllToAllV,
        CollKind::Scatter,
        CollKind::AllGatherV,
        CollKind::GatherV,
        CollKind::Send,
        CollKind::Recv,
    ];

    /// snake_case name, as the method is called.
    pub const fn name(self) -> &'static str {
        match self {
            CollKind::AllReduce => "all_reduce",
            CollKind::Broadcast => "broadcast",
            CollKind::Reduce => "reduce",
            CollKind::AllGather => "all_gather",
            CollKind::Gather => "gather",
            CollKind::ReduceScatter => "reduce_scatter",
            CollKind::Barrier => "barrier",
            CollKind::AllToAll => "all_to_all",
            CollKind::AllToAllV => "all_to_all_v",
            CollKind::Scatter => "scatter",
            CollKind::AllGatherV => "all_gather_v",
            CollKind::GatherV => "gather_v",
            CollKind::Send => "send",
            CollKind::Recv => "recv",
        }
    }

    /// Whether the call has a root rank.
    pub const fn has_root(self) -> bool {
        matches!(
            self,
            CollKind::Broadcast
                | CollKind::Reduce
                | CollKind::Gather
                | CollKind::Scatter
                | CollKind::GatherV
        )
    }

    /// Whether the call has a reduction operator.
    pub const fn has_op(self) -> bool {
        matches!(
            self,
            CollKind::AllReduce | CollKind::Reduce | CollKind::ReduceScatter
        )
    }

    /// What must agree between the ranks of one call, from the fields of its wire description
    /// (`kind` as its `u8`): the kind and dtype, and the op, root and count where the kind has
    /// them. The others are zeroed, so ranks that pass different unused values still agree.
    pub(crate) fn agreement_key(
        kind: u8,
        dtype: u8,
        op: u8,
        root: u64,
        count: u64,
    ) -> (u8, u8, u8, u64, u64) {
        let k = CollKind::from_u8(kind);
        let op = if k.is_some_and(|k| k.has_op()) { op } else { 0 };
        let root = if k.is_some_and(|k| k.has_root()) {
            root
        } else {
            0
        };
        let count = if k == Some(CollKind::Barrier) {
            0
        } else {
            count
        };
        (kind, dtype, op, root, count)
    }

    /// Whether the per-rank counts differ between ranks (the v-variants): their consistency is
    /// checked pair by pair rather than by comparing one count.
    pub const fn is_v(self) -> bool {
        matches!(
            self,
            CollKind::AllToAllV | CollKind::AllGatherV | CollKind::GatherV
        )
    }

    /// Whether this is a point-to-point operation rather than a collective.
    pub const fn is_p2p(self) -> bool {
        matches!(self, CollKind::Send | CollKind::Recv)
    }

    pub(crate) fn from_u8(v: u8) -> Option<CollKind> {
        CollKind::ALL.iter().copied().find(|k| *k as u8 == v)
    }
}

impl fmt::Display for CollKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for CollKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.replace('-', "_").to_ascii_lowercase();
        CollKind::ALL.iter().copied().find(|k| k.name() == s).ok_or_else(|| {
            format!("unknown collective '{s}' (expected all_reduce, broadcast, reduce, all_gather, gather, reduce_scatter, barrier, all_to_all, all_to_all_v, scatter, all_gather_v, gather_v, send or recv)")
        })
    }
}
