//! `train-cnn` end to end against the built binary, on small synthetic data: per-step lines off a
//! terminal, JSON output that parses line by line, the `--metrics` file and the `--plot` SVG, the
//! RSS summary of every rank (forked and under `lockstep launch`), the progress bar under a
//! pseudo-terminal (`script`, also under `lockstep launch`), and the refusals of precision and
//! trainer options. Sequential (`harness = false`): every test runs the trainer.

#[path = "../../../tests/common/mod.rs"]
mod common;

use common::show;

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::OnceLock;

const BIN: &str = env!("CARGO_BIN_EXE_train-cnn");

/// A scratch directory with 256 training and 64 test images.
fn root() -> &'static (PathBuf, PathBuf) {
    static ROOT: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    ROOT.get_or_init(|| {
        let root = std::env::temp_dir().join(format!("lockstep-train-cli-{}", std::process::id()));
        let data = root.join("data");
        std::fs::create_dir_all(&data).expect("scratch dir");
        lockstep_train::data::write_synthetic(&data, 256, 64, 3).expect("synthetic data");
        (root, data)
    })
}

/// Environment of a process started from a test: no launcher variables, no log filter, no
/// terminal claim.
fn clean(c: &mut Command) -> &mut Command {
    for v in [
        "LOCKSTEP_JOB_ID",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCKSTEP_LOG",
        "LOCKSTEP_CONSOLE_TTY",
        "LOCKSTEP_TOKEN",
    ] {
        c.env_remove(v);
    }
    // No configuration file of the user's: the defaults are the documented ones.
    c.env_remove("LOCKSTEP_CONFIG")
        .env("XDG_CONFIG_HOME", root().0.join("xdg"));
    c
}

