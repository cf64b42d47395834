//! The personalised exchanges: all_to_all, all_to_all_v, scatter, all_gather_v and gather_v, all
//! one algorithm over a matrix of block sizes `m[i][j]` (elements rank `i` sends to rank `j`).
//!
//! The first phase exchanges the descriptors and, for the v-variants, every rank's per-peer send
//! and receive counts (put in its slot), which every rank checks pair by pair, so an
//! inconsistency is the same [`CommError::Mismatch`] on every rank. Then, in rounds of one phase,
//! each rank stages the next piece of each of its outgoing blocks in its slot (the slot split
//! evenly between the ranks it sends to) and copies the pieces meant for it out of its peers'
//! slots. Every rank computes the same number of rounds from the matrix, so the phase counters
//! stay aligned; memory stays bounded by the slots whatever the message size.
//!
//! When every rank's send buffer lies in its shared heap (`alloc_shared`), there is no staging:
//! each rank copies its blocks straight out of its peers' send buffers, then one phase tells
//! them their buffers are free again (one copy instead of two, whatever the size).

use crate::comm::{Call, CollKind, CommError};
use crate::shm::channel::{Channel, Ctx};
use crate::shm::cma;
use crate::shm::inline;
use crate::shm::reduce::copy_block;
use crate::shm::sync::{CMA, SHARED_SEND};

/// Inline (scatter and all_to_all): copy this rank's block of the root's payload (scatter) or
/// of every rank's (all_to_all) out of the inline entries.
pub(crate) fn inline(ch: &mut Channel, call: &Call, cx: Ctx) -> Result<(), CommError> {
    inline::put_payload(ch, call);
    inline::exchange(ch, call, cx)?;
    let (n, me) = (ch.world(), ch.rank());
    let block = call.count * call.dtype.size();
    let recv = call.recv.addr as *mut u8;
    if block == 0 {
        return Ok(());
    }
    if call.kind == CollKind::Scatter {
        // SAFETY: the root's entry (send, on the root) holds n*block bytes; recv holds `block`,
        // equal to block `me` of send in place or disjoint.
        unsafe {
            copy_block(
                inline::src(ch, call, call.root).add(me * block),
                recv,
                block,
                false,
            )
        };
        return Ok(());
    }
    for r in 0..n {
        // SAFETY: entry r (send, for this rank) holds n*block bytes, block `me` is ours; recv
        // holds n*block, disjoint from send (the shared checks refuse overlapping buffers for
        // all-to-all, which has no in-place form).
        unsafe {
            copy_block(
                inline::src(ch, call, r).add(me * block),
                recv.add(r * block),
                block,
                false,
            )
        };
    }
    Ok(())
}

/// Where this rank's blocks are: (element offset, element count) per peer, for send and recv.
struct Plan {
    send: Vec<(usize, usize)>,
    recv: Vec<(usize, usize)>,
}

fn plan(call: &Call, n: usize, me: usize) -> Plan {
    let c = call.count;
    let sp = &call.splits;
    let zero = vec![(0, 0); n];
    match call.kind {
        CollKind::AllToAll => Plan {
            send: (0..n).map(|j| (j * c, c)).collect(),
            recv: (0..n).map(|i| (i * c, c)).collect(),
        },
        CollKind::Scatter => {
            let send = if me == call.root {
                (0..n).map(|j| (j * c, c)).collect()
            } else {
                zero.clone()
            };
            let mut recv = zero;
            recv[call.root] = (0, c);
            Plan { send, recv }
        }
        CollKind::AllToAllV => Plan {
            send: (0..n)
                .map(|j| (sp.send_displs[j], sp.send_counts[j]))
                .collect(),
            recv: (0..n)
                .map(|i| (sp.recv_displs[i], sp.recv_counts[i]))
                .collect(),
        },
        CollKind::AllGatherV => Plan {
            send: vec![(0, c); n],
            recv: (0..n)
                .map(|i| (sp.recv_displs[i], sp.recv_counts[i]))
                .collect(),
        },
        // GatherV (the dispatcher sends nothing else here).
        _ => {
            let mut send = zero.clone();
            send[call.root] = (0, c);
            let recv = if me == call.root {
                (0..n)
                    .map(|i| (sp.recv_displs[i], sp.recv_counts[i]))
                    .collect()
            } else {
                zero
            };
            Plan { send, recv }
        }
    }
}

