//! What a rank's function receives ([`RankContext`]) and returns ([`RankResult`]).

use crate::comm::Communicator;

/// What a rank's function returns: a value, or any error (converted with `?`).
pub type RankResult<R> = Result<R, Box<dyn std::error::Error + Send + Sync>>;

/// What each rank's function receives.
#[derive(Debug)]
pub struct RankContext {
    /// Global rank.
    pub rank: usize,
    /// Rank within this node.
    pub local_rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// A communicator joined by every rank.
    pub comm: Communicator,
}
