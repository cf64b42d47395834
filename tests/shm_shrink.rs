//! Shrinking a shared-memory communicator after a failure (`Communicator::shrink`): forked ranks
//! run a rotating mix of collectives, one is killed (`kill -9`) or stopped, and the survivors
//! agree on a communicator of themselves and go on with correct results.
//!
//! `harness = false`: the tests fork, so the process stays single-threaded; they run in turn and
//! the binary ends with `N passed, M failed`. Each bounds its time and checks that no process and
//! no `lockstep-*` segment is left behind. The moments and victims come from a seed, printed
//! first; `SHRINK_SEED=<n>` replays one.

mod common;
#[path = "common/mix.rs"]
mod mix;

use std::time::{Duration, Instant};

use common::check;
use common::forked::{fork_ranks, no_leftovers, segments_in, Ended, Ready, Rng};
use lockstep::comm::{CommError, Communicator, ReduceOp};
use lockstep::shm::{ShmConfig, ShmJob};
use mix::{run_mix, until_failure};

// -------------------------------------------------------------------------------------------------
// Helpers

fn seed() -> u64 {
    common::forked::seed("SHRINK_SEED")
}

fn segments() -> Vec<String> {
    segments_in("/dev/shm")
}

fn config() -> ShmConfig {
    ShmConfig {
        slot_bytes: 64 << 10,
        heap_bytes: 2 << 20,
        // A rank that waits for a stopped peer fails after this; nothing else waits this long.
        timeout: Duration::from_secs(10),
        ..ShmConfig::default()
    }
}

/// Join `job` as `rank`, tell the parent, and run the mix until a call fails: the
/// communicator, the error and when it came.
fn join_until_failure(
    job: &ShmJob,
    rank: usize,
    ready: Ready,
) -> Result<(Communicator, CommError, Instant), String> {
    let mut comm = job.communicator(rank).map_err(|e| e.to_string())?;
    comm.barrier().map_err(|e| e.to_string())?;
    ready.signal();
    let (e, seen) = until_failure(&mut comm, Duration::from_secs(20))?;
    Ok((comm, e, seen))
}

/// After a failure `e` (a peer died or was stopped): shrink, and check what the old
/// communicator says from then on. Returns the new communicator and how long shrink took after
/// the failure was seen.
fn shrink_after(
    comm: &mut Communicator,
    e: &CommError,
    seen: Instant,
) -> Result<(Communicator, Duration), String> {
    if !matches!(
        e,
        CommError::PeerLost { .. } | CommError::Aborted { .. } | CommError::Timeout { .. }
    ) {
        return Err(format!("unexpected error before shrink: {e}"));
    }
    let new = comm.shrink().map_err(|e| format!("shrink: {e}"))?;
    let took = seen.elapsed();
    match comm.barrier() {
        Err(CommError::Shrunk { .. }) => {}
        other => return Err(format!("the old communicator after shrink: {other:?}")),
    }
    Ok((new, took))
}

/// What a survivor reports: `ms=<shrink time> rank=<new rank> world=<new world> members=<global ranks>`.
fn report(new: &Communicator, took: Duration) -> String {
    format!(
        "ms={} rank={} world={} members={:?}",
        took.as_millis(),
        new.rank(),
        new.world_size(),
        new.global_ranks()
    )
}

fn field<'a>(msg: &'a str, key: &str) -> Option<&'a str> {
    let at = msg.find(&format!("{key}="))? + key.len() + 1;
    let rest = &msg[at..];
    Some(match key {
        "members" => rest,
        _ => rest.split(' ').next().unwrap_or(""),
    })
}

