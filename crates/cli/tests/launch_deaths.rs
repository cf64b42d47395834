//! How `lockstep launch` ends when it is told to stop or dies: SIGHUP, SIGINT with stubborn
//! ranks, `kill -9` with grandchildren, malformed `LOCKSTEP_*` variables, a rendezvous whose
//! last node never comes, a master port held by something that is not lockstep, and a two-node
//! job that must still complete while 1000 hostile connections hold node 0's store, and
//! restarts (`--max-restarts`, both policies). Every test
//! bounds the time the outcome takes and checks that no process it started is left: each
//! launcher runs with `LOCKSTEP_TEST_MARK=<unique>` in its environment, which every rank and
//! descendant inherits, and /proc is scanned for it. Sequential (`harness = false`): the tests
//! time the launcher's reactions.

#[path = "common/cli.rs"]
mod cli;
#[path = "../../../tests/common/mod.rs"]
mod common;

use cli::{both_succeed, exits, launch, says, sh, two_nodes, within, Run};
use common::show;

use std::io::{Read, Write};
use std::os::unix::ffi::OsStringExt;
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
    c.env_remove("LOCKSTEP_TOKEN")
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env("LOCKSTEP_TEST_MARK", mark);
    for v in lockstep::types::env::CHECKED {
        c.env_remove(v.name);
    }
    c
}

/// A launcher killed and reaped if the test returns early; its marked processes are killed too.
/// A launcher that was waited for leaves the marked processes alone: another launcher of the
/// same job (same mark) may still be stopping its ranks, and `nothing_left` checks them later.
struct Running {
    child: Option<Child>,
    mark: String,
    waited: bool,
}

