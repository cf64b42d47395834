//! The ring: the last `capacity` calls of one communicator, written by the thread that runs the
//! calls and readable at any time by another (the SIGUSR1 dump thread).
//!
//! Each slot is a seqlock over eight words of atomics: the writer (one thread: the communicator is
//! `&mut` while it runs a call) makes the slot's version odd, stores the words, and makes it even
//! again; a reader copies the words and keeps the copy only if the version was even and unchanged
//! across it. On x86 every one of these is a plain load or store: no allocation, no lock, nothing
//! shared with other ranks. Error texts, which do allocate, live beside the ring and are written
//! only when a call fails.
//!
//! A slot holds a *run*: a call, and the calls after it that repeat it exactly (same collective,
//! dtype, op, count, root and buffers, the same path, untimed and successful), which is what a
//! training loop's calls mostly are. A repeated call stores its id as the run's last (one word of
//! the line the run already holds, outside the seqlock: a reader sees the run with or without
//! it, both true) and the number of calls ended; only a call that differs from the one before
//! writes a whole slot. Readers expand runs back into one [`Record`] per call and keep the last
//! `capacity` calls, so what they see does not depend on how the calls were stored.
//!
//! Times are taken for some calls only ([`timed`]): two clock reads cost more than a small
//! collective on one node may take, and the recorder must not slow the job it watches. Every call
//! of [`TIMED_BYTES`] or more is timed (the reads are then lost in the copy), and of the smaller
//! ones every [`TIMED_EVERY`]-th collective, chosen by its number, so that all ranks time the
//! same calls and their start times compare; a failed call's end is always timed. A timed call
//! has a run of its own.
//!
//! A backend that knows a call's path as the call starts (the shared-memory inline path) gives it
//! with the start ([`Recorder::start_on`]), which the communicator's backend takes down where
//! this rank waits for its peers (`comm::Arrival`). Such a call, untimed, needs nothing more said
//! of it if it succeeds: its end is one store of `done`, and readers take a call that reads as
//! running but which `done` has passed as ended well (a failure always writes its outcome before
//! `done`).

use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering::*};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use super::clock::{ns, Clock, Scale};

use crate::types::{CollKind, Dtype, ReduceOp};

/// The path a call took through its backend, as the backend reports it
/// ([`Backend::last_path`](crate::comm::Backend::last_path)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
#[non_exhaustive]
pub enum CallPath {
    /// Not reported (`-`).
    Unknown = 0,
    /// Shared memory: arguments and payload in one line per rank.
    Inline = 1,
    /// Shared memory: a small all-reduce or reduce in one phase through the slots.
    OnePhase = 2,
    /// Shared memory: buffers in the segment, read and written in place.
    Registered = 3,
    /// Shared memory: one copy between the ranks' buffers (cross-memory attach).
    Cma = 4,
    /// Shared memory: chunk by chunk through the staging slots.
    Slots = 5,
    /// NCCL.
    Nccl = 6,
    /// Device buffers staged through a host communicator.
    Staged = 7,
    /// Shared memory in each node, MPI between nodes.
    Hier = 8,
}

impl CallPath {
    const ALL: [CallPath; 9] = [
        CallPath::Unknown,
        CallPath::Inline,
        CallPath::OnePhase,
        CallPath::Registered,
        CallPath::Cma,
        CallPath::Slots,
        CallPath::Nccl,
        CallPath::Staged,
        CallPath::Hier,
    ];

    /// Its name in the trace files.
    pub const fn name(self) -> &'static str {
        match self {
            CallPath::Unknown => "-",
            CallPath::Inline => "inline",
            CallPath::OnePhase => "one-phase",
            CallPath::Registered => "registered",
            CallPath::Cma => "cma",
            CallPath::Slots => "slots",
            CallPath::Nccl => "nccl",
            CallPath::Staged => "staged",
            CallPath::Hier => "hier",
        }
    }

    pub(crate) fn from_u8(v: u8) -> CallPath {
        CallPath::ALL
            .into_iter()
            .find(|p| *p as u8 == v)
            .unwrap_or(CallPath::Unknown)
    }
}

/// Where a call's buffers lived.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
#[non_exhaustive]
pub enum BufferKind {
    /// Host memory of the process.
    Host = 0,
    /// Device memory.
    Device = 1,
    /// In the backend's shared segment (the registered path).
    Registered = 2,
}

impl BufferKind {
    /// Its name in the trace files.
    pub const fn name(self) -> &'static str {
        match self {
            BufferKind::Host => "host",
            BufferKind::Device => "device",
            BufferKind::Registered => "registered",
        }
    }

    fn from_u8(v: u8) -> BufferKind {
        match v {
            1 => BufferKind::Device,
            2 => BufferKind::Registered,
            _ => BufferKind::Host,
        }
    }
}

/// How a recorded call ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// It returned successfully.
    Ok,
    /// It failed with this error.
    Error(String),
    /// It had not returned when the records were read.
    Running,
}

