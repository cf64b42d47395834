//! The host communicator an NCCL communicator was bootstrapped through on one node
//! ([`NcclComm::over_host`]), kept beside it for what NCCL does not do here:
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

use std::sync::Arc;
use std::time::Duration;

use crate::comm::{Call, CommError, Communicator, PeerCheck};
use crate::cuda::Context;

use super::comm::{NcclComm, NcclOptions};
use super::error::NcclError;

/// The host side of an NCCL communicator of one node.
pub(super) struct Membership {
    /// The communicator the unique id travelled through; its ranks are the NCCL ranks.
    host: Communicator,
    /// Its watch over the peers' processes.
    pub(super) peers: Option<PeerCheck>,
    /// How many shrinks and grows led to this communicator (0: the first).
    generation: u64,
    /// Once this communicator was shrunk or grown: its successor's generation.
    replaced: Option<u64>,
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

impl NcclComm {
    /// Join the NCCL communicator of `host`'s ranks, with the same rank numbers: rank 0 of
    /// `host` makes the unique id and broadcasts it through `host`, which is kept for the peer
    /// watch, [`shrink`](crate::comm::Communicator::shrink) and
    /// [`grow`](crate::comm::Communicator::grow). Every rank of `host` calls it.
    pub fn over_host(
        ctx: &Arc<Context>,
        host: Communicator,
        opts: NcclOptions,
    ) -> Result<NcclComm, NcclError> {
        Self::over_host_gen(ctx, host, opts, 0)
    }

    fn over_host_gen(
        ctx: &Arc<Context>,
        mut host: Communicator,
        opts: NcclOptions,
        generation: u64,
    ) -> Result<NcclComm, NcclError> {
        let (rank, world) = (host.rank(), host.world_size());
        let mut c = NcclComm::new(ctx, rank, world, &mut host, opts)?;
        c.membership = Some(Membership {
            peers: host.peer_check(),
            host,
            generation,
            replaced: None,
        });
        Ok(c)
    }

    /// The communicator of the ranks that remain (see [`Backend::shrink`](crate::comm::Backend::shrink)).
    pub(super) fn shrink_comm(
        &mut self,
        exclude: &[usize],
        wait: Duration,
    ) -> Result<NcclComm, CommError> {
        self.rebuild("shrink", |host| host.shrink_excluding(exclude, wait))
    }

    /// The communicator of the whole world again (see [`Backend::grow`](crate::comm::Backend::grow)).
    pub(super) fn grow_comm(&mut self, wait: Option<Duration>) -> Result<NcclComm, CommError> {
        self.rebuild("grow", |host| match wait {
            Some(w) => host.grow_within(w),
            None => host.grow(),
        })
    }

    /// Abort this NCCL communicator (calls in flight fail; its resources go before the new
    /// one's are taken), let the host communicator agree on the new members with `make`, and
    /// join a new NCCL communicator over them.
    fn rebuild(
        &mut self,
        verb: &str,
        make: impl FnOnce(&mut Communicator) -> Result<Communicator, CommError>,
    ) -> Result<NcclComm, CommError> {
        let Some(m) = self.membership.as_mut() else {
            return Err(CommError::Unsupported(format!(
                "{verb} on an NCCL communicator needs the host communicator of its node that it was made through (Communicator::from_env or lockstep launch on one node, rendezvous::device_communicator, NcclComm::over_host); this one was made across nodes through the store, by split, or with a unique-id exchange of the caller's: restart the job instead (lockstep launch --restart-policy job)"
            )));
        };
        if let Some(generation) = m.replaced {
            return Err(CommError::Shrunk {
                rank: m.host.global_rank(),
                generation,
            });
        }
        let generation = m.generation + 1;
        self.shared.abort(&format!(
            "{verb}: replaced by its generation-{generation} successor"
        ));
        m.replaced = Some(generation);
        let host = make(&mut m.host)?;
        tracing::info!(
            rank = host.global_rank(),
            world = host.world_size(),
            generation,
            "nccl {verb}: a new NCCL communicator over the host communicator's members"
        );
        Self::over_host_gen(&self.ctx, host, self.opts.clone(), generation).map_err(CommError::from)
    }
}
