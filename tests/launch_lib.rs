//! Tests of the library launcher [`lockstep::launch::launch`]: forks ranks from this process, so
//! this is a `harness = false` target that runs its tests one after another on the main thread.
//! Output tests re-run this binary in a child mode (`LOCKSTEP_TEST_MODE`) to capture its stdout.

mod common;
#[path = "common/rank_lines.rs"]
mod rank_lines;

use std::io::Write;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{check, marked, new_mark, scratch, signal, wait_until};
use lockstep::launch::{launch, monotonic_ns, LaunchConfig, LaunchError};
use lockstep::ReduceOp;

fn cfg(n: usize) -> LaunchConfig {
    let mut c = LaunchConfig::new(n);
    c.grace = Duration::from_secs(2);
    c
}

/// The error of a launch that must fail.
fn launch_failed<R>(r: Result<Vec<R>, LaunchError>) -> Result<LaunchError, String> {
    match r {
        Err(e) => Ok(e),
        Ok(_) => Err(check(false, "launch must fail", "").unwrap_err()),
    }
}

/// The launch took less than `limit_s` seconds since `t`.
fn within(t: Instant, limit_s: f64, what: &str) -> Result<(), String> {
    let took = t.elapsed();
    check(
        took < Duration::from_secs_f64(limit_s),
        what,
        format!("{took:?}"),
    )
}

fn ready_time_and_repeated_launch() -> Result<(), String> {
    // Each launch: t0 before the call; every rank reports when its communicator was ready.
    let fds = || {
        std::fs::read_dir("/proc/self/fd")
            .map(|d| d.count())
            .unwrap_or(0)
    };
    let fds_before = fds();
    let mut worst = Vec::new();
    for _ in 0..7 {
        let t0 = monotonic_ns();
        let ready = launch(&cfg(2), |mut ctx| {
            let t = monotonic_ns();
            let mut v = [ctx.rank as f32 + 1.0; 16];
            ctx.comm.all_reduce_in_place(&mut v[..], ReduceOp::Sum)?;
            if v[0] != 3.0 {
                return Err("wrong sum".into());
            }
            Ok(t)
        })
        .map_err(|e| e.to_string())?;
        worst.push((ready.iter().max().expect("2 ranks") - t0) as f64 / 1e6);
    }
    worst.sort_by(|a, b| a.partial_cmp(b).expect("finite"));
    let median = worst[worst.len() / 2];
    println!("    launch → every rank ready (2 ranks): median {median:.2} ms, all {worst:.2?}");
    check(
        fds() == fds_before,
        "repeated launches leak no file descriptors",
        format!("{fds_before} before, {} after", fds()),
    )?;
    // The target is 10 ms; allow slack for a loaded 2-core CI machine.
    check(
        median < 50.0,
        "ranks must be ready quickly",
        format!("median {median:.2} ms"),
    )
}

fn fail_fast_error_reports_root_cause() -> Result<(), String> {
    let t = Instant::now();
    let r = launch(&cfg(3), |ctx| -> lockstep::launch::RankResult<u32> {
        if ctx.rank == 1 {
            eprintln!("about to fail");
            return Err("boom on purpose".into());
        }
        std::thread::sleep(Duration::from_secs(30));
        Ok(0)
    });
    let Err(e @ LaunchError::RanksFailed(_)) = r else {
        return check(false, "launch must fail", "");
    };
    let f = e.failures();
    check(
        f[0].rank == 1
            && f[0].message == "boom on purpose"
            && f[0].exit_code == 1
            && !f[0].terminated_by_launcher,
        "root cause first",
        format!("{e}"),
    )?;
    check(
        f[0].stderr_tail == vec!["about to fail".to_string()],
        "stderr tail is kept",
        format!("{:?}", f[0].stderr_tail),
    )?;
    check(
        f.len() == 3
            && f[1..]
                .iter()
                .all(|x| x.terminated_by_launcher && x.exit_code == 128 + libc::SIGTERM),
        "others terminated",
        format!("{e}"),
    )?;
    check(
        e.exit_code() == 1 && e.to_string().contains("failed first"),
        "summary",
        format!("{e}"),
    )?;
    within(t, 2.0, "fast")
}

