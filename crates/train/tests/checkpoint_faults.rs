//! Crash consistency of `train-cnn --save`, end to end against the built binary
//! (`CARGO_BIN_EXE_train-cnn`). Sequential (`harness = false`): every test runs the trainer a few
//! times, and the machine has two cores.
//!
//! - a kill (`LOCKSTEP_FAULT_SAVE`, SIGKILL) at every step of a save: `--resume` then finds the
//!   newest committed state, the next save leaves no temporary file, nothing outside the
//!   checkpoint directory changes, and the finished run equals an uninterrupted one bit for bit;
//! - a damaged latest model file: the resume uses the previous pair and says so;
//! - save paths that cannot work, and a misspelt fault step, fail before any training.
//!
//! The data is a small synthetic FashionMNIST-shaped set written into the scratch directory (256
//! training and 64 test images), so the tests never skip and a run takes about a second; the
//! checkpoint protocol does not depend on the images.

#[path = "../../../tests/common/mod.rs"]
mod common;

use common::show;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::Instant;

use common::check;
use lockstep_train::checkpoint::fault::{SaveStep, FAULT_ENV};

const BIN: &str = env!("CARGO_BIN_EXE_train-cnn");
/// The names a checkpoint at `ck/model.safetensors` leaves once two saves completed.
const FOUR: [&str; 4] = [
    "model.optim.safetensors",
    "model.prev.optim.safetensors",
    "model.prev.safetensors",
    "model.safetensors",
];
/// Training images per run and per step: 4 steps an epoch on one rank.
const LIMIT: &str = "256";
const BATCH: &str = "64";

/// The scratch root and the synthetic data set, made once.
fn root() -> &'static (common::Scratch, PathBuf) {
    static ROOT: OnceLock<(common::Scratch, PathBuf)> = OnceLock::new();
    ROOT.get_or_init(|| {
        let root = common::scratch("ckfaults");
        let data = root.join("data");
        std::fs::create_dir_all(&data).expect("data dir");
        lockstep_train::data::write_synthetic(&data, 256, 64, 5).expect("synthetic data");
        (root, data)
    })
}

/// `train-cnn` on one CPU rank with the synthetic data, `--json` epochs on stdout.
fn train_cnn(epochs: u64) -> Command {
    let mut c = Command::new(BIN);
    for v in [
        "LOCKSTEP_JOB_ID",
        "RANK",
        "WORLD_SIZE",
        "LOCKSTEP_LOG",
        FAULT_ENV,
    ] {
        c.env_remove(v);
    }
    c.args([
        "--device",
        "cpu",
        "--nprocs",
        "1",
        "--batch-size",
        BATCH,
        "--limit-train",
        LIMIT,
        "--json",
        "--epochs",
    ]);
    c.arg(epochs.to_string()).arg("--data").arg(&root().1);
    c
}

fn run(mut c: Command) -> Result<Output, String> {
    c.output().map_err(|e| format!("cannot run {BIN}: {e}"))
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The epochs the run reported (`"epoch":N` of each JSON line).
fn epochs_run(o: &Output) -> Vec<u64> {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| {
            l.strip_prefix("{\"epoch\":")?
                .split(',')
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

fn names(d: &Path) -> Vec<String> {
    let mut v: Vec<String> = match std::fs::read_dir(d) {
        Ok(rd) => rd
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect(),
        Err(_) => Vec::new(),
    };
    v.sort();
    v
}

fn temps(d: &Path) -> usize {
    names(d).iter().filter(|n| n.contains(".tmp-")).count()
}

/// Every tensor of a safetensors file by name (the metadata, with its save id, left out).
fn tensors(p: &Path) -> Result<Tensors, String> {
    let bytes = std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| format!("{}: {e}", p.display()))?;
    Ok(st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.data().to_vec()))
        .collect())
}

/// Every file under `d` (recursively, symlinks not followed) with its size and contents.
fn snapshot(d: &Path, skip: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![d.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let p = e.path();
            if p == skip {
                continue;
            }
            match std::fs::symlink_metadata(&p) {
                Ok(m) if m.is_dir() => stack.push(p),
                Ok(_) => {
                    out.insert(p.clone(), std::fs::read(&p).unwrap_or_default());
                }
                Err(_) => {}
            }
        }
    }
    out
}

/// Tensors by name.
type Tensors = BTreeMap<String, Vec<u8>>;

/// The reference: the final model and optimizer tensors of an uninterrupted 3-epoch run.
fn reference() -> Result<&'static (Tensors, Tensors), String> {
    static REF: OnceLock<(Tensors, Tensors)> = OnceLock::new();
    if let Some(r) = REF.get() {
        return Ok(r);
    }
    let d = root().0.join("straight");
    std::fs::create_dir_all(&d).map_err(|e| e.to_string())?;
    let ck = d.join("model.safetensors");
    let mut c = train_cnn(3);
    c.arg("--save").arg(&ck);
    let o = run(c)?;
    check(
        o.status.success() && epochs_run(&o) == [1, 2, 3],
        "the uninterrupted run",
        show(&o),
    )?;
    Ok(REF.get_or_init(|| {
        (
            tensors(&ck).unwrap_or_default(),
            tensors(&d.join("model.optim.safetensors")).unwrap_or_default(),
        )
    }))
}

