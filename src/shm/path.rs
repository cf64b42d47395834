//! Which path a collective takes, decided once for every collective (as NCCL picks an algorithm
//! and a protocol per call before `RunWorkColl` runs it):
//!
//! * [`Path::Inline`]: the call's arguments and its payload travel together in each rank's
//!   inline entry, in one exchange without a phase (`shm::inline`); per-rank payloads up to
//!   `ShmConfig::fast_bytes`, and every barrier.
//! * [`Path::OnePhase`]: all-reduce and reduce up to `ShmConfig::small_bytes`: every rank puts
//!   its whole input in its slot and reduces everything itself, in one phase.
//! * [`Path::Registered`]: every buffer the call needs lies in the segment
//!   (`Communicator::alloc_shared`): peers read and write them directly, no slot.
//! * [`Path::Cma`]: ordinary buffers, one copy straight between the ranks' buffers with
//!   cross-memory attach (`shm::cma`), from `ShmConfig::cma_bytes` and where rank 0's tuner
//!   picks it.
//! * [`Path::Slots`]: everything else: the data goes through the ranks' two slots, chunk by
//!   chunk, with cached or streaming stores as rank 0's tuner picks (`shm::timing`).
//!
//! The first two follow from the call's size alone ([`by_size`]), the same on every rank whose
//! arguments agree. The other three need every rank's buffers: [`negotiate`] runs the first
//! phase, in which every rank publishes its descriptor (where its buffers are, whether it offers
//! a cross-memory copy), and every rank reads the same verdict from the same descriptors.
//!
//! Why a call may run its first phase again: before `begin` each rank guesses the path so that it
//! can already put the call's first chunk in its slot (which saves a phase on the slots path).
//! A rank whose buffers lie in the segment guesses [`Path::Registered`] and puts nothing there; a
//! rank offers a cross-memory copy when rank 0's tuner last picked it for the class. When the
//! descriptors show that the guesses differ (a peer's buffer is ordinary, rank 0 changed its pick,
//! another configuration), nothing has been written into a user buffer yet, so every rank runs the
//! first phase again, following rank 0's pick ([`Attempt::Follow`]), then on the slots
//! ([`Attempt::Slots`]) if they still differ.
//!
//! The cross-memory path also agrees on two outcomes that only it has: its first call on a
//! communicator probes every pair once ([`verified`]: a one-byte read, and a one-byte write of the
//! byte it read back where it was), and a refusal (Yama, seccomp) makes every rank use the slots
//! from then on; and its bodies end with one phase ([`conclude`]) in which a failed copy fails the
//! call on every rank, a dead peer being reported as such (see `gone_peer`).

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use crate::comm::{Call, CollKind, CommError};
use crate::shm::channel::{Channel, Ctx};
use crate::shm::cma::{cma_for, read_io, write_io};
use crate::shm::reduce::Found;
use crate::shm::sync::{Desc, CMA};
use crate::shm::timing::stage_group;
use crate::trace::CallPath;

/// The ways a collective's data can move (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Path {
    /// Arguments and payload in one line per rank, no phase (`shm::inline`).
    Inline,
    /// All-reduce/reduce of a small message: whole inputs through the slots, one phase.
    OnePhase,
    /// Buffers in the segment: peers read and write them directly.
    Registered,
    /// Ordinary buffers, one copy with cross-memory attach.
    Cma,
    /// Ordinary buffers, chunk by chunk through the slots.
    Slots,
}

impl Path {
    /// The flight recorder's name for it.
    pub(crate) fn traced(self) -> CallPath {
        match self {
            Path::Inline => CallPath::Inline,
            Path::OnePhase => CallPath::OnePhase,
            Path::Registered => CallPath::Registered,
            Path::Cma => CallPath::Cma,
            Path::Slots => CallPath::Slots,
        }
    }
}

/// The path that follows from `call`'s size alone, before any phase: [`Path::Inline`],
/// [`Path::OnePhase`], or `None` when the ranks must [`negotiate`].
pub(crate) fn by_size(ch: &Channel, call: &Call) -> Option<Path> {
    if crate::shm::inline::eligible(ch, call) {
        return Some(Path::Inline);
    }
    let reduces = matches!(call.kind, CollKind::AllReduce | CollKind::Reduce);
    (reduces && (call.count * call.dtype.size() <= ch.one_phase_bytes() || ch.world() == 1))
        .then_some(Path::OnePhase)
}

/// Which attempt at a call's first phase this is: a call whose ranks guessed differently runs it
/// again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Attempt {
    /// The first: rank 0's tuner picks, the others guess rank 0's last pick for the class (a
    /// wrong guess costs a second attempt, only when rank 0 changes its pick).
    First,
    /// After the ranks offered a cross-memory copy differently: each follows rank 0's pick,
    /// which all have now seen.
    Follow,
    /// Through the slots: the ranks cannot all take the cross-memory path (buffers in the
    /// segment on some, a refused probe, offers that differed twice), or some guessed a
    /// registered call that is not one.
    Slots,
}

