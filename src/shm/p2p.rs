//! Point-to-point sends and receives through the per-ordered-pair mailboxes of the segment (see
//! [`sync`](crate::shm::sync)), apart from the slots and phases of the collectives.
//!
//! Each mailbox is a single-producer, single-consumer byte stream through a ring: the sender
//! publishes how many stream bytes it has written (`sent`), the receiver how many it has consumed
//! (`taken`). A message is a 64-byte header (number, dtype, count) followed by its data, padded
//! to 64 bytes. The receiver matches the header against its own recv and publishes the verdict
//! (`matched`, or `bad` with what it expected), so a disagreement is a `Mismatch` on both sides
//! and makes that pair unusable. A send completes once all its data is in the stream and its
//! header is matched; a recv once it has copied all the data out. Messages larger than the ring
//! stream through it while the receiver takes them.
//!
//! Two shortcuts, chosen by the sender per message (message numbers keep them in order):
//! * **Fast box** (at most [`INLINE_BOX_BYTES`]): header and data in one cache line of the pair's
//!   control block, so a small message crosses between cores in one transfer (the latency path).
//! * **Cross-memory copy (CMA)** (at least `ShmConfig::cma_bytes`): only a header goes into the ring, naming
//!   the sender's pid and buffer; the receiver copies the data once, straight from the sender's
//!   memory (`process_vm_readv`), then matches the message. If the kernel refuses, the receiver
//!   says so (`nack`) and the sender streams the data through the ring as usual.
//!
//! A group's operations are progressed together by one loop that never blocks on a single
//! operation, so any set of operations whose sends and receives match completes. Operations on
//! the same ordered pair run in the order they were posted.
//!
//! A receive from any source ([`ANY_SOURCE`]) looks, while unmatched, at the mailboxes from every
//! other rank, in turn from the one after the rank it last took a message from (so none is
//! favoured), and takes the first message that has arrived on a pair whose stream no earlier
//! receive of the group holds; from then on it is a receive from that rank, header check and
//! all. While it finds none, the receives posted after it wait: any message they could take, it
//! could take too, and MPI gives a message to the earliest receive that matches it. Ranks that
//! are gone stop being candidates; once every other rank is gone, the receive fails.

use std::sync::atomic::Ordering::{Acquire, Relaxed, SeqCst};
use std::time::{Duration, Instant};

use crate::comm::{CollKind, CommError, Dtype, P2pOp, ANY_SOURCE};
use crate::shm::channel::Channel;
use crate::shm::cma::{self, allow_sibling_reads, pid_namespace};
use crate::shm::reduce::copy_block;
use crate::shm::segment::futex_wait;
use crate::shm::sync::{PairCtrl, INLINE_BOX_BYTES, PAIR_CTRL_BYTES};

/// Bytes of a message header in the stream.
const HDR: u64 = 64;

/// Header flag: the data is not in the stream; read it from `pid`'s memory at `addr`.
const CMA: u64 = 1;

#[repr(C)]
#[derive(Clone, Copy)]
struct MsgHeader {
    msg: u64,
    dtype: u64,
    count: u64,
    flags: u64,
    /// Direct copy: the sender's pid, its pid namespace (inode) and the buffer's address.
    pid: u64,
    pidns: u64,
    addr: u64,
    _pad: u64,
}
const _: () = assert!(std::mem::size_of::<MsgHeader>() == HDR as usize);

/// This rank's position in every pair's stream (only this rank sends on (me, j) and receives on
/// (j, me), so these live in the process), and scratch reused by every call.
#[derive(Debug)]
pub(crate) struct P2p {
    send_pos: Vec<u64>,
    send_msgs: Vec<u64>,
    recv_pos: Vec<u64>,
    recv_msgs: Vec<u64>,
    /// Number of the last message sent through each peer's inline box.
    inline_last: Vec<u64>,
    /// Peers whose receiver refused a cross-memory copy: later large messages to them are streamed.
    no_cma: Vec<bool>,
    /// Direct copies are on (config) and this process's identity for them.
    cma_min: usize,
    pid: u64,
    pidns: u64,
    /// Receivers refuse cross-memory copies (fault injection, `ShmConfig::fault_refuse_direct`).
    refuse_cma: bool,
    st: Vec<OpState>,
    front_send: Vec<bool>,
    front_recv: Vec<bool>,
    /// Mailboxes this rank has mapped: to each peer (sends) and from each peer (receives).
    mapped_send: Vec<bool>,
    mapped_recv: Vec<bool>,
    /// Where a receive from any source starts looking: the rank after the one whose message the
    /// last such receive took.
    any_next: usize,
}

