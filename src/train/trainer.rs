//! The data-parallel training loop.
//!
//! Every rank holds a full model. At start rank 0's parameters are broadcast so all replicas are
//! identical. Each step a rank runs forward and backward on its shard of the batch, then the
//! gradients are averaged with all-reduce in fixed-order buckets (DDP's scheme: ~25 MiB buckets
//! filled from the last parameter backwards), and every rank applies the same optimizer update.
//! The flat gradient buffer lives in `alloc_shared` memory when the backend offers it, so each
//! bucket all-reduce is zero-copy. BatchNorm statistics stay local to each rank (or, with
//! `sync_bn`, are summed over ranks as `SyncBatchNorm` does); before evaluation rank 0's running
//! statistics are broadcast, as DDP's `broadcast_buffers` does.
//!
//! Nothing is allocated per step: activations, gradients, index and label buffers are sized once
//! and reused (a smaller last batch only shrinks the view).

use std::ops::{Deref, DerefMut, Range};
use std::path::PathBuf;
use std::time::Instant;

use super::checkpoint::{self, CheckpointError, TrainState};
use super::data::Dataset;
use super::model::{Model, ModelError, StateMut};
use super::optim::Adam;
use super::sampler::{counts_for_metrics, DistributedSampler};
use super::schedule::Schedule;
use crate::comm::SharedBuffer;
use crate::comm::{CommError, Communicator, ReduceOp};

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
}

/// Validated settings of a training run.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    /// Epochs to train (total, counting epochs done before a resume).
    pub epochs: u64,
    /// Images per rank per step.
    pub batch_size: usize,
    /// Base learning rate (Adam).
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
    /// default, as in the recipe, where each rank normalises with its own batch.
    pub sync_bn: bool,
}

impl Default for TrainConfig {
    fn default() -> TrainConfig {
        TrainConfig {
            epochs: 4,
            batch_size: 64,
            lr: 0.005,
            seed: 42,
            schedule: Schedule::Constant,
            bucket_bytes: 25 << 20,
            save: None,
            resume: None,
            sync_bn: false,
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

/// Gradient storage: shared memory for zero-copy all-reduce, or a plain vector.
enum Grads {
    Shared(SharedBuffer<f32>),
    Local(Vec<f32>),
}

impl Deref for Grads {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            Grads::Shared(b) => b,
            Grads::Local(v) => v,
        }
    }
}

impl DerefMut for Grads {
    fn deref_mut(&mut self) -> &mut [f32] {
        match self {
            Grads::Shared(b) => b,
            Grads::Local(v) => v,
        }
    }
}

/// Contiguous gradient buckets, filled from the last parameter backwards (the order gradients
/// become ready in backward), each at least `bucket_bytes` unless it is the last.
pub fn buckets(model: &Model, bucket_bytes: usize) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut end = model.num_params();
    let mut start = end;
    for e in model.entries.iter().rev() {
        start = e.range.start;
        if (end - start) * 4 >= bucket_bytes {
            out.push(start..end);
            end = start;
        }
    }
    if start < end {
        out.push(start..end);
    }
    out
}

/// Average gradients over ranks, bucket by bucket, in a fixed order.
fn all_reduce_grads(comm: &mut Communicator, grads: &mut [f32], buckets: &[Range<usize>]) -> Result<(), CommError> {
    if comm.world_size() == 1 {
        return Ok(());
    }
    for b in buckets {
        comm.all_reduce_in_place(&mut grads[b.clone()], ReduceOp::Avg)?;
    }
    Ok(())
}

/// Broadcast rank 0's BatchNorm running statistics (and counters) to every rank.
fn broadcast_bn_state(comm: &mut Communicator, model: &mut Model) -> Result<(), CommError> {
    if comm.world_size() == 1 {
        return Ok(());
    }
    for s in model.state_mut() {
        match s {
            StateMut::F32(_, v) => comm.broadcast_in_place(&mut v[..], 0)?,
            StateMut::I64(_, v) => {
                let mut b = [*v];
                comm.broadcast_in_place(&mut b[..], 0)?;
                *v = b[0];
            }
        }
    }
    Ok(())
}

/// Fill the model input with samples `idx` of `data` (pixels / 255) and `labels`.
fn load_batch(model: &mut Model, data: &Dataset, idx: &[usize], labels: &mut Vec<u8>) {
    let (r, c) = (data.rows, data.cols);
    let input = model.input_mut();
    input.resize(&[idx.len(), 1, r, c]);
    labels.clear();
    for (dst, &i) in input.data_mut().chunks_exact_mut(r * c).zip(idx) {
        for (d, &p) in dst.iter_mut().zip(data.image(i)) {
            *d = p as f32 / 255.0;
        }
        labels.push(data.labels[i]);
    }
}

/// Test accuracy: every rank evaluates its shard, padding excluded, totals summed over ranks.
pub fn evaluate(comm: &mut Communicator, model: &mut Model, test: &Dataset, batch: usize) -> Result<(u64, u64), TrainError> {
    let mut sampler = DistributedSampler::new(test.len(), comm.world_size(), comm.rank(), false, 0);
    let mut idx = Vec::with_capacity(sampler.num_samples());
    sampler.indices(0, &mut idx);
    let (mut correct, mut counted) = (0u64, 0u64);
    let (mut labels, mut pred) = (Vec::with_capacity(batch), Vec::with_capacity(batch));
    for (bi, chunk) in idx.chunks(batch).enumerate() {
        load_batch(model, test, chunk, &mut labels);
        model.forward(false);
        model.argmax(&mut pred);
        for (k, (p, l)) in pred.iter().zip(&labels).enumerate() {
            if sampler.is_real(bi * batch + k) {
                counted += 1;
                correct += (p == l) as u64;
            }
        }
    }
    Ok(counts_for_metrics(comm, correct, counted)?)
}