/// Smaller calls are timed once in this many collectives (see the module docs).
pub const TIMED_EVERY: u64 = 64;
/// Calls moving at least this many bytes per rank are always timed.
pub const TIMED_BYTES: u64 = 64 << 10;

/// Whether the recorder times a call: collective number `seq` (0 for point-to-point, then
/// record `id` decides) moving `bytes` per rank.
pub(crate) fn timed(seq: u64, id: u64, bytes: u64) -> bool {
    let n = if seq == 0 { id } else { seq };
    bytes >= TIMED_BYTES || n % TIMED_EVERY == 1
}

/// One recorded call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// The record's number on this communicator, from 1 (every call).
    pub id: u64,
    /// The collective's number on this communicator, from 1; 0 for point-to-point.
    pub seq: u64,
    /// What was called.
    pub call: CallInfo,
    /// The path the backend took.
    pub path: CallPath,
    /// Start, in Unix nanoseconds (when this rank arrived at the call: the shared-memory backend
    /// notes it once it has published its part); `None` for a call the recorder did not time (it
    /// times every call of 64 KiB or more and every 64th smaller collective).
    pub start_ns: Option<u64>,
    /// End, in Unix nanoseconds; `None` while running and for an untimed call that succeeded.
    pub end_ns: Option<u64>,
    /// How it ended.
    pub outcome: Outcome,
}

/// What a record says of the call itself (what the recorder takes down before the call runs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallInfo {
    /// The collective, or `Send`/`Recv` (the first operation of a point-to-point group).
    pub kind: CollKind,
    /// Element type.
    pub dtype: Dtype,
    /// Reduction operator (`Sum` where none applies).
    pub op: ReduceOp,
    /// Element count (see `comm::Call::count`; a point-to-point group: its first operation's).
    pub count: u64,
    /// Root of a rooted collective, peer of a send or receive; `None` otherwise.
    pub root: Option<u64>,
    /// Operations of a point-to-point group (1 for a single send or receive, 0 for a collective).
    pub ops: u16,
    /// Host, device or registered buffers (registered: known once the call took that path).
    pub buffer: BufferKind,
}

/// Word 3 of a slot: the small fields, a byte each, and the group size.
fn pack(i: &CallInfo, path: CallPath, outcome: u8) -> u64 {
    i.kind as u64
        | (i.dtype as u64) << 8
        | (i.op as u64) << 16
        | (i.buffer as u64) << 24
        | (path as u64) << 32
        | (outcome as u64) << 40
        | (i.ops as u64) << 48
}

/// `packed` (path 0) taking `path`: registered buffers are known by it.
fn with_path(packed: u64, path: CallPath) -> u64 {
    let p = packed | (path as u64) << 32;
    if path == CallPath::Registered {
        p & !(0xff << 24) | (BufferKind::Registered as u64) << 24
    } else {
        p
    }
}

/// The call in flight ends by writing its slot (timed, or its run's path not known yet).
const QUICK_NO: u8 = 0;
/// It ends with `done` alone if it succeeds: its path came with its start.
const QUICK_ALWAYS: u8 = 1;
/// It joined a run, and ends with `done` alone if it succeeds on the run's path.
const QUICK_SAME_PATH: u8 = 2;

const RUNNING: u8 = 0;
const OK: u8 = 1;
const FAILED: u8 = 2;
/// `root` when the call has none.
const NO_ROOT: u64 = u64::MAX;
/// Error texts kept (the most recent ones; older failed records then say "error").
const ERRORS_KEPT: usize = 64;
/// The bytes of a packed word that a later call must repeat to join its run: kind, dtype, op,
/// buffer and group size (path and outcome are compared apart, once the call ended).
const CALL_BYTES: u64 = !(0xffff << 32);
/// Word 7 with this bit set holds the run's last id; clear, the end time of the run's one call
/// (0: untimed). A run of more than one call is untimed and successful, so it has no end time.
const LAST_ID: u64 = 1 << 63;

/// One slot: `[version, first id, first seq, packed, count, root, start, end or last id]` of a
/// run, one cache line of its own, so that writing a run touches one line (unaligned, most slots
/// would straddle two).
#[repr(align(64))]
struct Slot([AtomicU64; 8]);