fn kill9_rank_gives_peer_lost() -> Result<(), String> {
    let mut c = cfg(2);
    c.fail_fast = false; // let the survivor see the loss itself
    let r = launch(&c, |mut ctx| -> lockstep::launch::RankResult<()> {
        let mut v = vec![1.0f32; 1024];
        for i in 0.. {
            if ctx.rank == 1 && i == 50 {
                // SAFETY: plain syscall, killing this process.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            }
            ctx.comm.all_reduce_in_place(&mut v[..], ReduceOp::Max)?;
        }
        Ok(())
    });
    let e = launch_failed(r)?;
    let f = e.failures();
    check(
        f.len() == 2 && f[0].rank == 1 && f[0].exit_code == 137,
        "root cause is the killed rank",
        format!("{e}"),
    )?;
    check(
        f[1].message.contains("rank 1 (pid")
            && f[1].message.contains("died while rank 0 was in all_reduce"),
        "survivor reports PeerLost",
        format!("{e}"),
    )
}

fn hung_rank_is_named_after_the_timeout() -> Result<(), String> {
    let mut c = cfg(2);
    c.shm.timeout = Duration::from_millis(500);
    let t = Instant::now();
    let r = launch(&c, |mut ctx| -> lockstep::launch::RankResult<()> {
        if ctx.rank == 1 {
            std::thread::sleep(Duration::from_secs(30)); // hangs outside any collective
        }
        let mut v = [1.0f32; 4];
        ctx.comm.all_reduce_in_place(&mut v[..], ReduceOp::Sum)?;
        Ok(())
    });
    let e = launch_failed(r)?;
    let f = e.failures();
    check(
        f[0].rank == 0
            && f[0].message.contains("timed out")
            && f[0].message.contains("rank 1 is at collective #0"),
        "the waiting rank names the hung one",
        format!("{e}"),
    )?;
    check(
        f.len() == 2 && f[1].terminated_by_launcher,
        "the hung rank is terminated",
        format!("{e}"),
    )?;
    within(t, 3.0, "prompt")
}

fn panics_and_exits_are_reported() -> Result<(), String> {
    let r = launch(&cfg(2), |ctx| -> lockstep::launch::RankResult<()> {
        if ctx.rank == 0 {
            panic!("rank zero panics");
        }
        Ok(())
    });
    let e = launch_failed(r)?;
    check(
        e.failures()[0].message.contains("rank zero panics") && e.failures()[0].exit_code == 101,
        "panic message",
        format!("{e}"),
    )?;
    let r = launch(&cfg(2), |ctx| -> lockstep::launch::RankResult<()> {
        if ctx.rank == 1 {
            std::process::exit(7);
        }
        Ok(())
    });
    let e = launch_failed(r)?;
    check(
        e.exit_code() == 7,
        "exit code of the root cause",
        format!("{e}"),
    )
}

fn log_dir_and_filter() -> Result<(), String> {
    let d = scratch("liblogs");
    let mut c = cfg(2);
    c.log_dir = Some(d.to_path_buf());
    c.ranks_filter = Some(vec![]); // nothing on the console
    launch(&c, |ctx| {
        println!("hello from {}", ctx.rank);
        Ok(())
    })
    .map_err(|e| e.to_string())?;
    for r in 0..2 {
        let t =
            std::fs::read_to_string(d.join(format!("rank-{r}.log"))).map_err(|e| e.to_string())?;
        check(t == format!("hello from {r}\n"), "log file content", &t)?;
    }
    Ok(())
}

fn mode_of(p: &std::path::Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::symlink_metadata(p)
        .map(|m| m.permissions().mode() & 0o7777)
        .unwrap_or(0)
}

fn chmod(p: &std::path::Path, mode: u32) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))
        .map_err(|e| format!("chmod {}: {e}", p.display()))
}

/// Launch `n` quiet ranks that each log one line into `dir`.
fn launch_logging(n: usize, dir: &std::path::Path) -> Result<(), String> {
    let mut c = cfg(n);
    c.log_dir = Some(dir.to_path_buf());
    c.ranks_filter = Some(vec![]);
    launch(&c, |ctx| {
        println!("log line of rank {}", ctx.rank);
        Ok(())
    })
    .map(drop)
    .map_err(|e| e.to_string())
}

/// A launch logging into `dir` is refused with a message that says each of `needles`.
fn log_dir_refused(
    n: usize,
    dir: &std::path::Path,
    needles: &[&str],
    what: &str,
) -> Result<(), String> {
    let e = launch_logging(n, dir).err().unwrap_or_default();
    check(needles.iter().all(|x| e.contains(x)), what, &e)
}

