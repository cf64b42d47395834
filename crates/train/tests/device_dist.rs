//! The device engine's data-parallel path without a GPU: `train_device` on 2 forked ranks with
//! the CPU-twin executor and the shared-memory communicator. Exercises the gradient average, the
//! BatchNorm-state broadcast and the metric sums exactly as a GPU run sequences them (the GPU
//! executor routes the same calls to NCCL or the staged backend). Replicas must stay identical.
//! Also: the initial broadcast from rank 0, the per-epoch checkpoint and `--resume` (which
//! `train-cnn --device cuda` runs through the same `train_device`), in fp16 with the loss
//! scaler's state carried through the checkpoint.
//! `harness = false`: the launcher forks, which must not happen from a multi-threaded harness.

#[path = "../../../tests/common/mod.rs"]
mod common;
#[path = "common/train.rs"]
mod train;

use lockstep::comm::Communicator;
use lockstep::launch::{launch, LaunchConfig, RankContext};
use lockstep_train::data::{self, Dataset};
use lockstep_train::device::{train_device, CpuExec, DeviceError, DeviceOptions};
use lockstep_train::trainer::{EpochReport, Observer, Silent, TrainConfig, TrainOutcome};

/// `n_train` and `n_test` synthetic samples (generator seed `seed`), written to `dir` and read
/// back as the train and test sets.
fn synthetic(
    dir: &std::path::Path,
    n_train: usize,
    n_test: usize,
    seed: u64,
) -> Result<(Dataset, Dataset), String> {
    data::write_synthetic(dir, n_train, n_test, seed).map_err(|e| e.to_string())?;
    let train = data::load_split(dir, true).map_err(|e| e.to_string())?;
    let test = data::load_split(dir, false).map_err(|e| e.to_string())?;
    Ok((train, test))
}

/// `train_device` on the CPU-twin executor: the device engine's whole sequence without a GPU.
fn on_twins(
    cfg: &TrainConfig,
    opts: &DeviceOptions,
    (train, test): (&Dataset, &Dataset),
    comm: Option<&mut Communicator>,
    obs: &mut dyn Observer,
) -> Result<TrainOutcome, DeviceError> {
    train_device(
        cfg,
        opts,
        train,
        test,
        |len| Ok(CpuExec::new(len)),
        comm,
        obs,
    )
}

/// `train_device` on 2 forked ranks with the CPU twins and the shared-memory communicator:
/// `setup` gives each rank (by its index) its config and options, `each` maps the rank's outcome
/// to what the test compares (rank order).
fn on_two_ranks<R>(
    data: (&Dataset, &Dataset),
    setup: impl FnOnce(usize) -> Result<(TrainConfig, DeviceOptions), String>,
    each: impl FnOnce(TrainOutcome) -> R,
) -> Result<Vec<R>, String>
where
    R: serde::Serialize + serde::de::DeserializeOwned,
{
    launch(&LaunchConfig::new(2), |mut ctx: RankContext| {
        let (cfg, opts) = setup(ctx.rank)?;
        let out = on_twins(&cfg, &opts, data, Some(&mut ctx.comm), &mut Silent)?;
        Ok(each(out))
    })
    .map_err(|e| e.to_string())
}

/// `epochs` epochs in batches of `batch_size`, everything else the default.
fn config(epochs: u64, batch_size: usize) -> TrainConfig {
    TrainConfig {
        epochs,
        batch_size,
        ..Default::default()
    }
}

/// The default device options with the loss read back every `loss_every` steps.
fn loss_every(loss_every: usize) -> DeviceOptions {
    DeviceOptions {
        loss_every,
        ..Default::default()
    }
}

/// fp16 with a loss scaler that starts at `start` (factors 2 and 0.5) and grows after
/// `growth_interval` clean steps; the loss is read back every step.
fn fp16_opts(start: f32, growth_interval: u32) -> Result<DeviceOptions, String> {
    Ok(DeviceOptions {
        loss_every: 1,
        precision: lockstep_train::device::Precision::Fp16,
        loss_scaler: lockstep_train::precision::LossScaler::new(start, 2.0, 0.5, growth_interval)
            .map_err(|e| e.to_string())?,
    })
}

