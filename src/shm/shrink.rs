//! Shrinking a communicator after a failure ([`Communicator::shrink`]): the ranks that remain
//! agree, through the segment, on who they are, and meet in a segment of their own.
//!
//! Agreement. Each rank's fate in shrink attempt `k` of a segment is one word, its control
//! block's `Ctrl::shrink`, set once per attempt by one compare-and-swap from an earlier
//! attempt's value: by the rank itself (`k, joined`) when it calls shrink, or by any peer (`k,
//! excluded`) once that peer sees the rank's process dead (pidfd), the rank gone from the
//! communicator, the rank listed in its `exclude`, or its own wait for the rank over. Whichever
//! swap comes first decides, and nothing undoes it, so every rank that reads all the words of
//! attempt `k` reads the same members: no rank uses the new communicator before every word is
//! decided. A rank that was only slow (stopped, descheduled) finds itself excluded in its word
//! on its next call or shrink and gets [`CommError::Excluded`]; an excluded rank never rejoins
//! (later attempts exclude it at once).
//!
//! The new communicator. The members meet in a new named segment, `<tag>.x<k>` beside the
//! parent's (tags as for `shm::split`), which the member with the lowest rank creates and
//! reports in the header's shrink record (`ShrinkArea::created`); the others wait for that
//! report (or the creator's death), then all join it as a sub-communicator whose global ranks are
//! the members' and whose processes are known, so a member that dies meanwhile fails the join
//! at once. The last to join removes its name, so it goes away with its last process. Nothing
//! of the old segment is read again: an excluded rank that wakes up and writes its slots,
//! progress or inline entries writes where no member looks, so it cannot corrupt the new
//! communicator. The old communicator fails every later call ([`CommError::Shrunk`]) and
//! keeps its memory until it is dropped: repeated shrinks hold one segment per live
//! communicator, each sized for its members.
//!
//! A member that dies after posting itself but before the new segment is joined makes the
//! attempt fail on every member; the members then start the next attempt at once (a few times),
//! which excludes it.
//!
//! [`Communicator::shrink`]: crate::comm::Communicator::shrink

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release, SeqCst};
use std::time::{Duration, Instant};

use super::backend::ShmComm;
use super::segment::{futex_wait, futex_wake_all, SegName};
use super::sync::{Header, SHRINK_CREATED, SHRINK_EXCLUDED, SHRINK_FAILED, SHRINK_JOINED};
use crate::comm::{Backend, CommError};

/// How many attempts one shrink makes when members die during it.
const ATTEMPTS: u64 = 4;
/// The longest sleep of a shrink's waits between two looks at the peers.
const POLL: Duration = Duration::from_millis(2);

/// A shrink word: `attempt` and its status.
fn word(attempt: u64, status: u64) -> u64 {
    attempt << 2 | status
}

fn attempt_of(w: u64) -> u64 {
    w >> 2
}

fn status_of(w: u64) -> u64 {
    w & 3
}

/// Wake every rank asleep on the header's futex word (they recheck what they wait for).
fn wake(h: &Header) {
    h.wake.0.fetch_add(1, SeqCst);
    futex_wake_all(&h.wake.0);
}

impl ShmComm {
    /// Whether calls on this communicator may still run: an error once it was shrunk (its
    /// successor is the communicator to use) or when its peers excluded this rank in a shrink.
    /// One load of the header's shrink line, which nobody writes until a shrink starts.
    #[inline]
    pub(crate) fn check_shrink(&self) -> Result<(), CommError> {
        if let Some(generation) = self.shrunk() {
            return Err(CommError::Shrunk {
                rank: self.channel().global(self.channel().rank()),
                generation,
            });
        }
        let ch = self.channel();
        if ch.header().shrink.attempt.load(Relaxed) == 0 {
            return Ok(());
        }
        let mine = ch.ctrl(ch.rank()).shrink.load(Acquire);
        if status_of(mine) == SHRINK_EXCLUDED {
            return Err(self.excluded());
        }
        Ok(())
    }

    fn excluded(&self) -> CommError {
        let ch = self.channel();
        CommError::Excluded {
            rank: ch.global(ch.rank()),
            generation: self.generation() + 1,
            detail: format!(
                "its peers shrank the communicator of {} ranks without it (it did not call shrink within their wait: it was stopped or slow, or a peer listed it to exclude)",
                ch.world()
            ),
        }
    }

