//! [`ShmComm`], the shared-memory [`Backend`]: checks a call, runs it through its collective's
//! body for the path it takes (`shm::path`, `shm::coll`) and turns protocol failures into a
//! poisoned communicator.

use std::sync::{Arc, Mutex};

use super::alloc::{Heap, SharedAlloc};
use super::channel::{Channel, Ctx};
use super::coll::{self, all_reduce, broadcast, exchange, gather, reduce_scatter};
use super::inline;
use super::p2p::P2p;
use super::path::{self, Path};
use crate::comm::{
    Arrival, Backend, BackendKind, Call, CollKind, CommError, Dtype, MemSpace, P2pOp, SharedRegion,
    ANY_SOURCE,
};
use crate::trace::CallPath;

/// One rank's handle on a shared-memory communicator.
pub struct ShmComm {
    ch: Channel,
    heap: Arc<Mutex<Heap>>,
    poisoned: Option<String>,
    /// This rank's positions in the point-to-point mailboxes.
    p2p: P2p,
    /// Names this communicator's segment, for the names of its sub-communicators' segments: the
    /// job id of a named segment, a sub-communicator's own tag; `None` for an anonymous segment
    /// (the header's creator then names it).
    tag: Option<String>,
    /// Splits this rank has made of this communicator (numbers the sub-communicators' segments).
    splits: u64,
    /// Shrinks this communicator's lineage went through (0: a world or split communicator).
    generation: u64,
    /// The generation of the communicator a shrink or grow of this one made: every call fails
    /// from then on.
    shrunk: Option<u64>,
    /// For a communicator made by shrink or grow: the world communicator its lineage started
    /// from (see `shm::grow`). `None` for a world communicator (it is its own root) and for a
    /// sub-communicator of a split.
    lineage: Option<Lineage>,
}

/// The world communicator a lineage of shrinks and grows started from (see `shm::grow`).
#[derive(Debug, Clone)]
pub(crate) struct Lineage {
    /// The world segment's tag (see `shm::split`): grow segments are named after it.
    pub tag: String,
    /// The world's size: what a grow restores.
    pub world: usize,
    /// Ranks replaced in the lineage so far: numbers the grow segments.
    pub replaced: u64,
}

impl std::fmt::Debug for ShmComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmComm")
            .field("rank", &self.ch.rank())
            .field("world", &self.ch.world())
            .field("seq", &self.ch.seq())
            .finish()
    }
}

impl ShmComm {
    /// A communicator over a joined channel, allocating shared buffers from `heap`.
    pub(crate) fn new(ch: Channel, heap: Arc<Mutex<Heap>>) -> ShmComm {
        let p2p = P2p::new(
            ch.world(),
            ch.config().cma_bytes,
            ch.config().fault_refuse_direct,
        );
        ShmComm {
            ch,
            heap,
            poisoned: None,
            p2p,
            tag: None,
            splits: 0,
            generation: 0,
            shrunk: None,
            lineage: None,
        }
    }

    /// The world communicator this one's lineage of shrinks and grows started from: the one
    /// recorded by shrink or grow, or this one for a world communicator; `None` for a
    /// sub-communicator of a split (and the shrinks of one), which cannot grow.
    pub(crate) fn lineage(&self) -> Option<Lineage> {
        if self.lineage.is_some() || self.ch.global_ranks().is_some() {
            return self.lineage.clone();
        }
        Some(Lineage {
            tag: self.segment_tag(),
            world: self.ch.world(),
            replaced: 0,
        })
    }

    /// Record the lineage of a communicator a shrink or grow made.
    pub(crate) fn set_lineage(&mut self, lineage: Option<Lineage>) {
        self.lineage = lineage;
    }

    /// Shrinks this communicator's lineage went through (see `shm::shrink`).
    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    /// Set the generation of a communicator a shrink made.
    pub(crate) fn set_generation(&mut self, generation: u64) {
        self.generation = generation;
    }

    /// The generation of the communicator a shrink of this one made, once there is one.
    pub(crate) fn shrunk(&self) -> Option<u64> {
        self.shrunk
    }

    /// Mark this communicator shrunk (or grown) into generation `generation`: every later call
    /// fails.
    pub(crate) fn set_shrunk(&mut self, generation: u64) {
        self.shrunk = Some(generation);
    }

    /// Set the tag that names this communicator's segment (see `shm::split`).
    pub(crate) fn with_tag(mut self, tag: &str) -> ShmComm {
        self.tag = Some(tag.to_string());
        self
    }

    /// The tag of this communicator's segment, if it has one.
    pub(crate) fn tag(&self) -> Option<&str> {
        self.tag.as_deref()
    }

