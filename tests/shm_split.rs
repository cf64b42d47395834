//! Sub-communicators (`Communicator::split`, `new_group`) on the shared-memory backend, through
//! the fork launcher, for world sizes 1 to 5: ranks, orders and global ranks; collectives inside
//! subgroups; nested splits; two disjoint subgroups and the world communicator running different
//! collectives at the same time (two threads per rank); mismatch, dead-peer and timeout errors
//! inside a subgroup, which must name global ranks; no segment left behind.
//!
//! `harness = false`: the process forks, so it stays single-threaded; the binary ends with
//! `N passed, M failed`.

#[path = "common/launched.rs"]
mod launched;
#[path = "common/runner.rs"]
mod runner;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use launched::{no_failures, small_slots};
use lockstep::comm::{CommError, Communicator, ReduceOp};
use lockstep::launch::{launch, LaunchConfig, LaunchError, RankContext, RankResult};

const WORLDS: std::ops::RangeInclusive<usize> = 1..=5;
/// Iterations of each loop of the concurrency test.
const ITERS: usize = 200;

/// Small slots so that the messages below take several chunks.
fn cfg(n: usize) -> LaunchConfig {
    small_slots(n, 16 << 20, Duration::from_secs(30))
}

/// The results of a job whose ranks must all succeed, or why not.
fn all_ok<R>(res: Result<Vec<R>, LaunchError>) -> Result<Vec<R>, String> {
    res.map_err(|e| e.to_string())
}

/// A job whose ranks return their failures as a list: none may have any.
fn report(n: usize, res: Result<Vec<Vec<String>>, LaunchError>) -> Result<(), String> {
    let out = all_ok(res).map_err(|e| format!("world {n}: {e}"))?;
    no_failures(&format!("world {n} "), out)
}

/// For each world size of `worlds`, a job whose ranks each run `checks(comm, n, rank)` and then
/// [`check_world`], returning their failures: none may have any.
fn in_worlds(
    worlds: impl IntoIterator<Item = usize>,
    checks: impl Fn(&mut Communicator, usize, usize) -> RankResult<Vec<String>>,
) -> Result<(), String> {
    for n in worlds {
        let res = launch(&cfg(n), |mut ctx: RankContext| -> RankResult<Vec<String>> {
            let (c, me) = (&mut ctx.comm, ctx.rank);
            let mut bad = checks(c, n, me)?;
            bad.extend(check_world(c, n)?);
            Ok(bad)
        });
        report(n, res)?;
    }
    Ok(())
}

/// The members of rank `me`'s color, in their new order, when every rank `r` passes
/// `color(r)` and `key(r)`.
fn members(
    n: usize,
    me: usize,
    color: impl Fn(usize) -> Option<u32>,
    key: impl Fn(usize) -> i64,
) -> Option<Vec<usize>> {
    let c = color(me)?;
    let mut m: Vec<usize> = (0..n).filter(|&r| color(r) == Some(c)).collect();
    m.sort_by_key(|&r| (key(r), r));
    Some(m)
}