impl Running {
    fn spawn(c: &mut Command, mark: &str) -> Running {
        let child = c
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn lockstep");
        Running {
            child: Some(child),
            mark: mark.to_string(),
            waited: false,
        }
    }
    fn pid(&self) -> i32 {
        self.child.as_ref().expect("running").id() as i32
    }
    fn wait_with_output(mut self) -> std::io::Result<Output> {
        self.waited = true;
        self.child.take().expect("running").wait_with_output()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if self.waited {
            return;
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

/// Two ranks running `script` under a launcher with `--grace-s grace`, once both have started,
/// marked with a fresh mark named after `tag`.
fn two_ranks(tag: &str, grace: &str, script: &str) -> Result<(String, Running), String> {
    let mark = new_mark(tag);
    let mut c = lockstep(&mark);
    c.args(launch("2"))
        .args(["--grace-s", grace])
        .args(sh(script));
    let l = Running::spawn(&mut c, &mark);
    ranks_of(l.pid(), 2)?;
    Ok((mark, l))
}

/// A rendezvous that gave up after `--rdzv-timeout-s 2`: not before, and not long after.
fn after_the_2s_timeout(took: Duration) -> Result<(), String> {
    check(
        took >= Duration::from_secs(2) && took < Duration::from_secs(5),
        "within the 2 s timeout plus a margin",
        format!("{took:?}"),
    )
}

/// No process carrying `mark` within [`CLEANUP`].
fn nothing_left(mark: &str) -> Result<(), String> {
    let mut left = Vec::new();
    let gone = wait_until(CLEANUP, || {
        left = marked(mark);
        left.is_empty()
    });
    let what: Vec<String> = left
        .iter()
        .map(|p| {
            std::fs::read_to_string(format!("/proc/{p}/cmdline"))
                .unwrap_or_default()
                .replace('\0', " ")
        })
        .collect();
    // The failure is reported; what was left does not outlive the test.
    for p in &left {
        signal(*p, libc::SIGKILL);
    }
    check(
        gone,
        &format!("no process may be left {CLEANUP:?} after the launcher ended"),
        format!("{left:?}: {what:?}"),
    )
}

fn env_of(pid: i32, key: &str) -> Option<String> {
    let e = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    e.split(|b| *b == 0).find_map(|kv| {
        kv.strip_prefix(format!("{key}=").as_bytes())
            .map(|v| String::from_utf8_lossy(v).into_owned())
    })
}

// ------------------------------------------------------------------------------------------------

/// SIGHUP (a closed terminal): ranks get SIGTERM first and may finish their handler in the grace
/// period, even when the hang-up comes twice; the launcher exits 129.
fn sighup_sends_sigterm_then_exits_129() -> Result<(), String> {
    let mark = new_mark("hup");
    let d = scratch("hup");
    // The handler takes 0.4 s: a second SIGHUP meanwhile must not turn into SIGKILL.
    let script = format!(
        "trap 'sleep 0.4; echo $RANK > {}/term.$RANK; exit 0' TERM; sleep 1000 & wait",
        d.display()
    );
    let mut c = lockstep(&mark);
    c.args(launch("2"))
        .args(["--grace-s", "5"])
        .args(sh(&script));
    let l = Running::spawn(&mut c, &mark);
    ranks_of(l.pid(), 2)?;
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    signal(l.pid(), libc::SIGHUP);
    std::thread::sleep(Duration::from_millis(100));
    signal(l.pid(), libc::SIGHUP);
    let o = l.wait_with_output().map_err(|e| e.to_string())?;
    let took = t.elapsed();
    exits(&o, 129, "the launcher exits 128+SIGHUP")?;
    for r in 0..2 {
        check(
            d.join(format!("term.{r}")).exists(),
            &format!("rank {r} got SIGTERM and finished its handler"),
            show(&o),
        )?;
    }
    check(
        String::from_utf8_lossy(&o.stderr).contains("got SIGHUP: sending SIGTERM"),
        "the launcher says what it did",
        show(&o),
    )?;
    within(
        took,
        3.0,
        "the job stops once the handlers finish, well within the 5 s grace",
    )?;
    println!(
        "    SIGHUP → exit 129 after {:.0} ms (handlers take 400 ms)",
        took.as_secs_f64() * 1e3
    );
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
    c.args(launch("2")).args(sh(&script));
    let l = Running::spawn(&mut c, &mark);
    let ranks = ranks_of(l.pid(), 2)?;
    let job = ranks
        .iter()
        .find_map(|p| env_of(*p, "LOCKSTEP_JOB_ID"))
        .ok_or("no LOCKSTEP_JOB_ID in the ranks")?;
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
    check(
        o.status.code().is_none(),
        "the launcher was killed",
        show(&o),
    )?;
    check(
        !segment.exists(),
        "the guards remove the job's named segment",
        segment.display(),
    )?;
    println!(
        "    kill -9 → {n} processes gone after {:.0} ms",
        took.as_secs_f64() * 1e3
    );
    Ok(())
}

/// Ctrl-C with ranks that ignore SIGINT and SIGTERM: SIGKILL after the grace period, and the
/// launcher still exits 130 (not 137).
fn sigint_with_stubborn_ranks_exits_130() -> Result<(), String> {
    let (mark, l) = two_ranks(
        "int",
        "0.5",
        "trap '' INT TERM; sleep 1000 & exec sleep 1000",
    )?;
    std::thread::sleep(Duration::from_millis(100));
    let t = Instant::now();
    signal(l.pid(), libc::SIGINT);
    let o = l.wait_with_output().map_err(|e| e.to_string())?;
    let took = t.elapsed();
    exits(&o, 130, "exit 128+SIGINT although the ranks needed SIGKILL")?;
    check(
        took >= Duration::from_millis(450) && took < Duration::from_millis(1500),
        "SIGKILL comes after the 0.5 s grace period",
        format!("{took:?}"),
    )?;
    nothing_left(&mark)?;
    // SIGTERM the same way: 143.
    let (mark, l) = two_ranks("term", "0.3", "trap '' INT TERM; exec sleep 1000")?;
    signal(l.pid(), libc::SIGTERM);
    let o = l.wait_with_output().map_err(|e| e.to_string())?;
    exits(
        &o,
        143,
        "exit 128+SIGTERM although the ranks needed SIGKILL",
    )?;
    nothing_left(&mark)
}

/// Within this a malformed variable must stop the launcher (no rank starts, nothing waits).
const REFUSED_WITHIN: Duration = Duration::from_secs(2);

/// A malformed `LOCKSTEP_*` variable stops the launcher before any rank starts (exit 1, within
/// [`REFUSED_WITHIN`]), and a rank started by hand refuses it too, naming the variable, the value
/// and what is accepted.
fn malformed_env_is_an_error() -> Result<(), String> {
    let secs = "number of seconds greater than 0";
    let cases = [
        ("LOCKSTEP_TIMEOUT_S", "3s", secs),
        ("LOCKSTEP_TIMEOUT_S", "-1", secs),
        ("LOCKSTEP_TIMEOUT_S", "abc", secs),
        ("LOCKSTEP_TIMEOUT_S", "0", secs),
        ("LOCKSTEP_TIMEOUT_S", "1e3", secs),
        ("LOCKSTEP_RDZV_TIMEOUT_S", "1m", secs),
        ("LOCKSTEP_RDZV_TIMEOUT_S", "0", secs),
        ("LOCKSTEP_JOIN_TIMEOUT_S", "inf", secs),
        ("LOCKSTEP_BACKEND", "gpu", "one of: shm, nccl"),
        ("LOCKSTEP_DEBUG", "maybe", "1 or 0"),
        ("LOCKSTEP_NNODES", "0", "a whole number from 1"),
        (
            "LOCKSTEP_SHM_SLOT_BYTES",
            "1M",
            "a whole number from 4096 to 1073741824",
        ),
        (
            "LOCKSTEP_SHM_SLOT_BYTES",
            "100",
            "a whole number from 4096 to 1073741824",
        ),
        (
            "LOCKSTEP_SHM_SMALL_BYTES",
            "16k",
            "a whole number from 0 to",
        ),
        (
            "LOCKSTEP_SHM_HEAP_BYTES",
            "-5",
            "a whole number from 2097152 to",
        ),
        ("LOCKSTEP_SHM_NT_BYTES", "8e6", "a whole number from 0 to"),
        (
            "LOCKSTEP_SHM_CMA_BYTES",
            "32KiB",
            "a whole number from 0 to",
        ),
        (
            "LOCKSTEP_SHM_STAGE",
            "fast",
            "one of: auto, cached, streaming, nt",
        ),
        (
            "LOCKSTEP_SHM_SINGLE_COPY",
            "yes",
            "one of: auto, always, never",
        ),
        ("LOCKSTEP_PEER_CHECK_MS", "0", "a whole number from 1 to"),
        (
            "LOCKSTEP_SPIN_US",
            "2.5",
            "a whole number from 0 to 1000000",
        ),
        ("LOCKSTEP_CPU_BIND", "yes", "one of: block, core, none"),
        (
            "LOCKSTEP_STORE_PORT",
            "70000",
            "a whole number from 1 to 65535",
        ),
        (
            "LOCKSTEP_HOST_ID",
            "node\ta",
            "text without control characters",
        ),
    ];
    let mut slowest = Duration::ZERO;
    for (var, val, expected) in cases {
        let mark = new_mark("env");
        let t = Instant::now();
        let o = lockstep(&mark)
            .env(var, val)
            .args(launch("2"))
            .args(["--", BIN, "selftest"])
            .run()?;
        let took = t.elapsed();
        slowest = slowest.max(took);
        let err = String::from_utf8_lossy(&o.stderr);
        check(
            o.status.code() == Some(1)
                && err.contains(&format!("{var}={val:?} is invalid: expected"))
                && err.contains(expected),
            &format!("{var}={val} must be refused by name, with what it accepts"),
            show(&o),
        )?;
        check(
            took < REFUSED_WITHIN,
            &format!("{var}={val} refused within {REFUSED_WITHIN:?}"),
            format!("{took:?}"),
        )?;
        check(!err.contains("[rank"), "before any rank starts", show(&o))?;
        nothing_left(&mark)?;
    }
    // A token that is not UTF-8 is named, not taken for a missing one.
    let mark = new_mark("env-token");
    let o = lockstep(&mark)
        .env(
            "LOCKSTEP_TOKEN",
            std::ffi::OsString::from_vec(b"token-\xff-0123456789abcdef".to_vec()),
        )
        .args(two_nodes("1", "1"))
        .args(["--node-rank", "1", "--", "true"])
        .run()?;
    check(
        o.status.code() == Some(1)
            && String::from_utf8_lossy(&o.stderr).contains("LOCKSTEP_TOKEN=")
            && String::from_utf8_lossy(&o.stderr).contains("UTF-8"),
        "a token that is not UTF-8 is refused by name",
        show(&o),
    )?;
    // A rank started without the launcher checks the same variables (shm tuning included).
    for (var, val) in [
        ("LOCKSTEP_TIMEOUT_S", "3s"),
        ("LOCKSTEP_SHM_SLOT_BYTES", "1M"),
    ] {
        let mark = new_mark("env-rank");
        let t = Instant::now();
        let o = lockstep(&mark)
            .env(var, val)
            .env("RANK", "0")
            .env("WORLD_SIZE", "1")
            .env("LOCKSTEP_JOB_ID", format!("deaths-{}", std::process::id()))
            .arg("selftest")
            .run()?;
        slowest = slowest.max(t.elapsed());
        check(
            o.status.code() == Some(1)
                && String::from_utf8_lossy(&o.stderr)
                    .contains(&format!("{var}={val:?} is invalid")),
            &format!("Communicator::from_env refuses {var}={val} too"),
            show(&o),
        )?;
    }
    // --rdzv-timeout-s 0 is refused as well.
    let o = lockstep(&new_mark("env-flag"))
        .args(["launch", "--rdzv-timeout-s", "0", "--", "true"])
        .run()?;
    check(
        o.status.code() == Some(1) && String::from_utf8_lossy(&o.stderr).contains("greater than 0"),
        "a zero timeout is refused",
        show(&o),
    )?;
    println!(
        "    {} malformed values refused with exit 1, slowest after {:.0} ms",
        cases.len() + 3,
        slowest.as_secs_f64() * 1e3
    );
    Ok(())
}

/// Node 0 of a two-node job whose node 1 never starts: node 0's ranks give up after
/// --rdzv-timeout-s (not a built-in 60 s) and name only the missing ranks and node.
fn node0_honours_rdzv_timeout() -> Result<(), String> {
    let mark = new_mark("rdzv");
    let port = free_port().to_string();
    let mut c = lockstep(&mark);
    c.env("LOCKSTEP_TOKEN", TOKEN);
    c.args(two_nodes("2", &port))
        .args(["--node-rank", "0", "--rdzv-timeout-s", "2"]);
    c.args(["--", BIN, "selftest"]);
    let t = Instant::now();
    let l = Running::spawn(&mut c, &mark);
    let o = l.wait_with_output().map_err(|e| e.to_string())?;
    let took = t.elapsed();
    let err = String::from_utf8_lossy(&o.stderr);
    exits(&o, 1, "node 0 fails")?;
    check(
        err.contains("ranks 2-3 (node 1) did not reach the rendezvous within 2.0 s"),
        "the message names the missing ranks and node",
        show(&o),
    )?;
    check(
        !err.contains("lockstep/host/0") && !err.contains("ranks 0-"),
        "and only those",
        show(&o),
    )?;
    after_the_2s_timeout(took)?;
    println!(
        "    node 0 alone, --rdzv-timeout-s 2 → failed after {:.2} s",
        took.as_secs_f64()
    );
    nothing_left(&mark)
}

/// Three nodes, of which node 2 never starts: the ranks of nodes 0 and 1 give up after
/// --rdzv-timeout-s and name node 2's rank only (not each other), and both launchers fail.
fn rdzv_timeout_names_only_the_missing_node() -> Result<(), String> {
    let mark = new_mark("rdzv3");
    let port = free_port().to_string();
    let node = |r: &str| {
        let mut c = lockstep(&mark);
        c.env("LOCKSTEP_TOKEN", TOKEN);
        c.args(launch("1")).args([
            "--nnodes",
            "3",
            "--node-rank",
            r,
            "--master-port",
            &port,
            "--rdzv-timeout-s",
            "2",
        ]);
        c.args(["--", BIN, "selftest"]);
        Running::spawn(&mut c, &mark)
    };
    let t = Instant::now();
    let (a, b) = (node("0"), node("1"));
    let (oa, ob) = (
        a.wait_with_output().map_err(|e| e.to_string())?,
        b.wait_with_output().map_err(|e| e.to_string())?,
    );
    let took = t.elapsed();
    let both = format!("{}\n{}", show(&oa), show(&ob));
    check(
        oa.status.code() == Some(1) && ob.status.code() == Some(1),
        "both nodes fail",
        &both,
    )?;
    // The first rank to time out stops the job (the other node's ranks are then stopped by the
    // launchers), so at least one rank reports; every report names rank 2 on node 2 only.
    let reports: Vec<&str> = both
        .lines()
        .filter(|l| l.contains("did not reach the rendezvous"))
        .collect();
    check(
        !reports.is_empty(),
        "a rank reports the rendezvous timeout",
        &both,
    )?;
    for l in &reports {
        check(
            l.contains("rank 2 (node 2) did not reach the rendezvous within 2.0 s")
                && !l.contains("ranks ")
                && !l.contains("(nodes "),
            "the report names rank 2 on node 2, and no rank that arrived",
            &both,
        )?;
    }
    after_the_2s_timeout(took)?;
    println!("    nodes 0-1 of 3, --rdzv-timeout-s 2 → both failed after {:.2} s naming rank 2 (node 2) only", took.as_secs_f64());
    nothing_left(&mark)
}

/// A listener on 127.0.0.1 that serves every connection with `serve` on its own thread.
fn impostor(serve: fn(std::net::TcpStream)) -> Result<u16, String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let port = l.local_addr().map_err(|e| e.to_string())?.port();
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            std::thread::spawn(move || serve(s));
        }
    });
    Ok(port)
}

