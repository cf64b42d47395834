//! Whether the peers are still there: watching their processes, the communicator's abort record
//! (why it failed, for every rank to report the same culprit), the overall timeout, and how
//! errors name ranks (global ranks, and a sub-communicator's own).
//!
//! The waits of the phase protocol (`Channel::wait_for`) call [`Liveness::check_peers`] while
//! they sleep, and [`Liveness::check_abort`] after each wait.

use std::sync::atomic::Ordering::{Acquire, Relaxed, Release, SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::segment::PeerWatch;
use super::sync::{
    Abort, Ctrl, Header, ABORT_DIED, ABORT_LEFT, ABORT_SHRINK, ABORT_TIMEOUT, STATE_LEFT,
};
use crate::comm::{rank_name, Arrival, CollKind, CommError, TIMEOUT_HINT};

/// Where a phase is, for error messages.
#[derive(Clone, Copy)]
pub(crate) struct Ctx<'a> {
    pub op: CollKind,
    pub seq: u64,
    /// The flight recorder's note of the call's start, when recording: taken at the call's first
    /// wait for its peers (`Channel::wait_for`).
    pub arrival: Option<&'a Arrival<'a>>,
}

/// One rank's watch over its peers.
pub(crate) struct Liveness {
    rank: usize,
    world: usize,
    peers: Vec<Option<PeerWatch>>,
    /// A sub-communicator's global ranks (see `shm::split`), which its errors name; `None` for a
    /// world communicator.
    global: Option<Arc<[usize]>>,
}

impl Liveness {
    pub(crate) fn new(rank: usize, world: usize) -> Liveness {
        Liveness {
            rank,
            world,
            peers: Vec::new(),
            global: None,
        }
    }

    /// Make this the liveness of a sub-communicator whose rank `i` is global rank `global[i]`.
    pub(crate) fn set_global(&mut self, global: Arc<[usize]>) {
        self.global = Some(global);
    }

    /// The global ranks of a sub-communicator's ranks (`None`: a world communicator).
    pub(crate) fn global_ranks(&self) -> Option<&Arc<[usize]>> {
        self.global.as_ref()
    }

    /// The global rank of rank `r`.
    pub(crate) fn global(&self, r: usize) -> usize {
        self.global
            .as_ref()
            .and_then(|g| g.get(r).copied())
            .unwrap_or(r)
    }

    /// How errors name rank `r`: `rank 3`, or in a sub-communicator `rank 3 (rank 1 of this
    /// sub-communicator)`.
    pub(crate) fn who(&self, r: usize) -> String {
        rank_name(self.global.as_deref(), r)
    }

    /// The error for peer `r`, gone (`died`, or left the communicator) while this rank waited for
    /// it in `op` #`seq`; global ranks, and in a sub-communicator where the two sit in it.
    pub(crate) fn peer_lost(
        &self,
        ctrls: &[Ctrl],
        r: usize,
        died: bool,
        op: CollKind,
        seq: u64,
    ) -> CommError {
        let group = match &self.global {
            Some(_) => format!(
                " of a sub-communicator (rank {} is its rank {r}, rank {} its rank {})",
                self.global(r),
                self.global(self.rank),
                self.rank
            ),
            None => String::new(),
        };
        CommError::PeerLost {
            rank: self.global(self.rank),
            lost_rank: self.global(r),
            pid: ctrls[r].pid.load(Relaxed),
            how: if died {
                "died"
            } else {
                "left the communicator"
            },
            op,
            seq,
            group,
        }
    }

    /// Start watching every peer's process (their pids are written once all ranks have joined).
    pub(crate) fn watch_peers(&mut self, pids: &[i32]) {
        self.peers = (0..self.world)
            .map(|r| {
                if r == self.rank {
                    None
                } else {
                    Some(PeerWatch::new(pids[r]))
                }
            })
            .collect();
    }

    /// Whether peer `r` is gone: `Some(true)` if its process died, `Some(false)` if it left the
    /// communicator, `None` while it is there (point-to-point waits check their own peers).
    pub(crate) fn peer_gone(&self, ctrls: &[Ctrl], r: usize) -> Option<bool> {
        if self
            .peers
            .get(r)
            .and_then(|w| w.as_ref())
            .is_some_and(|w| w.is_dead())
        {
            return Some(true);
        }
        (ctrls[r].state.load(Acquire) == STATE_LEFT).then_some(false)
    }

