//! Growing a communicator back to its world after a lost rank was replaced
//! ([`Communicator::grow`]): the survivors and the replacement meet in a fresh segment of the
//! world's size, in which every rank has its number from before the loss.
//!
//! Lineage. A world communicator is the root of its lineage; a shrink or grow of a communicator
//! records the root's segment tag (the job id of a named world segment, `p<pid>.<start>` of an
//! anonymous one: see `shm::split`), its world size, and how many of its ranks were replaced so
//! far (`Lineage`). A sub-communicator of a split has no lineage and cannot grow.
//!
//! Rendezvous. The grow that replaces ranks for the `d`-th time in all (`d` counts ranks: a
//! grow after two deaths counts two) meets in the segment `<root tag>.g<d>`. Both sides know
//! `d` without talking: the survivors count the ranks their lineage lost, and `lockstep launch
//! --restart-policy rank` gives the replacement `LOCKSTEP_RESTART_COUNT`, the number of
//! restarts including its own, which is `d` when every restart replaced a rank that the
//! survivors then grew back. Replacements started together (several ranks lost at once) have
//! counts `d - k + 1 ..= d`, so a replacement with count `c` looks for `g<c>` to
//! `g<c + world - 1>`: never a name of an earlier grow, whose `d` is below `c`, so it never
//! joins a dead generation's segment, and a second death and replacement meet in a new one.
//! The world segment is not read by a replacement (its name is gone once every rank joined).
//!
//! Steps. A survivor holding a world (or grown) communicator first shrinks it (the survivors
//! agree on who is left as `shm::shrink` says); then the survivor of lowest rank creates the
//! grow segment, an all-gather on the shrunk communicator tells every survivor that it exists
//! (or that its creation failed: an error on all of them), and the survivors join it with their
//! global ranks, as a split's members join, waiting for the replacements up to the join
//! timeout (`LOCKSTEP_JOIN_TIMEOUT_S`, or the grow's own wait). The replacement polls for the
//! name, checks that the segment is made for its world and that its creator lives, and joins
//! it as its rank. The last rank to join removes the name; a grow that fails removes it too, so
//! a later grow with the same `d` cannot meet a leftover. Nothing of the old segments is written
//! after the grow: the shrunk communicator fails every later call ([`CommError::Shrunk`]).
//!
//! [`Communicator::grow`]: crate::comm::Communicator::grow

