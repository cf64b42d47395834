//! The flight recorder end to end (`lockstep::trace`): ranks forked by `launch` with
//! `LOCKSTEP_TRACE_DIR` set write their records when a call fails for the job and on SIGUSR1,
//! and the analysis (and the `lockstep trace` binary) names the rank that skipped a call.
//!
//! `harness = false`: the tests fork, so the process stays single-threaded; they run in turn.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::check;
use lockstep::comm::ReduceOp;
use lockstep::launch::{launch, LaunchConfig, RankContext, RankResult};
use lockstep::shm::ShmConfig;
use lockstep::trace::{read, Outcome};

/// A fresh, empty directory for one test's traces, and `LOCKSTEP_TRACE_DIR` pointing at it (the
/// ranks inherit it at fork).
fn trace_dir(tag: &str) -> PathBuf {
    let d = fresh_dir(tag);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `LOCKSTEP_TRACE_DIR` pointing at a directory that does not exist yet (the ranks make it).
fn fresh_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("lockstep-trace-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::env::set_var("LOCKSTEP_TRACE_DIR", &d);
    d
}

fn files(d: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(d)
        .map(|r| {
            r.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn config(n: usize, timeout_ms: u64) -> LaunchConfig {
    let mut cfg = LaunchConfig::new(n);
    cfg.shm = ShmConfig {
        slot_bytes: 64 << 10,
        heap_bytes: 2 << 20,
        timeout: Duration::from_millis(timeout_ms),
        ..ShmConfig::default()
    };
    cfg.fail_fast = false;
    cfg
}

/// Three ranks run three all-reduces; rank 2 skips the fourth (it comes late, to a barrier), so
/// ranks 0 and 1 time out in it. Every rank writes its trace, into a `LOCKSTEP_TRACE_DIR` that
/// did not exist; the analysis names rank 2 and collective #4, and so does `lockstep trace`, in
/// text and JSON.
fn t_skipped_call_is_named() -> Result<(), String> {
    let d = fresh_dir("skip");
    let out = launch(
        &config(3, 600),
        |mut ctx: RankContext| -> RankResult<String> {
            for _ in 0..3 {
                ctx.comm
                    .all_reduce_in_place(&mut [1f32; 4], ReduceOp::Sum)?;
            }
            let e = if ctx.rank == 2 {
                std::thread::sleep(Duration::from_millis(1200));
                ctx.comm.barrier().err()
            } else {
                ctx.comm
                    .all_reduce_in_place(&mut [1f32; 4], ReduceOp::Sum)
                    .err()
            };
            // The failed call is in the in-memory record too.
            let last = ctx.comm.trace().pop().ok_or("no records")?;
            Ok(format!(
                "{:?} {}",
                last.outcome != Outcome::Ok,
                e.map_or("passed".into(), |e| e.to_string())
            ))
        },
    )
    .map_err(|e| e.to_string())?;
    for (r, line) in out.iter().enumerate() {
        check(
            line.starts_with("true "),
            &format!("rank {r} failed and recorded it"),
            line,
        )?;
    }
    let names = files(&d);
    check(
        names == ["rank00000.jsonl", "rank00001.jsonl", "rank00002.jsonl"],
        "one file per rank",
        format!("{names:?}"),
    )?;
    let reports = read::report(&d).map_err(|e| e.to_string())?;
    check(
        reports.len() == 1,
        "one communicator",
        format!("{reports:?}"),
    )?;
    let r = &reports[0];
    let div = r
        .divergence
        .as_ref()
        .ok_or(format!("no divergence found:\n{r}"))?;
    check(div.seq == 4, "divergence at collective #4", format!("{r}"))?;
    check(
        div.ranks[2].call.as_deref() == Some("barrier 0×u8")
            && div.ranks[0].call.as_deref() == Some("all_reduce 4×f32"),
        "rank 2 called a barrier where the others all-reduced",
        format!("{r}"),
    )?;
    let stuck = r.stuck.as_ref().ok_or(format!("no stuck call:\n{r}"))?;
    check(
        stuck.seq == 4 && stuck.stuck == [0, 1] && stuck.missing == [2],
        "ranks 0 and 1 stuck in #4, rank 2 never arrived",
        format!("{r}"),
    )?;
    // Of the three calls every rank completed, the recorder timed #1 only (small collectives
    // are timed once in 64, the same ones on every rank), so lateness compares one.
    check(
        r.compared_calls == 1,
        "one timed call compared",
        format!("{r}"),
    )?;
    // The binary: text and JSON.
    let bin = common::lockstep_bin();
    let o = std::process::Command::new(bin)
        .args(["trace", d.to_str().unwrap()])
        .output()
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&o.stdout);
    check(
        o.status.success()
            && text.contains("first divergence: collective #4")
            && text.contains("ranks [2] never arrived"),
        "`lockstep trace` names rank 2 and #4",
        format!("{text}{}", String::from_utf8_lossy(&o.stderr)),
    )?;
    let o = std::process::Command::new(bin)
        .args(["trace", "--json", d.to_str().unwrap()])
        .output()
        .map_err(|e| e.to_string())?;
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).map_err(|e| e.to_string())?;
    check(
        v["comms"][0]["stuck"]["missing"] == serde_json::json!([2])
            && v["comms"][0]["divergence"]["seq"] == 4,
        "`lockstep trace --json` says the same",
        &v,
    )?;
    let _ = std::fs::remove_dir_all(&d);
    Ok(())
}

/// SIGUSR1 to a rank blocked in a barrier writes its trace while the job goes on: rank 0 signals
/// rank 1 (waiting for rank 0 in the barrier), waits for rank 1's file to appear, then joins the
/// barrier; both ranks finish their calls.
fn t_sigusr1_dumps_while_running() -> Result<(), String> {
    let d = trace_dir("usr1");
    let dir = d.clone();
    let out = launch(
        &config(2, 20_000),
        move |mut ctx: RankContext| -> RankResult<usize> {
            let pid = std::process::id() as u64;
            let mut pids = [0u64; 2];
            ctx.comm.all_gather(&[pid][..], &mut pids[..])?;
            for _ in 0..5 {
                ctx.comm
                    .all_reduce_in_place(&mut [1f32; 4], ReduceOp::Sum)?;
            }
            if ctx.rank == 0 {
                // SAFETY: kill(2) with a pid and a signal number.
                unsafe { libc::kill(pids[1] as i32, libc::SIGUSR1) };
                let file = dir.join("rank00001.jsonl");
                let t = Instant::now();
                while !file.exists() {
                    if t.elapsed() > Duration::from_secs(10) {
                        return Err("rank 1's trace did not appear within 10 s".into());
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            ctx.comm.barrier()?;
            ctx.comm
                .all_reduce_in_place(&mut [1f32; 4], ReduceOp::Sum)?;
            Ok(ctx.comm.trace().len())
        },
    )
    .map_err(|e| e.to_string())?;
    check(
        out == [8, 8],
        "both ranks went on after the signal",
        format!("{out:?}"),
    )?;
    check(
        files(&d) == ["rank00001.jsonl"],
        "only rank 1 wrote",
        format!("{:?}", files(&d)),
    )?;
    let t = read::read_dir(&d).map_err(|e| e.to_string())?;
    let rank1 = &t["world"][0];
    let states: Vec<&str> = rank1.lines.iter().map(|l| l.state.as_str()).collect();
    check(
        rank1.header.reason == "signal"
            && states == ["ok", "ok", "ok", "ok", "ok", "ok", "running"]
            && rank1.lines[6].op == "barrier",
        "rank 1's file shows six calls done and the barrier running",
        format!("{:?} {states:?}", rank1.header.reason),
    )?;
    let _ = std::fs::remove_dir_all(&d);
    Ok(())
}

/// `LOCKSTEP_TRACE_BUFFER`: 3 keeps the last three calls, 0 keeps none (and a dump says why),
/// and a malformed value stops the launch, naming the variable.
fn t_buffer_size_and_off() -> Result<(), String> {
    let d = trace_dir("size");
    let run = |n: &str| {
        std::env::set_var("LOCKSTEP_TRACE_BUFFER", n);
        let dir = d.clone();
        let r = launch(
            &config(2, 20_000),
            move |mut ctx: RankContext| -> RankResult<(Vec<u64>, String)> {
                for _ in 0..5 {
                    ctx.comm
                        .all_reduce_in_place(&mut [1f32; 4], ReduceOp::Sum)?;
                }
                let ids = ctx.comm.trace().iter().map(|r| r.seq).collect();
                let dumped = match ctx.comm.dump_trace(&dir) {
                    Ok(p) => p.display().to_string(),
                    Err(e) => e.to_string(),
                };
                Ok((ids, dumped))
            },
        );
        std::env::remove_var("LOCKSTEP_TRACE_BUFFER");
        r.map_err(|e| e.to_string())
    };
    let three = run("3")?;
    check(
        three
            .iter()
            .all(|(ids, p)| ids == &[3, 4, 5] && p.ends_with(".jsonl")),
        "3 keeps collectives #3..#5 and dumps",
        format!("{three:?}"),
    )?;
    let t = read::read_dir(&d).map_err(|e| e.to_string())?;
    check(
        t["world"].len() == 2
            && t["world"]
                .iter()
                .all(|r| r.lines.len() == 3 && r.header.reason == "request"),
        "each rank's file holds its three records",
        format!(
            "{:?}",
            t["world"].iter().map(|r| r.lines.len()).collect::<Vec<_>>()
        ),
    )?;
    let off = run("0")?;
    check(
        off.iter()
            .all(|(ids, e)| ids.is_empty() && e.contains("LOCKSTEP_TRACE_BUFFER is 0")),
        "0 records nothing and the dump says why",
        format!("{off:?}"),
    )?;
    let bad = run("many").err().unwrap_or_default();
    check(
        bad.contains("LOCKSTEP_TRACE_BUFFER") && bad.contains("many"),
        "a malformed value stops the launch",
        &bad,
    )?;
    let _ = std::fs::remove_dir_all(&d);
    Ok(())
}

/// `set_trace(false)` pauses the recorder: the calls made meanwhile are not recorded, those
/// before stay readable and dumpable, and `set_trace(true)` records again, numbering the calls
/// as the communicator does (the all-reduce after four paused ones is collective #8).
fn t_pause_and_resume() -> Result<(), String> {
    let d = trace_dir("pause");
    let dir = d.clone();
    let out = launch(
        &config(2, 20_000),
        move |mut ctx: RankContext| -> RankResult<(Vec<u64>, Vec<u64>, bool)> {
            let mut x = [1f32; 4];
            for _ in 0..3 {
                ctx.comm.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
            }
            ctx.comm.set_trace(false);
            ctx.comm.set_trace(false);
            for _ in 0..4 {
                ctx.comm.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
            }
            let paused: Vec<u64> = ctx.comm.trace().iter().map(|r| r.seq).collect();
            let dumped = ctx.comm.dump_trace(&dir).is_ok();
            ctx.comm.set_trace(true);
            ctx.comm.set_trace(true);
            // The same call as the last one recorded: it must not join that call's run.
            ctx.comm.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
            let resumed = ctx.comm.trace().iter().map(|r| r.seq).collect();
            Ok((paused, resumed, dumped))
        },
    )
    .map_err(|e| e.to_string())?;
    let _ = std::fs::remove_dir_all(&d);
    check(
        out.iter()
            .all(|(p, r, dumped)| p == &[1, 2, 3] && *dumped && r == &[1, 2, 3, 8]),
        "paused calls are not recorded, earlier ones stay, recording resumes",
        format!("{out:?}"),
    )
}

/// A failure stops the job (fail fast) while rank 2 computes, in no call, so no failure of its
/// own would make it write: the launcher asks it (SIGUSR1) before it terminates it, and its file
/// shows its three all-reduces; rank 1, waiting in the fourth when rank 0 fails, writes its own.
/// The stop does not wait for rank 2's computation.
fn t_fail_fast_collects_every_trace() -> Result<(), String> {
    let d = fresh_dir("stop");
    let mut cfg = config(3, 20_000);
    cfg.fail_fast = true;
    let t0 = Instant::now();
    let r = launch(&cfg, |mut ctx: RankContext| -> RankResult<()> {
        for _ in 0..3 {
            ctx.comm
                .all_reduce_in_place(&mut [1f32; 4], ReduceOp::Sum)?;
        }
        match ctx.rank {
            0 => {
                std::thread::sleep(Duration::from_millis(300));
                Err("rank 0 gives up".into())
            }
            1 => Ok(ctx
                .comm
                .all_reduce_in_place(&mut [1f32; 4], ReduceOp::Sum)?),
            _ => {
                std::thread::sleep(Duration::from_secs(20));
                Ok(())
            }
        }
    });
    let took = t0.elapsed();
    check(r.is_err(), "the job fails", format!("{r:?}"))?;
    check(
        took < Duration::from_secs(10),
        "the stop does not wait for rank 2's sleep",
        format!("{took:?}"),
    )?;
    let names = files(&d);
    check(
        names.contains(&"rank00001.jsonl".to_string())
            && names.contains(&"rank00002.jsonl".to_string()),
        "ranks 1 and 2 wrote their traces",
        format!("{names:?}"),
    )?;
    check(
        names.iter().all(|n| !n.starts_with('.')),
        "no write's temporary is left behind",
        format!("{names:?}"),
    )?;
    let two = std::fs::read_to_string(d.join("rank00002.jsonl")).map_err(|e| e.to_string())?;
    let calls = two
        .lines()
        .filter(|l| l.contains("\"op\":\"all_reduce\""))
        .count();
    check(
        calls == 3,
        "rank 2's file holds its three all-reduces",
        &two,
    )?;
    let _ = std::fs::remove_dir_all(&d);
    Ok(())
}

fn main() -> std::process::ExitCode {
    common::run(&[
        ("skipped_call_is_named", t_skipped_call_is_named),
        ("sigusr1_dumps_while_running", t_sigusr1_dumps_while_running),
        ("buffer_size_and_off", t_buffer_size_and_off),
        ("pause_and_resume", t_pause_and_resume),
        (
            "fail_fast_collects_every_trace",
            t_fail_fast_collects_every_trace,
        ),
    ])
}
