//! The ring: the last `capacity` calls of one communicator, written by the thread that runs the
//! calls and readable at any time by another (the SIGUSR1 dump thread).
//!
//! Each slot is a seqlock over eight words of atomics: the writer (one thread: the communicator is
//! `&mut` while it runs a call) makes the slot's version odd, stores the words, and makes it even
//! again; a reader copies the words and keeps the copy only if the version was even and unchanged
//! across it. On x86 every one of these is a plain load or store, so a call pays a few stores: no
//! allocation, no lock, nothing shared with other ranks. Error texts, which do allocate, live
//! beside the ring and are written only when a call fails.
//!
//! Times are taken for some calls only ([`timed`]): two clock reads cost more than a small
//! collective on one node may take, and the recorder must not slow the job it watches. Every call
//! of [`TIMED_BYTES`] or more is timed (the reads are then lost in the copy), and of the smaller
//! ones every [`TIMED_EVERY`]-th collective, chosen by its number, so that all ranks time the
//! same calls and their start times compare; a failed call's end is always timed.

use std::sync::atomic::{fence, AtomicU64, Ordering::*};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

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
pub const TIMED_EVERY: u64 = 16;
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
    /// Start, in Unix nanoseconds; `None` for a call the recorder did not time (it times every
    /// call of 64 KiB or more and every 16th smaller collective).
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

const RUNNING: u8 = 0;
const OK: u8 = 1;
const FAILED: u8 = 2;
/// `root` when the call has none.
const NO_ROOT: u64 = u64::MAX;
/// Error texts kept (the most recent ones; older failed records then say "error").
const ERRORS_KEPT: usize = 64;

/// One slot: `[version, id, seq, packed, count, root, start, end]`, one cache line of its own, so
/// that a call's record touches one line (unaligned, most slots would straddle two).
#[repr(align(64))]
struct Slot([AtomicU64; 8]);

