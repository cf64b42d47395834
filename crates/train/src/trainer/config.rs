//! The settings, progress reports, outcome and errors of a training run (either engine).

use std::path::PathBuf;

use crate::checkpoint::CheckpointError;
use crate::model::ModelError;
use crate::schedule::Schedule;
use lockstep::comm::CommError;

/// Errors of a training run.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A collective failed (a peer died, or the ranks disagree).
    #[error("collective failed: {0}")]
    Comm(#[from] CommError),
    /// The model rejected its input.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// Saving or loading a checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The configuration cannot work.
    #[error("invalid training configuration: {0}")]
    Config(String),
    /// The gradients stopped being finite numbers (found while clipping their norm).
    #[error("the gradient norm is {norm} at optimizer step {step}: training diverged; lower --lr (or the clipping threshold), or check the data")]
    NonFinite {
        /// The norm found.
        norm: f64,
        /// The optimizer step (1-based).
        step: u64,
    },
}

/// Which optimizer updates the parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OptimizerKind {
    /// `torch.optim.Adam` with PyTorch's defaults (the reference PyTorch script's choice).
    Adam,
    /// `torch.optim.SGD` with this momentum (0 for plain SGD).
    Sgd {
        /// Momentum factor.
        momentum: f32,
    },
}

/// Validated settings of a training run.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    /// Epochs to train (total, counting epochs done before a resume).
    pub epochs: u64,
    /// Images per rank per step.
    pub batch_size: usize,
    /// Base learning rate.
    pub lr: f32,
    /// Seed for initialisation and shuffling.
    pub seed: u64,
    /// Learning-rate schedule.
    pub schedule: Schedule,
    /// Gradient bucket size in bytes (DDP default 25 MiB).
    pub bucket_bytes: usize,
    /// Save a checkpoint here after every epoch (rank 0).
    pub save: Option<PathBuf>,
    /// Resume from this checkpoint.
    pub resume: Option<PathBuf>,
    /// Synchronise BatchNorm batch statistics over ranks (PyTorch `SyncBatchNorm`); off by
    /// default, as in the reference PyTorch script, where each rank normalises with its own batch.
    pub sync_bn: bool,
    /// The optimizer (Adam in the reference PyTorch script).
    pub optimizer: OptimizerKind,
    /// L2 penalty added to the gradient by the optimizer (PyTorch's `weight_decay`).
    pub weight_decay: f32,
    /// Micro-batches of `batch_size` per optimizer step (at least 1); the gradients are averaged
    /// over ranks once per step, after the last one.
    pub grad_accum: usize,
    /// Clip the global L2 norm of the averaged gradients to this (PyTorch's
    /// `clip_grad_norm_`); `None` leaves them alone.
    pub clip_grad_norm: Option<f32>,
}

impl Default for TrainConfig {
    fn default() -> TrainConfig {
        TrainConfig {
            epochs: 4,
            batch_size: 64,
            lr: 0.005,
            // `set_seed` (or `rng::set_global_seed`) moves every default run's generators.
            seed: crate::rng::global_seed(),
            schedule: Schedule::Constant,
            bucket_bytes: 25 << 20,
            save: None,
            resume: None,
            sync_bn: false,
            optimizer: OptimizerKind::Adam,
            weight_decay: 0.0,
            grad_accum: 1,
            clip_grad_norm: None,
        }
    }
}

/// What one epoch achieved (identical on every rank).
#[derive(Clone, Debug, PartialEq)]
pub struct EpochReport {
    /// 1-based epoch number.
    pub epoch: u64,
    /// Total epochs.
    pub epochs: u64,
    /// Mean training loss over all ranks' steps.
    pub train_loss: f64,
    /// Test accuracy in percent.
    pub test_acc: f64,
    /// Test samples counted (the test-set size, whatever the world size).
    pub test_count: u64,
    /// Wall time of the epoch (training and evaluation), seconds.
    pub epoch_s: f64,
    /// Training images per second over all ranks.
    pub images_per_s: f64,
    /// Optimizer steps in this epoch.
    pub steps: usize,
    /// Steps of this epoch whose optimizer update was skipped because the fp16 gradients
    /// overflowed (dynamic loss scaling); 0 in other precisions.
    pub skipped_steps: u64,
    /// The fp16 loss scale at the end of the epoch; `None` when the run scales no loss.
    pub loss_scale: Option<f32>,
}

impl TrainConfig {
    /// Optimizer steps in one epoch over `train_len` samples on `world` ranks: each rank's shard
    /// of `ceil(train_len / world)` samples in micro-batches of `batch_size`, `grad_accum` of them
    /// per step (the last step of an epoch may take fewer).
    pub fn steps_per_epoch(&self, train_len: usize, world: usize) -> usize {
        train_len
            .div_ceil(world.max(1))
            .div_ceil(self.batch_size.max(1))
            .div_ceil(self.grad_accum.max(1))
    }

    /// Check what `train` cannot work with, each error naming the setting.
    pub fn check(&self) -> Result<(), TrainError> {
        let bad = |m: String| Err(TrainError::Config(m));
        if self.epochs == 0 {
            return bad("epochs is 0, which would train nothing; pass at least 1".into());
        }
        if self.batch_size == 0 {
            return bad("batch size must be at least 1".into());
        }
        if self.grad_accum == 0 {
            return bad(
                "gradient accumulation of 0 micro-batches; pass at least 1 (1 = no accumulation)"
                    .into(),
            );
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad(format!(
                "learning rate {} must be a positive number",
                self.lr
            ));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad(format!(
                "weight decay {} must be 0 or a positive number",
                self.weight_decay
            ));
        }
        if let OptimizerKind::Sgd { momentum } = self.optimizer {
            if !(momentum.is_finite() && (0.0..1.0).contains(&momentum)) {
                return bad(format!("SGD momentum {momentum} must be in [0, 1)"));
            }
        }
        if let Some(c) = self.clip_grad_norm {
            if !(c.is_finite() && c > 0.0) {
                return bad(format!(
                    "gradient clipping threshold {c} must be a positive number"
                ));
            }
        }
        if self.optimizer != OptimizerKind::Adam && (self.save.is_some() || self.resume.is_some()) {
            return bad("checkpoints hold Adam's state only, so --save and --resume need --optimizer adam; drop them or use Adam".into());
        }
        Ok(())
    }
}

/// Receives progress (rank 0 gives a real one; other ranks a no-op).
pub trait Observer {
    /// An epoch of `steps` steps begins.
    fn epoch_start(&mut self, _epoch: u64, _epochs: u64, _steps: usize) {}
    /// Step `step` (1-based) finished with this rank's `loss`; `images_per_s` over all ranks.
    fn step(&mut self, _step: usize, _loss: f32, _images_per_s: f64) {}
    /// An epoch ended.
    fn epoch_end(&mut self, _report: &EpochReport) {}
}

/// An observer that ignores everything.
pub struct Silent;
impl Observer for Silent {}

/// Result of a run.
#[derive(Clone, Debug)]
pub struct TrainOutcome {
    /// One report per epoch run.
    pub reports: Vec<EpochReport>,
    /// Final parameters (flat, `state_dict` order).
    pub params: Vec<f32>,
    /// Bytes of activation buffers per rank (memory reporting).
    pub activation_bytes: usize,
}
