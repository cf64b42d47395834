//! `lockstep status` against live jobs: a rank stopped with SIGSTOP is named as behind, at the
//! collective it is stuck in, and the others as waiting for it, by the library and by the
//! binary, within 100 ms of reading; two jobs at once (one forked, one exec'd by `lockstep
//! launch`) are both listed and a finished one disappears.
//!
//! `harness = false`: the tests fork, so the process stays single-threaded. Each bounds its time
//! and checks that no process it started is left behind.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{alive, check, signal, wait_until};
use lockstep::comm::ReduceOp;
use lockstep::launch::{launch, LaunchConfig, RankContext, RankResult};
use lockstep::status::{job_status, list_jobs, JobStatus};

/// The reader's own time (discovery and reads, as the library measures it) must stay under this.
const READ_BOUND_US: u64 = 100_000;

/// Fork a launcher process that runs `launch()` with `n` ranks, each looping 1 KiB all-reduces
/// until `stop` exists (checked collectively every 256 calls, so every rank stops at the same
/// collective) or 60 s pass. Returns the launcher's pid.
fn start_forked_job(n: usize, stop: &Path) -> i32 {
    let stop = stop.to_path_buf();
    // SAFETY: the test process is single-threaded; the child runs `launch` and `_exit`s.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: plain prctl: the launcher dies with the test.
        unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) };
        let mut cfg = LaunchConfig::new(n);
        cfg.capture_output = false;
        let r = launch(&cfg, move |mut ctx: RankContext| -> RankResult<u64> {
            let t = Instant::now();
            let mut x = vec![1f32; 256];
            let mut i = 0u64;
            loop {
                ctx.comm.all_reduce_in_place(&mut x, ReduceOp::Max)?;
                i += 1;
                if i.is_multiple_of(256) {
                    let done = stop.exists() || t.elapsed() > Duration::from_secs(60);
                    let mut f = [done as u32 as f32];
                    ctx.comm.all_reduce_in_place(&mut f, ReduceOp::Max)?;
                    if f[0] > 0.0 {
                        return Ok(i);
                    }
                }
            }
        });
        // SAFETY: leave the child without running the parent's destructors.
        unsafe { libc::_exit(if r.is_ok() { 0 } else { 1 }) };
    }
    pid
}