/// The file at `p` still holds `content`.
fn still_holds(p: &std::path::Path, content: &str, what: &str) -> Result<(), String> {
    check(
        std::fs::read_to_string(p).ok().as_deref() == Some(content),
        what,
        "",
    )
}

fn log_dir_is_not_hijacked() -> Result<(), String> {
    let d = scratch("loglinks");
    let victim = d.join("victim");
    std::fs::write(&victim, "precious").map_err(|e| e.to_string())?;

    // A planted link under a log file's name: refused, the link's target untouched.
    let links = d.join("links");
    std::fs::create_dir(&links).map_err(|e| e.to_string())?;
    std::os::unix::fs::symlink(&victim, links.join("rank-0.log")).map_err(|e| e.to_string())?;
    log_dir_refused(
        1,
        &links,
        &["rank-0.log", "symbolic link"],
        "a symbolic link under a log name is refused",
    )?;
    still_holds(&victim, "precious", "the link's target is unchanged")?;

    // A hard link to another file: truncating it would empty the other name.
    let hard = d.join("hard");
    std::fs::create_dir(&hard).map_err(|e| e.to_string())?;
    std::fs::hard_link(&victim, hard.join("rank-0.log")).map_err(|e| e.to_string())?;
    log_dir_refused(
        1,
        &hard,
        &["hard links"],
        "a log name with another hard link is refused",
    )?;
    still_holds(&victim, "precious", "the other name is unchanged")?;

    // Writable by the group, no sticky bit: anyone in the group could plant files. Refused.
    let shared = d.join("shared");
    std::fs::create_dir(&shared).map_err(|e| e.to_string())?;
    chmod(&shared, 0o775)?;
    log_dir_refused(
        1,
        &shared,
        &["sticky", "chmod go-w"],
        "a group-writable directory without the sticky bit is refused",
    )?;
    check(
        std::fs::read_dir(&shared).map(|r| r.count()).unwrap_or(1) == 0,
        "and nothing is written there",
        "",
    )?;

    // Sticky and world-writable (like /tmp): our own old log is reused (emptied), another
    // user's file under a log name is refused.
    let sticky = d.join("sticky");
    std::fs::create_dir(&sticky).map_err(|e| e.to_string())?;
    chmod(&sticky, 0o1777)?;
    std::fs::write(
        sticky.join("rank-0.log"),
        "an old, longer log of an earlier run\n",
    )
    .map_err(|e| e.to_string())?;
    launch_logging(1, &sticky)?;
    let t = std::fs::read_to_string(sticky.join("rank-0.log")).map_err(|e| e.to_string())?;
    check(
        t == "log line of rank 0\n",
        "our own old log is truncated and rewritten",
        &t,
    )?;
    if nix::unistd::geteuid().is_root() {
        let theirs = sticky.join("rank-1.log");
        std::fs::write(&theirs, "theirs").map_err(|e| e.to_string())?;
        std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).map_err(|e| e.to_string())?;
        log_dir_refused(
            2,
            &sticky,
            &["rank-1.log", "belongs to uid 65534"],
            "another user's file under a log name is refused",
        )?;
        still_holds(&theirs, "theirs", "and left alone")?;
    } else {
        common::skip_part("another user's file (only root can make one here)");
    }

    // A new log directory (and its missing parent) is created; the directory itself 0700.
    let fresh = d.join("new/logs");
    launch_logging(2, &fresh)?;
    check(
        mode_of(&fresh) == 0o700,
        "a new log directory is private",
        format!("{:o}", mode_of(&fresh)),
    )?;
    check(
        mode_of(&fresh.join("rank-1.log")) == 0o600,
        "new log files are private",
        format!("{:o}", mode_of(&fresh.join("rank-1.log"))),
    )?;
    let _ = std::fs::remove_dir_all(&d);
    Ok(())
}

/// Child mode: 4 ranks write lines in pieces (flushing mid-line) as fast as they can.
fn child_output_mode() {
    let r = launch(&cfg(4), |ctx| {
        let mut o = std::io::stdout().lock();
        for i in 0..3000 {
            let _ = write!(o, "{}-", ctx.rank);
            let _ = o.flush();
            let _ = write!(o, "{}", "abcdefghij".repeat(1 + i % 7));
            let _ = o.flush();
            let _ = writeln!(o, "-{}", ctx.rank);
        }
        let _ = o.flush();
        Ok(())
    });
    std::process::exit(if r.is_ok() { 0 } else { 1 });
}