/// The model checkpoint `ck` equals the reference run's final model bit for bit.
fn ends_like_the_reference(ck: &Path, what: &str) -> Result<(), String> {
    let (model, _) = reference()?;
    check(&tensors(ck)? == model, what, "")
}

/// A checkpoint directory holding a complete 1-epoch save, made once and copied per test.
fn epoch_one() -> Result<PathBuf, String> {
    static ONE: OnceLock<PathBuf> = OnceLock::new();
    if let Some(d) = ONE.get() {
        return Ok(d.clone());
    }
    let d = root().0.join("epoch1");
    std::fs::create_dir_all(&d).map_err(|e| e.to_string())?;
    let mut c = train_cnn(1);
    c.arg("--save").arg(d.join("model.safetensors"));
    let o = run(c)?;
    check(
        o.status.success() && epochs_run(&o) == [1],
        "the 1-epoch run",
        show(&o),
    )?;
    Ok(ONE.get_or_init(|| d).clone())
}

fn copy_dir(from: &Path, to: &Path) -> Result<(), String> {
    std::fs::create_dir_all(to).map_err(|e| e.to_string())?;
    for n in names(from) {
        std::fs::copy(from.join(&n), to.join(&n)).map_err(|e| format!("copy {n}: {e}"))?;
    }
    Ok(())
}

/// One row of the report: step, what the resume said, temporaries after the kill and after
/// the next save, seconds for the killed run and the resumed run.
type Row = (String, String, usize, usize, f64, f64);

/// Kill the epoch-2 save at `step`, then resume to 3 epochs.
fn kill_at(step: SaveStep) -> Result<Row, String> {
    let w = root().0.join(format!("kill-{step}"));
    let _ = std::fs::remove_dir_all(&w);
    let ckdir = w.join("ck");
    copy_dir(&epoch_one()?, &ckdir)?;
    // A file beside the checkpoint directory: nothing outside it may change.
    std::fs::write(w.join("outside.txt"), b"untouched").map_err(|e| e.to_string())?;
    let before = snapshot(&w, &ckdir);
    let ck = ckdir.join("model.safetensors");

    let t = Instant::now();
    let mut c = train_cnn(2);
    c.arg("--resume")
        .arg(&ck)
        .arg("--save")
        .arg(&ck)
        .env(FAULT_ENV, step.name());
    let killed = run(c)?;
    let killed_s = t.elapsed().as_secs_f64();
    check(
        !killed.status.success()
            && stderr(&killed).contains(&format!("{FAULT_ENV}={step}"))
            && stderr(&killed).contains("SIGKILL"),
        "the save is killed at the step",
        show(&killed),
    )?;
    let temps_after_kill = temps(&ckdir);

    let t = Instant::now();
    let mut c = train_cnn(3);
    c.arg("--resume").arg(&ck).arg("--save").arg(&ck);
    let resumed = run(c)?;
    let resumed_s = t.elapsed().as_secs_f64();
    let expect = if step.is_committed() { 2 } else { 1 };
    let said = format!("resuming from the latest checkpoint: {} and", ck.display());
    let at = format!("(epoch {expect}, step {})", expect * 4);
    let err = stderr(&resumed);
    check(
        resumed.status.success() && err.contains(&said) && err.contains(&at),
        &format!("the resume after a kill at {step} starts from the newest committed save, epoch {expect}"),
        show(&resumed),
    )?;
    check(
        epochs_run(&resumed) == (expect + 1..=3).collect::<Vec<_>>(),
        "the remaining epochs run",
        show(&resumed),
    )?;
    check(
        names(&ckdir) == FOUR,
        "the checkpoint directory holds the two pairs and no temporary file",
        format!("{:?}", names(&ckdir)),
    )?;
    check(
        snapshot(&w, &ckdir) == before,
        "nothing outside the checkpoint directory changed",
        "",
    )?;
    ends_like_the_reference(
        &ck,
        "the final model equals the uninterrupted run's bit for bit",
    )?;
    let (_, optim) = reference()?;
    check(
        &tensors(&ckdir.join("model.optim.safetensors"))? == optim,
        "so does the optimizer state",
        "",
    )?;
    let line = err
        .lines()
        .find(|l| l.contains("resuming from"))
        .unwrap_or_default();
    let from = line
        .split(" and ")
        .nth(1)
        .and_then(|s| s.rsplit('/').next())
        .unwrap_or("?")
        .to_string();
    let via = if from.starts_with("model.prev.optim") {
        "kept optimizer file"
    } else {
        "live pair"
    };
    Ok((
        step.to_string(),
        format!("latest, epoch {expect} ({via})"),
        temps_after_kill,
        temps(&ckdir),
        killed_s,
        resumed_s,
    ))
}