/// The last calls of one communicator (see the module docs).
///
/// Only `done` and the slots are read by readers; the other words describe the newest run for
/// the writer alone (atomics so that the ring can be shared, plain loads and stores).
pub(crate) struct Recorder {
    slots: Box<[Slot]>,
    /// Calls started so far (the next one's id is this plus one).
    next: AtomicU64,
    /// Every call up to this id has ended (stored after the call's slot, if it wrote one).
    done: AtomicU64,
    /// Collectives recorded so far (the next one's `seq` is this plus one).
    colls: AtomicU64,
    /// The slot of the newest run (kept so that no call divides).
    open_slot: AtomicUsize,
    /// The newest run's packed word as its first call started (path and outcome 0).
    open_call: AtomicU64,
    /// Its count and root (`NO_ROOT` for none).
    open_count: AtomicU64,
    open_root: AtomicU64,
    /// Its first call's id and seq, for a joined call that has to open a run of its own at its end.
    open_id: AtomicU64,
    open_seq: AtomicU64,
    /// The path its calls took.
    open_path: AtomicU64,
    /// Whether the next call may join it: its calls were untimed and succeeded.
    open_joinable: AtomicBool,
    /// Whether the call in flight joined the newest run (it wrote no slot at its start).
    joined: AtomicBool,
    /// Whether the call in flight is timed ([`timed`]).
    open_timed: AtomicBool,
    /// How the call in flight may end without writing its slot (`QUICK_*`), as its start found.
    quick_end: AtomicU8,
    /// Error texts of failed records, by id, oldest first.
    errors: Mutex<Vec<(u64, String)>>,
    /// Times are ticks of this clock (`clock.rs`), nanoseconds since its zero once read ...
    clock: Clock,
    /// ... which was this many nanoseconds after the Unix epoch (CLOCK_REALTIME).
    base_realtime_ns: u64,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("capacity", &self.slots.len())
            .field("recorded", &self.next.load(Relaxed))
            .finish()
    }
}

/// What opens a run: its first call's words.
struct RunStart {
    id: u64,
    seq: u64,
    packed: u64,
    count: u64,
    /// The root word (`NO_ROOT` for none).
    root: u64,
    start: u64,
    end: u64,
}

impl Recorder {
    /// A ring of `capacity` calls (at least 1: a capacity of 0 means no recorder at all).
    pub(crate) fn new(capacity: usize) -> Recorder {
        let slots = (0..capacity.max(1))
            .map(|_| Slot(std::array::from_fn(|_| AtomicU64::new(0))))
            .collect();
        let clock = Clock::new();
        let base_realtime_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(ns)
            .unwrap_or(0);
        Recorder {
            slots,
            next: AtomicU64::new(0),
            done: AtomicU64::new(0),
            colls: AtomicU64::new(0),
            // One before slot 0 (the first run wraps it there).
            open_slot: AtomicUsize::new(capacity.max(1) - 1),
            open_call: AtomicU64::new(0),
            open_count: AtomicU64::new(0),
            open_root: AtomicU64::new(0),
            open_id: AtomicU64::new(0),
            open_seq: AtomicU64::new(0),
            open_path: AtomicU64::new(0),
            open_joinable: AtomicBool::new(false),
            joined: AtomicBool::new(false),
            open_timed: AtomicBool::new(false),
            quick_end: AtomicU8::new(QUICK_NO),
            errors: Mutex::new(Vec::new()),
            clock,
            base_realtime_ns,
        }
    }

    /// How many calls the ring holds.
    pub(crate) fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// The Unix time, in nanoseconds, of the recorder's clock zero: a record's times are
    /// nanoseconds after it, so records of ranks on one host (one realtime clock) compare.
    pub(crate) fn base_realtime_ns(&self) -> u64 {
        self.base_realtime_ns
    }

    /// Now, in the clock's ticks (never 0, which means "not timed").
    #[inline(always)]
    fn now(&self) -> u64 {
        self.clock.ticks().max(1)
    }

    /// Store words 1..8 of `slot` (`words`, given the slot's words) under its seqlock. Only the
    /// recording thread calls it. The stores are written out at constant indices by the caller:
    /// a call pays a handful of plain stores, with no bounds check and no list of them built
    /// first.
    #[inline(always)]
    fn write(&self, slot: &Slot, words: impl FnOnce(&[AtomicU64; 8])) {
        let v = slot.0[0].load(Relaxed);
        slot.0[0].store(v.wrapping_add(1), Relaxed);
        fence(Release);
        words(&slot.0);
        slot.0[0].store(v.wrapping_add(2), Release);
    }

    /// Open a run in the next slot (the oldest run's), and remember it as the newest.
    #[inline]
    fn open(&self, r: RunStart) {
        let i = match self.open_slot.load(Relaxed) + 1 {
            i if i == self.slots.len() => 0,
            i => i,
        };
        self.open_slot.store(i, Relaxed);
        self.write(&self.slots[i], |w| {
            w[1].store(r.id, Relaxed);
            w[2].store(r.seq, Relaxed);
            w[3].store(r.packed, Relaxed);
            w[4].store(r.count, Relaxed);
            w[5].store(r.root, Relaxed);
            w[6].store(r.start, Relaxed);
            w[7].store(r.end, Relaxed);
        });
        self.open_call.store(r.packed & CALL_BYTES, Relaxed);
        self.open_count.store(r.count, Relaxed);
        self.open_root.store(r.root, Relaxed);
        self.open_id.store(r.id, Relaxed);
        self.open_seq.store(r.seq, Relaxed);
    }

