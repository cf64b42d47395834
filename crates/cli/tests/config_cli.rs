//! The configuration file and the settings of `lockstep launch`, end to end against the built
//! binary: `lockstep config` (defaults, flags, `--interactive` answers on stdin), rejection of bad
//! files (key, file and line named), the backend of the file reaching the ranks, MASTER_ADDR /
//! MASTER_PORT, `--nproc-per-node auto` and its aliases, nonsense counts, JSON lines that parse
//! under the launcher, and carriage-return redraws reaching a terminal (`script`). Sequential
//! (`harness = false`): several tests start multi-rank jobs on a two-core machine.

#[path = "common/cli.rs"]
mod cli;
#[path = "../../../tests/common/mod.rs"]
mod common;

use cli::{fails_saying, launch, sh, two_nodes, Run};
use common::{show, text};

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::{check, free_port, scratch};

const BIN: &str = env!("CARGO_BIN_EXE_lockstep");
const TOKEN: &str = "config-cli-test-token-0123";

/// `program` with no configuration file of the user's (an empty XDG directory) and none of the
/// variables that would change a launch.
fn isolated(program: &str, xdg: &Path) -> Command {
    let mut c = Command::new(program);
    c.env("XDG_CONFIG_HOME", xdg);
    for v in [
        "LOCKSTEP_TOKEN",
        "LOCKSTEP_CONFIG",
        "LOCKSTEP_BACKEND",
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "WORLD_SIZE",
    ] {
        c.env_remove(v);
    }
    c
}

/// `lockstep`, [`isolated`].
fn lockstep(xdg: &Path) -> Command {
    isolated(BIN, xdg)
}

/// `lockstep --config <p>`: the file `p` instead of the user's.
fn with_config(xdg: &Path, p: &Path) -> Command {
    let mut c = lockstep(xdg);
    c.arg("--config").arg(p);
    c
}

/// `lockstep config <flags> --path <p>` and the file it wrote.
fn config_file(xdg: &Path, flags: &[&str], p: &Path) -> Result<(Output, String), String> {
    let o = out(lockstep(xdg).arg("config").args(flags).arg("--path").arg(p))?;
    let t = std::fs::read_to_string(p).map_err(|e| e.to_string())?;
    Ok((o, t))
}

/// The launch succeeded and its ranks printed `want` (sorted).
fn printed<T>(o: &Output, want: &[T], what: &str) -> Result<(), String>
where
    String: PartialEq<T>,
{
    check(o.status.success() && lines(o) == want, what, show(o))
}

/// The outputs of launchers started together, once all have ended.
fn wait_all(kids: Vec<std::process::Child>) -> Result<Vec<Output>, String> {
    kids.into_iter()
        .map(|k| k.wait_with_output().map_err(|e| e.to_string()))
        .collect()
}

fn out(c: &mut Command) -> Result<Output, String> {
    c.stdin(Stdio::null()).run()
}

/// The sorted stdout lines of a launch.
fn lines(o: &Output) -> Vec<String> {
    let mut v: Vec<String> = text(o).0.lines().map(String::from).collect();
    v.sort();
    v
}

fn write(p: &Path, s: &str) -> Result<(), String> {
    std::fs::write(p, s).map_err(|e| format!("{}: {e}", p.display()))
}

