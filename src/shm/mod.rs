//! The shared-memory backend: collectives for the ranks of one node, through one shared segment.
//!
//! * [`ShmJob`] creates a segment for `world` ranks; forked ranks inherit it and call
//!   [`ShmComm::join`]. Ranks exec'd separately call [`ShmComm::join_named`] with a job id.
//! * Messages travel through each rank's two staging slots (see [`sync`] for the protocol), in
//!   chunks, so any size from 0 bytes up works with bounded memory and no page faults in steady
//!   state. Large reductions are split so each rank reduces its own slice (reduce-scatter then
//!   all-gather); small ones take a one-phase path where every rank reduces the whole message.
//! * Buffers from [`Communicator::alloc_shared`](crate::comm::Communicator::alloc_shared) live in
//!   the segment; when every rank passes such buffers, peers read and write them directly.
//! * Every reduction sums sources in rank order 0..n, so all ranks get bit-identical results, and
//!   the same inputs give the same bits every run, whatever the path.

mod alloc;
mod config;
mod reduce;
mod segment;
mod sync;
mod tune;

pub(crate) use alloc::SharedAlloc;
pub use config::ShmConfig;
pub use reduce::{copy_block, copy_block2, reduce_into, reduce_raw, reduce_slices, store_fence, Dst};
pub use segment::{shm_name, unlink_named, Segment};
pub use tune::StageMode;

use std::sync::atomic::Ordering::{Acquire, Relaxed, Release, SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use alloc::Heap;
use segment::{available_cpus, futex_wait, futex_wake_all, PeerWatch};
use sync::{Ctrl, Desc, Header, Layout, INVALID, MAGIC, SHARED_RECV, SHARED_SEND, STAGE_NT, STATE_JOINED, STATE_LEFT, VERSION};
use tune::StageTuner;

use crate::comm::{Backend, BackendKind, Call, CollKind, CommError, Communicator, Dtype, MemSpace, ReduceOp};

/// A shared segment prepared for `world` ranks, created by the parent before it forks.
#[derive(Debug, Clone)]
pub struct ShmJob {
    seg: Arc<Segment>,
    layout: Layout,
    cfg: ShmConfig,
}

fn init_header(seg: &Segment, layout: &Layout, cfg: &ShmConfig) {
    // SAFETY: the segment starts with a Header-sized, 64-byte aligned (page-aligned mapping) region
    // that nobody else reads before `magic` is set.
    let h = unsafe { &*(seg.base() as *const Header) };
    h.version.store(VERSION, Relaxed);
    h.world.store(layout.world as u32, Relaxed);
    h.slot_bytes.store(layout.slot_bytes as u64, Relaxed);
    h.heap_bytes.store(layout.heap_bytes as u64, Relaxed);
    h.total_bytes.store(layout.total as u64, Relaxed);
    h.small_bytes.store(cfg.small_bytes.min(layout.slot_bytes) as u64, Relaxed);
    h.nt_bytes.store(cfg.nt_bytes as u64, Relaxed);
    h.magic.store(MAGIC, Release);
}

impl ShmJob {
    /// Create an anonymous segment for `world` ranks with settings from the environment.
    pub fn new(world: usize) -> Result<ShmJob, CommError> {
        ShmJob::with_config(world, ShmConfig::from_env())
    }

    /// Create an anonymous segment for `world` ranks.
    pub fn with_config(world: usize, cfg: ShmConfig) -> Result<ShmJob, CommError> {
        if world == 0 || world > 1024 {
            return Err(CommError::Setup(format!("world size {world} is out of range 1..=1024")));
        }
        let cfg = cfg.normalized_for(world);
        let layout = Layout::new(world, cfg.slot_bytes, cfg.heap_bytes)?;
        let seg = Segment::anonymous(layout.total)?;
        init_header(&seg, &layout, &cfg);
        Ok(ShmJob { seg: Arc::new(seg), layout, cfg })
    }

    /// Number of ranks the segment was made for.
    pub fn world_size(&self) -> usize {
        self.layout.world
    }

    /// Join as `rank` (called in each forked child).
    pub fn join(&self, rank: usize) -> Result<ShmComm, CommError> {
        ShmComm::join(self.seg.clone(), self.layout, self.cfg.clone(), rank, None)
    }

    /// Join as `rank` and wrap the result in a [`Communicator`].
    pub fn communicator(&self, rank: usize) -> Result<Communicator, CommError> {
        Ok(Communicator::from_backend(Box::new(self.join(rank)?)))
    }
}

/// One rank's handle on a shared-memory communicator.
pub struct ShmComm {
    seg: Arc<Segment>,
    layout: Layout,
    cfg: ShmConfig,
    rank: usize,
    world: usize,
    progress: u64,
    seq: u64,
    peers: Vec<Option<PeerWatch>>,
    heap: Arc<Mutex<Heap>>,
    spin: Duration,
    poisoned: Option<String>,
    /// Streaming stores were issued since the last fence.
    nt_pending: bool,
    /// The current collective stages with streaming stores: fence before every publish.
    stage_nt: bool,
    tuner: StageTuner,
    /// Rank 0: the staged call in progress, to time: (class group, bytes, streaming, start).
    timing: Option<(usize, usize, bool, Instant)>,
    /// Rank 0: when it began staging the current call, then how long that took (until `begin`).
    staging: (Option<Instant>, Duration),
}

impl std::fmt::Debug for ShmComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmComm").field("rank", &self.rank).field("world", &self.world).field("seq", &self.seq).finish()
    }
}

/// Where a phase is, for error messages.
#[derive(Clone, Copy)]
struct Ctx {
    op: CollKind,
    seq: u64,
}

