//! Growing a shared-memory communicator back to its world after a failure
//! (`Communicator::grow`): forked ranks run a rotating mix of checked collectives, one is
//! killed (`kill -9`), the parent forks a replacement for it, and the survivors and the
//! replacement go on as the full world, every rank with its number from before.
//!
//! `harness = false`: the tests fork, so the process stays single-threaded; they run in turn and
//! the binary ends with `N passed, M failed`. Each bounds its time and checks that no process and
//! no `lockstep-*` segment is left behind. The victims and moments come from a seed, printed
//! first; `GROW_SEED=<n>` replays one.

mod common;
#[path = "common/mix.rs"]
mod mix;

use std::time::{Duration, Instant};

use common::check;
use common::forked::{fork_ranks, no_leftovers, segments_in, Ended, Ready, Rng};
use lockstep::comm::{CommError, Communicator};
use lockstep::shm::{ShmConfig, ShmJob};
use mix::{run_mix, until_failure};

const WORLD: usize = 4;

fn config() -> ShmConfig {
    ShmConfig {
        slot_bytes: 64 << 10,
        heap_bytes: 2 << 20,
        timeout: Duration::from_secs(10),
        join_timeout: Duration::from_secs(10),
        ..ShmConfig::default()
    }
}

/// Run the mix until a call fails (a peer died), then grow; checks the old communicator fails
/// with `Shrunk` from then on. Returns the grown communicator and how long the grow took after
/// the failure was seen.
fn fail_then_grow(comm: &mut Communicator) -> Result<(Communicator, Duration), String> {
    let (e, seen) = until_failure(comm, Duration::from_secs(20))?;
    if !matches!(e, CommError::PeerLost { .. } | CommError::Aborted { .. }) {
        return Err(format!("unexpected error before grow: {e}"));
    }
    let new = comm.grow().map_err(|e| format!("grow: {e}"))?;
    let took = seen.elapsed();
    match comm.barrier() {
        Err(CommError::Shrunk { .. }) => {}
        other => return Err(format!("the old communicator after grow: {other:?}")),
    }
    Ok((new, took))
}

/// A process holding the full world's communicator: signal the parent, live through `grows`
/// more deaths (growing after each), then run 100 checked collectives and report
/// `ms=<slowest grow> rank=<rank> world=<world> sub=<is a sub-communicator>`.
fn live(mut comm: Communicator, ready: Ready, grows: usize) -> Result<String, String> {
    let mut worst = Duration::ZERO;
    comm.barrier().map_err(|e| e.to_string())?;
    ready.signal();
    for _ in 0..grows {
        let (mut new, took) = fail_then_grow(&mut comm)?;
        drop(comm);
        worst = worst.max(took);
        new.barrier()
            .map_err(|e| format!("first barrier after grow: {e}"))?;
        ready.signal();
        comm = new;
    }
    run_mix(&mut comm, 0, 100)?;
    Ok(format!(
        "ms={} rank={} world={} sub={}",
        worst.as_millis(),
        comm.rank(),
        comm.world_size(),
        comm.is_sub_communicator()
    ))
}

fn field<'a>(msg: &'a str, key: &str) -> Option<&'a str> {
    let at = msg.find(&format!("{key}="))? + key.len() + 1;
    msg[at..].split(' ').next()
}

/// The processes that ended holding rank `r` (slot `holder[r]` of `out`) each passed, as rank
/// `r` of the full world, a world communicator; returns the slowest grow.
fn check_world(out: &[Ended], holder: &[usize], what: &str) -> Result<u64, String> {
    let mut worst = 0;
    for (r, &slot) in holder.iter().enumerate() {
        let e = &out[slot];
        check(
            e.ok(),
            &format!("{what}: rank {r} (process {slot}) passed"),
            format!("{}: {}", e.describe(), e.msg),
        )?;
        check(
            field(&e.msg, "rank") == Some(&r.to_string())
                && field(&e.msg, "world") == Some(&WORLD.to_string())
                && field(&e.msg, "sub") == Some("false"),
            &format!("{what}: process {slot} is rank {r} of the world of {WORLD}"),
            &e.msg,
        )?;
        worst = worst.max(
            field(&e.msg, "ms")
                .and_then(|m| m.parse().ok())
                .unwrap_or(0),
        );
    }
    Ok(worst)
}

// -------------------------------------------------------------------------------------------------
// Tests

/// 5 times: 4 ranks run the mix, one (seeded) is killed with SIGKILL at a seeded moment and a
/// replacement is forked; the survivors grow with it and all 4 run 100 checked collectives as
/// ranks 0..4 of a world communicator.
fn t_kill_then_grow() -> Result<(), String> {
    let mut rng = Rng(common::forked::seed("GROW_SEED"));
    let before = segments_in("/dev/shm");
    let mut worst = 0;
    for round in 0..5 {
        let victim = rng.below(WORLD as u64) as usize;
        let delay = Duration::from_micros(rng.below(30_000));
        let job = ShmJob::with_config(WORLD, config()).map_err(|e| e.to_string())?;
        let mut ranks = fork_ranks(WORLD, |rank, ready| {
            let comm = job.communicator(rank).map_err(|e| e.to_string())?;
            live(comm, ready, 1)
        });
        ranks.await_ready(WORLD, Duration::from_secs(20))?;
        std::thread::sleep(delay);
        ranks.signal(victim, libc::SIGKILL);
        ranks.fork(|ready| {
            let comm = job
                .join_replacement(victim, 1)
                .map_err(|e| format!("replacement: {e}"))?;
            live(comm, ready, 0)
        });
        drop(job);
        let out = ranks.finish(Duration::from_secs(30))?;
        let what = format!("round {round} (victim {victim}, after {delay:?})");
        check(
            out[victim].killed(),
            &format!("{what}: the victim was killed"),
            &out[victim].msg,
        )?;
        let holder: Vec<usize> = (0..WORLD)
            .map(|r| if r == victim { WORLD } else { r })
            .collect();
        worst = worst.max(check_world(&out, &holder, &what)?);
    }
    println!("kill_then_grow: slowest grow {worst} ms after its failure");
    no_leftovers(&before)
}