fn config_written_read_and_shown() -> Result<(), String> {
    let d = scratch("cfg-roundtrip");
    let p = d.join("sub/config.toml");
    let o = out(lockstep(&d).args(["config", "--path"]).arg(&p))?;
    check(o.status.success(), "config succeeds", show(&o))?;
    let t = std::fs::read_to_string(&p).map_err(|e| e.to_string())?;
    for k in [
        "num_processes = 2",
        "num_machines = 1",
        "machine_rank = 0",
        "main_process_ip = \"127.0.0.1\"",
        "main_process_port = 29500",
    ] {
        check(
            t.contains(k),
            &format!("the default file (no GPU here) has {k}"),
            &t,
        )?;
    }
    check(
        t.contains("mixed_precision = \"no\"") && t.contains("backend = \"shm\""),
        "CPU defaults",
        &t,
    )?;
    // What was written reads back through the library as the same values.
    let c = lockstep::config::Config::read(&p).map_err(|e| e.to_string())?;
    check(
        c.num_processes == Some(2) && c.backend == Some(lockstep::config::BackendChoice::Shm),
        "round trip",
        format!("{c:?}"),
    )?;
    let o = out(lockstep(&d).args(["config", "--path"]).arg(&p))?;
    fails_saying(&o, 1, "--force", "an existing file is kept without --force")?;
    let flags = [
        "--force",
        "--backend",
        "nccl",
        "--num-processes",
        "3",
        "--mixed-precision",
        "bf16",
    ];
    let (o, t) = config_file(&d, &flags, &p)?;
    check(
        o.status.success()
            && t.contains("num_processes = 3")
            && t.contains("backend = \"nccl\"")
            && t.contains("\"bf16\""),
        "flags are written",
        &t,
    )?;
    // `env` shows the file in force and each value's source; the environment overrides the file.
    let o = out(with_config(&d, &p).arg("env").env("MASTER_PORT", "31234"))?;
    let s = text(&o).0;
    check(
        o.status.success() && s.contains(&format!("config:  {} (--config)", p.display())),
        "env names the file",
        show(&o),
    )?;
    // (case, what one line of the report shows: the key, its value, its source).
    for (what, line) in [
        (
            "env: num_processes",
            ["num_processes", "3", "(file; 3 per machine)"],
        ),
        ("env: backend", ["backend", "\"nccl\"", "(file)"]),
        (
            "env: port from env",
            ["main_process_port", "31234", "MASTER_PORT"],
        ),
    ] {
        check(
            s.lines().any(|l| line.iter().all(|part| l.contains(part))),
            what,
            &s,
        )?;
    }
    // The default location: `config` writes there, `env` reads it.
    let o = out(lockstep(&d).arg("config"))?;
    let default = d.join("lockstep/config.toml");
    check(
        o.status.success() && default.exists(),
        "config writes to $XDG_CONFIG_HOME/lockstep/config.toml",
        show(&o),
    )?;
    let o = out(lockstep(&d).arg("env"))?;
    check(
        text(&o).0.contains(&format!(
            "config:  {} (the default location)",
            default.display()
        )),
        "env finds it",
        show(&o),
    )?;
    // No temporary is left beside the file.
    let names: Vec<String> = std::fs::read_dir(p.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into())
        .collect();
    check(
        names == ["config.toml"],
        "only the file in its directory",
        format!("{names:?}"),
    )
}

fn config_interactive() -> Result<(), String> {
    let d = scratch("cfg-interactive");
    let p = d.join("config.toml");
    let ask = |answers: &str| -> Result<Output, String> {
        let mut c = lockstep(&d);
        c.args(["config", "--interactive", "--force", "--path"])
            .arg(&p)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = c.spawn().map_err(|e| e.to_string())?;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(answers.as_bytes())
            .map_err(|e| e.to_string())?;
        child.wait_with_output().map_err(|e| e.to_string())
    };
    // backend (a wrong answer, asked again), machines, rank, address, port, processes, precision.
    let o = ask("gpu\nshm\n2\n1\n10.1.2.3\n29555\n4\nbf16\n")?;
    check(o.status.success(), "interactive config succeeds", show(&o))?;
    let s = text(&o).0;
    for q in [
        "Which backend",
        "How many different machines",
        "What is the rank of this machine",
        "IP address",
        "port",
        "processes in total",
        "mixed precision",
    ] {
        check(s.contains(q), &format!("asks {q:?}"), &s)?;
    }
    check(s.contains("try again"), "a wrong answer is asked again", &s)?;
    let c = lockstep::config::Config::read(&p).map_err(|e| e.to_string())?;
    let want = lockstep::config::Config {
        num_processes: Some(4),
        num_machines: Some(2),
        machine_rank: Some(1),
        main_process_ip: Some("10.1.2.3".into()),
        main_process_port: Some(29555),
        mixed_precision: Some(lockstep::config::MixedPrecision::Bf16),
        backend: Some(lockstep::config::BackendChoice::Shm),
    };
    check(c == want, "the answers are written", format!("{c:?}"))?;
    // Empty answers take the defaults; one machine skips the multi-machine questions.
    let o = ask("\n1\n\n\n")?;
    let c = lockstep::config::Config::read(&p).map_err(|e| e.to_string())?;
    check(
        o.status.success()
            && c.num_processes == Some(2)
            && c.num_machines == Some(1)
            && !text(&o).0.contains("rank of this machine"),
        "defaults on empty answers",
        format!("{c:?}\n{}", show(&o)),
    )?;
    // Input that ends early writes nothing.
    std::fs::remove_file(&p).map_err(|e| e.to_string())?;
    let o = ask("shm\n")?;
    check(
        o.status.code() == Some(1) && text(&o).1.contains("standard input ended") && !p.exists(),
        "early EOF is an error",
        show(&o),
    )
}

