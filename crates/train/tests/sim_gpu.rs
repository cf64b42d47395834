//! The GPU code paths without a GPU: the real `kernels/*.cu` compiled as host C++ under the SIMT
//! shim (`tests/simt`), launched by name through the simulated driver (`tests/fake/sim_cuda.c`)
//! and NVRTC (`tests/fake/sim_nvrtc.c`), as built by `tests/common/simt.rs`. Checks:
//!
//! - `shim_semantics` (and `_concurrent`, blocks on 2 OS threads in a shuffled order): the shim's
//!   own self-test kernels (`tests/simt/selftest.cu`): shuffles of every kind and width against
//!   CUDA's documented formulas, ballots, half warps shuffling and voting over disjoint masks at
//!   once, atomics, barriers with returned threads, per-block shared memory; and misuse (a deadlock, a shuffle over returned lanes, `__trap`) failing the
//!   launch with the reason;
//! - `kernel_trap_fails_the_launch`: `linear_forward_f32`'s own `__trap` (fused ReLU with split-K);
//! - `steps_match_cpu_engine_{fp32,tf32,bf16}`: the device engine's whole training step (captured
//!   as a graph on the first step, replayed after) for 4 steps at batch 32 against the CPU
//!   engine from the same initialisation; per-step losses within fp32 1e-3 / 5e-3 (as
//!   tests/gpu_train.rs: summation order differs), TF32 5e-2 / 5e-2, bf16 first 2 steps
//!   2e-2 / 5e-2 and finite after;
//! - `steps_match_cpu_engine_fp16`: the same for fp16 with loss scaling (first 2 steps
//!   2e-2 / 5e-2, as bf16; fp16 keeps more mantissa bits);
//! - `steps_match_cpu_engine_fp32_clipping` (threshold 0.05, clips most steps),
//!   `..._fp32_clipping_idle` (1e6, never clips: parameters bit-identical to no clipping) and
//!   `..._fp16_clipping`: the step with `--clip-grad-norm` against the CPU engine clipping alike,
//!   same tolerances as above;
//! - `fp16_overflow_skips_then_trains`: a loss scale of 2^40 makes the first steps overflow: each
//!   is skipped with the parameters bit-unchanged and the scale halved, then steps apply (each
//!   applied one changing the parameters, the scale kept), all in one captured graph;
//! - `train_cnn_fp16_end_to_end`: `train-cnn --device cuda --precision fp16` learns (> 25 %) and
//!   reports `skipped_steps` and `loss_scale` in its JSON epoch line;
//! - `graph_replay_is_bit_identical_to_plain_launches`: 3 steps with and without graphs give the
//!   same parameters bit for bit (the shim runs deterministically);
//! - `two_runs_bit_identical_under_shuffled_blocks`: two runs of 2 steps with blocks on 2 OS
//!   threads in differently shuffled orders (`LOCKSTEP_SIMT_SHUFFLE`, `LOCKSTEP_SIMT_WORKERS`)
//!   give the same parameters bit for bit. This holds only if no kernel's result depends on the
//!   order of its floating-point atomics, which split-K weight gradients with `atomicAdd` violate;
//! - `train_cnn_end_to_end`: `train-cnn --device cuda --limit-train 512 --epochs 1` (2 ranks,
//!   FashionMNIST when installed, with its test set cut to 500 images to keep the run short;
//!   else a synthetic set) reaches a test accuracy far above chance (> 25 %; 10 % is chance,
//!   the CPU engine gets about 33 % from these 4 steps per rank) and within 8 points of the same
//!   run with `--device cpu`;
//! - `train_cnn_clip_end_to_end`: the same with `--clip-grad-norm 1.0` on both devices.
//!
//! Every check runs in its own process (the driver and NVRTC are chosen once per process).

#[path = "../../../tests/common/close.rs"]
mod close;
#[path = "common/reference.rs"]
mod reference;
#[path = "../../../tests/common/runner.rs"]
mod runner;
#[path = "common/simt.rs"]
mod simt;

use std::path::{Path, PathBuf};
use std::process::Command;

use close::{assert_close, Tol};
use lockstep::cuda::{Context, DeviceBuffer, KernelGrid};
use lockstep_train::data::{self, Dataset};
use lockstep_train::device::{plan, DeviceError, Engine, GpuExec, Precision};
use lockstep_train::model::Model;

use reference::LR;