    /// Record the start of a call; returns its id, to pass to [`end`](Self::end).
    #[inline]
    pub(crate) fn start(&self, info: &CallInfo) -> u64 {
        self.start_on(info, None).0
    }

    /// [`start`](Self::start), given the path the call takes when the backend knows it as the
    /// call starts (`None`: [`end`](Self::end) gives it). Known, it is stored with the start,
    /// and an untimed call then needs nothing more said of it if it succeeds: readers take a
    /// call whose outcome reads running, but which `done` has passed, as ended well. Returns the
    /// id, and whether such a success may end by [`end_quick`](Self::end_quick).
    #[inline]
    pub(crate) fn start_on(&self, info: &CallInfo, path: Option<CallPath>) -> (u64, bool) {
        let id = self.next.load(Relaxed) + 1;
        let seq = if info.ops == 0 {
            let s = self.colls.load(Relaxed) + 1;
            self.colls.store(s, Relaxed);
            s
        } else {
            0
        };
        let packed = pack(info, CallPath::Unknown, RUNNING);
        let root = info.root.unwrap_or(NO_ROOT);
        let bytes = info.count.saturating_mul(info.dtype.size() as u64);
        let is_timed = timed(seq, id, bytes);
        let joins = !is_timed
            && self.open_joinable.load(Relaxed)
            && self.open_call.load(Relaxed) == packed
            && self.open_count.load(Relaxed) == info.count
            && self.open_root.load(Relaxed) == root
            && path.is_none_or(|p| self.open_path.load(Relaxed) == p as u64);
        self.joined.store(joins, Relaxed);
        // Decided here, where the call waits for its peers, so that its end has one branch.
        let quick = match (is_timed, path, joins) {
            (true, _, _) => QUICK_NO,
            (false, Some(_), _) => QUICK_ALWAYS,
            (false, None, true) => QUICK_SAME_PATH,
            (false, None, false) => QUICK_NO,
        };
        self.quick_end.store(quick, Relaxed);
        if joins {
            let slot = &self.slots[self.open_slot.load(Relaxed)];
            slot.0[7].store(LAST_ID | id, Release);
        } else {
            self.open_timed.store(is_timed, Relaxed);
            self.open_joinable.store(false, Relaxed);
            let start = if is_timed { self.now() } else { 0 };
            self.open(RunStart {
                id,
                seq,
                packed: path.map_or(packed, |p| with_path(packed, p)),
                count: info.count,
                root,
                start,
                end: 0,
            });
            if let Some(p) = path {
                // The bytes the next call compares are those of its start (not Registered's).
                self.open_call.store(packed, Relaxed);
                self.open_path.store(p as u64, Relaxed);
            }
        }
        self.next.store(id, Relaxed);
        (id, quick == QUICK_ALWAYS)
    }

    /// Count `n` collectives made without being recorded: the next recorded one is numbered
    /// after them. Called by the recording thread, between calls.
    pub(crate) fn skip_collectives(&self, n: u64) {
        self.colls.store(self.colls.load(Relaxed) + n, Relaxed);
        // Readers number a run's calls from its first: the next call opens a run of its own.
        self.open_joinable.store(false, Relaxed);
    }

    /// The successful end of call `id`, which [`start_on`](Self::start_on) said may end so.
    #[inline]
    pub(crate) fn end_quick(&self, id: u64) {
        self.open_joinable.store(true, Relaxed);
        self.done.store(id, Release);
    }

    /// Record the end of call `id`: the path it took, and its error's text if it failed.
    #[inline]
    pub(crate) fn end(&self, id: u64, path: CallPath, error: Option<&dyn std::fmt::Display>) {
        let quick = match self.quick_end.load(Relaxed) {
            QUICK_ALWAYS => true,
            QUICK_SAME_PATH => self.open_path.load(Relaxed) == path as u64,
            _ => false,
        };
        if quick && error.is_none() {
            // The run goes on, or the call's own slot holds all there is to say (its path came
            // with its start): it ended well once `done` passes it.
            self.open_joinable.store(true, Relaxed);
            self.done.store(id, Release);
            return;
        }
        self.end_apart(id, path, error, self.joined.load(Relaxed));
    }