impl Attempt {
    /// The attempt after this one ended with `verdict` (not `No`, and `Yes` only when the probe
    /// was refused).
    fn next(self, verdict: CmaVerdict) -> Attempt {
        match (self, verdict) {
            (Attempt::First, CmaVerdict::Mixed) => Attempt::Follow,
            _ => Attempt::Slots,
        }
    }
}

/// What the descriptors say about the cross-memory path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CmaVerdict {
    /// Nobody offered it.
    No,
    /// Everybody did, from one pid namespace: take it (after the first call's probe).
    Yes,
    /// Some did: every rank runs the first phase again.
    Mixed,
}

/// What a collective tells [`negotiate`] about its call on this rank.
pub(crate) struct Offer<'a> {
    /// Bytes of this rank's send and receive buffers that must lie in its shared heap for the
    /// registered path (0: that buffer does not matter).
    pub send_bytes: usize,
    pub recv_bytes: usize,
    /// The per-rank message size the cross-memory choice judges by; `None` when the collective
    /// has no cross-memory body for this call (a reduce: its non-roots have no output to hold
    /// their reduced part).
    pub cma_size: Option<usize>,
    /// The size rank 0's choice of cached or streaming stores classes the call by.
    pub stores_size: usize,
    /// Whether rank `r`, whose descriptor carries `flags`, takes part in a registered call: the
    /// call is registered when every rank does.
    pub registered: &'a dyn Fn(usize, u8) -> bool,
    /// Whether a rank that would take part in a registered call skips its slot writes before
    /// `begin`, expecting the call to be registered (every rank then runs the first phase again
    /// when some did and the call is not). False where one rank's descriptor decides alone (a
    /// broadcast's root), so nobody guesses wrong.
    pub skip_when_registered: bool,
}

/// The outcome of [`negotiate`]: the path every rank takes, and what its body needs.
pub(crate) struct Agreement {
    /// [`Path::Registered`], [`Path::Cma`] or [`Path::Slots`].
    pub path: Path,
    /// Every rank's descriptor of the first phase.
    pub descs: Vec<Desc>,
    /// The first phase's number: the slots written before `begin` are those of this phase.
    pub phase: u64,
    /// On the slots path, whether the slots are written with streaming stores (rank 0's choice).
    pub streaming: bool,
}

impl Agreement {
    /// The agreement on `path`, recorded as the channel's last path (what the flight recorder
    /// reports for the call) at the one place every path is decided.
    fn reached(
        ch: &mut Channel,
        path: Path,
        descs: Vec<Desc>,
        phase: u64,
        streaming: bool,
    ) -> Self {
        ch.last_path = path.traced();
        Agreement {
            path,
            descs,
            phase,
            streaming,
        }
    }
}

/// Run the call's first phase and agree on its path: registered, cross-memory or slots, as the
/// module docs describe. `prestage(ch, phase, streaming, flags)` writes what this rank puts into
/// its slot of `phase` before `begin` on the slots path (`flags`: this rank's descriptor flags so
/// far), and returns descriptor flags to add; it runs on every attempt that may take the slots
/// path, and writes nothing a later attempt would miss (the slots are rewritten each time).
pub(crate) fn negotiate(
    ch: &mut Channel,
    call: &Call,
    cx: Ctx,
    offer: &Offer,
    prestage: &dyn Fn(&Channel, u64, bool, u8) -> u8,
) -> Result<Agreement, CommError> {
    let (n, me) = (ch.world(), ch.rank());
    let mut attempt = Attempt::First;
    loop {
        let (mut flags, mut so, mut ro) = ch.share_flags(call, offer.send_bytes, offer.recv_bytes);
        let cma = offer
            .cma_size
            .is_some_and(|b| offer_cma(ch, call, b, attempt));
        if cma {
            // Offered buffers are named by their addresses in this rank's own memory.
            (flags, so, ro) = (flags | CMA, call.send.addr as u64, call.recv.addr as u64);
        }
        let phase = ch.next_phase();
        let skip = offer.skip_when_registered
            && attempt == Attempt::First
            && (offer.registered)(me, flags);
        if !cma && !skip {
            let streaming = ch.streaming_pre(call.kind, offer.stores_size);
            flags |= prestage(ch, phase, streaming, flags);
        }
        let (descs, _) = ch.begin(call, flags | ch.streaming_flag(), so, ro, cx)?;
        match cma_verdict(ch, &descs) {
            CmaVerdict::No => {}
            CmaVerdict::Yes if verified(ch, call, &descs, cx)? => {
                return Ok(Agreement::reached(ch, Path::Cma, descs, phase, false));
            }
            // Nothing written yet: the first phase again, following rank 0's pick or on the slots.
            v => {
                attempt = attempt.next(v);
                continue;
            }
        }
        let takes_part = |r: usize| (offer.registered)(r, descs[r].flags);
        let registered = (0..n).all(takes_part);
        if !registered
            && offer.skip_when_registered
            && attempt == Attempt::First
            && (0..n).any(takes_part)
        {
            // Someone skipped its slot writes for a registered call that is not one.
            attempt = Attempt::Slots;
            continue;
        }
        if registered {
            return Ok(Agreement::reached(
                ch,
                Path::Registered,
                descs,
                phase,
                false,
            ));
        }
        // Every rank has arrived: rank 0 times the slots from here (a call of one rank moves
        // nothing worth timing).
        let streaming = ch.streaming_agreed(call.kind, offer.stores_size, &descs, n > 1);
        return Ok(Agreement::reached(ch, Path::Slots, descs, phase, streaming));
    }
}