fn two_ranks_stay_identical() -> Result<(), String> {
    let (train, test) = synthetic(&common::scratch("device-dist"), 30, 11, 3)?;
    // 30 images over 2 ranks, batch 4: 15 per rank = 3 full steps and one of 3.
    let setup = |_| Ok((config(1, 4), loss_every(2)));
    let out = on_two_ranks((&train, &test), setup, |out| {
        let r = &out.reports[0];
        (
            train::checksum(&out.params),
            r.test_count,
            r.train_loss,
            r.steps as u64,
        )
    })?;
    let (a, b) = (out[0], out[1]);
    common::check(
        a.0 == b.0,
        "parameters identical on both ranks",
        format!("checksums {} vs {}", a.0, b.0),
    )?;
    common::check(
        a.1 == 11 && b.1 == 11,
        "each test image counted once over the ranks",
        format!("{a:?} {b:?}"),
    )?;
    common::check(
        a.2 == b.2 && a.2.is_finite(),
        "the same mean training loss on both ranks",
        format!("{} vs {}", a.2, b.2),
    )?;
    common::check(
        a.3 == 4,
        "4 steps per rank (15 images, batch 4)",
        format!("{a:?}"),
    )
}

/// Ranks that initialise differently (another seed each) still train identical replicas: rank
/// 0's parameters and BatchNorm statistics are broadcast before the first step.
fn initial_weights_come_from_rank_0() -> Result<(), String> {
    let (train, test) = synthetic(&common::scratch("device-dist-bcast"), 16, 4, 5)?;
    let setup = |rank: usize| {
        let seed = 7 + rank as u64;
        Ok((
            TrainConfig {
                seed,
                ..config(1, 4)
            },
            loss_every(1),
        ))
    };
    let out = on_two_ranks((&train, &test), setup, |out| {
        out.params
            .iter()
            .map(|p| p.to_bits() as u64)
            .fold(0u64, |h, b| h.wrapping_mul(1_000_003).wrapping_add(b))
    })?;
    common::check(
        out[0] == out[1],
        "parameters identical on both ranks although their seeds differ",
        format!("hashes {out:?}"),
    )
}

/// Checks after each epoch that the checkpoint on disk is that epoch's (saved every epoch, not
/// only at the end).
struct SavedEachEpoch {
    path: std::path::PathBuf,
    seen: Vec<u64>,
}

impl Observer for SavedEachEpoch {
    fn epoch_end(&mut self, _report: &EpochReport) {
        let mut model = lockstep_train::model::Model::fashion_cnn(1).unwrap();
        let mut opt = lockstep_train::ops::optim::Adam::new(model.num_params(), 0.005);
        if let Ok(res) = lockstep_train::checkpoint::resume(&self.path, &mut model, &mut opt) {
            self.seen.push(res.state.epoch);
        }
    }
}

/// `--save` writes after every epoch; `--resume` from epoch 1's file then continues to exactly
/// the parameters of an uninterrupted run (the twins are deterministic, the checkpoint holds
/// parameters, Adam moments and step, and BatchNorm statistics exactly).
fn save_every_epoch_and_resume_bit_identically() -> Result<(), String> {
    let dir = common::scratch("device-resume");
    let (train, test) = synthetic(&dir, 20, 4, 9)?;
    let opts = loss_every(2);
    let e = |e: DeviceError| e.to_string();
    let run = |cfg: &TrainConfig, obs: &mut dyn Observer| {
        on_twins(cfg, &opts, (&train, &test), None, obs)
    };
    let full = dir.join("full.safetensors");
    let mut obs = SavedEachEpoch {
        path: full.clone(),
        seen: Vec::new(),
    };
    let save_full = TrainConfig {
        save: Some(full.clone()),
        ..config(2, 8)
    };
    let straight = run(&save_full, &mut obs).map_err(e)?;
    common::check(
        obs.seen == [1, 2],
        "a checkpoint of epoch 1, then of epoch 2, on disk as each epoch ends",
        format!("{:?}", obs.seen),
    )?;
    let half = dir.join("half.safetensors");
    let (save_half, resume_half) = train::save_then_resume(&config(2, 8), &half);
    run(&save_half, &mut Silent).map_err(e)?;
    let resumed = run(&resume_half, &mut Silent).map_err(e)?;
    let _ = std::fs::remove_dir_all(&dir);
    common::check(
        resumed.reports.len() == 1 && resumed.reports[0].epoch == 2,
        "the resumed run trains epoch 2 only",
        format!("{:?}", resumed.reports),
    )?;
    let differ = straight
        .params
        .iter()
        .zip(&resumed.params)
        .position(|(a, b)| a.to_bits() != b.to_bits());
    common::check(
        differ.is_none(),
        "resumed parameters bit-identical to the uninterrupted run",
        format!("first difference at {differ:?}"),
    )?;
    common::check(
        straight.reports[1].train_loss == resumed.reports[0].train_loss,
        "the same epoch-2 training loss",
        format!(
            "{} vs {}",
            straight.reports[1].train_loss, resumed.reports[0].train_loss
        ),
    )
}

