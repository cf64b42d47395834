//! `train-cnn`'s in-job recovery end to end (issue 37): `lockstep launch --nproc-per-node 2
//! --max-restarts 1 --restart-policy rank train-cnn --epochs 4`, rank 1 killed with SIGKILL in
//! the middle of epoch 2, against an undisturbed run with the same seed. The recovered run must
//! finish with a final test accuracy within 0.5 points of the undisturbed one and a wall time
//! within the undisturbed one plus 5 s, reading no checkpoint (no `--save`/`--resume`, an empty
//! working directory that stays empty). Prints both runs' figures. The same on the device
//! engine, both ranks staged on one simulated GPU: there the last epoch's loss must equal the
//! undisturbed run's, and the 5 s are checked on the survivor's recovery (see `compare`).
//!
//! Sequential (`harness = false`): it runs the trainer under the launcher. FashionMNIST when it is
//! installed (`--limit-train 1600`, the whole test set), else synthetic data (2 400 training and
//! 1 000 test images, which the CNN learns perfectly), keeps the pair of runs short on two CPUs.

#[path = "../../../tests/common/mod.rs"]
mod common;
#[path = "common/simt.rs"]
mod simt;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::check;

const BIN: &str = env!("CARGO_BIN_EXE_train-cnn");

/// One run: its final test accuracy, wall time, and (recovered run) the survivor's recovery.
struct Run {
    acc: f64,
    /// The last epoch's training loss (every rank's samples).
    loss: f64,
    wall: Duration,
    recovery_s: Option<f64>,
    stderr: String,
}

/// The process of `train-cnn` rank 1 among those carrying `mark` in their environment.
fn rank1_pid(mark: &str) -> Option<i32> {
    let want = format!("RECOVERY_TEST_MARK={mark}");
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let (Ok(env), Ok(cmd)) = (
            std::fs::read(format!("/proc/{pid}/environ")),
            std::fs::read(format!("/proc/{pid}/cmdline")),
        ) else {
            continue;
        };
        let argv0 = cmd.split(|&b| b == 0).next().unwrap_or(&[]);
        let vars: Vec<&[u8]> = env.split(|&b| b == 0).collect();
        if argv0.ends_with(b"train-cnn")
            && vars.contains(&want.as_bytes())
            && vars.contains(&&b"RANK=1"[..])
        {
            return Some(pid);
        }
    }
    None
}

/// The first number after `key` in `text`.
fn number_after(text: &str, key: &str) -> Option<f64> {
    let at = text.find(key)? + key.len();
    let s: String = text[at..]
        .chars()
        .skip_while(|c| *c == ' ')
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    s.parse().ok()
}

/// Where the ranks train: the CPU engine, or the device engine on the simulated GPU.
#[derive(Clone, Copy)]
enum Device<'a> {
    Cpu,
    /// One simulated GPU for both ranks (staged through shared memory), its libraries.
    Sim(&'a simt::SimGpu),
}