    /// [`end`](Self::end) of a call with a run of its own, or of one that joined a run and turns
    /// out to differ from it (another path, or a failure): it opens a run of its own now.
    fn end_apart(
        &self,
        id: u64,
        path: CallPath,
        error: Option<&dyn std::fmt::Display>,
        joined: bool,
    ) {
        let timed = !joined && self.open_timed.load(Relaxed);
        let end = if error.is_some() || timed {
            self.now()
        } else {
            0
        };
        let outcome = if error.is_some() { FAILED } else { OK };
        let call = self.open_call.load(Relaxed);
        let packed = with_path(call, path) | (outcome as u64) << 40;
        if joined {
            // The run it joined ends before it (in one store: readers see the call in one of
            // the two runs, or in neither for a moment); its words are the run's, but for its
            // own id and collective number.
            let prev = &self.slots[self.open_slot.load(Relaxed)];
            prev.0[7].store(LAST_ID | (id - 1), Release);
            let seq = match self.open_seq.load(Relaxed) {
                0 => 0,
                s => s + (id - self.open_id.load(Relaxed)),
            };
            self.open(RunStart {
                id,
                seq,
                packed,
                count: self.open_count.load(Relaxed),
                root: self.open_root.load(Relaxed),
                start: 0,
                end,
            });
            // The bytes the next call compares are those of its start (not Registered's).
            self.open_call.store(call, Relaxed);
        } else {
            let slot = &self.slots[self.open_slot.load(Relaxed)];
            if end == 0 {
                // An untimed call's end word is still the 0 `start` wrote.
                self.write(slot, |w| w[3].store(packed, Relaxed));
            } else {
                self.write(slot, |w| {
                    w[3].store(packed, Relaxed);
                    w[7].store(end, Relaxed);
                });
            }
        }
        self.open_path.store(path as u64, Relaxed);
        self.open_joinable.store(error.is_none() && !timed, Relaxed);
        if let Some(e) = error {
            self.keep_error(id, e);
        }
        self.done.store(id, Release);
    }

    /// Keep the text of failed call `id`'s error (the most recent [`ERRORS_KEPT`]).
    #[cold]
    fn keep_error(&self, id: u64, e: &dyn std::fmt::Display) {
        let mut errs = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        if errs.len() >= ERRORS_KEPT {
            errs.remove(0);
        }
        errs.push((id, e.to_string()));
    }

    /// A consistent copy of one slot, or `None` while it is being written (or was never written).
    fn read(&self, slot: &Slot) -> Option<[u64; 8]> {
        for _ in 0..1000 {
            let v1 = slot.0[0].load(Acquire);
            let mut w = [0u64; 8];
            for (i, x) in w.iter_mut().enumerate().skip(1) {
                *x = slot.0[i].load(Relaxed);
            }
            fence(Acquire);
            let v2 = slot.0[0].load(Relaxed);
            if v1 == v2 && v1.is_multiple_of(2) {
                return (v1 != 0).then_some(w);
            }
            std::hint::spin_loop();
        }
        None
    }

    /// The records of the last `capacity` calls, oldest first, one per call (runs expanded; times
    /// as Unix nanoseconds).
    ///
    /// Read from another thread while calls run, the slots are copied one after another, so a
    /// copy can mix slots from before and after some calls, and a run can read shorter than it
    /// became before the run after it opened: a gap. A copy made while no call started (`next`
    /// unchanged across it) has none, since a start opens at most one slot, after the run before
    /// it has stored its last id. If calls keep starting, the newest calls up to the last gap
    /// are given: what is certain.
    pub(crate) fn records(&self) -> Vec<Record> {
        for _ in 0..64 {
            let before = self.next.load(Acquire);
            let out = self.snapshot();
            fence(Acquire);
            if self.next.load(Relaxed) == before {
                return out;
            }
            std::hint::spin_loop();
        }
        let mut out = self.snapshot();
        if let Some(k) = out.windows(2).rposition(|w| w[1].id != w[0].id + 1) {
            out.drain(..=k);
        }
        out
    }

    /// One copy of the slots, expanded (see [`records`](Self::records)).
    fn snapshot(&self) -> Vec<Record> {
        // Every call up to `done` has ended; the later ones a run holds were running (or have
        // ended since: they read as running, a moment late).
        let done = self.done.load(Acquire);
        let scale = self.clock.scale();
        let errs = self
            .errors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut runs: Vec<([u64; 8], u64)> = self
            .slots
            .iter()
            .filter_map(|s| self.read(s))
            .map(|w| {
                let last = match w[7] {
                    l if l & LAST_ID != 0 => (l & !LAST_ID).max(w[1]),
                    _ => w[1],
                };
                (w, last)
            })
            .collect();
        runs.sort_by_key(|(w, _)| w[1]);
        // A call moving from a run to one of its own may be read in both: the later run has it.
        for i in 1..runs.len() {
            let next_first = runs[i].0[1];
            let prev = &mut runs[i - 1].1;
            *prev = (*prev).min(next_first - 1);
        }
        let newest = runs.last().map_or(0, |(_, last)| *last);
        let first = newest.saturating_sub(self.slots.len() as u64) + 1;
        let mut out = Vec::new();
        for (w, last) in &runs {
            for id in w[1].max(first)..=*last {
                if let Some(r) = self.decode(w, id, done, scale, &errs) {
                    out.push(r);
                }
            }
        }
        out
    }