/// The master port is held by a program that is not lockstep: node 1's launcher says the port
/// does not speak lockstep's protocol, at once when it answers garbage, and within
/// --rdzv-timeout-s when it accepts and never answers; no rank starts.
fn foreign_master_port_is_named() -> Result<(), String> {
    let http = impostor(|mut s| {
        let mut b = [0u8; 256];
        let _ = s.read(&mut b);
        let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n");
        std::thread::sleep(Duration::from_secs(3));
    })?;
    let silent = impostor(|mut s| {
        let mut b = [0u8; 256];
        while matches!(s.read(&mut b), Ok(n) if n > 0) {}
    })?;
    // (port, --rdzv-timeout-s, what the port does, time allowed)
    let cases = [
        (http, "5", "answers HTTP", Duration::from_secs(2)),
        (silent, "1.5", "never answers", Duration::from_millis(3000)),
    ];
    let mut times = Vec::new();
    for (port, timeout, what, within) in cases {
        let mark = new_mark("impostor");
        let t = Instant::now();
        let o = lockstep(&mark)
            .env("LOCKSTEP_TOKEN", TOKEN)
            .args(two_nodes("1", &port.to_string()))
            .args(["--node-rank", "1"])
            .args(["--rdzv-timeout-s", timeout, "--", BIN, "selftest"])
            .run()?;
        let took = t.elapsed();
        let err = String::from_utf8_lossy(&o.stderr);
        check(
            o.status.code() == Some(1)
                && err.contains(&format!(
                    "the peer at 127.0.0.1:{port} does not speak the lockstep store protocol"
                )),
            &format!("a master port that {what} is named as not lockstep's"),
            show(&o),
        )?;
        check(!err.contains("[rank"), "no rank starts", show(&o))?;
        check(
            took < within,
            &format!(
                "a port that {what} is reported within {within:?} (--rdzv-timeout-s {timeout})"
            ),
            format!("{took:?}"),
        )?;
        times.push(format!(
            "{what} (--rdzv-timeout-s {timeout}): {:.2} s",
            took.as_secs_f64()
        ));
        nothing_left(&mark)?;
    }
    println!("    foreign master port named: {}", times.join("; "));
    Ok(())
}

