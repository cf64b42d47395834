//! Layout of the shared segment and the synchronisation protocol of the shared-memory backend.
//!
//! Layout (offsets from the segment base):
//!
//! ```text
//! [Header: 4 KiB] [Ctrl × world: 256 B each] [slots: world × 2 × slot_bytes]
//! [inline entries: world × 2 × INLINE_ENTRY] [mailboxes: world × world × (PairCtrl + mbox_bytes)]
//! [heaps: world × heap_bytes]
//! ```
//!
//! The inline entries carry the inline path of small collectives (`shm::inline`): a rank
//! writes its call's arguments and its payload side by side, then the entry's sequence number,
//! so a peer that sees the number sees the call and (up to 40 bytes) the data in the same
//! cache line. No `progress` phase is published for them; see [`InlineHdr`].
//!
//! The mailboxes carry point-to-point messages (`shm::p2p`), one per ordered pair of ranks, apart
//! from the slots and phases of the collectives, so the two never interfere.
//!
//! Memory: the fixed part ([`Layout::backed`]: header, control blocks, slots, inline entries,
//! mailboxes) must fit in the file system when the segment is created (checked, or for a memfd
//! reserved); the header, control blocks and inline entries are reserved then, each rank's slots
//! and each mailbox are mapped (allocated) by the ranks that use them before first use, and a
//! heap range when `alloc_shared` hands it out (see `shm::bootstrap::reserve_backed`). So a full
//! tmpfs (Docker's 64 MiB `/dev/shm`) or a memory cgroup limit shows up as an error there, never
//! as a SIGBUS when a page is first touched.
//!
//! Protocol (modelled on NCCL's `ncclShmemAllgather`): each rank owns a monotonically increasing
//! `progress` counter, padded to its own cache line. A collective is a sequence of *phases*; in phase
//! `p` a rank writes only its own slot `p % 2` (and its call descriptor), publishes `progress = p`
//! with a release store, then waits (acquire loads) until every peer's progress is `>= p` before
//! reading the peers' slots. Every rank consumes phase `p`'s data before publishing `p + 1`, so when
//! a rank writes slot `p % 2` again in phase `p + 2` — after waiting for all peers to reach `p + 1` —
//! nobody still reads it. All ranks make the same number of phases for the same call, which is what
//! keeps the counters aligned after a detected argument mismatch.
//!
//! Waiting spins briefly, then yields, then sleeps on a futex in the header with a timeout; while
//! sleeping it checks that the peers are alive (pidfd), that nobody aborted, and the overall timeout.

use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64};

/// "LOCKSTEP" in ASCII: written last by the creator, once the header is valid.
pub(crate) const MAGIC: u64 = 0x4c4f_434b_5354_4550;
/// Bump when the layout changes.
pub(crate) const VERSION: u32 = 4;
/// Header size.
pub(crate) const HEADER_BYTES: usize = 4096;
/// Control block size per rank.
pub(crate) const CTRL_BYTES: usize = 256;

/// Rank state values in `Ctrl::state`.
pub(crate) const STATE_JOINED: u32 = 1;
pub(crate) const STATE_LEFT: u32 = 2;

/// Segment header, written by the creator before `magic`.
#[repr(C, align(64))]
pub(crate) struct Header {
    pub magic: AtomicU64,
    pub version: AtomicU32,
    pub world: AtomicU32,
    pub slot_bytes: AtomicU64,
    pub heap_bytes: AtomicU64,
    pub total_bytes: AtomicU64,
    /// Ranks that have joined (written their pid).
    pub joined: AtomicU32,
    /// The creator's pid, the inode of its pid namespace and its start time (field 22 of
    /// `/proc/<pid>/stat`): a later launch tells from them, without guessing from the age of the
    /// file, whether the creator of a leftover named segment is gone (see `shm::stale`).
    pub creator_pid: AtomicI32,
    pub creator_pidns: AtomicU64,
    pub creator_start: AtomicU64,
    /// The creator's path thresholds: every rank must choose the same path for the same call.
    pub small_bytes: AtomicU64,
    pub nt_bytes: AtomicU64,
    /// The abort record: why the communicator failed, for the peers to report (see [`Abort`]).
    pub abort: Abort,
    /// Ranks currently asleep on `wake` (separate line: written on every sleep).
    pub sleepers: PaddedU32,
    /// Futex word, bumped by publishers when someone sleeps and by every rank that joins (ranks
    /// waiting for the others to join sleep on it).
    pub wake: PaddedU32,
    /// The shrink record (see `shm::shrink`): after the fields above, so their offsets stay.
    pub shrink: ShrinkArea,
}

