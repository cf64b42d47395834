//! The epoch loop, written once for both engines: the batches of this rank's shard, the
//! observers, the end-of-epoch metrics (loss and accuracy summed over ranks), evaluation on the
//! test shard, the per-epoch checkpoint, and the resume that starts a run part-way. What differs
//! between the CPU trainer and the device engine (how a step computes, how ranks exchange values)
//! is the [`EpochEngine`] each implements.

use std::path::Path;
use std::time::Instant;

use super::config::{EpochReport, Observer, TrainConfig, TrainError};
use crate::checkpoint::{self, ScalerState, TrainState};
use crate::data::Dataset;
use crate::model::Model;
use crate::ops::optim::Adam;
use crate::sampler::DistributedSampler;

/// One engine's half of the epoch loop ([`run`]).
pub(crate) trait EpochEngine {
    /// The engine's error (the loop adds none of its own).
    type Error;
    /// This rank and the world size.
    fn rank_world(&self) -> (usize, usize);
    /// Epoch `epoch` (0-based) over this rank's sample ids `idx` begins.
    fn start_epoch(&mut self, epoch: u64, idx: &[usize]) -> Result<(), Self::Error>;
    /// Optimizer step `s` (0-based) over the micro-batches `group` (sample ids), whose first
    /// sample is at position `start` of the epoch's list. Returns the loss to show for it, or
    /// `None` when there is nothing new to show yet.
    fn train_step(
        &mut self,
        s: usize,
        start: usize,
        group: &[&[usize]],
    ) -> Result<Option<f32>, Self::Error>;
    /// After the epoch's last step: this rank's training loss summed over its samples.
    fn finish_steps(&mut self) -> Result<f64, Self::Error>;
    /// Sum `v` over the ranks in place (nothing to do alone).
    fn sum_over_ranks(&mut self, v: &mut [f64]) -> Result<(), Self::Error>;
    /// Rank 0's BatchNorm running statistics to every rank, before evaluation (DDP's
    /// `broadcast_buffers`).
    fn broadcast_buffers(&mut self) -> Result<(), Self::Error>;
    /// Correct predictions among the first `real` test samples of `ids` (the rest pads the
    /// shard to the length every rank has).
    fn count_correct(
        &mut self,
        test: &Dataset,
        ids: &[usize],
        real: usize,
    ) -> Result<u64, Self::Error>;
    /// The epoch ended after `wall` seconds (the CPU engine logs its phases).
    fn epoch_done(&mut self, _epoch: u64, _wall: f64) {}
    /// Steps of this epoch whose update the fp16 loss scaler skipped.
    fn skipped_steps(&self) -> u64 {
        0
    }
    /// The loss scaler, when the run scales the loss.
    fn loss_scaler(&self) -> Option<ScalerState> {
        None
    }
    /// Optimizer steps taken so far (what a checkpoint records).
    fn optimizer_step(&self) -> u64;
    /// Write a checkpoint (rank 0 only) with training state `st`.
    fn save(&mut self, path: &Path, st: &TrainState) -> Result<(), Self::Error>;
    /// Wait for every rank.
    fn barrier(&mut self) -> Result<(), Self::Error>;
}

/// The FashionMNIST CNN both engines train, initialised from `cfg.seed`; a save path that cannot
/// work fails now (rank 0), not after the first epoch.
pub(crate) fn new_model(cfg: &TrainConfig, rank: usize) -> Result<Model, TrainError> {
    let mut model = Model::fashion_cnn(cfg.batch_size)?;
    model.init(cfg.seed);
    if let (Some(path), 0) = (&cfg.save, rank) {
        checkpoint::check_target(path, checkpoint::estimate_bytes(model.num_params()))?;
    }
    Ok(model)
}

/// `--resume`: load the newest complete checkpoint at `path` into `model` (parameters,
/// BatchNorm statistics) and `opt` (moments, step) and return its training state (the epoch to
/// continue from). A checkpoint written by another world size is refused: the data order would
/// differ.
pub(crate) fn resume(
    path: &Path,
    model: &mut Model,
    opt: &mut Adam,
    rank: usize,
    world: usize,
) -> Result<TrainState, TrainError> {
    let resumed = checkpoint::resume(path, model, opt)?;
    if rank == 0 {
        for why in &resumed.passed_over {
            tracing::warn!("resume: passed over {why}");
        }
        tracing::info!(
            "resuming from the {} checkpoint: {} and {} (epoch {}, step {})",
            resumed.source,
            resumed.model_file.display(),
            resumed.optim_file.display(),
            resumed.state.epoch,
            resumed.state.step
        );
    }
    let st = resumed.state;
    if st.world_size != world as u64 {
        return Err(TrainError::Config(format!(
            "checkpoint {} was written by a {}-rank run; resume it with --nprocs {} to continue the same data order",
            path.display(),
            st.world_size,
            st.world_size
        )));
    }
    Ok(st)
}

