//! An NCCL communicator made over the host communicator of its node ([`NcclComm::over_host`]),
//! and made again over that host communicator's members when it shrinks or grows (the why is in
//! `membership.rs`).

use std::sync::Arc;
use std::time::Duration;

use crate::comm::{CommError, Communicator};
use crate::cuda::Context;

use super::comm::{NcclComm, NcclOptions};
use super::error::NcclError;
use super::membership::Membership;

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