/// The header's shrink record: how survivors agree on who is left after a failure and meet in
/// the segment of the shrunk communicator (`shm::shrink`). Each rank's own fate in a shrink is
/// its control block's [`Ctrl::shrink`] word.
#[repr(C, align(64))]
pub(crate) struct ShrinkArea {
    /// The highest shrink attempt any rank has started on this segment (0: none): nonzero tells
    /// every call to look at its own [`Ctrl::shrink`] word, so an excluded rank learns it.
    pub attempt: AtomicU64,
    /// The outcome of creating the shrunk communicator's segment: `attempt << 2 |`
    /// [`SHRINK_CREATED`] or [`SHRINK_FAILED`], written by the member that creates it.
    pub created: AtomicU64,
    /// This communicator's generation: 0 for a world (or split) communicator, and one more than
    /// its parent's for one made by a shrink. Written before `magic`.
    pub generation: AtomicU64,
}

/// [`Ctrl::shrink`] status (low two bits): the rank posted itself for the attempt (upper bits).
pub(crate) const SHRINK_JOINED: u64 = 1;
/// [`Ctrl::shrink`] status: a peer excluded the rank in the attempt (final: it never rejoins).
pub(crate) const SHRINK_EXCLUDED: u64 = 2;
/// [`ShrinkArea::created`] status: the segment of the attempt exists.
pub(crate) const SHRINK_CREATED: u64 = 1;
/// [`ShrinkArea::created`] status: its creation failed (the creator's own error says why).
pub(crate) const SHRINK_FAILED: u64 = 2;

/// The abort record in the header. The first rank to detect a failure claims it (`by`, compare
/// and swap from 0), fills in the culprit, then sets `ready`; peers read it after `ready`, so
/// every rank names the same culprit, not only the one that detected the failure.
#[repr(C, align(64))]
pub(crate) struct Abort {
    /// 0, or 1 + the rank that aborted the communicator.
    pub by: AtomicU32,
    /// 1 once the fields below are written.
    pub ready: AtomicU32,
    /// What happened: [`ABORT_DIED`], [`ABORT_LEFT`], [`ABORT_TIMEOUT`] or [`ABORT_SHRINK`] (0: no
    /// detail).
    pub how: AtomicU32,
    /// 1 + the culprit: the lost rank, or the first rank that had not arrived.
    pub rank: AtomicU32,
    /// Timeout: the collective the culprit was in (its sequence number) and its kind + 1 (0: none yet).
    pub culprit_seq: AtomicU64,
    pub culprit_kind: AtomicU32,
    /// Timeout: how many ranks had not arrived.
    pub missing: AtomicU32,
    /// Timeout: the collective the aborting rank waited in (kind + 1, sequence number) and for how long.
    pub at_kind: AtomicU32,
    pub at_seq: AtomicU64,
    pub waited_ms: AtomicU64,
}

/// `Abort::how` values.
pub(crate) const ABORT_DIED: u32 = 1;
pub(crate) const ABORT_LEFT: u32 = 2;
pub(crate) const ABORT_TIMEOUT: u32 = 3;
/// A rank started shrinking the communicator (`shm::shrink`): the peers' calls on it fail, so
/// that they join the shrink rather than wait for that rank.
pub(crate) const ABORT_SHRINK: u32 = 4;

/// An `AtomicU32` alone on its cache line.
#[repr(C, align(64))]
pub(crate) struct PaddedU32(pub AtomicU32);