fn synthetic(tag: &str, n_train: usize, n_test: usize) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lockstep-sim-gpu-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    data::write_synthetic(&dir, n_train, n_test, 5).unwrap();
    dir
}

/// A device engine on the simulated GPU for `steps` batches of `b` synthetic images (`tag` names
/// their folder), initialised as the CPU reference is (seed 42), with `configure` applied before
/// the data is uploaded and the index list set to the data's order.
fn sim_engine(
    ctx: &std::sync::Arc<Context>,
    (tag, b, steps): (&str, usize, usize),
    precision: Precision,
    graphs: bool,
    configure: impl FnOnce(&mut Engine<GpuExec>) -> Result<(), DeviceError>,
) -> Result<Engine<GpuExec>, String> {
    let dir = synthetic(tag, b * steps, 16);
    let train = data::load_split(&dir, true).map_err(|e| e.to_string())?;
    let _ = std::fs::remove_dir_all(&dir);
    let mut model = Model::fashion_cnn(b).unwrap();
    model.init(42);
    let e = |e: DeviceError| e.to_string();
    let t = plan::Tensors::new(&model, b, precision).map_err(e)?;
    let exec = GpuExec::new(ctx, t.arena_len, graphs).map_err(|e| e.to_string())?;
    let mut eng = Engine::new(exec, &model, b, precision).map_err(e)?;
    configure(&mut eng).map_err(e)?;
    let rows_only = Dataset {
        rows: 28,
        cols: 28,
        ..Default::default()
    };
    eng.upload_dataset(&train, &rows_only).map_err(e)?;
    let idx: Vec<usize> = (0..train.len()).collect();
    eng.set_index_list(&idx, false).map_err(e)?;
    Ok(eng)
}

/// `steps` device-engine steps, clipping the gradient norm to `clip` when given: the losses and
/// the final parameters.
fn device_run(
    ctx: &std::sync::Arc<Context>,
    b: usize,
    steps: usize,
    precision: Precision,
    graphs: bool,
    clip: Option<f32>,
) -> Result<(Vec<f32>, Vec<f32>), String> {
    let mut eng = sim_engine(ctx, ("steps", b, steps), precision, graphs, |eng| {
        eng.set_clip_grad_norm(clip)
    })?;
    let e = |e: DeviceError| e.to_string();
    let mut losses = Vec::new();
    for s in 0..steps {
        eng.train_step(s * b, b, LR, None).map_err(e)?;
        losses.push(eng.last_loss().map_err(e)?);
    }
    eng.check_grad_norm().map_err(e)?;
    if graphs && eng.exec.graph_count() != 1 {
        return Err(format!(
            "expected one captured graph (captured once, then replayed), found {}",
            eng.exec.graph_count()
        ));
    }
    Ok((losses, eng.params().map_err(e)?))
}

fn steps_match_cpu(precision: Precision, tol: Tol, compared: usize) -> Result<(), String> {
    steps_match_cpu_clipped(precision, tol, compared, None)
}

/// The device step against the CPU engine, both clipping the gradient norm to `clip` when given.
/// A threshold below 1 must clip most steps (the CPU engine's norms say so) and change the
/// device's parameters; one above the norms must leave them bit-identical to no clipping.
fn steps_match_cpu_clipped(
    precision: Precision,
    tol: Tol,
    compared: usize,
    clip: Option<f32>,
) -> Result<(), String> {
    let (b, steps) = (32, 4);
    let ctx = Context::new(0).map_err(|e| e.to_string())?;
    let (got, params) = device_run(&ctx, b, steps, precision, true, clip)?;
    let dir = synthetic("cpu", b * steps, 16);
    let train = data::load_split(&dir, true).map_err(|e| e.to_string())?;
    let _ = std::fs::remove_dir_all(&dir);
    let mut model = Model::fashion_cnn(b).unwrap();
    model.init(42);
    let idx: Vec<usize> = (0..train.len()).collect();
    let (want, norms, _) = reference::cpu_engine_run(&model, &train, &idx, b, steps, clip);
    println!(
        "    device losses {got:?}\n    cpu    losses {want:?}\n    cpu gradient norms {norms:?}"
    );
    assert_close(
        "losses, simulated GPU vs CPU engine",
        &got[..compared],
        &want[..compared],
        tol,
    )?;
    if !got.iter().all(|l| l.is_finite()) {
        return Err(format!("non-finite loss: {got:?}"));
    }
    if let Some(c) = clip {
        let (_, unclipped) = device_run(&ctx, b, steps, precision, true, None)?;
        let same = digest(&params) == digest(&unclipped);
        if c < 1.0 && (norms.iter().filter(|&&n| n > c as f64).count() < steps / 2 || same) {
            return Err(format!("clipping to {c} must act on most steps (CPU norms {norms:?}) and change the parameters"));
        }
        if c >= 1.0 && (norms.iter().any(|&n| n >= c as f64) || !same) {
            return Err(format!("clipping to {c} must never act (CPU norms {norms:?}): the parameters must equal an unclipped run's"));
        }
    }
    Ok(())
}