/// Whether this rank offers its buffers for a cross-memory copy in this call: `bytes` is the
/// per-rank message size the tuner judges by. A rank with either buffer in its shared heap does
/// not offer: shared buffers take the registered path. Where the sizes allow both paths, rank 0's
/// tuner picks one and the others follow (see [`Attempt`]).
fn offer_cma(ch: &mut Channel, call: &Call, bytes: usize, attempt: Attempt) -> bool {
    let esz = call.dtype.size();
    let eligible = attempt != Attempt::Slots
        && ch.world() > 1
        && !ch.cma.refused
        && cma_for(
            bytes,
            ch.config().cma_bytes,
            ch.one_phase_bytes(),
            ch.config().nt_bytes,
        )
        && ch
            .share_flags(call, call.send.len * esz, call.recv.len * esz)
            .0
            == 0;
    let rank0 = ch.rank() == 0;
    ch.timing.cma_offer(
        eligible.then(|| (stage_group(call.kind), bytes)),
        rank0 && attempt == Attempt::First,
    )
}

/// The verdict of every rank's descriptor (the same on every rank: they all read the same
/// ones); for a call that could take either path, every rank also learns rank 0's pick for the
/// class and starts timing the call under the path it takes (see `shm::timing`).
fn cma_verdict(ch: &mut Channel, descs: &[Desc]) -> CmaVerdict {
    let offered = descs.iter().filter(|d| d.flags & CMA != 0).count();
    let v = if offered == 0 {
        CmaVerdict::No
    } else if offered == descs.len() && descs.iter().all(|d| d.pidns == descs[0].pidns) {
        CmaVerdict::Yes
    } else {
        CmaVerdict::Mixed
    };
    ch.timing.cma_seen(
        descs[0].flags & CMA != 0,
        (v != CmaVerdict::Mixed).then_some(v == CmaVerdict::Yes),
    );
    v
}

/// The pid of rank `r`'s process, for the cross-memory calls.
pub(crate) fn pid(ch: &Channel, r: usize) -> u64 {
    ch.ctrl(r).pid.load(Relaxed) as u64
}

/// One phase in which every rank says whether its copies succeeded; returns the first rank whose
/// did not (the same on every rank). Under the finite check the phase also carries each rank's
/// `found` (see `Channel::phase_found`), and returns the first of them.
fn verdicts(
    ch: &mut Channel,
    ok: bool,
    found: Option<Found>,
    cx: Ctx,
) -> Result<(Option<usize>, Option<Found>), CommError> {
    let (n, me) = (ch.world(), ch.rank());
    let p = ch.next_phase();
    // SAFETY: our own slot of the next phase: every peer finished reading it (two phases ago)
    // before publishing the phase we have passed; 8 bytes fit in any slot; nobody reads it
    // before we publish p.
    unsafe { (ch.slot(me, p) as *mut u64).write(ok as u64) };
    let found = if ch.check_finite() {
        ch.phase_found(found, cx)?.1
    } else {
        ch.phase(cx)?;
        None
    };
    // SAFETY: every rank wrote its verdict in its slot of phase p before publishing it, and
    // writes that slot again only after everyone has published p + 1.
    let failed = (0..n).find(|&r| unsafe { (ch.slot(r, p) as *const u64).read() } != 1);
    Ok((failed, found))
}