/// Train the recipe's CNN on `train_set`, evaluating on `test_set` after every epoch.
pub fn train(
    cfg: &TrainConfig,
    train_set: &Dataset,
    test_set: &Dataset,
    comm: &mut Communicator,
    obs: &mut dyn Observer,
) -> Result<TrainOutcome, TrainError> {
    if cfg.batch_size == 0 {
        return Err(TrainError::Config("batch size must be at least 1".into()));
    }
    if train_set.rows != 28 || train_set.cols != 28 || (!test_set.is_empty() && (test_set.rows != 28 || test_set.cols != 28)) {
        return Err(TrainError::Config(format!("the CNN expects 28x28 images, the dataset has {}x{}", train_set.rows, train_set.cols)));
    }
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut model = Model::fashion_cnn(cfg.batch_size)?;
    model.init(cfg.seed);
    model.set_sync_bn(cfg.sync_bn && world > 1);
    let mut opt = Adam::new(model.num_params(), cfg.lr);
    let mut first_epoch = 0;
    if let (Some(path), 0) = (&cfg.save, rank) {
        // A save path that cannot work fails now, not after the first epoch.
        checkpoint::check_target(path, checkpoint::estimate_bytes(model.num_params()))?;
    }
    if let Some(path) = &cfg.resume {
        let resumed = checkpoint::resume(path, &mut model, &mut opt)?;
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
        first_epoch = st.epoch;
    }
    // Replicas start identical: rank 0's parameters (and BN state) win.
    if world > 1 {
        comm.broadcast_in_place(&mut model.params[..], 0)?;
        broadcast_bn_state(comm, &mut model)?;
    }
    let mut grads = match comm.alloc_shared::<f32>(model.num_params()) {
        Ok(b) if world > 1 => Grads::Shared(b),
        _ => Grads::Local(vec![0.0; model.num_params()]),
    };
    let buckets = buckets(&model, cfg.bucket_bytes);
    let mut sampler = DistributedSampler::new(train_set.len(), world, rank, true, cfg.seed);
    let mut idx = Vec::with_capacity(sampler.num_samples());
    let mut labels = Vec::with_capacity(cfg.batch_size);
    let mut reports = Vec::new();
    for epoch in first_epoch..cfg.epochs {
        let t0 = Instant::now();
        sampler.indices(epoch, &mut idx);
        let steps = idx.len().div_ceil(cfg.batch_size);
        obs.epoch_start(epoch + 1, cfg.epochs, steps);
        let (mut loss_sum, mut loss_n) = (0.0f64, 0.0f64);
        let mut images = 0usize;
        for (s, chunk) in idx.chunks(cfg.batch_size).enumerate() {
            load_batch(&mut model, train_set, chunk, &mut labels);
            let loss = if cfg.sync_bn && world > 1 {
                let mut sum = |b: &mut [f64]| comm.all_reduce_in_place(b, ReduceOp::Sum);
                model.forward_with(true, Some(&mut sum))?;
                let loss = model.loss(&labels)?;
                grads.fill(0.0);
                model.backward_with(&labels, &mut grads, Some(&mut sum))?;
                loss
            } else {
                model.forward(true);
                let loss = model.loss(&labels)?;
                grads.fill(0.0);
                model.backward(&labels, &mut grads);
                loss
            };
            all_reduce_grads(comm, &mut grads, &buckets)?;
            opt.lr = cfg.schedule.lr(cfg.lr, opt.step);
            opt.step(&mut model.params, &grads);
            loss_sum += loss as f64 * chunk.len() as f64;
            loss_n += chunk.len() as f64;
            images += chunk.len();
            obs.step(s + 1, loss, (images * world) as f64 / t0.elapsed().as_secs_f64().max(1e-9));
        }
        let train_s = t0.elapsed().as_secs_f64();
        let mut tot = [loss_sum, loss_n];
        comm.all_reduce_in_place(&mut tot[..], ReduceOp::Sum)?;
        broadcast_bn_state(comm, &mut model)?;
        let (correct, counted) = evaluate(comm, &mut model, test_set, cfg.batch_size)?;
        let report = EpochReport {
            epoch: epoch + 1,
            epochs: cfg.epochs,
            train_loss: tot[0] / tot[1].max(1.0),
            test_acc: 100.0 * correct as f64 / counted.max(1) as f64,
            test_count: counted,
            epoch_s: t0.elapsed().as_secs_f64(),
            images_per_s: tot[1] / train_s.max(1e-9),
            steps,
        };
        if let Some(path) = &cfg.save {
            if rank == 0 {
                let st = TrainState { epoch: epoch + 1, step: opt.step, seed: cfg.seed, world_size: world as u64 };
                checkpoint::save(path, &mut model, &opt, &st)?;
            }
            // Nobody races ahead (and possibly reads the file) before it is complete.
            comm.barrier()?;
        }
        obs.epoch_end(&report);
        reports.push(report);
    }
    Ok(TrainOutcome { reports, params: model.params.clone(), activation_bytes: model.activation_bytes() })
}
