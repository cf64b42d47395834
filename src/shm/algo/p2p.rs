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
//! A group's operations are progressed together by one loop that never blocks on a single
//! operation, so any set of operations whose sends and receives match completes. Operations on
//! the same ordered pair run in the order they were posted.

use std::sync::atomic::Ordering::{Acquire, Relaxed, SeqCst};
use std::time::{Duration, Instant};

use crate::comm::{CollKind, CommError, Dtype, P2pOp};
use crate::shm::channel::Channel;
use crate::shm::reduce::copy_block;
use crate::shm::segment::futex_wait;
use crate::shm::sync::{PairCtrl, PAIR_CTRL_BYTES};

/// Bytes of a message header in the stream.
const HDR: u64 = 64;

#[repr(C)]
#[derive(Clone, Copy)]
struct MsgHeader {
    msg: u64,
    dtype: u64,
    count: u64,
    _pad: [u64; 5],
}
const _: () = assert!(std::mem::size_of::<MsgHeader>() == HDR as usize);

/// This rank's position in every pair's stream (only this rank sends on (me, j) and receives on
/// (j, me), so these live in the process).
#[derive(Debug)]
pub(crate) struct P2p {
    send_pos: Vec<u64>,
    send_msgs: Vec<u64>,
    recv_pos: Vec<u64>,
    recv_msgs: Vec<u64>,
}

struct OpState {
    op: P2pOp,
    bytes: usize,
    /// Header written (send) or matched (recv), with this message number.
    msg: Option<u64>,
    /// Data bytes written or copied so far.
    done: usize,
    /// Send: all data is in the stream (waiting for the match).
    streamed: bool,
    finished: bool,
}

impl P2p {
    pub(crate) fn new(world: usize) -> P2p {
        P2p { send_pos: vec![0; world], send_msgs: vec![0; world], recv_pos: vec![0; world], recv_msgs: vec![0; world] }
    }

