//! Sub-communicators of the shared-memory backend ([`Communicator::split`]).
//!
//! Every rank of the parent gives its `(color, key)` in an all-gather on the parent, so each
//! knows the members of its color and their order (by key, then parent rank). The members of a
//! color then meet in a segment of their own, named like the world's (`lockstep-<tag>` in
//! `/dev/shm` or `LOCKSTEP_SHM_DIR`), with tag `<parent tag>.s<split number>c<color>`: the parent
//! tag is the job id of a named world segment, `p<pid>.<start time>` of the process that made an
//! anonymous one (forked ranks share no file to inherit a new segment through), and a
//! sub-communicator's own tag for nested splits. The member with the lowest parent rank creates
//! it (header, creator identity, reserved memory) exactly as rank 0 creates a named world
//! segment; a second all-gather on the parent reports whether every creation worked, so a
//! failure is an error on every rank, and nobody waits for a segment that will not come. Then
//! the members join it like a world segment: the last to arrive removes its name, so it goes
//! away with the last process that maps it; a member that dies before joining is noticed at
//! once (its process is known from the parent); a name left behind by a killed creator is
//! reclaimed like a world segment's (`shm::stale`, `create_named`).
//!
//! The sub-communicator's channel knows the global rank of each of its ranks, and every error it
//! reports (mismatch, lost peer, timeout, abort) names them: `rank 3 (rank 1 of this
//! sub-communicator)`.
//!
//! [`Communicator::split`]: crate::comm::Communicator::split

use std::sync::atomic::Ordering::Acquire;
use std::sync::Arc;

use super::backend::ShmComm;
use super::bootstrap::{anonymous_tag, create_ready, join, open_ready, SubJoin};
use super::config::ShmConfig;
use super::segment::{SegName, Segment};
use super::sync::Layout;
use crate::comm::{Backend, Call, CollKind, CommError, Dtype, MemSpace, RawMem, ReduceOp, Splits};

/// One rank's part in a sub-communicator about to be joined (of a split, or of a shrink: see
/// `shm::shrink`).
pub(crate) struct Member {
    pub name: SegName,
    pub tag: String,
    pub cfg: ShmConfig,
    pub layout: Layout,
    /// Its rank in the sub-communicator.
    pub rank: usize,
    /// The segment, on the member that created it.
    pub created: Option<Segment>,
    pub sub: SubJoin,
}

impl ShmComm {
    /// Split this communicator (see [`Backend::split`]): `Ok(None)` for ranks with no color.
    pub(crate) fn split_shm(
        &mut self,
        color: Option<u32>,
        key: i64,
    ) -> Result<Option<ShmComm>, CommError> {
        let k = self.next_split();
        let n = self.world_size();
        let all = self.gather_i64(&[color.map_or(-1, i64::from), key, k as i64])?;
        // Ranks whose earlier splits failed differently would name different segments; the
        // failure paths below fail every rank, so this is a guard, not an expected error.
        let behind: Vec<String> = (0..n)
            .filter(|&r| all[3 * r + 2] != k as i64)
            .map(|r| self.channel().who(r))
            .collect();
        if !behind.is_empty() {
            return Err(CommError::Mismatch {
                seq: self.seq(),
                detail: format!(
                    "split #{k} of {}: {} counted another number of splits of this communicator; every rank must make the same splits",
                    self.channel().who(self.rank()),
                    behind.join(", ")
                ),
            });
        }
        let colors: Vec<i64> = (0..n).map(|r| all[3 * r]).collect();
        let keys: Vec<i64> = (0..n).map(|r| all[3 * r + 1]).collect();
        let member = match color {
            None => Ok(None),
            Some(c) => self.prepare(k, c, &colors, &keys).map(Some),
        };
        // Every creation must have worked before anyone joins: otherwise the members of a color
        // whose creator failed would wait for its segment until the join timeout.
        let ok = self.gather_i64(&[member.is_ok() as i64])?;
        let failed: Vec<String> = (0..n)
            .filter(|&r| ok[r] == 0)
            .map(|r| self.channel().who(r))
            .collect();
        if !failed.is_empty() {
            return Err(match member {
                Ok(m) => {
                    if let Some(m) = m.filter(|m| m.created.is_some()) {
                        m.name.unlink();
                    }
                    CommError::Setup(format!(
                        "split: {} could not set up its sub-communicator (its own error says why), so no sub-communicator was made",
                        failed.join(", ")
                    ))
                }
                Err(e) => e,
            });
        }
        let Some(m) = member? else { return Ok(None) };
        m.join_or_unlink().map(Some)
    }

