//! End-to-end tests of `lockstep launch` and the other subcommands, run against the built binary
//! (`CARGO_BIN_EXE_lockstep`). Sequential (`harness = false`): several tests time the launcher's
//! reactions, and the machine has two cores.

#[path = "common/cli.rs"]
mod cli;
#[path = "../../../tests/common/mod.rs"]
mod common;
#[path = "../../../tests/common/rank_lines.rs"]
mod rank_lines;

use cli::{both_succeed, exits, fails_saying, launch, prints, says, sh, two_nodes, within, Run};
use common::{show, text};

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::{alive, check, children_of, free_port, grandchildren_of, scratch, signal, wait_until};

const BIN: &str = env!("CARGO_BIN_EXE_lockstep");
/// A valid job token (at least 16 bytes), passed through the environment as users should.
const TOKEN: &str = "launch-cli-test-token-0123";

fn lockstep() -> Command {
    let mut c = Command::new(BIN);
    c.env_remove("LOCKSTEP_TOKEN")
        .env_remove("RANK")
        .env_remove("WORLD_SIZE");
    // No configuration file of the user's, and none of the variables that override one.
    c.env("XDG_CONFIG_HOME", "/nonexistent/lockstep-test-config");
    for v in [
        "LOCKSTEP_CONFIG",
        "LOCKSTEP_BACKEND",
        "MASTER_ADDR",
        "MASTER_PORT",
    ] {
        c.env_remove(v);
    }
    c
}

/// A running launcher that is killed and reaped if a test returns early.
struct Running(Option<Child>);