/// The last calls of one communicator (see the module docs).
pub(crate) struct Recorder {
    slots: Box<[Slot]>,
    /// Records written so far (the next one's id is this plus one); only the writer stores it.
    next: AtomicU64,
    /// Collectives recorded so far (the next one's `seq` is this plus one).
    colls: AtomicU64,
    /// The packed word of the call in flight, to finish it without reading the slot back.
    open: AtomicU64,
    /// Whether the call in flight is timed ([`timed`]).
    open_timed: std::sync::atomic::AtomicBool,
    /// The slot of the call in flight (`(id - 1) % capacity`, kept so that no call divides).
    open_slot: std::sync::atomic::AtomicUsize,
    /// Error texts of failed records, by id, oldest first.
    errors: Mutex<Vec<(u64, String)>>,
    /// Times are nanoseconds since this instant ...
    base: Instant,
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

/// Nanoseconds as a `u64` (saturating: 584 years).
fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Recorder {
    /// A ring of `capacity` calls (at least 1: a capacity of 0 means no recorder at all).
    pub(crate) fn new(capacity: usize) -> Recorder {
        let slots = (0..capacity.max(1))
            .map(|_| Slot(std::array::from_fn(|_| AtomicU64::new(0))))
            .collect();
        let base = Instant::now();
        let base_realtime_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(ns)
            .unwrap_or(0);
        Recorder {
            slots,
            next: AtomicU64::new(0),
            colls: AtomicU64::new(0),
            open: AtomicU64::new(0),
            open_timed: std::sync::atomic::AtomicBool::new(false),
            // One before slot 0 (the first call wraps it there).
            open_slot: std::sync::atomic::AtomicUsize::new(capacity.max(1) - 1),
            errors: Mutex::new(Vec::new()),
            base,
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

    fn now(&self) -> u64 {
        ns(self.base.elapsed())
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

    /// Record the start of a call; returns its id, to pass to [`end`](Self::end).
    #[inline]
    pub(crate) fn start(&self, info: &CallInfo) -> u64 {
        let id = self.next.load(Relaxed) + 1;
        self.next.store(id, Relaxed);
        let seq = if info.ops == 0 {
            let s = self.colls.load(Relaxed) + 1;
            self.colls.store(s, Relaxed);
            s
        } else {
            0
        };
        let packed = pack(info, CallPath::Unknown, RUNNING);
        self.open.store(packed, Relaxed);
        let i = match self.open_slot.load(Relaxed) + 1 {
            i if i == self.slots.len() => 0,
            i => i,
        };
        self.open_slot.store(i, Relaxed);
        let slot = &self.slots[i];
        let bytes = info.count.saturating_mul(info.dtype.size() as u64);
        let is_timed = timed(seq, id, bytes);
        self.open_timed.store(is_timed, Relaxed);
        let start = if is_timed { self.now().max(1) } else { 0 };
        let root = info.root.unwrap_or(NO_ROOT);
        self.write(slot, |w| {
            w[1].store(id, Relaxed);
            w[2].store(seq, Relaxed);
            w[3].store(packed, Relaxed);
            w[4].store(info.count, Relaxed);
            w[5].store(root, Relaxed);
            w[6].store(start, Relaxed);
            w[7].store(0, Relaxed);
        });
        id
    }

    /// Record the end of call `id`: the path it took, and its error's text if it failed.
    #[inline]
    pub(crate) fn end(&self, id: u64, path: CallPath, error: Option<&dyn std::fmt::Display>) {
        let end = if error.is_some() || self.open_timed.load(Relaxed) {
            self.now().max(1)
        } else {
            0
        };
        let outcome = if error.is_some() { FAILED } else { OK };
        // Replace path (byte 4) and outcome (byte 5) of the packed word.
        let mut packed = self.open.load(Relaxed) & !(0xffff << 32)
            | (path as u64) << 32
            | (outcome as u64) << 40;
        if path == CallPath::Registered {
            packed = packed & !(0xff << 24) | (BufferKind::Registered as u64) << 24;
        }
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
        if let Some(e) = error {
            self.keep_error(id, e);
        }
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

    /// The records the ring holds, oldest first (times as Unix nanoseconds).
    pub(crate) fn records(&self) -> Vec<Record> {
        let errs = self
            .errors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut out: Vec<Record> = self
            .slots
            .iter()
            .filter_map(|s| self.read(s))
            .filter_map(|w| self.decode(&w, &errs))
            .collect();
        out.sort_by_key(|r| r.id);
        out
    }

    fn decode(&self, w: &[u64; 8], errs: &[(u64, String)]) -> Option<Record> {
        let byte = |i: u32| (w[3] >> (8 * i)) as u8;
        let outcome = match byte(5) {
            RUNNING => Outcome::Running,
            OK => Outcome::Ok,
            _ => Outcome::Error(
                errs.iter()
                    .find(|(id, _)| *id == w[1])
                    .map_or_else(|| "error".to_string(), |(_, t)| t.clone()),
            ),
        };
        Some(Record {
            id: w[1],
            seq: w[2],
            call: CallInfo {
                kind: CollKind::from_u8(byte(0))?,
                dtype: Dtype::from_u8(byte(1))?,
                op: ReduceOp::from_u8(byte(2))?,
                buffer: BufferKind::from_u8(byte(3)),
                ops: (w[3] >> 48) as u16,
                count: w[4],
                root: (w[5] != NO_ROOT).then_some(w[5]),
            },
            path: CallPath::from_u8(byte(4)),
            start_ns: (w[6] != 0).then(|| self.base_realtime_ns + w[6]),
            end_ns: (w[7] != 0).then(|| self.base_realtime_ns + w[7]),
            outcome,
        })
    }
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
            let t = Instant::now();
            for _ in 0..10_000_000 {
                let id = r.start(std::hint::black_box(&info));
                r.end(id, CallPath::Inline, None);
            }
            eprintln!("{:.1} ns per call", t.elapsed().as_nanos() as f64 / 1e7);
        }
    }
}