#[derive(Debug, Clone, Copy)]
struct OpState {
    op: P2pOp,
    bytes: usize,
    /// Header written (send) or matched (recv), with this message number.
    msg: Option<u64>,
    /// Data bytes written or copied so far.
    done: usize,
    /// Send: all data is in the stream, the inline box, or offered for a cross-memory copy (waiting for
    /// the match).
    streamed: bool,
    /// Send: offered for a cross-memory copy (waiting for the copy, or a refusal).
    cma: bool,
    finished: bool,
}

impl OpState {
    /// Move this message's payload through a peer's ring, the one loop of both ends: the stream is
    /// at `*pos` in a ring of `cap` bytes, and may advance up to `end` (the sender: the space the
    /// receiver released; the receiver: what the sender published). `copy(at, done, len)` moves
    /// `len` bytes between ring offset `at` and payload offset `done`, in pieces that neither wrap
    /// around the ring nor pass `end` or the payload's end. Once the payload is all through,
    /// `*pos` moves on to the next header's 64-byte boundary, as both ends count it. Returns
    /// whether anything moved.
    fn stream(
        &mut self,
        pos: &mut u64,
        cap: u64,
        end: u64,
        mut copy: impl FnMut(usize, usize, usize),
    ) -> bool {
        let mut moved = false;
        while self.done < self.bytes {
            let room = end.saturating_sub(*pos);
            if room == 0 {
                break;
            }
            let at = *pos % cap;
            let len = (room as usize)
                .min(self.bytes - self.done)
                .min((cap - at) as usize);
            copy(at as usize, self.done, len);
            *pos += len as u64;
            self.done += len;
            moved = true;
        }
        if self.done == self.bytes {
            *pos = pos.next_multiple_of(HDR);
        }
        moved
    }
}

impl P2p {
    pub(crate) fn new(world: usize, cma_min: usize, refuse_cma: bool) -> P2p {
        if cma_min > 0 && world > 1 {
            allow_sibling_reads();
        }
        P2p {
            send_pos: vec![0; world],
            send_msgs: vec![0; world],
            recv_pos: vec![0; world],
            recv_msgs: vec![0; world],
            inline_last: vec![0; world],
            no_cma: vec![false; world],
            cma_min: if cma_min == 0 { usize::MAX } else { cma_min },
            pid: std::process::id() as u64,
            pidns: pid_namespace(),
            refuse_cma,
            st: Vec::new(),
            front_send: vec![false; world],
            front_recv: vec![false; world],
            mapped_send: vec![false; world],
            mapped_recv: vec![false; world],
            any_next: 0,
        }
    }

    /// Map the mailboxes `ops` use that this rank has not used yet, control lines and ring
    /// (allocating their pages in a named segment, see `shm::bootstrap::reserve_backed`): both
    /// ends of a pair do so before touching it, so neither can meet a SIGBUS, and a job that sends
    /// nothing point-to-point maps no mailbox.
    fn map_mailboxes(&mut self, ch: &Channel, ops: &[P2pOp]) -> Result<(), CommError> {
        let me = ch.rank();
        for o in ops {
            match o.kind {
                CollKind::Send => self.map_mailbox(ch, true, o.peer)?,
                // A receive from any source may take a message from any other rank.
                _ if o.peer == ANY_SOURCE => {
                    for j in (0..ch.world()).filter(|&j| j != me) {
                        self.map_mailbox(ch, false, j)?;
                    }
                }
                _ => self.map_mailbox(ch, false, o.peer)?,
            }
        }
        Ok(())
    }