/// Raise this process's descriptor limit to at least `n` (the hard limit permitting).
fn raise_nofile(n: u64) -> Result<(), String> {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) != 0 {
            return Err(std::io::Error::last_os_error().to_string());
        }
        if rl.rlim_cur < n {
            rl.rlim_cur = n.min(rl.rlim_max);
            if libc::setrlimit(libc::RLIMIT_NOFILE, &rl) != 0 {
                return Err(std::io::Error::last_os_error().to_string());
            }
        }
    }
    check(
        rl.rlim_cur >= n,
        &format!("room for {n} descriptors"),
        format!("hard limit {}", rl.rlim_max),
    )
}

/// One hostile connection to `addr`: a hello frame announced and left unfinished (just under the
/// pre-authentication limit), or every tenth one an oversized frame announcement.
fn hostile_connection(addr: std::net::SocketAddr, i: usize) -> Option<std::net::TcpStream> {
    let max_hello = lockstep::store::MAX_HELLO_FRAME;
    let mut c = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    let _ = c.set_nonblocking(true);
    if i.is_multiple_of(10) {
        let _ = c.write_all(&(1u32 << 20).to_le_bytes());
        let _ = c.write_all(&[7u8; 4096]);
    } else {
        let _ = c.write_all(&(max_hello as u32).to_le_bytes());
        let _ = c.write_all(&vec![7u8; max_hello - 16]);
    }
    Some(c)
}