/// Per-rank control block.
#[repr(C, align(64))]
pub(crate) struct Ctrl {
    /// Last published phase.
    pub progress: AtomicU64,
    pub pid: AtomicI32,
    pub state: AtomicU32,
    /// The rank's fate in this segment's shrinks (`shm::shrink`): `attempt << 2 | status`
    /// ([`SHRINK_JOINED`] or [`SHRINK_EXCLUDED`]), 0 before any. Each value is set by one
    /// compare-and-swap, by the rank itself (joined) or by a peer (excluded), so every survivor
    /// reads the same final value. Takes the first 8 bytes of what was padding: the fields
    /// around it keep their offsets.
    pub shrink: AtomicU64,
    _pad: [u8; 40],
    /// Call descriptors, one per phase parity (see module docs).
    pub desc: [DescCell; 2],
    /// Collective sequence number the rank is in (for timeout reports). On a line of its own:
    /// written at the start of every call, it would otherwise take the progress line, which the
    /// peers poll, away from them on every call.
    pub coll_seq: AtomicU64,
    /// Kind + 1 of the collective `coll_seq` numbers (0 before the first), for timeout reports.
    pub coll_kind: AtomicU32,
    /// When the rank began waiting for its peers in collective `wait_seq`
    /// (`CLOCK_MONOTONIC_COARSE` in nanoseconds), for `lockstep status`'s time in a call. Stamped
    /// by the wait loop once per collective, and only when the wait outlasts its first polls, so
    /// a call whose peers are there costs no clock read (see `Channel::wait_for`).
    pub wait_start: AtomicU64,
    /// The collective `wait_start` belongs to (stored after it, release).
    pub wait_seq: AtomicU64,
    _pad2: [u8; 32],
}

/// A descriptor slot written by its owner before publishing and read by peers after waiting.
#[repr(C, align(64))]
pub(crate) struct DescCell(pub std::cell::UnsafeCell<Desc>);

/// The call as every rank sees it, for the cross-rank argument check and zero-copy addressing.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Desc {
    pub kind: u8,
    pub dtype: u8,
    pub op: u8,
    pub flags: u8,
    /// Low 32 bits of the number of this rank's last timed call (0: none), whose time `took_ns`
    /// gives: rank 0's tuners record the slowest rank's time (see `Channel::end_call`).
    pub took_seq: u32,
    pub root: u64,
    pub count: u64,
    pub seq: u64,
    /// Segment offset of the send buffer when `flags & SHARED_SEND`.
    pub send_off: u64,
    /// Segment offset of the receive buffer when `flags & SHARED_RECV`.
    pub recv_off: u64,
    /// The rank's pid namespace (inode), for cross-memory copies between ranks (`CMA`).
    pub pidns: u64,
    /// This rank's time in call `took_seq`, in nanoseconds (see `took_seq`).
    pub took_ns: u64,
}

pub(crate) const SHARED_SEND: u8 = 1;
pub(crate) const SHARED_RECV: u8 = 2;
/// The rank offers a cross-memory copy (`shm::cma`): `send_off` is the send buffer's address in
/// the rank's own memory, which its peers may read with `process_vm_readv` (the exchanges, and
/// the collectives' CMA path, `shm::path`); on the CMA path `recv_off` is the output's, which its
/// peers may also write (`process_vm_writev`).
pub(crate) const CMA: u8 = 16;
/// The rank refused the call locally (bad arguments); its peers fail the matching call too.
pub(crate) const INVALID: u8 = 4;
/// Rank 0 chose streaming stores for this call's slot writes (see `shm::timing`).
pub(crate) const STREAMING: u8 = 8;
/// The rank writes its block of this all-gather into its slot after the descriptors, not before
/// (`coll::gather::late_slots`).
pub(crate) const LATE_SLOT: u8 = 32;

/// The rank runs the finite check (`ShmConfig::check_finite`): the ranks must agree on it, so
/// every rank reports a non-finite input alike (`shm::check` compares it).
pub(crate) const FINITE: u8 = 64;
/// Not a call: a finite-check report (see [`Desc::found`]) in the descriptor cell of a phase after
/// the first, which no other descriptor uses.
pub(crate) const FOUND: u8 = 128;

impl Desc {
    /// A rank's finite-check report for call `seq`: the first non-finite input element it read
    /// (`found`: element, source rank, class), or none. It travels in the rank's descriptor cell
    /// of the phase that publishes it (`Channel::phase_found`): `flags` is [`FOUND`], `op` the
    /// class (0 none, 1 NaN, 2 +Inf, 3 -Inf), `count` the element, `root` the source.
    pub(crate) fn found(seq: u64, found: Option<crate::shm::reduce::Found>) -> Desc {
        use crate::comm::NonFiniteKind as K;
        let (op, count, root) = match found {
            None => (0, 0, 0),
            Some(f) => (
                match f.kind {
                    K::NaN => 1,
                    K::PosInf => 2,
                    K::NegInf => 3,
                },
                f.elem as u64,
                f.src as u64,
            ),
        };
        Desc {
            flags: FOUND,
            op,
            count,
            root,
            seq,
            ..Desc::default()
        }
    }