    /// Map the mailbox to `peer` (`send`) or from it, unless this rank has already.
    fn map_mailbox(&mut self, ch: &Channel, send: bool, peer: usize) -> Result<(), CommError> {
        let me = ch.rank();
        let (mapped, src, dst) = if send {
            (&mut self.mapped_send[peer], me, peer)
        } else {
            (&mut self.mapped_recv[peer], peer, me)
        };
        if *mapped {
            return Ok(());
        }
        let l = ch.layout();
        ch.seg()
            .populate(l.pair_off(src, dst), PAIR_CTRL_BYTES + l.mbox_bytes)
            .map_err(|e| {
                crate::shm::segment::no_room_now(
                    &e,
                    &format!(
                        "the mailbox from {} to {} and its control lines",
                        ch.who(src),
                        ch.who(dst)
                    ),
                )
            })?;
        *mapped = true;
        Ok(())
    }

    /// Run a group of operations (checked locally: peers in range or, for receives, any source;
    /// host buffers) to completion. A mismatch fails its own operation while the others go on;
    /// the first error is returned. A lost peer or a timeout ends the group at once. Each receive
    /// from any source that matched gets its sender's rank in `peer`.
    pub(crate) fn run(&mut self, ch: &Channel, ops: &mut [P2pOp]) -> Result<(), CommError> {
        self.map_mailboxes(ch, ops)?;
        let mut st = std::mem::take(&mut self.st);
        st.clear();
        st.extend(ops.iter().map(|&op| OpState {
            op,
            bytes: op.mem.len * op.dtype.size(),
            msg: None,
            done: 0,
            streamed: false,
            cma: false,
            finished: false,
        }));
        let r = self.progress(ch, &mut st);
        for (o, s) in ops.iter_mut().zip(&st) {
            o.peer = s.op.peer;
        }
        self.st = st;
        r
    }

    fn progress(&mut self, ch: &Channel, st: &mut [OpState]) -> Result<(), CommError> {
        let mut first_err: Option<CommError> = None;
        let mut waiter = Waiter::new();
        loop {
            let fp = if waiter.sleepy() {
                fingerprint(ch, st)
            } else {
                0
            };
            self.front_send.iter_mut().for_each(|f| *f = false);
            self.front_recv.iter_mut().for_each(|f| *f = false);
            let mut progressed = false;
            let mut pending = false;
            for s in st.iter_mut().filter(|s| !s.finished) {
                let peer = s.op.peer;
                let r = match s.op.kind {
                    CollKind::Send if s.streamed => self.check_ack(ch, s),
                    CollKind::Send if !self.front_send[peer] => {
                        self.front_send[peer] = true;
                        self.step_send(ch, s)
                    }
                    CollKind::Recv if peer == ANY_SOURCE => self.step_any(ch, s),
                    CollKind::Recv if !self.front_recv[peer] => {
                        self.front_recv[peer] = true;
                        self.step_recv(ch, s)
                    }
                    _ => Ok(false),
                };
                match r {
                    Ok(p) => progressed |= p,
                    Err(e @ CommError::Mismatch { .. }) => {
                        s.finished = true;
                        progressed = true;
                        first_err.get_or_insert(e);
                    }
                    Err(e) => return Err(e),
                }
                pending |= !s.finished;
            }
            if !pending {
                return first_err.map_or(Ok(()), Err);
            }
            if progressed {
                waiter.reset();
            } else {
                waiter.idle(ch, st, fp)?;
            }
        }
    }