/// Check a sub-communicator against the members it should have (global ranks, in order), and run
/// collectives on it; returns failures.
fn check_sub(
    c: &mut Communicator,
    want: &[usize],
    me_global: usize,
) -> Result<Vec<String>, CommError> {
    let mut bad = Vec::new();
    let m = want.len();
    let my = want.iter().position(|&g| g == me_global).expect("a member");
    if c.rank() != my
        || c.world_size() != m
        || c.global_ranks() != want
        || c.global_rank() != me_global
        || !c.is_sub_communicator()
    {
        bad.push(format!(
            "rank {} of {} with global ranks {:?} (global rank {}), want rank {my} of {m} with {want:?}",
            c.rank(),
            c.world_size(),
            c.global_ranks(),
            c.global_rank()
        ));
        return Ok(bad);
    }
    // The sum of the members' global ranks, in a message of several chunks.
    let len = 5000;
    let x: Vec<u64> = (0..len)
        .map(|i| me_global as u64 * 1000 + i as u64)
        .collect();
    let mut y = vec![0u64; len];
    c.all_reduce(&x, &mut y, ReduceOp::Sum)?;
    let s: u64 = want.iter().map(|&g| g as u64 * 1000).sum();
    if let Some(i) = (0..len).find(|&i| y[i] != s + (m * i) as u64) {
        bad.push(format!(
            "all_reduce of global ranks: [{i}] = {}, want {}",
            y[i],
            s + (m * i) as u64
        ));
    }
    // all_gather: every member's global rank, in sub-communicator order.
    let mut g = vec![0u64; m];
    c.all_gather(&[me_global as u64][..], &mut g[..])?;
    if g.iter().map(|&v| v as usize).collect::<Vec<_>>() != want {
        bad.push(format!("all_gather of global ranks: {g:?}, want {want:?}"));
    }
    // broadcast from the last sub-rank.
    let mut b = vec![me_global as f32; 3000];
    c.broadcast_in_place(&mut b, m - 1)?;
    if b.iter().any(|&v| v != want[m - 1] as f32) {
        bad.push(format!("broadcast from sub-rank {}: got {}", m - 1, b[0]));
    }
    // A ring of point-to-point messages, in sub-communicator ranks.
    let (next, prev) = ((my + 1) % m, (my + m - 1) % m);
    let out = vec![me_global as i32; 2000];
    let mut inn = vec![-1i32; 2000];
    c.group(|gr| {
        gr.send(&out, next)?;
        gr.recv(&mut inn, prev)
    })?;
    if inn.iter().any(|&v| v != want[prev] as i32) {
        bad.push(format!("ring recv from sub-rank {prev}: got {}", inn[0]));
    }
    c.barrier()?;
    Ok(bad)
}

/// World all-reduce of ones: the world communicator still works (and is in step).
fn check_world(c: &mut Communicator, n: usize) -> Result<Vec<String>, CommError> {
    let mut x = vec![1i64; 100];
    c.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
    Ok(if x.iter().all(|&v| v == n as i64) {
        vec![]
    } else {
        vec![format!("world all_reduce after splits: {}", x[0])]
    })
}

/// Split by parity with `key = -rank` (reversed order), and with no color on some ranks.
fn t_split_parity_and_none() -> Result<(), String> {
    in_worlds(WORLDS, |c, n, me| {
        let mut bad = Vec::new();
        let color = |r: usize| Some((r % 2) as u32);
        let key = |r: usize| -(r as i64);
        let want = members(n, me, color, key).unwrap();
        match c.split(color(me), key(me))? {
            Some(mut sub) => bad.extend(check_sub(&mut sub, &want, me)?),
            None => bad.push("parity split gave no communicator".into()),
        }
        // Rank 0 takes no part; the others, in their order.
        let color = |r: usize| (r != 0).then_some(7);
        match (c.split(color(me), 0)?, members(n, me, color, |_| 0)) {
            (Some(mut sub), Some(want)) => bad.extend(check_sub(&mut sub, &want, me)?),
            (None, None) => {}
            (got, want) => bad.push(format!(
                "color {:?}: got a communicator: {}, want {want:?}",
                color(me),
                got.is_some()
            )),
        }
        // Every rank without a color: nobody gets one, and the parent stays in step.
        if c.split(None, 3)?.is_some() {
            bad.push("split(None) gave a communicator".into());
        }
        // Equal keys keep the parent's order.
        let want: Vec<usize> = (0..n).collect();
        match c.split(Some(0), 5)? {
            Some(mut sub) => bad.extend(check_sub(&mut sub, &want, me)?),
            None => bad.push("split of everyone gave no communicator".into()),
        }
        Ok(bad)
    })
}