/// The trainer's arguments for 2 ranks, 1 epoch (unless `extra` says) of 8 steps (128 images
/// per rank, batches of 16).
fn args(extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = ["--device", "cpu", "--batch-size", "16", "--data"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    v.push(root().1.display().to_string());
    if !extra.contains(&"--epochs") {
        v.extend(["--epochs".to_string(), "1".to_string()]);
    }
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

fn train_cnn(extra: &[&str]) -> Result<Output, String> {
    let mut c = Command::new(BIN);
    clean(&mut c)
        .args(args(extra))
        .output()
        .map_err(|e| format!("cannot run {BIN}: {e}"))
}

/// stdout lines without the launcher's `[rank 0] ` prefix (forked text mode and `lockstep
/// launch` add it).
fn lines(o: &Output) -> Vec<String> {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| l.strip_prefix("[rank 0] ").unwrap_or(l).to_string())
        .collect()
}

/// `epoch 1/1 step 2/8 loss 2.1234 1234 img/s`, with any loss and rate.
fn is_step_line(l: &str, step: usize, steps: usize) -> bool {
    let Some(rest) = l.strip_prefix(&format!("epoch 1/1 step {step}/{steps} loss ")) else {
        return false;
    };
    let parts: Vec<&str> = rest.split(' ').collect();
    parts.len() == 3
        && parts[0].split_once('.').is_some_and(|(_, d)| d.len() == 4)
        && parts[0].parse::<f32>().is_ok_and(f32::is_finite)
        && parts[1].parse::<u64>().is_ok()
        && parts[2] == "img/s"
}

fn step_lines_off_a_terminal() -> Result<(), String> {
    let o = train_cnn(&["--nprocs", "2", "--log-every", "2"])?;
    if !o.status.success() {
        return Err(show(&o));
    }
    let l = lines(&o);
    let steps: Vec<&String> = l.iter().filter(|l| l.contains(" step ")).collect();
    let ok = steps.len() == 4
        && steps
            .iter()
            .zip([2, 4, 6, 8])
            .all(|(l, s)| is_step_line(l, s, 8));
    if !ok {
        return Err(format!(
            "want step lines 2, 4, 6, 8 of 8 in the seed's shape\n{}",
            show(&o)
        ));
    }
    if !l
        .iter()
        .any(|l| l.starts_with("epoch 1/1  loss ") && l.contains("test acc"))
    {
        return Err(format!("no epoch line\n{}", show(&o)));
    }
    rss_covers(&l, 2, &o)?;
    // No bar off a terminal: no carriage return, no escape sequence.
    if o.stdout.iter().any(|&b| b == b'\r' || b == 0x1b) {
        return Err(format!(
            "terminal control bytes off a terminal\n{}",
            show(&o)
        ));
    }
    // The default (every 100 steps) prints none in an 8-step epoch.
    let o = train_cnn(&["--nprocs", "1"])?;
    if !o.status.success() || lines(&o).iter().any(|l| l.contains(" step ")) {
        return Err(format!(
            "default --log-every printed step lines in an 8-step epoch\n{}",
            show(&o)
        ));
    }
    Ok(())
}

/// `peak RSS per rank: a, b MiB` (text) or `{"peak_rss_mib":[a,b]}` (JSON) with one positive
/// value per rank.
fn rss_covers(lines: &[String], ranks: usize, o: &Output) -> Result<(), String> {
    let vals: Option<Vec<f64>> = lines.iter().find_map(|l| {
        let v = if let Some(r) = l.strip_prefix("peak RSS per rank: ") {
            r.strip_suffix(" MiB")?
                .split(", ")
                .map(|x| x.parse().ok())
                .collect()
        } else {
            let j: serde_json::Value = serde_json::from_str(l).ok()?;
            j.get("peak_rss_mib")?
                .as_array()?
                .iter()
                .map(|x| x.as_f64())
                .collect()
        };
        v
    });
    match vals {
        Some(v) if v.len() == ranks && v.iter().all(|&x| x > 1.0) => Ok(()),
        other => Err(format!(
            "want the peak RSS of {ranks} ranks, found {other:?}\n{}",
            show(o)
        )),
    }
}

fn json_metrics_and_plot() -> Result<(), String> {
    let d = root().0.join("files");
    std::fs::create_dir_all(&d).map_err(|e| e.to_string())?;
    let (m, p) = (d.join("metrics.jsonl"), d.join("curves.svg"));
    let o = train_cnn(&[
        "--nprocs",
        "2",
        "--json",
        "--log-every",
        "4",
        "--metrics",
        &m.display().to_string(),
        "--plot",
        &p.display().to_string(),
    ])?;
    if !o.status.success() {
        return Err(show(&o));
    }
    // Every stdout line is a JSON object: step lines (first key "step"), the epoch, the RSS.
    let mut objs = Vec::new();
    for l in String::from_utf8_lossy(&o.stdout).lines() {
        let v: serde_json::Value = serde_json::from_str(l)
            .map_err(|e| format!("stdout line {l:?} is not JSON ({e})\n{}", show(&o)))?;
        objs.push(v);
    }
    let steps: Vec<u64> = objs
        .iter()
        .filter_map(|v| v.get("step")?.as_u64())
        .collect();
    let epochs: Vec<f64> = objs
        .iter()
        .filter_map(|v| v.get("test_acc")?.as_f64())
        .collect();
    if steps != [4, 8] || epochs.len() != 1 {
        return Err(format!(
            "want steps [4, 8] and one epoch object, got {steps:?} and {epochs:?}\n{}",
            show(&o)
        ));
    }
    rss_covers(
        &String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(String::from)
            .collect::<Vec<_>>(),
        2,
        &o,
    )?;
    // The metrics file: a record per step, one per epoch, a summary of both ranks.
    let text = std::fs::read_to_string(&m).map_err(|e| format!("{}: {e}", m.display()))?;
    let recs: Vec<serde_json::Value> = text
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("metrics file: {e}\n{text}"))?;
    let kind = |k: &str| recs.iter().filter(|r| r["kind"] == k).count();
    let step_nums: Vec<u64> = recs
        .iter()
        .filter(|r| r["kind"] == "step")
        .filter_map(|r| r["step"].as_u64())
        .collect();
    if step_nums != (1..=8).collect::<Vec<_>>() || kind("epoch") != 1 || kind("summary") != 1 {
        return Err(format!(
            "metrics file records: steps {step_nums:?}, {} epoch, {} summary\n{text}",
            kind("epoch"),
            kind("summary")
        ));
    }
    let last = recs
        .iter()
        .find(|r| r["kind"] == "epoch")
        .ok_or("no epoch record")?;
    if last["test_acc"].as_f64() != epochs.first().copied()
        || last["test_count"].as_u64() != Some(64)
    {
        return Err(format!("the epoch record disagrees with stdout: {last}"));
    }
    let summary = recs
        .iter()
        .find(|r| r["kind"] == "summary")
        .ok_or("no summary")?;
    if summary["peak_rss_mib"].as_array().map(Vec::len) != Some(2) {
        return Err(format!("summary: {summary}"));
    }
    let svg = std::fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display()))?;
    if !(svg.starts_with("<svg")
        && svg.contains("training loss")
        && svg.contains("test accuracy")
        && svg.matches("<circle").count() == 2)
    {
        return Err(format!(
            "the plot lacks a chart or the epoch's points:\n{}",
            &svg[..svg.len().min(400)]
        ));
    }
    let left: Vec<_> = std::fs::read_dir(&d)
        .map_err(|e| e.to_string())?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    if left.len() != 2 {
        return Err(format!("temporary files left beside the outputs: {left:?}"));
    }
    Ok(())
}