    /// Count one more split of this communicator; returns its number (from 1).
    pub(crate) fn next_split(&mut self) -> u64 {
        self.splits += 1;
        self.splits
    }

    /// The channel (for `shm::split`, which reads the peers' processes and settings).
    pub(crate) fn channel(&self) -> &Channel {
        &self.ch
    }

    /// Run `call` on `path`, the path its size decides (`path::by_size`), or with `None` the
    /// path its ranks agree on in its first phase.
    fn run_call(&mut self, call: &Call, cx: Ctx, path: Option<Path>) -> Result<(), CommError> {
        let ch = &mut self.ch;
        match (path, call.kind) {
            (Some(Path::Inline), kind) => match kind {
                CollKind::Barrier => inline::exchange(ch, call, cx),
                CollKind::AllReduce | CollKind::Reduce => all_reduce::inline(ch, call, cx),
                CollKind::Broadcast => broadcast::inline(ch, call, cx),
                CollKind::AllGather | CollKind::Gather => gather::inline(ch, call, cx),
                CollKind::ReduceScatter => reduce_scatter::inline(ch, call, cx),
                // `inline::eligible` admits the other kinds: scatter and all_to_all.
                _ => exchange::inline(ch, call, cx),
            },
            (Some(_), _) => all_reduce::one_phase(ch, call, cx),
            (None, CollKind::Barrier) => coll::barrier(ch, call, cx),
            (None, CollKind::AllReduce | CollKind::Reduce) => all_reduce::all_reduce(ch, call, cx),
            (None, CollKind::Broadcast) => broadcast::broadcast(ch, call, cx),
            (None, CollKind::AllGather | CollKind::Gather) => gather::all_gather(ch, call, cx),
            (None, CollKind::ReduceScatter) => reduce_scatter::reduce_scatter(ch, call, cx),
            (
                None,
                CollKind::AllToAll
                | CollKind::AllToAllV
                | CollKind::Scatter
                | CollKind::AllGatherV
                | CollKind::GatherV,
            ) => exchange::exchange(ch, call, cx),
            (None, CollKind::Send | CollKind::Recv) => Err(CommError::Unsupported(format!(
                "{} is point-to-point: call Communicator::{} (the collective path cannot run it)",
                call.kind, call.kind
            ))),
        }
    }

    fn poison_on(&mut self, e: &CommError) {
        if matches!(
            e,
            CommError::PeerLost { .. } | CommError::Timeout { .. } | CommError::Aborted { .. }
        ) {
            self.poisoned = Some(e.to_string());
            // A peer may still touch buffers of the failed call: never hand their memory out again.
            self.heap
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .quarantine();
        }
    }
    /// A collective, its start noted for the flight recorder (`arrival`) at its first wait.
    fn run_with(&mut self, call: &Call, arrival: Option<&Arrival<'_>>) -> Result<(), CommError> {
        // `shm::shrink` (inherent methods there, as for split).
        self.check_shrink()?;
        if let Some(reason) = &self.poisoned {
            return Err(CommError::Aborted {
                by: self.ch.global(self.ch.rank()),
                reason: format!("an earlier collective failed: {reason}"),
            });
        }
        for (what, m) in [("send", call.send), ("recv", call.recv)] {
            if m.space != MemSpace::Host && m.len > 0 {
                let e = CommError::Unsupported(format!(
                    "{} on {}: the {what} buffer is device memory, which the shared-memory backend cannot read; use the NCCL backend or copy it to the host",
                    call.kind,
                    self.ch.who(self.ch.rank())
                ));
                self.reject(call.kind, call.dtype, &e);
                return Err(e);
            }
        }
        // A call that may write the slots maps this rank's slots first (once); if there is no room
        // any more, the call is refused so the peers fail at once too, rather than waiting.
        let path = path::by_size(&self.ch, call);
        if path != Some(Path::Inline) {
            if let Err(e) = self.ch.ensure_slots() {
                self.reject(call.kind, call.dtype, &e);
                return Err(e);
            }
        }
        // The body names the path the ranks agree on; exchanges without a single copy stage.
        self.ch.last_path = match (path, call.kind) {
            (Some(p), _) => p.traced(),
            (None, CollKind::Barrier) => CallPath::Unknown,
            (None, _) => CallPath::Slots,
        };
        self.ch.path_known = path == Some(Path::Inline);
        let cx = self.ch.start_call(call.kind, arrival);
        let r = self.run_call(call, cx, path);
        self.ch.end_call(r.is_ok());
        if let Err(e) = &r {
            self.poison_on(e);
        }
        r
    }
}

impl Backend for ShmComm {
    fn rank(&self) -> usize {
        self.ch.rank()
    }

    fn world_size(&self) -> usize {
        self.ch.world()
    }

