//! Forking tests of data-parallel training (harness = false: the launcher forks, which the
//! threaded libtest harness must not do). Prints one line per test and ends with
//! `N passed, M failed`; exits non-zero on failure.
//!
//! - metric counts: every test sample counted exactly once for world sizes 1-4, uneven sizes;
//! - a short real run on 2 ranks: loss falls, accuracy far above chance, replicas identical;
//! - determinism: the same seed gives the same loss curve run after run;
//! - resume on 2 ranks: save after epoch 1, resume, equal to the straight 2-epoch run.

#[path = "../../../tests/common/runner.rs"]
mod runner;
#[path = "common/train.rs"]
mod train;

use std::path::{Path, PathBuf};
use std::time::Instant;

use lockstep::launch::{launch, LaunchConfig, RankContext};
use lockstep_train::data::{self, Dataset};
use lockstep_train::sampler::{counts_for_metrics, DistributedSampler};
use lockstep_train::trainer::{self, EpochReport, Observer, TrainConfig};

type TestResult = Result<(), String>;
/// Per rank: (step losses, epoch losses, epoch accuracies, parameter checksum).
type RankRun = (Vec<f64>, Vec<f64>, Vec<f64>, f64);
type TestFn = fn() -> TestResult;

fn data_dir() -> (PathBuf, bool) {
    let real = Path::new(data::DEFAULT_DATA_DIR);
    if real.join("train-images-idx3-ubyte.gz").exists() {
        return (real.to_path_buf(), true);
    }
    let d = std::env::temp_dir().join(format!("lockstep-train-dist-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("temp dir");
    data::write_synthetic(&d, 2000, 1000, 2).expect("synthetic data");
    (d, false)
}

fn load(n_train: usize, n_test: usize) -> (Dataset, Dataset) {
    train::load_splits(&data_dir().0, n_train, n_test)
}

fn metric_counts_exact() -> TestResult {
    for world in 1..=4 {
        for len in [10_000usize, 10_001, 9_999, 7, 1] {
            let res = launch(&LaunchConfig::new(world), |mut ctx: RankContext| {
                let mut s = DistributedSampler::new(len, ctx.world_size, ctx.rank, false, 0);
                let mut idx = Vec::new();
                s.indices(0, &mut idx);
                // "Correct" = even index, so the expected total is known exactly.
                let (mut correct, mut counted) = (0u64, 0u64);
                for (i, &j) in idx.iter().enumerate() {
                    if s.is_real(i) {
                        counted += 1;
                        correct += (j % 2 == 0) as u64;
                    }
                }
                let (c, n) = counts_for_metrics(&mut ctx.comm, correct, counted)?;
                Ok((c, n))
            })
            .map_err(|e| e.to_string())?;
            for (c, n) in res {
                if n != len as u64 || c != len.div_ceil(2) as u64 {
                    return Err(format!(
                        "world {world}, len {len}: counted {n} (correct {c}), expected {len} ({})",
                        len.div_ceil(2)
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Records every step's loss on each rank.
#[derive(Default)]
struct Losses(Vec<f64>);
impl Observer for Losses {
    fn step(&mut self, _step: usize, loss: f32, _ips: f64) {
        self.0.push(loss as f64);
    }
}

/// Train on 2 ranks; per rank: (step losses, epoch losses, epoch accuracies, param checksum).
fn run2(cfg: &TrainConfig, tr: &Dataset, te: &Dataset) -> Result<Vec<RankRun>, String> {
    launch(&LaunchConfig::new(2), |mut ctx: RankContext| {
        let mut obs = Losses::default();
        let out = trainer::train(cfg, tr, te, &mut ctx.comm, &mut obs)?;
        let el: Vec<f64> = out
            .reports
            .iter()
            .map(|r: &EpochReport| r.train_loss)
            .collect();
        let acc: Vec<f64> = out.reports.iter().map(|r| r.test_acc).collect();
        Ok((obs.0, el, acc, train::checksum(&out.params)))
    })
    .map_err(|e| e.to_string())
}

fn short_run_learns_and_is_deterministic() -> TestResult {
    let (tr, te) = load(2000, 2000);
    let cfg = TrainConfig {
        epochs: 1,
        ..TrainConfig::default()
    };
    let a = run2(&cfg, &tr, &te)?;
    let steps = &a[0].0;
    let n = steps.len();
    let head: f64 = steps[..3].iter().sum::<f64>() / 3.0;
    let tail: f64 = steps[n - 3..].iter().sum::<f64>() / 3.0;
    let acc = a[0].2[0];
    println!("    2 ranks, {} train images, {n} steps: loss {head:.3} -> {tail:.3}, test acc {acc:.2} % on {} images", tr.len(), te.len());
    if tail >= head * 0.8 {
        return Err(format!(
            "loss did not fall: first steps {head:.3}, last steps {tail:.3}"
        ));
    }
    if acc < 50.0 {
        return Err(format!(
            "accuracy {acc:.2} % is not far above chance (10 %)"
        ));
    }
    if a[0].3 != a[1].3 || a[0].2 != a[1].2 {
        return Err("the two replicas ended with different parameters or metrics".into());
    }
    let b = run2(&cfg, &tr, &te)?;
    if a[0].0 != b[0].0 || a[1].0 != b[1].0 || a[0].3 != b[0].3 {
        return Err("same seed gave a different loss curve on the second run".into());
    }
    Ok(())
}

fn resume_on_two_ranks_matches_straight_run() -> TestResult {
    let (tr, te) = load(640, 500);
    let d = std::env::temp_dir().join(format!("lockstep-train-resume-{}", std::process::id()));
    std::fs::create_dir_all(&d).map_err(|e| e.to_string())?;
    let ck = d.join("model.safetensors");
    let base = TrainConfig {
        epochs: 2,
        ..TrainConfig::default()
    };
    let straight = run2(&base, &tr, &te)?;
    let (first, resume) = train::save_then_resume(&base, &ck);
    run2(&first, &tr, &te)?;
    let resumed = run2(&resume, &tr, &te)?;
    let _ = std::fs::remove_dir_all(&d);
    if resumed[0].1[0] != straight[0].1[1]
        || resumed[0].3 != straight[0].3
        || resumed[1].3 != straight[1].3
    {
        return Err(format!(
            "resumed epoch 2 loss {} vs straight {}; params {} vs {}",
            resumed[0].1[0], straight[0].1[1], resumed[0].3, straight[0].3
        ));
    }
    Ok(())
}

/// Gradients and BN running statistics of one step on 8 images: 1 rank with the whole batch,
/// or 2 ranks with 4 images each and synchronised BatchNorm (then gradients averaged). They
/// must agree: SyncBN makes the data-parallel step equal to the single large-batch step.
fn sync_bn_matches_single_large_batch() -> TestResult {
    use lockstep::comm::ReduceOp;
    use lockstep_train::model::{Model, StateMut};
    let (tr, _) = load(8, 1);
    let labels: Vec<u8> = tr.labels[..8].to_vec();
    let setup = |from: usize, n: usize| -> Model {
        let mut m = Model::fashion_cnn(n).expect("model");
        m.init(3);
        let input = m.input_mut();
        for (dst, i) in input.data_mut().chunks_exact_mut(784).zip(from..from + n) {
            for (d, &p) in dst.iter_mut().zip(tr.image(i)) {
                *d = p as f32 / 255.0;
            }
        }
        m
    };
    let running = |m: &mut Model| -> Vec<f32> {
        let mut v = Vec::new();
        for s in m.state_mut() {
            if let StateMut::F32(_, x) = s {
                v.extend_from_slice(x);
            }
        }
        v
    };
    let mut single = setup(0, 8);
    single.forward(true);
    single.loss(&labels).map_err(|e| e.to_string())?;
    let mut g1 = vec![0.0f32; single.num_params()];
    single.backward(&labels, &mut g1);
    let r1 = running(&mut single);
    let res = launch(&LaunchConfig::new(2), |mut ctx: RankContext| {
        let mut m = setup(4 * ctx.rank, 4);
        m.set_sync_bn(true);
        let lab = &labels[4 * ctx.rank..4 * ctx.rank + 4];
        let comm = &mut ctx.comm;
        let mut sum = |b: &mut [f64]| comm.all_reduce_in_place(b, ReduceOp::Sum);
        m.forward_with(true, Some(&mut sum))?;
        m.loss(lab)?;
        let mut g = vec![0.0f32; m.num_params()];
        m.backward_with(lab, &mut g, Some(&mut sum))?;
        ctx.comm.all_reduce_in_place(&mut g[..], ReduceOp::Avg)?;
        Ok((g, running(&mut m)))
    })
    .map_err(|e| e.to_string())?;
    for (rank, (g2, r2)) in res.iter().enumerate() {
        for (name, a, b) in [("grad", &g1, g2), ("running stats", &r1, r2)] {
            let scale = a.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            if let Some(i) = (0..a.len()).find(|&i| (a[i] - b[i]).abs() > 1e-4 * scale + 1e-6) {
                return Err(format!(
                    "rank {rank}: {name}[{i}] single {} vs synced {} (max |value| {scale})",
                    a[i], b[i]
                ));
            }
        }
    }
    Ok(())
}

/// `train-cnn` refuses runs that would do nothing, and datasets that cannot be trained on, with a
/// message naming the flag or the file, at once (exit 2 for flags, 1 for data).
fn cli_refuses_empty_runs() -> TestResult {
    let (dir, _) = data_dir();
    let bad = std::env::temp_dir().join(format!("lockstep-train-bad-{}", std::process::id()));
    std::fs::create_dir_all(&bad).map_err(|e| e.to_string())?;
    let idx = |dims: &[usize]| data::encode_idx(dims, &vec![1u8; dims.iter().product()]);
    let files = [
        ("train-images-idx3-ubyte", idx(&[8, 28, 28])),
        ("train-labels-idx1-ubyte", idx(&[8])),
        ("t10k-images-idx3-ubyte", idx(&[4, 10, 10])),
        ("t10k-labels-idx1-ubyte", idx(&[4])),
    ];
    for (name, bytes) in &files {
        std::fs::write(bad.join(name), bytes).map_err(|e| e.to_string())?;
    }
    let d = dir.display().to_string();
    let b = bad.display().to_string();
    let cases: [(&[&str], i32, &str); 3] = [
        (
            &["--data", &d, "--epochs", "0"],
            2,
            "--epochs 0 would train nothing",
        ),
        (
            &["--data", &d, "--limit-train", "0"],
            2,
            "--limit-train 0 leaves no training images",
        ),
        (
            &["--data", &b, "--epochs", "1"],
            1,
            "t10k-images-idx3-ubyte holds 10×10 images but the training split",
        ),
    ];
    for (args, code, want) in cases {
        let t = Instant::now();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_train-cnn"))
            .args(args)
            .output()
            .map_err(|e| e.to_string())?;
        let err = String::from_utf8_lossy(&out.stderr);
        if out.status.code() != Some(code)
            || !err.contains(want)
            || t.elapsed().as_secs_f64() > 10.0
        {
            return Err(format!(
                "train-cnn {args:?}: exit {:?} after {:.1} s, stderr: {err}",
                out.status.code(),
                t.elapsed().as_secs_f64()
            ));
        }
    }
    let _ = std::fs::remove_dir_all(&bad);
    Ok(())
}

fn main() -> std::process::ExitCode {
    let tests: [(&str, TestFn); 5] = [
        ("cli_refuses_empty_runs", cli_refuses_empty_runs),
        (
            "sync_bn_matches_single_large_batch",
            sync_bn_matches_single_large_batch,
        ),
        ("metric_counts_exact_world_1_to_4", metric_counts_exact),
        (
            "short_run_learns_and_is_deterministic",
            short_run_learns_and_is_deterministic,
        ),
        (
            "resume_on_two_ranks_matches_straight_run",
            resume_on_two_ranks_matches_straight_run,
        ),
    ];
    let (_, real) = data_dir();
    println!(
        "data: {}",
        if real {
            "FashionMNIST at the default path"
        } else {
            "synthetic IDX files (dataset not installed)"
        }
    );
    runner::run(&tests)
}