impl Running {
    fn id(&self) -> u32 {
        self.0.as_ref().expect("running").id()
    }
    fn try_wait(&mut self) -> std::io::Result<Option<std::process::ExitStatus>> {
        self.0.as_mut().expect("running").try_wait()
    }
    fn wait(mut self) -> std::io::Result<std::process::ExitStatus> {
        self.0.take().expect("running").wait()
    }
    fn wait_with_output(mut self) -> std::io::Result<Output> {
        self.0.take().expect("running").wait_with_output()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn spawn_piped(c: &mut Command) -> Running {
    Running(Some(
        c.stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn lockstep"),
    ))
}

/// Node `node_rank` of a two-node job of `nproc` ranks per node, its store on `port`, with the
/// job's token; the program follows.
fn node_of_two(nproc: &str, node_rank: &str, port: &str) -> Command {
    let mut c = lockstep();
    c.env("LOCKSTEP_TOKEN", TOKEN)
        .args(two_nodes(nproc, port))
        .args(["--node-rank", node_rank]);
    c
}

/// The outputs of the two launchers of a job, once both have ended.
fn wait_both(a: Running, b: Running) -> Result<(Output, Output), String> {
    let oa = a.wait_with_output().map_err(|e| e.to_string())?;
    let ob = b.wait_with_output().map_err(|e| e.to_string())?;
    Ok((oa, ob))
}

/// A launch of `n` ranks that sleep (`exec sleep 30`) and their pids, once all have started.
fn sleeping_job(n: usize) -> Result<(Running, Vec<i32>), String> {
    let mut c = lockstep();
    c.args(launch(&n.to_string())).args(sh("exec sleep 30"));
    let child = spawn_piped(&mut c);
    let ranks = ranks_of(child.id() as i32, n)?;
    Ok((child, ranks))
}

/// Wait for `n` ranks under launcher `pid` (each under its guard), then return their pids.
fn ranks_of(pid: i32, n: usize) -> Result<Vec<i32>, String> {
    let mut kids = Vec::new();
    let ok = wait_until(Duration::from_secs(5), || {
        kids = grandchildren_of(pid);
        kids.len() >= n
    });
    check(
        ok,
        "the launcher did not start its ranks",
        format!("grandchildren of {pid}: {kids:?}"),
    )?;
    Ok(kids)
}

/// Every rank in `ranks` is gone.
fn none_survive(ranks: &[i32]) -> Result<(), String> {
    check(
        ranks.iter().all(|p| !alive(*p)),
        "no rank may survive",
        format!("{ranks:?}"),
    )
}

/// SIGKILL the process among `ranks` whose `RANK` is `rank`.
fn kill_rank(ranks: &[i32], rank: &str) -> Result<(), String> {
    let pid = *ranks
        .iter()
        .find(|p| env_of(**p, "RANK").as_deref() == Some(rank))
        .ok_or(format!("no rank {rank}"))?;
    signal(pid, libc::SIGKILL);
    Ok(())
}

fn env_of(pid: i32, key: &str) -> Option<String> {
    let e = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    e.split(|b| *b == 0).find_map(|kv| {
        kv.strip_prefix(format!("{key}=").as_bytes())
            .map(|v| String::from_utf8_lossy(v).into_owned())
    })
}

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_nanos()
}

// ------------------------------------------------------------------------------------------------

fn selftest_two_and_eight_ranks() -> Result<(), String> {
    for n in [2, 8] {
        let o = lockstep()
            .args(launch(&n.to_string()))
            .args(["--", BIN, "selftest"])
            .run()?;
        let ok = format!("[rank 0] lockstep selftest ok: {n} ranks, backend shm");
        prints(&o, &[&ok], "selftest failed")?;
    }
    Ok(())
}

fn fail_fast_exit_code() -> Result<(), String> {
    let d = scratch("failfast");
    let script = format!(
        "echo $$ > {d}/pid.$RANK; if [ \"$RANK\" = 1 ]; then sleep 0.3; echo 'rank one fails' >&2; date +%s%N > {d}/t1; exit 3; fi; exec sleep 30",
        d = d.display()
    );
    let o = lockstep().args(launch("3")).args(sh(&script)).run()?;
    let end = now_ns();
    let (_, err) = text(&o);
    exits(&o, 3, "launcher must exit with the failing rank's code 3")?;
    let t1: u128 = std::fs::read_to_string(d.join("t1"))
        .map_err(|e| e.to_string())?
        .trim()
        .parse()
        .map_err(|_| "bad t1".to_string())?;
    let lag = (end.saturating_sub(t1)) as f64 / 1e9;
    check(
        lag < 1.0,
        "launcher must exit within 1 s of the failure",
        format!("lag {lag:.3} s\n{}", show(&o)),
    )?;
    check(
        err.contains("rank 1 (pid")
            && err.contains("failed first: exited with code 3")
            && err.contains("| rank one fails")
            && err.contains("=========="),
        "summary must name rank 1 and show its stderr",
        show(&o),
    )?;
    for r in [0, 2] {
        let pid: i32 = std::fs::read_to_string(d.join(format!("pid.{r}")))
            .map_err(|e| e.to_string())?
            .trim()
            .parse()
            .map_err(|_| "bad pid".to_string())?;
        check(
            !alive(pid),
            "the other ranks must be gone",
            format!("rank {r} pid {pid} alive"),
        )?;
    }
    println!(
        "    fail-fast: launcher exited {:.1} ms after rank 1's exit",
        lag * 1e3
    );
    Ok(())
}

fn kill9_rank_mid_all_reduce() -> Result<(), String> {
    // --no-fail-fast lets the survivor notice the loss itself (PeerLost) before the report.
    let mut c = lockstep();
    c.args(launch("2")).args([
        "--no-fail-fast",
        "--",
        BIN,
        "selftest",
        "--iters",
        "1000000000",
        "--count",
        "4096",
    ]);
    let child = spawn_piped(&mut c);
    let ranks = ranks_of(child.id() as i32, 2)?;
    std::thread::sleep(Duration::from_millis(300));
    kill_rank(&ranks, "1")?;
    let t = Instant::now();
    let o = child.wait_with_output().map_err(|e| e.to_string())?;
    let (_, err) = text(&o);
    exits(
        &o,
        137,
        "launcher must exit 128+9 for the SIGKILLed root cause",
    )?;
    check(
        err.contains("rank 1 (pid") && err.contains("SIGKILL"),
        "summary must name rank 1 and SIGKILL",
        show(&o),
    )?;
    check(
        err.contains("died while rank 0 was in all_reduce"),
        "the survivor must report the lost peer",
        show(&o),
    )?;
    within(t.elapsed(), 3.0, "the survivor must notice within seconds")
}

fn kill9_rank_fail_fast() -> Result<(), String> {
    let mut c = lockstep();
    c.args(launch("2"))
        .args(["--", BIN, "selftest", "--iters", "1000000000"]);
    let child = spawn_piped(&mut c);
    let ranks = ranks_of(child.id() as i32, 2)?;
    std::thread::sleep(Duration::from_millis(200));
    kill_rank(&ranks, "1")?;
    let o = child.wait_with_output().map_err(|e| e.to_string())?;
    exits(&o, 137, "launcher must exit 137")?;
    none_survive(&ranks)
}

fn kill9_launcher_leaves_nothing() -> Result<(), String> {
    let (child, ranks) = sleeping_job(3)?;
    signal(child.id() as i32, libc::SIGKILL);
    let _ = child.wait();
    let gone = wait_until(Duration::from_secs(2), || ranks.iter().all(|p| !alive(*p)));
    check(
        gone,
        "every rank must die with the launcher",
        format!(
            "alive: {:?}",
            ranks.iter().filter(|p| alive(**p)).collect::<Vec<_>>()
        ),
    )
}

fn sigint_reaches_every_rank() -> Result<(), String> {
    let (child, ranks) = sleeping_job(2)?;
    std::thread::sleep(Duration::from_millis(100));
    let t = Instant::now();
    signal(child.id() as i32, libc::SIGINT);
    let o = child.wait_with_output().map_err(|e| e.to_string())?;
    exits(&o, 130, "launcher must exit 130 after SIGINT")?;
    within(t.elapsed(), 1.0, "SIGINT must stop the job at once")?;
    none_survive(&ranks)
}

fn sigterm_reaches_every_rank() -> Result<(), String> {
    let (child, ranks) = sleeping_job(2)?;
    std::thread::sleep(Duration::from_millis(100));
    signal(child.id() as i32, libc::SIGTERM);
    let o = child.wait_with_output().map_err(|e| e.to_string())?;
    fails_saying(
        &o,
        143,
        "stopped by SIGTERM",
        "launcher must exit 143 after SIGTERM",
    )?;
    none_survive(&ranks)
}

fn second_sigint_kills_at_once() -> Result<(), String> {
    let mut c = lockstep();
    // Ranks that ignore SIGINT and SIGTERM: only the second Ctrl-C (SIGKILL) stops them.
    c.args(launch("2"))
        .args(["--grace-s", "30"])
        .args(sh("trap '' INT TERM; exec sleep 30"));
    let mut child = spawn_piped(&mut c);
    let ranks = ranks_of(child.id() as i32, 2)?;
    std::thread::sleep(Duration::from_millis(100));
    signal(child.id() as i32, libc::SIGINT);
    std::thread::sleep(Duration::from_millis(300));
    check(
        child.try_wait().map_err(|e| e.to_string())?.is_none(),
        "ranks ignoring SIGINT keep the job alive during the grace period",
        "",
    )?;
    let t = Instant::now();
    signal(child.id() as i32, libc::SIGINT);
    let o = child.wait_with_output().map_err(|e| e.to_string())?;
    check(
        t.elapsed() < Duration::from_secs(1),
        "the second SIGINT must kill at once",
        format!("{:?}\n{}", t.elapsed(), show(&o)),
    )?;
    exits(
        &o,
        130,
        "the launcher exits 128+SIGINT even though the ranks needed SIGKILL",
    )?;
    none_survive(&ranks)
}

fn output_is_line_atomic_and_prefixed() -> Result<(), String> {
    // `yes` writes 8 KiB blocks, so lines are cut at arbitrary points between pipe reads.
    let n = 20000;
    let script = format!(
        "if [ $RANK = 0 ]; then printf '10%%\\r20%%\\r30%%\\n'; fi; yes \"$RANK-0123456789abcdefghijklmnopqrstuvwxyz-$RANK\" | head -n {n}"
    );
    let o = lockstep().args(launch("4")).args(sh(&script)).run()?;
    let (out, _) = text(&o);
    check(o.status.success(), "job failed", show(&o))?;
    let progress = ["[rank 0] 10%", "[rank 0] 20%", "[rank 0] 30%"];
    let lines = out
        .split_inclusive(['\n', '\r'])
        .map(|seg| seg.trim_end_matches(['\n', '\r']))
        .filter(|body| !progress.contains(body));
    let counts: [usize; 4] = rank_lines::per_rank(
        lines,
        |body| {
            (0..4).find(|r| {
                body == format!("[rank {r}] {r}-0123456789abcdefghijklmnopqrstuvwxyz-{r}")
            })
        },
        "every line must be one rank's whole line with its prefix",
    )?;
    check(
        counts == [n; 4],
        "every line must arrive",
        format!("{counts:?}"),
    )?;
    check(
        out.contains("[rank 0] 10%\r[rank 0] 20%\r[rank 0] 30%\n"),
        "\\r segments are forwarded one by one",
        "",
    )
}

fn log_dir_and_ranks_filter() -> Result<(), String> {
    let d = scratch("logs");
    let o = lockstep()
        .args(launch("2"))
        .args(["--ranks-filter", "1", "--log-dir"])
        .arg(&d)
        .args(sh("echo out $RANK; echo err $RANK >&2"))
        .run()?;
    let (out, err) = text(&o);
    check(
        o.status.success() && out == "[rank 1] out 1\n" && err == "[rank 1] err 1\n",
        "only rank 1 is shown",
        show(&o),
    )?;
    let log0 = std::fs::read_to_string(d.join("rank-0.log")).map_err(|e| e.to_string())?;
    check(
        log0.contains("out 0\n") && log0.contains("err 0\n"),
        "rank 0's log has both streams",
        &log0,
    )
}

fn log_dir_links_and_permissions() -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let d = scratch("loglinks");
    let victim = d.join("victim");
    std::fs::write(&victim, "precious").map_err(|e| e.to_string())?;
    let run = |dir: &std::path::Path| {
        lockstep()
            .args(launch("2"))
            .arg("--log-dir")
            .arg(dir)
            .args(sh("echo out $RANK"))
            .run()
    };
    // A link planted under rank 1's log name: the launch is refused before any rank starts.
    let links = d.join("links");
    std::fs::create_dir(&links).map_err(|e| e.to_string())?;
    std::os::unix::fs::symlink(&victim, links.join("rank-1.log")).map_err(|e| e.to_string())?;
    let o = run(&links)?;
    let (out, err) = text(&o);
    check(
        !o.status.success()
            && err.contains("rank-1.log")
            && err.contains("symbolic link")
            && out.is_empty(),
        "a planted link is refused",
        show(&o),
    )?;
    check(
        std::fs::read_to_string(&victim).ok().as_deref() == Some("precious"),
        "the link's target is unchanged",
        "",
    )?;
    // A group-writable directory without the sticky bit.
    let shared = d.join("shared");
    std::fs::create_dir(&shared).map_err(|e| e.to_string())?;
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o770))
        .map_err(|e| e.to_string())?;
    let o = run(&shared)?;
    check(
        !o.status.success() && text(&o).1.contains("without the sticky bit"),
        "a group-writable directory is refused",
        show(&o),
    )?;
    // A new directory is made 0700 and the job runs.
    let fresh = d.join("fresh");
    let o = run(&fresh)?;
    let mode = std::fs::metadata(&fresh)
        .map(|m| m.permissions().mode() & 0o7777)
        .unwrap_or(0);
    check(
        o.status.success() && mode == 0o700,
        "a new log directory is created 0700",
        format!("mode {mode:o}\n{}", show(&o)),
    )?;
    let log1 = std::fs::read_to_string(fresh.join("rank-1.log")).map_err(|e| e.to_string())?;
    check(log1 == "out 1\n", "and the ranks log there", &log1)
}