impl ShmComm {
    fn join(seg: Arc<Segment>, layout: Layout, cfg: ShmConfig, rank: usize, job_id: Option<&str>) -> Result<ShmComm, CommError> {
        let world = layout.world;
        if rank >= world {
            return Err(CommError::Setup(format!("rank {rank} is out of range for world size {world}")));
        }
        let heap = Arc::new(Mutex::new(Heap::new(layout.heap_off(rank), layout.heap_bytes)));
        let spin = cfg.spin.unwrap_or(if world > available_cpus() { Duration::from_micros(2) } else { Duration::from_micros(20) });
        if cfg.bind_cpu {
            bind_to_cpu(rank, world);
        }
        let cfg_stage = cfg.stage;
        let mut c = ShmComm {
            seg,
            layout,
            cfg,
            rank,
            world,
            progress: 0,
            seq: 0,
            peers: Vec::new(),
            heap,
            spin,
            poisoned: None,
            nt_pending: false,
            stage_nt: false,
            tuner: StageTuner::new(cfg_stage),
            timing: None,
            staging: (None, Duration::ZERO),
        };
        let me = c.ctrl(rank);
        if me.state.compare_exchange(0, STATE_JOINED, SeqCst, SeqCst).is_err() {
            return Err(CommError::Setup(format!("rank {rank} has already joined this communicator (pid {})", me.pid.load(Relaxed))));
        }
        // Touch our own slots now so collectives never page-fault on them.
        c.seg.prefault(layout.slot_off(rank, 0), 2 * layout.slot_bytes);
        me.progress.store(0, Relaxed);
        me.pid.store(std::process::id() as i32, Relaxed);
        let joined = c.header().joined.fetch_add(1, SeqCst) + 1;
        if joined as usize == world {
            if let Some(id) = job_id {
                // Everyone has mapped the named segment: remove its name so nothing can leak.
                unlink_named(id);
            }
        }
        // Wait for the others to join, watching the clock.
        let start = Instant::now();
        while (c.header().joined.load(Acquire) as usize) < world {
            if start.elapsed() > c.cfg.join_timeout {
                let missing: Vec<usize> = (0..world).filter(|&r| c.ctrl(r).state.load(Acquire) == 0).collect();
                return Err(CommError::Setup(format!(
                    "rank {rank}: ranks {missing:?} did not join within {:.0} s (LOCKSTEP_JOIN_TIMEOUT_S); did every rank start?",
                    c.cfg.join_timeout.as_secs_f64()
                )));
            }
            std::thread::sleep(Duration::from_micros(if start.elapsed() < Duration::from_millis(2) { 20 } else { 500 }));
        }
        c.peers = (0..world).map(|r| if r == rank { None } else { Some(PeerWatch::new(c.ctrl(r).pid.load(Acquire))) }).collect();
        Ok(c)
    }