/// `new_group`: a set of ranks in any order (the new order is the parent's), refusals of bad
/// lists on the rank that passed them and on its peers, disagreeing sets.
fn t_new_group() -> Result<(), String> {
    in_worlds(WORLDS, |c, n, me| {
        let mut bad = Vec::new();
        // The last rank and rank 0, listed backwards.
        let list: Vec<usize> = if n > 1 { vec![n - 1, 0] } else { vec![0] };
        let mut want = list.clone();
        want.sort();
        match (c.new_group(&list)?, want.contains(&me)) {
            (Some(mut g), true) => bad.extend(check_sub(&mut g, &want, me)?),
            (None, false) => {}
            (g, member) => bad.push(format!(
                "new_group({list:?}): got a communicator: {}, member: {member}",
                g.is_some()
            )),
        }
        // Every rank.
        let all: Vec<usize> = (0..n).rev().collect();
        match c.new_group(&all)? {
            Some(mut g) => bad.extend(check_sub(&mut g, &(0..n).collect::<Vec<_>>(), me)?),
            None => bad.push("new_group of every rank gave no communicator".into()),
        }
        // The last rank passes a bad list: refused there, a mismatch naming it elsewhere.
        for (what, badlist) in [
            ("empty", vec![]),
            ("out of range", vec![0, n]),
            ("duplicate", vec![0, 0]),
        ] {
            let l = if me == n - 1 { badlist } else { vec![0] };
            match (me == n - 1, c.new_group(&l)) {
                (true, Err(CommError::InvalidArgument { .. })) => {}
                (false, Err(e @ CommError::Mismatch { .. }))
                    if e.to_string().contains(&format!("rank {} refused", n - 1)) => {}
                (_, r) => bad.push(format!(
                    "new_group with a list {what} on rank {}: {:?}",
                    n - 1,
                    r.map(|g| g.is_some())
                )),
            }
        }
        // Two ranks disagree on the set: every rank fails, naming the odd one.
        if n > 1 {
            let l = if me == 1 { vec![1] } else { vec![0] };
            match c.new_group(&l) {
                Err(e @ CommError::Mismatch { .. })
                    if e.to_string()
                        .contains("rank 1 passed another set of ranks than rank 0") => {}
                r => bad.push(format!(
                    "new_group with disagreeing sets: {:?}",
                    r.map(|g| g.is_some())
                )),
            }
        }
        Ok(bad)
    })
}

/// A split of a split: global ranks compose; the middle communicator stays usable.
fn t_nested() -> Result<(), String> {
    in_worlds(WORLDS, |c, n, me| {
        let mut bad = Vec::new();
        // Everyone, reversed: sub-rank s is global rank n-1-s.
        let mut rev = c.split(Some(0), -(me as i64))?.ok_or("no communicator")?;
        let want: Vec<usize> = (0..n).rev().collect();
        bad.extend(check_sub(&mut rev, &want, me)?);
        // Split that by the parity of the sub-rank, reversed again.
        let s = rev.rank();
        let mut inner = rev
            .split(Some((s % 2) as u32), -(s as i64))?
            .ok_or("no inner communicator")?;
        let mut want_inner: Vec<usize> = (0..n).filter(|&t| t % 2 == s % 2).collect();
        want_inner.sort_by_key(|&t| -(t as i64));
        let want_inner: Vec<usize> = want_inner.iter().map(|&t| want[t]).collect();
        bad.extend(check_sub(&mut inner, &want_inner, me)?);
        // And once more, with new_group of the inner communicator's first rank.
        let third = inner.new_group(&[0])?;
        match (third, inner.rank() == 0) {
            (Some(mut t), true) => bad.extend(check_sub(&mut t, &[me], me)?),
            (None, false) => {}
            (t, first) => bad.push(format!(
                "new_group(&[0]) of the inner communicator: got one: {}, first: {first}",
                t.is_some()
            )),
        }
        bad.extend(check_sub(&mut rev, &want, me)?);
        Ok(bad)
    })
}

