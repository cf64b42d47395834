//! Shrinking a shared-memory communicator after a failure (`Communicator::shrink`): forked ranks
//! run a rotating mix of collectives, one is killed (`kill -9`) or stopped, and the survivors
//! agree on a communicator of themselves and go on with correct results.
//!
//! `harness = false`: the tests fork, so the process stays single-threaded; they run in turn and
//! the binary ends with `N passed, M failed`. Each bounds its time and checks that no process and
//! no `lockstep-*` segment is left behind. The moments and victims come from a seed, printed
//! first; `SHRINK_SEED=<n>` replays one.

mod common;

use std::io::Read;
use std::os::fd::{FromRawFd, RawFd};
use std::time::{Duration, Instant};

use common::check;
use lockstep::comm::{CommError, Communicator, ReduceOp};
use lockstep::shm::{ShmConfig, ShmJob};

// -------------------------------------------------------------------------------------------------
// Helpers

/// splitmix64: the moments and victims of a run, from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn seed() -> u64 {
    let s = std::env::var("SHRINK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    println!("seed {s} (replay with SHRINK_SEED={s})");
    s
}

fn pipe() -> (RawFd, RawFd) {
    let mut fds = [0; 2];
    // SAFETY: valid out-array of two fds.
    let r = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(r, 0, "pipe2: {}", std::io::Error::last_os_error());
    (fds[0], fds[1])
}

fn write_all(fd: RawFd, b: &[u8]) {
    // SAFETY: writing a buffer we own to our pipe end; under PIPE_BUF, so atomic.
    unsafe { libc::write(fd, b.as_ptr() as *const libc::c_void, b.len()) };
}

/// A rank's way to tell the parent it reached a point (one byte on a pipe).
#[derive(Clone, Copy)]
struct Ready(RawFd);

impl Ready {
    fn signal(&self) {
        write_all(self.0, b"r");
    }
}

/// Forked ranks: their pids, and the read ends of their ready and result pipes.
struct Ranks {
    pids: Vec<i32>,
    ready: RawFd,
    out: std::fs::File,
}

/// What a rank reported: its exit status (`waitpid` form) and the line it wrote.
struct Ended {
    status: i32,
    msg: String,
}

impl Ended {
    fn killed(&self) -> bool {
        libc::WIFSIGNALED(self.status) && libc::WTERMSIG(self.status) == libc::SIGKILL
    }

    fn ok(&self) -> bool {
        libc::WIFEXITED(self.status) && libc::WEXITSTATUS(self.status) == 0
    }
}

/// Fork `n` ranks running `f(rank, ready)`; each writes its result (one line) to a pipe and
/// `_exit`s 0 on `Ok`, 1 on `Err`.
fn fork_ranks(n: usize, f: impl Fn(usize, Ready) -> Result<String, String>) -> Ranks {
    let (rd, wr) = pipe();
    let (ready_rd, ready_wr) = pipe();
    let mut pids = Vec::new();
    for rank in 0..n {
        // SAFETY: the test process is single-threaded; the child runs `f` and `_exit`s.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let (code, msg) = match f(rank, Ready(ready_wr)) {
                Ok(m) => (0, m),
                Err(m) => (1, m),
            };
            let mut line = format!("{rank}\t{}", msg.replace('\n', " "));
            line.truncate(3000);
            line.push('\n');
            write_all(wr, line.as_bytes());
            // SAFETY: leave the child without running the parent's destructors.
            unsafe { libc::_exit(code) };
        }
        assert!(pid > 0, "fork: {}", std::io::Error::last_os_error());
        pids.push(pid);
    }
    // SAFETY: we own the write ends and do not use them afterwards.
    unsafe {
        libc::close(wr);
        libc::close(ready_wr);
    }
    Ranks {
        pids,
        ready: ready_rd,
        // SAFETY: rd is our pipe end, owned from here on by the File.
        out: unsafe { std::fs::File::from_raw_fd(rd) },
    }
}