    /// The report [`found`](Self::found) wrote for call `seq`; `None` when it reports nothing or
    /// is not a report of that call.
    pub(crate) fn report(&self, seq: u64) -> Option<crate::shm::reduce::Found> {
        use crate::comm::NonFiniteKind as K;
        if self.flags != FOUND || self.seq != seq {
            return None;
        }
        let kind = match self.op {
            1 => K::NaN,
            2 => K::PosInf,
            3 => K::NegInf,
            _ => return None,
        };
        Some(crate::shm::reduce::Found {
            elem: self.count as usize,
            src: self.root as usize,
            kind,
        })
    }
}

const _: () = assert!(std::mem::size_of::<Ctrl>() == CTRL_BYTES);
const _: () = assert!(std::mem::size_of::<Desc>() == 64);
const _: () = assert!(std::mem::size_of::<Header>() <= HEADER_BYTES);

/// The control lines of one ordered pair's mailbox (a byte stream from `src` to `dst`, see
/// `shm::p2p`): the sender's line, the receiver's, and the sender's inline box.
#[repr(C, align(64))]
pub(crate) struct PairCtrl {
    /// Stream bytes the sender has written (monotonic).
    pub sent: AtomicU64,
    _pad0: [u8; 56],
    /// Stream bytes the receiver has consumed (monotonic).
    pub taken: AtomicU64,
    /// Number of the last message the receiver has matched against its recv (for a message read
    /// directly from the sender's memory, or one it refused to read so, once its data is in).
    pub matched: AtomicU64,
    /// 0, or the number of the first message whose recv disagreed (the pair is then unusable).
    pub bad: AtomicU64,
    /// What that recv expected: dtype code and element count.
    pub bad_dtype: AtomicU64,
    pub bad_count: AtomicU64,
    /// Number of the last message the receiver could not read directly from the sender's memory
    /// (cross-memory attach refused): the sender then streams its data through the ring.
    pub nack: AtomicU64,
    _pad1: [u8; 16],
    /// A small message in one cache line, so that it crosses between cores in one transfer.
    pub inline: InlineBox,
}

/// One small message (at most [`INLINE_BOX_BYTES`]) from the sender: `msg` is stored last (release), so
/// a receiver that sees its number sees the rest. The sender reuses it once the receiver has
/// matched that number.
#[repr(C, align(64))]
pub(crate) struct InlineBox {
    /// Number of the message in the box (0: none yet).
    pub msg: AtomicU64,
    pub dtype: AtomicU64,
    pub count: AtomicU64,
    /// The data, little-endian bytes in words.
    pub data: [AtomicU64; 5],
}

/// The head of a rank's inline entry for collective number `seq` (one of two, by the parity of
/// `seq`). The owner writes the other fields and the payload after it, then `seq` (release; it
/// checks for sleepers after its wait, behind a fence, see `Channel::wait_published`); a peer
/// that reads `seq` equal to the call's number (acquire) may read the rest. The owner rewrites an
/// entry only two collectives later, after every peer has arrived at the collective in between
/// (each collective waits for every rank), so by then nobody reads it.
#[repr(C)]
pub(crate) struct InlineHdr {
    pub seq: AtomicU64,
    pub kind: u8,
    pub dtype: u8,
    pub op: u8,
    /// [`FINITE`] when the rank runs the finite check, else 0.
    pub flags: u8,
    pub root: u32,
    pub count: u64,
}

/// Bytes before a inline entry's payload.
pub(crate) const INLINE_HDR: usize = std::mem::size_of::<InlineHdr>();
/// Largest payload of a inline entry (the largest threshold `fast_bytes` may have).
pub(crate) const INLINE_MAX: usize = 4096;
/// Bytes of one inline entry: head and payload, whole cache lines.
pub(crate) const INLINE_ENTRY: usize = (INLINE_HDR + INLINE_MAX).next_multiple_of(64);
const _: () = assert!(INLINE_HDR == 24);

/// Largest message the inline box carries.
pub(crate) const INLINE_BOX_BYTES: usize = 40;

/// Bytes of a pair's control lines.
pub(crate) const PAIR_CTRL_BYTES: usize = 192;
const _: () = assert!(std::mem::size_of::<PairCtrl>() == PAIR_CTRL_BYTES);