/// fp16 with dynamic loss scaling on 2 ranks: a starting scale of 2^26 overflows (fp16 tops out at 65504), and both ranks
/// must skip the same steps (one verdict on the all-reduced gradients), halve the scale the same
/// number of times and end with bit-identical parameters.
fn fp16_ranks_agree_on_skips() -> Result<(), String> {
    let (train, test) = synthetic(&common::scratch("device-dist-fp16"), 48, 11, 3)?;
    // 48 images over 2 ranks, batch 4: 6 steps per rank per epoch, 2 epochs.
    let setup = |_| Ok((config(2, 4), fp16_opts(2f32.powi(26), 2000)?));
    let out = on_two_ranks((&train, &test), setup, |out| {
        let bits: Vec<u32> = out.params.iter().map(|p| p.to_bits()).collect();
        let skipped: Vec<u64> = out.reports.iter().map(|r| r.skipped_steps).collect();
        let scales: Vec<Option<f32>> = out.reports.iter().map(|r| r.loss_scale).collect();
        let finite = out.params.iter().all(|p| p.is_finite());
        (bits, skipped, scales, finite)
    })?;
    let (a, b) = (&out[0], &out[1]);
    let differ = a.0.iter().zip(&b.0).filter(|(x, y)| x != y).count();
    common::check(
        differ == 0,
        "fp16 parameters bit-identical on both ranks",
        format!("{differ} of {} differ", a.0.len()),
    )?;
    common::check(
        a.1 == b.1 && a.2 == b.2,
        "the same skipped steps and loss scale on both ranks",
        format!("{:?} {:?} vs {:?} {:?}", a.1, a.2, b.1, b.2),
    )?;
    let total: u64 = a.1.iter().sum();
    common::check(
        total > 0 && total < 12,
        "2^26 overflows at first, then steps apply",
        format!("skipped per epoch {:?} of 6 steps each", a.1),
    )?;
    common::check(
        a.2.last()
            .copied()
            .flatten()
            .is_some_and(|s| s < 2f32.powi(26)),
        "the scale came down",
        format!("{:?}", a.2),
    )?;
    common::check(
        a.3,
        "finite parameters after the skipped steps",
        "a parameter is inf or NaN",
    )
}

/// Parameters and BatchNorm buffers, Adam's first and second moments (as bits), and the
/// training state of a checkpoint.
type CheckpointBits = (
    Vec<u32>,
    Vec<u32>,
    Vec<u32>,
    lockstep_train::checkpoint::TrainState,
);

/// Everything a checkpoint holds, as bits: parameters and BatchNorm buffers, Adam moments, and
/// the training state (step, epoch, loss scaler).
fn checkpoint_bits(path: &std::path::Path) -> Result<CheckpointBits, String> {
    let mut model = lockstep_train::model::Model::fashion_cnn(1).map_err(|e| e.to_string())?;
    let mut opt = lockstep_train::ops::optim::Adam::new(model.num_params(), 0.005);
    let r = lockstep_train::checkpoint::resume(path, &mut model, &mut opt)
        .map_err(|e| e.to_string())?;
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let mut params = bits(&model.params);
    for s in model.state_mut() {
        if let lockstep_train::model::StateMut::F32(_, v) = s {
            params.extend(bits(v));
        }
    }
    Ok((params, bits(&opt.m), bits(&opt.v), r.state))
}

