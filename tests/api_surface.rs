//! The public surface a framework meets first, exercised through the crate root only: a user's
//! own tensor type passed to collectives through `AsRef<[T]>`/`AsMut<[T]>` (no `unsafe impl`), a
//! rank function that is `FnOnce` (moves its captures), and a rank result of the user's own
//! serde type. harness = false: `launch` forks.

#[path = "common/runner.rs"]
mod runner;

use lockstep::comm::{Buffer, BufferMut, Call, CollKind, Dtype, P2pOp, RawMem, Splits};
use lockstep::{launch, CommError, LaunchConfig, RankContext, RankResult, ReduceOp};
use serde::{Deserialize, Serialize};

/// A framework's tensor: the collective sees only its contiguous storage.
struct Tensor {
    shape: Vec<usize>,
    data: Vec<f32>,
}

impl AsRef<[f32]> for Tensor {
    fn as_ref(&self) -> &[f32] {
        &self.data
    }
}

impl AsMut<[f32]> for Tensor {
    fn as_mut(&mut self) -> &mut [f32] {
        &mut self.data
    }
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Summary {
    rank: usize,
    shape: Vec<usize>,
    sum: f64,
    note: Option<String>,
}

fn main() -> std::process::ExitCode {
    runner::run(&[
        (
            "user_tensor_fnonce_serde_result",
            user_tensor_fnonce_serde_result,
        ),
        ("erased_entry_checks_as_typed", erased_entry_checks_as_typed),
    ])
}

/// A user's own tensor type through the collectives, an `FnOnce` rank closure that consumes what it
/// captured, and a serde result back from every rank.
fn user_tensor_fnonce_serde_result() -> Result<(), String> {
    let world = 3;
    // Moved into the closure and consumed there: only an FnOnce can do this.
    let notes: Vec<String> = (0..world).map(|r| format!("rank {r} was here")).collect();
    let res = launch(
        &LaunchConfig::new(world),
        move |mut ctx: RankContext| -> RankResult<Summary> {
            let mut t = Tensor {
                shape: vec![2, 5],
                data: vec![ctx.rank as f32 + 1.0; 10],
            };
            ctx.comm.all_reduce_in_place(&mut t, ReduceOp::Sum)?;
            let mut gathered = Tensor {
                shape: vec![world, 2, 5],
                data: vec![0.0; 10 * world],
            };
            ctx.comm.all_gather(&t, &mut gathered)?;
            // A locally refused call is an error value, not a panic.
            let mut short = Tensor {
                shape: vec![3],
                data: vec![0.0; 3],
            };
            match ctx.comm.all_reduce(&t, &mut short, ReduceOp::Sum) {
                Err(CommError::InvalidArgument { .. }) => {}
                other => {
                    return Err(
                        format!("a length mismatch must be refused locally, got {other:?}").into(),
                    )
                }
            }
            let mut notes = notes;
            let note = notes.drain(..).nth(ctx.rank);
            Ok(Summary {
                rank: ctx.rank,
                shape: gathered.shape,
                sum: gathered.data.iter().map(|&x| x as f64).sum(),
                note,
            })
        },
    );
    let want_sum = (1..=world).sum::<usize>() as f64 * 10.0 * world as f64;
    match res {
        Ok(v)
            if v.len() == world
                && v.iter().enumerate().all(|(r, s)| {
                    s.rank == r
                        && s.shape == vec![world, 2, 5]
                        && s.sum == want_sum
                        && s.note.as_deref() == Some(format!("rank {r} was here").as_str())
                }) =>
        {
            Ok(())
        }
        other => Err(format!("{other:?}")),
    }
}

/// The erased entry, `Communicator::run`, as a binding uses it: a raw `Call` runs as the typed
/// method does (also through `start`); one with a buffer of the wrong size is refused with the
/// typed method's message, and when only one rank passes it, the peers' matching call fails with
/// a mismatch naming that rank instead of waiting; point-to-point through `run_p2p` likewise.
fn erased_entry_checks_as_typed() -> Result<(), String> {
    let world = 3;
    let out = launch(
        &LaunchConfig::new(world),
        move |mut ctx: RankContext| -> RankResult<Vec<String>> {
            let (me, c) = (ctx.rank, &mut ctx.comm);
            let mut notes = Vec::new();
            let raw = |send: RawMem, recv: RawMem, count: usize| Call {
                kind: CollKind::AllReduce,
                dtype: Dtype::F32,
                op: ReduceOp::Sum,
                root: 0,
                count,
                send,
                recv,
                splits: Splits::default(),
            };
            // A good raw call, and the same through `start`.
            let send = vec![me as f32 + 1.0; 4];
            let mut recv = vec![0f32; 4];
            let call = raw(Buffer::<f32>::raw(&send), recv.raw_mut(), 4);
            // SAFETY: `send` and `recv` are live, disjoint vectors of 4 f32s, untouched until the
            // call returns (the shm backend completes it before returning).
            unsafe { c.run(&call) }?;
            let want = (1..=world).sum::<usize>() as f32;
            if recv != [want; 4] {
                notes.push(format!("raw all_reduce gave {recv:?}"));
            }
            // SAFETY: as above; the Work is waited for at once.
            c.start(|c| unsafe { c.run(&call) }).wait()?;
            // Every rank passes a short recv: the typed method's message, through both entries.
            let mut short = vec![0f32; 3];
            let typed = c.all_reduce(&send, &mut short, ReduceOp::Sum);
            let call = raw(Buffer::<f32>::raw(&send), short.raw_mut(), 4);
            // SAFETY: refused before any byte is read: the lengths disagree.
            let erased = unsafe { c.run(&call) };
            match (&typed, &erased) {
                (Err(t @ CommError::InvalidArgument { .. }), Err(e))
                    if t.to_string() == e.to_string() => {}
                _ => notes.push(format!("typed {typed:?} but erased {erased:?}")),
            }
            // A count that disagrees with the buffers, and an overlap that is no in-place form.
            let mut buf = vec![0f32; 8];
            let b = buf.raw_mut();
            let half = RawMem {
                addr: b.addr + 4,
                len: 4,
                space: b.space,
            };
            for (what, call, needle) in [
                (
                    "count",
                    raw(Buffer::<f32>::raw(&send), recv.raw_mut(), 5),
                    "count is 5",
                ),
                ("overlap", raw(RawMem { len: 4, ..b }, half, 4), "overlap"),
            ] {
                // SAFETY: refused before any byte is read or written.
                match unsafe { c.run(&call) } {
                    Err(CommError::InvalidArgument { detail, .. }) if detail.contains(needle) => {}
                    r => notes.push(format!("{what}: {r:?}")),
                }
            }
            // Only rank 1 passes a short recv: refused there, a mismatch naming it elsewhere.
            let mut r2 = vec![0f32; if me == 1 { 3 } else { 4 }];
            let call = raw(Buffer::<f32>::raw(&send), r2.raw_mut(), 4);
            // SAFETY: as for the first call.
            let r = unsafe { c.run(&call) };
            match (me, &r) {
                (1, Err(CommError::InvalidArgument { rank: 1, .. })) => {}
                (0 | 2, Err(CommError::Mismatch { detail, .. })) if detail.contains("rank 1") => {}
                _ => notes.push(format!("one rank refused: {r:?}")),
            }
            // Point-to-point: a ring through run_p2p, and a lone send to itself refused.
            let (to, from) = ((me + 1) % world, (me + world - 1) % world);
            let out = [me as u64; 2];
            let mut got = [u64::MAX; 2];
            let mut ops = [
                P2pOp {
                    kind: CollKind::Send,
                    peer: to,
                    dtype: Dtype::U64,
                    mem: Buffer::<u64>::raw(&out),
                },
                P2pOp {
                    kind: CollKind::Recv,
                    peer: from,
                    dtype: Dtype::U64,
                    mem: got.raw_mut(),
                },
            ];
            // SAFETY: `out` and `got` are live, disjoint arrays of 2 u64s, untouched until the
            // group returns.
            unsafe { c.run_p2p(&mut ops) }?;
            if got != [from as u64; 2] {
                notes.push(format!("ring gave {got:?}"));
            }
            // SAFETY: refused before any byte is read.
            match unsafe {
                c.run_p2p(
                    &mut ops[..1]
                        .iter()
                        .map(|o| P2pOp { peer: me, ..*o })
                        .collect::<Vec<_>>(),
                )
            } {
                Err(CommError::InvalidArgument { detail, .. }) if detail.contains("itself") => {}
                r => notes.push(format!("self send: {r:?}")),
            }
            // Still in step.
            let mut z = [1u64; 3];
            c.all_reduce_in_place(&mut z, ReduceOp::Sum)?;
            if z != [world as u64; 3] {
                notes.push(format!("all_reduce after refused calls gave {z:?}"));
            }
            Ok(notes)
        },
    )
    .map_err(|e| e.to_string())?;
    let notes: Vec<String> = out.into_iter().flatten().collect();
    if notes.is_empty() {
        Ok(())
    } else {
        Err(notes.join("; "))
    }
}