fn output_is_line_atomic_and_prefixed() -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let o = Command::new(exe)
        .env("LOCKSTEP_TEST_MODE", "output")
        .output()
        .map_err(|e| e.to_string())?;
    let out = String::from_utf8_lossy(&o.stdout);
    check(
        o.status.success(),
        "child launch failed",
        String::from_utf8_lossy(&o.stderr),
    )?;
    let whole_line_of = |line: &str| {
        (0..4).find(|r| {
            line.strip_prefix(&format!("[rank {r}] {r}-"))
                .and_then(|x| x.strip_suffix(&format!("-{r}")))
                .is_some_and(|mid| {
                    !mid.is_empty()
                        && mid.len() % 10 == 0
                        && mid.as_bytes().chunks(10).all(|c| c == b"abcdefghij")
                })
        })
    };
    let counts: [usize; 4] = rank_lines::per_rank(
        out.lines(),
        whole_line_of,
        "every line must be one rank's whole line",
    )?;
    check(
        counts == [3000; 4],
        "every line arrives",
        format!("{counts:?}"),
    )
}

/// Pipes (and log files) this process holds, by descriptor number.
fn open_pipes() -> Vec<(i32, String)> {
    let mut v = Vec::new();
    for e in std::fs::read_dir("/proc/self/fd")
        .into_iter()
        .flatten()
        .flatten()
    {
        let Ok(fd) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let target = std::fs::read_link(e.path())
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        if fd > 2 && (target.starts_with("pipe:") || target.ends_with(".log")) {
            v.push((fd, target));
        }
    }
    v
}

fn each_rank_holds_only_its_own_pipes() -> Result<(), String> {
    let d = scratch("fds");
    let before: Vec<i32> = open_pipes().into_iter().map(|(fd, _)| fd).collect();
    let mut c = cfg(4);
    c.log_dir = Some(d.to_path_buf());
    let held = launch(&c, move |_ctx| {
        // Only what the launch created: the host's own pipes are not ours to judge.
        Ok(open_pipes()
            .into_iter()
            .filter(|(fd, _)| !before.contains(fd))
            .map(|(_, t)| t)
            .collect::<Vec<String>>())
    })
    .map_err(|e| e.to_string())?;
    for (r, h) in held.iter().enumerate() {
        // stdout and stderr are dup'd onto 1 and 2; the result pipe is the one left.
        check(
            h.len() == 1,
            &format!("rank {r} holds only its result pipe"),
            format!("{h:?}"),
        )?;
    }
    Ok(())
}

/// Child mode: a host whose 2 ranks each start a grandchild, then wait.
fn child_grandchildren_mode() {
    let _ = launch(&cfg(2), |_ctx| {
        let _g = std::process::Command::new("sleep").arg("1000").spawn()?;
        std::thread::sleep(Duration::from_secs(1000));
        Ok(())
    });
    std::process::exit(1);
}

fn host_killed_takes_everything_with_it() -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mark = new_mark("lib-kill9");
    let mut host = Command::new(exe)
        .env("LOCKSTEP_TEST_MODE", "grandchildren")
        .env("LOCKSTEP_TEST_MARK", &mark)
        .spawn()
        .map_err(|e| e.to_string())?;
    // Host, 2 guards, 2 ranks, 2 sleeps.
    let started = wait_until(Duration::from_secs(5), || marked(&mark).len() >= 7);
    let n = marked(&mark).len();
    signal(host.id() as i32, libc::SIGKILL);
    let _ = host.wait();
    let gone = wait_until(Duration::from_secs(2), || marked(&mark).is_empty());
    let left = marked(&mark);
    for p in &left {
        signal(*p, libc::SIGKILL);
    }
    check(
        started,
        "the ranks start their grandchildren",
        format!("{n} marked processes"),
    )?;
    check(
        gone,
        "nothing outlives the host's kill -9 by more than 2 s",
        format!("left: {left:?}"),
    )
}

