//! Timing collectives for rank 0's two tuners (`shm::tune`): cached or streaming stores into the
//! slots, and the slots or a cross-memory copy for ordinary buffers.
//!
//! Every rank times its part of a call whose way was chosen by a tuner, from the start of its own
//! work before `begin` (less the wait in `begin`, mostly how late the peers came) to the end of
//! the call, and sends the time to rank 0 in its next descriptor. Rank 0 records the slowest
//! rank's time once all have arrived. Why every rank: a call costs what its slowest rank spends,
//! and rank 0 alone may see little of it (a broadcast's root on the slots only writes them, its
//! peers copy out).

use std::time::{Duration, Instant};

use super::config::ShmConfig;
use super::sync::Desc;
use super::tune::Tuner;
use crate::comm::CollKind;

/// One timed call: (class group, bytes, the way it ran, start).
type Timed = (usize, usize, bool, Instant);

/// One rank's tuners and the clocks of its current call.
pub(crate) struct Timing {
    /// Cached (`false`) or streaming (`true`) stores into the slots.
    streaming: Tuner,
    /// The slots (`false`) or a cross-memory copy (`true`), for ordinary buffers.
    cma: Tuner,
    /// The current call on the slots, to time.
    slots_call: Option<Timed>,
    /// The class (group, bytes) of the current call when it may take either the slots or a
    /// cross-memory copy, from the offer to the verdict.
    cma_class: Option<(usize, usize)>,
    /// The current call, to time for the choice of a cross-memory copy.
    cma_call: Option<Timed>,
    /// When this rank began the current call's work (its slot writes, or its offer of a
    /// cross-memory copy), then how long that took until `begin` (see [`pre_begin`](Self::pre_begin)).
    clock: (Option<Instant>, Duration),
    /// This rank's time in its last timed call: (low 32 bits of its number, nanoseconds), sent
    /// to rank 0 in the next descriptor.
    report: (u32, u64),
    /// Rank 0: its last timed call, waiting for the peers' times.
    pending: Option<Pending>,
}

/// Rank 0's last timed call, recorded once every rank's time for it has arrived.
struct Pending {
    /// Low 32 bits of its number.
    seq: u32,
    /// Rank 0's own time.
    secs: f64,
    /// The classes and ways it was timed for: the stores (group, bytes, streaming) and the path
    /// (group, bytes, cross-memory).
    slots: Option<(usize, usize, bool)>,
    cma: Option<(usize, usize, bool)>,
}

impl Timing {
    pub(crate) fn new(cfg: &ShmConfig) -> Timing {
        Timing {
            streaming: Tuner::streaming_stores(cfg.stage),
            cma: Tuner::cma_path(cfg.single_copy),
            slots_call: None,
            cma_class: None,
            cma_call: None,
            clock: (None, Duration::ZERO),
            report: (0, 0),
            pending: None,
        }
    }

    /// When the current call started, counting this rank's work before `begin` and everything
    /// after it, but not the wait in `begin`, which is mostly how late the peers came.
    fn pre_begin(&self) -> Instant {
        Instant::now()
            .checked_sub(self.clock.1)
            .unwrap_or_else(Instant::now)
    }

    /// Streaming stores for the slot writes made before the descriptors are exchanged: rank 0
    /// (`rank0`) chooses, the others guess rank 0's last choice.
    pub(crate) fn streaming_pre(&mut self, rank0: bool, kind: CollKind, bytes: usize) -> bool {
        let g = stage_group(kind);
        let now = Instant::now();
        self.clock = (Some(now), Duration::ZERO);
        if rank0 {
            self.streaming.choose(g, bytes, now)
        } else {
            self.streaming.guess(g, bytes)
        }
    }

    /// Every rank learns rank 0's choice (`streaming`) from its descriptor; when the call runs
    /// on the slots (`timed`), its time counts from here: every rank has arrived.
    pub(crate) fn streaming_agreed(
        &mut self,
        kind: CollKind,
        bytes: usize,
        streaming: bool,
        timed: bool,
    ) {
        self.streaming.seen(stage_group(kind), bytes, streaming);
        if timed {
            self.slots_call = Some((stage_group(kind), bytes, streaming, self.pre_begin()));
        }
    }

