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
}

impl CollKind {
    /// Every kind.
    pub const ALL: [CollKind; 7] = [
        CollKind::AllReduce,
        CollKind::Broadcast,
        CollKind::Reduce,
        CollKind::AllGather,
        CollKind::Gather,
        CollKind::ReduceScatter,
        CollKind::Barrier,
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
        }
    }

    /// Whether the call has a root rank.
    pub const fn has_root(self) -> bool {
        matches!(self, CollKind::Broadcast | CollKind::Reduce | CollKind::Gather)
    }

    /// Whether the call has a reduction operator.
    pub const fn has_op(self) -> bool {
        matches!(self, CollKind::AllReduce | CollKind::Reduce | CollKind::ReduceScatter)
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
            format!("unknown collective '{s}' (expected all_reduce, broadcast, reduce, all_gather, gather, reduce_scatter or barrier)")
        })
    }
}