/// Two disjoint subgroups (by parity) and the world communicator run different collectives at
/// the same time: in each rank one thread drives the subgroup, another the world; every result
/// is checked.
fn t_concurrent() -> Result<(), String> {
    for n in WORLDS {
        let res = launch(
            &cfg(n),
            move |mut ctx: RankContext| -> RankResult<Vec<String>> {
                let me = ctx.rank;
                let want = members(n, me, |r| Some((r % 2) as u32), |r| -(r as i64)).unwrap();
                let mut sub = ctx
                    .comm
                    .split(Some((me % 2) as u32), -(me as i64))?
                    .ok_or("no communicator")?;
                let world = &mut ctx.comm;
                // Each thread raises its flag after its first iteration and does not begin its last
                // before the other's flag is up, so the two loops surely overlap.
                let (sub_started, world_started) = (AtomicBool::new(false), AtomicBool::new(false));
                let (sub_started, world_started) = (&sub_started, &world_started);
                let (sub_bad, world_bad) = std::thread::scope(|s| {
                    let want = &want;
                    let sub_thread = s.spawn(move || -> Result<Vec<String>, CommError> {
                        let (m, my) = (sub.world_size(), sub.rank());
                        let mut bad = Vec::new();
                        for it in 0..ITERS {
                            rendezvous(it, sub_started, world_started);
                            // all_reduce (sizes from one chunk to several), then all_to_all.
                            let len = 1 + (it * 997) % 6000;
                            let x: Vec<i64> = (0..len)
                                .map(|i| (me * 100_000 + it * 10 + i) as i64)
                                .collect();
                            let mut y = vec![0i64; len];
                            sub.all_reduce(&x, &mut y, ReduceOp::Sum)?;
                            let base: i64 = want.iter().map(|&g| (g * 100_000) as i64).sum();
                            if let Some(i) =
                                (0..len).find(|&i| y[i] != base + (m * (it * 10 + i)) as i64)
                            {
                                bad.push(format!(
                                    "sub all_reduce iteration {it}: [{i}] = {}",
                                    y[i]
                                ));
                            }
                            let blk = 1 + it % 700;
                            let send: Vec<u32> = (0..m * blk)
                                .map(|k| (me * 1_000_000 + (k / blk) * 1000 + k % blk) as u32)
                                .collect();
                            let mut recv = vec![0u32; m * blk];
                            sub.all_to_all(&send, &mut recv)?;
                            if let Some(k) = (0..m * blk).find(|&k| {
                                recv[k] != (want[k / blk] * 1_000_000 + my * 1000 + k % blk) as u32
                            }) {
                                bad.push(format!(
                                    "sub all_to_all iteration {it}: [{k}] = {}",
                                    recv[k]
                                ));
                            }
                        }
                        Ok(bad)
                    });
                    let mut bad = Vec::new();
                    let world_run = (|| -> Result<(), CommError> {
                        for it in 0..ITERS {
                            rendezvous(it, world_started, sub_started);
                            // all_gather, then broadcast from a rotating root, then reduce_scatter.
                            let len = 1 + (it * 389) % 3000;
                            let x: Vec<f64> = (0..len).map(|i| (me * 7 + it + i) as f64).collect();
                            let mut g = vec![0f64; len * n];
                            world.all_gather(&x, &mut g)?;
                            if let Some(k) = (0..len * n)
                                .find(|&k| g[k] != ((k / len) * 7 + it + k % len) as f64)
                            {
                                bad.push(format!(
                                    "world all_gather iteration {it}: [{k}] = {}",
                                    g[k]
                                ));
                            }
                            let root = it % n;
                            let mut b = vec![(me + it) as u8; 1 + it * 31];
                            world.broadcast_in_place(&mut b, root)?;
                            if b.iter().any(|&v| v != (root + it) as u8) {
                                bad.push(format!("world broadcast iteration {it}: {}", b[0]));
                            }
                            let c = 1 + it % 500;
                            let s: Vec<i32> = (0..c * n).map(|k| (k + me) as i32).collect();
                            let mut r = vec![0i32; c];
                            world.reduce_scatter(&s, &mut r, ReduceOp::Sum)?;
                            let total_me: i32 = (0..n as i32).sum();
                            if let Some(i) =
                                (0..c).find(|&i| r[i] != ((me * c + i) * n) as i32 + total_me)
                            {
                                bad.push(format!(
                                    "world reduce_scatter iteration {it}: [{i}] = {}",
                                    r[i]
                                ));
                            }
                        }
                        Ok(())
                    })();
                    (
                        sub_thread.join().expect("subgroup thread panicked"),
                        world_run.map(|_| bad),
                    )
                });
                let mut bad = sub_bad?;
                bad.extend(world_bad?);
                bad.extend(check_world(world, n)?);
                Ok(bad)
            },
        );
        report(n, res)?;
    }
    Ok(())
}