impl Ranks {
    /// Wait for `k` ready bytes, at most `timeout`.
    fn await_ready(&self, k: usize, timeout: Duration) -> Result<(), String> {
        let start = Instant::now();
        let mut got = 0;
        while got < k {
            let left = timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Err(format!("{got} of {k} ranks ready after {timeout:?}"));
            }
            let mut p = libc::pollfd {
                fd: self.ready,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            if unsafe { libc::poll(&mut p, 1, left.as_millis().max(1) as i32) } <= 0 {
                continue;
            }
            let mut b = [0u8; 16];
            // SAFETY: reading into a buffer we own, at most its length.
            let r = unsafe {
                libc::read(
                    self.ready,
                    b.as_mut_ptr() as *mut libc::c_void,
                    (k - got).min(16),
                )
            };
            if r == 0 {
                return Err(format!("the ranks ended with {got} of {k} ready"));
            }
            if r > 0 {
                got += r as usize;
            }
        }
        Ok(())
    }

    fn signal(&self, rank: usize, sig: i32) {
        common::signal(self.pids[rank], sig);
    }

    /// Wait at most `deadline` for every rank to end, then kill what is left (and fail).
    fn finish(mut self, deadline: Duration) -> Result<Vec<Ended>, String> {
        let start = Instant::now();
        let mut text = Vec::new();
        let mut late = false;
        loop {
            let left = deadline.saturating_sub(start.elapsed());
            if left.is_zero() {
                late = true;
                break;
            }
            let mut p = libc::pollfd {
                fd: std::os::fd::AsRawFd::as_raw_fd(&self.out),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            if unsafe { libc::poll(&mut p, 1, left.as_millis().max(1) as i32) } <= 0 {
                continue;
            }
            let mut buf = [0u8; 4096];
            match self.out.read(&mut buf) {
                Ok(0) => break,
                Ok(k) => text.extend_from_slice(&buf[..k]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("read: {e}")),
            }
        }
        for &p in &self.pids {
            if late {
                common::signal(p, libc::SIGKILL);
            }
        }
        let mut out: Vec<Ended> = self
            .pids
            .iter()
            .map(|&pid| {
                // A stopped rank must not keep the kill from landing.
                if late {
                    common::signal(pid, libc::SIGCONT);
                }
                let mut st = 0;
                // SAFETY: our child; valid out-parameter.
                unsafe { libc::waitpid(pid, &mut st, 0) };
                Ended {
                    status: st,
                    msg: String::new(),
                }
            })
            .collect();
        // SAFETY: our pipe end, not used afterwards.
        unsafe { libc::close(self.ready) };
        for line in String::from_utf8_lossy(&text).lines() {
            if let Some((r, m)) = line.split_once('\t') {
                if let Some(e) = r.parse::<usize>().ok().and_then(|r| out.get_mut(r)) {
                    e.msg = m.to_string();
                }
            }
        }
        if late {
            let msgs: Vec<&str> = out.iter().map(|e| e.msg.as_str()).collect();
            return Err(format!(
                "ranks still running after {deadline:?} (killed); reports {msgs:?}"
            ));
        }
        Ok(out)
    }
}

/// `lockstep-*` names in /dev/shm.
fn segments() -> Vec<String> {
    let Ok(rd) = std::fs::read_dir("/dev/shm") else {
        return Vec::new();
    };
    let mut v: Vec<String> = rd
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("lockstep-"))
        .collect();
    v.sort();
    v
}