    fn step_send(&mut self, ch: &Channel, s: &mut OpState) -> Result<bool, CommError> {
        let (me, peer) = (ch.rank(), s.op.peer);
        let (pc, ring, cap) = pair(ch, me, peer);
        if pc.bad.load(Acquire) != 0 {
            return Err(mismatch(ch, pc, me, peer, s));
        }
        if s.msg.is_none()
            && s.bytes <= INLINE_BOX_BYTES
            && self.inline_last[peer] <= pc.matched.load(Acquire)
        {
            // The inline box is free (its last message was matched): the whole message goes there.
            self.send_msgs[peer] += 1;
            let k = self.send_msgs[peer];
            let fb = &pc.inline;
            fb.dtype.store(s.op.dtype as u64, Relaxed);
            fb.count.store(s.op.mem.len as u64, Relaxed);
            let mut words = [0u64; INLINE_BOX_BYTES / 8];
            // SAFETY: `bytes` <= INLINE_BOX_BYTES bytes of the send buffer are readable (its length)
            // and fit in `words`.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    s.op.mem.addr as *const u8,
                    words.as_mut_ptr() as *mut u8,
                    s.bytes,
                )
            };
            for (slot, w) in fb.data.iter().zip(words) {
                slot.store(w, Relaxed);
            }
            // Last, and sequentially consistent for the sleepers' handshake (see `Waiter`).
            fb.msg.store(k, SeqCst);
            self.inline_last[peer] = k;
            s.msg = Some(k);
            s.streamed = true;
            ch.wake_sleepers();
            self.check_ack(ch, s)?;
            return Ok(true);
        }
        let taken = pc.taken.load(Acquire);
        let pos = &mut self.send_pos[peer];
        let mut moved = false;
        if s.msg.is_none() {
            if *pos + HDR > taken + cap {
                return Ok(false);
            }
            self.send_msgs[peer] += 1;
            let k = self.send_msgs[peer];
            let cma = s.bytes >= self.cma_min && !self.no_cma[peer];
            let h = MsgHeader {
                msg: k,
                dtype: s.op.dtype as u64,
                count: s.op.mem.len as u64,
                flags: if cma { CMA } else { 0 },
                pid: self.pid,
                pidns: self.pidns,
                addr: s.op.mem.addr as u64,
                _pad: 0,
            };
            // SAFETY: `pos % cap` is a multiple of 64 (headers and padding keep it so, and cap is
            // a multiple of 64), so the header lies inside the ring, 64-aligned, in space the
            // receiver has released (pos + HDR <= taken + cap).
            unsafe { std::ptr::write(ring.add((*pos % cap) as usize) as *mut MsgHeader, h) };
            *pos += HDR;
            s.msg = Some(k);
            moved = true;
            if cma {
                // The receiver copies the data itself; the send waits for its match (or refusal).
                s.cma = true;
                s.streamed = true;
                pc.sent.store(*pos, SeqCst);
                ch.wake_sleepers();
                self.check_ack(ch, s)?;
                return Ok(true);
            }
        }
        let src = s.op.mem.addr as *const u8;
        // The receiver has released the ring up to `taken`: the window ends a ring ahead of it.
        moved |= s.stream(pos, cap, taken + cap, |at, done, len| {
            // SAFETY: [done, done+len) lies in the send buffer (bytes = its length); the ring
            // range [at, at+len) is inside the ring and released by the receiver (the window).
            unsafe { copy_block(src.add(done), ring.add(at), len, false) }
        });
        s.streamed |= s.done == s.bytes;
        if moved {
            pc.sent.store(*pos, SeqCst);
            ch.wake_sleepers();
        }
        if s.streamed {
            self.check_ack(ch, s)?;
        }
        Ok(moved)
    }

    /// A send whose data is placed completes once the receiver has matched its header; a direct
    /// copy the receiver refused goes back to streaming.
    fn check_ack(&mut self, ch: &Channel, s: &mut OpState) -> Result<bool, CommError> {
        let (me, peer) = (ch.rank(), s.op.peer);
        let (pc, _, _) = pair(ch, me, peer);
        if pc.bad.load(Acquire) != 0 {
            return Err(mismatch(ch, pc, me, peer, s));
        }
        let Some(k) = s.msg else { return Ok(false) };
        if s.cma && pc.nack.load(Acquire) >= k {
            tracing::debug!("rank {peer} cannot read this rank's memory directly: large messages to it go through the mailbox");
            self.no_cma[peer] = true;
            s.cma = false;
            s.streamed = false;
            return self.step_send(ch, s).map(|_| true);
        }
        if pc.matched.load(Acquire) >= k {
            // A receiver that disagrees publishes `bad` before `matched` (see `check_header`),
            // so `bad` may have been read above before it was set: read it again now that
            // `matched` covers this message. Without this the send could succeed while its
            // recv reports the mismatch (seen about once in 30 runs of the p2p_group case of
            // tests/shm_p2p.rs's mismatch test).
            if pc.bad.load(Acquire) != 0 {
                return Err(mismatch(ch, pc, me, peer, s));
            }
            s.finished = true;
            return Ok(true);
        }
        Ok(false)
    }

    /// A receive from any source, not matched yet: take the next message of the first rank (in
    /// turn from `any_next`) whose message has arrived and whose stream no receive posted before
    /// this one holds; the receive is one from that rank from then on. If no message has
    /// arrived, the receives posted after this one wait (see the module's description).
    fn step_any(&mut self, ch: &Channel, s: &mut OpState) -> Result<bool, CommError> {
        let (me, n) = (ch.rank(), ch.world());
        let from = (0..n)
            .map(|i| (self.any_next + i) % n)
            .find(|&j| j != me && !self.front_recv[j] && self.arrived(ch, j));
        let Some(j) = from else {
            for (j, f) in self.front_recv.iter_mut().enumerate() {
                *f |= j != me;
            }
            return Ok(false);
        };
        self.any_next = (j + 1) % n;
        self.front_recv[j] = true;
        s.op.peer = j;
        // The message has arrived, so this matches it (or finds the mismatch): `sent` and the
        // inline box only grow, and only this rank marks the pair bad.
        self.step_recv(ch, s)
    }

    /// Whether the next message from `j` to this rank has arrived (its header is in the inline box
    /// or the ring), on a pair no mismatch has made unusable.
    fn arrived(&self, ch: &Channel, j: usize) -> bool {
        let (pc, _, _) = pair(ch, j, ch.rank());
        if pc.bad.load(Acquire) != 0 {
            return false;
        }
        // `sent` first, as in `step_recv`.
        let sent = pc.sent.load(Acquire);
        pc.inline.msg.load(Acquire) == self.recv_msgs[j] + 1 || sent >= self.recv_pos[j] + HDR
    }

    fn step_recv(&mut self, ch: &Channel, s: &mut OpState) -> Result<bool, CommError> {
        let (me, peer) = (ch.rank(), s.op.peer);
        let (pc, ring, cap) = pair(ch, peer, me);
        if pc.bad.load(Acquire) != 0 {
            return Err(mismatch(ch, pc, peer, me, s));
        }
        // `sent` first: a later message visible in the ring makes an earlier one in the inline box
        // visible too (the sender published the box before it).
        let sent = pc.sent.load(Acquire);
        let pos = &mut self.recv_pos[peer];
        let mut moved = false;
        if s.msg.is_none() {
            let k = self.recv_msgs[peer] + 1;
            let fb = &pc.inline;
            if fb.msg.load(Acquire) == k {
                self.recv_msgs[peer] = k;
                s.msg = Some(k);
                let (dtype, count) = (fb.dtype.load(Relaxed), fb.count.load(Relaxed));
                if let Some(e) = check_header(ch, pc, peer, me, k, dtype, count, s) {
                    return Err(e);
                }
                let mut words = [0u64; INLINE_BOX_BYTES / 8];
                for (w, slot) in words.iter_mut().zip(&fb.data) {
                    *w = slot.load(Relaxed);
                }
                // SAFETY: the receive buffer holds `bytes` (<= INLINE_BOX_BYTES, as the sender's count
                // equals ours) writable bytes.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        words.as_ptr() as *const u8,
                        s.op.mem.addr as *mut u8,
                        s.bytes,
                    )
                };
                s.finished = true;
                pc.matched.store(k, SeqCst);
                ch.wake_sleepers();
                return Ok(true);
            }
            if sent < *pos + HDR {
                return Ok(false);
            }
            // SAFETY: the sender wrote this header before publishing `sent` >= pos + HDR (acquire
            // above); it is 64-aligned inside the ring (see step_send).
            let h = unsafe { std::ptr::read(ring.add((*pos % cap) as usize) as *const MsgHeader) };
            self.recv_msgs[peer] = k;
            s.msg = Some(k);
            let count = if h.msg == k { h.count } else { u64::MAX };
            if let Some(e) = check_header(ch, pc, peer, me, k, h.dtype, count, s) {
                return Err(e);
            }
            *pos += HDR;
            if h.flags & CMA != 0 {
                if h.pidns == self.pidns
                    && !self.refuse_cma
                    && cma::read(h.pid, h.addr, s.op.mem.addr, s.bytes)
                {
                    s.done = s.bytes;
                    s.finished = true;
                    pc.taken.store(*pos, SeqCst);
                    pc.matched.store(k, SeqCst);
                    ch.wake_sleepers();
                    return Ok(true);
                }
                // Refused: the sender streams the data after this header; the match is
                // published once it is all in.
                pc.taken.store(*pos, SeqCst);
                pc.nack.store(k, SeqCst);
                ch.wake_sleepers();
                s.cma = true;
                return Ok(true);
            }
            pc.matched.store(k, SeqCst);
            moved = true;
        }
        let dst = s.op.mem.addr as *mut u8;
        // The sender has published the stream up to `sent`: the window ends there.
        moved |= s.stream(pos, cap, sent, |at, done, len| {
            // SAFETY: the sender wrote ring range [at, at+len) of the stream before publishing
            // `sent` (the window); [done, done+len) lies in the receive buffer.
            unsafe { copy_block(ring.add(at), dst.add(done), len, false) }
        });
        s.finished |= s.done == s.bytes;
        if moved {
            pc.taken.store(*pos, SeqCst);
            if s.finished && s.cma {
                pc.matched.store(s.msg.unwrap_or(0), SeqCst);
            }
            ch.wake_sleepers();
        }
        Ok(moved)
    }
}