fn kill_at_every_save_step() -> Result<(), String> {
    reference()?;
    let mut rows = Vec::new();
    for step in SaveStep::ALL {
        rows.push(kill_at(step).map_err(|e| format!("kill at {step}:\n{e}"))?);
    }
    println!(
        "  {:<16} {:<42} {:>11} {:>12} {:>8} {:>9}",
        "fault step", "resumed from", "tmp (kill)", "tmp (saved)", "kill s", "resume s"
    );
    for (s, from, a, b, k, r) in &rows {
        println!("  {s:<16} {from:<42} {a:>11} {b:>12} {k:>8.2} {r:>9.2}");
    }
    Ok(())
}

fn damaged_latest_resumes_the_previous_pair() -> Result<(), String> {
    let w = root().0.join("damaged");
    let _ = std::fs::remove_dir_all(&w);
    let ckdir = w.join("ck");
    copy_dir(&epoch_one()?, &ckdir)?;
    let ck = ckdir.join("model.safetensors");
    let mut c = train_cnn(2);
    c.arg("--resume").arg(&ck).arg("--save").arg(&ck);
    let o = run(c)?;
    check(
        o.status.success() && names(&ckdir) == FOUR,
        "a second save keeps the first as the previous pair",
        show(&o),
    )?;
    // Half the latest model file, as a failing disk or a careless copy might leave it.
    let bytes = std::fs::read(&ck).map_err(|e| e.to_string())?;
    std::fs::write(&ck, &bytes[..bytes.len() / 2]).map_err(|e| e.to_string())?;
    let mut c = train_cnn(3);
    c.arg("--resume").arg(&ck).arg("--save").arg(&ck);
    let o = run(c)?;
    let err = stderr(&o);
    check(
        o.status.success()
            && err.contains("resuming from the previous checkpoint")
            && err.contains("(epoch 1, step 4)")
            && err.contains("passed over")
            && epochs_run(&o) == [2, 3],
        "the previous pair is used, and the log says so and why",
        show(&o),
    )?;
    ends_like_the_reference(&ck, "and the run ends where the uninterrupted one does")
}

/// A directory in which this user cannot create a file, if one can be found.
fn unwritable_dir() -> Option<PathBuf> {
    let probe = |d: &Path| {
        std::fs::File::create(d.join(".lockstep-probe"))
            .map(|_| std::fs::remove_file(d.join(".lockstep-probe")))
            .is_err()
    };
    let d = root().0.join("readonly");
    let _ = std::fs::create_dir_all(&d);
    let _ = std::process::Command::new("chmod")
        .arg("0555")
        .arg(&d)
        .status();
    if probe(&d) {
        return Some(d);
    }
    // root ignores permission bits; sysfs refuses new files even to root.
    [Path::new("/sys")]
        .into_iter()
        .find(|d| d.is_dir() && probe(d))
        .map(Path::to_path_buf)
}

fn save_path_problems_fail_before_training() -> Result<(), String> {
    let w = root().0.join("bad-targets");
    std::fs::create_dir_all(w.join("adir")).map_err(|e| e.to_string())?;
    let cases: Vec<(PathBuf, &str)> = vec![
        (w.join("adir"), "is a directory"),
        (
            w.join("missing/sub/model.safetensors"),
            "does not exist; create it first",
        ),
    ];
    let mut cases = cases;
    match unwritable_dir() {
        Some(d) => cases.push((d.join("model.safetensors"), "cannot create a file in")),
        None => common::skip_part(
            "the unwritable-directory case (no directory refuses this user's files)",
        ),
    }
    for (path, says) in cases {
        let t = Instant::now();
        let mut c = train_cnn(2);
        c.arg("--save").arg(&path);
        let o = run(c)?;
        let err = stderr(&o);
        check(
            o.status.code() == Some(2)
                && err.contains(&path.display().to_string())
                && err.contains(says)
                && epochs_run(&o).is_empty(),
            &format!("--save {} fails at once saying {says:?}", path.display()),
            show(&o),
        )?;
        check(
            t.elapsed().as_secs_f64() < 10.0,
            "before any training",
            format!("{:?}", t.elapsed()),
        )?;
    }
    let mut c = train_cnn(1);
    c.arg("--save")
        .arg(w.join("model.safetensors"))
        .env(FAULT_ENV, "after-rename");
    let o = run(c)?;
    let err = stderr(&o);
    check(
        o.status.code() == Some(2)
            && err.contains("\"after-rename\"")
            && SaveStep::ALL.iter().all(|s| err.contains(s.name())),
        "a misspelt fault step is refused with the list of valid ones",
        show(&o),
    )?;
    check(
        names(&w) == ["adir"],
        "and nothing was written",
        format!("{:?}", names(&w)),
    )
}

fn main() -> std::process::ExitCode {
    let code = common::run(&[
        ("kill_at_every_save_step", kill_at_every_save_step),
        (
            "damaged_latest_resumes_the_previous_pair",
            damaged_latest_resumes_the_previous_pair,
        ),
        (
            "save_path_problems_fail_before_training",
            save_path_problems_fail_before_training,
        ),
    ]);
    if code == std::process::ExitCode::SUCCESS {
        let _ = std::fs::remove_dir_all(&root().0);
    }
    code
}