/// FNV-1a of the bits of `v`.
fn digest(v: &[f32]) -> u64 {
    v.iter()
        .flat_map(|x| x.to_bits().to_le_bytes())
        .fold(0xcbf29ce484222325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100000001b3)
        })
}

fn sim_counter_text(name: &str) -> String {
    let path = std::env::var("LOCKSTEP_CUDA_LIBRARY").unwrap();
    let sym = format!("{name}\0");
    // SAFETY: the simulated driver is already loaded by lockstep; the symbol is
    // `const char* name(void)` returning a NUL-terminated static buffer.
    unsafe {
        let lib = libloading::Library::new(&path).unwrap();
        let f = lib
            .get::<unsafe extern "C" fn() -> *const std::ffi::c_char>(sym.as_bytes())
            .unwrap();
        std::ffi::CStr::from_ptr(f()).to_string_lossy().into_owned()
    }
}

/// CUDA's documented result of `__shfl_*_sync` for lane `l` (offering value `v(l)`).
fn shfl_expected(kind: i32, arg: i32, width: i32, tid: i32) -> i32 {
    let (lane, warp) = (tid % 32, tid / 32);
    let v = |l: i32| 1000 * warp + l;
    let base = lane & !(width - 1);
    let src = match kind {
        0 => base + (arg & (width - 1)),
        1 => {
            if lane - base >= arg {
                lane - arg
            } else {
                lane
            }
        }
        2 => {
            if lane - base + arg < width {
                lane + arg
            } else {
                lane
            }
        }
        _ => {
            let s = lane ^ arg;
            if s < base + width {
                s
            } else {
                lane
            }
        }
    };
    v(src)
}