use std::sync::atomic::Ordering::{Acquire, Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::backend::{Lineage, ShmComm};
use super::bootstrap::{create_ready, join, open_ready, SubJoin};
use super::config::ShmConfig;
use super::segment::SegName;
use super::split::Member;
use super::sync::{Header, Layout};
use crate::comm::{Backend, CommError, Communicator};

/// `1, 3` as `rank 1, rank 3`.
fn ranks_text(ranks: &[usize]) -> String {
    let v: Vec<String> = ranks.iter().map(|r| format!("rank {r}")).collect();
    v.join(", ")
}

impl ShmComm {
    /// Grow this communicator back to its world (see [`Backend::grow`]): shrink first when it
    /// still has the world's ranks, then meet the replacements as the module docs say. `wait`
    /// bounds the wait for the replacements (default: the join timeout).
    pub(crate) fn grow_shm(&mut self, wait: Option<Duration>) -> Result<ShmComm, CommError> {
        self.check_shrink()?;
        let Some(lineage) = self.lineage() else {
            return Err(CommError::Unsupported(format!(
                "grow on {}: this is a sub-communicator of split or new_group, which cannot grow; grow the world communicator (or what shrink made of it) instead",
                self.channel().who(self.rank())
            )));
        };
        if self.channel().global_ranks().is_none() {
            // A world or grown communicator: agree on the survivors first.
            let mut shrunk = self.shrink_shm(&[], Communicator::SHRINK_WAIT)?;
            return shrunk.grow_members(lineage, wait);
        }
        self.grow_members(lineage, wait)
    }

    /// The grow proper, on the survivors' (shrunk) communicator.
    fn grow_members(
        &mut self,
        lineage: Lineage,
        wait: Option<Duration>,
    ) -> Result<ShmComm, CommError> {
        let start = Instant::now();
        let world = lineage.world;
        let ch = self.channel();
        let members: Vec<usize> = (0..ch.world()).map(|r| ch.global(r)).collect();
        let me = members[ch.rank()];
        let missing: Vec<usize> = (0..world).filter(|g| !members.contains(g)).collect();
        let replaced = lineage.replaced + missing.len() as u64;
        let tag = format!("{}.g{replaced}", lineage.tag);
        let mut cfg = ch.config().clone().normalized_for(world);
        if let Some(w) = wait {
            cfg.join_timeout = w;
        }
        let limit = cfg.join_timeout;
        let name = SegName::new(cfg.checked_shm_dir()?, &tag)?;
        let layout = Layout::new(world, cfg.slot_bytes, cfg.heap_bytes)?;
        let generation = self.generation() + 1;
        let made = if ch.rank() == 0 {
            create_ready(&name, &tag, &layout, &cfg).map(|seg| {
                // SAFETY: the new segment starts with a Header (page-aligned mapping), whose
                // fields are atomics; the others open it only after the all-gather below.
                let h = unsafe { &*(seg.base() as *const Header) };
                h.shrink.generation.store(generation, Relaxed);
                Some(seg)
            })
        } else {
            Ok(None)
        };
        let creator = ch.who(0);
        // Every survivor learns whether the segment exists before anyone joins it.
        let ok = match self.gather_i64(&[made.is_ok() as i64]) {
            Ok(ok) => ok,
            Err(e) => {
                if matches!(made, Ok(Some(_))) {
                    name.unlink();
                }
                return Err(e);
            }
        };
        if ok[0] == 0 {
            return Err(made.err().unwrap_or_else(|| {
                CommError::Setup(format!(
                    "grow: {creator} could not create the grown communicator's segment {name} (its own error says why), so no rank has a new communicator"
                ))
            }));
        }
        let created = made?;
        let ch = self.channel();
        let mut pids = vec![0; world];
        for (r, &g) in members.iter().enumerate() {
            pids[g] = ch.ctrl(r).pid.load(Acquire);
        }
        tracing::info!(
            "grow: rank {me} waits for the replacement of {} in {name} (up to {:.0} s)",
            ranks_text(&missing),
            limit.as_secs_f64()
        );
        let member = Member {
            name: name.clone(),
            tag: tag.clone(),
            cfg,
            layout,
            rank: me,
            created,
            sub: SubJoin {
                global: None,
                pids,
                spin: ch.spin(),
            },
        };
        let mut c = member.join_or_unlink().map_err(|e| match e {
            CommError::Setup(m) => CommError::Setup(format!(
                "grow of rank {me} back to {world} ranks (segment {name}): {m}. The replacement of {} did not join (the survivors wait for it up to {:.0} s: LOCKSTEP_JOIN_TIMEOUT_S, or grow_within's wait): grow needs a launcher that replaces lost ranks (`lockstep launch --max-restarts N --restart-policy rank` with restarts left); the replacement's own error or exit status says why it did not come",
                ranks_text(&missing),
                limit.as_secs_f64()
            )),
            e => e,
        })?;
        c.set_generation(generation);
        c.set_lineage(Some(Lineage {
            replaced,
            ..lineage
        }));
        self.set_shrunk(generation);
        tracing::info!(
            "grow: rank {me} is back in a communicator of {world} ranks with the replacement of {} (generation {generation}, {:.1} ms)",
            ranks_text(&missing),
            start.elapsed().as_secs_f64() * 1e3
        );
        Ok(c)
    }

    /// Join, as the replacement of `rank` of a world of `world` ranks whose root segment tag
    /// is `root_tag`, the communicator its survivors grow (see the module docs):
    /// `restart_count` is the launcher's `LOCKSTEP_RESTART_COUNT`. Waits up to the join timeout
    /// for the survivors' segment.
    pub fn join_replacement(
        root_tag: &str,
        rank: usize,
        world: usize,
        restart_count: u64,
        cfg: ShmConfig,
    ) -> Result<ShmComm, CommError> {
        if rank >= world {
            return Err(CommError::Setup(format!(
                "replacement rank {rank} is out of range for world size {world}"
            )));
        }
        let cfg = cfg.normalized_for(world);
        let dir = cfg.checked_shm_dir()?;
        let first = restart_count.max(1);
        let names = (first..first + world as u64)
            .map(|d| Ok((d, SegName::new(dir, &format!("{root_tag}.g{d}"))?)))
            .collect::<Result<Vec<_>, CommError>>()?;
        let start = Instant::now();
        // Polled with back-off, as a world segment is (it has no futex before it exists).
        let mut nap = Duration::from_micros(50);
        loop {
            for (d, name) in &names {
                let Some((seg, layout)) = open_ready(name, world)? else {
                    continue;
                };
                // SAFETY: the mapping is at least a Header long (open_ready checked its size)
                // and page-aligned; the header's fields are atomics.
                let generation = unsafe { &*(seg.base() as *const Header) }
                    .shrink
                    .generation
                    .load(Relaxed);
                let tag = format!("{root_tag}.g{d}");
                let mut c =
                    join(Arc::new(seg), layout, cfg, rank, Some(name), None)?.with_tag(&tag);
                c.set_generation(generation);
                c.set_lineage(Some(Lineage {
                    tag: root_tag.to_string(),
                    world,
                    replaced: *d,
                }));
                tracing::info!(
                    "grow: replacement rank {rank} joined its survivors in {name} (generation {generation}, after {:.1} ms)",
                    start.elapsed().as_secs_f64() * 1e3
                );
                return Ok(c);
            }
            if start.elapsed() > cfg.join_timeout {
                return Err(CommError::Setup(format!(
                    "replacement rank {rank}: no survivors of job {root_tag} waited for it: segment {} did not appear within {:.0} s (LOCKSTEP_JOIN_TIMEOUT_S). The other ranks must call grow after they lose a peer; a program that does not recover in the job should run under --restart-policy job",
                    names[0].1,
                    cfg.join_timeout.as_secs_f64()
                )));
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(1));
        }
    }
}