    /// Join the named segment of job `job_id` as `rank` of `world` (ranks exec'd separately on one
    /// node). Rank 0 creates the segment; the others wait for it. The name is removed once all
    /// ranks have mapped it.
    pub fn join_named(job_id: &str, rank: usize, world: usize, cfg: ShmConfig) -> Result<ShmComm, CommError> {
        let cfg = cfg.normalized_for(world);
        let layout = Layout::new(world, cfg.slot_bytes, cfg.heap_bytes)?;
        if rank == 0 {
            let seg = Segment::create_named(job_id, layout.total)?;
            init_header(&seg, &layout, &cfg);
            return ShmComm::join(Arc::new(seg), layout, cfg, rank, Some(job_id));
        }
        let start = Instant::now();
        loop {
            if let Some(seg) = Segment::open_named(job_id, sync::HEADER_BYTES)? {
                // SAFETY: the mapping is at least HEADER_BYTES long and page-aligned.
                let h = unsafe { &*(seg.base() as *const Header) };
                if h.magic.load(Acquire) == MAGIC {
                    let (w, slot, heap) =
                        (h.world.load(Relaxed) as usize, h.slot_bytes.load(Relaxed) as usize, h.heap_bytes.load(Relaxed) as usize);
                    if h.version.load(Relaxed) != VERSION || w != world {
                        return Err(CommError::Setup(format!(
                            "segment {} was made for world size {w} (layout v{}), this rank expects {world} (v{VERSION}); are two jobs using the same job id?",
                            shm_name(job_id),
                            h.version.load(Relaxed)
                        )));
                    }
                    // The creator's sizes win, so every rank agrees on the layout.
                    let layout = Layout::new(world, slot, heap)?;
                    if seg.len() >= layout.total {
                        return ShmComm::join(Arc::new(seg), layout, cfg, rank, Some(job_id));
                    }
                }
            }
            if start.elapsed() > cfg.join_timeout {
                return Err(CommError::Setup(format!(
                    "rank {rank}: shared segment {} did not appear within {:.0} s; is rank 0 of job {job_id} running on this node?",
                    shm_name(job_id),
                    cfg.join_timeout.as_secs_f64()
                )));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    // ----------------------------------------------------------------------------------------
    // Segment access

    fn header(&self) -> &Header {
        // SAFETY: the header lies at offset 0 of the live mapping; all its fields are atomics.
        unsafe { &*(self.seg.base() as *const Header) }
    }

    fn ctrl(&self, r: usize) -> &Ctrl {
        // SAFETY: control blocks are inside the mapping (layout), 64-aligned; fields are atomics or
        // UnsafeCells accessed under the phase protocol.
        unsafe { &*(self.seg.base().add(self.layout.ctrl_off(r)) as *const Ctrl) }
    }

    fn slot(&self, r: usize, phase: u64) -> *mut u8 {
        // SAFETY: slot offsets lie inside the mapping by construction of the layout.
        unsafe { self.seg.base().add(self.layout.slot_off(r, phase)) }
    }

    fn at(&self, off: u64) -> *mut u8 {
        // SAFETY: offsets come from descriptors written by ranks that checked them with `contains`.
        unsafe { self.seg.base().add(off as usize) }
    }

    /// Segment offset of a host buffer if it lies entirely in this rank's heap region.
    fn shared_off(&self, addr: usize, bytes: usize) -> Option<u64> {
        let lo = self.seg.base() as usize + self.layout.heap_off(self.rank);
        let hi = lo + self.layout.heap_bytes;
        (addr >= lo && addr + bytes <= hi && bytes > 0).then(|| (addr - self.seg.base() as usize) as u64)
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
        self.ctrl(self.rank).progress.store(self.progress, SeqCst);
        let h = self.header();
        if h.sleepers.0.load(SeqCst) > 0 {
            h.wake.0.fetch_add(1, SeqCst);
            futex_wake_all(&h.wake.0);
        }
        self.progress
    }

    fn all_reached(&self, target: u64, next: &mut usize) -> bool {
        while *next < self.world {
            if *next != self.rank && self.ctrl(*next).progress.load(Acquire) < target {
                return false;
            }
            *next += 1;
        }
        true
    }

    /// Publish and wait for every peer to reach the same phase. Returns the phase number.
    fn phase(&mut self, cx: Ctx) -> Result<u64, CommError> {
        let p = self.publish();
        self.wait_all(p, cx)?;
        Ok(p)
    }

    fn wait_all(&mut self, target: u64, cx: Ctx) -> Result<(), CommError> {
        let mut next = 0;
        // Fast path: spin on the peers' progress lines.
        let mut i = 0u32;
        let mut start: Option<Instant> = None;
        loop {
            if self.all_reached(target, &mut next) {
                return Ok(());
            }
            std::hint::spin_loop();
            i += 1;
            if i % 128 == 0 {
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
            if self.all_reached(target, &mut next) {
                return Ok(());
            }
            let waited = start.elapsed();
            if waited < Duration::from_millis(2) {
                // Give the CPU away in case the peer we wait for shares it, then poll a little:
                // yielding costs well under a microsecond when nobody else is runnable.
                std::thread::yield_now();
                for _ in 0..64 {
                    if self.all_reached(target, &mut next) {
                        return Ok(());
                    }
                    std::hint::spin_loop();
                }
            } else {
                let h = self.header();
                h.sleepers.0.fetch_add(1, SeqCst);
                let w = h.wake.0.load(SeqCst);
                if !self.all_reached(target, &mut next) {
                    futex_wait(&h.wake.0, w, nap);
                    nap = (nap * 2).min(Duration::from_millis(20)).min(self.cfg.peer_check);
                }
                h.sleepers.0.fetch_sub(1, SeqCst);
            }
            if last_check.elapsed() >= self.cfg.peer_check || waited < Duration::from_millis(2) && i % 64 == 0 {
                last_check = Instant::now();
                self.check_peers(target, next, cx, start)?;
            }
            i = i.wrapping_add(1);
        }
    }

    /// Slow-path health check: abort flag, dead or departed peers, overall timeout.
    fn check_peers(&self, target: u64, next: usize, cx: Ctx, start: Instant) -> Result<(), CommError> {
        for r in next..self.world {
            if r == self.rank {
                continue;
            }
            let c = self.ctrl(r);
            if c.progress.load(Acquire) >= target {
                continue;
            }
            let died = self.peers[r].as_ref().is_some_and(|w| w.is_dead());
            let left = c.state.load(Acquire) == STATE_LEFT;
            if died || left {
                // Tell ranks that wait on someone else too.
                let h = self.header();
                if h.abort_by.compare_exchange(0, self.rank as u32 + 1, SeqCst, SeqCst).is_ok() {
                    h.lost_how.store(if died { 1 } else { 2 }, SeqCst);
                    h.lost_rank.store(r as u32 + 1, SeqCst);
                }
                return Err(self.lost(r, died, cx));
            }
        }
        let h = self.header();
        let by = h.abort_by.load(Acquire);
        if by != 0 && by as usize - 1 != self.rank {
            let lost = h.lost_rank.load(Acquire);
            if lost != 0 {
                return Err(self.lost(lost as usize - 1, h.lost_how.load(Acquire) == 1, cx));
            }
            return Err(CommError::Aborted { by: by as usize - 1, reason: "it hit an unrecoverable error".into() });
        }
        let waited = start.elapsed();
        if waited >= self.cfg.timeout {
            // Peers that arrive later must not go on using this rank's buffers.
            let _ = self.header().abort_by.compare_exchange(0, self.rank as u32 + 1, SeqCst, SeqCst);
            let missing: Vec<String> = (0..self.world)
                .filter(|&r| r != self.rank && self.ctrl(r).progress.load(Acquire) < target)
                .map(|r| format!("rank {r} is at collective #{}", self.ctrl(r).coll_seq.load(Relaxed)))
                .collect();
            return Err(CommError::Timeout {
                rank: self.rank,
                op: cx.op,
                seq: cx.seq,
                secs: waited.as_secs_f64(),
                detail: format!(
                    "{} not arrived: {}; this rank (rank {}) is at #{}",
                    if missing.len() == 1 { "one rank has" } else { "some ranks have" },
                    missing.join(", "),
                    self.rank,
                    cx.seq
                ),
            });
        }
        Ok(())
    }

    fn lost(&self, r: usize, died: bool, cx: Ctx) -> CommError {
        CommError::PeerLost {
            rank: self.rank,
            lost_rank: r,
            pid: self.ctrl(r).pid.load(Relaxed),
            how: if died { "died" } else { "left the communicator" },
            op: cx.op,
            seq: cx.seq,
        }
    }

    /// First phase of every collective: publish the descriptor (and whatever the caller staged in
    /// the slot of this phase), wait for all, and compare descriptors. Returns every rank's
    /// descriptor, and the phase number.
    fn begin(&mut self, call: &Call, flags: u8, send_off: u64, recv_off: u64, cx: Ctx) -> Result<(Vec<Desc>, u64), CommError> {
        if let (Some(t), _) = self.staging {
            self.staging = (None, t.elapsed());
        }
        let d = Desc {
            kind: call.kind as u8,
            dtype: call.dtype as u8,
            op: call.op as u8,
            flags,
            _r: 0,
            root: call.root as u64,
            count: call.count as u64,
            seq: self.seq,
            send_off,
            recv_off,
            _pad: [0; 2],
        };
        let p = self.progress + 1;
        self.write_desc(p, d);
        self.phase(cx)?;
        let descs: Vec<Desc> = (0..self.world).map(|r| if r == self.rank { d } else { self.read_desc(r, p) }).collect();
        check_descs(&descs, self.seq)?;
        Ok((descs, p))
    }

    fn poison_on(&mut self, e: &CommError) {
        if matches!(e, CommError::PeerLost { .. } | CommError::Timeout { .. } | CommError::Aborted { .. }) {
            self.poisoned = Some(e.to_string());
            // A peer may still touch buffers of the failed call: never hand their memory out again.
            self.heap.lock().unwrap_or_else(|p| p.into_inner()).quarantine();
        }
    }
}

/// Pin this rank to one CPU of its allowed set (rank-th, when there are at least as many CPUs as
/// ranks), as MPI does by default: migrations and two ranks landing on one CPU cost far more than
/// the collectives themselves. Skipped when oversubscribed.
fn bind_to_cpu(rank: usize, world: usize) {
    // SAFETY: zeroed cpu_set_t is a valid empty set; sched_getaffinity/setaffinity take a valid
    // pointer and its size.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return;
        }
        let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect();
        if cpus.len() < world {
            return;
        }
        let mut one: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpus[rank], &mut one);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &one);
    }
}