    /// How the members `members` (ranks of this communicator, in their new order) join their
    /// sub-communicator: their global ranks and processes, and this rank's spin time.
    pub(crate) fn sub_join(&self, members: &[usize]) -> SubJoin {
        let ch = self.channel();
        SubJoin {
            global: Some(
                members
                    .iter()
                    .map(|&r| ch.global(r))
                    .collect::<Arc<[usize]>>(),
            ),
            pids: members
                .iter()
                .map(|&r| ch.ctrl(r).pid.load(Acquire))
                .collect(),
            spin: ch.spin(),
        }
    }

    /// An all-gather of `vals` (the same count on every rank) on this communicator. A mismatch
    /// here means a peer was not in a split: say so.
    pub(crate) fn gather_i64(&mut self, vals: &[i64]) -> Result<Vec<i64>, CommError> {
        let c = vals.len();
        let mut out = vec![0i64; c * self.world_size()];
        let call = Call {
            kind: CollKind::AllGather,
            dtype: Dtype::I64,
            op: ReduceOp::Sum,
            root: 0,
            count: c,
            send: RawMem {
                addr: vals.as_ptr() as usize,
                len: c,
                space: MemSpace::Host,
            },
            recv: RawMem {
                addr: out.as_mut_ptr() as usize,
                len: out.len(),
                space: MemSpace::Host,
            },
            splits: Splits::default(),
        };
        match self.run(&call) {
            Ok(()) => Ok(out),
            Err(CommError::Mismatch { seq, detail }) => Err(CommError::Mismatch {
                seq,
                detail: format!(
                    "{detail} (this rank was in split or new_group, which exchange colors and keys with all_gathers of i64 values on the parent communicator)"
                ),
            }),
            Err(e) => Err(e),
        }
    }

    /// The tag naming this communicator's segment (see the module docs).
    pub(crate) fn segment_tag(&self) -> String {
        if let Some(t) = self.tag() {
            return t.to_string();
        }
        anonymous_tag(self.channel().header())
    }

    /// This rank's part in split `k` with color `c`: its place among the members, and (on the
    /// member with the lowest parent rank) the created segment.
    fn prepare(&self, k: u64, c: u32, colors: &[i64], keys: &[i64]) -> Result<Member, CommError> {
        let me = self.rank();
        let mut members: Vec<usize> = (0..colors.len())
            .filter(|&r| colors[r] == i64::from(c))
            .collect();
        let creator = members[0];
        members.sort_by_key(|&r| (keys[r], r));
        let mut m = self.member(&format!("s{k}c{c}"), &members)?;
        if me == creator {
            m.create()?;
        }
        Ok(m)
    }

    /// This rank's part in a sub-communicator of `members` (ranks of this communicator, in
    /// their new order) whose segment's tag is this one's with `.suffix`; nothing created yet.
    pub(crate) fn member(&self, suffix: &str, members: &[usize]) -> Result<Member, CommError> {
        let ch = self.channel();
        let tag = format!("{}.{suffix}", self.segment_tag());
        let cfg = ch.config().clone().normalized_for(members.len());
        let name = SegName::new(cfg.checked_shm_dir()?, &tag)?;
        let layout = Layout::new(members.len(), cfg.slot_bytes, cfg.heap_bytes)?;
        Ok(Member {
            name,
            tag,
            cfg,
            layout,
            rank: members.iter().position(|&r| r == ch.rank()).unwrap_or(0),
            created: None,
            sub: self.sub_join(members),
        })
    }
}

impl Member {
    /// Create the sub-communicator's segment (this rank is the member that does), ready to join.
    pub(crate) fn create(&mut self) -> Result<&Segment, CommError> {
        let seg = create_ready(&self.name, &self.tag, &self.layout, &self.cfg)?;
        Ok(self.created.insert(seg))
    }

    /// [`join`](Self::join), removing the segment's name when the join fails (not every member
    /// has mapped it, so nobody else will), so nothing is left behind.
    pub(crate) fn join_or_unlink(self) -> Result<ShmComm, CommError> {
        let name = self.name.clone();
        let joined = self.join();
        if joined.is_err() {
            name.unlink();
        }
        joined
    }

    /// Join the sub-communicator's segment, which exists: every creator reported success.
    fn join(self) -> Result<ShmComm, CommError> {
        let Member {
            name,
            tag,
            cfg,
            layout,
            rank,
            created,
            sub,
        } = self;
        let (seg, layout) = match created {
            Some(seg) => (seg, layout),
            None => {
                let gone = || {
                    CommError::Setup(format!(
                        "the new communicator's segment {name} is gone or incomplete before this rank joined it (was it removed by hand?)"
                    ))
                };
                // The creator's sizes win, as for a world segment.
                open_ready(&name, layout.world)?.ok_or_else(gone)?
            }
        };
        Ok(join(Arc::new(seg), layout, cfg, rank, Some(&name), Some(&sub))?.with_tag(&tag))
    }
}