/// Every survivor (global rank `g`, in `alive` order) reported the same members (`alive`), its
/// place among them as its rank, and a shrink within `bound` of its failure.
fn check_survivors(
    out: &[Ended],
    alive: &[usize],
    bound: Duration,
    what: &str,
) -> Result<Vec<u64>, String> {
    let mut times = Vec::new();
    for (pos, &g) in alive.iter().enumerate() {
        let e = &out[g];
        check(e.ok(), &format!("{what}: survivor {g} passed"), &e.msg)?;
        check(
            field(&e.msg, "members") == Some(&format!("{alive:?}")),
            &format!("{what}: survivor {g} agrees on the members {alive:?}"),
            &e.msg,
        )?;
        check(
            field(&e.msg, "rank") == Some(&pos.to_string())
                && field(&e.msg, "world") == Some(&alive.len().to_string()),
            &format!("{what}: survivor {g} is rank {pos} of {}", alive.len()),
            &e.msg,
        )?;
        let ms: u64 = field(&e.msg, "ms")
            .and_then(|m| m.parse().ok())
            .ok_or_else(|| format!("{what}: no time in {}", e.msg))?;
        check(
            Duration::from_millis(ms) < bound,
            &format!("{what}: survivor {g} shrank within {bound:?} of its failure"),
            &e.msg,
        )?;
        times.push(ms);
    }
    Ok(times)
}

// -------------------------------------------------------------------------------------------------
// Tests

/// 10 times: 4 ranks run the mix, one (seeded) is killed with SIGKILL at a seeded moment; the 3
/// survivors shrink within 1 s of their failure, agree on the members, and run 100 more
/// collectives with correct results.
fn t_kill_then_shrink() -> Result<(), String> {
    let mut rng = Rng(seed());
    let before = segments();
    let mut worst = 0;
    for round in 0..10 {
        let victim = rng.below(4) as usize;
        let delay = Duration::from_micros(rng.below(30_000));
        let job = ShmJob::with_config(4, config()).map_err(|e| e.to_string())?;
        let ranks = fork_ranks(4, |rank, ready| {
            let (mut comm, e, seen) = join_until_failure(&job, rank, ready)?;
            let (mut new, took) = shrink_after(&mut comm, &e, seen)?;
            run_mix(&mut new, 0, 100)?;
            Ok(report(&new, took))
        });
        drop(job);
        ranks.await_ready(4, Duration::from_secs(20))?;
        std::thread::sleep(delay);
        ranks.signal(victim, libc::SIGKILL);
        let out = ranks.finish(Duration::from_secs(30))?;
        let what = format!("round {round} (victim {victim}, after {delay:?})");
        if std::env::var_os("SHRINK_VERBOSE").is_some() {
            for (r, e) in out.iter().enumerate() {
                println!("{what}: rank {r}: {}", e.msg);
            }
        }
        check(
            out[victim].killed(),
            &format!("{what}: the victim was killed"),
            &out[victim].msg,
        )?;
        let alive: Vec<usize> = (0..4).filter(|&r| r != victim).collect();
        let times = check_survivors(&out, &alive, Duration::from_secs(1), &what)?;
        worst = worst.max(times.into_iter().max().unwrap_or(0));
    }
    println!("kill_then_shrink: slowest shrink {worst} ms after its failure");
    no_leftovers(&before)
}