/// Run one of the exchanges (`call.kind` tells which).
pub(crate) fn exchange(ch: &mut Channel, call: &Call, cx: Ctx) -> Result<(), CommError> {
    let (n, me, esz) = (ch.world(), ch.rank(), call.dtype.size());
    let plan = plan(call, n, me);
    let send = call.send.addr as *const u8;
    let recv = call.recv.addr as *mut u8;
    let v = call.kind.is_v();
    let p0 = ch.next_phase();
    // Small equal blocks (all_to_all, scatter): the data rides in the descriptors' phase, one
    // phase in all. Every rank decides the same way (the count is the same on every rank, or the
    // descriptor check fails the call everywhere).
    let one_phase =
        !v && n > 1 && n * call.count * esz <= ch.one_phase_bytes().min(ch.slot_bytes());
    if one_phase {
        ch.last_path = crate::trace::CallPath::OnePhase;
    }
    if one_phase && (call.kind == CollKind::AllToAll || me == call.root) {
        // SAFETY: our own slot of phase p0 holds `small_bytes` or more; the send buffer holds
        // n × count elements (checked by the communicator); nobody reads the slot before we
        // publish p0.
        unsafe { copy_block(send, ch.slot(me, p0), n * call.count * esz, false) };
    }
    if v {
        // Counts go through the slot of the first phase: n send counts, n receive counts, then the
        // n send displacements (for the zero-copy path). The slot holds at least 4 KiB per peer
        // (ShmConfig::normalized_for), far more than 24n bytes.
        let counts: Vec<u64> = plan
            .send
            .iter()
            .map(|&(_, c)| c as u64)
            .chain(plan.recv.iter().map(|&(_, c)| c as u64))
            .chain(plan.send.iter().map(|&(o, _)| o as u64))
            .collect();
        // SAFETY: our own slot of phase p0, 2n u64 fit (above); nobody reads it before we publish.
        unsafe {
            copy_block(
                counts.as_ptr() as *const u8,
                ch.slot(me, p0),
                counts.len() * 8,
                false,
            )
        };
    }
    // The per-rank counts of the v-variants differ between ranks: they are checked below, pair by
    // pair, so the descriptors carry none.
    let desc_call = if v { Call { count: 0, ..*call } } else { *call };
    let (mut flags, mut send_off, _) = ch.share_flags(call, call.send.len * esz, 0);
    if flags & SHARED_SEND == 0 && ch.config().cma_bytes > 0 && !ch.cma.refused {
        // Offer our send buffer for cross-memory copies: its address in our own memory.
        flags |= CMA;
        send_off = call.send.addr as u64;
    }
    let (descs, _) = ch.begin(&desc_call, flags, send_off, 0, cx)?;
    // Element offset, in rank r's send buffer, of its block for rank j (zero-copy path).
    let mut send_displ: Vec<usize> = (0..n * n).map(|k| plan_displ(call, k % n)).collect();
    // m[i * n + j]: elements rank i sends to rank j.
    let m: Vec<usize> = if v {
        let mut m = vec![0usize; n * n];
        let mut recv_from = vec![0usize; n * n];
        for r in 0..n {
            let mut vals = vec![0u64; 3 * n];
            // SAFETY: rank r put 3n u64 in its slot of phase p0 before publishing it, and
            // nobody writes that slot again before everyone has published p0 + 1.
            unsafe {
                copy_block(
                    ch.slot(r, p0),
                    vals.as_mut_ptr() as *mut u8,
                    3 * n * 8,
                    false,
                )
            };
            for j in 0..n {
                m[r * n + j] = vals[j] as usize;
                recv_from[j * n + r] = vals[n + j] as usize;
                send_displ[r * n + j] = vals[2 * n + j] as usize;
            }
        }
        check_counts(&m, &recv_from, n, call.kind, cx.seq, &|r| ch.who(r))?;
        m
    } else {
        let c = call.count;
        (0..n * n)
            .map(|k| {
                if call.kind == CollKind::AllToAll || k / n == call.root {
                    c
                } else {
                    0
                }
            })
            .collect()
    };
    let nt = ch.nt_for(plan.recv.iter().map(|&(_, c)| c).sum::<usize>() * esz);
    if one_phase {
        for i in (0..n).filter(|&i| m[i * n + me] > 0) {
            let (off, cnt) = plan.recv[i];
            // SAFETY: rank i put its whole send (n × count elements) in its slot of phase p0
            // before publishing it, and does not write that slot again before we publish p0 + 1;
            // our block from it lies in recv (checked by the communicator).
            let from = unsafe { ch.slot(i, p0).add(plan_displ(call, me) * esz) };
            // SAFETY: as above.
            unsafe { copy_block(from, recv.add(off * esz), cnt * esz, false) };
        }
        return Ok(());
    }
    // Our own block: straight from send to recv.
    let (so, sc) = plan.send[me];
    if sc > 0 {
        // SAFETY: the communicator checked both blocks lie within their buffers; the blocks are
        // equal or disjoint (distinct borrows).
        ch.put(
            unsafe { send.add(so * esz) },
            unsafe { recv.add(plan.recv[me].0 * esz) },
            sc * esz,
            nt,
        );
    }
    // A rank that sends nothing to its peers (a scatter's non-roots) need not share its buffer.
    let shares =
        |r: usize| descs[r].flags & SHARED_SEND != 0 || (0..n).all(|j| j == r || m[r * n + j] == 0);
    if n > 1 && (0..n).all(shares) {
        for i in (0..n).filter(|&i| i != me && m[i * n + me] > 0) {
            let (off, cnt) = plan.recv[i];
            // SAFETY: rank i's send buffer lies in its shared heap (SHARED_SEND, offset from
            // `shared_off`), and its block for us is `cnt` elements at the displacement it
            // published (checked against its buffer by its communicator); our block from it lies
            // in recv (checked by ours). Rank i does not touch its buffer until the phase below.
            ch.put(
                unsafe { ch.at(descs[i].send_off).add(send_displ[i * n + me] * esz) },
                unsafe { recv.add(off * esz) },
                cnt * esz,
                nt,
            );
        }
        // Our peers have read our send buffer once everyone has published this phase.
        ch.phase(cx)?;
        return Ok(());
    }
    // Ordinary buffers, large blocks: each rank copies its blocks once, straight out of its peers'
    // memory, if every rank offered its buffer and the kernel lets it; the result is agreed in one
    // phase (a refusal anywhere sends everyone down the slots path below, for good).
    let offers = |r: usize| {
        (descs[r].flags & CMA != 0 && descs[r].pidns == descs[me].pidns)
            || (0..n).all(|j| j == r || m[r * n + j] == 0)
    };
    let largest = (0..n * n)
        .filter(|k| k / n != k % n)
        .map(|k| m[k] * esz)
        .max()
        .unwrap_or(0);
    if n > 1 && largest >= ch.config().cma_bytes && ch.config().cma_bytes > 0 && (0..n).all(offers)
    {
        let mut ok = true;
        for i in (0..n).filter(|&i| i != me && m[i * n + me] > 0) {
            let (off, cnt) = plan.recv[i];
            let pid = ch.ctrl(i).pid.load(std::sync::atomic::Ordering::Relaxed) as u64;
            // Rank i's block for us lies in its send buffer (checked by its communicator); ours
            // from it in recv (checked by ours); rank i waits in the phase below meanwhile.
            if ch.config().fault_refuse_direct
                || !cma::read(
                    pid,
                    descs[i].send_off + (send_displ[i * n + me] * esz) as u64,
                    call.recv.addr + off * esz,
                    cnt * esz,
                )
            {
                ok = false;
                break;
            }
        }
        let p = ch.next_phase();
        // SAFETY: our own slot of the next phase; 8 bytes fit in any slot; nobody reads it before
        // we publish the phase.
        unsafe { (ch.slot(me, p) as *mut u64).write(ok as u64) };
        ch.phase(cx)?;
        // SAFETY: every rank wrote its verdict in its slot of phase p before publishing it.
        if (0..n).all(|r| unsafe { (ch.slot(r, p) as *const u64).read() } == 1) {
            ch.last_path = crate::trace::CallPath::Cma;
            return Ok(());
        }
        tracing::debug!("a rank could not read its peers' buffers directly: exchanges stage through the slots from now on");
        ch.cma.refused = true;
    }
    // Rank i's outgoing peers, and the bytes of each piece it stages per round.
    let dests: Vec<Vec<usize>> = (0..n)
        .map(|i| (0..n).filter(|&j| j != i && m[i * n + j] > 0).collect())
        .collect();
    let piece: Vec<usize> = dests
        .iter()
        .map(|d| (ch.slot_bytes() / d.len().max(1)) / 64 * 64)
        .collect();
    let rounds = (0..n)
        .flat_map(|i| dests[i].iter().map(move |&j| (i, j)))
        .map(|(i, j)| (m[i * n + j] * esz).div_ceil(piece[i]))
        .max()
        .unwrap_or(0);
    for r in 0..rounds {
        let p = ch.next_phase();
        for (idx, &j) in dests[me].iter().enumerate() {
            let (off, cnt) = plan.send[j];
            let (bytes, at) = (cnt * esz, r * piece[me]);
            if at < bytes {
                // SAFETY: the piece lies in our send block (checked by the communicator) and in
                // our slot (idx < dests.len(), piece × dests.len() <= slot_bytes).
                unsafe {
                    copy_block(
                        send.add(off * esz + at),
                        ch.slot(me, p).add(idx * piece[me]),
                        piece[me].min(bytes - at),
                        false,
                    )
                };
            }
        }
        ch.phase(cx)?;
        for i in (0..n).filter(|&i| i != me && m[i * n + me] > 0) {
            let idx = dests[i].iter().position(|&j| j == me).unwrap_or(0);
            let (off, cnt) = plan.recv[i];
            let (bytes, at) = (cnt * esz, r * piece[i]);
            if at < bytes {
                // SAFETY: rank i put this piece in its slot of phase p (same plan, same
                // matrix); it lies in our recv block from rank i, which the communicator checked.
                ch.put(
                    unsafe { ch.slot(i, p).add(idx * piece[i]) },
                    unsafe { recv.add(off * esz + at) },
                    piece[i].min(bytes - at),
                    nt,
                );
            }
        }
    }
    Ok(())
}

