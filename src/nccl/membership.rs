//! The host communicator an NCCL communicator was bootstrapped through on one node
//! ([`NcclComm::over_host`], `over_host.rs`, which also rebuilds the NCCL communicator for
//! shrink and grow), kept beside it for what NCCL does not do here:
//!
//! * **noticing a peer's death**: NCCL's kernels wait for a dead peer until the timeout, so the
//!   watchdog polls the host communicator's [`PeerCheck`] (a pidfd per peer) while it waits, and
//!   a death becomes [`CommError::PeerLost`] within a poll;
//! * **showing each rank's call** to `lockstep status`, which reads the host communicator's
//!   segment: the collective number, kind and arguments of every call as it is enqueued (a few
//!   stores), and when a wait for it outlasts its first look;
//! * **agreeing on the survivors** (shrink) and **taking a replacement back in** (grow): the host
//!   communicator shrinks or grows (its members agreed through its segment, a rank that was only
//!   slow excluded there and told so), then a new NCCL communicator of exactly those ranks is
//!   made over it with a fresh unique id, so a rank left out can never reach it.
//!
//! Why not `ncclCommShrink` (NCCL 2.27) and `ncclCommGrow` (2.29): shrink needs a parent NCCL
//! did not abort, and the watchdog aborts on a death so that no call waits on it; grow needs an
//! NCCL most installations do not have yet. A rebuilt communicator works on every NCCL lockstep
//! loads, for the price of one `ncclCommInitRank`.
//!
//! A communicator made without a host one (across nodes through the store, by split, or by
//! [`NcclComm::new`] with the caller's exchange) has no watch and refuses shrink and grow.

use crate::comm::{Call, Communicator, PeerCheck};

/// The host side of an NCCL communicator of one node.
pub(super) struct Membership {
    /// The communicator the unique id travelled through; its ranks are the NCCL ranks.
    pub(super) host: Communicator,
    /// Its watch over the peers' processes.
    pub(super) peers: Option<PeerCheck>,
    /// How many shrinks and grows led to this communicator (0: the first).
    pub(super) generation: u64,
    /// Once this communicator was shrunk or grown: its successor's generation.
    pub(super) replaced: Option<u64>,
}

impl Membership {
    /// The global ranks of a shrunk communicator's ranks (`None`: the world's own numbering).
    pub(super) fn global_ranks(&self) -> Option<Vec<usize>> {
        self.host
            .is_sub_communicator()
            .then(|| self.host.global_ranks())
    }

    /// This rank's global rank, which errors name.
    pub(super) fn global_rank(&self) -> usize {
        self.host.global_rank()
    }

    /// Show call `seq` in the host communicator's segment, where `lockstep status` reads it.
    pub(super) fn show(&self, call: &Call, seq: u64) {
        self.host.show_carried(call, seq);
    }

    /// Show that this rank waits in call `seq`.
    pub(super) fn show_wait(&self, seq: u64) {
        self.host.show_carried_wait(seq);
    }

    /// The generation of the communicator that replaced this one, if one did.
    pub(super) fn replaced(&self) -> Option<u64> {
        self.replaced
    }
}
