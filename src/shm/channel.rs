//! One rank's end of the slot protocol described in [`sync`](super::sync): addressing the segment,
//! publishing phases, waiting for the peers (spin, yield, futex) while watching that they are alive,
//! the first phase of every call with its cross-rank argument check, and the bookkeeping of the
//! staging mode chosen by [`tune`](super::tune).
//!
//! The collective algorithms (`shm::algo`) are written against [`Channel`] only; job setup
//! (`shm::bootstrap`) creates it and marks the rank as gone when it is dropped.

use std::sync::atomic::fence;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release, SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::config::ShmConfig;
use super::reduce::{copy_block, copy_block2, store_fence};
use super::segment::{futex_wait, futex_wake_all, show_bytes, PeerWatch, Segment};
use super::sync::{
    Abort, Ctrl, Desc, FastHdr, Header, Layout, ABORT_DIED, ABORT_LEFT, ABORT_TIMEOUT, FAST_HDR,
    INVALID, SHARED_RECV, SHARED_SEND, STAGE_NT, STATE_LEFT,
};
use super::tune::Tuner;
use crate::comm::{
    rank_name, Call, CollKind, CommError, Dtype, MemSpace, RawMem, ReduceOp, TIMEOUT_HINT,
};

/// Where a phase is, for error messages.
#[derive(Clone, Copy)]
pub(crate) struct Ctx {
    pub op: CollKind,
    pub seq: u64,
}

/// One rank's view of a joined segment and its position in the phase protocol.
pub(crate) struct Channel {
    seg: Arc<Segment>,
    layout: Layout,
    cfg: ShmConfig,
    rank: usize,
    world: usize,
    /// Last phase this rank published.
    progress: u64,
    /// Collectives this rank has entered (including refused ones).
    seq: u64,
    peers: Vec<Option<PeerWatch>>,
    spin: Duration,
    /// Streaming stores were issued since the last fence.
    nt_pending: bool,
    /// The current collective stages with streaming stores: fence before every publish.
    stage_nt: bool,
    tuner: Tuner,
    /// The staged call in progress, to time: (class group, bytes, streaming, start).
    timing: Option<(usize, usize, bool, Instant)>,
    /// This rank's time in its last timed call: (low 32 bits of its number, nanoseconds), sent
    /// to rank 0 in the next descriptor.
    report: (u32, u64),
    /// Rank 0: its last timed call, waiting for the peers' times (see [`end_call`](Self::end_call)).
    pending: Option<Pending>,
    /// Single copy or staging, for collectives on ordinary buffers (`algo::single`).
    pub(crate) single: Tuner,
    /// The class (group, bytes) of the current call when it may take either path, from the
    /// offer to the verdict (`algo::single`).
    pub(crate) single_class: Option<(usize, usize)>,
    /// The current call, to time for `single`: (group, bytes, single copy, start).
    pub(crate) single_timing: Option<(usize, usize, bool, Instant)>,
    /// When this rank began the current call's work (its staging, or its offer of a single
    /// copy), then how long that took until `begin` (see [`pre_begin`](Self::pre_begin)).
    staging: (Option<Instant>, Duration),
    /// Direct copies between ranks (`process_vm_readv`) were refused once: every rank learnt it
    /// in the same phase, so all stop offering them.
    pub(crate) direct_refused: bool,
    /// Every rank read every peer's memory once, in a probe phase (`algo::single`): from then on
    /// a failed direct copy in a collective is an error, not a reason to stage.
    pub(crate) direct_verified: bool,
    /// Where the single-copy reductions land the peers' pieces before reducing them (reused
    /// across calls, so no allocation or page fault in steady state).
    pub(crate) scratch: Vec<u64>,
    /// A sub-communicator's global ranks (see `shm::split`), which its errors name; `None` for a
    /// world communicator.
    global: Option<Arc<[usize]>>,
    /// This rank's two staging slots are mapped ([`ensure_slots`](Self::ensure_slots)).
    slots_ready: bool,
}

impl Channel {
    /// A channel for `rank` over a segment whose header is initialised. Joining (the control
    /// block's state, the wait for the others) is the caller's job, then [`watch_peers`](Self::watch_peers).
    pub(crate) fn new(
        seg: Arc<Segment>,
        layout: Layout,
        cfg: ShmConfig,
        rank: usize,
        spin: Duration,
    ) -> Channel {
        let tuner = Tuner::staging(cfg.stage);
        let single = Tuner::single_copy(cfg.single_copy);
        Channel {
            seg,
            layout,
            cfg,
            rank,
            world: layout.world,
            progress: 0,
            seq: 0,
            peers: Vec::new(),
            spin,
            nt_pending: false,
            stage_nt: false,
            tuner,
            timing: None,
            report: (0, 0),
            pending: None,
            single,
            single_class: None,
            single_timing: None,
            staging: (None, Duration::ZERO),
            direct_refused: false,
            direct_verified: false,
            scratch: Vec::new(),
            global: None,
            slots_ready: false,
        }
    }