/// fp16 `--save` / `--resume` on 2 ranks: the checkpoint carries the loss scaler (scale, growth
/// count, skipped steps), so a run resumed after epoch 1 continues exactly as the uninterrupted
/// run: the same skips and scales in epoch 2 and, at the end, bit-identical parameters, Adam
/// moments and scaler state. A starting scale of 2^20 overflows and a growth interval of 3 makes
/// the scale move both ways: epoch 1 ends at 2^17 with 2 of the 3 clean steps of a growth
/// counted, so a resume that restarted the scaler (at 2^20, count 0), or restored only its
/// scale, would skip or grow at other steps and end elsewhere.
fn fp16_resume_continues_the_loss_scaler_bit_identically() -> Result<(), String> {
    const START: f32 = (1u32 << 20) as f32;
    let dir = common::scratch("device-resume-fp16");
    let (train, test) = synthetic(&dir, 48, 11, 3)?;
    let run = |cfg: TrainConfig| {
        on_two_ranks(
            (&train, &test),
            |_| Ok((cfg, fp16_opts(START, 3)?)),
            |out| {
                let bits: Vec<u32> = out.params.iter().map(|p| p.to_bits()).collect();
                let per_epoch: Vec<(u64, Option<f32>)> = out
                    .reports
                    .iter()
                    .map(|r| (r.skipped_steps, r.loss_scale))
                    .collect();
                (bits, per_epoch)
            },
        )
    };
    // 48 images over 2 ranks, batch 4: 6 steps per rank per epoch.
    let base = config(2, 4);
    let (full, half, resumed_path) = (
        dir.join("full.safetensors"),
        dir.join("half.safetensors"),
        dir.join("resumed.safetensors"),
    );
    let straight = run(TrainConfig {
        save: Some(full.clone()),
        ..base.clone()
    })?;
    run(TrainConfig {
        epochs: 1,
        save: Some(half.clone()),
        ..base.clone()
    })?;
    let saved = checkpoint_bits(&half)?.3;
    let resumed = run(TrainConfig {
        resume: Some(half),
        save: Some(resumed_path.clone()),
        ..base.clone()
    })?;
    let (a, b) = (checkpoint_bits(&full)?, checkpoint_bits(&resumed_path)?);
    let _ = std::fs::remove_dir_all(&dir);
    let sc = saved
        .loss_scaler
        .ok_or("the fp16 checkpoint holds no loss-scaler state")?;
    common::check(
        sc.skipped > 0 && sc.scale != START && sc.good_steps > 0 && sc.growth_interval == 3,
        "epoch 1 skipped steps, moved the scale and counted clean steps (so restoring them matters)",
        format!("{sc:?}"),
    )?;
    let (s, r) = (&straight[0], &resumed[0]);
    common::check(
        resumed[0].0 == resumed[1].0 && straight[0].0 == straight[1].0,
        "replicas identical in both runs",
        "the ranks differ",
    )?;
    common::check(
        r.1.len() == 1 && r.1[0] == s.1[1],
        "epoch 2 of the resumed run skips the same steps and ends at the same scale",
        format!("straight {:?}, resumed {:?}", s.1, r.1),
    )?;
    let differ = s.0.iter().zip(&r.0).filter(|(x, y)| x != y).count();
    common::check(
        differ == 0,
        "resumed parameters bit-identical to the uninterrupted run",
        format!("{differ} differ"),
    )?;
    common::check(
        a.0 == b.0 && a.1 == b.1 && a.2 == b.2,
        "final checkpoints: parameters, BatchNorm statistics and Adam moments bit-identical",
        "they differ",
    )?;
    common::check(
        a.3.step == b.3.step && a.3.loss_scaler == b.3.loss_scaler && a.3.loss_scaler.is_some(),
        "final checkpoints: the same optimizer step and loss-scaler state (scale, growth count, skipped steps)",
        format!("{:?} vs {:?}", a.3, b.3),
    )
}

/// An fp32 checkpoint (or one written before the scaler was stored) still resumes an fp16 run:
/// with a fresh scaler (the configured one), which at 2^26 overflows again in the resumed epoch.
fn fp16_resume_from_a_checkpoint_without_scaler_state() -> Result<(), String> {
    let dir = common::scratch("device-resume-noscaler");
    let (train, test) = synthetic(&dir, 24, 4, 9)?;
    let e = |e: DeviceError| e.to_string();
    let ck = dir.join("fp32.safetensors");
    let (save, resume) = train::save_then_resume(&config(2, 4), &ck);
    let data = (&train, &test);
    on_twins(&save, &DeviceOptions::default(), data, None, &mut Silent).map_err(e)?;
    let saved = checkpoint_bits(&ck)?.3;
    let opts = fp16_opts(2f32.powi(26), 2000)?;
    let out = on_twins(&resume, &opts, data, None, &mut Silent).map_err(e)?;
    let _ = std::fs::remove_dir_all(&dir);
    common::check(
        saved.loss_scaler.is_none(),
        "an fp32 checkpoint stores no loss scaler",
        format!("{saved:?}"),
    )?;
    let r = &out.reports;
    common::check(
        r.len() == 1 && r[0].epoch == 2 && r[0].skipped_steps > 0 && r[0].loss_scale.is_some_and(|s| s < 2f32.powi(26)),
        "the resumed epoch starts from the configured scaler (2^26 overflows, the scale comes down)",
        format!("{r:?}"),
    )?;
    common::check(
        out.params.iter().all(|p| p.is_finite()),
        "finite parameters",
        "a parameter is inf or NaN",
    )
}

fn main() -> std::process::ExitCode {
    common::run(&[
        ("two_ranks_stay_identical", two_ranks_stay_identical),
        (
            "initial_weights_come_from_rank_0",
            initial_weights_come_from_rank_0,
        ),
        (
            "save_every_epoch_and_resume_bit_identically",
            save_every_epoch_and_resume_bit_identically,
        ),
        ("fp16_ranks_agree_on_skips", fp16_ranks_agree_on_skips),
        (
            "fp16_resume_continues_the_loss_scaler_bit_identically",
            fp16_resume_continues_the_loss_scaler_bit_identically,
        ),
        (
            "fp16_resume_from_a_checkpoint_without_scaler_state",
            fp16_resume_from_a_checkpoint_without_scaler_state,
        ),
    ])
}