fn bad_files_are_named() -> Result<(), String> {
    let d = scratch("cfg-bad");
    let p = d.join("c.toml");
    let launch = |p: &Path| {
        out(lockstep(&d)
            .arg("--config")
            .arg(p)
            .args(["launch", "--", "true"]))
    };
    let cases: &[(&str, &str, &str, &str)] = &[
        (
            "num_processes = 2\n# ok\nnum_procs = 3\n",
            "line 3",
            "num_procs",
            "unknown field",
        ),
        (
            "backend = \"gpu\"\n",
            "line 1",
            "backend",
            "unknown variant",
        ),
        (
            "mixed_precision = \"fp8\"\n",
            "line 1",
            "mixed_precision",
            "fp8",
        ),
        (
            "num_processes = \"four\"\n",
            "line 1",
            "num_processes",
            "string",
        ),
        (
            "\nnum_processes = 0\n",
            "line 2",
            "num_processes",
            "at least 1",
        ),
        (
            "num_machines = 2\nmachine_rank = 5\n",
            "line 2",
            "machine_rank",
            "out of range",
        ),
        (
            "main_process_port = 99999\n",
            "line 1",
            "main_process_port",
            "99999",
        ),
        ("[launch]\nnproc = 2\n", "line 1", "launch", "unknown field"),
        ("num_processes = 2 3\n", "line 1", "num_processes", ""),
        (
            "nproc_per_node = 4\n",
            "line 1",
            "nproc_per_node",
            "write `num_processes`",
        ),
    ];
    for (body, line, key, what) in cases {
        write(&p, body)?;
        let o = launch(&p)?;
        let e = text(&o).1;
        check(
            o.status.code() == Some(1)
                && e.contains(&format!("config file {}, {line}, key `{key}`", p.display()))
                && e.contains(what)
                && !text(&o).0.contains("[rank"),
            &format!("{body:?} is refused naming the file, {line} and `{key}`"),
            show(&o),
        )?;
    }
    // A comment after a value is TOML: the file works.
    write(&p, "num_processes = 3 # ranks\nbackend = \"shm\"   # CPU\n")?;
    let o = out(with_config(&d, &p)
        .arg("launch")
        .args(sh("echo $RANK/$WORLD_SIZE")))?;
    printed(
        &o,
        &["[rank 0] 0/3", "[rank 1] 1/3", "[rank 2] 2/3"],
        "comments after values",
    )?;
    // A file named by LOCKSTEP_CONFIG or --config must exist, and the name must be one.
    let missing = d.join("missing.toml");
    for (named, says, what) in [
        (
            missing.as_os_str(),
            "(named by LOCKSTEP_CONFIG) does not exist",
            "missing named file",
        ),
        (
            "a\tb".as_ref(),
            "LOCKSTEP_CONFIG=",
            "malformed LOCKSTEP_CONFIG is named",
        ),
    ] {
        let o = out(lockstep(&d)
            .env("LOCKSTEP_CONFIG", named)
            .args(["launch", "--", "true"]))?;
        fails_saying(&o, 1, says, what)?;
    }
    Ok(())
}