    /// Map this rank's two staging slots (allocating their pages in a named segment) before the
    /// first collective that may write them, so no collective page-faults on them, and a
    /// file system that filled up since the segment was created is an error here, never a
    /// SIGBUS. Done on first use rather than at join, because a job whose collectives all take
    /// the fast path (a start-up check, small-message jobs) never touches the slots; a peer reads
    /// a slot only after its owner wrote it in the same collective, so after this.
    pub(crate) fn ensure_slots(&mut self) -> Result<(), CommError> {
        if self.slots_ready {
            return Ok(());
        }
        let (off, len) = (
            self.layout.slot_off(self.rank, 0),
            2 * self.layout.slot_bytes,
        );
        self.seg.populate(off, len).map_err(|e| {
            super::segment::no_room_now(
                &e,
                &format!(
                    "the two staging slots of {} ({} each)",
                    self.who(self.rank),
                    show_bytes(self.layout.slot_bytes as u64)
                ),
            )
        })?;
        self.slots_ready = true;
        Ok(())
    }

    /// Make this the channel of a sub-communicator whose rank `i` is global rank `global[i]`.
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
    pub(crate) fn peer_lost(&self, r: usize, died: bool, op: CollKind, seq: u64) -> CommError {
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
            pid: self.ctrl(r).pid.load(Relaxed),
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
    pub(crate) fn watch_peers(&mut self) {
        self.peers = (0..self.world)
            .map(|r| {
                if r == self.rank {
                    None
                } else {
                    Some(PeerWatch::new(self.ctrl(r).pid.load(Acquire)))
                }
            })
            .collect();
    }

    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    pub(crate) fn world(&self) -> usize {
        self.world
    }

    /// Collectives this rank has entered.
    pub(crate) fn seq(&self) -> u64 {
        self.seq
    }

    /// The mapping, shared with the buffers allocated in it.
    pub(crate) fn seg(&self) -> &Arc<Segment> {
        &self.seg
    }

    /// Bytes of each staging slot.
    pub(crate) fn slot_bytes(&self) -> usize {
        self.layout.slot_bytes
    }

    /// Messages up to this size take the one-phase paths.
    pub(crate) fn small_bytes(&self) -> usize {
        self.cfg.small_bytes
    }

    /// The number the next published phase will have: the slot parity a caller stages into
    /// before its next `begin` or `phase`.
    pub(crate) fn next_phase(&self) -> u64 {
        self.progress + 1
    }

    /// The settings (timeouts, peer-check interval) this channel runs with.
    pub(crate) fn config(&self) -> &ShmConfig {
        &self.cfg
    }

    /// Wait at most `timeout` for the peers in the calls that follow (collectives and
    /// point-to-point alike: both read it from [`config`](Self::config) while they wait).
    pub(crate) fn set_timeout(&mut self, timeout: Duration) {
        self.cfg.timeout = timeout;
    }

    /// How long a waiter spins before yielding.
    pub(crate) fn spin(&self) -> Duration {
        self.spin
    }

    /// The segment's layout.
    pub(crate) fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Whether peer `r` is gone: `Some(true)` if its process died, `Some(false)` if it left the
    /// communicator, `None` while it is there (point-to-point waits check their own peers).
    pub(crate) fn peer_gone(&self, r: usize) -> Option<bool> {
        if self
            .peers
            .get(r)
            .and_then(|w| w.as_ref())
            .is_some_and(|w| w.is_dead())
        {
            return Some(true);
        }
        (self.ctrl(r).state.load(Acquire) == STATE_LEFT).then_some(false)
    }

    /// Wake the ranks asleep on the header's futex (after publishing something they may wait for).
    pub(crate) fn wake_sleepers(&self) {
        let h = self.header();
        if h.sleepers.0.load(SeqCst) > 0 {
            h.wake.0.fetch_add(1, SeqCst);
            futex_wake_all(&h.wake.0);
        }
    }

    /// After this rank published a phase or a fast entry with a release store: wait until every
    /// peer has arrived (`arrived`), wake the sleepers, and fail if a peer aborted the call (see
    /// [`check_abort`](Self::check_abort)).
    ///
    /// Why after the wait, and why a fence: a sequentially consistent store stalls the publisher
    /// until its cache line is exclusive again, a peer's read away (about 9 ns of a 35 ns
    /// exchange with a shared cache, `benches/baselines/xfloor.c`). A release store does not,
    /// but then the check for sleepers below must not be read before the store is visible: the
    /// fence orders them (the handshake of [`wait_for`](Self::wait_for)'s sleepers, whose
    /// increment is a locked instruction, so one side always sees the other). Placed after the
    /// wait, the fence finds the store long visible and costs about 1.5 ns. Waking late is
    /// harmless: a sleeper waits for every peer, so the last rank to arrive wakes it, and that
    /// rank's own wait ends at once.
    fn wait_published(
        &mut self,
        arrived: &impl Fn(&Channel, usize) -> bool,
        cx: Ctx,
    ) -> Result<(), CommError> {
        let waited = self.wait_for(arrived, cx);
        fence(SeqCst);
        self.wake_sleepers();
        waited?;
        self.check_abort(cx)
    }

    // ----------------------------------------------------------------------------------------
    // Segment access

    pub(crate) fn header(&self) -> &Header {
        // SAFETY: the header lies at offset 0 of the live mapping; all its fields are atomics.
        unsafe { &*(self.seg.base() as *const Header) }
    }

    pub(crate) fn ctrl(&self, r: usize) -> &Ctrl {
        // SAFETY: control blocks are inside the mapping (layout), 64-aligned; fields are atomics or
        // UnsafeCells accessed under the phase protocol.
        unsafe { &*(self.seg.base().add(self.layout.ctrl_off(r)) as *const Ctrl) }
    }

    /// Rank `r`'s staging slot of phase `phase` (by parity). This rank's own only after
    /// [`ensure_slots`](Self::ensure_slots).
    pub(crate) fn slot(&self, r: usize, phase: u64) -> *mut u8 {
        debug_assert!(
            r != self.rank || self.slots_ready,
            "a collective staged data before ensure_slots"
        );
        // SAFETY: slot offsets lie inside the mapping by construction of the layout.
        unsafe { self.seg.base().add(self.layout.slot_off(r, phase)) }
    }

    /// The address of a segment offset taken from a peer's descriptor.
    pub(crate) fn at(&self, off: u64) -> *mut u8 {
        // SAFETY: offsets come from descriptors written by ranks that took them from `shared_off`,
        // which only accepts ranges inside that rank's heap region of the mapping.
        unsafe { self.seg.base().add(off as usize) }
    }

    /// Segment offset of a host buffer if it lies entirely in this rank's heap region.
    fn shared_off(&self, addr: usize, bytes: usize) -> Option<u64> {
        let lo = self.seg.base() as usize + self.layout.heap_off(self.rank);
        let hi = lo + self.layout.heap_bytes;
        (addr >= lo && addr + bytes <= hi && bytes > 0)
            .then(|| (addr - self.seg.base() as usize) as u64)
    }

    fn write_desc(&self, phase: u64, d: Desc) {
        // SAFETY: only this rank writes its own descriptor cell, and peers read the cell of parity
        // `phase % 2` only between our publish of `phase` and their publish of `phase + 1`, which
        // precedes any later write of the same parity by us (see sync.rs).
        unsafe { *self.ctrl(self.rank).desc[(phase % 2) as usize].0.get() = d };
    }

    fn read_desc(&self, r: usize, phase: u64) -> Desc {
        // SAFETY: see write_desc; called after waiting for all ranks to reach `phase`.
        unsafe { *self.ctrl(r).desc[(phase % 2) as usize].0.get() }
    }

    // ----------------------------------------------------------------------------------------
    // Phases

    /// Publish the next phase and return its number.
    fn publish(&mut self) -> u64 {
        if self.nt_pending || self.stage_nt {
            store_fence();
            self.nt_pending = false;
        }
        self.progress += 1;
        // Release, not SeqCst: the sleepers are checked after the wait (`wait_published`).
        self.ctrl(self.rank).progress.store(self.progress, Release);
        self.progress
    }

    /// Whether every peer from `*next` on has arrived (`arrived(self, r)`), advancing `*next`
    /// past those that have, so a later poll starts at the first one still missing.
    fn all_arrived(&self, arrived: &impl Fn(&Channel, usize) -> bool, next: &mut usize) -> bool {
        while *next < self.world {
            if *next != self.rank && !arrived(self, *next) {
                return false;
            }
            *next += 1;
        }
        true
    }

    /// Publish and wait for every peer to reach the same phase. Returns the phase number.
    pub(crate) fn phase(&mut self, cx: Ctx) -> Result<u64, CommError> {
        let p = self.publish();
        self.wait_published(
            &|ch: &Channel, r: usize| ch.ctrl(r).progress.load(Acquire) >= p,
            cx,
        )?;
        Ok(p)
    }

    /// After a wait: a rank that comes late finds its peers' phase published even though they
    /// gave up on it (timed out) and went on: it must fail too, naming the same culprit, not read
    /// buffers their callers own again. One load of a line nobody writes while all is well.
    fn check_abort(&self, cx: Ctx) -> Result<(), CommError> {
        let a = &self.header().abort;
        if a.by.load(Acquire) != 0 {
            // An abort recorded in a later collective (a peer that finished this one went on and
            // lost a rank there) does not undo this phase: this rank's next call fails instead.
            let later = a.ready.load(Acquire) != 0 && a.at_seq.load(Relaxed) > cx.seq;
            if !later {
                if let Some(e) = self.peer_abort(cx) {
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Wait until every peer `r` has arrived (`arrived(self, r)`): spin, then yield, then sleep
    /// on the header's futex, checking the peers' health and the timeout while not spinning.
    fn wait_for(
        &mut self,
        arrived: &impl Fn(&Channel, usize) -> bool,
        cx: Ctx,
    ) -> Result<(), CommError> {
        let mut next = 0;
        // Fast path: spin on the peers' lines.
        let mut i = 0u32;
        let mut start: Option<Instant> = None;
        loop {
            if self.all_arrived(arrived, &mut next) {
                return Ok(());
            }
            std::hint::spin_loop();
            i += 1;
            if i.is_multiple_of(128) {
                let s = *start.get_or_insert_with(Instant::now);
                if s.elapsed() >= self.spin {
                    break;
                }
            }
        }
        // Slow path: yield, then sleep on the futex; check peers and the clock periodically.
        let start = start.unwrap_or_else(Instant::now);
        let mut last_check = Instant::now();
        let mut nap = Duration::from_micros(500);
        loop {
            if self.all_arrived(arrived, &mut next) {
                return Ok(());
            }
            let waited = start.elapsed();
            if waited < Duration::from_millis(2) {
                // Give the CPU away in case the peer we wait for shares it, then poll a little:
                // yielding costs well under a microsecond when nobody else is runnable.
                std::thread::yield_now();
                for _ in 0..64 {
                    if self.all_arrived(arrived, &mut next) {
                        return Ok(());
                    }
                    std::hint::spin_loop();
                }
            } else {
                let h = self.header();
                h.sleepers.0.fetch_add(1, SeqCst);
                let w = h.wake.0.load(SeqCst);
                if !self.all_arrived(arrived, &mut next) {
                    futex_wait(&h.wake.0, w, nap);
                    nap = (nap * 2)
                        .min(Duration::from_millis(20))
                        .min(self.cfg.peer_check);
                }
                h.sleepers.0.fetch_sub(1, SeqCst);
            }
            if last_check.elapsed() >= self.cfg.peer_check
                || waited < Duration::from_millis(2) && i.is_multiple_of(64)
            {
                last_check = Instant::now();
                self.check_peers(arrived, next, cx, start)?;
            }
            i = i.wrapping_add(1);
        }
    }

    /// Slow-path health check: abort flag, dead or departed peers, overall timeout.
    fn check_peers(
        &self,
        arrived: &impl Fn(&Channel, usize) -> bool,
        next: usize,
        cx: Ctx,
        start: Instant,
    ) -> Result<(), CommError> {
        for r in next..self.world {
            if r == self.rank {
                continue;
            }
            let c = self.ctrl(r);
            if arrived(self, r) {
                continue;
            }
            let died = self.peers[r].as_ref().is_some_and(|w| w.is_dead());
            let left = c.state.load(Acquire) == STATE_LEFT;
            // A peer publishes its progress before it leaves or exits: one that reached the target
            // and then went away between the two loads above did its part of this phase.
            if (died || left) && arrived(self, r) {
                continue;
            }
            if died || left {
                // Tell ranks that wait on someone else too.
                self.record_abort(|a| {
                    a.how
                        .store(if died { ABORT_DIED } else { ABORT_LEFT }, Relaxed);
                    a.rank.store(r as u32 + 1, Relaxed);
                    a.at_seq.store(cx.seq, Relaxed);
                });
                return Err(self.lost(r, died, cx));
            }
        }
        if let Some(e) = self.peer_abort(cx) {
            return Err(e);
        }
        let waited = start.elapsed();
        if waited >= self.cfg.timeout {
            let stuck: Vec<usize> = (0..self.world)
                .filter(|&r| r != self.rank && !arrived(self, r))
                .collect();
            let first = stuck.first().copied().unwrap_or(self.rank);
            let (seq, kind) = self.position(first);
            // Peers that arrive later must not go on using this rank's buffers, and must name the
            // same culprit as this rank.
            self.record_abort(|a| {
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
                    let (seq, kind) = self.position(r);
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

    /// The collective rank `r` is in or last was in: its sequence number and kind.
    fn position(&self, r: usize) -> (u64, Option<CollKind>) {
        let c = self.ctrl(r);
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

    /// Abort the communicator for every rank, describing why with `fill`, unless a peer did first.
    fn record_abort(&self, fill: impl FnOnce(&Abort)) {
        let a = &self.header().abort;
        if a.by
            .compare_exchange(0, self.rank as u32 + 1, SeqCst, SeqCst)
            .is_ok()
        {
            fill(a);
            a.ready.store(1, Release);
        }
    }

    /// The error for a communicator a peer aborted, naming the culprit the peer recorded.
    fn peer_abort(&self, cx: Ctx) -> Option<CommError> {
        let a = &self.header().abort;
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
            ABORT_DIED | ABORT_LEFT => self.lost(culprit, a.how.load(Relaxed) == ABORT_DIED, cx),
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

    fn lost(&self, r: usize, died: bool, cx: Ctx) -> CommError {
        self.peer_lost(r, died, cx.op, cx.seq)
    }

    // ----------------------------------------------------------------------------------------
    // Calls

    /// Enter the next collective: number it and show the number to peers (for timeout reports).
    pub(crate) fn start_call(&mut self, op: CollKind) -> Ctx {
        self.seq += 1;
        let me = self.ctrl(self.rank);
        me.coll_kind.store(op as u32 + 1, Relaxed);
        me.coll_seq.store(self.seq, Relaxed);
        Ctx { op, seq: self.seq }
    }

    /// Leave the collective: keep this rank's time in a successful timed call for the tuners,
    /// and fence the streaming stores it issued so they are ordered before anything the caller
    /// does next.
    ///
    /// Why every rank times the call: its cost is that of its slowest rank, and rank 0 alone
    /// may see little of it (a staged broadcast's root only stages, its peers copy out). Each rank
    /// sends its time to rank 0 in its next descriptor; rank 0 records the largest in `begin`.
    pub(crate) fn end_call(&mut self, ok: bool) {
        let stage = self.timing.take();
        let single = self.single_timing.take();
        self.single_class = None;
        let start = match (stage, single) {
            (Some(a), Some(b)) => Some(a.3.min(b.3)),
            (a, b) => a.or(b).map(|t| t.3),
        };
        if let (Some(t0), true) = (start, ok) {
            let secs = t0.elapsed().as_secs_f64();
            self.report = (self.seq as u32, (secs * 1e9) as u64);
            if self.rank == 0 {
                let class =
                    |t: Option<(usize, usize, bool, Instant)>| t.map(|(g, b, m, _)| (g, b, m));
                self.pending = Some(Pending {
                    seq: self.seq as u32,
                    secs,
                    stage: class(stage),
                    single: class(single),
                });
            }
        }
        if self.nt_pending || self.stage_nt {
            store_fence();
            self.nt_pending = false;
            self.stage_nt = false;
        }
    }

    /// Rank 0, once the descriptors are in: record its last timed call with the slowest time any
    /// rank reported for it. A rank that did not time that call (it failed there) leaves the
    /// measurement out.
    fn record_pending(&mut self, descs: &[Desc]) {
        let Some(p) = self.pending.take() else { return };
        let mut secs = p.secs;
        for d in descs.iter().skip(1) {
            if d.took_seq != p.seq || d.took_ns == 0 {
                return;
            }
            secs = secs.max(d.took_ns as f64 * 1e-9);
        }
        tracing::trace!(own = p.secs * 1e6, max = secs * 1e6, stage = ?p.stage, single = ?p.single, "tuner record");
        if let Some((g, b, nt)) = p.stage {
            self.tuner.record(g, b, nt, secs);
        }
        // A staged call measures staging only in the way the staging tuner settled on: during
        // its warm-up, and in its probes, it runs the other way on purpose, and those times
        // (streaming stores at 1 MiB with a shared cache: 2x) would make staging look slower
        // than it is. The path tuner then waits, choosing staged, until staging has settled.
        let staged_as_settled = p
            .stage
            .is_none_or(|(g, b, nt)| self.tuner.settled_on(g, b, nt));
        if let Some((g, b, single)) = p.single {
            if single || staged_as_settled {
                self.single.record(g, b, single, secs);
            }
        }
    }

    /// First phase of every collective: publish the descriptor (and whatever the caller staged in
    /// the slot of this phase), wait for all, and compare descriptors. Returns every rank's
    /// descriptor, and the phase number.
    pub(crate) fn begin(
        &mut self,
        call: &Call,
        flags: u8,
        send_off: u64,
        recv_off: u64,
        cx: Ctx,
    ) -> Result<(Vec<Desc>, u64), CommError> {
        if let (Some(t), _) = self.staging {
            self.staging = (None, t.elapsed());
        }
        let (took_seq, took_ns) = std::mem::take(&mut self.report);
        let d = Desc {
            kind: call.kind as u8,
            dtype: call.dtype as u8,
            op: call.op as u8,
            flags,
            took_seq,
            root: call.root as u64,
            count: call.count as u64,
            seq: self.seq,
            send_off,
            recv_off,
            pidns: crate::shm::direct::pid_namespace(),
            took_ns,
        };
        let p = self.progress + 1;
        self.write_desc(p, d);
        self.phase(cx)?;
        let descs: Vec<Desc> = (0..self.world)
            .map(|r| {
                if r == self.rank {
                    d
                } else {
                    self.read_desc(r, p)
                }
            })
            .collect();
        check_descs(&descs, self.seq, &|r| self.who(r))?;
        if self.rank == 0 {
            self.record_pending(&descs);
        }
        Ok((descs, p))
    }

    /// Refuse a `kind` call this rank found invalid: take part in its first phase with the
    /// INVALID flag, so every peer's matching call fails with an error naming this rank and the
    /// phase counters stay aligned. The error is the one `begin` returns (the refusal itself, or
    /// a lost peer).
    pub(crate) fn refuse(&mut self, kind: CollKind, dtype: Dtype) -> Result<(), CommError> {
        let cx = self.start_call(kind);
        let empty = RawMem {
            addr: 0,
            len: 0,
            space: MemSpace::Host,
        };
        let call = Call {
            kind,
            dtype,
            op: ReduceOp::Sum,
            root: 0,
            count: 0,
            send: empty,
            recv: empty,
            splits: Default::default(),
        };
        self.begin(&call, INVALID, 0, 0, cx).map(|_| ())
    }

    // ----------------------------------------------------------------------------------------
    // The fast path: one-phase collectives of small messages (see `algo::fast`)

    /// Per-rank payloads up to this size take the fast path.
    pub(crate) fn fast_bytes(&self) -> usize {
        self.cfg.fast_bytes
    }

    fn fast_hdr(&self, r: usize, seq: u64) -> *mut FastHdr {
        // SAFETY: fast entries lie inside the mapping by construction of the layout, 64-aligned.
        unsafe { self.seg.base().add(self.layout.fast_entry_off(r, seq)) as *mut FastHdr }
    }

    /// The payload of rank `r`'s fast entry for the current collective (`FAST_MAX` bytes).
    /// This rank writes its own before [`fast_exchange`](Self::fast_exchange); peers' entries
    /// may be read after it, until this rank's next collective returns.
    pub(crate) fn fast_data(&self, r: usize) -> *mut u8 {
        // SAFETY: the payload follows the head inside the entry (FAST_HDR + FAST_MAX <= FAST_ENTRY).
        unsafe { (self.fast_hdr(r, self.seq) as *mut u8).add(FAST_HDR) }
    }

    fn fast_seq(&self, r: usize) -> u64 {
        // SAFETY: the head is in the mapping; `seq` is an atomic that only its owner writes.
        unsafe { (*self.fast_hdr(r, self.seq)).seq.load(Acquire) }
    }

    /// The one phase of a fast collective: publish this rank's entry (its payload is already in
    /// [`fast_data`](Self::fast_data)) with the call's arguments and number, wait until every
    /// peer has published its entry for the same call, and compare the arguments as
    /// [`begin`](Self::begin) does. A peer that took the phased path for this call (its
    /// arguments put it above the threshold, or it refused the call) publishes a phase instead;
    /// this rank then joins it through `begin`, so every rank reports the same mismatch and the
    /// counters stay aligned.
    pub(crate) fn fast_exchange(&mut self, call: &Call, cx: Ctx) -> Result<(), CommError> {
        let seq = self.seq;
        // This rank's call as its entry carries it (root in 32 bits), and as the check below
        // compares it: the own entry is never read back (see `algo::fast`).
        let own = Desc {
            kind: call.kind as u8,
            dtype: call.dtype as u8,
            op: call.op as u8,
            root: call.root as u32 as u64,
            count: call.count as u64,
            seq,
            ..Desc::default()
        };
        let h = self.fast_hdr(self.rank, seq);
        // SAFETY: only this rank writes its own entry; peers read this parity's head only after
        // the `seq` store below and stop before their next collective, which this rank's next
        // collective waits for, so nobody reads it now (see `FastHdr`).
        unsafe {
            (*h).kind = own.kind;
            (*h).dtype = own.dtype;
            (*h).op = own.op;
            (*h).root = own.root as u32;
            (*h).count = own.count;
            // Release: the sleepers are checked after the wait (`wait_published`).
            (*h).seq.store(seq, Release);
        }
        let mine = self.progress;
        // A peer whose progress passed ours entered a phased call: it will not publish an entry.
        let arrived = |ch: &Channel, r: usize| {
            ch.fast_seq(r) == seq || ch.ctrl(r).progress.load(Acquire) > mine
        };
        self.wait_published(&arrived, cx)?;
        if (0..self.world).any(|r| r != self.rank && self.fast_seq(r) != seq) {
            self.begin(call, 0, 0, 0, cx)?;
            // `begin` reports the disagreement that sent the peer there; equal arguments never
            // take different paths, but should they, this is still a disagreement.
            return Err(CommError::Mismatch {
                seq,
                detail: format!(
                    "the ranks took different paths for {}: their settings (fast_bytes) differ",
                    call.kind
                ),
            });
        }
        let desc = |r: usize| {
            if r == self.rank {
                return own;
            }
            // SAFETY: rank r published this entry (its seq equals ours, acquire above) and does
            // not rewrite it before this rank's next collective.
            let h = unsafe { &*self.fast_hdr(r, seq) };
            Desc {
                kind: h.kind,
                dtype: h.dtype,
                op: h.op,
                root: h.root as u64,
                count: h.count,
                seq,
                ..Desc::default()
            }
        };
        // Compare every rank with rank 0 (as `check_descs` does) without allocating; build the
        // report only when one differs.
        let d0 = desc(0);
        if (1..self.world).all(|r| same_call(&d0, &desc(r))) {
            return Ok(());
        }
        let descs: Vec<Desc> = (0..self.world).map(desc).collect();
        check_descs(&descs, seq, &|r| self.who(r))
    }

    // ----------------------------------------------------------------------------------------
    // Copies and the staging mode

    /// Copy into a user buffer: streaming stores when the message is large.
    pub(crate) fn put(&mut self, src: *const u8, dst: *mut u8, bytes: usize, nt: bool) {
        // SAFETY: callers pass ranges valid for `bytes` that are equal or disjoint.
        unsafe { copy_block(src, dst, bytes, nt) };
        self.nt_pending |= nt;
    }

    /// Stage `bytes` into a slot and copy them to a user buffer at once (see [`copy_block2`]).
    ///
    /// # Safety
    /// As for [`copy_block2`].
    pub(crate) unsafe fn put2(
        &mut self,
        src: *const u8,
        slot: *mut u8,
        slot_nt: bool,
        dst: *mut u8,
        nt: bool,
        bytes: usize,
    ) {
        // SAFETY: forwarded contract.
        unsafe { copy_block2(src, slot, slot_nt, dst, nt, bytes) };
        self.nt_pending |= nt;
    }

    /// Start the clock of the current call now (see [`pre_begin`](Self::pre_begin)).
    pub(crate) fn start_clock(&mut self) {
        self.staging = (Some(Instant::now()), Duration::ZERO);
    }

    /// When the current call started, counting this rank's work before `begin` and everything
    /// after it, but not the wait in `begin`, which is mostly how late the peers came.
    pub(crate) fn pre_begin(&self) -> Instant {
        Instant::now()
            .checked_sub(self.staging.1)
            .unwrap_or_else(Instant::now)
    }

    /// Staging mode for the part of a staged call written before the descriptors are exchanged:
    /// rank 0 chooses, the others guess rank 0's last choice.
    pub(crate) fn stage_pre(&mut self, kind: CollKind, bytes: usize) -> bool {
        let g = stage_group(kind);
        let now = Instant::now();
        self.staging = (Some(now), Duration::ZERO);
        let nt = if self.rank == 0 {
            self.tuner.choose(g, bytes, now)
        } else {
            self.tuner.guess(g, bytes)
        };
        self.stage_nt = nt;
        nt
    }

    /// Descriptor flag carrying rank 0's choice.
    pub(crate) fn stage_flag(&self) -> u8 {
        if self.rank == 0 && self.stage_nt {
            STAGE_NT
        } else {
            0
        }
    }

    /// The mode every rank uses once the descriptors are in: rank 0's. When the call stages
    /// (`timed`), rank 0 times it from here: every rank has arrived, so the time measures the
    /// transfer, not how late a peer came.
    pub(crate) fn stage_agreed(
        &mut self,
        kind: CollKind,
        bytes: usize,
        descs: &[Desc],
        timed: bool,
    ) -> bool {
        let nt = descs[0].flags & STAGE_NT != 0;
        self.tuner.seen(stage_group(kind), bytes, nt);
        if timed {
            self.timing = Some((stage_group(kind), bytes, nt, self.pre_begin()));
        }
        // Fences stay on if this rank guessed streaming for its first part.
        self.stage_nt |= nt;
        nt
    }

    /// Whether a message whose output is `bytes` long should bypass the caches.
    pub(crate) fn nt_for(&self, bytes: usize) -> bool {
        bytes >= self.cfg.nt_bytes
    }

    /// Offsets and flags for zero-copy: which of this rank's buffers live in its shared heap.
    pub(crate) fn share_flags(
        &self,
        call: &Call,
        send_bytes: usize,
        recv_bytes: usize,
    ) -> (u8, u64, u64) {
        let s = self.shared_off(call.send.addr, send_bytes);
        let r = self.shared_off(call.recv.addr, recv_bytes);
        let flags =
            if s.is_some() { SHARED_SEND } else { 0 } | if r.is_some() { SHARED_RECV } else { 0 };
        (flags, s.unwrap_or(0), r.unwrap_or(0))
    }
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

fn desc_call(d: &Desc) -> String {
    let kind = CollKind::from_u8(d.kind).map(|k| k.name()).unwrap_or("?");
    let dtype = Dtype::from_u8(d.dtype).map(|t| t.name()).unwrap_or("?");
    let mut s = format!("{kind}(count={}, dtype={dtype}", d.count);
    if let Some(k) = CollKind::from_u8(d.kind) {
        if k.has_op() {
            s += &format!(
                ", op={}",
                ReduceOp::from_u8(d.op).map(|o| o.name()).unwrap_or("?")
            );
        }
        if k.has_root() {
            s += &format!(", root={}", d.root);
        }
    }
    s + ")"
}

/// Whether two descriptors describe the same call: kind, dtype, and the op, root and count where
/// the kind has them.
fn same_call(a: &Desc, b: &Desc) -> bool {
    let key = |d: &Desc| {
        let k = CollKind::from_u8(d.kind);
        (
            d.kind,
            d.dtype,
            if k.is_some_and(|k| k.has_op()) {
                d.op
            } else {
                0
            },
            if k.is_some_and(|k| k.has_root()) {
                d.root
            } else {
                0
            },
            if k == Some(CollKind::Barrier) {
                0
            } else {
                d.count
            },
        )
    };
    key(a) == key(b)
}

/// Compare every rank's descriptor with rank 0's; on disagreement, name every rank that differs
/// (`who` names a rank).
fn check_descs(descs: &[Desc], seq: u64, who: &dyn Fn(usize) -> String) -> Result<(), CommError> {
    let invalid: Vec<usize> = (0..descs.len())
        .filter(|&r| descs[r].flags & INVALID != 0)
        .collect();
    if let Some(&first) = invalid.first() {
        let kind = CollKind::from_u8(descs[first].kind)
            .map(|k| k.name())
            .unwrap_or("?");
        let names: Vec<String> = invalid.iter().map(|&r| who(r)).collect();
        return Err(CommError::Mismatch {
            seq,
            detail: format!(
                "{} refused its {kind} call (invalid arguments, or no room left for its staging slots: its own error says which)",
                names.join(", ")
            ),
        });
    }
    let differ: Vec<usize> = (1..descs.len())
        .filter(|&r| !same_call(&descs[0], &descs[r]))
        .collect();
    if differ.is_empty() {
        return Ok(());
    }
    let mut parts = vec![format!("{} called {}", who(0), desc_call(&descs[0]))];
    for r in differ.iter().take(8) {
        parts.push(format!("{} called {}", who(*r), desc_call(&descs[*r])));
    }
    if differ.len() > 8 {
        parts.push(format!("and {} more ranks differ", differ.len() - 8));
    }
    Err(CommError::Mismatch {
        seq,
        detail: parts.join(", "),
    })
}

/// Rank 0's last timed call, recorded once every rank's time for it has arrived.
struct Pending {
    /// Low 32 bits of its number.
    seq: u32,
    /// Rank 0's own time.
    secs: f64,
    /// The classes and ways it was timed for: staging (group, bytes, streaming) and the path
    /// (group, bytes, single copy).
    stage: Option<(usize, usize, bool)>,
    single: Option<(usize, usize, bool)>,
}

/// Tuning class of a collective's staging (see `shm::tune`).
pub(crate) fn stage_group(kind: CollKind) -> usize {
    match kind {
        CollKind::AllReduce | CollKind::Reduce | CollKind::Barrier => 0,
        CollKind::Broadcast => 1,
        CollKind::AllGather | CollKind::Gather => 2,
        CollKind::ReduceScatter => 3,
        // The exchanges stage with cached stores only; they share the gather class.
        _ => 2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mismatch_names_ranks() {
        let mut a = Desc {
            kind: CollKind::AllReduce as u8,
            dtype: Dtype::F32 as u8,
            op: ReduceOp::Sum as u8,
            count: 100,
            ..Default::default()
        };
        let b = Desc { count: 101, ..a };
        let world = |r: usize| rank_name(None, r);
        let e = check_descs(&[a, a, b], 5, &world).unwrap_err().to_string();
        assert!(
            e.contains("rank 2 called all_reduce(count=101, dtype=f32, op=sum)"),
            "{e}"
        );
        assert!(e.contains("rank 0 called all_reduce(count=100"), "{e}");
        // In a sub-communicator, ranks are named by their global rank first.
        let global = [5usize, 1, 3];
        let sub = |r: usize| rank_name(Some(&global), r);
        let e = check_descs(&[a, a, b], 5, &sub).unwrap_err().to_string();
        assert!(
            e.contains("rank 3 (rank 2 of this sub-communicator) called all_reduce(count=101"),
            "{e}"
        );
        assert!(
            e.contains("rank 5 (rank 0 of this sub-communicator) called all_reduce(count=100"),
            "{e}"
        );
        let refused = Desc {
            flags: INVALID,
            ..a
        };
        let e = check_descs(&[a, refused, refused], 6, &sub)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rank 1 (rank 1 of this sub-communicator), rank 3 (rank 2 of this sub-communicator) refused its all_reduce"),
            "{e}"
        );
        a.root = 3; // root does not matter for all_reduce
        assert!(check_descs(&[a, Desc { root: 0, ..a }], 1, &world).is_ok());
    }
}
