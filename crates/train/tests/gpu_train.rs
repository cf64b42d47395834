//! The device engine on a real GPU: 20 training steps on the GPU and on the CPU engine from the
//! same initialisation give the same losses; bf16 steps agree at first and learn; graph replay
//! matches plain launches; `train_device` and `train-cnn --device cuda` (1 and 2 ranks) train.
//!
//! Without a driver it prints `skipped: no CUDA driver` (and fails under LOCKSTEP_REQUIRE_GPU=1).
//! Kernels are built with `-DLOCKSTEP_NO_TF32` unless `LOCKSTEP_NVRTC_OPTIONS` is already set.
//!
//! Tolerances on per-step losses (|got - want| <= atol + rtol * |want|): fp32 without TF32
//! 1e-3 / 5e-3 over 20 steps (summation order differs, and Adam amplifies sign noise on the
//! BN-cancelled conv biases into the trajectory); with TF32 5e-2 / 5e-2; bf16: the first 2 steps
//! 2e-2 / 5e-2, then "learns like the CPU". Graph replay vs plain launches, and two runs of the
//! same steps, must be bit-identical (losses and parameters): split-K weight gradients sum their
//! slices in a fixed order (no atomics), so nothing depends on block scheduling.

#[path = "../../../tests/common/close.rs"]
mod close;
#[path = "../../../tests/common/gpu.rs"]
mod gpu;
#[path = "common/reference.rs"]
mod reference;
#[path = "../../../tests/common/runner.rs"]
mod runner;

use close::{assert_close, Tol};
use lockstep_train::data::{self, Dataset};
use lockstep_train::device::{plan, DeviceOptions, Engine, GpuExec, Precision};
use lockstep_train::model::Model;
use lockstep_train::trainer::{Silent, TrainConfig};

fn synthetic_dir(n_train: usize, n_test: usize) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "lockstep-gpu-train-{}-{n_train}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    data::write_synthetic(&dir, n_train, n_test, 5).unwrap();
    dir
}

#[allow(clippy::too_many_arguments)]
fn gpu_losses(
    ctx: &std::sync::Arc<lockstep::cuda::Context>,
    model: &Model,
    data: &Dataset,
    idx: &[usize],
    b: usize,
    steps: usize,
    precision: Precision,
    graphs: bool,
) -> Result<(Vec<f32>, f64, Vec<f32>), String> {
    let e = |e: lockstep_train::device::DeviceError| e.to_string();
    let t = plan::Tensors::new(model, b, precision).map_err(e)?;
    let exec = GpuExec::new(ctx, t.arena_len, graphs).map_err(|e| e.to_string())?;
    let mut eng = Engine::new(exec, model, b, precision).map_err(e)?;
    eng.upload_dataset(
        data,
        &Dataset {
            rows: 28,
            cols: 28,
            ..Default::default()
        },
    )
    .map_err(e)?;
    eng.set_index_list(idx, false).map_err(e)?;
    let mut out = Vec::new();
    let t0 = std::time::Instant::now();
    for s in 0..steps {
        eng.train_step(s * b, b, 0.005, None).map_err(e)?;
        out.push(eng.last_loss().map_err(e)?);
    }
    let per_step_ms = t0.elapsed().as_secs_f64() * 1e3 / steps as f64;
    if graphs && eng.exec.graph_count() != 1 {
        return Err(format!(
            "expected one captured graph for one batch size, found {}",
            eng.exec.graph_count()
        ));
    }
    let params = eng.params().map_err(e)?;
    Ok((out, per_step_ms, params))
}

/// The train-cnn binary: `LOCKSTEP_TRAIN_CNN`, else next to this test binary's folder
/// (`target/release/deps/..`, so a carried `target/release` works anywhere), else the build path.
fn train_cnn_path() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("LOCKSTEP_TRAIN_CNN") {
        return p.into();
    }
    let beside = std::env::current_exe()
        .ok()
        .and_then(|e| Some(e.parent()?.parent()?.join("train-cnn")));
    beside
        .filter(|p| p.is_file())
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_train-cnn").into())
}