/// Match message `k`'s header (dtype, count; `count` = u64::MAX for a message out of order)
/// against the recv; on a disagreement, publish it (the pair becomes unusable) and return the
/// error.
#[allow(clippy::too_many_arguments)]
fn check_header(
    ch: &Channel,
    pc: &PairCtrl,
    peer: usize,
    me: usize,
    k: u64,
    dtype: u64,
    count: u64,
    s: &OpState,
) -> Option<CommError> {
    if dtype == s.op.dtype as u64 && count == s.op.mem.len as u64 {
        return None;
    }
    pc.bad_dtype.store(s.op.dtype as u64, Relaxed);
    pc.bad_count.store(s.op.mem.len as u64, Relaxed);
    pc.bad.store(k, SeqCst);
    pc.matched.store(k, SeqCst);
    ch.wake_sleepers();
    let dt = Dtype::from_u8(dtype as u8).map_or("?", |d| d.name());
    let (peer, me) = (ch.who(peer), ch.who(me));
    Some(CommError::Mismatch {
        seq: k,
        detail: format!(
            "point-to-point message #{k} from {peer} to {me} is send(count={count}, dtype={dt}) but the matching recv on {me} is recv(count={}, dtype={}); a send and the recv it matches (in order, per pair of ranks) must agree, and this pair of ranks cannot exchange messages any more",
            s.op.mem.len,
            s.op.dtype
        ),
    })
}

