//! Joining from launchers other than `lockstep launch`: `Communicator::from_env()` (through
//! `lockstep selftest`) under a real Open MPI `mpirun`, and under the environments torchrun and
//! srun set, on one node and as two "nodes" on this machine (rank 0 then hosts the rendezvous
//! store). harness = false: the tests start processes and wait for them.
//!
//! `mpirun` comes from Debian's `openmpi-bin` (CI installs it); without it the mpirun case prints
//! `skipped: ...`, and fails instead when `LOCKSTEP_REQUIRE_MPI=1`.

#[path = "../../../tests/common/runner.rs"]
mod runner;

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

type TestResult = Result<(), String>;
type TestFn = fn() -> TestResult;

const LOCKSTEP: &str = env!("CARGO_BIN_EXE_lockstep");
const TOKEN: &str = "foreign-launcher-test-token";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A name no earlier run can have left a segment under.
fn unique(tag: &str) -> String {
    let ns = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!("{tag}{}x{ns}", std::process::id())
}

fn selftest(env: &[(String, String)]) -> Child {
    let mut c = Command::new(LOCKSTEP);
    c.args(["selftest", "--iters", "3"]);
    for v in [
        "LOCKSTEP_JOB_ID",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "LOCKSTEP_TOKEN",
    ] {
        c.env_remove(v);
    }
    for (k, v) in env {
        c.env(k, v);
    }
    c.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start lockstep selftest")
}