fn shim_semantics() -> Result<(), String> {
    let c = |e: lockstep::cuda::CudaError| e.to_string();
    let ctx = Context::new(0).map_err(c)?;
    let s = ctx.stream().map_err(c)?;
    let f = |name: &str| ctx.function(&simt::SELFTEST, name).map_err(c);
    let grid = |blocks: u32, threads: u32| KernelGrid {
        grid: (blocks, 1, 1),
        block: (threads, 1, 1),
        shared_mem: 0,
    };

    let shfl = f("simt_shfl")?;
    for kind in 0..4 {
        for width in [32, 16, 8, 4, 1] {
            for arg in [0, 1, 3, 5, 16, 31] {
                let mut out = DeviceBuffer::<i32>::zeros(&s, 64).map_err(c)?;
                shfl.launch(grid(1, 64))
                    .arg_mut(&mut out)
                    .scalar(kind)
                    .scalar(arg)
                    .scalar(width)
                    .run(&s)
                    .map_err(c)?;
                let got = out.to_vec(&s).map_err(c)?;
                let want: Vec<i32> = (0..64)
                    .map(|t| shfl_expected(kind, arg, width, t))
                    .collect();
                if got != want {
                    return Err(format!(
                        "shuffle kind {kind} arg {arg} width {width}:\n got {got:?}\nwant {want:?}"
                    ));
                }
            }
        }
    }

    let mut out = DeviceBuffer::<i32>::zeros(&s, 2).map_err(c)?;
    let pattern = 0x5a5a_0ff1u32 as i32;
    f("simt_ballot")?
        .launch(grid(1, 64))
        .arg_mut(&mut out)
        .scalar(pattern)
        .run(&s)
        .map_err(c)?;
    if out.to_vec(&s).map_err(c)? != vec![pattern, pattern] {
        return Err(format!(
            "ballot: {:?}, want {pattern:#x} twice",
            out.to_vec(&s)
        ));
    }

    let mut out = DeviceBuffer::<i32>::zeros(&s, 64).map_err(c)?;
    let mut ballots = DeviceBuffer::<i32>::zeros(&s, 4).map_err(c)?;
    f("simt_shfl_halves")?
        .launch(grid(1, 64))
        .arg_mut(&mut out)
        .arg_mut(&mut ballots)
        .run(&s)
        .map_err(c)?;
    let want: Vec<i32> = (0..64)
        .map(|t| {
            let (lane, warp) = (t % 32, t / 32);
            let src = if lane < 16 {
                lane ^ 1
            } else if lane - 16 + 2 < 16 {
                lane + 2
            } else {
                lane
            };
            1000 * warp + src
        })
        .collect();
    let votes = |lanes: std::ops::Range<u32>| {
        lanes.filter(|l| l % 3 == 0).fold(0u32, |m, l| m | 1 << l) as i32
    };
    let want_ballots = [votes(0..16), votes(16..32), votes(0..16), votes(16..32)];
    if out.to_vec(&s).map_err(c)? != want || ballots.to_vec(&s).map_err(c)? != want_ballots {
        return Err(format!(
            "half-warp operations over disjoint masks: {:?} / ballots {:?}, want {want:?} / {want_ballots:?}",
            out.to_vec(&s),
            ballots.to_vec(&s)
        ));
    }

    let (blocks, threads) = (37u32, 96u32);
    let mut counter = DeviceBuffer::<i32>::zeros(&s, 1).map_err(c)?;
    let mut sum = DeviceBuffer::<f32>::zeros(&s, 1).map_err(c)?;
    let mut maxid = DeviceBuffer::<i32>::zeros(&s, 1).map_err(c)?;
    f("simt_atomics")?
        .launch(grid(blocks, threads))
        .arg_mut(&mut counter)
        .arg_mut(&mut sum)
        .arg_mut(&mut maxid)
        .run(&s)
        .map_err(c)?;
    let n = (blocks * threads) as i32;
    let got = (
        counter.to_vec(&s).map_err(c)?[0],
        sum.to_vec(&s).map_err(c)?[0],
        maxid.to_vec(&s).map_err(c)?[0],
    );
    if got != (n, n as f32 * 0.5, n - 1) {
        return Err(format!(
            "atomics: (count, sum, max) = {got:?}, want ({n}, {}, {})",
            n as f32 * 0.5,
            n - 1
        ));
    }

    let keep = 45;
    let mut out = DeviceBuffer::<i32>::zeros(&s, 128).map_err(c)?;
    f("simt_early_exit")?
        .launch(grid(1, 128))
        .arg_mut(&mut out)
        .scalar(keep)
        .run(&s)
        .map_err(c)?;
    let got = out.to_vec(&s).map_err(c)?;
    let total = (0..keep).sum::<i32>();
    if got[..keep as usize].iter().any(|&v| v != total)
        || got[keep as usize..].iter().any(|&v| v != 0)
    {
        return Err(format!(
            "barrier with {keep} of 128 threads left: {got:?} (want {total} for the first {keep})"
        ));
    }

    let mut out = DeviceBuffer::<i32>::from_host(&s, &[-1; 9]).map_err(c)?;
    f("simt_shared_per_block")?
        .launch(grid(9, 256))
        .arg_mut(&mut out)
        .run(&s)
        .map_err(c)?;
    if out.to_vec(&s).map_err(c)? != vec![0; 9] {
        return Err(format!(
            "shared memory is not per block: wrong elements per block {:?}",
            out.to_vec(&s)
        ));
    }

    let misuse = f("simt_misuse")?;
    for (what, needle) in [(0, "deadlock"), (1, "returned"), (2, "__trap() called")] {
        let mut out = DeviceBuffer::<i32>::zeros(&s, 32).map_err(c)?;
        let e = match misuse
            .launch(grid(2, 32))
            .arg_mut(&mut out)
            .scalar(what)
            .run(&s)
        {
            Ok(()) => return Err(format!("misuse {what} ({needle}) launched fine")),
            Err(e) => e.to_string(),
        };
        let why = sim_counter_text("sim_last_launch_error");
        println!("    misuse {what}: {e}\n      {why}");
        if !e.contains("CUDA_ERROR_LAUNCH_FAILED")
            || !why.contains(needle)
            || !why.contains("simt_misuse")
        {
            return Err(format!("misuse {what}: expected CUDA_ERROR_LAUNCH_FAILED and `{needle}`, got {e:?} / {why:?}"));
        }
    }
    Ok(())
}