    /// The offer of a cross-memory copy: `class` (group, bytes) when the call may take it, else
    /// `None`. Returns whether this rank offers it: rank 0 on a first attempt (`choose`) picks,
    /// the others follow rank 0's last pick for the class.
    pub(crate) fn cma_offer(&mut self, class: Option<(usize, usize)>, choose: bool) -> bool {
        self.cma_class = class;
        let Some((g, bytes)) = class else {
            return false;
        };
        self.clock = (Some(Instant::now()), Duration::ZERO);
        if choose {
            self.cma.choose(g, bytes, Instant::now())
        } else {
            self.cma.guess(g, bytes)
        }
    }

    /// After the descriptors of a call that offered: rank 0's pick (`rank0_cma`), and the way
    /// the call runs if every rank agreed (`runs_cma`, `None` when the offers differed).
    pub(crate) fn cma_seen(&mut self, rank0_cma: bool, runs_cma: Option<bool>) {
        if let Some((g, bytes)) = self.cma_class.take() {
            self.cma.seen(g, bytes, rank0_cma);
            if let Some(cma) = runs_cma {
                self.cma_call = Some((g, bytes, cma, self.pre_begin()));
            }
        }
    }

    /// The current call no longer times the choice of a cross-memory copy (the probe refused it).
    pub(crate) fn cma_untimed(&mut self) {
        self.cma_call = None;
    }

    /// At `begin`: stop the clock of the work before it, and take the time to report to rank 0
    /// (low 32 bits of the call's number, nanoseconds).
    pub(crate) fn at_begin(&mut self) -> (u32, u64) {
        if let (Some(t), _) = self.clock {
            self.clock = (None, t.elapsed());
        }
        std::mem::take(&mut self.report)
    }

    /// Leave call number `seq`: keep this rank's time in it if it succeeded (`ok`) and was
    /// timed; rank 0 (`rank0`) keeps it for its tuners until the peers' times arrive.
    pub(crate) fn end_call(&mut self, ok: bool, seq: u64, rank0: bool) {
        let slots = self.slots_call.take();
        let cma = self.cma_call.take();
        self.cma_class = None;
        let start = match (slots, cma) {
            (Some(a), Some(b)) => Some(a.3.min(b.3)),
            (a, b) => a.or(b).map(|t| t.3),
        };
        if let (Some(t0), true) = (start, ok) {
            let secs = t0.elapsed().as_secs_f64();
            self.report = (seq as u32, (secs * 1e9) as u64);
            if rank0 {
                let class = |t: Option<Timed>| t.map(|(g, b, m, _)| (g, b, m));
                self.pending = Some(Pending {
                    seq: seq as u32,
                    secs,
                    slots: class(slots),
                    cma: class(cma),
                });
            }
        }
    }

    /// Rank 0, once the descriptors are in: record its last timed call with the slowest time any
    /// rank reported for it. A rank that did not time that call (it failed there) leaves the
    /// measurement out.
    pub(crate) fn record_pending(&mut self, descs: &[Desc]) {
        let Some(p) = self.pending.take() else { return };
        let mut secs = p.secs;
        for d in descs.iter().skip(1) {
            if d.took_seq != p.seq || d.took_ns == 0 {
                return;
            }
            secs = secs.max(d.took_ns as f64 * 1e-9);
        }
        tracing::trace!(own = p.secs * 1e6, max = secs * 1e6, slots = ?p.slots, cma = ?p.cma, "tuner record");
        if let Some((g, b, nt)) = p.slots {
            self.streaming.record(g, b, nt, secs);
        }
        // A call on the slots measures them only with the stores the streaming tuner settled on:
        // during its warm-up, and in its probes, it runs the other way on purpose, and those
        // times (streaming stores at 1 MiB with a shared cache: 2x) would make the slots look
        // slower than they are. The path tuner then waits, choosing the slots, until the stores
        // have settled.
        let slots_as_settled = p
            .slots
            .is_none_or(|(g, b, nt)| self.streaming.settled_on(g, b, nt));
        if let Some((g, b, cma)) = p.cma {
            if cma || slots_as_settled {
                self.cma.record(g, b, cma, secs);
            }
        }
    }
}

/// Tuning class of a collective (see `shm::tune`).
pub(crate) fn stage_group(kind: CollKind) -> usize {
    match kind {
        CollKind::AllReduce | CollKind::Reduce | CollKind::Barrier => 0,
        CollKind::Broadcast => 1,
        CollKind::AllGather | CollKind::Gather => 2,
        CollKind::ReduceScatter => 3,
        // The exchanges use cached stores only; they share the gather class.
        _ => 2,
    }
}