/// Under `lockstep launch` every rank joins from the environment; rank 0's summary still covers
/// both ranks, and the text output carries the launcher's prefix only.
fn launched_run_reports_every_rank() -> Result<(), String> {
    let mut c = Command::new(common::lockstep_bin());
    clean(&mut c)
        .args(["launch", "--nproc-per-node", "2", "--", BIN])
        .args(args(&["--log-every", "4"]));
    let o = c.output().map_err(|e| e.to_string())?;
    if !o.status.success() {
        return Err(show(&o));
    }
    let l = lines(&o);
    if !(is_step_line(
        l.iter()
            .find(|l| l.contains(" step 4/"))
            .map(String::as_str)
            .unwrap_or(""),
        4,
        8,
    )) {
        return Err(format!("no step line under lockstep launch\n{}", show(&o)));
    }
    rss_covers(&l, 2, &o)
}

/// Run `cmd` under a pseudo-terminal; `None` when `script` (util-linux) is not installed.
fn under_pty(cmd: &str) -> Result<Option<String>, String> {
    let mut c = Command::new("script");
    clean(&mut c).args(["-qec", cmd, "/dev/null"]);
    match c.output() {
        Ok(o) if o.status.success() => Ok(Some(String::from_utf8_lossy(&o.stdout).into_owned())),
        Ok(o) => Err(format!("script -qec {cmd:?} failed\n{}", show(&o))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

fn quote(args: &[String]) -> String {
    args.iter()
        .map(|a| format!("'{a}'"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// On a terminal the default text mode draws a bar: `ESC[2K epoch 1/2 [...] n/8 ... \r` redraws,
/// ending at 8/8, wiped by the epoch line; under `lockstep launch` the same redraws arrive
/// forwarded one by one with rank 0's prefix.
fn progress_bar_under_a_pseudo_terminal() -> Result<(), String> {
    let a = args(&["--epochs", "2"]);
    let direct = format!("'{BIN}' --nprocs 2 {}", quote(&a));
    let launched = format!(
        "'{}' launch --nproc-per-node 2 -- '{BIN}' {}",
        common::lockstep_bin(),
        quote(&a)
    );
    for (what, cmd) in [("train-cnn", direct), ("lockstep launch", launched)] {
        let Some(out) = under_pty(&cmd)? else {
            common::skip_part("`script` (util-linux) is not installed");
            return Ok(());
        };
        let redraws: Vec<&str> = out
            .split('\r')
            .filter(|s| s.contains("epoch 1/2 ["))
            .collect();
        let ok = redraws.len() >= 3
            && redraws.iter().all(|s| s.contains("\x1b[2K"))
            && redraws.iter().any(|s| s.contains("] 0/8"))
            && redraws.iter().any(|s| s.contains("] 8/8 loss "))
            && out.contains("epoch 2/2 [")
            && out.contains("\x1b[2K")
            && out
                .lines()
                .any(|l| l.contains("epoch 1/2  loss ") && l.contains("test acc"))
            && out.contains("peak RSS per rank: ");
        if !ok {
            return Err(format!("{what}: no progress bar redraws (ESC[2K ... \\r) up to 8/8 on the terminal:\n{out:?}"));
        }
        if what == "lockstep launch" && !redraws.iter().all(|s| s.contains("[rank 0] epoch 1/2 ["))
        {
            return Err(format!("{what}: redraws lost rank 0's prefix:\n{out:?}"));
        }
    }
    Ok(())
}

/// Precision and options that cannot run are refused at once with exit 2 and a message naming
/// them; nothing trains in fp32 instead of bf16.
fn refusals() -> Result<(), String> {
    let d = root().0.display().to_string();
    let cases: &[(&[&str], &str)] = &[
        (&["--precision", "bf16"], "precision bf16 on the CPU"),
        (&["--precision", "fp16"], "precision fp16 on the CPU"),
        (&["--precision", "half"], "no (fp32), fp16 or bf16"),
        (&["--grad-accum", "0"], "--grad-accum 0"),
        (&["--log-every", "0"], "--log-every 0"),
        (
            &["--clip-grad-norm", "0"],
            "--clip-grad-norm must be a positive number",
        ),
        (
            &["--optimizer", "sgd", "--momentum", "1"],
            "--momentum must be in [0, 1)",
        ),
        (
            &["--optimizer", "sgd", "--save", "m.safetensors"],
            "Adam's state only",
        ),
        (&["--plot", "curves.png"], "with a .svg extension"),
        (
            &["--metrics", "/nonexistent-lockstep-dir/m.jsonl"],
            "does not exist",
        ),
        (&["--metrics", &d], "is a directory"),
        (&["--epochs", "0"], "--epochs 0 would train nothing"),
    ];
    for (extra, want) in cases {
        let o = train_cnn(extra)?;
        let err = String::from_utf8_lossy(&o.stderr);
        if o.status.code() != Some(2) || !err.contains(want) || !o.stdout.is_empty() {
            return Err(format!(
                "{extra:?}: want exit 2 and {want:?} on stderr, nothing on stdout\n{}",
                show(&o)
            ));
        }
    }
    Ok(())
}

/// train-cnn reads the configuration file `lockstep config` writes: its mixed_precision is the
/// default of --precision (so bf16 in the file is refused on the CPU, never trained in fp32), a
/// flag overrides it, and a bad key is an error naming the file, line and key.
fn reads_the_config_file() -> Result<(), String> {
    let d = root().0.join("config");
    std::fs::create_dir_all(&d).map_err(|e| e.to_string())?;
    let good = d.join("bf16.toml");
    std::fs::write(
        &good,
        "num_processes = 2\nmixed_precision = \"bf16\" # as accelerate\n",
    )
    .map_err(|e| e.to_string())?;
    let g = good.display().to_string();
    let o = train_cnn(&["--config", &g])?;
    let err = String::from_utf8_lossy(&o.stderr);
    if o.status.code() != Some(2) || !err.contains("precision bf16 on the CPU") {
        return Err(format!(
            "mixed_precision = bf16 from the file must be refused on the CPU\n{}",
            show(&o)
        ));
    }
    let o = train_cnn(&["--config", &g, "--precision", "no", "--limit-train", "64"])?;
    if !o.status.success() {
        return Err(format!(
            "--precision no overrides the file's bf16\n{}",
            show(&o)
        ));
    }
    let bad = d.join("bad.toml");
    std::fs::write(&bad, "num_processes = 2\nnproc = 3\n").map_err(|e| e.to_string())?;
    let o = train_cnn(&["--config", &bad.display().to_string()])?;
    let err = String::from_utf8_lossy(&o.stderr);
    if o.status.code() != Some(2)
        || !err.contains("bad.toml")
        || !err.contains("line 2")
        || !err.contains("nproc")
    {
        return Err(format!(
            "an unknown key must be an error naming file, line and key\n{}",
            show(&o)
        ));
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    let code = common::run(&[
        ("reads_the_config_file", reads_the_config_file),
        ("refusals", refusals),
        ("step_lines_off_a_terminal", step_lines_off_a_terminal),
        ("json_metrics_and_plot", json_metrics_and_plot),
        (
            "launched_run_reports_every_rank",
            launched_run_reports_every_rank,
        ),
        (
            "progress_bar_under_a_pseudo_terminal",
            progress_bar_under_a_pseudo_terminal,
        ),
    ]);
    let _ = std::fs::remove_dir_all(&root().0);
    code
}