fn two_launchers_form_one_job() -> Result<(), String> {
    let port = free_port().to_string();
    let node = |r: &str| spawn_piped(node_of_two("2", r, &port).args(["--", BIN, "selftest"]));
    let a = node("0");
    let b = node("1");
    let (oa, ob) = wait_both(a, b)?;
    both_succeed(&oa, &ob, "both launchers must succeed")?;
    check(
        text(&oa)
            .0
            .contains("[rank 0] lockstep selftest ok: 4 ranks, backend shm"),
        "one 4-rank job",
        show(&oa),
    )
}

fn failure_on_one_node_stops_the_other() -> Result<(), String> {
    let port = free_port().to_string();
    let script =
        "if [ $RANK = 3 ]; then sleep 0.3; echo 'rank three fails' >&2; exit 3; fi; exec sleep 30";
    let node = |r: &str| spawn_piped(node_of_two("2", r, &port).args(sh(script)));
    let (a, b) = (node("0"), node("1"));
    let t = Instant::now();
    let (oa, ob) = wait_both(a, b)?;
    fails_saying(
        &ob,
        3,
        "rank three fails",
        "node 1 reports its failing rank",
    )?;
    fails_saying(
        &oa,
        3,
        "because rank 3 (pid",
        "node 0 stops and exits with the root cause's code",
    )?;
    within(t.elapsed(), 1.5, "both stop within a second of the failure")
}

fn cross_host_cpu_job_is_refused() -> Result<(), String> {
    let port = free_port().to_string();
    let node = |r: &str, host: &str| {
        let mut c = node_of_two("1", r, &port);
        c.env("LOCKSTEP_HOST_ID", host)
            .args(["--", BIN, "selftest"]);
        spawn_piped(&mut c)
    };
    let (a, b) = (node("0", "hostA"), node("1", "hostB"));
    let (oa, ob) = wait_both(a, b)?;
    check(
        !oa.status.success() && !ob.status.success(),
        "both must fail",
        format!("{}\n{}", show(&oa), show(&ob)),
    )?;
    // Whichever node's rank fails first reports why; the other node may be stopped before its rank does.
    let both = format!("{}{}", text(&oa).1, text(&ob).1);
    check(
        both.contains("a cross-host CPU communicator is not available"),
        "the error must say why",
        format!("{}\n{}", show(&oa), show(&ob)),
    )
}