    /// Run a group of operations (checked locally: peers in range, host buffers) to completion.
    /// A mismatch fails its own operation while the others go on; the first error is returned.
    /// A lost peer or a timeout ends the group at once.
    pub(crate) fn run(&mut self, ch: &Channel, ops: &[P2pOp]) -> Result<(), CommError> {
        let n = ch.world();
        let mut st: Vec<OpState> = ops
            .iter()
            .map(|&op| OpState { op, bytes: op.mem.len * op.dtype.size(), msg: None, done: 0, streamed: false, finished: false })
            .collect();
        let mut first_err: Option<CommError> = None;
        let mut waiter = Waiter::new();
        let mut front_send = vec![false; n];
        let mut front_recv = vec![false; n];
        loop {
            let fp = if waiter.sleepy() { fingerprint(ch, &st) } else { 0 };
            front_send.iter_mut().for_each(|f| *f = false);
            front_recv.iter_mut().for_each(|f| *f = false);
            let mut progressed = false;
            let mut pending = false;
            for s in st.iter_mut().filter(|s| !s.finished) {
                let peer = s.op.peer;
                let r = match s.op.kind {
                    CollKind::Send if s.streamed => check_ack(ch, s),
                    CollKind::Send if !front_send[peer] => {
                        front_send[peer] = true;
                        self.step_send(ch, s)
                    }
                    CollKind::Recv if !front_recv[peer] => {
                        front_recv[peer] = true;
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
                waiter.idle(ch, &st, fp)?;
            }
        }
    }

    fn step_send(&mut self, ch: &Channel, s: &mut OpState) -> Result<bool, CommError> {
        let (me, peer) = (ch.rank(), s.op.peer);
        let (pc, ring, cap) = pair(ch, me, peer);
        if pc.bad.load(Acquire) != 0 {
            return Err(mismatch(ch, pc, me, peer, s));
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
            let h = MsgHeader { msg: k, dtype: s.op.dtype as u64, count: s.op.mem.len as u64, _pad: [0; 5] };
            // SAFETY: `pos % cap` is a multiple of 64 (headers and padding keep it so, and cap is
            // a multiple of 64), so the header lies inside the ring, 64-aligned, in space the
            // receiver has released (pos + HDR <= taken + cap).
            unsafe { std::ptr::write(ring.add((*pos % cap) as usize) as *mut MsgHeader, h) };
            *pos += HDR;
            s.msg = Some(k);
            moved = true;
        }
        let src = s.op.mem.addr as *const u8;
        while s.done < s.bytes {
            let free = (taken + cap).saturating_sub(*pos);
            if free == 0 {
                break;
            }
            let at = *pos % cap;
            let len = (free as usize).min(s.bytes - s.done).min((cap - at) as usize);
            // SAFETY: [done, done+len) lies in the send buffer (bytes = its length); the ring
            // range [at, at+len) is inside the ring and released by the receiver (free).
            unsafe { copy_block(src.add(s.done), ring.add(at as usize), len, false) };
            *pos += len as u64;
            s.done += len;
            moved = true;
        }
        if s.done == s.bytes {
            *pos = pos.next_multiple_of(HDR);
            s.streamed = true;
        }
        if moved {
            pc.sent.store(*pos, SeqCst);
            ch.wake_sleepers();
        }
        if s.streamed {
            check_ack(ch, s)?;
        }
        Ok(moved)
    }

    fn step_recv(&mut self, ch: &Channel, s: &mut OpState) -> Result<bool, CommError> {
        let (me, peer) = (ch.rank(), s.op.peer);
        let (pc, ring, cap) = pair(ch, peer, me);
        if pc.bad.load(Acquire) != 0 {
            return Err(mismatch(ch, pc, peer, me, s));
        }
        let sent = pc.sent.load(Acquire);
        let pos = &mut self.recv_pos[peer];
        let mut moved = false;
        if s.msg.is_none() {
            if sent < *pos + HDR {
                return Ok(false);
            }
            // SAFETY: the sender wrote this header before publishing `sent` >= pos + HDR (acquire
            // above); it is 64-aligned inside the ring (see step_send).
            let h = unsafe { std::ptr::read(ring.add((*pos % cap) as usize) as *const MsgHeader) };
            self.recv_msgs[peer] += 1;
            let k = self.recv_msgs[peer];
            s.msg = Some(k);
            if h.msg != k || h.dtype != s.op.dtype as u64 || h.count != s.op.mem.len as u64 {
                pc.bad_dtype.store(s.op.dtype as u64, Relaxed);
                pc.bad_count.store(s.op.mem.len as u64, Relaxed);
                pc.bad.store(k, SeqCst);
                pc.matched.store(k, SeqCst);
                ch.wake_sleepers();
                let (dt, count) = (Dtype::from_u8(h.dtype as u8).map_or("?", |d| d.name()), h.count);
                return Err(CommError::Mismatch {
                    seq: k,
                    detail: format!(
                        "point-to-point message #{k} from rank {peer} to rank {me} is send(count={count}, dtype={dt}) but the matching recv on rank {me} is recv(count={}, dtype={}); a send and the recv it matches (in order, per pair of ranks) must agree, and this pair of ranks cannot exchange messages any more",
                        s.op.mem.len,
                        s.op.dtype
                    ),
                });
            }
            pc.matched.store(k, SeqCst);
            *pos += HDR;
            moved = true;
        }
        let dst = s.op.mem.addr as *mut u8;
        while s.done < s.bytes {
            let avail = sent.saturating_sub(*pos);
            if avail == 0 {
                break;
            }
            let at = *pos % cap;
            let len = (avail as usize).min(s.bytes - s.done).min((cap - at) as usize);
            // SAFETY: the sender wrote [pos, pos+len) of the stream before publishing `sent`;
            // [done, done+len) lies in the receive buffer.
            unsafe { copy_block(ring.add(at as usize), dst.add(s.done), len, false) };
            *pos += len as u64;
            s.done += len;
            moved = true;
        }
        if s.done == s.bytes {
            *pos = pos.next_multiple_of(HDR);
            s.finished = true;
        }
        if moved {
            pc.taken.store(*pos, SeqCst);
            ch.wake_sleepers();
        }
        Ok(moved)
    }
}

/// The mailbox from `src` to `dst`: its control lines, ring and ring size.
fn pair(ch: &Channel, src: usize, dst: usize) -> (&PairCtrl, *mut u8, u64) {
    let l = ch.layout();
    // SAFETY: the layout puts world × world mailboxes inside the mapping, each a 64-aligned
    // PairCtrl (atomics only) followed by `mbox_bytes` of ring.
    unsafe {
        let base = ch.seg().base().add(l.pair_off(src, dst));
        (&*(base as *const PairCtrl), base.add(PAIR_CTRL_BYTES), l.mbox_bytes as u64)
    }
}

/// A streamed send completes once the receiver has matched its header.
fn check_ack(ch: &Channel, s: &mut OpState) -> Result<bool, CommError> {
    let (me, peer) = (ch.rank(), s.op.peer);
    let (pc, _, _) = pair(ch, me, peer);
    if pc.bad.load(Acquire) != 0 {
        return Err(mismatch(ch, pc, me, peer, s));
    }
    if s.msg.is_some_and(|k| pc.matched.load(Acquire) >= k) {
        s.finished = true;
        return Ok(true);
    }
    Ok(false)
}

/// The error of an operation on a pair whose receiver found a disagreement.
fn mismatch(ch: &Channel, pc: &PairCtrl, src: usize, dst: usize, s: &OpState) -> CommError {
    let bad = pc.bad.load(Acquire);
    let _ = ch;
    if s.op.kind == CollKind::Send && s.msg == Some(bad) {
        let dt = Dtype::from_u8(pc.bad_dtype.load(Relaxed) as u8).map_or("?", |d| d.name());
        return CommError::Mismatch {
            seq: bad,
            detail: format!(
                "point-to-point message #{bad} from rank {src} to rank {dst} is send(count={}, dtype={}) but the matching recv on rank {dst} is recv(count={}, dtype={dt}); a send and the recv it matches (in order, per pair of ranks) must agree, and this pair of ranks cannot exchange messages any more",
                s.op.mem.len,
                s.op.dtype,
                pc.bad_count.load(Relaxed)
            ),
        };
    }
    CommError::Mismatch {
        seq: bad,
        detail: format!(
            "point-to-point message #{bad} from rank {src} to rank {dst} did not match its recv, so this pair of ranks cannot exchange messages any more ({} of {} elements of {} here)",
            s.op.kind, s.op.mem.len, s.op.dtype
        ),
    }
}

/// Sum of the counters the pending operations wait on: it changes whenever one of them may
/// progress (they only grow).
fn fingerprint(ch: &Channel, st: &[OpState]) -> u64 {
    let me = ch.rank();
    st.iter().filter(|s| !s.finished).fold(0u64, |acc, s| {
        let (src, dst) = if s.op.kind == CollKind::Send { (me, s.op.peer) } else { (s.op.peer, me) };
        let (pc, _, _) = pair(ch, src, dst);
        acc.wrapping_add(pc.sent.load(SeqCst))
            .wrapping_add(pc.taken.load(SeqCst))
            .wrapping_add(pc.matched.load(SeqCst))
            .wrapping_add(pc.bad.load(SeqCst))
    })
}

/// Waiting without progress: spin, yield, then sleep on the header's futex, checking the peers
/// of the pending operations and the timeout.
struct Waiter {
    since: Option<Instant>,
    last_check: Instant,
    nap: Duration,
    spins: u32,
    /// A peer found gone on the previous check: fail if another pass makes no progress either
    /// (its last data may still have been on the way).
    gone: Option<CommError>,
}

impl Waiter {
    fn new() -> Waiter {
        Waiter { since: None, last_check: Instant::now(), nap: Duration::from_micros(500), spins: 0, gone: None }
    }

    fn reset(&mut self) {
        self.since = None;
        self.spins = 0;
        self.gone = None;
        self.nap = Duration::from_micros(500);
    }

    /// Whether the next idle may sleep (the caller then takes a fingerprint before its pass).
    fn sleepy(&self) -> bool {
        self.since.is_some_and(|s| s.elapsed() >= Duration::from_millis(2))
    }

    fn idle(&mut self, ch: &Channel, st: &[OpState], fp: u64) -> Result<(), CommError> {
        if let Some(e) = self.gone.take() {
            return Err(e);
        }
        let start = *self.since.get_or_insert_with(Instant::now);
        self.spins = self.spins.wrapping_add(1);
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
                self.nap = (self.nap * 2).min(Duration::from_millis(20)).min(ch.config().peer_check);
            }
            h.sleepers.0.fetch_sub(1, SeqCst);
        }
        if self.last_check.elapsed() >= ch.config().peer_check || waited < Duration::from_millis(2) && self.spins.is_multiple_of(64) {
            self.last_check = Instant::now();
            self.check(ch, st, waited)?;
        }
        Ok(())
    }