/// Run the job in `cwd` on the data in `data`; with `kill`, SIGKILL rank 1 once rank 0 reports
/// half of epoch 2's steps.
fn run(cwd: &Path, data: &Path, limit: &[&str], device: Device, kill: bool) -> Result<Run, String> {
    let mark = format!("{}-{}", std::process::id(), kill);
    let err_path = cwd.with_extension(format!("stderr-{kill}"));
    let mut c = Command::new(common::lockstep_bin());
    for v in [
        "LOCKSTEP_JOB_ID",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCKSTEP_CONSOLE_TTY",
        "LOCKSTEP_TOKEN",
        "LOCKSTEP_CONFIG",
    ] {
        c.env_remove(v);
    }
    c.current_dir(cwd)
        .env("LOCKSTEP_LOG", "info")
        .env("RECOVERY_TEST_MARK", &mark)
        .env("XDG_CONFIG_HOME", cwd.join("no-config"))
        .args(["launch", "--nproc-per-node", "2", "--max-restarts", "1"])
        .args(["--restart-policy", "rank", "--", BIN])
        .args(["--epochs", "4", "--seed", "7", "--json"])
        .args(limit)
        .args(["--log-every", "1", "--data"])
        .arg(data)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&err_path).map_err(|e| e.to_string())?);
    match device {
        Device::Cpu => {
            c.args(["--device", "cpu"]);
        }
        Device::Sim(sim) => {
            c.args(["--device", "cuda"])
                .env("LOCKSTEP_CUDA_LIBRARY", &sim.cuda)
                .env("LOCKSTEP_NVRTC_LIBRARY", &sim.nvrtc)
                .env("XDG_CACHE_HOME", &sim.cache)
                .env("SIM_CUDA_DEVICES", "1");
        }
    }
    let t0 = Instant::now();
    let mut child = c.spawn().map_err(|e| e.to_string())?;
    let out = child.stdout.take().ok_or("no stdout")?;
    let (mut acc, mut loss, mut killed) = (None, f64::NAN, false);
    for line in BufReader::new(out).lines() {
        let line = line.map_err(|e| e.to_string())?;
        let Some(json) = line.find('{').map(|i| &line[i..]) else {
            continue;
        };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(json) else {
            continue;
        };
        if let Some(a) = v.get("test_acc").and_then(|a| a.as_f64()) {
            acc = Some(a);
            loss = v
                .get("train_loss")
                .and_then(|l| l.as_f64())
                .unwrap_or(f64::NAN);
        }
        let (epoch, step, steps) = (
            v.get("epoch").and_then(|x| x.as_u64()),
            v.get("step").and_then(|x| x.as_u64()),
            v.get("steps").and_then(|x| x.as_u64()),
        );
        if let (true, false, Some(2), Some(s), Some(n)) = (kill, killed, epoch, step, steps) {
            if s >= n / 2 {
                let pid = rank1_pid(&mark).ok_or("rank 1's process was not found")?;
                common::signal(pid, libc::SIGKILL);
                println!("  killed rank 1 (pid {pid}) at epoch 2 step {s}/{n}");
                killed = true;
            }
        }
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    let wall = t0.elapsed();
    let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
    let _ = std::fs::remove_file(&err_path);
    check(
        status.success(),
        &format!(
            "the {} run succeeded",
            if kill { "recovered" } else { "undisturbed" }
        ),
        format!("{status:?}\n{stderr}"),
    )?;
    check(!kill || killed, "rank 1 was killed in epoch 2", &stderr)?;
    Ok(Run {
        acc: acc.ok_or_else(|| format!("no test accuracy reported\n{stderr}"))?,
        loss,
        wall,
        recovery_s: number_after(&stderr, "recovered in"),
        stderr,
    })
}

fn kill_rank_1_in_epoch_2() -> Result<(), String> {
    let root: PathBuf =
        std::env::temp_dir().join(format!("lockstep-recovery-{}", std::process::id()));
    let (data, cwd) = (root.join("data"), root.join("run"));
    std::fs::create_dir_all(&cwd).map_err(|e| e.to_string())?;
    let real = Path::new(lockstep_train::data::DEFAULT_DATA_DIR);
    let (data, limit): (PathBuf, &[&str]) = if real.join("train-images-idx3-ubyte.gz").exists() {
        println!("  FashionMNIST from {}", real.display());
        (real.to_path_buf(), &["--limit-train", "1600"])
    } else {
        println!("  synthetic data (FashionMNIST is not installed)");
        std::fs::create_dir_all(&data).map_err(|e| e.to_string())?;
        lockstep_train::data::write_synthetic(&data, 2400, 1000, 3).map_err(|e| e.to_string())?;
        (data, &[])
    };
    let result = compare(&cwd, &data, limit, Device::Cpu);
    let _ = std::fs::remove_dir_all(&root);
    result
}