fn desc_call(d: &Desc) -> String {
    let kind = CollKind::from_u8(d.kind).map(|k| k.name()).unwrap_or("?");
    let dtype = Dtype::from_u8(d.dtype).map(|t| t.name()).unwrap_or("?");
    let mut s = format!("{kind}(count={}, dtype={dtype}", d.count);
    if let Some(k) = CollKind::from_u8(d.kind) {
        if k.has_op() {
            s += &format!(", op={}", ReduceOp::from_u8(d.op).map(|o| o.name()).unwrap_or("?"));
        }
        if k.has_root() {
            s += &format!(", root={}", d.root);
        }
    }
    s + ")"
}

/// Compare every rank's descriptor with rank 0's; on disagreement, name every rank that differs.
fn check_descs(descs: &[Desc], seq: u64) -> Result<(), CommError> {
    let invalid: Vec<String> = (0..descs.len()).filter(|&r| descs[r].flags & INVALID != 0).map(|r| r.to_string()).collect();
    if !invalid.is_empty() {
        let kind = CollKind::from_u8(descs[invalid[0].parse::<usize>().unwrap_or(0)].kind).map(|k| k.name()).unwrap_or("?");
        return Err(CommError::Mismatch {
            seq,
            detail: format!("rank {} refused its {kind} call with invalid arguments (its own error says which)", invalid.join(", rank ")),
        });
    }
    let key = |d: &Desc| {
        let k = CollKind::from_u8(d.kind);
        (
            d.kind,
            d.dtype,
            if k.is_some_and(|k| k.has_op()) { d.op } else { 0 },
            if k.is_some_and(|k| k.has_root()) { d.root } else { 0 },
            if k == Some(CollKind::Barrier) { 0 } else { d.count },
        )
    };
    let k0 = key(&descs[0]);
    let differ: Vec<usize> = (1..descs.len()).filter(|&r| key(&descs[r]) != k0).collect();
    if differ.is_empty() {
        return Ok(());
    }
    let mut parts = vec![format!("rank 0 called {}", desc_call(&descs[0]))];
    for r in differ.iter().take(8) {
        parts.push(format!("rank {r} called {}", desc_call(&descs[*r])));
    }
    if differ.len() > 8 {
        parts.push(format!("and {} more ranks differ", differ.len() - 8));
    }
    Err(CommError::Mismatch { seq, detail: parts.join(", ") })
}

/// Tuning class of a collective's staging (see `shm::tune`).
fn stage_group(kind: CollKind) -> usize {
    match kind {
        CollKind::AllReduce | CollKind::Reduce | CollKind::Barrier => 0,
        CollKind::Broadcast => 1,
        CollKind::AllGather | CollKind::Gather => 2,
        CollKind::ReduceScatter => 3,
    }
}

/// Split `len` elements into `n` parts aligned to `unit` elements: part `j` is `[lo, hi)`.
fn part(len: usize, n: usize, j: usize, unit: usize) -> (usize, usize) {
    let q = len.div_ceil(n).next_multiple_of(unit);
    let lo = (j * q).min(len);
    let hi = ((j + 1) * q).min(len);
    (lo, hi)
}

impl ShmComm {
    fn run_call(&mut self, call: &Call) -> Result<(), CommError> {
        let cx = Ctx { op: call.kind, seq: self.seq };
        match call.kind {
            CollKind::Barrier => self.begin(call, 0, 0, 0, cx).map(|_| ()),
            CollKind::AllReduce | CollKind::Reduce => self.all_reduce(call, cx),
            CollKind::Broadcast => self.broadcast(call, cx),
            CollKind::AllGather | CollKind::Gather => self.all_gather(call, cx),
            CollKind::ReduceScatter => self.reduce_scatter(call, cx),
        }
    }

    /// Copy into a user buffer: streaming stores when the message is large.
    fn put(&mut self, src: *const u8, dst: *mut u8, bytes: usize, nt: bool) {
        // SAFETY: callers pass ranges valid for `bytes` that are equal or disjoint.
        unsafe { copy_block(src, dst, bytes, nt) };
        self.nt_pending |= nt;
    }

