//! One rank's end of the phase protocol described in [`sync`](super::sync): addressing the
//! segment, publishing phases, waiting for the peers (spin, yield, futex), the first phase of
//! every call (`begin`: the descriptors, compared by `shm::check`), and the fences that order
//! streaming stores before a publish.
//!
//! What the waits need besides the protocol lives beside it: whether the peers are alive and why
//! the communicator aborted (`shm::liveness`), the timing of calls for rank 0's tuners
//! (`shm::timing`), and the cross-memory state (`shm::cma`). The collectives (`shm::coll`) are
//! written against [`Channel`] only; job setup (`shm::bootstrap`) creates it and marks the rank
//! as gone when it is dropped.

use crate::trace::CallPath;
use std::sync::atomic::fence;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release, SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::check::check_descs;
use super::cma::CmaState;
use super::config::ShmConfig;
pub(crate) use super::liveness::Ctx;
use super::liveness::Liveness;
use super::reduce::Found;
use super::reduce::{copy_block, copy_block2, store_fence};
use super::segment::{coarse_now_ns, futex_wait, futex_wake_all, show_bytes, PeerWatch, Segment};
use super::sync::{
    Ctrl, Desc, Header, Layout, FINITE, INVALID, SHARED_RECV, SHARED_SEND, STREAMING,
};
use super::timing::Timing;
use crate::comm::{
    Arrival, Call, CollKind, CommError, Dtype, LostPeer, MemSpace, PeerCheck, RawMem, ReduceOp,
};

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
    spin: Duration,
    /// Streaming stores were issued since the last fence.
    nt_pending: bool,
    /// The current collective writes the slots with streaming stores: fence before every publish.
    stage_nt: bool,
    /// The peers' processes, the abort record, and how errors name ranks.
    live: Liveness,
    /// The tuners and the clocks of the current call (see `shm::timing`).
    pub(crate) timing: Timing,
    /// Whether cross-memory copies work on this communicator, and their scratch buffer.
    pub(crate) cma: CmaState,
    /// This rank's two slots are mapped ([`ensure_slots`](Self::ensure_slots)).
    slots_ready: bool,
    /// The path the current (or last) collective took, for the flight recorder: set before the
    /// call from its size, and by the body once the ranks agree on another.
    pub(crate) last_path: CallPath,
    /// Whether `last_path` is already the current collective's path at its first wait, where
    /// the flight recorder notes the call (`Ctx::arrival`): the inline path, chosen by size
    /// alone (the others are agreed in the first phase).
    pub(crate) path_known: bool,
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
        Channel {
            last_path: CallPath::Unknown,
            path_known: false,
            seg,
            layout,
            timing: Timing::new(&cfg),
            cfg,
            rank,
            world: layout.world,
            progress: 0,
            seq: 0,
            spin,
            nt_pending: false,
            stage_nt: false,
            live: Liveness::new(rank, layout.world),
            cma: CmaState::default(),
            slots_ready: false,
        }
    }

    /// Map this rank's two staging slots (allocating their pages in a named segment) before the
    /// first collective that may write them, so no collective page-faults on them, and a
    /// file system that filled up since the segment was created is an error here, never a
    /// SIGBUS. Done on first use rather than at join, because a job whose collectives all take
    /// the inline path (a start-up check, small-message jobs) never touches the slots; a peer reads
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

    /// All-reduce/reduce messages up to this size take the one-phase path (`shm::path`).
    pub(crate) fn one_phase_bytes(&self) -> usize {
        self.cfg.small_bytes
    }

    /// Per-rank payloads up to this size take the inline path (`shm::inline`).
    pub(crate) fn inline_bytes(&self) -> usize {
        self.cfg.fast_bytes
    }

    /// The number the next published phase will have: the slot parity a caller stages into
    /// before its next `begin` or `phase`.
    pub(crate) fn next_phase(&self) -> u64 {
        self.progress + 1
    }

    /// Whether reductions check their floating-point inputs for NaN and infinities
    /// (`ShmConfig::check_finite`).
    pub(crate) fn check_finite(&self) -> bool {
        self.cfg.check_finite
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

    /// Run the finite check in the calls that follow, or stop running it
    /// (`ShmConfig::check_finite`; the first phase of each call compares it across the ranks).
    pub(crate) fn set_check_finite(&mut self, on: bool) {
        self.cfg.check_finite = on;
    }

    /// How long a waiter spins before yielding.
    pub(crate) fn spin(&self) -> Duration {
        self.spin
    }

    /// The segment's layout.
    pub(crate) fn layout(&self) -> &Layout {
        &self.layout
    }

    // ----------------------------------------------------------------------------------------
    // The peers (see `shm::liveness`)

    /// Make this the channel of a sub-communicator whose rank `i` is global rank `global[i]`.
    pub(crate) fn set_global(&mut self, global: Arc<[usize]>) {
        self.live.set_global(global);
    }

    /// The global ranks of a sub-communicator's ranks (`None`: a world communicator).
    pub(crate) fn global_ranks(&self) -> Option<&Arc<[usize]>> {
        self.live.global_ranks()
    }

    /// The global rank of rank `r`.
    pub(crate) fn global(&self, r: usize) -> usize {
        self.live.global(r)
    }

    /// How errors name rank `r` (see `Liveness::who`).
    pub(crate) fn who(&self, r: usize) -> String {
        self.live.who(r)
    }

    /// The error for peer `r`, gone (`died`, or left) while this rank waited for it in `op`
    /// #`seq` (see `Liveness::peer_lost`).
    pub(crate) fn peer_lost(&self, r: usize, died: bool, op: CollKind, seq: u64) -> CommError {
        self.live.peer_lost(self.ctrls(), r, died, op, seq)
    }

    /// Start watching every peer's process (their pids are written once all ranks have joined).
    pub(crate) fn watch_peers(&mut self) {
        let pids: Vec<i32> = self.ctrls().iter().map(|c| c.pid.load(Acquire)).collect();
        self.live.watch_peers(&pids);
    }

    /// A look at the peers' processes for another layer (see [`PeerCheck`]): pidfds of its own,
    /// so it stays valid after this channel is dropped.
    pub(crate) fn peer_check(&self) -> PeerCheck {
        let me = self.rank();
        let peers: Vec<(LostPeer, PeerWatch)> = (0..self.world())
            .filter(|&r| r != me)
            .map(|r| {
                let pid = self.ctrls()[r].pid.load(Acquire);
                let lost = LostPeer {
                    rank: r,
                    global: self.global(r),
                    pid,
                };
                (lost, PeerWatch::new(pid))
            })
            .collect();
        Arc::new(move || peers.iter().find(|(_, w)| w.is_dead()).map(|(p, _)| *p))
    }

    /// Whether peer `r` is gone: `Some(true)` if its process died, `Some(false)` if it left the
    /// communicator, `None` while it is there.
    pub(crate) fn peer_gone(&self, r: usize) -> Option<bool> {
        self.live.peer_gone(self.ctrls(), r)
    }

    /// Abort the communicator because this rank shrinks it (see `Liveness::abort_for_shrink`).
    pub(crate) fn abort_for_shrink(&self) {
        self.live.abort_for_shrink(self.header(), self.seq);
    }

    /// Wake the ranks asleep on the header's futex (after publishing something they may wait for).
    pub(crate) fn wake_sleepers(&self) {
        let h = self.header();
        if h.sleepers.0.load(SeqCst) > 0 {
            h.wake.0.fetch_add(1, SeqCst);
            futex_wake_all(&h.wake.0);
        }
    }

    /// After this rank published a phase or an inline entry with a release store: wait until
    /// every peer has arrived (`arrived`), wake the sleepers, and fail if a peer aborted the call
    /// (see `Liveness::check_abort`).
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
    pub(crate) fn wait_published(
        &mut self,
        arrived: &impl Fn(&Channel, usize) -> bool,
        cx: Ctx,
    ) -> Result<(), CommError> {
        let waited = self.wait_for(arrived, cx);
        fence(SeqCst);
        self.wake_sleepers();
        waited?;
        self.live.check_abort(self.header(), self.ctrls(), cx)
    }

    // ----------------------------------------------------------------------------------------
    // Segment access

    pub(crate) fn header(&self) -> &Header {
        // SAFETY: the header lies at offset 0 of the live mapping; all its fields are atomics.
        unsafe { &*(self.seg.base() as *const Header) }
    }

    /// Every rank's control block, in rank order.
    pub(crate) fn ctrls(&self) -> &[Ctrl] {
        // SAFETY: the `world` control blocks lie back to back inside the mapping (`ctrl_off`,
        // `CTRL_BYTES` = the size of `Ctrl`), 64-aligned; fields are atomics or UnsafeCells
        // accessed under the phase protocol.
        unsafe {
            std::slice::from_raw_parts(
                self.seg.base().add(self.layout.ctrl_off(0)) as *const Ctrl,
                self.world,
            )
        }
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
            "a collective wrote a slot before ensure_slots"
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

    /// [`phase`](Self::phase), carrying this rank's finite-check finding (`found`, or none) to its
    /// peers in its descriptor cell of the phase; returns the phase and the first finding of all
    /// ranks (lowest element, then lowest source rank), the same on every rank. Every rank of the
    /// call must call it at the same point (all run the check: `begin` compared the setting).
    pub(crate) fn phase_found(
        &mut self,
        found: Option<Found>,
        cx: Ctx,
    ) -> Result<(u64, Option<Found>), CommError> {
        let p = self.progress + 1;
        self.write_desc(p, Desc::found(self.seq, found));
        self.phase(cx)?;
        let all = (0..self.world)
            .filter(|&r| r != self.rank)
            .map(|r| self.read_desc(r, p).report(self.seq))
            .fold(found, Found::first);
        Ok((p, all))
    }

    /// Wait until every peer `r` has arrived (`arrived(self, r)`): spin, then yield, then sleep
    /// on the header's futex, checking the peers' health and the timeout while not spinning.
    fn wait_for(
        &mut self,
        arrived: &impl Fn(&Channel, usize) -> bool,
        cx: Ctx,
    ) -> Result<(), CommError> {
        let mut next = 0;
        // The first look at the peers' lines goes out before the recorder's stores, which then
        // run while it is in flight (see `comm::arrival`).
        let first = self.all_arrived(arrived, &mut next);
        match cx.arrival {
            Some(a) if self.path_known => a.note_path(self.last_path),
            Some(a) => a.note(),
            None => {}
        }
        if first {
            return Ok(());
        }
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
                if start.is_none() {
                    self.stamp_wait();
                }
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
                self.live.check_peers(
                    self.header(),
                    self.ctrls(),
                    &|r| arrived(self, r),
                    next,
                    cx,
                    start,
                    self.cfg.timeout,
                )?;
            }
            i = i.wrapping_add(1);
        }
    }

    /// Show when this rank began waiting in the current collective (for `lockstep status`), on
    /// its first wait of the call that outlasts the first polls: waits that end at once, the
    /// common case of a small call, read no clock.
    fn stamp_wait(&self) {
        self.stamp_wait_at(self.seq);
    }

    /// [`stamp_wait`](Self::stamp_wait) for collective `seq`.
    pub(crate) fn stamp_wait_at(&self, seq: u64) {
        let me = self.ctrl(self.rank);
        if me.wait_seq.load(Relaxed) != seq {
            me.wait_start.store(coarse_now_ns(), Relaxed);
            me.wait_seq.store(seq, Release);
        }
    }

    /// Show call `seq` of a communicator another transport carries over this one's ranks (NCCL)
    /// where `lockstep status` reads calls: the collective number and kind, and the arguments in
    /// the descriptor cell of parity `seq` (so the last two calls are there, as status looks them
    /// up by number). Only while this communicator runs no collective of its own: the device
    /// communicator that carries the calls owns it (the host communicator of `nccl::membership`).
    pub(crate) fn show_carried(&self, call: &Call, seq: u64) {
        let me = self.ctrl(self.rank);
        let d = Desc {
            kind: call.kind as u8,
            dtype: call.dtype as u8,
            op: call.op as u8,
            root: call.root as u64,
            count: call.count as u64,
            seq,
            ..Desc::default()
        };
        // SAFETY: only this rank writes its own cell, and no peer reads it for an exchange: this
        // communicator runs no collective while another carries its ranks' calls (see above),
        // and its last one (the unique-id exchange) ended on every rank before the carrier's
        // initialisation, which waits for every rank, let any rank make a call.
        unsafe { *me.desc[(seq % 2) as usize].0.get() = d };
        me.coll_kind.store(call.kind as u32 + 1, Relaxed);
        me.coll_seq.store(seq, Release);
    }

    // ----------------------------------------------------------------------------------------
    // Calls

    /// Enter the next collective: number it and show the number to peers (for timeout reports).
    pub(crate) fn start_call<'a>(
        &mut self,
        op: CollKind,
        arrival: Option<&'a Arrival<'a>>,
    ) -> Ctx<'a> {
        self.seq += 1;
        let me = self.ctrl(self.rank);
        me.coll_kind.store(op as u32 + 1, Relaxed);
        me.coll_seq.store(self.seq, Relaxed);
        Ctx {
            op,
            seq: self.seq,
            arrival,
        }
    }

    /// Leave the collective: keep this rank's time in a successful timed call for the tuners
    /// (see `shm::timing`), and fence the streaming stores it issued so they are ordered before
    /// anything the caller does next.
    pub(crate) fn end_call(&mut self, ok: bool) {
        self.timing.end_call(ok, self.seq, self.rank == 0);
        if self.nt_pending || self.stage_nt {
            store_fence();
            self.nt_pending = false;
            self.stage_nt = false;
        }
    }

    /// First phase of every collective: publish the descriptor (and whatever the caller wrote into
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
        let (took_seq, took_ns) = self.timing.at_begin();
        let finite = if self.cfg.check_finite { FINITE } else { 0 };
        let d = Desc {
            kind: call.kind as u8,
            dtype: call.dtype as u8,
            op: call.op as u8,
            flags: flags | finite,
            took_seq,
            root: call.root as u64,
            count: call.count as u64,
            seq: self.seq,
            send_off,
            recv_off,
            pidns: super::cma::pid_namespace(),
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
            self.timing.record_pending(&descs);
        }
        Ok((descs, p))
    }

    /// Refuse a `kind` call this rank found invalid: take part in its first phase with the
    /// INVALID flag, so every peer's matching call fails with an error naming this rank and the
    /// phase counters stay aligned. The error is the one `begin` returns (the refusal itself, or
    /// a lost peer).
    pub(crate) fn refuse(&mut self, kind: CollKind, dtype: Dtype) -> Result<(), CommError> {
        let cx = self.start_call(kind, None);
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
    // Copies and streaming stores

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

    /// Streaming stores or not for the slot writes made before the descriptors are exchanged:
    /// rank 0 chooses, the others guess rank 0's last choice (see `shm::timing`).
    pub(crate) fn streaming_pre(&mut self, kind: CollKind, bytes: usize) -> bool {
        let nt = self.timing.streaming_pre(self.rank == 0, kind, bytes);
        self.stage_nt = nt;
        nt
    }

    /// Descriptor flag carrying rank 0's choice.
    pub(crate) fn streaming_flag(&self) -> u8 {
        if self.rank == 0 && self.stage_nt {
            STREAMING
        } else {
            0
        }
    }

    /// The stores every rank uses once the descriptors are in: rank 0's. When the call runs on
    /// the slots (`timed`), rank 0 times it from here: every rank has arrived, so the time
    /// measures the transfer, not how late a peer came.
    pub(crate) fn streaming_agreed(
        &mut self,
        kind: CollKind,
        bytes: usize,
        descs: &[Desc],
        timed: bool,
    ) -> bool {
        let nt = descs[0].flags & STREAMING != 0;
        self.timing.streaming_agreed(kind, bytes, nt, timed);
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