fn kernel_trap_fails_the_launch() -> Result<(), String> {
    use lockstep_train::device::kernels::KernelId;
    let c = |e: lockstep::cuda::CudaError| e.to_string();
    let ctx = Context::new(0).map_err(c)?;
    let s = ctx.stream().map_err(c)?;
    let (b, inf, outf) = (4usize, 40usize, 8usize);
    let x = DeviceBuffer::from_host(&s, &vec![0.5f32; b * inf]).map_err(c)?;
    let w = DeviceBuffer::from_host(&s, &vec![0.25f32; outf * inf]).map_err(c)?;
    let bias = DeviceBuffer::from_host(&s, &vec![0.0f32; outf]).map_err(c)?;
    let mut y = DeviceBuffer::<f32>::zeros(&s, b * outf).map_err(c)?;
    let f = ctx
        .function(KernelId::Linear.source(), "linear_forward_f32")
        .map_err(c)?;
    let run = |y: &mut DeviceBuffer<f32>, relu: i32, splits: u32| {
        f.launch(KernelGrid {
            grid: (1, 1, splits),
            block: (128, 1, 1),
            shared_mem: 0,
        })
        .arg_mut(y)
        .arg(&x)
        .arg(&w)
        .arg(&bias)
        .scalar(b as i32)
        .scalar(inf as i32)
        .scalar(outf as i32)
        .scalar(relu)
        .run(&s)
    };
    run(&mut y, 1, 1).map_err(c)?;
    if y.to_vec(&s).map_err(c)? != vec![0.5 * 0.25 * inf as f32; b * outf] {
        return Err(format!("linear forward: {:?}", y.to_vec(&s)));
    }
    let e = run(&mut y, 1, 2)
        .err()
        .ok_or("a fused ReLU with split-K must trap")?
        .to_string();
    let why = sim_counter_text("sim_last_launch_error");
    println!("    {e}\n      {why}");
    if !e.contains("CUDA_ERROR_LAUNCH_FAILED")
        || !why.contains("linear_forward_f32: __trap() called")
    {
        return Err(format!(
            "expected the kernel's __trap as a failed launch, got {e:?} / {why:?}"
        ));
    }
    Ok(())
}

/// Print the digest of the parameters after 2 steps (for `two_runs_bit_identical_...`).
fn params_digest() -> Result<(), String> {
    let ctx = Context::new(0).map_err(|e| e.to_string())?;
    let (losses, params) = device_run(&ctx, 32, 2, Precision::Fp32, true, None)?;
    println!("digest {:016x} losses {losses:?}", digest(&params));
    Ok(())
}

/// Test and training splits cut from FashionMNIST (when installed) or a synthetic set.
fn e2e_data(dir: &Path) -> &'static str {
    std::fs::create_dir_all(dir).unwrap();
    let real = Path::new(data::DEFAULT_DATA_DIR);
    match data::load_splits(real) {
        Ok((train, test)) => {
            for (prefix, d, n) in [("train", &train, 512usize), ("t10k", &test, 500)] {
                let n = n.min(d.len());
                std::fs::write(
                    dir.join(format!("{prefix}-images-idx3-ubyte")),
                    data::encode_idx(&[n, 28, 28], &d.images[..n * 784]),
                )
                .unwrap();
                std::fs::write(
                    dir.join(format!("{prefix}-labels-idx1-ubyte")),
                    data::encode_idx(&[n], &d.labels[..n]),
                )
                .unwrap();
            }
            "FashionMNIST (first 512 training and 500 test images)"
        }
        Err(_) => {
            data::write_synthetic(dir, 512, 500, 11).unwrap();
            "a synthetic set (FashionMNIST not installed: apt-get install dataset-fashion-mnist)"
        }
    }
}

fn test_acc(stdout: &str) -> Option<f64> {
    stdout
        .lines()
        .filter(|l| l.contains("\"test_acc\""))
        .filter_map(|l| {
            l.split("\"test_acc\":")
                .nth(1)?
                .split([',', '}'])
                .next()?
                .trim()
                .parse()
                .ok()
        })
        .next_back()
}

/// `train-cnn` with `extra` flags on both devices (see the module documentation).
/// `train-cnn` on the simulated GPU: one epoch over the first 512 training images of `dir`,
/// JSON lines out, with `args` (device, precision) before the shared ones.
fn train_cnn_one_epoch(sim: &simt::SimGpu, dir: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_train-cnn"));
    cmd.args(args)
        .args(["--limit-train", "512", "--epochs", "1", "--json", "--data"])
        .arg(dir);
    sim.apply(&mut cmd);
    cmd
}