fn no_leftovers(before: &[String]) -> Result<(), String> {
    let new: Vec<String> = segments()
        .into_iter()
        .filter(|n| !before.contains(n))
        .collect();
    check(
        new.is_empty(),
        "no segment left behind in /dev/shm",
        format!("{new:?}"),
    )?;
    let kids = common::children_of(std::process::id() as i32);
    check(kids.is_empty(), "no rank process left", format!("{kids:?}"))
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

/// Element counts, rotating through the paths: inline, one-phase, slots (several chunks).
const COUNTS: [usize; 4] = [3, 300, 5000, 40_000];

/// Collective `j` of the rotating mix (all_reduce, broadcast, reduce_scatter, all_gather,
/// reduce, barrier) on `comm`, its result checked against what it must be.
fn op(comm: &mut Communicator, j: usize) -> Result<(), CommError> {
    let (n, me) = (comm.world_size(), comm.rank());
    let count = COUNTS[(j / 6) % COUNTS.len()];
    let bad = |what: &str, i: usize, got: f32, want: f32| {
        panic_free_err(format!(
            "{what} #{j} on rank {me} of {n}: element {i} is {got}, expected {want}"
        ))
    };
    let tri = (n * (n + 1) / 2) as f32;
    match j % 6 {
        0 => {
            let mut b: Vec<f32> = (0..count)
                .map(|i| ((me + 1) * (1 + i % 7) + j % 5) as f32)
                .collect();
            comm.all_reduce_in_place(&mut b[..], ReduceOp::Sum)?;
            for (i, &v) in b.iter().enumerate() {
                let want = tri * (1 + i % 7) as f32 + (n * (j % 5)) as f32;
                if v != want {
                    return Err(bad("all_reduce", i, v, want));
                }
            }
        }
        1 => {
            let root = j % n;
            let mut b: Vec<f32> = (0..count)
                .map(|i| if me == root { (i + j) as f32 } else { -1.0 })
                .collect();
            comm.broadcast_in_place(&mut b[..], root)?;
            for (i, &v) in b.iter().enumerate() {
                if v != (i + j) as f32 {
                    return Err(bad("broadcast", i, v, (i + j) as f32));
                }
            }
        }
        2 => {
            let send: Vec<f32> = (0..count * n).map(|i| (me + i % 1000) as f32).collect();
            let mut recv = vec![0f32; count];
            comm.reduce_scatter(&send[..], &mut recv[..], ReduceOp::Sum)?;
            for (i, &v) in recv.iter().enumerate() {
                let want = (n * (n - 1) / 2 + n * ((me * count + i) % 1000)) as f32;
                if v != want {
                    return Err(bad("reduce_scatter", i, v, want));
                }
            }
        }
        3 => {
            let send: Vec<f32> = (0..count).map(|i| (me * 1000 + i % 1000) as f32).collect();
            let mut recv = vec![0f32; count * n];
            comm.all_gather(&send[..], &mut recv[..])?;
            for (i, &v) in recv.iter().enumerate() {
                let want = ((i / count) * 1000 + (i % count) % 1000) as f32;
                if v != want {
                    return Err(bad("all_gather", i, v, want));
                }
            }
        }
        4 => {
            let root = (j / 6) % n;
            let send: Vec<f32> = (0..count)
                .map(|i| ((me + 1) * (1 + i % 3)) as f32)
                .collect();
            let mut recv = vec![0f32; count];
            comm.reduce(&send[..], &mut recv[..], ReduceOp::Sum, root)?;
            if me == root {
                for (i, &v) in recv.iter().enumerate() {
                    let want = tri * (1 + i % 3) as f32;
                    if v != want {
                        return Err(bad("reduce", i, v, want));
                    }
                }
            }
        }
        _ => comm.barrier()?,
    }
    Ok(())
}

/// A wrong result, as an error the rank reports (Unsupported carries the text as it is).
fn panic_free_err(msg: String) -> CommError {
    CommError::Unsupported(format!("WRONG RESULT: {msg}"))
}

/// Run the mix on `comm` until a call fails (a peer died or was stopped), at most `limit`;
/// returns the error and when it came.
fn until_failure(comm: &mut Communicator, limit: Duration) -> Result<(CommError, Instant), String> {
    let start = Instant::now();
    let mut j = 0;
    loop {
        if let Err(e) = op(comm, j) {
            let at = Instant::now();
            if e.to_string().contains("WRONG RESULT") {
                return Err(e.to_string());
            }
            return Ok((e, at));
        }
        j += 1;
        if start.elapsed() > limit {
            return Err(format!("no failure within {limit:?} ({j} collectives)"));
        }
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

/// `k` collectives of the mix on `comm`, from `j0`, every result checked.
fn run_mix(comm: &mut Communicator, j0: usize, k: usize) -> Result<(), String> {
    for j in j0..j0 + k {
        op(comm, j).map_err(|e| format!("after shrink, collective {j}: {e}"))?;
    }
    Ok(())
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
