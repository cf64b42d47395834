//! How `lockstep launch` ends when it is told to stop or dies: SIGHUP, SIGINT with stubborn
//! ranks, `kill -9` with grandchildren, malformed `LOCKSTEP_*` variables, and a rendezvous whose
//! second node never comes. Every test bounds the time the outcome takes and checks that no
//! process it started is left: each launcher runs with `LOCKSTEP_TEST_MARK=<unique>` in its
//! environment, which every rank and descendant inherits, and /proc is scanned for it.
//! Sequential (`harness = false`): the tests time the launcher's reactions.

mod common;

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{check, free_port, grandchildren_of, marked, new_mark, scratch, signal, wait_until};

const BIN: &str = env!("CARGO_BIN_EXE_lockstep");
const TOKEN: &str = "launch-deaths-test-token-0123";
/// How long anything left behind may take to disappear once the launcher is gone.
const CLEANUP: Duration = Duration::from_secs(2);

/// `lockstep` with a clean rendezvous environment and the test's mark.
fn lockstep(mark: &str) -> Command {
    let mut c = Command::new(BIN);
    c.env_remove("LOCKSTEP_TOKEN").env_remove("RANK").env_remove("WORLD_SIZE").env("LOCKSTEP_TEST_MARK", mark);
    for v in ["LOCKSTEP_TIMEOUT_S", "LOCKSTEP_RDZV_TIMEOUT_S", "LOCKSTEP_BACKEND", "LOCKSTEP_DEBUG", "LOCKSTEP_NNODES", "LOCKSTEP_HOST_ID"]
    {
        c.env_remove(v);
    }
    c
}