/// A malformed `LOCKSTEP_*` variable makes `launch` refuse before forking, naming it, even though
/// `LaunchConfig::new` ran while it was set.
fn malformed_env_refuses_launch() -> Result<(), String> {
    // Sequential tests (harness = false): no other thread reads the environment meanwhile.
    std::env::set_var("LOCKSTEP_SHM_STAGE", "fast");
    let c = cfg(2);
    let t = Instant::now();
    let r = launch(&c, |_ctx| Ok(std::process::id()));
    std::env::remove_var("LOCKSTEP_SHM_STAGE");
    let took = t.elapsed();
    let Err(e @ LaunchError::Setup(_)) = r else {
        return check(false, "launch must refuse", format!("{r:?}"));
    };
    let m = e.to_string();
    check(
        m.contains(
            "LOCKSTEP_SHM_STAGE=\"fast\" is invalid: expected one of: auto, cached, streaming, nt",
        ),
        "the variable is named",
        &m,
    )?;
    check(
        took < Duration::from_millis(500),
        "at once",
        format!("{took:?}"),
    )?;
    // Once fixed, the same config launches.
    let pids = launch(&cfg(2), |_ctx| Ok(std::process::id())).map_err(|e| e.to_string())?;
    check(
        pids.len() == 2,
        "a clean environment launches",
        format!("{pids:?}"),
    )
}

/// The CPUs this thread may run on.
fn affinity() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity takes a valid pointer
    // and its size; CPU_ISSET reads indexes below CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        assert_eq!(
            libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set),
            0
        );
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

/// `block` (the default): each rank gets CPUs / ranks consecutive CPUs of the allowed set, a
/// single rank all of them (threads started later inherit it); `core`: one CPU each; `none`:
/// the mask is left alone. Every rank reports its own affinity.
fn cpu_binding_modes() -> Result<(), String> {
    let all = affinity();
    let mut worlds = vec![1];
    if all.len() >= 2 {
        worlds.push(2);
    }
    for mode in [None, Some("block"), Some("core"), Some("none")] {
        for &w in &worlds {
            let mut c = cfg(w);
            c.shm.cpu_bind = match mode {
                Some("core") => lockstep::shm::CpuBind::Core,
                Some("none") => lockstep::shm::CpuBind::None,
                Some("block") => lockstep::shm::CpuBind::Block,
                _ => lockstep::shm::default_cpu_bind(),
            };
            let got = launch(&c, |_ctx| {
                let on_thread = std::thread::spawn(affinity).join().unwrap_or_default();
                Ok((affinity(), on_thread))
            })
            .map_err(|e| e.to_string())?;
            let per = match mode {
                Some("core") => 1,
                Some("none") => 0,
                _ => all.len() / w,
            };
            for (r, (mine, thread)) in got.iter().enumerate() {
                let want: Vec<usize> = if per == 0 {
                    all.clone()
                } else {
                    all[r * per..(r + 1) * per].to_vec()
                };
                check(
                    *mine == want && thread == mine,
                    &format!("{mode:?}, {w} ranks: rank {r}'s CPUs (and a thread it starts)"),
                    format!("want {want:?}, got {mine:?} (thread {thread:?}); allowed {all:?}"),
                )?;
            }
        }
    }
    check(
        lockstep::shm::default_cpu_bind() == lockstep::shm::CpuBind::Block,
        "the default binding of a Rust program is block",
        format!("{:?}", lockstep::shm::default_cpu_bind()),
    )
}

fn main() -> std::process::ExitCode {
    match std::env::var("LOCKSTEP_TEST_MODE").as_deref() {
        Ok("output") => child_output_mode(),
        Ok("grandchildren") => child_grandchildren_mode(),
        _ => {}
    }
    common::run(&[
        (
            "ready_time_and_repeated_launch",
            ready_time_and_repeated_launch,
        ),
        (
            "fail_fast_error_reports_root_cause",
            fail_fast_error_reports_root_cause,
        ),
        ("kill9_rank_gives_peer_lost", kill9_rank_gives_peer_lost),
        (
            "hung_rank_is_named_after_the_timeout",
            hung_rank_is_named_after_the_timeout,
        ),
        (
            "panics_and_exits_are_reported",
            panics_and_exits_are_reported,
        ),
        ("log_dir_and_filter", log_dir_and_filter),
        ("log_dir_is_not_hijacked", log_dir_is_not_hijacked),
        (
            "output_is_line_atomic_and_prefixed",
            output_is_line_atomic_and_prefixed,
        ),
        (
            "each_rank_holds_only_its_own_pipes",
            each_rank_holds_only_its_own_pipes,
        ),
        (
            "host_killed_takes_everything_with_it",
            host_killed_takes_everything_with_it,
        ),
        ("malformed_env_refuses_launch", malformed_env_refuses_launch),
        ("cpu_binding_modes", cpu_binding_modes),
    ])
}