/// The mailbox from `src` to `dst`: its control lines, ring and ring size.
fn pair(ch: &Channel, src: usize, dst: usize) -> (&PairCtrl, *mut u8, u64) {
    let l = ch.layout();
    // SAFETY: the layout puts world × world mailboxes inside the mapping, each a 64-aligned
    // PairCtrl (atomics only) followed by `mbox_bytes` of ring.
    unsafe {
        let base = ch.seg().base().add(l.pair_off(src, dst));
        (
            &*(base as *const PairCtrl),
            base.add(PAIR_CTRL_BYTES),
            l.mbox_bytes as u64,
        )
    }
}

/// The error of an operation on a pair whose receiver found a disagreement.
fn mismatch(ch: &Channel, pc: &PairCtrl, src: usize, dst: usize, s: &OpState) -> CommError {
    let bad = pc.bad.load(Acquire);
    let (src, dst) = (ch.who(src), ch.who(dst));
    if s.op.kind == CollKind::Send && s.msg == Some(bad) {
        let dt = Dtype::from_u8(pc.bad_dtype.load(Relaxed) as u8).map_or("?", |d| d.name());
        return CommError::Mismatch {
            seq: bad,
            detail: format!(
                "point-to-point message #{bad} from {src} to {dst} is send(count={}, dtype={}) but the matching recv on {dst} is recv(count={}, dtype={dt}); a send and the recv it matches (in order, per pair of ranks) must agree, and this pair of ranks cannot exchange messages any more",
                s.op.mem.len,
                s.op.dtype,
                pc.bad_count.load(Relaxed)
            ),
        };
    }
    CommError::Mismatch {
        seq: bad,
        detail: format!(
            "point-to-point message #{bad} from {src} to {dst} did not match its recv, so this pair of ranks cannot exchange messages any more ({} of {} elements of {} here)",
            s.op.kind, s.op.mem.len, s.op.dtype
        ),
    }
}