/// Mailbox bytes per ordered pair: up to 64 KiB (and a slot), less for large worlds so all
/// mailboxes together stay within 64 MiB, but never under 256 bytes.
fn mbox_bytes(world: usize, slot_bytes: usize) -> usize {
    let budget = (64usize << 20) / world.saturating_mul(world).max(1);
    (budget.min(64 << 10).min(slot_bytes) / 64 * 64).max(256)
}

/// Byte offsets of the segment's regions for a world size and sizes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Layout {
    pub world: usize,
    pub slot_bytes: usize,
    pub heap_bytes: usize,
    pub slots_off: usize,
    /// Start of the inline entries (world × 2 × [`INLINE_ENTRY`]).
    pub inline_off: usize,
    /// Start of the point-to-point mailboxes and the ring bytes of each.
    pub p2p_off: usize,
    pub mbox_bytes: usize,
    pub heaps_off: usize,
    pub total: usize,
}

impl Layout {
    pub(crate) fn new(
        world: usize,
        slot_bytes: usize,
        heap_bytes: usize,
    ) -> Result<Layout, crate::comm::CommError> {
        let too_big = || {
            crate::comm::CommError::Setup(format!(
                "a segment for {world} ranks with {slot_bytes}-byte slots and {heap_bytes}-byte heaps does not fit the address space; lower LOCKSTEP_SHM_HEAP_BYTES"
            ))
        };
        let slots_off = (HEADER_BYTES + world * CTRL_BYTES).next_multiple_of(4096);
        let slots = world
            .checked_mul(2)
            .and_then(|v| v.checked_mul(slot_bytes))
            .ok_or_else(too_big)?;
        let inline_off = slots_off.checked_add(slots).ok_or_else(too_big)?;
        let inline = world.checked_mul(2 * INLINE_ENTRY).ok_or_else(too_big)?;
        let p2p_off = inline_off
            .checked_add(inline)
            .ok_or_else(too_big)?
            .next_multiple_of(4096);
        let mbox_bytes = mbox_bytes(world, slot_bytes);
        let mboxes = world
            .checked_mul(world)
            .and_then(|p| p.checked_mul(PAIR_CTRL_BYTES + mbox_bytes))
            .ok_or_else(too_big)?;
        let heaps_off = p2p_off
            .checked_add(mboxes)
            .ok_or_else(too_big)?
            .next_multiple_of(2 << 20);
        let total = world
            .checked_mul(heap_bytes)
            .and_then(|h| h.checked_add(heaps_off))
            .filter(|t| *t < 1 << 46)
            .ok_or_else(too_big)?;
        Ok(Layout {
            world,
            slot_bytes,
            heap_bytes,
            slots_off,
            inline_off,
            p2p_off,
            mbox_bytes,
            heaps_off,
            total,
        })
    }

    /// Bytes from the start that collectives and point-to-point calls may touch whatever the
    /// user allocates: header, control blocks, slots and mailboxes. Checked (or reserved) at
    /// creation, backed by parts as they are first used; the heaps, sized generously, are
    /// reserved per buffer.
    pub(crate) fn backed(&self) -> usize {
        self.p2p_off + self.world * self.world * (PAIR_CTRL_BYTES + self.mbox_bytes)
    }

    pub(crate) fn ctrl_off(&self, rank: usize) -> usize {
        HEADER_BYTES + rank * CTRL_BYTES
    }

    pub(crate) fn slot_off(&self, rank: usize, parity: u64) -> usize {
        self.slots_off + (rank * 2 + (parity % 2) as usize) * self.slot_bytes
    }

    /// Offset of rank `rank`'s inline entry for collective number `seq` (by parity).
    pub(crate) fn inline_entry_off(&self, rank: usize, seq: u64) -> usize {
        self.inline_off + (rank * 2 + (seq % 2) as usize) * INLINE_ENTRY
    }

    /// Offset of the mailbox from `src` to `dst`: its [`PairCtrl`], then `mbox_bytes` of ring.
    pub(crate) fn pair_off(&self, src: usize, dst: usize) -> usize {
        self.p2p_off + (src * self.world + dst) * (PAIR_CTRL_BYTES + self.mbox_bytes)
    }

    pub(crate) fn heap_off(&self, rank: usize) -> usize {
        self.heaps_off + rank * self.heap_bytes
    }
}