fn train_cnn_end_to_end(sim: &simt::SimGpu, extra: &[&str]) -> Result<(), String> {
    let dir = std::env::temp_dir().join(format!("lockstep-sim-gpu-e2e-{}", std::process::id()));
    let what = e2e_data(&dir);
    let mut accs = Vec::new();
    for device in ["cuda", "cpu"] {
        let mut cmd = train_cnn_one_epoch(sim, &dir, &["--device", device]);
        cmd.args(extra);
        let t = std::time::Instant::now();
        let out = cmd.output().map_err(|e| e.to_string())?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if !out.status.success() {
            return Err(format!(
                "train-cnn --device {device} failed ({}):\n{text}",
                out.status
            ));
        }
        let acc = test_acc(&String::from_utf8_lossy(&out.stdout))
            .ok_or_else(|| format!("no test_acc in the output:\n{text}"))?;
        println!("    train-cnn --device {device} {extra:?} on {what}: test accuracy {acc:.2} % ({:.1} s)", t.elapsed().as_secs_f64());
        accs.push(acc);
    }
    let _ = std::fs::remove_dir_all(&dir);
    let (cuda, cpu) = (accs[0], accs[1]);
    // Chance is 10 %; the two engines compute the same network from the same initialisation, so
    // they land close (TF32 and summation order make the only differences).
    if cuda < 25.0 || (cuda - cpu).abs() > 8.0 {
        return Err(format!("test accuracy {cuda:.2} % on the simulated GPU, {cpu:.2} % on the CPU (want > 25 % and within 8 points)"));
    }
    Ok(())
}

/// fp16 on the simulated GPU with a loss scale of 2^40, captured graph and all: the first steps
/// overflow and are skipped with the parameters bit-unchanged and the scale halving, then
/// training proceeds with the scale the overflows left.
fn fp16_overflow() -> Result<(), String> {
    use lockstep_train::precision::{LossScaler, StepAction};
    let (b, steps) = (16usize, 30usize);
    let ctx = Context::new(0).map_err(|e| e.to_string())?;
    let init = (1u64 << 40) as f32;
    let scaler = LossScaler::new(init, 2.0, 0.5, 2000).map_err(|e| e.to_string())?;
    let mut eng = sim_engine(&ctx, ("fp16", b, steps), Precision::Fp16, true, |eng| {
        eng.set_loss_scaler(scaler)
    })?;
    let e = |e: DeviceError| e.to_string();
    let mut actions = Vec::new();
    for s in 0..steps {
        let before = digest(&eng.params().map_err(e)?);
        let scale = eng.loss_scaler().map(|s| s.scale()).unwrap_or(0.0);
        let a = eng.train_step(s * b, b, LR, None).map_err(e)?;
        let after = digest(&eng.params().map_err(e)?);
        let now = eng.loss_scaler().map(|s| s.scale()).unwrap_or(0.0);
        match a {
            StepAction::Skip if after != before || now != scale / 2.0 => {
                return Err(format!(
                    "step {s}: skipped, yet the parameters changed ({}) or the scale went {scale} -> {now}",
                    after != before
                ))
            }
            StepAction::Apply if after == before || now != scale => {
                return Err(format!(
                    "step {s}: applied, yet the parameters are unchanged ({}) or the scale went {scale} -> {now}",
                    after == before
                ))
            }
            _ => {}
        }
        actions.push(a == StepAction::Skip);
    }
    let skipped = actions.iter().filter(|&&s| s).count();
    println!(
        "    skipped {skipped} of {steps} steps, final scale {:?}, graphs {}",
        eng.loss_scaler().map(|s| s.scale()),
        eng.exec.graph_count()
    );
    // Skips come first; once the scale fits, steps apply (an occasional later overflow is
    // GradScaler's normal behaviour, checked step by step above).
    let first_apply = actions
        .iter()
        .position(|&s| !s)
        .ok_or("every step was skipped")?;
    let applied_after = actions[first_apply..].iter().filter(|&&s| !s).count();
    if first_apply < 10 || applied_after < 5 || eng.step as usize != steps - skipped {
        return Err(format!(
            "expected a run of skips then applied steps: {actions:?}, step count {}",
            eng.step
        ));
    }
    if eng.exec.graph_count() != 1 {
        return Err(format!(
            "the fp16 step must stay one captured graph, found {}",
            eng.exec.graph_count()
        ));
    }
    Ok(())
}