    /// Staging mode for the part of a staged call written before the descriptors are exchanged:
    /// rank 0 chooses, the others guess rank 0's last choice.
    fn stage_pre(&mut self, kind: CollKind, bytes: usize) -> bool {
        let g = stage_group(kind);
        let nt = if self.rank == 0 {
            let now = Instant::now();
            self.staging = (Some(now), Duration::ZERO);
            self.tuner.choose(g, bytes, now)
        } else {
            self.tuner.guess(g, bytes)
        };
        self.stage_nt = nt;
        nt
    }

    /// Descriptor flag carrying rank 0's choice.
    fn stage_flag(&self) -> u8 {
        if self.rank == 0 && self.stage_nt {
            STAGE_NT
        } else {
            0
        }
    }

    /// The mode every rank uses once the descriptors are in: rank 0's. When the call stages
    /// (`timed`), rank 0 times it from here: every rank has arrived, so the time measures the
    /// transfer, not how late a peer came.
    fn stage_agreed(&mut self, kind: CollKind, bytes: usize, descs: &[Desc], timed: bool) -> bool {
        let nt = descs[0].flags & STAGE_NT != 0;
        self.tuner.seen(stage_group(kind), bytes, nt);
        if timed && self.rank == 0 {
            // Counted: this rank's own staging before `begin` and everything after it; not
            // counted: the wait in `begin`, which is mostly how late the peers came.
            let start = Instant::now().checked_sub(self.staging.1).unwrap_or_else(Instant::now);
            self.timing = Some((stage_group(kind), bytes, nt, start));
        }
        // Fences stay on if this rank guessed streaming for its first part.
        self.stage_nt |= nt;
        nt
    }

    /// Stage `bytes` into a slot and copy them to a user buffer at once (see [`copy_block2`]).
    ///
    /// # Safety
    /// As for [`copy_block2`].
    unsafe fn put2(&mut self, src: *const u8, slot: *mut u8, slot_nt: bool, dst: *mut u8, nt: bool, bytes: usize) {
        // SAFETY: forwarded contract.
        unsafe { copy_block2(src, slot, slot_nt, dst, nt, bytes) };
        self.nt_pending |= nt;
    }

    /// Whether a message whose output is `bytes` long should bypass the caches.
    fn nt_for(&self, bytes: usize) -> bool {
        bytes >= self.cfg.nt_bytes
    }

    /// Offsets and flags for zero-copy: which of this rank's buffers live in its shared heap.
    fn share_flags(&self, call: &Call, send_bytes: usize, recv_bytes: usize) -> (u8, u64, u64) {
        let s = self.shared_off(call.send.addr, send_bytes);
        let r = self.shared_off(call.recv.addr, recv_bytes);
        let flags = if s.is_some() { SHARED_SEND } else { 0 } | if r.is_some() { SHARED_RECV } else { 0 };
        (flags, s.unwrap_or(0), r.unwrap_or(0))
    }

    /// all_reduce and reduce (`call.kind` tells which; only the root receives a reduce).
    fn all_reduce(&mut self, call: &Call, cx: Ctx) -> Result<(), CommError> {
        let (n, me, esz) = (self.world, self.rank, call.dtype.size());
        let count = call.count;
        let bytes = count * esz;
        let all = call.kind == CollKind::AllReduce;
        let receives = |r: usize| all || r == call.root;
        let send = call.send.addr as *const u8;
        let recv = call.recv.addr as *mut u8;

        // Small path, one phase: every rank stages its whole input and reduces everything itself.
        if bytes <= self.cfg.small_bytes || n == 1 {
            let p = self.progress + 1;
            if n > 1 {
                // SAFETY: the slot holds slot_bytes >= small_bytes >= bytes; send is valid for bytes.
                unsafe { copy_block(send, self.slot(me, p), bytes, false) };
            }
            let (flags, so, ro) = (0, 0, 0);
            self.begin(call, flags, so, ro, cx)?;
            if receives(me) && count > 0 {
                let srcs: Vec<*const u8> = (0..n).map(|r| if r == me { send } else { self.slot(r, p) as *const u8 }).collect();
                // SAFETY: every source holds `count` elements (descriptors agree on count); recv is
                // valid for count elements on receiving ranks (checked by Communicator) and equals
                // send or does not overlap it.
                unsafe { reduce_raw(call.dtype, call.op, n, &srcs, recv, count) };
            }
            return Ok(());
        }

        // Zero-copy path when every rank's send (and the receivers' recv) is in the segment.
        let (flags, so, ro) = self.share_flags(call, bytes, if receives(me) { bytes } else { 0 });
        let mut p = self.progress + 1;
        let unit = (64 / esz).max(1);
        // The staged path stages the first round in this same phase, so write it before `begin`.
        // The chunk is decided from this rank's own flags only after begin; staging round 0 into
        // our slot is harmless if we end up zero-copy.
        let c_max = (self.layout.slot_bytes / (n - 1) / esz) / unit * unit;
        let round = n * c_max;
        let stage = |s: &Self, base: usize, len: usize, p: u64, snt: bool| {
            for j in (0..n).filter(|&j| j != me) {
                let (lo, hi) = part(len, n, j, unit);
                let idx = if j < me { j } else { j - 1 };
                // SAFETY: send is valid for count elements and base+hi <= count; the slot has room
                // for (n-1)*c_max elements and hi-lo <= c_max.
                unsafe { copy_block(send.add((base + lo) * esz), s.slot(me, p).add(idx * c_max * esz), (hi - lo) * esz, snt) };
            }
        };
        let pre = self.stage_pre(call.kind, bytes);
        stage(self, 0, count.min(round), p, pre);
        let (descs, _) = self.begin(call, flags | self.stage_flag(), so, ro, cx)?;
        let zero_copy = descs.iter().enumerate().all(|(r, d)| d.flags & SHARED_SEND != 0 && (!receives(r) || d.flags & SHARED_RECV != 0));
        if zero_copy {
            return self.all_reduce_zero_copy(call, &descs, cx);
        }
        let snt = self.stage_agreed(call.kind, bytes, &descs, true);
        let nt = self.nt_for(bytes);
        let mut base = 0;
        let mut first = true;
        while base < count {
            let len = round.min(count - base);
            if !first {
                p = self.progress + 1;
                stage(self, base, len, p, snt);
                self.phase(cx)?;
            }
            first = false;
            // Reduce my part from my input and the peers' staged copies of it; the result goes to
            // my slot of the next phase (for the others) and to my output.
            let (lo, hi) = part(len, n, me, unit);
            let srcs: Vec<*const u8> = (0..n)
                .map(|k| {
                    if k == me {
                        // SAFETY: within send's count elements.
                        unsafe { send.add((base + lo) * esz) }
                    } else {
                        let idx = if me < k { me } else { me - 1 };
                        // SAFETY: within peer k's slot (see stage).
                        unsafe { self.slot(k, p).add(idx * c_max * esz) as *const u8 }
                    }
                })
                .collect();
            let out_slot = self.slot(me, p + 1);
            let others_need = all || me != call.root;
            if hi > lo {
                let mut dsts = Vec::with_capacity(2);
                if others_need {
                    dsts.push(Dst { ptr: out_slot, nt: snt });
                }
                if receives(me) {
                    // SAFETY: recv holds count elements on receivers.
                    dsts.push(Dst { ptr: unsafe { recv.add((base + lo) * esz) }, nt });
                }
                // SAFETY: out_slot holds slot_bytes >= c_max elements >= hi-lo; sources valid; recv
                // may equal our own source exactly (in place).
                unsafe { reduce_into(call.dtype, call.op, n, &srcs, &dsts, hi - lo) };
            }
            p = self.phase(cx)?;
            if receives(me) {
                for j in (0..n).filter(|&j| j != me) {
                    let (lo, hi) = part(len, n, j, unit);
                    // SAFETY: peer j wrote hi-lo elements of its part into its slot of phase p;
                    // recv holds count elements.
                    self.put(self.slot(j, p), unsafe { recv.add((base + lo) * esz) }, (hi - lo) * esz, nt);
                }
            }
            base += len;
        }
        Ok(())
    }