    /// Shrink this communicator (see [`Backend::shrink`](crate::comm::Backend::shrink)): the
    /// communicator of the ranks that call it, agreed as the module docs say.
    pub(crate) fn shrink_shm(
        &mut self,
        exclude: &[usize],
        wait: Duration,
    ) -> Result<ShmComm, CommError> {
        self.check_shrink()?;
        let (n, me) = (self.world_size(), self.rank());
        if let Some(&r) = exclude.iter().find(|&&r| r >= n || r == me) {
            return Err(CommError::Unsupported(format!(
                "shrink on {}: cannot exclude rank {r} of a communicator of {n} ranks ({}); list other ranks of this communicator",
                self.channel().who(me),
                if r == me { "it is this rank: a rank that leaves does not call shrink" } else { "out of range" }
            )));
        }
        // Peers blocked in a call on this communicator fail within a peer check, and come here.
        self.channel().abort_for_shrink();
        let mut tries = 0;
        loop {
            tries += 1;
            let k = self.post()?;
            let members = self.decide(k, exclude, wait)?;
            match self.meet(k, &members) {
                Ok(mut c) => {
                    c.set_generation(self.generation() + 1);
                    c.set_lineage(self.lineage());
                    self.set_shrunk(self.generation() + 1);
                    tracing::info!(
                        "shrink: rank {} is rank {} of {} (generation {}, attempt {k})",
                        self.channel().global(me),
                        c.rank(),
                        c.world_size(),
                        self.generation() + 1
                    );
                    return Ok(c);
                }
                // A member died during the attempt: the next one excludes it.
                Err(e)
                    if tries < ATTEMPTS
                        && members
                            .iter()
                            .any(|&r| r != me && self.channel().peer_gone(r) == Some(true)) =>
                {
                    tracing::info!("shrink attempt {k} failed, a member died: {e}");
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Post this rank for the next attempt of this segment; returns the attempt's number.
    fn post(&self) -> Result<u64, CommError> {
        let ch = self.channel();
        let h = ch.header();
        let own = &ch.ctrl(ch.rank()).shrink;
        let k = (attempt_of(own.load(Acquire)) + 1).max(h.shrink.attempt.load(Acquire));
        h.shrink.attempt.fetch_max(k, SeqCst);
        let mut cur = own.load(Acquire);
        loop {
            if status_of(cur) == SHRINK_EXCLUDED {
                return Err(self.excluded());
            }
            match own.compare_exchange(cur, word(k, SHRINK_JOINED), SeqCst, Acquire) {
                Ok(_) => break,
                Err(now) => cur = now,
            }
        }
        wake(h);
        Ok(k)
    }

    /// Wait until every rank's fate in attempt `k` is decided, deciding those that are gone,
    /// listed in `exclude`, or not there after `wait`; returns the members in rank order.
    fn decide(&self, k: u64, exclude: &[usize], wait: Duration) -> Result<Vec<usize>, CommError> {
        let ch = self.channel();
        let h = ch.header();
        let n = ch.world();
        let start = Instant::now();
        let mut fate: Vec<Option<bool>> = vec![None; n];
        fate[ch.rank()] = Some(true);
        loop {
            let w = h.wake.0.load(SeqCst);
            let mut open = false;
            for (r, fate) in fate.iter_mut().enumerate() {
                if fate.is_some() {
                    continue;
                }
                let c: &AtomicU64 = &ch.ctrl(r).shrink;
                let cur = c.load(Acquire);
                if attempt_of(cur) >= k {
                    *fate = Some(status_of(cur) == SHRINK_JOINED);
                    continue;
                }
                let out = status_of(cur) == SHRINK_EXCLUDED
                    || exclude.contains(&r)
                    || ch.peer_gone(r).is_some()
                    || start.elapsed() >= wait;
                if out {
                    // Fails only when the rank posted itself meanwhile: read again below.
                    if c.compare_exchange(cur, word(k, SHRINK_EXCLUDED), SeqCst, Acquire)
                        .is_ok()
                    {
                        wake(h);
                    }
                    let now = c.load(Acquire);
                    *fate = Some(status_of(now) == SHRINK_JOINED && attempt_of(now) >= k);
                    continue;
                }
                open = true;
            }
            if !open {
                break;
            }
            futex_wait(&h.wake.0, w, POLL);
        }
        Ok((0..n).filter(|&r| fate[r] == Some(true)).collect())
    }

    /// Create (on the first member) and join the segment of attempt `k`'s communicator.
    fn meet(&self, k: u64, members: &[usize]) -> Result<ShmComm, CommError> {
        let ch = self.channel();
        let h = ch.header();
        let me = ch.rank();
        let creator = members[0];
        let mut m = self.member(&format!("x{k}"), members)?;
        if me == creator {
            let generation = self.generation() + 1;
            let made = m.create().map(|seg| {
                // SAFETY: the new segment starts with a Header (page-aligned mapping), whose
                // fields are atomics; the members read it only after the release store below.
                let nh = unsafe { &*(seg.base() as *const Header) };
                nh.shrink.generation.store(generation, Relaxed);
            });
            let status = if made.is_ok() {
                SHRINK_CREATED
            } else {
                SHRINK_FAILED
            };
            h.shrink.created.store(word(k, status), Release);
            wake(h);
            made?;
        } else {
            self.await_creation(k, creator, &m.name)?;
        }
        m.join_or_unlink()
    }

    /// Wait until the creator of attempt `k`'s segment reports it made (or failed, or died).
    fn await_creation(&self, k: u64, creator: usize, name: &SegName) -> Result<(), CommError> {
        let ch = self.channel();
        let h = ch.header();
        let start = Instant::now();
        let limit = ch.config().join_timeout;
        loop {
            let w = h.wake.0.load(SeqCst);
            let c = h.shrink.created.load(Acquire);
            if attempt_of(c) == k {
                return match status_of(c) {
                    SHRINK_CREATED => Ok(()),
                    _ => Err(CommError::Setup(format!(
                        "shrink: {} could not create the new communicator's segment {name} (its own error says why), so no rank has a new communicator",
                        ch.who(creator)
                    ))),
                };
            }
            if attempt_of(c) > k {
                return Err(CommError::Setup(format!(
                    "shrink: the other ranks started shrink attempt {} while this rank waited in attempt {k}; call shrink again",
                    attempt_of(c)
                )));
            }
            if let Some(died) = ch.peer_gone(creator) {
                return Err(CommError::Setup(format!(
                    "shrink: {} {} before it created the new communicator's segment; call shrink again",
                    ch.who(creator),
                    if died { "died" } else { "left" }
                )));
            }
            if start.elapsed() >= limit {
                return Err(CommError::Setup(format!(
                    "shrink: {} did not create the new communicator's segment {name} within {:.0} s (LOCKSTEP_JOIN_TIMEOUT_S)",
                    ch.who(creator),
                    limit.as_secs_f64()
                )));
            }
            futex_wait(&h.wake.0, w, POLL);
        }
    }
}