/// `train-cnn --device cuda --precision fp16` (2 ranks) on the simulated GPU learns, and its
/// JSON epoch line reports the skipped steps and the loss scale.
fn train_cnn_fp16_end_to_end(sim: &simt::SimGpu) -> Result<String, String> {
    let dir = std::env::temp_dir().join(format!("lockstep-sim-gpu-e2e16-{}", std::process::id()));
    let what = e2e_data(&dir);
    let mut cmd = train_cnn_one_epoch(sim, &dir, &["--device", "cuda", "--precision", "fp16"]);
    let out = cmd.output().map_err(|e| e.to_string())?;
    let _ = std::fs::remove_dir_all(&dir);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let text = format!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        return Err(format!(
            "train-cnn --precision fp16 failed ({}):\n{text}",
            out.status
        ));
    }
    let acc = test_acc(&stdout).ok_or_else(|| format!("no test_acc in the output:\n{text}"))?;
    let line = stdout
        .lines()
        .find(|l| l.contains("\"test_acc\""))
        .unwrap_or_default();
    if !line.contains("\"skipped_steps\":") || !line.contains("\"loss_scale\":") {
        return Err(format!(
            "the epoch line reports no skipped_steps / loss_scale: {line}"
        ));
    }
    if acc < 25.0 {
        return Err(format!(
            "fp16 on {what}: test accuracy {acc:.2} % (want > 25 %; chance is 10 %)"
        ));
    }
    Ok(format!(
        "    fp16 on {what}: test accuracy {acc:.2} %; {line}\n"
    ))
}

/// A check that runs one scenario in a child process: (check, scenario, its environment).
type OneScenario = (
    &'static str,
    &'static str,
    &'static [(&'static str, &'static str)],
);

/// The environment that builds the kernels without TF32 (for checks with f32 tolerances).
const NO_TF32: (&str, &str) = ("LOCKSTEP_NVRTC_OPTIONS", "-DLOCKSTEP_NO_TF32");

fn scenario(name: &str) -> Result<(), String> {
    match name {
        "shim_semantics" => shim_semantics(),
        "kernel_trap_fails_the_launch" => kernel_trap_fails_the_launch(),
        "steps_fp32" => steps_match_cpu(Precision::Fp32, Tol::new(1e-3, 5e-3), 4),
        "steps_tf32" => steps_match_cpu(Precision::Fp32, Tol::new(5e-2, 5e-2), 4),
        "steps_bf16" => steps_match_cpu(Precision::Bf16, Tol::new(2e-2, 5e-2), 2),
        "steps_fp16" => steps_match_cpu(Precision::Fp16, Tol::new(2e-2, 5e-2), 2),
        "steps_fp32_clip" => {
            steps_match_cpu_clipped(Precision::Fp32, Tol::new(1e-3, 5e-3), 4, Some(0.05))
        }
        "steps_fp32_clip_idle" => {
            steps_match_cpu_clipped(Precision::Fp32, Tol::new(1e-3, 5e-3), 4, Some(1e6))
        }
        "steps_fp16_clip" => {
            steps_match_cpu_clipped(Precision::Fp16, Tol::new(2e-2, 5e-2), 2, Some(0.05))
        }
        "fp16_overflow" => fp16_overflow(),
        "graph_vs_plain" => {
            let ctx = Context::new(0).map_err(|e| e.to_string())?;
            let (la, pa) = device_run(&ctx, 32, 3, Precision::Fp32, true, None)?;
            let (lb, pb) = device_run(&ctx, 32, 3, Precision::Fp32, false, None)?;
            if la
                .iter()
                .map(|x| x.to_bits())
                .ne(lb.iter().map(|x| x.to_bits()))
                || digest(&pa) != digest(&pb)
            {
                let differ = pa
                    .iter()
                    .zip(&pb)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                return Err(format!("graph replay differs from plain launches: losses {la:?} vs {lb:?}; {differ} parameters differ"));
            }
            Ok(())
        }
        "params_digest" => params_digest(),
        other => Err(format!("unknown scenario {other}")),
    }
}