/// Wait for `pid` (a child) at most `limit`; kill it if it is still there. Its exit status.
fn reap(pid: i32, limit: Duration) -> Option<i32> {
    let t = Instant::now();
    loop {
        let mut st = 0;
        // SAFETY: waitpid on our own child with a valid out-pointer.
        let r = unsafe { libc::waitpid(pid, &mut st, libc::WNOHANG) };
        if r == pid {
            return Some(st);
        }
        if r < 0 || t.elapsed() > limit {
            signal(pid, libc::SIGKILL);
            // SAFETY: as above, blocking.
            unsafe { libc::waitpid(pid, &mut st, 0) };
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn scratch_file(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("lockstep-status-{}-{name}", std::process::id()));
    let _ = std::fs::remove_file(&p);
    p
}

/// The job's status once every rank has joined and made `min_seq` collectives.
fn wait_started(id: &str, world: usize, min_seq: u64) -> Result<JobStatus, String> {
    let mut last = String::new();
    let ok = wait_until(Duration::from_secs(20), || match job_status(id) {
        Ok(s) => {
            let ready = s.ranks.len() == world
                && s.ranks
                    .iter()
                    .all(|r| r.member == "joined" && r.seq >= min_seq);
            last = s.text();
            ready
        }
        Err(e) => {
            last = e.to_string();
            false
        }
    });
    check(ok, &format!("job {id} running with {world} ranks"), &last)?;
    job_status(id).map_err(|e| e.to_string())
}

fn json(text: &str) -> Result<serde_json::Value, String> {
    serde_json::from_str(text).map_err(|e| format!("not JSON ({e}): {text}"))
}

/// Rank 1 of 3 stopped: everybody names it behind at its collective, the others wait for it.
fn t_stopped_rank_is_behind() -> Result<(), String> {
    let stop = scratch_file("stopped");
    let launcher = start_forked_job(3, &stop);
    let id = launcher.to_string();
    let result = (|| -> Result<(), String> {
        let s = wait_started(&id, 3, 1000)?;
        let victim = s.ranks[1].pid;
        signal(victim, libc::SIGSTOP);
        // Wait until the stop has taken effect and the peers have run into it.
        let settled = wait_until(Duration::from_secs(10), || {
            job_status(&id).is_ok_and(|s| {
                s.ranks[1].proc_state == Some('T')
                    && s.ranks[0].waiting_for == [1]
                    && s.ranks[2].waiting_for == [1]
            })
        });
        std::thread::sleep(Duration::from_millis(300));
        // The library.
        let t = Instant::now();
        let s = job_status(&id).map_err(|e| e.to_string())?;
        let lib_wall = t.elapsed();
        let text = s.text();
        check(
            settled,
            "the peers came to wait for the stopped rank",
            &text,
        )?;
        let stuck = s.ranks[1].seq;
        check(
            s.ranks[1].behind && !s.ranks[0].behind && !s.ranks[2].behind,
            "rank 1, and only it, is behind",
            &text,
        )?;
        check(
            s.ranks[0].waiting_for == [1] && s.ranks[2].waiting_for == [1],
            "ranks 0 and 2 wait for rank 1",
            &text,
        )?;
        check(
            s.ranks[0].seq >= stuck
                && s.ranks[0].seq <= stuck + 1
                && s.ranks[1].proc_state == Some('T'),
            "rank 1 is stopped at its collective, the others at most one further",
            &text,
        )?;
        check(
            s.ranks
                .iter()
                .all(|r| r.op.as_deref() == Some("all_reduce") && !r.moving),
            "every rank is in an all_reduce and none moves",
            &text,
        )?;
        check(
            s.ranks[0].waited_ms.is_some_and(|ms| ms >= 200),
            "rank 0 has waited in its call for at least 200 ms",
            &text,
        )?;
        check(
            s.summary
                .iter()
                .any(|l| l.contains("wait for rank 1") && l.contains("(stopped)"))
                && s.summary.iter().any(|l| l.contains(&format!("#{stuck}"))),
            "the summary names the stopped rank and its collective",
            &text,
        )?;
        check(
            s.read_us < READ_BOUND_US,
            &format!("the reader answered within {READ_BOUND_US} us"),
            format!("{} us (wall {lib_wall:?})", s.read_us),
        )?;
        // The binary, with --json: the same answer.
        let t = Instant::now();
        let out = Command::new(common::lockstep_bin())
            .args(["status", &id, "--json"])
            .output()
            .map_err(|e| e.to_string())?;
        let bin_wall = t.elapsed();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        check(
            out.status.success(),
            "lockstep status --json exits 0",
            format!("{stdout}{}", String::from_utf8_lossy(&out.stderr)),
        )?;
        let v = json(&stdout)?;
        let ranks = v["ranks"].as_array().cloned().unwrap_or_default();
        check(
            ranks.len() == 3
                && ranks[1]["behind"] == true
                && ranks[1]["seq"] == stuck
                && ranks[1]["proc_state"] == "T"
                && ranks[0]["waiting_for"] == serde_json::json!([1])
                && ranks[2]["waiting_for"] == serde_json::json!([1])
                && ranks[0]["behind"] == false,
            "the binary's JSON names rank 1 behind at its collective and the others waiting for it",
            &stdout,
        )?;
        let read_us = v["read_us"].as_u64().unwrap_or(u64::MAX);
        check(
            read_us < READ_BOUND_US,
            &format!("the binary's reader answered within {READ_BOUND_US} us"),
            format!("{read_us} us (process wall {bin_wall:?})"),
        )?;
        println!(
            "  reader: library {} us ({lib_wall:?} wall), binary {read_us} us ({bin_wall:?} wall with process start)",
            s.read_us
        );
        // The job goes on once the rank continues.
        signal(victim, libc::SIGCONT);
        let moved = wait_until(Duration::from_secs(10), || {
            job_status(&id).is_ok_and(|s| s.ranks.iter().all(|r| r.seq > stuck + 1))
        });
        check(moved, "the job goes on after SIGCONT", "")?;
        Ok(())
    })();
    // Stop the job whatever happened; a stopped rank is continued first.
    let pids: Vec<i32> = job_status(&id)
        .map(|s| s.ranks.iter().map(|r| r.pid).collect())
        .unwrap_or_default();
    for &p in &pids {
        signal(p, libc::SIGCONT);
    }
    let _ = std::fs::write(&stop, b"");
    let st = reap(launcher, Duration::from_secs(20));
    let _ = std::fs::remove_file(&stop);
    result?;
    check(
        st.is_some_and(|s| libc::WIFEXITED(s) && libc::WEXITSTATUS(s) == 0),
        "the job ended cleanly",
        format!("{st:?}"),
    )?;
    check(
        pids.iter().all(|&p| !alive(p)),
        "no rank is left",
        format!("{pids:?}"),
    )?;
    let l = list_jobs().map_err(|e| e.to_string())?;
    check(
        !l.jobs.iter().any(|j| j.id == id),
        "the finished job is no longer listed",
        l.text(),
    )
}

/// Two jobs at once, a forked one and one exec'd by `lockstep launch`, are both listed (also by
/// `lockstep status --json`); each disappears once it has finished.
fn t_two_jobs_listed() -> Result<(), String> {
    let stop = scratch_file("two");
    let forked = start_forked_job(2, &stop);
    let id = forked.to_string();
    let mut exec = Command::new(common::lockstep_bin())
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--",
            common::lockstep_bin(),
            "selftest",
            "--iters",
            "100000000",
            "--count",
            "16",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| e.to_string())?;
    let exec_pid = exec.id() as i32;
    let result = (|| -> Result<(), String> {
        wait_started(&id, 2, 1)?;
        // The exec'd job: the one whose holders include a child of the `lockstep launch` process.
        let mut exec_id = String::new();
        let found = wait_until(Duration::from_secs(20), || {
            list_jobs().is_ok_and(|l| {
                l.jobs.iter().any(|j| {
                    let ours = !j.forked
                        && j.joined == 2
                        && j.rank_pids.iter().any(|&p| {
                            common::children_of(exec_pid).contains(&p)
                                || common::grandchildren_of(exec_pid).contains(&p)
                        });
                    if ours {
                        exec_id = j.id.clone();
                    }
                    ours
                })
            })
        });
        let l = list_jobs().map_err(|e| e.to_string())?;
        check(found, "the exec'd job is listed", l.text())?;
        check(
            l.jobs
                .iter()
                .any(|j| j.id == id && j.forked && j.world == 2),
            "the forked job is listed",
            l.text(),
        )?;
        let out = Command::new(common::lockstep_bin())
            .args(["status", "--json"])
            .output()
            .map_err(|e| e.to_string())?;
        let v = json(&String::from_utf8_lossy(&out.stdout))?;
        let ids: Vec<String> = v["jobs"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .filter_map(|j| j["id"].as_str().map(str::to_string))
            .collect();
        check(
            ids.contains(&id) && ids.contains(&exec_id),
            "lockstep status --json lists both jobs",
            format!("{ids:?} ({id}, {exec_id})"),
        )?;
        let s = job_status(&exec_id).map_err(|e| e.to_string())?;
        check(
            s.ranks.len() == 2 && s.ranks.iter().all(|r| r.member == "joined" && r.seq >= 1),
            "the exec'd job's ranks are read",
            s.text(),
        )?;
        // The forked job finishes: it disappears, the other stays.
        std::fs::write(&stop, b"").map_err(|e| e.to_string())?;
        let st = reap(forked, Duration::from_secs(20));
        check(st.is_some(), "the forked job finished", "")?;
        let l = list_jobs().map_err(|e| e.to_string())?;
        check(
            !l.jobs.iter().any(|j| j.id == id) && l.jobs.iter().any(|j| j.id == exec_id),
            "the finished job is gone, the other still listed",
            l.text(),
        )?;
        // The exec'd one is stopped by its launcher (SIGTERM): it disappears too.
        signal(exec_pid, libc::SIGTERM);
        let _ = exec.wait();
        let gone = wait_until(Duration::from_secs(10), || {
            list_jobs().is_ok_and(|l| !l.jobs.iter().any(|j| j.id == exec_id))
        });
        check(
            gone,
            "the stopped exec'd job is gone",
            list_jobs().map(|l| l.text()).unwrap_or_default(),
        )?;
        let e = job_status(&exec_id)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        check(
            e.contains("no running lockstep job of yours matches"),
            "asking for a finished job says it is not running",
            &e,
        )
    })();
    let _ = std::fs::write(&stop, b"");
    reap(forked, Duration::from_secs(20));
    if exec.try_wait().ok().flatten().is_none() {
        signal(exec_pid, libc::SIGKILL);
        let _ = exec.wait();
    }
    let _ = std::fs::remove_file(&stop);
    result
}

/// Another user's process is refused by name; no job at all is a message, exit 0.
fn t_refusals() -> Result<(), String> {
    // pid 1 belongs to root: refused unless the test runs as root, where it is simply no job.
    let e = job_status("1")
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    // SAFETY: plain getter.
    let root = unsafe { libc::geteuid() } == 0;
    check(
        if root {
            e.contains("no running lockstep job of yours matches")
        } else {
            e.contains("belongs to another user")
        },
        "pid 1 is not a job of ours",
        &e,
    )?;
    let out = Command::new(common::lockstep_bin())
        .args(["status", "no-such-job-id"])
        .output()
        .map_err(|e| e.to_string())?;
    let err = String::from_utf8_lossy(&out.stderr);
    check(
        out.status.code() == Some(1)
            && err.contains("no running lockstep job of yours matches \"no-such-job-id\""),
        "an unknown job is an error (exit 1) that says so",
        &err,
    )?;
    let out = Command::new(common::lockstep_bin())
        .args(["status"])
        .output()
        .map_err(|e| e.to_string())?;
    check(
        out.status.success(),
        "lockstep status exits 0",
        String::from_utf8_lossy(&out.stderr),
    )
}

fn main() -> std::process::ExitCode {
    common::run(&[
        ("stopped_rank_is_behind", t_stopped_rank_is_behind),
        ("two_jobs_listed", t_two_jobs_listed),
        ("refusals", t_refusals),
    ])
}