/// Sum of the counters the pending operations wait on: it changes whenever one of them may
/// progress (they only grow). An unmatched receive from any source waits on every other rank.
fn fingerprint(ch: &Channel, st: &[OpState]) -> u64 {
    let me = ch.rank();
    st.iter().filter(|s| !s.finished).fold(0u64, |acc, s| {
        if s.op.peer == ANY_SOURCE {
            return (0..ch.world())
                .filter(|&j| j != me)
                .fold(acc, |a, j| a.wrapping_add(counters(ch, j, me)));
        }
        let (src, dst) = if s.op.kind == CollKind::Send {
            (me, s.op.peer)
        } else {
            (s.op.peer, me)
        };
        acc.wrapping_add(counters(ch, src, dst))
    })
}

/// Sum of the counters of the mailbox from `src` to `dst`.
fn counters(ch: &Channel, src: usize, dst: usize) -> u64 {
    let (pc, _, _) = pair(ch, src, dst);
    pc.sent
        .load(SeqCst)
        .wrapping_add(pc.taken.load(SeqCst))
        .wrapping_add(pc.matched.load(SeqCst))
        .wrapping_add(pc.bad.load(SeqCst))
        .wrapping_add(pc.nack.load(SeqCst))
        .wrapping_add(pc.inline.msg.load(SeqCst))
}

/// For a receive from any source: the error once every other rank is gone (died, or left the
/// communicator), naming one that died if any did; `None` while one is there.
fn all_gone(ch: &Channel) -> Option<CommError> {
    let me = ch.rank();
    let mut gone = Vec::new();
    for j in (0..ch.world()).filter(|&j| j != me) {
        gone.push((j, ch.peer_gone(j)?));
    }
    let &(r, died) = gone.iter().find(|g| g.1).or(gone.last())?;
    let mut e = ch.peer_lost(r, died, CollKind::Recv, 0);
    if let CommError::PeerLost { group, .. } = &mut e {
        group.push_str(&format!(
            " from any source, and no rank that could send is left ({})",
            gone_list(ch, &gone)
        ));
    }
    Some(e)
}