    fn all_reduce_zero_copy(&mut self, call: &Call, descs: &[Desc], cx: Ctx) -> Result<(), CommError> {
        let (n, me, esz) = (self.world, self.rank, call.dtype.size());
        let count = call.count;
        let unit = (64 / esz).max(1);
        // Rounds small enough that the reduced chunk is still in cache when it is copied out.
        let sub = ((32 << 10) / esz).max(unit);
        let dests: Vec<usize> = if call.kind == CollKind::AllReduce { (0..n).collect() } else { vec![call.root] };
        let sends: Vec<*const u8> = descs.iter().map(|d| self.at(d.send_off) as *const u8).collect();
        let recvs: Vec<*mut u8> = descs.iter().map(|d| self.at(d.recv_off)).collect();
        let nt = self.nt_for(count * esz);
        let (mlo, mhi) = part(count, n, me, unit);
        let mut at = mlo;
        while at < mhi {
            let len = sub.min(mhi - at);
            // SAFETY: every rank's send holds `count` elements (descriptors agree) and lies in the
            // segment; [at, at+len) is inside my part, which no other rank reads or writes in any
            // receive buffer during this collective.
            unsafe {
                let srcs: Vec<*const u8> = sends.iter().map(|s| s.add(at * esz)).collect();
                let dsts: Vec<Dst> = dests.iter().map(|&d| Dst { ptr: recvs[d].add(at * esz), nt }).collect();
                reduce_into(call.dtype, call.op, n, &srcs, &dsts, len);
            }
            at += len;
        }
        // Nobody returns (and reuses its buffers) before everyone has finished.
        self.phase(cx)?;
        Ok(())
    }

    fn broadcast(&mut self, call: &Call, cx: Ctx) -> Result<(), CommError> {
        let (n, me, esz) = (self.world, self.rank, call.dtype.size());
        let root = call.root;
        let bytes = call.count * esz;
        let send = call.send.addr as *const u8;
        let recv = call.recv.addr as *mut u8;
        let chunk = self.layout.slot_bytes;
        let nt = self.nt_for(bytes);
        let (flags, so, ro) = self.share_flags(call, if me == root { bytes } else { 0 }, 0);
        let mut p = self.progress + 1;
        let pre = self.stage_pre(call.kind, bytes);
        if me == root {
            // SAFETY: the slot holds `chunk` bytes; send holds `bytes`.
            unsafe { copy_block(send, self.slot(me, p), bytes.min(chunk), pre) };
        }
        let (descs, _) = self.begin(call, flags | self.stage_flag(), so, ro, cx)?;
        let zero_copy = descs[root].flags & SHARED_SEND != 0 && bytes > self.cfg.small_bytes;
        let snt = self.stage_agreed(call.kind, bytes, &descs, !zero_copy && n > 1);
        if me == root {
            // The staged path copies the rest chunk by chunk along with the staging, reading the
            // send buffer once. send and recv hold `bytes` each and are equal or disjoint.
            let own = if n == 1 || zero_copy { bytes } else { bytes.min(chunk) };
            self.put(send, recv, own, nt);
        }
        if n == 1 {
            return Ok(());
        }
        if zero_copy {
            if me != root {
                // The root's send buffer lies in the segment and holds `bytes`.
                self.put(self.at(descs[root].send_off), recv, bytes, nt);
            }
            self.phase(cx)?;
            return Ok(());
        }
        let mut off = 0;
        loop {
            let len = chunk.min(bytes - off);
            if me != root {
                // SAFETY (add): off + len <= bytes. The root staged `len` bytes of this chunk in its
                // slot of phase p.
                self.put(self.slot(root, p), unsafe { recv.add(off) }, len, nt);
            }
            off += len;
            if off >= bytes {
                break;
            }
            p = self.progress + 1;
            if me == root {
                // SAFETY: as above, next chunk, into the slot and the root's own output at once;
                // the slot is disjoint from both user buffers.
                unsafe { self.put2(send.add(off), self.slot(me, p), snt, recv.add(off), nt, chunk.min(bytes - off)) };
            }
            self.phase(cx)?;
        }
        Ok(())
    }