/// Wait for every process (killing them after `limit`), then check each succeeded.
fn wait_all(kids: Vec<Child>, limit: Duration, what: &str) -> Result<Vec<Output>, String> {
    let t = Instant::now();
    let mut kids = kids;
    while kids
        .iter_mut()
        .any(|k| k.try_wait().ok().flatten().is_none())
    {
        if t.elapsed() > limit {
            for k in &mut kids {
                let _ = k.kill();
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let outs: Vec<Output> = kids
        .into_iter()
        .map(|k| k.wait_with_output().unwrap())
        .collect();
    for (i, o) in outs.iter().enumerate() {
        if !o.status.success() {
            return Err(format!(
                "{what}: process {i} {:?} after {:.1} s\n{}{}",
                o.status,
                t.elapsed().as_secs_f64(),
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            ));
        }
    }
    Ok(outs)
}

fn kv(pairs: &[(&str, String)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

fn mpirun() -> TestResult {
    let found = Command::new("mpirun")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        return runner::skip(
            "LOCKSTEP_REQUIRE_MPI",
            "mpirun is not on PATH (apt-get install openmpi-bin)",
        );
    }
    for n in [2, 3] {
        let t = Instant::now();
        let out = Command::new("mpirun")
            .args([
                "--oversubscribe",
                "-np",
                &n.to_string(),
                LOCKSTEP,
                "selftest",
            ])
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .env_remove("LOCKSTEP_JOB_ID")
            .output()
            .map_err(|e| e.to_string())?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let want = format!("lockstep selftest ok: {n} ranks, backend shm");
        if !out.status.success() || !stdout.contains(&want) {
            return Err(format!(
                "mpirun -np {n} lockstep selftest: {:?}\n{stdout}{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        println!(
            "  mpirun -np {n} lockstep selftest: ok in {:.2} s",
            t.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

fn torchrun_one_node() -> TestResult {
    let (port, run) = (free_port().to_string(), unique("t"));
    let kids = (0..2)
        .map(|r| {
            selftest(&kv(&[
                ("RANK", r.to_string()),
                ("LOCAL_RANK", r.to_string()),
                ("WORLD_SIZE", "2".into()),
                ("LOCAL_WORLD_SIZE", "2".into()),
                ("MASTER_ADDR", "127.0.0.1".into()),
                ("MASTER_PORT", port.clone()),
                ("TORCHELASTIC_RUN_ID", run.clone()),
            ]))
        })
        .collect();
    wait_all(kids, Duration::from_secs(20), "torchrun, one node").map(|_| ())
}

/// Two torchrun "nodes" with one rank each on this machine: rank 0 hosts lockstep's store on
/// MASTER_PORT + 1, both find they share the host and form one shared-memory communicator.
fn torchrun_two_nodes() -> TestResult {
    let base = free_port();
    let (port, run) = (base.to_string(), unique("t2"));
    let env = |r: usize, token: bool| {
        let mut v = kv(&[
            ("RANK", r.to_string()),
            ("LOCAL_RANK", "0".into()),
            ("WORLD_SIZE", "2".into()),
            ("LOCAL_WORLD_SIZE", "1".into()),
            ("GROUP_WORLD_SIZE", "2".into()),
            ("MASTER_ADDR", "127.0.0.1".into()),
            ("MASTER_PORT", port.clone()),
            ("TORCHELASTIC_RUN_ID", run.clone()),
            ("LOCKSTEP_RDZV_TIMEOUT_S", "10".into()),
        ]);
        if token {
            v.push(("LOCKSTEP_TOKEN".into(), TOKEN.into()));
        }
        v
    };
    // The store port must be free too.
    if std::net::TcpListener::bind(("127.0.0.1", base + 1)).is_err() {
        println!(
            "  (port {} busy: two-node torchrun case not run this time)",
            base + 1
        );
        return Ok(());
    }
    wait_all(
        vec![selftest(&env(0, true)), selftest(&env(1, true))],
        Duration::from_secs(30),
        "torchrun, two nodes",
    )?;
    // Without a token, every rank says what to set, at once.
    let t = Instant::now();
    let out = selftest(&env(1, false)).wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    if out.status.success()
        || !err.contains("LOCKSTEP_TOKEN is not set")
        || t.elapsed() > Duration::from_secs(5)
    {
        return Err(format!(
            "torchrun without a token: {:?} after {:.1} s: {err}",
            out.status,
            t.elapsed().as_secs_f64()
        ));
    }
    Ok(())
}

fn srun_env(
    r: usize,
    n: usize,
    nodes: usize,
    job: &str,
    extra: &[(&str, String)],
) -> Vec<(String, String)> {
    let per_node = n / nodes;
    let mut v = kv(&[
        ("SLURM_PROCID", r.to_string()),
        ("SLURM_NTASKS", n.to_string()),
        ("SLURM_LOCALID", (r % per_node).to_string()),
        ("SLURM_NODEID", (r / per_node).to_string()),
        ("SLURM_STEP_NUM_NODES", nodes.to_string()),
        (
            "SLURM_STEP_TASKS_PER_NODE",
            if nodes == 1 {
                n.to_string()
            } else {
                format!("{per_node}(x{nodes})")
            },
        ),
        ("SLURM_JOB_ID", job.into()),
        ("SLURM_STEP_ID", "0".into()),
        ("SLURM_STEP_NODELIST", "localhost".into()),
    ]);
    v.extend(kv(extra));
    v
}

fn srun_one_node() -> TestResult {
    let job = (std::process::id() % 100_000 + 7).to_string();
    let kids = (0..3)
        .map(|r| selftest(&srun_env(r, 3, 1, &job, &[])))
        .collect();
    wait_all(kids, Duration::from_secs(20), "srun, one node").map(|_| ())
}

fn srun_two_nodes() -> TestResult {
    let job = (std::process::id() % 100_000 + 11).to_string();
    let port = free_port().to_string();
    let extra = [
        ("LOCKSTEP_STORE_PORT", port),
        ("LOCKSTEP_TOKEN", TOKEN.to_string()),
        ("LOCKSTEP_RDZV_TIMEOUT_S", "10".to_string()),
    ];
    let kids = (0..2)
        .map(|r| selftest(&srun_env(r, 2, 2, &job, &extra)))
        .collect();
    wait_all(kids, Duration::from_secs(30), "srun, two nodes").map(|_| ())
}

fn no_launcher() -> TestResult {
    let t = Instant::now();
    let out = selftest(&[]).wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    if out.status.success()
        || !err.contains("no launcher variables found")
        || t.elapsed() > Duration::from_secs(5)
    {
        return Err(format!("no launcher: {:?}: {err}", out.status));
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    let tests: [(&str, TestFn); 6] = [
        ("mpirun_selftest", mpirun),
        ("torchrun_env_one_node", torchrun_one_node),
        ("torchrun_env_two_nodes_on_one_host", torchrun_two_nodes),
        ("srun_env_one_node", srun_one_node),
        ("srun_env_two_nodes_on_one_host", srun_two_nodes),
        ("no_launcher_is_named", no_launcher),
    ];
    runner::run(&tests)
}