fn show(o: &Output) -> String {
    format!(
        "status: {:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A launcher killed and reaped if the test returns early; its marked processes are killed too.
struct Running {
    child: Option<Child>,
    mark: String,
}

impl Running {
    fn spawn(c: &mut Command, mark: &str) -> Running {
        let child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn lockstep");
        Running { child: Some(child), mark: mark.to_string() }
    }
    fn pid(&self) -> i32 {
        self.child.as_ref().expect("running").id() as i32
    }
    fn wait_with_output(mut self) -> std::io::Result<Output> {
        self.child.take().expect("running").wait_with_output()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        for p in marked(&self.mark) {
            signal(p, libc::SIGKILL);
        }
    }
}

/// Wait for `n` ranks under launcher `pid`.
fn ranks_of(pid: i32, n: usize) -> Result<Vec<i32>, String> {
    let mut r = Vec::new();
    let ok = wait_until(Duration::from_secs(5), || {
        r = grandchildren_of(pid);
        r.len() >= n
    });
    check(ok, "the launcher did not start its ranks", format!("{r:?}"))?;
    Ok(r)
}

/// No process carrying `mark` within [`CLEANUP`].
fn nothing_left(mark: &str) -> Result<(), String> {
    let mut left = Vec::new();
    let gone = wait_until(CLEANUP, || {
        left = marked(mark);
        left.is_empty()
    });
    let what: Vec<String> =
        left.iter().map(|p| std::fs::read_to_string(format!("/proc/{p}/cmdline")).unwrap_or_default().replace('\0', " ")).collect();
    check(gone, &format!("no process may be left {CLEANUP:?} after the launcher ended"), format!("{left:?}: {what:?}"))
}

fn env_of(pid: i32, key: &str) -> Option<String> {
    let e = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    e.split(|b| *b == 0).find_map(|kv| kv.strip_prefix(format!("{key}=").as_bytes()).map(|v| String::from_utf8_lossy(v).into_owned()))
}

// ------------------------------------------------------------------------------------------------

/// SIGHUP (a closed terminal): ranks get SIGTERM first and may finish their handler in the grace
/// period, even when the hang-up comes twice; the launcher exits 129.
fn sighup_sends_sigterm_then_exits_129() -> Result<(), String> {
    let mark = new_mark("hup");
    let d = scratch("hup");
    // The handler takes 0.4 s: a second SIGHUP meanwhile must not turn into SIGKILL.
    let script = format!("trap 'sleep 0.4; echo $RANK > {}/term.$RANK; exit 0' TERM; sleep 1000 & wait", d.display());
    let mut c = lockstep(&mark);
    c.args(["launch", "--nproc-per-node", "2", "--grace-s", "5", "--", "sh", "-c", &script]);
    let l = Running::spawn(&mut c, &mark);
    ranks_of(l.pid(), 2)?;
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    signal(l.pid(), libc::SIGHUP);
    std::thread::sleep(Duration::from_millis(100));
    signal(l.pid(), libc::SIGHUP);
    let o = l.wait_with_output().map_err(|e| e.to_string())?;
    let took = t.elapsed();
    check(o.status.code() == Some(129), "the launcher exits 128+SIGHUP", show(&o))?;
    for r in 0..2 {
        check(d.join(format!("term.{r}")).exists(), &format!("rank {r} got SIGTERM and finished its handler"), show(&o))?;
    }
    check(String::from_utf8_lossy(&o.stderr).contains("got SIGHUP: sending SIGTERM"), "the launcher says what it did", show(&o))?;
    check(took < Duration::from_secs(3), "the job stops once the handlers finish, well within the 5 s grace", format!("{took:?}"))?;
    println!("    SIGHUP → exit 129 after {:.0} ms (handlers take 400 ms)", took.as_secs_f64() * 1e3);
    nothing_left(&mark)
}

/// `kill -9` of the launcher: ranks, their children, a `setsid` child and a double-forked
/// orphan all die, and the job's named shared-memory segment is removed.
fn kill9_launcher_kills_every_descendant() -> Result<(), String> {
    let mark = new_mark("kill9");
    // Rank 0 joins the named segment and waits for rank 1, which never joins; every rank leaves
    // grandchildren: one in its group, one in a new session, one re-parented (double fork).
    let script =
        format!("setsid sleep 1000 & (sleep 1000 &); sleep 1000 & if [ $RANK = 0 ]; then exec {BIN} selftest; else exec sleep 1000; fi");
    let mut c = lockstep(&mark);
    c.args(["launch", "--nproc-per-node", "2", "--", "sh", "-c", &script]);
    let l = Running::spawn(&mut c, &mark);
    let ranks = ranks_of(l.pid(), 2)?;
    let job = ranks.iter().find_map(|p| env_of(*p, "LOCKSTEP_JOB_ID")).ok_or("no LOCKSTEP_JOB_ID in the ranks")?;
    let segment = std::path::PathBuf::from(format!("/dev/shm/lockstep-{job}"));
    // 2 ranks + 3 sleeps each, plus 2 guards and the launcher (which carry the mark too).
    let mut n = 0;
    let ready = wait_until(Duration::from_secs(5), || {
        n = marked(&mark).len();
        n >= 2 + 6 + 3 && segment.exists()
    });
    check(
        ready,
        "the ranks start their grandchildren and rank 0 creates the segment",
        format!("{n} marked, segment {}", segment.exists()),
    )?;
    let t = Instant::now();
    signal(l.pid(), libc::SIGKILL);
    nothing_left(&mark)?;
    let took = t.elapsed();
    let o = l.wait_with_output().map_err(|e| e.to_string())?;
    check(o.status.code().is_none(), "the launcher was killed", show(&o))?;
    check(!segment.exists(), "the guards remove the job's named segment", segment.display())?;
    println!("    kill -9 → {n} processes gone after {:.0} ms", took.as_secs_f64() * 1e3);
    Ok(())
}

/// Ctrl-C with ranks that ignore SIGINT and SIGTERM: SIGKILL after the grace period, and the
/// launcher still exits 130 (not 137).
fn sigint_with_stubborn_ranks_exits_130() -> Result<(), String> {
    let mark = new_mark("int");
    let mut c = lockstep(&mark);
    c.args(["launch", "--nproc-per-node", "2", "--grace-s", "0.5", "--", "sh", "-c", "trap '' INT TERM; sleep 1000 & exec sleep 1000"]);
    let l = Running::spawn(&mut c, &mark);
    ranks_of(l.pid(), 2)?;
    std::thread::sleep(Duration::from_millis(100));
    let t = Instant::now();
    signal(l.pid(), libc::SIGINT);
    let o = l.wait_with_output().map_err(|e| e.to_string())?;
    let took = t.elapsed();
    check(o.status.code() == Some(130), "exit 128+SIGINT although the ranks needed SIGKILL", show(&o))?;
    check(
        took >= Duration::from_millis(450) && took < Duration::from_millis(1500),
        "SIGKILL comes after the 0.5 s grace period",
        format!("{took:?}"),
    )?;
    nothing_left(&mark)?;
    // SIGTERM the same way: 143.
    let mark = new_mark("term");
    let mut c = lockstep(&mark);
    c.args(["launch", "--nproc-per-node", "2", "--grace-s", "0.3", "--", "sh", "-c", "trap '' INT TERM; exec sleep 1000"]);
    let l = Running::spawn(&mut c, &mark);
    ranks_of(l.pid(), 2)?;
    signal(l.pid(), libc::SIGTERM);
    let o = l.wait_with_output().map_err(|e| e.to_string())?;
    check(o.status.code() == Some(143), "exit 128+SIGTERM although the ranks needed SIGKILL", show(&o))?;
    nothing_left(&mark)
}

/// A malformed `LOCKSTEP_*` variable stops the launcher before any rank starts, and a rank started
/// by hand refuses it too, naming the variable, the value and what is accepted.
fn malformed_env_is_an_error() -> Result<(), String> {
    let cases = [
        ("LOCKSTEP_TIMEOUT_S", "3s", "number of seconds greater than 0"),
        ("LOCKSTEP_TIMEOUT_S", "-1", "number of seconds greater than 0"),
        ("LOCKSTEP_TIMEOUT_S", "abc", "number of seconds greater than 0"),
        ("LOCKSTEP_TIMEOUT_S", "0", "number of seconds greater than 0"),
        ("LOCKSTEP_RDZV_TIMEOUT_S", "1m", "number of seconds greater than 0"),
        ("LOCKSTEP_BACKEND", "gpu", "one of: shm, nccl"),
        ("LOCKSTEP_DEBUG", "maybe", "1 or 0"),
        ("LOCKSTEP_NNODES", "0", "a whole number from 1"),
    ];
    for (var, val, expected) in cases {
        let mark = new_mark("env");
        let t = Instant::now();
        let o = lockstep(&mark)
            .env(var, val)
            .args(["launch", "--nproc-per-node", "2", "--", BIN, "selftest"])
            .output()
            .map_err(|e| e.to_string())?;
        let err = String::from_utf8_lossy(&o.stderr);
        check(
            o.status.code() == Some(1) && err.contains(&format!("{var}={val:?} is invalid: expected")) && err.contains(expected),
            &format!("{var}={val} must be refused by name"),
            show(&o),
        )?;
        check(t.elapsed() < Duration::from_secs(2), "at once", format!("{:?}", t.elapsed()))?;
        check(!err.contains("[rank"), "before any rank starts", show(&o))?;
        nothing_left(&mark)?;
    }
    // A rank started without the launcher checks the same variables.
    let mark = new_mark("env-rank");
    let o = lockstep(&mark)
        .env("LOCKSTEP_TIMEOUT_S", "3s")
        .env("RANK", "0")
        .env("WORLD_SIZE", "1")
        .env("LOCKSTEP_JOB_ID", format!("deaths-{}", std::process::id()))
        .arg("selftest")
        .output()
        .map_err(|e| e.to_string())?;
    check(
        o.status.code() == Some(1) && String::from_utf8_lossy(&o.stderr).contains("LOCKSTEP_TIMEOUT_S=\"3s\" is invalid"),
        "Communicator::from_env refuses it too",
        show(&o),
    )?;
    // --rdzv-timeout-s 0 is refused as well.
    let o = lockstep(&mark).args(["launch", "--rdzv-timeout-s", "0", "--", "true"]).output().map_err(|e| e.to_string())?;
    check(
        o.status.code() == Some(1) && String::from_utf8_lossy(&o.stderr).contains("greater than 0"),
        "a zero timeout is refused",
        show(&o),
    )
}

/// Node 0 of a two-node job whose node 1 never starts: node 0's ranks give up after
/// --rdzv-timeout-s (not a built-in 60 s) and name only the missing ranks and node.
fn node0_honours_rdzv_timeout() -> Result<(), String> {
    let mark = new_mark("rdzv");
    let port = free_port().to_string();
    let mut c = lockstep(&mark);
    c.env("LOCKSTEP_TOKEN", TOKEN);
    c.args(["launch", "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "0", "--master-port", &port, "--rdzv-timeout-s", "2"]);
    c.args(["--", BIN, "selftest"]);
    let t = Instant::now();
    let l = Running::spawn(&mut c, &mark);
    let o = l.wait_with_output().map_err(|e| e.to_string())?;
    let took = t.elapsed();
    let err = String::from_utf8_lossy(&o.stderr);
    check(o.status.code() == Some(1), "node 0 fails", show(&o))?;
    check(
        err.contains("ranks 2-3 (node 1) did not reach the rendezvous within 2.0 s"),
        "the message names the missing ranks and node",
        show(&o),
    )?;
    check(!err.contains("lockstep/host/0") && !err.contains("ranks 0-"), "and only those", show(&o))?;
    check(took >= Duration::from_secs(2) && took < Duration::from_secs(5), "within the 2 s timeout plus a margin", format!("{took:?}"))?;
    println!("    node 0 alone, --rdzv-timeout-s 2 → failed after {:.2} s", took.as_secs_f64());
    nothing_left(&mark)
}

fn main() -> std::process::ExitCode {
    common::run(&[
        ("sighup_sends_sigterm_then_exits_129", sighup_sends_sigterm_then_exits_129),
        ("kill9_launcher_kills_every_descendant", kill9_launcher_kills_every_descendant),
        ("sigint_with_stubborn_ranks_exits_130", sigint_with_stubborn_ranks_exits_130),
        ("malformed_env_is_an_error", malformed_env_is_an_error),
        ("node0_honours_rdzv_timeout", node0_honours_rdzv_timeout),
    ])
}