fn busy_port_is_named() -> Result<(), String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let port = l
        .local_addr()
        .map_err(|e| e.to_string())?
        .port()
        .to_string();
    let o = lockstep()
        .env("LOCKSTEP_TOKEN", TOKEN)
        .args(two_nodes("1", &port))
        .args(["--", "true"])
        .run()?;
    let (_, err) = text(&o);
    check(
        o.status.code() == Some(1)
            && err.contains(&format!("port {port}"))
            && err.contains("already in use")
            && err.contains("--master-port"),
        "busy port must be named",
        show(&o),
    )
}

fn wrong_token_and_unreachable_master() -> Result<(), String> {
    let port = free_port().to_string();
    let mut c = lockstep();
    c.env("LOCKSTEP_TOKEN", "right-token-0123456789");
    c.args(two_nodes("1", &port)).args(["--", "sleep", "30"]);
    let a = spawn_piped(&mut c);
    let o = lockstep()
        .env("LOCKSTEP_TOKEN", "wrong-token-0123456789")
        .args(two_nodes("1", &port))
        .args(["--node-rank", "1", "--rdzv-timeout-s", "5", "--", "true"])
        .run()?;
    signal(a.id() as i32, libc::SIGTERM);
    let _ = a.wait();
    fails_saying(
        &o,
        1,
        "rejected this job's token",
        "wrong token must be reported",
    )?;
    let t = Instant::now();
    let o = lockstep()
        .env("LOCKSTEP_TOKEN", TOKEN)
        .args(two_nodes("1", &free_port().to_string()))
        .args(["--node-rank", "1", "--rdzv-timeout-s", "1", "--", "true"])
        .run()?;
    fails_saying(
        &o,
        1,
        "could not reach the rendezvous store",
        "unreachable master must be reported",
    )?;
    within(t.elapsed(), 4.0, "retries are bounded by --rdzv-timeout-s")?;
    // A port whose holder accepts connections (the kernel's listen queue) but never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let sport = silent.local_addr().map_err(|e| e.to_string())?.port();
    let t = Instant::now();
    let o = lockstep()
        .env("LOCKSTEP_TOKEN", TOKEN)
        .args(two_nodes("1", &sport.to_string()))
        .args(["--node-rank", "1"])
        .args(["--rdzv-timeout-s", "1", "--", "true"])
        .run()?;
    fails_saying(
        &o,
        1,
        &format!("the peer at 127.0.0.1:{sport} does not speak the lockstep store protocol"),
        "a port that accepts but never answers is named",
    )?;
    within(
        t.elapsed(),
        3.0,
        "within --rdzv-timeout-s (1 s), not a fixed 10 s",
    )
}

/// Node 1 of a two-node job whose node 0 is nowhere: gets as far as the token checks and the
/// rendezvous, then fails fast.
fn lone_node1() -> Command {
    let mut c = lockstep();
    c.args(two_nodes("1", &free_port().to_string()))
        .args(["--node-rank", "1"]);
    c.args(["--rdzv-timeout-s", "0.2"]);
    c
}

fn token_rules() -> Result<(), String> {
    // Refused tokens, each with the reason (and, for obvious ones, how to make a good one):
    // (case, the token in LOCKSTEP_TOKEN, options before the program, what stderr says).
    let refused: [(&str, Option<&str>, &[&str], &str); 5] = [
        ("a short token is refused", Some("short"), &[], "5 byte(s) long, but at least 16"),
        ("an empty --token is refused", None, &["--token", ""], "at least 16"),
        (
            "a repeated character is refused",
            Some("aaaaaaaaaaaaaaaaaaaa"),
            &[],
            "the job token is one character repeated ('a' 20 times), which anyone can guess; leave it out on node 0 and `lockstep launch` generates one, or make one with `openssl rand -hex 16`",
        ),
        (
            "a sequence is refused",
            Some("0123456789abcdef"),
            &[],
            "the job token is a simple sequence (\"0123456789ab...\"), which anyone can guess",
        ),
        // Node 1 without a token is told where to get node 0's.
        (
            "node 1 needs a token",
            None,
            &[],
            "node 1 of a multi-node job needs the job's token",
        ),
    ];
    for (what, token, options, says) in refused {
        let mut c = lone_node1();
        if let Some(t) = token {
            c.env("LOCKSTEP_TOKEN", t);
        }
        let o = c.args(options).args(["--", "true"]).run()?;
        fails_saying(&o, 1, says, what)?;
    }
    // --token works but warns that `ps` shows it.
    let o = lone_node1().args(["--token", TOKEN, "--", "true"]).run()?;
    let err = text(&o).1;
    check(
        err.contains("warning: --token puts the job token on the command line")
            && err.contains("could not reach the rendezvous store"),
        "--token is accepted with a warning",
        show(&o),
    )?;
    // A token file others can read is used, with a warning; --token and --token-file exclude each other.
    let d = scratch("token-rules");
    let f = d.join("shared-token");
    std::fs::write(&f, format!("{TOKEN}\n")).map_err(|e| e.to_string())?;
    std::fs::set_permissions(&f, std::os::unix::fs::PermissionsExt::from_mode(0o644))
        .map_err(|e| e.to_string())?;
    let o = lone_node1()
        .arg("--token-file")
        .arg(&f)
        .args(["--", "true"])
        .run()?;
    says(
        &o,
        &[
            "has mode 644",
            "chmod 600",
            "could not reach the rendezvous store",
        ],
        "a token file readable by others is used with a warning",
    )?;
    let o = lone_node1()
        .args(["--token", TOKEN, "--token-file"])
        .arg(&f)
        .args(["--", "true"])
        .run()?;
    fails_saying(
        &o,
        2,
        "cannot be used with",
        "--token and --token-file conflict",
    )
}