fn main() {
    if let Ok(name) = std::env::var("LOCKSTEP_SIM_SCENARIO") {
        match scenario(&name) {
            Ok(()) => return,
            Err(e) => {
                println!("{e}");
                std::process::exit(1);
            }
        }
    }
    let sim = simt::SimGpu::build();
    let exe = std::env::current_exe().unwrap();
    let run = |name: &str, env: &[(&str, &str)]| -> Result<String, String> {
        let mut cmd = Command::new(&exe);
        sim.apply(&mut cmd);
        cmd.env("LOCKSTEP_SIM_SCENARIO", name)
            .env_remove("LOCKSTEP_NVRTC_OPTIONS");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = cmd.output().map_err(|e| e.to_string())?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if out.status.success() {
            Ok(text)
        } else {
            Err(format!("({}):\n{text}", out.status))
        }
    };
    type Check<'a> = Box<dyn Fn() -> Result<String, String> + 'a>;
    // The checks that are one scenario in a child process.
    let one_scenario: [OneScenario; 12] = [
        ("shim_semantics", "shim_semantics", &[]),
        (
            "shim_semantics_concurrent",
            "shim_semantics",
            &[
                ("LOCKSTEP_SIMT_WORKERS", "2"),
                ("LOCKSTEP_SIMT_SHUFFLE", "7"),
            ],
        ),
        (
            "kernel_trap_fails_the_launch",
            "kernel_trap_fails_the_launch",
            &[],
        ),
        ("steps_match_cpu_engine_fp32", "steps_fp32", &[NO_TF32]),
        ("steps_match_cpu_engine_tf32", "steps_tf32", &[]),
        ("steps_match_cpu_engine_bf16", "steps_bf16", &[NO_TF32]),
        ("steps_match_cpu_engine_fp16", "steps_fp16", &[NO_TF32]),
        (
            "steps_match_cpu_engine_fp32_clipping",
            "steps_fp32_clip",
            &[NO_TF32],
        ),
        (
            "steps_match_cpu_engine_fp32_clipping_idle",
            "steps_fp32_clip_idle",
            &[NO_TF32],
        ),
        (
            "steps_match_cpu_engine_fp16_clipping",
            "steps_fp16_clip",
            &[NO_TF32],
        ),
        (
            "fp16_overflow_skips_then_trains",
            "fp16_overflow",
            &[NO_TF32],
        ),
        (
            "graph_replay_is_bit_identical_to_plain_launches",
            "graph_vs_plain",
            &[NO_TF32],
        ),
    ];
    let mut checks: Vec<(&str, Check)> = one_scenario
        .into_iter()
        .map(|(check, name, env)| (check, Box::new(move || run(name, env)) as Check))
        .collect();
    checks.extend::<[(&str, Check); 4]>([
        (
            "two_runs_bit_identical_under_shuffled_blocks",
            Box::new(|| {
                let mut digests = Vec::new();
                for seed in ["1", "2"] {
                    let out = run(
                        "params_digest",
                        &[
                            NO_TF32,
                            ("LOCKSTEP_SIMT_WORKERS", "2"),
                            ("LOCKSTEP_SIMT_SHUFFLE", seed),
                        ],
                    )?;
                    let line = out
                        .lines()
                        .find(|l| l.starts_with("digest "))
                        .ok_or_else(|| format!("no digest line:\n{out}"))?
                        .to_string();
                    digests.push(line);
                }
                if digests[0] != digests[1] {
                    return Err(format!(
                        "two runs of the device step differ (blocks in different orders on 2 OS threads):\n  {}\n  {}\n\
a kernel's result depends on the order of its floating-point atomics (split-K with atomicAdd?)",
                        digests[0], digests[1]
                    ));
                }
                Ok(digests.join("\n"))
            }),
        ),
        (
            "train_cnn_end_to_end",
            Box::new(|| train_cnn_end_to_end(&sim, &[]).map(|()| String::new())),
        ),
        (
            "train_cnn_clip_end_to_end",
            Box::new(|| {
                train_cnn_end_to_end(&sim, &["--clip-grad-norm", "1.0"]).map(|()| String::new())
            }),
        ),
        (
            "train_cnn_fp16_end_to_end",
            Box::new(|| train_cnn_fp16_end_to_end(&sim)),
        ),
    ]);
    let mut r = runner::Runner::new();
    for (name, check) in &checks {
        r.run(name, || {
            let text = check()?;
            if std::env::var_os("LOCKSTEP_SIM_VERBOSE").is_some() {
                print!("{text}");
            }
            Ok(())
        });
    }
    if r.finish() != std::process::ExitCode::SUCCESS {
        std::process::exit(1);
    }
}