/// In iteration `it` of one of two loops: raise `mine` after the first iteration, and wait for
/// `other` before the last.
fn rendezvous(it: usize, mine: &AtomicBool, other: &AtomicBool) {
    if it == 1 {
        mine.store(true, Ordering::SeqCst);
    }
    if it == ITERS - 1 {
        while !other.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

/// The subgroup used by the error tests, and its members in order: every rank but rank 0 (every
/// rank in a world of two), reversed, so local and global ranks differ.
fn error_group(
    c: &mut Communicator,
    n: usize,
    me: usize,
) -> Result<(Option<Communicator>, Vec<usize>), CommError> {
    let color = |r: usize| (n == 2 || r != 0).then_some(1);
    let want = members(n, me, color, |r| -(r as i64)).unwrap_or_default();
    Ok((c.split(color(me), -(me as i64))?, want))
}

/// A subgroup member calls all_reduce with another length: every member fails at once with a
/// mismatch naming global ranks (and the subgroup's ranks); both communicators stay usable.
fn t_mismatch_in_subgroup() -> Result<(), String> {
    in_worlds(2..=5, |c, n, me| {
        let mut bad = Vec::new();
        let (sub, want) = error_group(c, n, me)?;
        if let Some(mut sub) = sub {
            // Sub-rank 0 (global rank n-1) passes 11 elements, the others 10.
            let odd = want[0];
            let len = if me == odd { 11 } else { 10 };
            let x = vec![1f32; len];
            let mut y = vec![0f32; len];
            let t = Instant::now();
            match sub.all_reduce(&x, &mut y, ReduceOp::Sum) {
                Err(e @ CommError::Mismatch { .. }) => {
                    let msg = e.to_string();
                    let need = [
                    format!("rank {odd} (rank 0 of this sub-communicator) called all_reduce(count=11"),
                    format!("rank {} (rank 1 of this sub-communicator) called all_reduce(count=10", want[1]),
                ];
                    for s in need {
                        if !msg.contains(&s) {
                            bad.push(format!("mismatch message lacks {s:?}: {msg}"));
                        }
                    }
                }
                r => bad.push(format!("expected a mismatch, got {r:?}")),
            }
            if t.elapsed() > Duration::from_secs(2) {
                bad.push(format!("mismatch took {:?}", t.elapsed()));
            }
            // Refused locally on one member: the others get a mismatch naming it globally.
            let root = if me == odd { 99 } else { 0 };
            let mut b = vec![0u8; 4];
            match (me == odd, sub.broadcast_in_place(&mut b, root)) {
                (true, Err(CommError::InvalidArgument { rank, .. })) if rank == odd => {}
                (false, Err(e @ CommError::Mismatch { .. }))
                    if e.to_string().contains(&format!(
                        "rank {odd} (rank 0 of this sub-communicator) refused its broadcast call"
                    )) => {}
                (_, r) => bad.push(format!(
                    "broadcast with root 99 on global rank {odd}: {r:?}"
                )),
            }
            bad.extend(check_sub(&mut sub, &want, me)?);
        }
        Ok(bad)
    })
}

/// A subgroup member dies: its subgroup peers get `PeerLost` naming its global rank within a
/// second, and no hang; the world communicator reports it too.
fn t_dead_peer_in_subgroup() -> Result<(), String> {
    for n in 2..=5 {
        let mut cfg = cfg(n);
        cfg.fail_fast = false;
        let res = launch(&cfg, move |mut ctx: RankContext| -> RankResult<String> {
            let (c, me) = (&mut ctx.comm, ctx.rank);
            let (sub, want) = error_group(c, n, me)?;
            let victim = want.first().copied().unwrap_or(n - 1);
            if me == victim {
                std::thread::sleep(Duration::from_millis(100));
                std::process::abort();
            }
            let t = Instant::now();
            let e = match sub {
                Some(mut sub) => {
                    let mut x = vec![1f32; 50_000];
                    let e = sub
                        .all_reduce_in_place(&mut x, ReduceOp::Sum)
                        .err()
                        .ok_or("subgroup all_reduce succeeded")?;
                    let my = sub.rank();
                    let msg = e.to_string();
                    let place = format!("of a sub-communicator (rank {victim} is its rank 0, rank {me} its rank {my})");
                    if !matches!(e, CommError::PeerLost { lost_rank, rank, .. } if lost_rank == victim && rank == me)
                        || !msg.contains(&format!("rank {victim} (pid"))
                        || !msg.contains("died")
                        || !msg.contains(&place)
                    {
                        return Err(format!("subgroup error is not PeerLost naming global rank {victim} {place}: {msg}").into());
                    }
                    // A failed subgroup refuses more work.
                    if sub.barrier().is_ok() {
                        return Err("barrier after a lost peer succeeded".into());
                    }
                    e
                }
                // Not in the subgroup: the world communicator notices the death.
                None => {
                    let e = c.barrier().err().ok_or("world barrier succeeded")?;
                    if !matches!(e, CommError::PeerLost { lost_rank, .. } if lost_rank == victim) {
                        return Err(format!(
                            "world error is not PeerLost naming rank {victim}: {e}"
                        )
                        .into());
                    }
                    e
                }
            };
            let took = t.elapsed();
            if took > Duration::from_secs(2) {
                return Err(format!("detection took {took:?}").into());
            }
            // A subgroup member stays until rank 0 (outside the subgroup) has seen the victim's
            // death, so that rank 0 does not see this rank's exit first.
            if n > 2 && me != 0 {
                std::thread::sleep(Duration::from_millis(1000));
            }
            Err(format!("OK-SURVIVOR {e}").into())
        });
        match res {
            Err(LaunchError::RanksFailed(f)) => {
                let survivors: Vec<_> = f
                    .iter()
                    .filter(|x| x.message.starts_with("OK-SURVIVOR"))
                    .collect();
                if survivors.len() != n - 1 {
                    return Err(format!(
                        "world {n}: not every survivor reported the dead peer properly: {f:#?}"
                    ));
                }
            }
            other => return Err(format!("world {n}: unexpected outcome {other:?}")),
        }
    }
    Ok(())
}

/// A subgroup member that does not arrive: its peers time out naming its global rank.
fn t_timeout_in_subgroup() -> Result<(), String> {
    for n in 2..=5 {
        let mut cfg = cfg(n);
        cfg.shm.timeout = Duration::from_millis(400);
        let res = launch(
            &cfg,
            move |mut ctx: RankContext| -> RankResult<Vec<String>> {
                let (c, me) = (&mut ctx.comm, ctx.rank);
                let mut bad = Vec::new();
                let (sub, want) = error_group(c, n, me)?;
                let Some(mut sub) = sub else { return Ok(bad) };
                let late = want[0];
                if me == late {
                    std::thread::sleep(Duration::from_millis(1000));
                    // It arrives after its peers gave up: it fails too, naming itself.
                    if sub.barrier().is_ok() {
                        bad.push("the late rank's barrier succeeded".into());
                    }
                    return Ok(bad);
                }
                match sub.barrier() {
                    Err(e @ (CommError::Timeout { .. } | CommError::Aborted { .. })) => {
                        let msg = e.to_string();
                        let s = format!(
                        "rank {late} (rank 0 of this sub-communicator) is stuck before barrier #1 (rank {late} is at collective #0"
                    );
                        if !msg.contains(&s) {
                            bad.push(format!("timeout message lacks {s:?}: {msg}"));
                        }
                    }
                    r => bad.push(format!("expected a timeout, got {r:?}")),
                }
                Ok(bad)
            },
        );
        report(n, res)?;
    }
    Ok(())
}

/// The named segments in `dir` whose name starts with `prefix`.
fn segments(dir: &Path, prefix: &str) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|f| f.starts_with(prefix))
                .collect()
        })
        .unwrap_or_default()
}