/// The same on the device engine: both ranks on one simulated GPU (the staged backend; the
/// simulated driver runs the real kernels), synthetic data small enough for it.
fn kill_rank_1_in_epoch_2_on_the_device() -> Result<(), String> {
    let root: PathBuf =
        std::env::temp_dir().join(format!("lockstep-recovery-dev-{}", std::process::id()));
    let (data, cwd) = (root.join("data"), root.join("run"));
    std::fs::create_dir_all(&cwd).map_err(|e| e.to_string())?;
    std::fs::create_dir_all(&data).map_err(|e| e.to_string())?;
    // The simulated driver runs a few dozen images a second: 4 steps of 16 per rank an epoch,
    // the loss read back every step (its lines tell when epoch 2 is half done), a learning rate
    // low enough that the last epoch's loss still has digits to compare.
    lockstep_train::data::write_synthetic(&data, 128, 32, 3).map_err(|e| e.to_string())?;
    let sim = simt::SimGpu::build();
    let result = compare(
        &cwd,
        &data,
        &["--batch-size", "16", "--loss-every", "1", "--lr", "0.0002"],
        Device::Sim(&sim),
    );
    let _ = std::fs::remove_dir_all(&root);
    result
}

/// An undisturbed run and one whose rank 1 is killed in epoch 2, in `cwd` on `data`: the bars
/// of the module docs.
fn compare(cwd: &Path, data: &Path, limit: &[&str], device: Device) -> Result<(), String> {
    let calm = run(cwd, data, limit, device, false)?;
    let hit = run(cwd, data, limit, device, true)?;
    let left: Vec<_> = std::fs::read_dir(cwd)
        .map_err(|e| e.to_string())?
        .flatten()
        .map(|e| e.file_name())
        .collect();
    println!(
        "  undisturbed: test accuracy {:.2} %, last epoch's loss {}, wall {:.2} s",
        calm.acc,
        calm.loss,
        calm.wall.as_secs_f64()
    );
    println!(
        "  rank 1 killed in epoch 2: test accuracy {:.2} %, last epoch's loss {}, wall {:.2} s, recovery {:.2} s on the survivor",
        hit.acc,
        hit.loss,
        hit.wall.as_secs_f64(),
        hit.recovery_s.unwrap_or(f64::NAN)
    );
    check(
        hit.stderr.contains("restart 1: rank 1") && hit.recovery_s.is_some(),
        "the launcher replaced rank 1 and the survivor recovered in the job",
        &hit.stderr,
    )?;
    check(
        (hit.acc - calm.acc).abs() <= 0.5,
        "final test accuracy within 0.5 points of the undisturbed run",
        format!("{} vs {}", hit.acc, calm.acc),
    )?;
    // The failed step is done again with the replacement, so the parameters follow the
    // undisturbed run's: the last epoch's loss is the same (epoch 2's differs: the replacement
    // counts the survivor's loss for the steps before it joined).
    check(
        (hit.loss - calm.loss).abs() <= 1e-6 * calm.loss.abs().max(1.0),
        "the last epoch's training loss equals the undisturbed run's",
        format!("{} vs {}", hit.loss, calm.loss),
    )?;
    match device {
        Device::Cpu => check(
            hit.wall <= calm.wall + Duration::from_secs(5),
            "wall time within the undisturbed run's + 5 s",
            format!("{:?} vs {:?}", hit.wall, calm.wall),
        )?,
        // The simulated GPU runs the kernels on the CPUs, so its runs' wall times follow
        // whatever else those CPUs do (the pair has differed by 12 s beside a build): the time
        // the death cost is taken where the survivor spends it, from its failed call (the
        // replacement's start included) to the state received, against the same 5 s.
        Device::Sim(_) => check(
            hit.recovery_s.is_some_and(|s| s <= 5.0),
            "the survivor's recovery within 5 s",
            format!("{:?} s", hit.recovery_s),
        )?,
    }
    check(
        left.is_empty(),
        "no file written or left in the working directory (no checkpoint)",
        format!("{left:?}"),
    )
}

fn main() -> std::process::ExitCode {
    common::run(&[
        ("kill_rank_1_in_epoch_2", kill_rank_1_in_epoch_2),
        (
            "kill_rank_1_in_epoch_2_on_the_device",
            kill_rank_1_in_epoch_2_on_the_device,
        ),
    ])
}