fn backend_of_the_file_reaches_the_ranks() -> Result<(), String> {
    let d = scratch("cfg-backend");
    let p = d.join("c.toml");
    write(&p, "num_processes = 2\nbackend = \"nccl\"\n")?;
    let echo = [
        "launch",
        "--",
        "sh",
        "-c",
        "echo $LOCKSTEP_BACKEND $LOCKSTEP_CONFIG",
    ];
    let abs = std::fs::canonicalize(&p).map_err(|e| e.to_string())?;
    let o = out(with_config(&d, &p).args(echo))?;
    let want = |b: &str| {
        (0..2)
            .map(|r| format!("[rank {r}] {b} {}", abs.display()))
            .collect::<Vec<_>>()
    };
    printed(
        &o,
        &want("nccl"),
        "backend = nccl reaches every rank, with the file",
    )?;
    // The flag overrides the environment, which overrides the file.
    let o = out(with_config(&d, &p)
        .env("LOCKSTEP_BACKEND", "shm")
        .args(echo))?;
    printed(&o, &want("shm"), "LOCKSTEP_BACKEND overrides the file")?;
    let o = out(with_config(&d, &p)
        .env("LOCKSTEP_BACKEND", "nccl")
        .args(["launch", "--backend", "shm"])
        .args(&echo[1..]))?;
    printed(&o, &want("shm"), "--backend overrides both")?;
    // auto: nccl only with a GPU; this machine's forked probe decides.
    write(&p, "backend = \"auto\"\n")?;
    let gpus = lockstep::config::count_gpus().unwrap_or(0);
    let o = out(with_config(&d, &p).args(echo))?;
    printed(
        &o,
        &want(if gpus > 0 { "nccl" } else { "shm" }),
        "auto follows the GPUs",
    )?;
    // The ranks really build the backend the file names: without NCCL here, selftest fails
    // naming it rather than quietly running on shared memory.
    if gpus == 0 {
        write(&p, "backend = \"nccl\"\n")?;
        let o = out(with_config(&d, &p)
            .args(launch("1"))
            .args(["--", BIN, "selftest"]))?;
        let e = text(&o).1.to_lowercase();
        check(
            !o.status.success()
                && (e.contains("nccl") || e.contains("cuda"))
                && !text(&o).0.contains("selftest ok"),
            "a nccl job without NCCL fails naming it",
            show(&o),
        )?;
    }
    Ok(())
}