    /// all_gather and gather.
    fn all_gather(&mut self, call: &Call, cx: Ctx) -> Result<(), CommError> {
        let (n, me, esz) = (self.world, self.rank, call.dtype.size());
        let all = call.kind == CollKind::AllGather;
        let receives = all || me == call.root;
        let bytes = call.count * esz;
        let send = call.send.addr as *const u8;
        let recv = call.recv.addr as *mut u8;
        let chunk = self.layout.slot_bytes;
        let nt = self.nt_for(bytes * n);
        let (flags, so, ro) = self.share_flags(call, bytes, 0);
        let mut p = self.progress + 1;
        let pre = self.stage_pre(call.kind, bytes);
        // SAFETY: the slot holds `chunk` bytes; send holds `bytes`.
        unsafe { copy_block(send, self.slot(me, p), bytes.min(chunk), pre) };
        let (descs, _) = self.begin(call, flags | self.stage_flag(), so, ro, cx)?;
        let zero_copy = descs.iter().all(|d| d.flags & SHARED_SEND != 0) && bytes > self.cfg.small_bytes;
        let snt = self.stage_agreed(call.kind, bytes, &descs, !zero_copy && n > 1);
        // Our own block: the staged path copies it chunk by chunk along with the staging.
        // SAFETY (add): recv holds n*bytes on receivers.
        let own = if receives { Some(unsafe { recv.add(me * bytes) }) } else { None };
        if let Some(own) = own {
            // send is either disjoint from our block or exactly it.
            self.put(send, own, if n == 1 || zero_copy { bytes } else { bytes.min(chunk) }, nt);
        }
        if n == 1 {
            return Ok(());
        }
        if zero_copy {
            if receives {
                for j in (0..n).filter(|&j| j != me) {
                    // SAFETY (add): within recv. Peer j's send lies in the segment and holds `bytes`.
                    self.put(self.at(descs[j].send_off), unsafe { recv.add(j * bytes) }, bytes, nt);
                }
            }
            self.phase(cx)?;
            return Ok(());
        }
        let mut off = 0;
        loop {
            let len = chunk.min(bytes - off);
            if receives {
                for j in (0..n).filter(|&j| j != me) {
                    // SAFETY (add): within recv. Peer j staged `len` bytes of this chunk in its slot.
                    self.put(self.slot(j, p), unsafe { recv.add(j * bytes + off) }, len, nt);
                }
            }
            off += len;
            if off >= bytes {
                break;
            }
            p = self.progress + 1;
            let len = chunk.min(bytes - off);
            // SAFETY: next chunk of our own send into our slot (and our own block of recv, which
            // holds `bytes` from `own`); the slot is disjoint from the user buffers.
            unsafe {
                match own {
                    Some(own) => self.put2(send.add(off), self.slot(me, p), snt, own.add(off), nt, len),
                    None => copy_block(send.add(off), self.slot(me, p), len, snt),
                }
            }
            self.phase(cx)?;
        }
        Ok(())
    }

    fn reduce_scatter(&mut self, call: &Call, cx: Ctx) -> Result<(), CommError> {
        let (n, me, esz) = (self.world, self.rank, call.dtype.size());
        let c = call.count;
        let send = call.send.addr as *const u8;
        let recv = call.recv.addr as *mut u8;
        let (flags, so, ro) = self.share_flags(call, n * c * esz, 0);
        if n == 1 {
            self.begin(call, flags, so, ro, cx)?;
            // SAFETY: single source, c elements, recv equal or disjoint.
            unsafe { reduce_raw(call.dtype, call.op, 1, &[send], recv, c) };
            return Ok(());
        }
        let unit = (64 / esz).max(1);
        let nt = self.nt_for(c * esz);
        let c_max = ((self.layout.slot_bytes / (n - 1) / esz) / unit * unit).max(unit);
        let stage = |s: &Self, off: usize, len: usize, p: u64, snt: bool| {
            for j in (0..n).filter(|&j| j != me) {
                let idx = if j < me { j } else { j - 1 };
                // SAFETY: send holds n*c elements; the slot holds (n-1)*c_max elements; len <= c_max.
                unsafe { copy_block(send.add((j * c + off) * esz), s.slot(me, p).add(idx * c_max * esz), len * esz, snt) };
            }
        };
        let mut p = self.progress + 1;
        let pre = self.stage_pre(call.kind, n * c * esz);
        stage(self, 0, c.min(c_max), p, pre);
        let (descs, _) = self.begin(call, flags | self.stage_flag(), so, ro, cx)?;
        let zero_copy = descs.iter().all(|d| d.flags & SHARED_SEND != 0) && c * esz > self.cfg.small_bytes;
        let snt = self.stage_agreed(call.kind, n * c * esz, &descs, !zero_copy);
        if zero_copy {
            let sends: Vec<*const u8> = descs.iter().map(|d| self.at(d.send_off) as *const u8).collect();
            let srcs: Vec<*const u8> = sends
                .iter()
                .map(|s| {
                    // SAFETY: every send holds n*c elements in the segment.
                    unsafe { s.add(me * c * esz) }
                })
                .collect();
            // SAFETY: block `me` of every send is read only by this rank; recv holds c elements and
            // is either our own block `me` (in place, same address as srcs[me]) or disjoint.
            unsafe { reduce_into(call.dtype, call.op, n, &srcs, &[Dst { ptr: recv, nt }], c) };
            self.phase(cx)?;
            return Ok(());
        }
        let mut off = 0;
        loop {
            let len = c_max.min(c - off);
            let srcs: Vec<*const u8> = (0..n)
                .map(|k| {
                    if k == me {
                        // SAFETY: within send.
                        unsafe { send.add((me * c + off) * esz) }
                    } else {
                        let idx = if me < k { me } else { me - 1 };
                        // SAFETY: within peer k's slot of phase p.
                        unsafe { self.slot(k, p).add(idx * c_max * esz) as *const u8 }
                    }
                })
                .collect();
            // SAFETY: recv holds c elements; len elements from off.
            unsafe { reduce_into(call.dtype, call.op, n, &srcs, &[Dst { ptr: recv.add(off * esz), nt }], len) };
            off += len;
            if off >= c {
                break;
            }
            p = self.progress + 1;
            stage(self, off, c_max.min(c - off), p, snt);
            self.phase(cx)?;
        }
        Ok(())
    }
}