fn generated_token_reaches_the_other_node() -> Result<(), String> {
    let d = scratch("gen-token");
    let port = free_port().to_string();
    // Node 0 gets no token: it generates one and prints how to pass it on (stderr to a file, to
    // read it while node 0 runs).
    let err0 = d.join("node0.err");
    let f = std::fs::File::create(&err0).map_err(|e| e.to_string())?;
    let mut c = lockstep();
    c.args(two_nodes("1", &port))
        .args(["--node-rank", "0", "--", BIN, "selftest"]);
    let a = Running(Some(
        c.stdout(Stdio::piped())
            .stderr(Stdio::from(f))
            .spawn()
            .map_err(|e| e.to_string())?,
    ));
    let mut token = None;
    wait_until(Duration::from_secs(5), || {
        let t = std::fs::read_to_string(&err0).unwrap_or_default();
        token = t
            .split_whitespace()
            .find_map(|w| w.strip_prefix("LOCKSTEP_TOKEN="))
            .map(String::from);
        token.is_some()
    });
    let printed = std::fs::read_to_string(&err0).unwrap_or_default();
    let Some(token) = token else {
        return Err(format!("node 0 printed no generated token:\n{printed}"));
    };
    check(
        token.len() == 32 && token.chars().all(|c| c.is_ascii_hexdigit()),
        "a 128-bit hex token",
        &printed,
    )?;
    check(
        printed.contains("--token-file") && printed.contains("not --token"),
        "the hint names the safe ways to pass it",
        &printed,
    )?;
    // Node 1 reads it from a private file.
    let tf = d.join("token");
    {
        use std::os::unix::fs::OpenOptionsExt;
        let mut w = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tf)
            .map_err(|e| e.to_string())?;
        std::io::Write::write_all(&mut w, format!("{token}\n").as_bytes())
            .map_err(|e| e.to_string())?;
    }
    let ob = lockstep()
        .args(two_nodes("1", &port))
        .args(["--node-rank", "1", "--token-file"])
        .arg(&tf)
        .args(["--", BIN, "selftest"])
        .run()?;
    let oa = a.wait_with_output().map_err(|e| e.to_string())?;
    check(
        oa.status.success() && ob.status.success(),
        "both launchers succeed with the generated token",
        format!("{}\n{printed}\n{}", show(&oa), show(&ob)),
    )?;
    check(
        !text(&ob).1.contains("warning"),
        "a private token file draws no warning",
        show(&ob),
    )?;
    check(
        text(&oa)
            .0
            .contains("[rank 0] lockstep selftest ok: 2 ranks"),
        "one 2-rank job",
        show(&oa),
    )
}