    /// Call `id` of the run in slot words `w`.
    fn decode(
        &self,
        w: &[u64; 8],
        id: u64,
        done: u64,
        scale: Scale,
        errs: &[(u64, String)],
    ) -> Option<Record> {
        let own = id == w[1];
        let byte = |i: u32| (w[3] >> (8 * i)) as u8;
        let outcome = match byte(5) {
            // A call that joined the run reads as the run until it ends.
            _ if !own && id > done => Outcome::Running,
            // Given its path as it started, a call that succeeds untimed writes no outcome.
            RUNNING if id <= done => Outcome::Ok,
            RUNNING => Outcome::Running,
            OK => Outcome::Ok,
            _ => Outcome::Error(
                errs.iter()
                    .find(|(e, _)| *e == id)
                    .map_or_else(|| "error".to_string(), |(_, t)| t.clone()),
            ),
        };
        let path = match outcome {
            Outcome::Running if !own => CallPath::Unknown,
            _ => CallPath::from_u8(byte(4)),
        };
        let end = if w[7] & LAST_ID != 0 { 0 } else { w[7] };
        let time = |t: u64| (own && t != 0).then(|| self.base_realtime_ns + scale.ns(t));
        Some(Record {
            id,
            seq: match w[2] {
                0 => 0,
                s => s + (id - w[1]),
            },
            call: decode_call(w[3], w[4], w[5])?,
            path,
            start_ns: time(w[6]),
            end_ns: time(end),
            outcome,
        })
    }
}