/// Train epochs `first_epoch..cfg.epochs` on `eng`, evaluating on `test_set` after each;
/// `cfg.save` is written by rank 0 after every epoch (every rank waits for it). The first epoch
/// starts at its optimizer step `first_step` (a replacement rank joins its peers there: see
/// `recover`; 0 otherwise).
#[allow(clippy::too_many_arguments)]
pub(crate) fn run<G: EpochEngine>(
    eng: &mut G,
    cfg: &TrainConfig,
    first_epoch: u64,
    first_step: usize,
    train_set: &Dataset,
    test_set: &Dataset,
    obs: &mut dyn Observer,
) -> Result<Vec<EpochReport>, G::Error> {
    let (rank, world) = eng.rank_world();
    let mut sampler = DistributedSampler::new(train_set.len(), world, rank, true, cfg.seed);
    let mut idx = Vec::with_capacity(sampler.num_samples());
    // This rank's test shard; padding comes last (`is_real` holds for a prefix).
    let mut test_sampler = DistributedSampler::new(test_set.len(), world, rank, false, 0);
    let mut test_ids = Vec::new();
    test_sampler.indices(0, &mut test_ids);
    let real = (0..test_ids.len())
        .take_while(|&k| test_sampler.is_real(k))
        .count();
    let accum = cfg.grad_accum.max(1);
    let mut reports = Vec::new();
    for epoch in first_epoch..cfg.epochs {
        let t0 = Instant::now();
        sampler.indices(epoch, &mut idx);
        eng.start_epoch(epoch, &idx)?;
        let micro: Vec<&[usize]> = idx.chunks(cfg.batch_size).collect();
        let steps = micro.len().div_ceil(accum);
        obs.epoch_start(epoch + 1, cfg.epochs, steps);
        let mut images = 0usize;
        for (s, group) in micro.chunks(accum).enumerate() {
            if epoch == first_epoch && s < first_step {
                // Done by the peers before this replacement rank joined them.
                images += group.iter().map(|c| c.len()).sum::<usize>();
                continue;
            }
            let loss = eng.train_step(s, s * accum * cfg.batch_size, group)?;
            images += group.iter().map(|c| c.len()).sum::<usize>();
            if let Some(loss) = loss {
                let per_s = (images * world) as f64 / t0.elapsed().as_secs_f64().max(1e-9);
                obs.step(s + 1, loss, per_s);
            }
        }
        let loss_sum = eng.finish_steps()?;
        let train_s = t0.elapsed().as_secs_f64();
        let mut tot = [loss_sum, images as f64];
        eng.sum_over_ranks(&mut tot)?;
        eng.broadcast_buffers()?;
        let correct = eng.count_correct(test_set, &test_ids, real)?;
        let mut counts = [correct as f64, real as f64];
        eng.sum_over_ranks(&mut counts)?;
        eng.epoch_done(epoch + 1, t0.elapsed().as_secs_f64());
        let skipped = eng.skipped_steps();
        let report = EpochReport {
            epoch: epoch + 1,
            epochs: cfg.epochs,
            train_loss: tot[0] / tot[1].max(1.0),
            test_acc: 100.0 * counts[0] / counts[1].max(1.0),
            test_count: counts[1] as u64,
            epoch_s: t0.elapsed().as_secs_f64(),
            images_per_s: tot[1] / train_s.max(1e-9),
            steps,
            skipped_steps: skipped,
            loss_scale: eng.loss_scaler().map(|s| s.scale),
        };
        if skipped > 0 && rank == 0 {
            tracing::info!(
                "epoch {}: {skipped} of {steps} steps skipped (fp16 gradients overflowed); loss scale now {}",
                epoch + 1,
                report.loss_scale.unwrap_or(1.0)
            );
        }
        if let Some(path) = &cfg.save {
            if rank == 0 {
                let st = TrainState {
                    epoch: epoch + 1,
                    step: eng.optimizer_step(),
                    seed: cfg.seed,
                    world_size: world as u64,
                    loss_scaler: eng.loss_scaler(),
                };
                eng.save(path, &st)?;
            }
            // Nobody races ahead (and possibly reads the file) before it is complete.
            eng.barrier()?;
        }
        obs.epoch_end(&report);
        reports.push(report);
    }
    Ok(reports)
}