/// Rank 0 leads the node's process group and the other ranks join it, though their guards are
/// forked before rank 0's pid is known (they learn the group through their control pipes). When
/// rank 0 cannot start, the launcher says so promptly and leaves no guard or rank behind.
fn ranks_share_rank0s_group_and_a_failed_rank0_leaves_nothing() -> Result<(), String> {
    let o = lockstep()
        .args(launch("4"))
        .args(sh("echo pgrp $$ $(cut -d' ' -f5 /proc/$$/stat)"))
        .run()?;
    check(o.status.success(), "four ranks of sh run", show(&o))?;
    let groups = groups_of(&o);
    check(groups.len() == 4, "every rank printed its group", show(&o))?;
    let (p0, g0) = groups
        .get("0")
        .cloned()
        .ok_or_else(|| format!("rank 0 printed nothing\n{}", show(&o)))?;
    check(p0 == g0, "rank 0 leads the group", show(&o))?;
    check(
        groups.values().all(|(_, g)| *g == g0),
        "every rank is in rank 0's group",
        show(&o),
    )?;

    // An executable whose interpreter does not exist: found on disk, refused by execve.
    let dir = std::env::temp_dir().join(format!("lockstep-test-{}-badexec", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let prog = dir.join("prog");
    std::fs::write(&prog, "#!/nonexistent/interpreter\n").map_err(|e| e.to_string())?;
    std::fs::set_permissions(&prog, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .map_err(|e| e.to_string())?;
    let t = std::time::Instant::now();
    let o = lockstep().args(launch("4")).arg("--").arg(&prog).run()?;
    let took = t.elapsed();
    let _ = std::fs::remove_dir_all(&dir);
    fails_saying(
        &o,
        1,
        "cannot start rank 0",
        "a rank 0 that cannot exec is reported",
    )?;
    check(
        took < std::time::Duration::from_secs(5),
        &format!("the launcher gives up at once (took {took:?})"),
        show(&o),
    )?;
    // No guard of that launch may be left: a guard keeps its launcher's command line, which
    // names the program (other jobs' guards on the machine do not count).
    std::thread::sleep(std::time::Duration::from_millis(100));
    let ours = prog.to_string_lossy().into_owned();
    let guards = std::fs::read_dir("/proc")
        .map_err(|e| e.to_string())?
        .flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path().join("comm"))
                .is_ok_and(|c| c.trim() == "lockstep-guard")
        })
        .filter(|e| {
            std::fs::read(e.path().join("cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&ours))
        })
        .count();
    check(
        guards == 0,
        &format!("no guard is left behind ({guards} found)"),
        show(&o),
    )
}

/// The process groups the ranks of one launch printed ("[rank R] pgrp PID PGRP"): rank -> (pid, pgrp).
fn groups_of(o: &Output) -> std::collections::BTreeMap<String, (String, String)> {
    let mut groups = std::collections::BTreeMap::new();
    for l in text(o).0.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        if let ["[rank", r, "pgrp", pid, pg] = f[..] {
            groups.insert(
                r.trim_end_matches(']').to_string(),
                (pid.to_string(), pg.to_string()),
            );
        }
    }
    groups
}

fn rank0_exiting_at_once_keeps_every_rank_in_its_group() -> Result<(), String> {
    // Rank 0 ends the moment it starts; the others join its group after that. Its guard holds it
    // unreaped until every rank has joined, so the group outlives it.
    let script =
        "[ \"$RANK\" = 0 ] && exec echo pgrp $$ $$; echo pgrp $$ $(cut -d' ' -f5 /proc/$$/stat)";
    for i in 0..30 {
        let o = lockstep().args(launch("4")).args(sh(script)).run()?;
        check(
            o.status.success(),
            &format!("launch {i}: four ranks of sh run"),
            show(&o),
        )?;
        let groups = groups_of(&o);
        check(
            groups.len() == 4,
            &format!("launch {i}: every rank printed its group"),
            show(&o),
        )?;
        let (p0, _) = groups
            .get("0")
            .cloned()
            .ok_or_else(|| format!("rank 0 printed nothing\n{}", show(&o)))?;
        check(
            groups.values().all(|(_, g)| *g == p0),
            &format!("launch {i}: every rank is in rank 0's group"),
            show(&o),
        )?;
    }
    Ok(())
}

fn stopped_guard_does_not_hang_the_launcher() -> Result<(), String> {
    // Rank 1 stops its own guard (its parent) and exits: the guard cannot report the exit, so the
    // launcher must notice the exited rank, name the stopped guard and continue it. At once, the
    // guard may be stopped before it reported that its rank started (the launcher is still
    // starting ranks then); after a pause, the job is running.
    for (pause, starting) in [("", true), ("sleep 0.3;", false)] {
        let t = Instant::now();
        let o = lockstep()
            .args(launch("2"))
            .args(["--grace-s", "3", "--", "sh", "-c"])
            .arg(format!(
                "if [ $RANK = 1 ]; then {pause} echo guard $PPID; kill -STOP $PPID; fi; echo done"
            ))
            .run()?;
        let took = t.elapsed();
        let (out, err) = text(&o);
        let guard = out
            .lines()
            .find_map(|l| l.strip_prefix("[rank 1] guard "))
            .ok_or_else(|| format!("rank 1 did not run\n{}", show(&o)))?;
        check(
            o.status.success(),
            "the job ends with the ranks' status",
            show(&o),
        )?;
        let running =
            format!("its guard (pid {guard}) has not reported it: the guard is stopped (SIGSTOP or job control); continuing it (SIGCONT)");
        let start = format!(
            "the guard (pid {guard}) of a starting rank is stopped: continuing it (SIGCONT)"
        );
        check(
            err.contains(&running) || (starting && err.contains(&start)),
            "the launcher names the stopped guard",
            show(&o),
        )?;
        check(
            took < Duration::from_secs(3),
            &format!("the job ends within the grace period (took {took:?})"),
            show(&o),
        )?;
    }

    // Ctrl-C while a guard is stopped: the job still ends within the grace period.
    let mut c = lockstep();
    c.args(launch("2"))
        .args(["--grace-s", "2", "--", "sh", "-c"]);
    c.arg("if [ $RANK = 1 ]; then sleep 0.3; echo guard $PPID; kill -STOP $PPID; fi; echo ready; exec sleep 30");
    let child = spawn_piped(&mut c);
    let ranks = ranks_of(child.id() as i32, 2)?;
    // Until rank 1 has stopped its guard.
    let stopped = wait_until(Duration::from_secs(5), || {
        children_of(child.id() as i32).iter().any(|g| {
            std::fs::read_to_string(format!("/proc/{g}/stat")).is_ok_and(|s| s.contains(") T "))
        })
    });
    check(stopped, "rank 1 stopped its guard", "")?;
    let t = Instant::now();
    signal(child.id() as i32, libc::SIGINT);
    let o = child.wait_with_output().map_err(|e| e.to_string())?;
    let took = t.elapsed();
    let (out, err) = text(&o);
    let guard = out
        .lines()
        .find_map(|l| l.strip_prefix("[rank 1] guard "))
        .unwrap_or("?");
    exits(&o, 130, "the launcher exits 130 after SIGINT")?;
    // (Found by the signal, or, on a machine slow enough that the launcher was still starting
    // ranks, while it waited for the guard's report.)
    check(
        err.contains(&format!(
            "the guard (pid {guard}) of rank 1 is stopped: continuing it (SIGCONT)"
        )) || err.contains(&format!(
            "the guard (pid {guard}) of a starting rank is stopped: continuing it (SIGCONT)"
        )),
        "the launcher names the stopped guard",
        show(&o),
    )?;
    check(
        took < Duration::from_secs(2),
        &format!("Ctrl-C ends the job within the grace period (took {took:?})"),
        show(&o),
    )?;
    none_survive(&ranks)
}

fn stopped_guard_does_not_hang_bench() -> Result<(), String> {
    // `lockstep bench` forks its ranks under guards too: stop one guard while the ranks measure.
    let mut c = lockstep();
    c.args([
        "bench", "--nprocs", "2", "--sizes", "16M", "-n", "20", "-w", "1",
    ]);
    let child = spawn_piped(&mut c);
    let me = child.id() as i32;
    let name = |p: i32| {
        std::fs::read_to_string(format!("/proc/{p}/comm"))
            .map(|c| c.trim().to_string())
            .unwrap_or_default()
    };
    let mut guards = Vec::new();
    let found = wait_until(Duration::from_secs(10), || {
        guards = children_of(me)
            .into_iter()
            .filter(|&g| name(g) == "lockstep-guard")
            .collect();
        guards.len() == 2 && guards.iter().all(|&g| !children_of(g).is_empty())
    });
    check(
        found,
        "bench starts two guards, each with its rank",
        format!("{guards:?}"),
    )?;
    let ranks: Vec<i32> = guards.iter().flat_map(|&g| children_of(g)).collect();
    check(
        ranks.iter().all(|&r| name(r) == "lockstep-rank"),
        "a forked rank is named apart from its guard in ps",
        format!("{ranks:?}"),
    )?;
    signal(guards[1], libc::SIGSTOP);
    let t = Instant::now();
    let o = child.wait_with_output().map_err(|e| e.to_string())?;
    check(o.status.success(), "the benchmark completes", show(&o))?;
    check(
        text(&o).1.contains(&format!(
            "its guard (pid {}) has not reported it: the guard is stopped",
            guards[1]
        )),
        "bench names the stopped guard",
        show(&o),
    )?;
    within(t.elapsed(), 30.0, "bench ends")
}

fn launchers_with_different_settings_fail_at_once() -> Result<(), String> {
    let port = free_port().to_string();
    let node = |r: &str, n: &str| {
        let mut c = node_of_two(n, r, &port);
        c.args(["--rdzv-timeout-s", "20", "--", BIN, "selftest"]);
        spawn_piped(&mut c)
    };
    let t = Instant::now();
    let a = node("0", "2");
    let b = node("1", "1");
    let (oa, ob) = wait_both(a, b)?;
    let took = t.elapsed();
    let msg = "node 1 and node 0 of this job were started with different --nproc-per-node: 1 on node 1, 2 on node 0; \
               start every node's launcher with the same --nproc-per-node, --nnodes and backend";
    fails_saying(&ob, 1, msg, "node 1 names both values")?;
    fails_saying(
        &oa,
        1,
        &format!("node 0 stopped its ranks because {msg}"),
        "node 0 stops with the same message",
    )?;
    check(
        took < Duration::from_secs(5),
        &format!("both fail long before the rendezvous timeout (took {took:?})"),
        "",
    )
}

fn missing_program_and_bad_options() -> Result<(), String> {
    let o = lockstep()
        .args(launch("2"))
        .args(["--", "/nonexistent/prog"])
        .run()?;
    fails_saying(
        &o,
        1,
        "cannot start rank 0",
        "missing program must be reported",
    )?;
    let o = lockstep()
        .args(launch("2"))
        .args(["--ranks-filter", "0,5", "--", "true"])
        .run()?;
    fails_saying(
        &o,
        1,
        "--ranks-filter names rank 5",
        "out-of-range filter is rejected",
    )?;
    let o = lockstep().args(["launch", "--bogus", "--", "true"]).run()?;
    exits(&o, 2, "unknown options are rejected")?;
    let o = lockstep()
        .env("LOCKSTEP_BACKEND", "carrier-pigeon")
        .args(launch("1"))
        .args(["--", BIN, "selftest"])
        .run()?;
    fails_saying(
        &o,
        1,
        "LOCKSTEP_BACKEND=\"carrier-pigeon\" is invalid: expected one of: shm, nccl",
        "unknown backend is named",
    )?;
    let o = lockstep().arg("selftest").run()?;
    check(
        o.status.code() == Some(1)
            && text(&o).1.contains("no launcher variables found")
            && text(&o)
                .1
                .contains("start this program with `lockstep launch"),
        "selftest outside a job says how to start it",
        show(&o),
    )
}

/// An exec'd rank starts with the signal state an exec of the launcher's command would have
/// (the guard starts it with clone + execve, not fork, and sets that state itself): nothing
/// blocked, SIGPIPE at its default (as `std::process::Command` does), the launcher's own
/// handlers (INT, TERM, HUP) back at the default, and what the launcher's parent ignored
/// (QUIT: one the guard also ignores; USR1: one it never touches) still ignored.
fn exec_rank_signal_state() -> Result<(), String> {
    use std::os::unix::process::CommandExt;
    let mut c = lockstep();
    c.args(launch("1"))
        .args(sh("grep -E '^Sig(Blk|Ign)' /proc/self/status"));
    // SAFETY: signal/sigprocmask between fork and exec are async-signal-safe.
    unsafe {
        c.pre_exec(|| {
            for s in [libc::SIGQUIT, libc::SIGUSR1, libc::SIGPIPE] {
                libc::signal(s, libc::SIG_IGN);
            }
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGUSR2);
            libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            Ok(())
        })
    };
    let o = c.run()?;
    let (out, _) = text(&o);
    let mask = |name: &str| {
        out.lines().find_map(|l| {
            l.split_once(name)
                .and_then(|(_, v)| u64::from_str_radix(v.trim(), 16).ok())
        })
    };
    let (Some(blk), Some(ign)) = (mask("SigBlk:"), mask("SigIgn:")) else {
        return check(false, "the rank prints its signal masks", show(&o));
    };
    let bit = |s: i32| 1u64 << (s - 1);
    check(
        o.status.success() && blk == 0,
        "nothing is blocked in the rank",
        show(&o),
    )?;
    check(
        ign & (bit(libc::SIGQUIT) | bit(libc::SIGUSR1)) == bit(libc::SIGQUIT) | bit(libc::SIGUSR1),
        "inherited ignores stay",
        show(&o),
    )?;
    check(
        ign & (bit(libc::SIGPIPE)
            | bit(libc::SIGINT)
            | bit(libc::SIGTERM)
            | bit(libc::SIGHUP)
            | bit(libc::SIGCHLD))
            == 0,
        "SIGPIPE and the launcher's handled signals are at their default",
        show(&o),
    )
}