/// A call's fields from a packed word, its count and its root word.
fn decode_call(packed: u64, count: u64, root: u64) -> Option<CallInfo> {
    let byte = |i: u32| (packed >> (8 * i)) as u8;
    Some(CallInfo {
        kind: CollKind::from_u8(byte(0))?,
        dtype: Dtype::from_u8(byte(1))?,
        op: ReduceOp::from_u8(byte(2))?,
        buffer: BufferKind::from_u8(byte(3)),
        ops: (packed >> 48) as u16,
        count,
        root: (root != NO_ROOT).then_some(root),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(kind: CollKind, count: u64) -> CallInfo {
        CallInfo {
            kind,
            dtype: Dtype::F32,
            op: ReduceOp::Sum,
            count,
            root: None,
            ops: 0,
            buffer: BufferKind::Host,
        }
    }

    #[test]
    fn every_slot_is_one_cache_line() {
        assert_eq!(std::mem::size_of::<Slot>(), 64);
        let r = Recorder::new(3);
        assert!(r
            .slots
            .iter()
            .all(|s| (s as *const Slot as usize).is_multiple_of(64)));
    }

    #[test]
    fn keeps_the_last_calls_in_order_across_the_wrap() {
        let r = Recorder::new(4);
        for i in 1..=10u64 {
            let id = r.start(&info(CollKind::AllReduce, i));
            r.end(id, CallPath::Slots, None);
        }
        let recs = r.records();
        assert_eq!(recs.iter().map(|r| r.id).collect::<Vec<_>>(), [7, 8, 9, 10]);
        assert_eq!(
            recs.iter().map(|r| r.seq).collect::<Vec<_>>(),
            [7, 8, 9, 10]
        );
        assert_eq!(
            recs.iter().map(|r| r.call.count).collect::<Vec<_>>(),
            [7, 8, 9, 10]
        );
        assert!(recs
            .iter()
            .all(|r| r.outcome == Outcome::Ok && r.path == CallPath::Slots));
    }

    #[test]
    fn small_calls_are_timed_one_in_timed_every_and_large_ones_always() {
        let r = Recorder::new(64);
        for i in 1..=2 * TIMED_EVERY {
            let id = r.start(&info(CollKind::AllReduce, 2));
            r.end(id, CallPath::Inline, None);
            let big = r.start(&info(CollKind::AllReduce, TIMED_BYTES / 4));
            r.end(big, CallPath::Slots, None);
            assert_eq!(i, id.div_ceil(2));
        }
        for rec in r.records() {
            let want = rec.call.count > 2 || rec.seq % TIMED_EVERY == 1;
            assert_eq!(rec.start_ns.is_some(), want, "{rec:?}");
            assert_eq!(rec.end_ns.is_some(), want, "{rec:?}");
            if let (Some(a), Some(b)) = (rec.start_ns, rec.end_ns) {
                assert!(b >= a, "{rec:?}");
            }
        }
        // A failed call's end is timed even when its start was not.
        for _ in 0..2 {
            let id = r.start(&info(CollKind::AllReduce, 2));
            r.end(id, CallPath::Inline, Some(&"peer lost"));
        }
        let last = r.records().pop().unwrap();
        assert!(last.start_ns.is_none() && last.end_ns.is_some(), "{last:?}");
    }

    #[test]
    fn a_running_call_a_failure_and_point_to_point_are_told_apart() {
        let r = Recorder::new(8);
        let a = r.start(&info(CollKind::Barrier, 0));
        r.end(a, CallPath::Inline, Some(&"timed out"));
        let p = r.start(&CallInfo {
            root: Some(1),
            ops: 1,
            ..info(CollKind::Send, 3)
        });
        r.end(p, CallPath::Unknown, None);
        r.start(&info(CollKind::AllGather, 5));
        let recs = r.records();
        assert_eq!(recs.len(), 3);
        assert_eq!(recs[0].outcome, Outcome::Error("timed out".into()));
        assert_eq!(
            (recs[1].seq, recs[1].call.root, recs[1].call.ops),
            (0, Some(1), 1)
        );
        assert_eq!((recs[2].seq, recs[2].end_ns), (2, None));
        assert_eq!(recs[2].outcome, Outcome::Running);
    }

    #[test]
    fn an_empty_ring_has_no_records() {
        assert!(Recorder::new(3).records().is_empty());
    }

    /// The call `i` of a mixed sequence: runs of repeats broken by other counts, kinds, paths,
    /// point-to-point groups and failures, as a training loop's calls come.
    fn call_of(i: u64) -> (CallInfo, CallPath, bool) {
        let mut c = info(CollKind::AllReduce, [2, 2, 2, 6][(i / 5 % 4) as usize]);
        if i.is_multiple_of(37) {
            c = CallInfo {
                root: Some(1),
                ops: 1,
                ..info(CollKind::Send, 4)
            };
        } else if i.is_multiple_of(29) {
            c = CallInfo {
                root: Some(0),
                ..info(CollKind::Broadcast, 2)
            };
        }
        let path = if i.is_multiple_of(11) {
            CallPath::Registered
        } else {
            CallPath::Inline
        };
        (c, path, i.is_multiple_of(23))
    }

    /// What a recorder that stored every call on its own would hold for calls `1..=n` (times as
    /// "present or not"), the last `cap` of them.
    fn expected(n: u64, cap: u64) -> Vec<(u64, u64, CallInfo, CallPath, bool, bool, Outcome)> {
        let mut seq = 0;
        let mut all = Vec::new();
        for id in 1..=n {
            let (mut c, path, fails) = call_of(id);
            let s = if c.ops == 0 {
                seq += 1;
                seq
            } else {
                0
            };
            let t = timed(s, id, c.count * 4);
            if path == CallPath::Registered {
                c.buffer = BufferKind::Registered;
            }
            let outcome = if fails {
                Outcome::Error(format!("failure {id}"))
            } else {
                Outcome::Ok
            };
            all.push((id, s, c, path, t, t || fails, outcome));
        }
        all.split_off(all.len().saturating_sub(cap as usize))
    }

    fn seen(r: &Recorder) -> Vec<(u64, u64, CallInfo, CallPath, bool, bool, Outcome)> {
        r.records()
            .into_iter()
            .map(|x| {
                (
                    x.id,
                    x.seq,
                    x.call,
                    x.path,
                    x.start_ns.is_some(),
                    x.end_ns.is_some(),
                    x.outcome,
                )
            })
            .collect()
    }

    /// Record call `id` of [`call_of`] as a communicator does: with its path at its start when
    /// `with_path` (as the inline path's calls come), ending it quickly when the start allows.
    fn record(r: &Recorder, id: u64, with_path: bool) {
        let (c, path, fails) = call_of(id);
        let (got, quick) = r.start_on(&c, with_path.then_some(path));
        assert_eq!(got, id);
        if quick && !fails {
            r.end_quick(id);
        } else {
            let err = format!("failure {id}");
            r.end(id, path, fails.then_some(&err as &dyn std::fmt::Display));
        }
    }

    #[test]
    fn runs_of_repeated_calls_read_back_as_every_call_would() {
        // Paths given at the end, and mostly at the start (every third call at the end).
        for mixed in [false, true] {
            for cap in [1u64, 2, 3, 7, 64, 2000] {
                let r = Recorder::new(cap as usize);
                for id in 1..=500u64 {
                    record(&r, id, mixed && id % 3 != 0);
                    if id % 50 == 0 || id < 40 {
                        assert_eq!(
                            seen(&r),
                            expected(id, cap),
                            "capacity {cap}, paths at the start {mixed}, after call {id}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_start_with_its_path_reads_as_running_on_that_path_until_it_ends() {
        let r = Recorder::new(8);
        let (c, path) = (info(CollKind::AllReduce, 2), CallPath::Inline);
        // Call 1 is timed: it ends by writing its slot.
        assert_eq!(r.start_on(&c, Some(path)), (1, false));
        r.end(1, path, None);
        let (id, quick) = r.start_on(&c, Some(path));
        assert!(quick);
        let last = r.records().pop().unwrap();
        assert_eq!(
            (last.id, last.outcome, last.path),
            (id, Outcome::Running, path)
        );
        r.end_quick(id);
        // It joins no run but its own (call 1 was timed); the next ones join it.
        for _ in 0..3 {
            let (id, quick) = r.start_on(&c, Some(path));
            assert!(quick);
            r.end_quick(id);
        }
        let recs = r.records();
        assert_eq!(recs.len(), 5);
        assert!(recs
            .iter()
            .all(|x| x.outcome == Outcome::Ok && x.path == path));
        assert!(recs[1..]
            .iter()
            .all(|x| x.start_ns.is_none() && x.end_ns.is_none()));
        // Another path does not join: the registered path's buffers read as registered.
        let (id, _) = r.start_on(&c, Some(CallPath::Registered));
        r.end_quick(id);
        let last = r.records().pop().unwrap();
        assert_eq!(
            (last.path, last.call.buffer),
            (CallPath::Registered, BufferKind::Registered)
        );
        assert_eq!(r.records()[4].path, path);
    }

    #[test]
    fn repeats_take_no_slot_and_a_call_in_flight_reads_as_running() {
        let r = Recorder::new(4);
        let timed_one = 15 * TIMED_EVERY + 1;
        for id in 1..=timed_one + 3 {
            r.start(&info(CollKind::AllReduce, 2));
            r.end(id, CallPath::Inline, None);
        }
        let recs = r.records();
        assert_eq!(
            recs.iter().map(|x| x.seq).collect::<Vec<_>>(),
            (timed_one..=timed_one + 3).collect::<Vec<_>>()
        );
        // The first is a timed call, the others repeat it.
        assert!(recs[0].start_ns.is_some() && recs[1].start_ns.is_none());
        // A repeat in flight: running, its path not known yet; once ended, one like the others.
        let id = r.start(&info(CollKind::AllReduce, 2));
        let last = r.records().pop().unwrap();
        assert_eq!(
            (last.id, last.outcome, last.path),
            (id, Outcome::Running, CallPath::Unknown)
        );
        r.end(id, CallPath::Inline, None);
        let last = r.records().pop().unwrap();
        assert_eq!(
            (last.id, last.outcome, last.path),
            (id, Outcome::Ok, CallPath::Inline)
        );
        // A repeat that fails ends its run: the failure has its record, error text and end time.
        let id = r.start(&info(CollKind::AllReduce, 2));
        r.end(id, CallPath::Inline, Some(&"peer lost"));
        let last = r.records().pop().unwrap();
        assert_eq!((last.id, last.seq), (id, timed_one + 5));
        assert_eq!(last.outcome, Outcome::Error("peer lost".into()));
        assert!(last.start_ns.is_none() && last.end_ns.is_some());
    }

    #[test]
    fn a_reader_beside_the_writer_sees_whole_calls_in_order() {
        let r = std::sync::Arc::new(Recorder::new(16));
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let reader = {
            let (r, stop) = (r.clone(), stop.clone());
            std::thread::spawn(move || {
                let (mut reads, mut seen) = (0u64, 0usize);
                while !stop.load(Relaxed) {
                    let recs = r.records();
                    seen += recs.len();
                    assert!(recs.len() <= 16);
                    for w in recs.windows(2) {
                        assert_eq!(w[1].id, w[0].id + 1, "{recs:?}");
                    }
                    for x in &recs {
                        let (c, _, fails) = call_of(x.id);
                        assert_eq!((x.call.kind, x.call.count), (c.kind, c.count), "{x:?}");
                        // A failure never reads as a success (a quick end writes no outcome).
                        assert!(!(fails && x.outcome == Outcome::Ok), "{x:?}");
                        if x.outcome != Outcome::Running {
                            assert_ne!(x.path, CallPath::Unknown, "{x:?}");
                        }
                    }
                    reads += 1;
                }
                (reads, seen)
            })
        };
        for id in 1..=300_000u64 {
            record(&r, id, id % 3 != 0);
        }
        stop.store(true, Relaxed);
        let (reads, seen) = reader.join().unwrap();
        // The reader got records, not only empty copies: on average several calls a read.
        assert!(
            reads > 0 && seen as u64 >= 4 * reads,
            "{seen} records in {reads} reads"
        );
    }
}
/// The recorder's own cost per call, without a collective around it:
/// `cargo test --release --lib recorder_cost -- --ignored --nocapture`.
#[cfg(test)]
mod cost_probe {
    use super::*;
    #[test]
    #[ignore]
    fn recorder_cost() {
        let r = Recorder::new(2000);
        let info = CallInfo {
            kind: CollKind::AllReduce,
            dtype: Dtype::F32,
            op: ReduceOp::Sum,
            count: 2,
            root: None,
            ops: 0,
            buffer: BufferKind::Host,
        };
        for _ in 0..3 {
            let t = std::time::Instant::now();
            for _ in 0..10_000_000 {
                let id = r.start(std::hint::black_box(&info));
                r.end(id, CallPath::Inline, None);
            }
            eprintln!("{:.1} ns per call", t.elapsed().as_nanos() as f64 / 1e7);
        }
    }
}