/// Sub-communicators' segments are gone once every member has joined, and after the job: in
/// `/dev/shm`, and in `LOCKSTEP_SHM_DIR` (here through `ShmConfig::shm_dir`).
fn t_segments_removed() -> Result<(), String> {
    let private = std::env::temp_dir().join(format!("lockstep-split-test-{}", std::process::id()));
    std::fs::create_dir_all(&private).map_err(|e| e.to_string())?;
    // Segments of this job are named after the process that made the world segment: this one.
    let prefix = format!("lockstep-p{}.", std::process::id());
    for dir in [None, Some(private.clone())] {
        let shown = dir.clone().unwrap_or_else(|| PathBuf::from("/dev/shm"));
        for n in WORLDS {
            let mut cfg = cfg(n);
            cfg.shm.shm_dir = dir.clone();
            let (shown2, prefix2) = (shown.clone(), prefix.clone());
            let res = launch(
                &cfg,
                move |mut ctx: RankContext| -> RankResult<Vec<String>> {
                    let (c, me) = (&mut ctx.comm, ctx.rank);
                    let mut bad = Vec::new();
                    let mut keep = Vec::new();
                    for round in 0..3 {
                        if let Some(mut s) =
                            c.split((me % (round + 1) != 0).then_some(round as u32), 0)?
                        {
                            if let Some(inner) = s.split(Some(0), -(me as i64))? {
                                keep.push(inner);
                            }
                            keep.push(s);
                        }
                    }
                    if let Some(g) = c.new_group(&[0])? {
                        keep.push(g);
                    }
                    // Every member has joined: no name is left, though the communicators live.
                    c.barrier()?;
                    let left = segments(&shown2, &prefix2);
                    if !left.is_empty() {
                        bad.push(format!(
                            "segments still named in {} while the communicators live: {left:?}",
                            shown2.display()
                        ));
                    }
                    for k in keep.iter_mut() {
                        k.barrier()?;
                    }
                    Ok(bad)
                },
            );
            report(n, res)?;
            let left = segments(&shown, &prefix);
            if !left.is_empty() {
                return Err(format!(
                    "world {n}: segments left in {} after the job: {left:?}",
                    shown.display()
                ));
            }
        }
    }
    let left: Vec<String> = segments(&private, "");
    let _ = std::fs::remove_dir_all(&private);
    if !left.is_empty() {
        return Err(format!(
            "files left in the private segment directory: {left:?}"
        ));
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    runner::run(&[
        ("split_parity_and_none", t_split_parity_and_none),
        ("new_group", t_new_group),
        ("nested", t_nested),
        ("concurrent_subgroups_and_world", t_concurrent),
        ("mismatch_in_subgroup", t_mismatch_in_subgroup),
        ("dead_peer_in_subgroup", t_dead_peer_in_subgroup),
        ("timeout_in_subgroup", t_timeout_in_subgroup),
        ("segments_removed", t_segments_removed),
    ])
}