/// `rank 1 died, rank 2 left the communicator`.
fn gone_list(ch: &Channel, gone: &[(usize, bool)]) -> String {
    let how = |died: bool| {
        if died {
            "died"
        } else {
            "left the communicator"
        }
    };
    gone.iter()
        .map(|&(j, died)| format!("{} {}", ch.who(j), how(died)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// What an unmatched receive from any source waits for, for a timeout: the ranks that could
/// still send (global ranks), and those that are gone.
fn any_source_wait(ch: &Channel) -> String {
    let me = ch.rank();
    let (mut live, mut gone) = (Vec::new(), Vec::new());
    for j in (0..ch.world()).filter(|&j| j != me) {
        match ch.peer_gone(j) {
            None => live.push(ch.global(j)),
            Some(died) => gone.push((j, died)),
        }
    }
    let mut m = format!("recv from any source: no message arrived from any of ranks {live:?}");
    if !gone.is_empty() {
        m.push_str(&format!(" ({})", gone_list(ch, &gone)));
    }
    m
}

/// Waiting without progress: spin, yield, then sleep on the header's futex, checking the peers
/// of the pending operations and the timeout.
struct Waiter {
    since: Option<Instant>,
    /// When the peers were last checked (`None`: not yet in this wait).
    last_check: Option<Instant>,
    nap: Duration,
    spins: u32,
    /// A peer found gone on the previous check: fail if another pass makes no progress either
    /// (its last data may still have been on the way).
    gone: Option<CommError>,
}

impl Waiter {
    fn new() -> Waiter {
        Waiter {
            since: None,
            last_check: None,
            nap: Duration::from_micros(500),
            spins: 0,
            gone: None,
        }
    }

    fn reset(&mut self) {
        self.since = None;
        self.spins = 0;
        self.gone = None;
        self.nap = Duration::from_micros(500);
    }

    /// Whether the next idle may sleep (the caller then takes a fingerprint before its pass).
    fn sleepy(&self) -> bool {
        self.since
            .is_some_and(|s| s.elapsed() >= Duration::from_millis(2))
    }

    fn idle(&mut self, ch: &Channel, st: &[OpState], fp: u64) -> Result<(), CommError> {
        if let Some(e) = self.gone.take() {
            return Err(e);
        }
        self.spins = self.spins.wrapping_add(1);
        // The first polls only spin: reading the clock on each would delay noticing the message.
        if self.spins < 64 {
            std::hint::spin_loop();
            return Ok(());
        }
        let start = *self.since.get_or_insert_with(Instant::now);
        let waited = start.elapsed();
        if waited < ch.spin() {
            std::hint::spin_loop();
            return Ok(());
        }
        if waited < Duration::from_millis(2) {
            std::thread::yield_now();
        } else {
            let h = ch.header();
            h.sleepers.0.fetch_add(1, SeqCst);
            let w = h.wake.0.load(SeqCst);
            // Sleep only if nothing changed since the pass began: a publisher that saw no sleeper
            // did its store before our increment, so the fingerprint shows it.
            if fingerprint(ch, st) == fp {
                futex_wait(&h.wake.0, w, self.nap);
                self.nap = (self.nap * 2)
                    .min(Duration::from_millis(20))
                    .min(ch.config().peer_check);
            }
            h.sleepers.0.fetch_sub(1, SeqCst);
        }
        let due = self.last_check.get_or_insert(start).elapsed() >= ch.config().peer_check;
        if due || waited < Duration::from_millis(2) && self.spins.is_multiple_of(64) {
            self.last_check = Some(Instant::now());
            self.check(ch, st, waited)?;
        }
        Ok(())
    }

    fn check(&mut self, ch: &Channel, st: &[OpState], waited: Duration) -> Result<(), CommError> {
        let me = ch.rank();
        let pending = st.iter().filter(|s| !s.finished);
        for s in pending.clone() {
            if s.op.peer == ANY_SOURCE {
                // Waits on as long as one rank that could send is there.
                if let Some(e) = all_gone(ch) {
                    self.gone = Some(e);
                    return Ok(());
                }
                continue;
            }
            if let Some(died) = ch.peer_gone(s.op.peer) {
                self.gone = Some(ch.peer_lost(s.op.peer, died, s.op.kind, s.msg.unwrap_or(0)));
                return Ok(());
            }
        }
        if waited >= ch.config().timeout {
            let first = st.iter().find(|s| !s.finished);
            let what: Vec<String> = pending
                .map(|s| {
                    if s.op.peer == ANY_SOURCE {
                        return any_source_wait(ch);
                    }
                    let (peer, g) = (ch.who(s.op.peer), ch.global(s.op.peer));
                    match (s.op.kind, s.msg) {
                        (CollKind::Send, None) => format!(
                            "send to {peer}: its mailbox is full (rank {g} is not receiving)"
                        ),
                        (CollKind::Send, Some(k)) => format!(
                            "send #{k} to {peer}: rank {g} has not posted the matching recv"
                        ),
                        (_, None) => format!("recv from {peer}: rank {g} has not sent"),
                        (_, Some(k)) => format!(
                            "recv #{k} from {peer}: {} of {} bytes arrived",
                            s.done, s.bytes
                        ),
                    }
                })
                .collect();
            return Err(CommError::Timeout {
                rank: ch.global(me),
                op: first.map_or(CollKind::Send, |s| s.op.kind),
                seq: first.and_then(|s| s.msg).unwrap_or(0),
                secs: waited.as_secs_f64(),
                detail: format!("waiting on {} for: {}", ch.who(me), what.join("; ")),
                missing: missing_peers(ch, st),
            });
        }
        Ok(())
    }
}

/// The global ranks of the peers whose unfinished operations a point-to-point timeout names (a
/// receive from any source waits for every other rank).
fn missing_peers(ch: &Channel, st: &[OpState]) -> Vec<usize> {
    let me = ch.rank();
    let mut v: Vec<usize> = st
        .iter()
        .filter(|s| !s.finished)
        .flat_map(|s| match s.op.peer {
            ANY_SOURCE => (0..ch.world()).filter(|&r| r != me).collect(),
            peer => vec![peer],
        })
        .map(|r| ch.global(r))
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}