/// Two deaths in turn, each followed by a replacement and a grow; the second victim may be the
/// first replacement. All 4 then run 100 checked collectives.
fn t_two_deaths_two_grows() -> Result<(), String> {
    let mut rng = Rng(common::forked::seed("GROW_SEED"));
    let before = segments_in("/dev/shm");
    let first = rng.below(WORLD as u64) as usize;
    let second = rng.below(WORLD as u64) as usize;
    let job = ShmJob::with_config(WORLD, config()).map_err(|e| e.to_string())?;
    let mut ranks = fork_ranks(WORLD, |rank, ready| {
        let comm = job.communicator(rank).map_err(|e| e.to_string())?;
        live(comm, ready, 2)
    });
    // Which process holds each rank.
    let mut holder: Vec<usize> = (0..WORLD).collect();
    for (count, victim) in [(1u64, first), (2, second)] {
        ranks.await_ready(WORLD, Duration::from_secs(20))?;
        std::thread::sleep(Duration::from_micros(rng.below(20_000)));
        ranks.signal(holder[victim], libc::SIGKILL);
        holder[victim] = ranks.pids.len();
        ranks.fork(|ready| {
            let comm = job
                .join_replacement(victim, count)
                .map_err(|e| format!("replacement {count}: {e}"))?;
            live(comm, ready, 2 - count as usize)
        });
    }
    drop(job);
    let out = ranks.finish(Duration::from_secs(30))?;
    let what = format!("two deaths (rank {first}, then rank {second})");
    check_world(&out, &holder, &what)?;
    no_leftovers(&before)
}

/// A rank is killed and no replacement comes: every survivor's grow fails within its wait
/// with an error that names the missing rank; nothing is left behind.
fn t_no_replacement_times_out() -> Result<(), String> {
    let before = segments_in("/dev/shm");
    let victim = 1;
    let wait = Duration::from_millis(1500);
    let job = ShmJob::with_config(3, config()).map_err(|e| e.to_string())?;
    let ranks = fork_ranks(3, |rank, ready| {
        let mut comm = job.communicator(rank).map_err(|e| e.to_string())?;
        comm.barrier().map_err(|e| e.to_string())?;
        ready.signal();
        let (_, seen) = until_failure(&mut comm, Duration::from_secs(20))?;
        match comm.grow_within(wait) {
            Ok(_) => Err("grow succeeded without a replacement".into()),
            Err(e) => Ok(format!("ms={} {e}", seen.elapsed().as_millis())),
        }
    });
    drop(job);
    ranks.await_ready(3, Duration::from_secs(20))?;
    ranks.signal(victim, libc::SIGKILL);
    let out = ranks.finish(Duration::from_secs(30))?;
    for r in [0, 2] {
        let e = &out[r];
        check(
            e.ok(),
            &format!("survivor {r} reported its grow's error"),
            &e.msg,
        )?;
        check(
            e.msg.contains("replacement of rank 1 did not join")
                && e.msg.contains("LOCKSTEP_JOIN_TIMEOUT_S"),
            &format!("survivor {r}'s error names the missing rank and the timeout"),
            &e.msg,
        )?;
        let ms: u64 = field(&e.msg, "ms")
            .and_then(|m| m.parse().ok())
            .unwrap_or(u64::MAX);
        check(
            ms < 5000,
            &format!("survivor {r} gave up within 5 s of its failure"),
            &e.msg,
        )?;
    }
    no_leftovers(&before)
}

/// A replacement that finds no survivors growing fails within the join timeout, saying so.
fn t_replacement_alone_times_out() -> Result<(), String> {
    let before = segments_in("/dev/shm");
    let cfg = ShmConfig {
        join_timeout: Duration::from_millis(500),
        ..config()
    };
    let job = ShmJob::with_config(2, cfg).map_err(|e| e.to_string())?;
    let t = Instant::now();
    let r = job.join_replacement(1, 1);
    let took = t.elapsed();
    let msg = match r {
        Ok(_) => return Err("a replacement joined without survivors".into()),
        Err(e) => e.to_string(),
    };
    check(
        msg.contains("no survivors") && msg.contains("call grow"),
        "the replacement's error says no survivors grew",
        &msg,
    )?;
    check(
        took < Duration::from_secs(3),
        "the replacement gave up within its join timeout",
        format!("{took:?}"),
    )?;
    no_leftovers(&before)
}

fn main() -> std::process::ExitCode {
    common::run(&[
        ("kill_then_grow", t_kill_then_grow),
        ("two_deaths_two_grows", t_two_deaths_two_grows),
        ("no_replacement_times_out", t_no_replacement_times_out),
        ("replacement_alone_times_out", t_replacement_alone_times_out),
    ])
}