fn main() {
    // The ranks launched below (and train-cnn's) wait for their peers at most
    // LOCKSTEP_TIMEOUT_S, 60 s unless set: a hang must end as an error well inside a GPU lease
    // of a few minutes, not after the 600 s default.
    if std::env::var_os("LOCKSTEP_TIMEOUT_S").is_none() {
        std::env::set_var("LOCKSTEP_TIMEOUT_S", "60");
    }
    gpu::driver_or_skip();
    let tf32 = gpu::tf32_unless_disabled();
    let dir = synthetic_dir(2048, 512);
    let mut r = gpu::Runner::new();
    // Child processes first (this process has not initialised CUDA yet; they are exec'd anyway).
    for nprocs in [1, 2] {
        r.run(&format!("train_cnn_device_cuda_{nprocs}_ranks"), || {
            let out = std::process::Command::new(train_cnn_path())
                .args([
                    "--device",
                    "cuda",
                    "--nprocs",
                    &nprocs.to_string(),
                    "--epochs",
                    "2",
                    "--data",
                ])
                .arg(&dir)
                .output()
                .map_err(|e| e.to_string())?;
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            println!(
                "{}",
                text.lines()
                    .map(|l| format!("    {l}"))
                    .collect::<Vec<_>>()
                    .join("\n")
            );
            if !out.status.success() {
                return Err(format!("train-cnn failed ({}):\n{text}", out.status));
            }
            let acc: f64 = text
                .lines()
                .filter_map(|l| {
                    l.split("test acc ")
                        .nth(1)?
                        .split_whitespace()
                        .next()?
                        .parse()
                        .ok()
                })
                .next_back()
                .ok_or("no accuracy line")?;
            // Same bar as tests/train_dist.rs for the CPU engine: far above chance (10 %).
            if acc < 50.0 {
                return Err(format!(
                    "test accuracy {acc} % after 2 epochs on the synthetic set (expected > 50 %)"
                ));
            }
            Ok(())
        });
    }
    let ctx = gpu::context_or_skip();
    println!(
        "  device: {:?}; TF32 {}",
        ctx.info().map(|i| i.name).unwrap_or_default(),
        if tf32 { "on" } else { "off" }
    );
    let train = data::load_split(&dir, true).unwrap();
    let mut model = Model::fashion_cnn(64).unwrap();
    model.init(42);
    let idx: Vec<usize> = (0..train.len()).rev().collect();

    r.run("twenty_steps_match_cpu_engine_fp32", || {
        let want = reference::cpu_engine_run(&model, &train, &idx, 64, 20, None).0;
        let (got, ms, _) = gpu_losses(&ctx, &model, &train, &idx, 64, 20, Precision::Fp32, true)?;
        println!("    gpu {ms:.3} ms/step (with a loss read-back per step); losses {got:?}");
        let tol = if tf32 {
            Tol::new(5e-2, 5e-2)
        } else {
            Tol::new(1e-3, 5e-3)
        };
        assert_close("fp32 losses, GPU vs CPU engine", &got, &want, tol)
    });

    r.run("bf16_steps_agree_then_learn", || {
        let want = reference::cpu_engine_run(&model, &train, &idx, 64, 20, None).0;
        let (got, _, _) = gpu_losses(&ctx, &model, &train, &idx, 64, 20, Precision::Bf16, true)?;
        assert_close(
            "bf16 losses, first 2 steps",
            &got[..2],
            &want[..2],
            Tol::new(2e-2, 5e-2),
        )?;
        let tail = |v: &[f32]| v[15..].iter().sum::<f32>() / 5.0;
        if !(got.iter().all(|l| l.is_finite())
            && tail(&got) < 0.5 * got[0] + 0.5 * tail(&want).max(0.0))
        {
            return Err(format!(
                "bf16 does not learn like fp32: bf16 {got:?}\ncpu {want:?}"
            ));
        }
        Ok(())
    });

    // Bit-identical: the same steps give the same bits, replayed from a graph or launched one
    // by one, and run after run (fp32 and bf16).
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let same = |what: &str,
                a: &(Vec<f32>, f64, Vec<f32>),
                b: &(Vec<f32>, f64, Vec<f32>)|
     -> Result<(), String> {
        if bits(&a.0) != bits(&b.0) {
            return Err(format!(
                "{what}: losses differ in their bits:\n{:?}\n{:?}",
                a.0, b.0
            ));
        }
        match a
            .2
            .iter()
            .zip(&b.2)
            .position(|(x, y)| x.to_bits() != y.to_bits())
        {
            Some(i) => Err(format!(
                "{what}: parameter {i} differs: {:e} vs {:e}",
                a.2[i], b.2[i]
            )),
            None => Ok(()),
        }
    };
    r.run("graph_replay_matches_plain_launches_bitwise", || {
        let a = gpu_losses(&ctx, &model, &train, &idx, 64, 5, Precision::Fp32, true)?;
        let b = gpu_losses(&ctx, &model, &train, &idx, 64, 5, Precision::Fp32, false)?;
        same("graph vs plain", &a, &b)
    });
    r.run("two_runs_are_bit_identical", || {
        for precision in [Precision::Fp32, Precision::Bf16] {
            let a = gpu_losses(&ctx, &model, &train, &idx, 64, 8, precision, true)?;
            let b = gpu_losses(&ctx, &model, &train, &idx, 64, 8, precision, true)?;
            same(&format!("{precision:?}, run 1 vs run 2"), &a, &b)?;
        }
        Ok(())
    });

    r.run("train_device_epoch_with_partial_batch", || {
        let test = data::load_split(&dir, false).map_err(|e| e.to_string())?;
        let mut small = train.clone();
        small.truncate(1000); // 15 full batches and one of 40
        let cfg = TrainConfig {
            epochs: 2,
            batch_size: 64,
            ..Default::default()
        };
        let out = lockstep_train::device::train_device(
            &cfg,
            &DeviceOptions {
                loss_every: 4,
                ..Default::default()
            },
            &small,
            &test,
            |len| Ok(GpuExec::new(&ctx, len, true)?),
            None,
            &mut Silent,
        )
        .map_err(|e| e.to_string())?;
        let last = out.reports.last().ok_or("no report")?;
        println!("    {last:?}");
        if last.test_count != 512
            || last.test_acc < 50.0
            || last.train_loss >= out.reports[0].train_loss
        {
            return Err(format!("unexpected reports {:?}", out.reports));
        }
        Ok(())
    });
    let _ = std::fs::remove_dir_all(&dir);
    gpu::finish(r);
}