/// Element offset, in rank `r`'s send buffer, of its block for rank `j`, for the variants whose
/// layout every rank knows (the v-variants' displacements come with the counts).
fn plan_displ(call: &Call, j: usize) -> usize {
    match call.kind {
        CollKind::AllToAll | CollKind::Scatter => j * call.count,
        _ => 0,
    }
}

/// Every rank's send count to every peer must be that peer's receive count from it (`who` names
/// a rank).
fn check_counts(
    sends: &[usize],
    recvs: &[usize],
    n: usize,
    kind: CollKind,
    seq: u64,
    who: &dyn Fn(usize) -> String,
) -> Result<(), CommError> {
    let mut bad = Vec::new();
    let mut more = 0;
    for i in 0..n {
        for j in 0..n {
            let (s, r) = (sends[i * n + j], recvs[i * n + j]);
            if s != r {
                if bad.len() < 8 {
                    let (wi, wj) = (who(i), who(j));
                    bad.push(format!(
                        "{wi} sends {s} elements to {wj} but {wj} expects {r} from {wi}"
                    ));
                } else {
                    more += 1;
                }
            }
        }
    }
    if bad.is_empty() {
        return Ok(());
    }
    if more > 0 {
        bad.push(format!("and {more} more pairs disagree"));
    }
    Err(CommError::Mismatch {
        seq,
        detail: format!("{kind} counts disagree: {}", bad.join("; ")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_disagreement_names_both_ranks() {
        // 2 ranks: rank 0 sends 3 to rank 1, but rank 1 expects 4 from rank 0.
        let sends = [1, 3, 2, 5];
        let recvs = [1, 4, 2, 5];
        let who = |r: usize| format!("rank {r}");
        let e = check_counts(&sends, &recvs, 2, CollKind::AllToAllV, 7, &who)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rank 0 sends 3 elements to rank 1 but rank 1 expects 4 from rank 0"),
            "{e}"
        );
        assert!(check_counts(&sends, &sends, 2, CollKind::AllToAllV, 7, &who).is_ok());
    }
}