    /// After a wait: a rank that comes late finds its peers' phase published even though they
    /// gave up on it (timed out) and went on: it must fail too, naming the same culprit, not read
    /// buffers their callers own again. One load of a line nobody writes while all is well.
    pub(crate) fn check_abort(
        &self,
        header: &Header,
        ctrls: &[Ctrl],
        cx: Ctx,
    ) -> Result<(), CommError> {
        let a = &header.abort;
        if a.by.load(Acquire) != 0 {
            // An abort recorded in a later collective (a peer that finished this one went on and
            // lost a rank there) does not undo this phase: this rank's next call fails instead.
            let later = a.ready.load(Acquire) != 0 && a.at_seq.load(Relaxed) > cx.seq;
            if !later {
                if let Some(e) = self.peer_abort(header, ctrls, cx) {
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Slow-path health check: abort flag, dead or departed peers, overall timeout.
    /// `arrived(r)`: whether peer `r` has arrived; the peers before `next` have.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn check_peers(
        &self,
        header: &Header,
        ctrls: &[Ctrl],
        arrived: &dyn Fn(usize) -> bool,
        next: usize,
        cx: Ctx,
        start: Instant,
        timeout: Duration,
    ) -> Result<(), CommError> {
        for r in next..self.world {
            if r == self.rank {
                continue;
            }
            let c = &ctrls[r];
            if arrived(r) {
                continue;
            }
            let died = self.peers[r].as_ref().is_some_and(|w| w.is_dead());
            let left = c.state.load(Acquire) == STATE_LEFT;
            // A peer publishes its progress before it leaves or exits: one that reached the target
            // and then went away between the two loads above did its part of this phase.
            if (died || left) && arrived(r) {
                continue;
            }
            if died || left {
                // Tell ranks that wait on someone else too.
                self.record_abort(header, |a| {
                    a.how
                        .store(if died { ABORT_DIED } else { ABORT_LEFT }, Relaxed);
                    a.rank.store(r as u32 + 1, Relaxed);
                    a.at_seq.store(cx.seq, Relaxed);
                });
                return Err(self.peer_lost(ctrls, r, died, cx.op, cx.seq));
            }
        }
        if let Some(e) = self.peer_abort(header, ctrls, cx) {
            return Err(e);
        }
        let waited = start.elapsed();
        if waited >= timeout {
            let stuck: Vec<usize> = (0..self.world)
                .filter(|&r| r != self.rank && !arrived(r))
                .collect();
            let first = stuck.first().copied().unwrap_or(self.rank);
            let (seq, kind) = position(&ctrls[first]);
            // Peers that arrive later must not go on using this rank's buffers, and must name the
            // same culprit as this rank.
            self.record_abort(header, |a| {
                a.how.store(ABORT_TIMEOUT, Relaxed);
                a.rank.store(first as u32 + 1, Relaxed);
                a.culprit_seq.store(seq, Relaxed);
                a.culprit_kind
                    .store(kind.map_or(0, |k| k as u32 + 1), Relaxed);
                a.missing.store(stuck.len() as u32, Relaxed);
                a.at_kind.store(cx.op as u32 + 1, Relaxed);
                a.at_seq.store(cx.seq, Relaxed);
                a.waited_ms.store(waited.as_millis() as u64, Relaxed);
            });
            let missing: Vec<String> = stuck
                .iter()
                .map(|&r| {
                    let (seq, kind) = position(&ctrls[r]);
                    stuck_text(&self.who(r), self.global(r), seq, kind, cx.op, cx.seq)
                })
                .collect();
            return Err(CommError::Timeout {
                rank: self.global(self.rank),
                op: cx.op,
                seq: cx.seq,
                secs: waited.as_secs_f64(),
                missing: stuck.iter().map(|&r| self.global(r)).collect(),
                detail: format!(
                    "{} not arrived: {}; this rank ({}) is at #{}",
                    if missing.len() == 1 {
                        "one rank has".to_string()
                    } else {
                        format!("{} ranks have", missing.len())
                    },
                    missing.join(", "),
                    self.who(self.rank),
                    cx.seq
                ),
            });
        }
        Ok(())
    }

    /// Abort the communicator because this rank shrinks it (`shm::shrink`), unless a peer
    /// aborted it first: peers blocked in a call on it fail within a peer check and can join the
    /// shrink, rather than wait for this rank until the timeout.
    pub(crate) fn abort_for_shrink(&self, header: &Header, seq: u64) {
        self.record_abort(header, |a| {
            a.how.store(ABORT_SHRINK, Relaxed);
            a.rank.store(self.rank as u32 + 1, Relaxed);
            a.at_seq.store(seq, Relaxed);
        });
    }

    /// Abort the communicator for every rank, describing why with `fill`, unless a peer did first.
    fn record_abort(&self, header: &Header, fill: impl FnOnce(&Abort)) {
        let a = &header.abort;
        if a.by
            .compare_exchange(0, self.rank as u32 + 1, SeqCst, SeqCst)
            .is_ok()
        {
            fill(a);
            a.ready.store(1, Release);
        }
    }

    /// The error for a communicator a peer aborted, naming the culprit the peer recorded.
    fn peer_abort(&self, header: &Header, ctrls: &[Ctrl], cx: Ctx) -> Option<CommError> {
        let a = &header.abort;
        let by = a.by.load(Acquire);
        if by == 0 || by as usize - 1 == self.rank {
            return None;
        }
        let by = by as usize - 1;
        // The aborting rank fills the record right after claiming it: wait briefly for it.
        let t = Instant::now();
        while a.ready.load(Acquire) == 0 && t.elapsed() < Duration::from_millis(50) {
            std::thread::yield_now();
        }
        let culprit = a.rank.load(Relaxed) as usize;
        if a.ready.load(Acquire) == 0 || culprit == 0 {
            return Some(CommError::Aborted {
                by: self.global(by),
                reason: "it hit an unrecoverable error".into(),
            });
        }
        let culprit = culprit - 1;
        Some(match a.how.load(Relaxed) {
            ABORT_DIED | ABORT_LEFT => self.peer_lost(
                ctrls,
                culprit,
                a.how.load(Relaxed) == ABORT_DIED,
                cx.op,
                cx.seq,
            ),
            ABORT_SHRINK => CommError::Aborted {
                by: self.global(by),
                reason: format!(
                    "{} is shrinking this communicator (after a failure, or to exclude ranks): call shrink on this rank too to get the communicator of the ranks that remain",
                    self.who(by)
                ),
            },
            _ => {
                let kind = a.culprit_kind.load(Relaxed);
                let kind = if kind == 0 {
                    None
                } else {
                    CollKind::from_u8((kind - 1) as u8)
                };
                let at_kind =
                    CollKind::from_u8((a.at_kind.load(Relaxed).max(1) - 1) as u8).unwrap_or(cx.op);
                let at_seq = a.at_seq.load(Relaxed);
                let more = a.missing.load(Relaxed).saturating_sub(1);
                CommError::Aborted {
                    by: self.global(by),
                    reason: format!(
                        "{}{}: {} timed out after {:.1} s waiting for it in {at_kind} #{at_seq} ({TIMEOUT_HINT})",
                        stuck_text(&self.who(culprit), self.global(culprit), a.culprit_seq.load(Relaxed), kind, at_kind, at_seq),
                        if more > 0 { format!(", and {more} more rank(s) had not arrived") } else { String::new() },
                        self.who(by),
                        a.waited_ms.load(Relaxed) as f64 / 1e3,
                    ),
                }
            }
        })
    }
}

/// The collective a rank (its control block `c`) is in or last was in: its sequence number and
/// kind.
fn position(c: &Ctrl) -> (u64, Option<CollKind>) {
    let kind = c.coll_kind.load(Relaxed);
    (
        c.coll_seq.load(Relaxed),
        if kind == 0 {
            None
        } else {
            CollKind::from_u8((kind - 1) as u8)
        },
    )
}

/// Where a rank that has not arrived at `op` #`seq` is: in it (it entered the collective but does
/// not progress), or before it (at an earlier collective, or none yet). `who` names the rank,
/// `g` is its global rank.
fn stuck_text(
    who: &str,
    g: usize,
    r_seq: u64,
    r_kind: Option<CollKind>,
    op: CollKind,
    seq: u64,
) -> String {
    if r_seq >= seq {
        format!("{who} is stuck in {} #{r_seq}", r_kind.unwrap_or(op))
    } else if r_seq == 0 {
        format!("{who} is stuck before {op} #{seq} (rank {g} is at collective #0: it has not started any)")
    } else {
        let k = r_kind.map(|k| format!(", {k}")).unwrap_or_default();
        format!("{who} is stuck before {op} #{seq} (rank {g} is at collective #{r_seq}{k})")
    }
}