fn stale_segments_of_dead_launchers_are_removed() -> Result<(), String> {
    // Names in the launcher's job-id format whose launcher pid does not exist; one old, one new.
    let old = format!("/dev/shm/lockstep-7ffffff{}-abc", std::process::id() % 10);
    let new = format!("/dev/shm/lockstep-7ffffff{}-abd", std::process::id() % 10);
    for p in [&old, &new] {
        std::fs::write(p, b"").map_err(|e| e.to_string())?;
    }
    let f = std::fs::File::options()
        .write(true)
        .open(&old)
        .map_err(|e| e.to_string())?;
    f.set_modified(SystemTime::now() - Duration::from_secs(3600))
        .map_err(|e| e.to_string())?;
    let o = lockstep().args(launch("1")).args(["--", "true"]).run()?;
    let (old_gone, new_kept) = (
        !std::path::Path::new(&old).exists(),
        std::path::Path::new(&new).exists(),
    );
    let _ = std::fs::remove_file(&new);
    check(
        o.status.success() && old_gone && new_kept,
        "old stale segment removed, recent one kept",
        format!("{old_gone} {new_kept}"),
    )
}

/// A segment whose header names a creator that was killed is removed by the next launch at once,
/// however new the file is.
fn stale_segment_of_dead_creator_removed_at_once() -> Result<(), String> {
    let job = format!("test-dead-creator-{}", std::process::id());
    let path = format!("/dev/shm/lockstep-{job}");
    // SAFETY: the child only runs lockstep code and _exits.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let cfg = lockstep::shm::ShmConfig {
            heap_bytes: 2 << 20,
            join_timeout: Duration::from_secs(30),
            ..Default::default()
        };
        // Rank 0 of 2 creates the segment and waits for rank 1, which never comes.
        let r = lockstep::shm::ShmComm::join_named(&job, 0, 2, cfg);
        // SAFETY: leave the child without running the parent's destructors.
        unsafe { libc::_exit(r.is_err() as i32) };
    }
    let appeared = wait_until(Duration::from_secs(5), || {
        std::path::Path::new(&path).exists()
    });
    std::thread::sleep(Duration::from_millis(100));
    signal(pid, libc::SIGKILL);
    // SAFETY: our child.
    unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
    check(
        appeared && std::path::Path::new(&path).exists(),
        "a killed creator leaves its segment",
        &path,
    )?;
    let t = Instant::now();
    let o = lockstep().args(launch("1")).args(["--", "true"]).run()?;
    let gone = !std::path::Path::new(&path).exists();
    if !gone {
        lockstep::shm::unlink_named(&job);
    }
    check(
        o.status.success() && gone,
        "the next launch removed it at once",
        format!("gone={gone} after {:?}\n{}", t.elapsed(), show(&o)),
    )
}