fn master_addr_and_port() -> Result<(), String> {
    let d = scratch("cfg-master");
    let echo = [
        "launch",
        "--nproc-per-node",
        "1",
        "--",
        "sh",
        "-c",
        "echo $MASTER_ADDR:$MASTER_PORT",
    ];
    let o = out(lockstep(&d)
        .env("MASTER_PORT", "31111")
        .env("MASTER_ADDR", "localhost")
        .args(echo))?;
    printed(
        &o,
        &["[rank 0] localhost:31111"],
        "MASTER_ADDR/MASTER_PORT reach the ranks",
    )?;
    let o = out(lockstep(&d)
        .env("MASTER_PORT", "31111")
        .args(["launch", "--master-port", "31112"])
        .args(&echo[1..]))?;
    printed(
        &o,
        &["[rank 0] 127.0.0.1:31112"],
        "the flag overrides MASTER_PORT",
    )?;
    let p = d.join("c.toml");
    write(
        &p,
        "main_process_ip = \"127.0.0.1\"\nmain_process_port = 31113\n",
    )?;
    let o = out(with_config(&d, &p).args(echo))?;
    printed(
        &o,
        &["[rank 0] 127.0.0.1:31113"],
        "the file's port without MASTER_PORT",
    )?;
    let o = out(with_config(&d, &p).env("MASTER_PORT", "31114").args(echo))?;
    printed(
        &o,
        &["[rank 0] 127.0.0.1:31114"],
        "MASTER_PORT overrides the file",
    )?;
    let o = out(lockstep(&d).env("MASTER_PORT", "31x").args(echo))?;
    fails_saying(
        &o,
        1,
        "MASTER_PORT=\"31x\" is invalid",
        "a malformed MASTER_PORT is named",
    )?;
    // Two nodes: node 0 listens on the port MASTER_PORT names (node 1 is given it by flag).
    let port = free_port().to_string();
    let mut kids = Vec::new();
    for r in ["0", "1"] {
        let mut c = lockstep(&d);
        c.env("LOCKSTEP_TOKEN", TOKEN)
            .args(launch("1"))
            .args(["--nnodes", "2", "--node-rank", r]);
        if r == "0" {
            c.env("MASTER_PORT", &port);
        } else {
            c.args(["--master-port", &port]);
        }
        c.args(["--", BIN, "selftest"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        kids.push(c.spawn().map_err(|e| e.to_string())?);
    }
    let outs = wait_all(kids)?;
    check(
        outs.iter().all(|o| o.status.success())
            && text(&outs[0]).0.contains("selftest ok: 2 ranks"),
        "node 0's store listens on MASTER_PORT",
        outs.iter().map(show).collect::<Vec<_>>().join("\n"),
    )
}

fn process_counts() -> Result<(), String> {
    let d = scratch("cfg-counts");
    let ws = ["--", "sh", "-c", "echo $WORLD_SIZE"];
    let world = |args: &[&str]| -> Result<(Output, Vec<String>), String> {
        let o = out(lockstep(&d).arg("launch").args(args).args(ws))?;
        let l = lines(&o);
        Ok((o, l))
    };
    let gpus = lockstep::config::count_gpus().unwrap_or(0);
    let auto = if gpus > 0 {
        gpus
    } else {
        lockstep::config::DEFAULT_NUM_PROCESSES
    };
    let (o, l) = world(&["--nproc-per-node", "auto"])?;
    check(
        o.status.success() && l.len() == auto && l.iter().all(|x| x.ends_with(&format!(" {auto}"))),
        "auto: one per GPU, else 2",
        show(&o),
    )?;
    let (o, l) = world(&[])?;
    check(
        o.status.success() && l.len() == lockstep::config::DEFAULT_NUM_PROCESSES,
        "the default number of ranks",
        show(&o),
    )?;
    for alias in ["--nproc_per_node", "--num_processes", "--num-processes"] {
        let (o, l) = world(&[alias, "3"])?;
        check(
            o.status.success() && l.len() == 3,
            &format!("{alias} 3"),
            show(&o),
        )?;
    }
    let o = out(lockstep(&d)
        .args(["launch", "--num_processes", "3", "--nnodes", "2"])
        .args(ws))?;
    fails_saying(&o, 1, "must be a multiple of --nnodes 2", "uneven total")?;
    // Nonsense counts get messages that say what is wrong.
    let o = out(lockstep(&d).args(["launch", "--nnodes", "0"]).args(ws))?;
    fails_saying(
        &o,
        1,
        "--nnodes 0: a job runs on at least 1 node",
        "--nnodes 0",
    )?;
    let o = out(lockstep(&d).args(launch("0")).args(ws))?;
    fails_saying(&o, 2, "0 ranks cannot run anything", "--nproc-per-node 0")?;
    let o = out(lockstep(&d).args(launch("many")).args(ws))?;
    fails_saying(&o, 2, "is not a number of ranks", "--nproc-per-node many")?;
    let o = out(lockstep(&d)
        .env("LOCKSTEP_TOKEN", TOKEN)
        .args(launch("1"))
        .args(["--nnodes", "2", "--node-rank", "2"])
        .args(ws))?;
    fails_saying(
        &o,
        1,
        "--node-rank 2 is out of range for --nnodes 2: nodes are numbered 0 to 1",
        "node rank >= nnodes",
    )?;
    // More ranks than CPUs start, with a warning.
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let n = (cpus + 1).to_string();
    let (o, l) = world(&["--nproc-per-node", &n])?;
    let e = text(&o).1;
    check(
        o.status.success()
            && l.len() == cpus + 1
            && e.contains("WARN")
            && e.contains(&format!("only {cpus} CPU(s)")),
        "oversubscription warns",
        show(&o),
    )
}

fn torchrun_and_accelerate_habits() -> Result<(), String> {
    let d = scratch("cfg-habits");
    // The program without `--`, its own options passed through untouched.
    let o = out(lockstep(&d).args(launch("2")).args([
        "sh",
        "-c",
        "echo args $RANK \"$@\"",
        "x",
        "--lr",
        "1",
        "-v",
    ]))?;
    let l = lines(&o);
    check(
        o.status.success() && l.len() == 2 && l.iter().all(|x| x.ends_with("--lr 1 -v")),
        "the program needs no `--`",
        show(&o),
    )?;
    // torchrun's and Accelerate's spellings.
    let env = "echo $WORLD_SIZE $OMP_NUM_THREADS $ACCELERATE_MIXED_PRECISION";
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let o = out(lockstep(&d)
        .env_remove("OMP_NUM_THREADS")
        .args([
            "launch",
            "--nproc_per_node",
            "cpu",
            "--standalone",
            "--node_rank",
            "0",
            "--master_addr",
            "127.0.0.1",
        ])
        .args([
            "--master_port",
            "29999",
            "--mixed_precision",
            "bf16",
            "sh",
            "-c",
            env,
        ]))?;
    let want = format!("{cpus} 1 bf16");
    check(
        o.status.success()
            && lines(&o).iter().all(|x| x.ends_with(&want))
            && lines(&o).len() == cpus,
        "torchrun spellings; cpu ranks",
        show(&o),
    )?;
    let o = out(lockstep(&d)
        .args([
            "launch",
            "--num_machines",
            "1",
            "--machine_rank",
            "0",
            "--main_process_port",
            "29999",
            "--num_processes",
            "2",
        ])
        .args(["sh", "-c", env]))?;
    check(
        o.status.success() && lines(&o).len() == 2,
        "Accelerate's spellings",
        show(&o),
    )?;
    // OMP_NUM_THREADS: the node's CPUs shared among its ranks, unless the user set it.
    let o = out(lockstep(&d)
        .env_remove("OMP_NUM_THREADS")
        .args(launch("1"))
        .args(["sh", "-c", env]))?;
    check(
        lines(&o).iter().all(|x| x.ends_with(&format!("1 {cpus}"))),
        "one rank gets every CPU",
        show(&o),
    )?;
    let o = out(lockstep(&d)
        .env("OMP_NUM_THREADS", "7")
        .args(launch("2"))
        .args(["sh", "-c", env]))?;
    check(
        lines(&o).iter().all(|x| x.ends_with("2 7")),
        "a user's OMP_NUM_THREADS is kept",
        show(&o),
    )?;
    let o = out(lockstep(&d).args(["launch", "--standalone", "--nnodes", "2", "true"]))?;
    fails_saying(
        &o,
        1,
        "--standalone is a single-node job, but --nnodes (or the configuration) asks for 2 nodes",
        "--standalone with several nodes is refused",
    )?;
    if lockstep::config::count_gpus().unwrap_or(0) == 0 {
        let o = out(lockstep(&d).args(launch("gpu")).arg("true"))?;
        fails_saying(
            &o,
            1,
            "`gpu` starts one rank per GPU, but this machine has none",
            "gpu without GPUs",
        )?;
    }
    // A misspelt option gets clap's tip, and never runs as the program.
    let o = out(lockstep(&d).args(["launch", "--nproc-per-nod", "2", "true"]))?;
    fails_saying(
        &o,
        2,
        "tip: a similar argument exists: '--nproc-per-node'",
        "a tip names the right spelling",
    )?;
    // One meaning per flag: `config --nproc-per-node` counts per machine, as `launch` does.
    // (file, flags, what it must hold, case).
    for (name, flags, holds, what) in [
        (
            "per-node.toml",
            ["--nproc-per-node", "4", "--num-machines", "2"],
            "num_processes = 8",
            "--nproc-per-node 4 on 2 machines is 8 ranks in all",
        ),
        (
            "total.toml",
            ["--num_processes", "4", "--num-machines", "2"],
            "num_processes = 4",
            "--num_processes counts every machine's ranks",
        ),
    ] {
        let (o, t) = config_file(&d, &flags, &d.join(name))?;
        check(o.status.success() && t.contains(holds), what, &t)?;
    }
    Ok(())
}

fn init_line_on_request() -> Result<(), String> {
    let d = scratch("cfg-init-line");
    let run = |log: Option<&str>| {
        let mut c = lockstep(&d);
        c.args(launch("2")).args([BIN, "selftest"]);
        if let Some(l) = log {
            c.env("LOCKSTEP_LOG", l);
        }
        out(&mut c)
    };
    let o = run(Some("info"))?;
    let err = text(&o).1;
    for r in 0..2 {
        let line = err
            .lines()
            .find(|l| l.contains(&format!("init: rank {r} of 2 backend shm host ")))
            .unwrap_or("");
        check(
            o.status.success()
                && line.contains(&format!("lockstep {} init", env!("CARGO_PKG_VERSION")))
                && line.contains(" pid ")
                && line.contains(" cpus ")
                && line.contains(" cma "),
            &format!("LOCKSTEP_LOG=info: rank {r} logs its init line"),
            show(&o),
        )?;
    }
    let o = run(None)?;
    check(
        o.status.success() && !text(&o).1.contains("init: rank"),
        "no init line by default",
        show(&o),
    )
}

fn multi_node_master_port_is_free_for_rank0() -> Result<(), String> {
    // torch's env:// makes rank 0 host a store on MASTER_PORT. Under a multi-node launch the
    // launchers' own store holds --master-port, so the ranks get another port, the same on every
    // node, and find the launchers' store through LOCKSTEP_STORE_PORT.
    let d = scratch("cfg-env-port");
    let port = free_port().to_string();
    let script = format!(
        "echo ports $MASTER_PORT $LOCKSTEP_STORE_PORT; \
         if [ $RANK = 0 ]; then python3 -c 'import os, socket; s = socket.socket(); s.bind((\"\", int(os.environ[\"MASTER_PORT\"]))); print(\"bound\")' || exit 9; fi; \
         exec {BIN} selftest"
    );
    let mut kids = Vec::new();
    for r in ["0", "1"] {
        let mut c = lockstep(&d);
        c.env("LOCKSTEP_TOKEN", TOKEN)
            .args(two_nodes("1", &port))
            .args(["--node-rank", r]);
        c.args(sh(&script))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        kids.push(c.spawn().map_err(|e| e.to_string())?);
    }
    let outs = wait_all(kids)?;
    let all = outs.iter().map(show).collect::<Vec<_>>().join("\n");
    check(
        outs.iter().all(|o| o.status.success()),
        "both nodes succeed",
        &all,
    )?;
    let ports: Vec<String> = outs
        .iter()
        .flat_map(|o| {
            text(o)
                .0
                .lines()
                .filter_map(|l| l.split_once("ports ").map(|(_, p)| p.to_string()))
                .collect::<Vec<_>>()
        })
        .collect();
    check(
        ports.len() == 2 && ports[0] == ports[1],
        "every rank gets the same ports",
        &all,
    )?;
    let (master, store) = ports[0].split_once(' ').unwrap_or(("", ""));
    check(
        store == port && master != port && master.parse::<u16>().is_ok(),
        "MASTER_PORT is not the launchers' store port",
        &all,
    )?;
    check(
        text(&outs[0]).0.contains("bound") && text(&outs[0]).0.contains("selftest ok: 2 ranks"),
        "rank 0 binds MASTER_PORT and the job runs",
        &all,
    )
}

fn json_lines_parse_under_the_launcher() -> Result<(), String> {
    let d = scratch("cfg-json");
    // Real JSON from a lockstep program, JSON the shell writes (nesting, escapes), and text.
    let script = r#"printf '{"rank": %s, "loss": 0.4384, "tags": ["a", {"b": "c\\"d"}], "ok": true}\n' $RANK; echo "epoch 1/4 step $RANK"; printf '{not json}\n'"#;
    let o = out(lockstep(&d).args(launch("2")).args(sh(script)))?;
    check(o.status.success(), "the job succeeds", show(&o))?;
    let s = text(&o).0;
    let mut objects = 0;
    for line in s.lines() {
        if line.starts_with('{') && line.ends_with('}') && !line.contains("not json") {
            let v: serde_json::Value = serde_json::from_str(line)
                .map_err(|e| format!("{line:?} does not parse: {e}\n{s}"))?;
            check(v["loss"] == 0.4384, "the object is intact", line)?;
            objects += 1;
        } else {
            check(
                line.starts_with("[rank "),
                "other lines keep their prefix",
                line,
            )?;
        }
    }
    check(
        objects == 2 && s.contains("[rank 1] {not json}"),
        "one object per rank, unprefixed; text prefixed",
        &s,
    )?;
    // A program's --json output: every line parses.
    let o = out(lockstep(&d).args(launch("2")).args([
        "--", BIN, "bench", "--sizes", "8", "-n", "2", "--format", "json",
    ]))?;
    let s = text(&o).0;
    let parsed: Vec<serde_json::Value> = s
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{e}\n{}", show(&o)))?;
    check(
        o.status.success()
            && parsed.len() == 1
            && parsed[0]["wrong"] == 0
            && parsed[0]["ranks"] == 2,
        "the joined benchmark's JSON line (rank 0's, for both ranks) parses",
        show(&o),
    )?;
    // --no-prefix: text lines as written.
    let o = out(lockstep(&d)
        .args(launch("2"))
        .arg("--no-prefix")
        .args(sh("echo r$RANK")))?;
    check(
        o.status.success() && lines(&o) == ["r0", "r1"],
        "--no-prefix",
        show(&o),
    )
}

fn carriage_returns_reach_a_terminal() -> Result<(), String> {
    let d = scratch("cfg-tty");
    if Command::new("script").arg("--version").output().is_err() {
        return Err("`script` (util-linux) is needed to give the launcher a terminal".into());
    }
    let cmd = format!(
        "{BIN} launch --nproc-per-node 1 -- sh -c 'printf \"10%%\\r20%%\\r30%%\\n\"; printf \"\\033[2K40%%\\r\\033[2K50%%\\n\" >&2; echo tty=$LOCKSTEP_CONSOLE_TTY'"
    );
    let o = out(isolated("script", &d).args(["-qec", &cmd, "/dev/null"]))?;
    let s = String::from_utf8_lossy(&o.stdout).into_owned();
    // The terminal turns "\n" into "\r\n"; the redraws arrive one by one, each with its prefix,
    // a clear-line sequence before the prefix.
    check(
        o.status.success(),
        "the job succeeds under script",
        show(&o),
    )?;
    check(
        s.contains("[rank 0] 10%\r[rank 0] 20%\r[rank 0] 30%\r\n"),
        "stdout redraws arrive intact",
        format!("{s:?}"),
    )?;
    check(
        s.contains("\x1b[2K[rank 0] 40%\r\x1b[2K[rank 0] 50%"),
        "stderr redraws keep the clear-line first",
        format!("{s:?}"),
    )?;
    check(
        s.contains("[rank 0] tty=1"),
        "rank 0 is told it may draw",
        format!("{s:?}"),
    )?;
    // Only rank 0 reports, so only rank 0 is told; and bars go to stdout, so a terminal on stderr
    // alone does not count.
    let redirected = d.join("stdout.txt");
    let cmd = format!(
        "{BIN} launch --nproc-per-node 2 -- sh -c 'echo tty$RANK=$LOCKSTEP_CONSOLE_TTY'; {BIN} launch --nproc-per-node 1 -- sh -c 'echo redirected=$LOCKSTEP_CONSOLE_TTY' > {}",
        redirected.display()
    );
    // Not told by an outer launch that a terminal is there.
    let o = out(isolated("script", &d)
        .env_remove("LOCKSTEP_CONSOLE_TTY")
        .args(["-qec", &cmd, "/dev/null"]))?;
    let s = String::from_utf8_lossy(&o.stdout).into_owned();
    check(
        s.contains("[rank 0] tty0=1") && s.contains("[rank 1] tty1=\r"),
        "rank 0 told, rank 1 not",
        format!("{s:?}"),
    )?;
    let r = std::fs::read_to_string(&redirected)
        .map_err(|e| format!("{}: {e}", redirected.display()))?;
    check(
        r == "[rank 0] redirected=\n",
        "stdout to a file: not told, though stderr is a terminal",
        format!("{r:?}"),
    )?;
    // Off a terminal the ranks are not told so.
    let o = out(lockstep(&d)
        .args(launch("1"))
        .args(sh("echo tty=$LOCKSTEP_CONSOLE_TTY")))?;
    check(
        lines(&o) == ["[rank 0] tty="],
        "no terminal, no LOCKSTEP_CONSOLE_TTY",
        show(&o),
    )
}

fn main() -> std::process::ExitCode {
    common::run(&[
        (
            "config_written_read_and_shown",
            config_written_read_and_shown,
        ),
        ("config_interactive", config_interactive),
        ("bad_files_are_named", bad_files_are_named),
        (
            "backend_of_the_file_reaches_the_ranks",
            backend_of_the_file_reaches_the_ranks,
        ),
        ("master_addr_and_port", master_addr_and_port),
        (
            "multi_node_master_port_is_free_for_rank0",
            multi_node_master_port_is_free_for_rank0,
        ),
        ("process_counts", process_counts),
        (
            "torchrun_and_accelerate_habits",
            torchrun_and_accelerate_habits,
        ),
        ("init_line_on_request", init_line_on_request),
        (
            "json_lines_parse_under_the_launcher",
            json_lines_parse_under_the_launcher,
        ),
        (
            "carriage_returns_reach_a_terminal",
            carriage_returns_reach_a_terminal,
        ),
    ])
}