    fn check(&mut self, ch: &Channel, st: &[OpState], waited: Duration) -> Result<(), CommError> {
        let me = ch.rank();
        let pending = st.iter().filter(|s| !s.finished);
        for s in pending.clone() {
            if let Some(died) = ch.peer_gone(s.op.peer) {
                self.gone = Some(CommError::PeerLost {
                    rank: me,
                    lost_rank: s.op.peer,
                    pid: ch.ctrl(s.op.peer).pid.load(Relaxed),
                    how: if died { "died" } else { "left the communicator" },
                    op: s.op.kind,
                    seq: s.msg.unwrap_or(0),
                });
                return Ok(());
            }
        }
        if waited >= ch.config().timeout {
            let first = st.iter().find(|s| !s.finished);
            let what: Vec<String> = pending
                .map(|s| match (s.op.kind, s.msg) {
                    (CollKind::Send, None) => {
                        format!("send to rank {}: its mailbox is full (rank {} is not receiving)", s.op.peer, s.op.peer)
                    }
                    (CollKind::Send, Some(k)) => {
                        format!("send #{k} to rank {}: rank {} has not posted the matching recv", s.op.peer, s.op.peer)
                    }
                    (_, None) => format!("recv from rank {}: rank {} has not sent", s.op.peer, s.op.peer),
                    (_, Some(k)) => format!("recv #{k} from rank {}: {} of {} bytes arrived", s.op.peer, s.done, s.bytes),
                })
                .collect();
            return Err(CommError::Timeout {
                rank: me,
                op: first.map_or(CollKind::Send, |s| s.op.kind),
                seq: first.and_then(|s| s.msg).unwrap_or(0),
                secs: waited.as_secs_f64(),
                detail: format!("waiting on rank {me} for: {}", what.join("; ")),
            });
        }
        Ok(())
    }
}