fn config_and_env() -> Result<(), String> {
    let d = scratch("config");
    let p = d.join("sub/config.toml");
    let o = lockstep().args(["config", "--path"]).arg(&p).run()?;
    check(o.status.success(), "config must succeed", show(&o))?;
    let t = std::fs::read_to_string(&p).map_err(|e| e.to_string())?;
    check(
        t.contains("num_processes = ")
            && t.contains("backend = ")
            && t.contains("mixed_precision = "),
        "config has the keys",
        &t,
    )?;
    let o = lockstep().args(["config", "--path"]).arg(&p).run()?;
    fails_saying(&o, 1, "--force", "existing config is kept without --force")?;
    let o = lockstep()
        .args([
            "config",
            "--force",
            "--backend",
            "shm",
            "--nproc-per-node",
            "3",
            "--path",
        ])
        .arg(&p)
        .run()?;
    let t = std::fs::read_to_string(&p).map_err(|e| e.to_string())?;
    check(
        o.status.success() && t.contains("num_processes = 3") && t.contains("backend = \"shm\""),
        "overrides are written",
        &t,
    )?;
    // `launch` without --nproc-per-node takes the config file's value.
    let o = lockstep()
        .env("LOCKSTEP_CONFIG", &p)
        .arg("launch")
        .args(sh("echo $RANK/$WORLD_SIZE"))
        .run()?;
    let mut lines: Vec<String> = text(&o).0.lines().map(String::from).collect();
    lines.sort();
    check(
        o.status.success() && lines == ["[rank 0] 0/3", "[rank 1] 1/3", "[rank 2] 2/3"],
        "config's num_processes is the default",
        show(&o),
    )?;
    let o = lockstep().arg("env").run()?;
    let report = ["cpu:", "cuda/nccl:", "lockstep CUDA environment"];
    prints(&o, &report, "env report")?;
    let version = format!("lockstep {}", env!("CARGO_PKG_VERSION"));
    check(
        text(&o).0.starts_with(&version),
        "the env report starts with the version",
        show(&o),
    )
}

fn main() -> std::process::ExitCode {
    common::run(&[
        ("selftest_two_and_eight_ranks", selftest_two_and_eight_ranks),
        ("fail_fast_exit_code", fail_fast_exit_code),
        ("kill9_rank_mid_all_reduce", kill9_rank_mid_all_reduce),
        ("kill9_rank_fail_fast", kill9_rank_fail_fast),
        (
            "kill9_launcher_leaves_nothing",
            kill9_launcher_leaves_nothing,
        ),
        ("sigint_reaches_every_rank", sigint_reaches_every_rank),
        ("sigterm_reaches_every_rank", sigterm_reaches_every_rank),
        ("second_sigint_kills_at_once", second_sigint_kills_at_once),
        (
            "output_is_line_atomic_and_prefixed",
            output_is_line_atomic_and_prefixed,
        ),
        ("log_dir_and_ranks_filter", log_dir_and_ranks_filter),
        (
            "log_dir_links_and_permissions",
            log_dir_links_and_permissions,
        ),
        ("two_launchers_form_one_job", two_launchers_form_one_job),
        (
            "failure_on_one_node_stops_the_other",
            failure_on_one_node_stops_the_other,
        ),
        (
            "cross_host_cpu_job_is_refused",
            cross_host_cpu_job_is_refused,
        ),
        ("busy_port_is_named", busy_port_is_named),
        (
            "wrong_token_and_unreachable_master",
            wrong_token_and_unreachable_master,
        ),
        ("token_rules", token_rules),
        (
            "generated_token_reaches_the_other_node",
            generated_token_reaches_the_other_node,
        ),
        (
            "missing_program_and_bad_options",
            missing_program_and_bad_options,
        ),
        (
            "ranks_share_rank0s_group_and_a_failed_rank0_leaves_nothing",
            ranks_share_rank0s_group_and_a_failed_rank0_leaves_nothing,
        ),
        (
            "rank0_exiting_at_once_keeps_every_rank_in_its_group",
            rank0_exiting_at_once_keeps_every_rank_in_its_group,
        ),
        (
            "stopped_guard_does_not_hang_the_launcher",
            stopped_guard_does_not_hang_the_launcher,
        ),
        (
            "stopped_guard_does_not_hang_bench",
            stopped_guard_does_not_hang_bench,
        ),
        (
            "launchers_with_different_settings_fail_at_once",
            launchers_with_different_settings_fail_at_once,
        ),
        ("exec_rank_signal_state", exec_rank_signal_state),
        (
            "stale_segments_of_dead_launchers_are_removed",
            stale_segments_of_dead_launchers_are_removed,
        ),
        (
            "stale_segment_of_dead_creator_removed_at_once",
            stale_segment_of_dead_creator_removed_at_once,
        ),
        ("config_and_env", config_and_env),
    ])
}