    fn kind(&self) -> BackendKind {
        BackendKind::Shm
    }

    fn describe(&self) -> String {
        // Cross-memory attach moves point-to-point messages of at least this size in one copy.
        let cma = match self.ch.config().cma_bytes {
            0 => "off".to_string(),
            b => format!("from {b} B"),
        };
        format!("cpus {} cma {cma}", super::segment::affinity_text())
    }

    fn run(&mut self, call: &Call) -> Result<(), CommError> {
        self.run_with(call, None)
    }

    fn run_noting(&mut self, call: &Call, arrival: &Arrival<'_>) -> Result<(), CommError> {
        self.run_with(call, Some(arrival))
    }

    fn p2p(&mut self, ops: &mut [P2pOp]) -> Result<(), CommError> {
        self.check_shrink()?;
        if let Some(reason) = &self.poisoned {
            return Err(CommError::Aborted {
                by: self.ch.global(self.ch.rank()),
                reason: format!("an earlier call failed: {reason}"),
            });
        }
        for o in ops.iter() {
            if o.mem.space != MemSpace::Host && o.mem.len > 0 {
                return Err(CommError::Unsupported(format!(
                    "{} on {}: the buffer is device memory, which the shared-memory backend cannot read; use the NCCL backend or copy it to the host",
                    o.kind,
                    self.ch.who(self.ch.rank())
                )));
            }
            let any = o.peer == ANY_SOURCE && o.kind == CollKind::Recv && self.ch.world() > 1;
            if (o.peer >= self.ch.world() && !any) || !o.kind.is_p2p() {
                return Err(CommError::InvalidArgument {
                    op: o.kind,
                    rank: self.ch.global(self.ch.rank()),
                    detail: format!(
                        "a point-to-point operation needs kind send or recv and a peer below {} (or, for a recv with another rank in the communicator, any source)",
                        self.ch.world()
                    ),
                });
            }
        }
        let r = self.p2p.run(&self.ch, ops);
        if let Err(e) = &r {
            self.poison_on(e);
        }
        r
    }

    fn synchronize(&mut self) -> Result<(), CommError> {
        Ok(())
    }

    fn last_path(&self) -> CallPath {
        self.ch.last_path
    }

    fn reject(&mut self, kind: CollKind, dtype: Dtype, _reason: &CommError) {
        // A shrunk communicator's peers have gone to its successor: nobody would read the refusal.
        if self.poisoned.is_some() || self.check_shrink().is_err() {
            return;
        }
        if let Err(e) = self.ch.refuse(kind, dtype) {
            self.poison_on(&e);
        }
    }

    fn seq(&self) -> u64 {
        self.ch.seq()
    }

    fn timeout(&self) -> Option<std::time::Duration> {
        Some(self.ch.config().timeout)
    }

    fn set_timeout(&mut self, timeout: std::time::Duration) -> Result<(), CommError> {
        self.ch.set_timeout(timeout);
        Ok(())
    }

    fn check_finite(&self) -> bool {
        self.ch.check_finite()
    }

    fn set_check_finite(&mut self, on: bool) -> Result<(), CommError> {
        self.ch.set_check_finite(on);
        Ok(())
    }

    fn split(
        &mut self,
        color: Option<u32>,
        key: i64,
    ) -> Result<Option<Box<dyn Backend>>, CommError> {
        // `shm::split` (an inherent method there: it builds on bootstrap, which builds on this file).
        Ok(self
            .split_shm(color, key)?
            .map(|c| Box::new(c) as Box<dyn Backend>))
    }

    fn shrink(
        &mut self,
        exclude: &[usize],
        wait: std::time::Duration,
    ) -> Result<Box<dyn Backend>, CommError> {
        Ok(Box::new(self.shrink_shm(exclude, wait)?))
    }

    fn grow(&mut self, wait: Option<std::time::Duration>) -> Result<Box<dyn Backend>, CommError> {
        Ok(Box::new(self.grow_shm(wait)?))
    }

    fn global_ranks(&self) -> Option<Vec<usize>> {
        self.ch.global_ranks().map(|g| g.to_vec())
    }

    fn peer_check(&self) -> Option<crate::comm::PeerCheck> {
        Some(self.ch.peer_check())
    }

    fn show_carried(&self, call: &Call, seq: u64) {
        self.ch.show_carried(call, seq);
    }

    fn show_carried_wait(&self, seq: u64) {
        self.ch.stamp_wait_at(seq);
    }

    fn alloc_shared(&mut self, bytes: usize) -> Result<Box<dyn SharedRegion>, CommError> {
        Ok(Box::new(SharedAlloc::new(
            self.ch.seg().clone(),
            self.heap.clone(),
            bytes,
        )?))
    }
}