impl Backend for ShmComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn kind(&self) -> BackendKind {
        BackendKind::Shm
    }

    fn run(&mut self, call: &Call) -> Result<(), CommError> {
        if let Some(reason) = &self.poisoned {
            return Err(CommError::Aborted { by: self.rank, reason: format!("an earlier collective failed: {reason}") });
        }
        for (what, m) in [("send", call.send), ("recv", call.recv)] {
            if m.space != MemSpace::Host && m.len > 0 {
                let e = CommError::Unsupported(format!(
                    "{} on rank {}: the {what} buffer is device memory, which the shared-memory backend cannot read; use the NCCL backend or copy it to the host",
                    call.kind, self.rank
                ));
                self.reject(call.kind, call.dtype, &e);
                return Err(e);
            }
        }
        self.seq += 1;
        self.ctrl(self.rank).coll_seq.store(self.seq, Relaxed);
        let r = self.run_call(call);
        if let Some((g, bytes, nt, t0)) = self.timing.take() {
            if r.is_ok() {
                self.tuner.record(g, bytes, nt, t0.elapsed().as_secs_f64());
            }
        }
        if self.nt_pending || self.stage_nt {
            store_fence();
            self.nt_pending = false;
            self.stage_nt = false;
        }
        if let Err(e) = &r {
            self.poison_on(e);
        }
        r
    }

    fn synchronize(&mut self) -> Result<(), CommError> {
        Ok(())
    }

    fn reject(&mut self, kind: CollKind, dtype: Dtype, _reason: &CommError) {
        if self.poisoned.is_some() {
            return;
        }
        // Take part in the call's first phase with the INVALID flag: every peer's matching call
        // then fails with an error naming this rank, and the phase counters stay aligned.
        self.seq += 1;
        self.ctrl(self.rank).coll_seq.store(self.seq, Relaxed);
        let empty = crate::comm::RawMem { addr: 0, len: 0, space: MemSpace::Host };
        let call = Call { kind, dtype, op: ReduceOp::Sum, root: 0, count: 0, send: empty, recv: empty };
        let cx = Ctx { op: kind, seq: self.seq };
        if let Err(e) = self.begin(&call, INVALID, 0, 0, cx) {
            self.poison_on(&e);
        }
    }

    fn seq(&self) -> u64 {
        self.seq
    }

    fn alloc_shared(&mut self, bytes: usize) -> Result<Box<dyn crate::comm::SharedRegion>, CommError> {
        Ok(Box::new(SharedAlloc::new(self.seg.clone(), self.heap.clone(), bytes)?))
    }
}

impl Drop for ShmComm {
    fn drop(&mut self) {
        // Peers still waiting on us learn at once that we are gone, rather than at the timeout.
        self.ctrl(self.rank).state.store(STATE_LEFT, SeqCst);
        let h = self.header();
        h.wake.0.fetch_add(1, SeqCst);
        futex_wake_all(&h.wake.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_and_align() {
        for len in [0usize, 1, 7, 63, 64, 65, 1000, 4097] {
            for n in 1..9 {
                let mut end = 0;
                for j in 0..n {
                    let (lo, hi) = part(len, n, j, 16);
                    assert_eq!(lo, end.min(len));
                    assert!(lo % 16 == 0 || lo == len);
                    end = hi;
                }
                assert_eq!(end, len);
            }
        }
    }

    #[test]
    fn mismatch_names_ranks() {
        let mut a =
            Desc { kind: CollKind::AllReduce as u8, dtype: Dtype::F32 as u8, op: ReduceOp::Sum as u8, count: 100, ..Default::default() };
        let b = Desc { count: 101, ..a };
        let e = check_descs(&[a, a, b], 5).unwrap_err().to_string();
        assert!(e.contains("rank 2 called all_reduce(count=101, dtype=f32, op=sum)"), "{e}");
        assert!(e.contains("rank 0 called all_reduce(count=100"), "{e}");
        a.root = 3; // root does not matter for all_reduce
        assert!(check_descs(&[a, Desc { root: 0, ..a }], 1).is_ok());
    }

    #[test]
    fn single_rank_all_reduce() {
        let job = ShmJob::with_config(1, ShmConfig::default()).unwrap();
        let mut c = job.communicator(0).unwrap();
        let x: Vec<f32> = (0..100_000).map(|i| i as f32).collect();
        let mut y = vec![0f32; x.len()];
        c.all_reduce(&x, &mut y, ReduceOp::Avg).unwrap();
        assert_eq!(x, y);
        let mut s = c.alloc_shared::<f32>(1000).unwrap();
        s[3] = 2.0;
        c.all_reduce_in_place(&mut s, ReduceOp::Sum).unwrap();
        assert_eq!(s[3], 2.0);
        c.barrier().unwrap();
        // Absurd sizes are refused, not overflowed.
        assert!(c.alloc_shared::<i64>(usize::MAX / 8).is_err());
        assert!(c.alloc_shared::<u8>(usize::MAX).is_err());
    }
}