/// A rank stopped (SIGSTOP) while the others run the mix: they time out, shrink without it
/// (it does not call shrink within the wait), and go on; continued (SIGCONT) while they run,
/// it is told it was excluded, on its next call and on shrink, and their results stay right.
fn t_stopped_rank_is_excluded() -> Result<(), String> {
    let before = segments();
    let mut cfg = config();
    cfg.timeout = Duration::from_millis(400);
    let job = ShmJob::with_config(4, cfg).map_err(|e| e.to_string())?;
    let slow = 2;
    let ranks = fork_ranks(4, |rank, ready| {
        let (mut comm, e, seen) = join_until_failure(&job, rank, ready)?;
        if rank == slow {
            // Back from the stop: its call failed (its peers gave up on it and shrank).
            let next = comm.barrier();
            let shrink = comm.shrink();
            let both = format!(
                "first {e}; next {next:?}; shrink {:?}",
                shrink.as_ref().err()
            );
            return match (next, shrink) {
                (
                    Err(CommError::Excluded { generation: 1, .. }),
                    Err(CommError::Excluded { generation: 1, .. }),
                ) => Ok(format!("excluded: {both}")),
                _ => Err(format!("not told it was excluded: {both}")),
            };
        }
        let (mut new, took) = shrink_after(&mut comm, &e, seen)?;
        ready.signal();
        // Run while the stopped rank comes back and fails on the old communicator.
        // At least 100 collectives and 1.5 s; the ranks agree when to stop (a max of their
        // flags), so they all run the same ones.
        let t = Instant::now();
        let mut j = 0;
        loop {
            run_mix(&mut new, j, 1)?;
            j += 1;
            let mut stop = [u32::from(
                j >= 100 && t.elapsed() > Duration::from_millis(1500),
            )];
            new.all_reduce_in_place(&mut stop[..], ReduceOp::Max)
                .map_err(|e| e.to_string())?;
            if stop[0] == 1 {
                break;
            }
        }
        Ok(report(&new, took))
    });
    drop(job);
    ranks.await_ready(4, Duration::from_secs(20))?;
    std::thread::sleep(Duration::from_millis(20));
    ranks.signal(slow, libc::SIGSTOP);
    // The survivors time out (0.4 s), wait for it in shrink (1 s) and report.
    let waited = ranks.await_ready(3, Duration::from_secs(10));
    ranks.signal(slow, libc::SIGCONT);
    waited?;
    let out = ranks.finish(Duration::from_secs(30))?;
    check(
        out[slow].ok() && out[slow].msg.starts_with("excluded"),
        "the stopped rank was told it was excluded",
        &out[slow].msg,
    )?;
    // Its failure (a timeout) is seen after 0.4 s; the wait for the stopped rank is 1 s.
    check_survivors(
        &out,
        &[0, 1, 3],
        Duration::from_millis(2500),
        "stopped rank",
    )?;
    no_leftovers(&before)
}

/// Two deaths in turn: 4 ranks shrink to 3, run, lose another, shrink to 2 and run 100 more.
fn t_repeated_shrink() -> Result<(), String> {
    let mut rng = Rng(seed());
    let before = segments();
    let first = rng.below(4) as usize;
    let second = loop {
        let s = rng.below(4) as usize;
        if s != first {
            break s;
        }
    };
    let job = ShmJob::with_config(4, config()).map_err(|e| e.to_string())?;
    let ranks = fork_ranks(4, |rank, ready| {
        let (mut comm, e, seen) = join_until_failure(&job, rank, ready)?;
        let (mut mid, took1) = shrink_after(&mut comm, &e, seen)?;
        drop(comm);
        run_mix(&mut mid, 0, 12)?;
        ready.signal();
        let (e, seen) = until_failure(&mut mid, Duration::from_secs(20))?;
        let (mut last, took2) = shrink_after(&mut mid, &e, seen)?;
        run_mix(&mut last, 0, 100)?;
        Ok(report(&last, took1.max(took2)))
    });
    drop(job);
    ranks.await_ready(4, Duration::from_secs(20))?;
    ranks.signal(first, libc::SIGKILL);
    ranks.await_ready(3, Duration::from_secs(20))?;
    std::thread::sleep(Duration::from_millis(rng.below(20)));
    ranks.signal(second, libc::SIGKILL);
    let out = ranks.finish(Duration::from_secs(30))?;
    let what = format!("repeated shrink (victims {first} then {second})");
    check(
        out[first].killed() && out[second].killed(),
        &format!("{what}: both victims were killed"),
        format!("{:?} {:?}", out[first].msg, out[second].msg),
    )?;
    let alive: Vec<usize> = (0..4).filter(|&r| r != first && r != second).collect();
    check_survivors(&out, &alive, Duration::from_secs(1), &what)?;
    no_leftovers(&before)
}

fn main() -> std::process::ExitCode {
    common::run(&[
        ("kill_then_shrink", t_kill_then_shrink),
        ("stopped_rank_is_excluded", t_stopped_rank_is_excluded),
        ("repeated_shrink", t_repeated_shrink),
    ])
}