/// A real two-node job on loopback completes while 1000 hostile connections are held against
/// node 0's store: opened before node 1 starts, and each one the store drops (budget, handshake
/// deadline) reopened at once until the job is over.
fn two_node_job_completes_under_attack() -> Result<(), String> {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;
    raise_nofile(1200)?;
    let mark = new_mark("attack");
    let port = free_port();
    let node = |r: &str| {
        let mut c = lockstep(&mark);
        c.env("LOCKSTEP_TOKEN", TOKEN);
        c.args(two_nodes("2", &port.to_string()))
            .args(["--node-rank", r]);
        c.args(["--rdzv-timeout-s", "30", "--", BIN, "selftest"]);
        Running::spawn(&mut c, &mark)
    };
    let a = node("0");
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
    check(
        wait_until(Duration::from_secs(5), || {
            std::net::TcpStream::connect(addr).is_ok()
        }),
        "node 0 listens on its master port",
        port,
    )?;
    let stop = Arc::new(AtomicBool::new(false));
    let (opened, held) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let attacker = {
        let (stop, opened, held) = (stop.clone(), opened.clone(), held.clone());
        std::thread::spawn(move || {
            let mut conns: Vec<Option<std::net::TcpStream>> = Vec::with_capacity(1000);
            for i in 0..1000 {
                if i % 32 == 31 {
                    // Let the store accept: a full listen backlog costs a 1 s SYN retry.
                    std::thread::sleep(Duration::from_millis(1));
                }
                conns.push(hostile_connection(addr, i));
                opened.fetch_add(1, Ordering::Relaxed);
            }
            held.store(conns.iter().flatten().count(), Ordering::Relaxed);
            // Keep 1000 open: replace each one the store closed.
            let mut i = 1000;
            while !stop.load(Ordering::Relaxed) {
                for c in conns.iter_mut() {
                    let mut b = [0u8; 256];
                    let gone = match c {
                        // Closed (end of file or reset); data is the store's refusal, then the close.
                        Some(s) => match s.read(&mut b) {
                            Ok(n) => n == 0,
                            Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
                        },
                        None => true,
                    };
                    if gone && !stop.load(Ordering::Relaxed) {
                        *c = hostile_connection(addr, i);
                        i += 1;
                        opened.fetch_add(1, Ordering::Relaxed);
                    }
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    check(
        wait_until(Duration::from_secs(10), || held.load(Ordering::Relaxed) > 0),
        "the attacker opens its 1000 connections",
        opened.load(Ordering::Relaxed),
    )?;
    let before = opened.load(Ordering::Relaxed);
    // Node 1 starts amid the flood.
    let t = Instant::now();
    let b = node("1");
    let (oa, ob) = (
        a.wait_with_output().map_err(|e| e.to_string())?,
        b.wait_with_output().map_err(|e| e.to_string())?,
    );
    let took = t.elapsed();
    stop.store(true, Ordering::Relaxed);
    let _ = attacker.join();
    let during = opened.load(Ordering::Relaxed) - before;
    both_succeed(&oa, &ob, "both launchers succeed during the attack")?;
    check(
        String::from_utf8_lossy(&oa.stdout).contains("[rank 0] lockstep selftest ok: 4 ranks"),
        "one 4-rank job ran its collectives",
        show(&oa),
    )?;
    within(
        took,
        10.0,
        "the job completes within 10 s of node 1's start",
    )?;
    println!(
        "    {} of 1000 hostile connections open when node 1 started, {during} more opened while the job ran; the 2-node job completed in {:.2} s",
        held.load(Ordering::Relaxed),
        took.as_secs_f64()
    );
    nothing_left(&mark)
}

// ------------------------------------------------------------------------------------------------
// Restarts (`--max-restarts N`, `--restart-policy job|rank`).

/// Lines of `dir/name`, none when it is missing.
fn lines_of(dir: &std::path::Path, name: &str) -> Vec<String> {
    std::fs::read_to_string(dir.join(name))
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

/// Shell lines for rank 1 of a restart test (`d`: its scratch directory): wait (at most 10 s) until rank 0 of this attempt
/// has written its line to `seen.0`, so that a failure of rank 1 never stops rank 0 before it.
fn wait_for_rank0(d: &std::path::Path) -> String {
    format!(
        "i=0; while [ \"$(cat {d}/seen.0 2>/dev/null | wc -l)\" -le \"$LOCKSTEP_RESTART_COUNT\" ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done;",
        d = d.display()
    )
}

/// A launch of `nproc` ranks of `sh -c script` with `flags`; returns its output once it ends
/// (at most 30 s), after checking that it left no process behind.
fn launch_script(mark: &str, nproc: &str, flags: &[&str], script: &str) -> Result<Output, String> {
    let mut c = lockstep(mark);
    c.args(launch(nproc))
        .args(["--grace-s", "2"])
        .args(flags)
        .args(sh(script));
    let l = Running::spawn(&mut c, mark);
    let pid = l.pid();
    let done = wait_until(Duration::from_secs(30), || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| s.contains(") Z "))
            .unwrap_or(true)
    });
    check(done, "the launch ends within 30 s", "")?;
    let o = l.wait_with_output().map_err(|e| e.to_string())?;
    nothing_left(mark)?;
    Ok(o)
}

/// Job policy: rank 1 fails on the first attempt (LOCKSTEP_RESTART_COUNT=0) while rank 0 has
/// joined the job's segment (`lockstep selftest` waits for rank 1 there); the launcher stops
/// rank 0 and starts both again, now joining a new segment, and the job succeeds. Every rank
/// sees both restart counts; no segment of either attempt and no process is left. Without
/// restarts the same program fails with rank 1's code.
fn restart_job_policy_reruns_every_rank() -> Result<(), String> {
    for max in ["1", "0"] {
        let mark = new_mark(&format!("restart-job-{max}"));
        let d = scratch(&format!("restart-job-{max}"));
        let script = format!(
            "echo \"$LOCKSTEP_RESTART_COUNT $TORCHELASTIC_RESTART_COUNT $LOCKSTEP_REPLACEMENT $LOCKSTEP_JOB_ID\" >> {d}/seen.$RANK; \
             if [ \"$LOCKSTEP_RESTART_COUNT\" = 0 ] && [ \"$RANK\" = 1 ]; then {w} sleep 0.2; exit 4; fi; \
             exec {BIN} selftest",
            d = d.display(),
            w = wait_for_rank0(&d)
        );
        let o = launch_script(
            &mark,
            "2",
            &["--max-restarts", max, "--restart-policy", "job"],
            &script,
        )?;
        let seen: Vec<Vec<String>> = (0..2).map(|r| lines_of(&d, &format!("seen.{r}"))).collect();
        let ids: Vec<&str> = seen
            .iter()
            .flatten()
            .filter_map(|l| l.split(' ').nth(3))
            .collect();
        for id in &ids {
            check(
                !std::path::Path::new(&format!("/dev/shm/lockstep-{id}")).exists(),
                "no segment of any attempt is left",
                id,
            )?;
        }
        if max == "0" {
            exits(&o, 4, "without restarts the job fails with rank 1's code")?;
            check(
                seen.iter().all(|s| s.len() == 1),
                "one attempt only",
                format!("{seen:?}"),
            )?;
            continue;
        }
        check(
            o.status.success(),
            "the job succeeds on its restart",
            show(&o),
        )?;
        for (r, s) in seen.iter().enumerate() {
            let counts: Vec<String> = s
                .iter()
                .map(|l| l.split(' ').take(3).collect::<Vec<_>>().join(" "))
                .collect();
            check(
                counts == ["0 0 0", "1 1 0"],
                &format!("rank {r} ran twice with both restart counts (0, then 1), never as a replacement"),
                format!("{seen:?}"),
            )?;
        }
        check(
            s_id(&seen[0][0]) == s_id(&seen[1][0])
                && s_id(&seen[0][1]) == s_id(&seen[1][1])
                && s_id(&seen[0][0]) != s_id(&seen[0][1]),
            "each attempt has its own job id, shared by its ranks",
            format!("{seen:?}"),
        )?;
        says(
            &o,
            &[
                "rank 1 (pid",
                "exited with code 4: every rank was stopped; starting the whole job again (restart 1 of 1, --restart-policy job)",
                "the job succeeded after 1 restart(s) (--restart-policy job)",
            ],
            "the launcher logs the restart and sums it up",
        )?;
    }
    Ok(())
}

fn s_id(line: &str) -> &str {
    line.split(' ').nth(3).unwrap_or("")
}

/// A program that always fails is started exactly N+1 times; the launcher then exits with the
/// failing rank's code and its summary says it gave up, listing each restart.
fn restart_gives_up_after_n_restarts() -> Result<(), String> {
    let mark = new_mark("restart-giveup");
    let d = scratch("restart-giveup");
    let script = format!(
        "echo $LOCKSTEP_RESTART_COUNT >> {d}/seen.$RANK; if [ \"$RANK\" = 1 ]; then {w} exit 3; fi; sleep 1000 & wait",
        d = d.display(),
        w = wait_for_rank0(&d)
    );
    let o = launch_script(
        &mark,
        "2",
        &["--max-restarts", "2", "--restart-policy", "job"],
        &script,
    )?;
    let err = String::from_utf8_lossy(&o.stderr);
    exits(&o, 3, "the launcher exits with the failing rank's code")?;
    for r in 0..2 {
        check(
            lines_of(&d, &format!("seen.{r}")) == ["0", "1", "2"],
            &format!("rank {r} was started exactly 3 times"),
            format!("{:?}", lines_of(&d, &format!("seen.{r}"))),
        )?;
    }
    check(
        err.contains(
            "lockstep: gave up: 2 of 2 restart(s) (--max-restarts 2, --restart-policy job) used",
        ) && err.contains("  restart 1: rank 1 (pid")
            && err.contains("  restart 2: rank 1 (pid")
            && err.contains("failed first: exited with code 3"),
        "the summary says it gave up and why each restart happened",
        show(&o),
    )
}

/// Rank policy: rank 1 dies and gets a replacement (same rank, LOCKSTEP_REPLACEMENT=1, restart
/// count 1) while ranks 0 and 2 keep running: they wait for the file the replacement writes,
/// so the job succeeds only if the launcher left them alone. When a survivor then fails too and
/// no restart remains, the job fails with its code, as without restarts.
fn restart_rank_policy_replaces_only_the_dead_rank() -> Result<(), String> {
    for survivor_fails in [false, true] {
        let name = format!("restart-rank-{survivor_fails}");
        let mark = new_mark(&name);
        let d = scratch(&name);
        let survivor_end = if survivor_fails { "exit 5" } else { "exit 0" };
        let script = format!(
            "echo \"$LOCKSTEP_RESTART_COUNT $TORCHELASTIC_RESTART_COUNT $LOCKSTEP_REPLACEMENT $LOCKSTEP_RESTART_POLICY $$\" >> {d}/seen.$RANK; \
             if [ \"$RANK\" = 1 ]; then \
               if [ \"$LOCKSTEP_REPLACEMENT\" = 1 ]; then echo \"$RANK $LOCAL_RANK\" > {d}/replaced.tmp; mv {d}/replaced.tmp {d}/replaced; \
                 if [ {survivor_fails} = true ]; then sleep 1000 & wait; fi; exit 0; fi; \
               sleep 0.2; kill -9 $$; fi; \
             i=0; while [ ! -e {d}/replaced ]; do sleep 0.05; i=$((i+1)); if [ $i -gt 300 ]; then exit 9; fi; done; \
             if [ $RANK = 2 ]; then sleep 0.2; {survivor_end}; fi; exit 0",
            d = d.display()
        );
        let o = launch_script(&mark, "3", &["--max-restarts", "1"], &script)?;
        let err = String::from_utf8_lossy(&o.stderr);
        let seen: Vec<Vec<String>> = (0..3).map(|r| lines_of(&d, &format!("seen.{r}"))).collect();
        let first = |r: usize| {
            seen[r]
                .first()
                .map(|l| l.rsplit_once(' ').map(|x| x.0.to_string()))
        };
        check(
            seen[0].len() == 1 && seen[2].len() == 1 && first(0) == Some(Some("0 0 0 rank".into())),
            "the survivors were started once, with restart count 0, not as replacements",
            format!("{seen:?}"),
        )?;
        check(
            seen[1].len() == 2
                && seen[1][0].starts_with("0 0 0 rank ")
                && seen[1][1].starts_with("1 1 1 rank "),
            "rank 1 was replaced once, with restart count 1 and the marker",
            format!("{seen:?}"),
        )?;
        check(
            lines_of(&d, "replaced") == ["1 1"],
            "the replacement has the same rank and local rank",
            format!("{:?}", lines_of(&d, "replaced")),
        )?;
        check(
            err.contains("was killed by signal 9 (SIGKILL): starting a replacement with the same rank while the other ranks run on (restart 1 of 1, --restart-policy rank)")
                || err.contains("starting a replacement with the same rank while the other ranks run on (restart 1 of 1, --restart-policy rank)"),
            "the launcher logs the replacement",
            show(&o),
        )?;
        if survivor_fails {
            check(
                o.status.code() == Some(5) && err.contains("gave up: 1 of 1 restart(s)"),
                "a survivor failing with no restart left ends the job with its code",
                show(&o),
            )?;
        } else {
            check(
                o.status.success(),
                "the job succeeds with the replacement",
                show(&o),
            )?;
            says(
                &o,
                &["the job succeeded after 1 restart(s) (--restart-policy rank)"],
                "the launcher sums up the restart",
            )?;
        }
    }
    Ok(())
}

/// `--max-restarts` and `--restart-policy` are parsed strictly; rank policy without restarts
/// and restarts across nodes are refused with what to do.
fn restart_flags_are_strict() -> Result<(), String> {
    let mark = new_mark("restart-flags");
    let cases: &[(&[&str], i32, &str)] = &[
        (&["--max-restarts=-1"], 2, "not a number of restarts"),
        (&["--max-restarts", "+1"], 2, "not a number of restarts"),
        (&["--max-restarts", "x"], 2, "not a number of restarts"),
        (&["--restart-policy", "node"], 2, "not a restart policy"),
        (
            &["--restart-policy", "rank"],
            1,
            "--restart-policy rank with --max-restarts 0 replaces nothing",
        ),
        (
            &["--max_restarts", "1", "--nnodes", "2"],
            1,
            "restarts are only supported in single-node jobs",
        ),
    ];
    for (flags, code, says) in cases {
        let o = lockstep(&mark)
            .args(launch("1"))
            .args(*flags)
            .args(["--", "true"])
            .env("LOCKSTEP_TOKEN", TOKEN)
            .run()?;
        check(
            o.status.code() == Some(*code) && String::from_utf8_lossy(&o.stderr).contains(says),
            &format!("{flags:?} is refused with exit {code}, saying {says:?}"),
            show(&o),
        )?;
    }
    nothing_left(&mark)
}

fn main() -> std::process::ExitCode {
    common::run(&[
        (
            "sighup_sends_sigterm_then_exits_129",
            sighup_sends_sigterm_then_exits_129,
        ),
        (
            "kill9_launcher_kills_every_descendant",
            kill9_launcher_kills_every_descendant,
        ),
        (
            "sigint_with_stubborn_ranks_exits_130",
            sigint_with_stubborn_ranks_exits_130,
        ),
        ("malformed_env_is_an_error", malformed_env_is_an_error),
        ("node0_honours_rdzv_timeout", node0_honours_rdzv_timeout),
        (
            "rdzv_timeout_names_only_the_missing_node",
            rdzv_timeout_names_only_the_missing_node,
        ),
        ("foreign_master_port_is_named", foreign_master_port_is_named),
        (
            "two_node_job_completes_under_attack",
            two_node_job_completes_under_attack,
        ),
        (
            "restart_job_policy_reruns_every_rank",
            restart_job_policy_reruns_every_rank,
        ),
        (
            "restart_gives_up_after_n_restarts",
            restart_gives_up_after_n_restarts,
        ),
        (
            "restart_rank_policy_replaces_only_the_dead_rank",
            restart_rank_policy_replaces_only_the_dead_rank,
        ),
        ("restart_flags_are_strict", restart_flags_are_strict),
    ])
}