/// First cross-memory call on this communicator: every rank reads one byte of each peer's
/// offered buffer, and writes one byte of the peer's output back as it read it, and all agree on
/// the outcome. False (for good, on every rank) when a copy was refused.
///
/// Why both directions, whatever this call does: a seccomp filter may allow one of the two
/// system calls and not the other, and a later call of another kind may need the other. The
/// write puts back the value just read, while no rank writes that byte (data moves only after
/// the verdict), so the output is unchanged.
fn verified(ch: &mut Channel, call: &Call, descs: &[Desc], cx: Ctx) -> Result<bool, CommError> {
    if ch.cma.verified {
        return Ok(true);
    }
    let me = ch.rank();
    let mut ok = !ch.config().fault_refuse_direct;
    let mut probe = 0u8;
    let at = &mut probe as *mut u8 as usize;
    for r in (0..ch.world()).filter(|&r| r != me) {
        if !ok {
            break;
        }
        // Every rank offers a buffer of at least one byte (the tuner never picks an empty
        // message): its input, or its output for a broadcast's non-roots; and every rank has an
        // output of at least one byte but a gather's non-roots.
        let addr = if call.kind == CollKind::Broadcast && r != call.root {
            descs[r].recv_off
        } else {
            descs[r].send_off
        };
        let out = (call.kind != CollKind::Gather || r == call.root).then_some(descs[r].recv_off);
        let pid = pid(ch, r);
        let res = read_io(pid, addr, at, 1).and_then(|_| {
            out.map_or(Ok(()), |o| {
                read_io(pid, o, at, 1).and_then(|_| write_io(pid, o, at, 1))
            })
        });
        if let Err(e) = res {
            tracing::debug!(
                "a cross-memory copy to or from {} was refused ({e})",
                ch.who(r)
            );
            ok = false;
        }
    }
    match verdicts(ch, ok, None, cx)?.0 {
        None => {
            ch.cma.verified = true;
            Ok(true)
        }
        Some(r) => {
            tracing::debug!(
                "{} could not copy to or from a peer's memory directly: collectives go through the slots from now on",
                ch.who(r)
            );
            ch.cma.refused = true;
            // The call runs again on the slots, and is not timed for the choice there is no more.
            ch.timing.cma_untimed();
            Ok(false)
        }
    }
}

/// How long a rank whose copy failed waits to see whether a peer is gone.
const GONE_WAIT: Duration = Duration::from_millis(100);

/// A peer that is gone (`died` or left), waiting up to `GONE_WAIT` for one. Why wait: a copy that
/// fails after a successful probe almost always met a peer that is exiting. Its memory goes
/// (the copy fails with ESRCH) a moment before its process is seen dead, and it may have
/// published its verdict before it died, so the verdict phase completes: without the wait, the
/// ranks would report the failed copy instead of the death.
fn gone_peer(ch: &Channel) -> Option<(usize, bool)> {
    let until = Instant::now() + GONE_WAIT;
    loop {
        if let Some(gone) = (0..ch.world())
            .filter(|&k| k != ch.rank())
            .find_map(|k| ch.peer_gone(k).map(|died| (k, died)))
        {
            return Some(gone);
        }
        if Instant::now() >= until {
            return None;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The phase that ends a cross-memory body: nobody reuses its buffers before every peer has read
/// them and written into them, and a failed copy (`err`) fails the call on every rank.
pub(crate) fn conclude(
    ch: &mut Channel,
    call: &Call,
    err: Option<std::io::Error>,
    cx: Ctx,
) -> Result<(), CommError> {
    conclude_found(ch, call, err.map_or(Ok(None), Err), cx).map(drop)
}

/// [`conclude`] for a reduction: `outcome` is this rank's failed copy, or under the finite check
/// the first non-finite element it read; returns the first of every rank's (a failed copy on
/// any rank fails the call first).
pub(crate) fn conclude_found(
    ch: &mut Channel,
    call: &Call,
    outcome: Result<Option<Found>, std::io::Error>,
    cx: Ctx,
) -> Result<Option<Found>, CommError> {
    let (err, found) = match outcome {
        Ok(f) => (None, f),
        Err(e) => (Some(e), None),
    };
    let (failed, found) = verdicts(ch, err.is_none(), found, cx)?;
    let Some(r) = failed else {
        return Ok(found);
    };
    if let Some((k, died)) = gone_peer(ch) {
        return Err(ch.peer_lost(k, died, cx.op, cx.seq));
    }
    let why = match err {
        Some(e) => format!(
            "a direct copy to or from a peer's buffer (process_vm_readv/writev) failed ({e})"
        ),
        None => format!(
            "{} could not copy to or from a peer's buffer (process_vm_readv/writev)",
            ch.who(r)
        ),
    };
    Err(CommError::Aborted {
        by: ch.global(r),
        reason: format!(
            "{why} in {} #{} after the direct-copy probe had succeeded, so the output is incomplete; restart the job, or set LOCKSTEP_SHM_CMA_BYTES=0 to stage every message",
            call.kind, cx.seq
        ),
    })
}
