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
//!
//! Options beyond the reference PyTorch script: SGD with momentum instead of Adam ([`OptimizerKind`]); gradient
//! accumulation over `grad_accum` micro-batches with the all-reduce only after the last one (DDP's
//! `no_sync`), weighted so the step equals one step on the concatenated batch
//! ([`step_gradients`]); and clipping of the global gradient norm after the all-reduce
//! ([`clip_grad_norm`]), identical on every rank because the gradients are.

use std::ops::{Deref, DerefMut, Range};
use std::path::PathBuf;
use std::time::Instant;

use super::checkpoint::{self, CheckpointError, TrainState};
use super::data::Dataset;
use super::model::{Model, ModelError, StateMut};
use super::optim::{Adam, Sgd};
use super::sampler::{counts_for_metrics, DistributedSampler};
use super::schedule::Schedule;
use lockstep::comm::SharedBuffer;
use lockstep::comm::{CommError, Communicator, ReduceOp};

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

/// The optimizer of a run, with its state.
enum Optimizer {
    Adam(Adam),
    Sgd(Sgd),
}

impl Optimizer {
    fn new(kind: OptimizerKind, n: usize, lr: f32, weight_decay: f32) -> Optimizer {
        match kind {
            OptimizerKind::Adam => {
                let mut a = Adam::new(n, lr);
                a.weight_decay = weight_decay;
                Optimizer::Adam(a)
            }
            OptimizerKind::Sgd { momentum } => Optimizer::Sgd(Sgd::new(lr, momentum, weight_decay)),
        }
    }

    fn step(&mut self, lr: f32, params: &mut [f32], grads: &[f32]) {
        match self {
            Optimizer::Adam(a) => {
                a.lr = lr;
                a.step(params, grads);
            }
            Optimizer::Sgd(s) => {
                s.lr = lr;
                s.step(params, grads);
            }
        }
    }
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
            seed: super::rng::global_seed(),
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
fn all_reduce_grads(
    comm: &mut Communicator,
    grads: &mut [f32],
    buckets: &[Range<usize>],
) -> Result<(), CommError> {
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

/// CPU time of the calling thread, seconds (0 if the clock cannot be read: the figure is only
/// logged).
fn thread_cpu_s() -> f64 {
    use nix::time::{clock_gettime, ClockId};
    clock_gettime(ClockId::CLOCK_THREAD_CPUTIME_ID)
        .map(|t| t.tv_sec() as f64 + t.tv_nsec() as f64 * 1e-9)
        .unwrap_or(0.0)
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

/// Multiply every gradient by `k`.
fn scale(grads: &mut [f32], k: f32) {
    for g in grads.iter_mut() {
        *g *= k;
    }
}

/// The gradients of one optimizer step, averaged over ranks, in `grads`: forward and backward on
/// each micro-batch of sample ids in `micro`, accumulated locally with no communication (DDP's
/// `no_sync`), then one bucketed all-reduce. Each micro-batch's mean-loss gradient is weighted by
/// its size, so the step equals one step on the micro-batches concatenated (for a model without
/// batch statistics; BatchNorm normalises each micro-batch on its own, as in PyTorch). Returns the
/// size-weighted sum of the micro-batch losses and the number of samples.
///
/// With a single micro-batch this is the plain step: no pass over the gradients beyond the zeroing.
#[allow(clippy::too_many_arguments)]
pub fn step_gradients(
    model: &mut Model,
    data: &Dataset,
    micro: &[&[usize]],
    grads: &mut [f32],
    labels: &mut Vec<u8>,
    comm: &mut Communicator,
    buckets: &[Range<usize>],
    sync_bn: bool,
) -> Result<(f64, usize), TrainError> {
    let out = local_gradients(
        model,
        data,
        micro,
        grads,
        labels,
        comm,
        sync_bn,
        &mut Phases::default(),
    )?;
    all_reduce_grads(comm, grads, buckets)?;
    Ok(out)
}

/// Wall and CPU time of each phase of an epoch on one rank, logged at debug level at the end of
/// the epoch: what the step's CPU profile (`benches/train_step.rs`) does not show, such as the
/// waiting at the gradient all-reduce for a slower rank, or time the rank was not running.
#[derive(Default)]
struct Phases {
    /// Filling the input tensor (pixels to f32) and the labels.
    batch: Lap,
    /// Forward, loss and backward.
    compute: Lap,
    /// The gradient all-reduce, including the wait for the other ranks.
    reduce: Lap,
    /// Clipping and the optimizer step.
    optim: Lap,
    /// The observer (rank 0's progress output).
    observe: Lap,
    /// The end-of-epoch reductions, BatchNorm broadcast and evaluation.
    eval: Lap,
    /// Wall milliseconds of every step's forward + backward, for their spread.
    steps_ms: Vec<f32>,
}

/// Accumulated wall and CPU time of one phase.
#[derive(Default, Clone, Copy)]
struct Lap {
    wall: f64,
    cpu: f64,
}

/// A running phase: started by [`Stopwatch::start`], added to a [`Lap`] by [`Stopwatch::stop`].
struct Stopwatch {
    wall: Instant,
    cpu: f64,
}

impl Stopwatch {
    fn start() -> Stopwatch {
        Stopwatch {
            wall: Instant::now(),
            cpu: thread_cpu_s(),
        }
    }
    /// Add the time since `start` to `lap`; returns the wall seconds.
    fn stop(self, lap: &mut Lap) -> f64 {
        let w = self.wall.elapsed().as_secs_f64();
        lap.wall += w;
        lap.cpu += thread_cpu_s() - self.cpu;
        w
    }
}

impl Phases {
    /// One debug line: each phase as wall / CPU milliseconds, and the spread of the steps.
    fn log(&mut self, rank: usize, epoch: u64, wall: f64) {
        let f = |l: &Lap| format!("{:.0}/{:.0}", l.wall * 1e3, l.cpu * 1e3);
        self.steps_ms.sort_by(f32::total_cmp);
        let q = |p: f64| {
            self.steps_ms
                .get(((self.steps_ms.len() as f64 - 1.0) * p).round() as usize)
                .copied()
                .unwrap_or(0.0)
        };
        tracing::debug!(
            "rank {rank} epoch {epoch}: {:.0} ms wall; phases in ms wall/CPU: batches {}, forward+backward {}, all-reduce (with waiting) {}, \
             optimizer {}, progress {}, evaluation {}; forward+backward per step min {:.1} median {:.1} p90 {:.1} max {:.1} ms",
            wall * 1e3,
            f(&self.batch),
            f(&self.compute),
            f(&self.reduce),
            f(&self.optim),
            f(&self.observe),
            f(&self.eval),
            q(0.0),
            q(0.5),
            q(0.9),
            q(1.0)
        );
    }
}

/// [`step_gradients`] without the all-reduce: the gradients of this rank's micro-batches.
#[allow(clippy::too_many_arguments)]
fn local_gradients(
    model: &mut Model,
    data: &Dataset,
    micro: &[&[usize]],
    grads: &mut [f32],
    labels: &mut Vec<u8>,
    comm: &mut Communicator,
    sync_bn: bool,
    ph: &mut Phases,
) -> Result<(f64, usize), TrainError> {
    let world = comm.world_size();
    grads.fill(0.0);
    let (mut loss_sum, mut n, mut prev) = (0.0f64, 0usize, 0usize);
    for chunk in micro {
        let b = chunk.len();
        // Invariant: after micro-batch k, grads = sum_j (b_j / b_k) g_j. Rescaling only when the
        // size changes keeps equal micro-batches (all but an epoch's last) free of extra passes.
        if prev != 0 && prev != b {
            scale(grads, prev as f32 / b as f32);
        }
        let t = Stopwatch::start();
        load_batch(model, data, chunk, labels);
        t.stop(&mut ph.batch);
        let t = Stopwatch::start();
        let loss = if sync_bn && world > 1 {
            let mut sum = |b: &mut [f64]| comm.all_reduce_in_place(b, ReduceOp::Sum);
            model.forward_with(true, Some(&mut sum))?;
            let loss = model.loss(labels)?;
            model.backward_with(labels, grads, Some(&mut sum))?;
            loss
        } else {
            model.forward(true);
            let loss = model.loss(labels)?;
            model.backward(labels, grads);
            loss
        };
        let w = t.stop(&mut ph.compute);
        ph.steps_ms.push((w * 1e3) as f32);
        loss_sum += loss as f64 * b as f64;
        n += b;
        prev = b;
    }
    if micro.len() > 1 {
        // sum_j (b_j / b_last) g_j  ->  sum_j (b_j / n) g_j
        scale(grads, prev as f32 / n as f32);
    }
    Ok((loss_sum, n))
}

/// Scale `grads` so that their global L2 norm is at most `max_norm`, as PyTorch's
/// `clip_grad_norm_` does (coefficient `max_norm / (norm + 1e-6)`, applied only when below 1).
/// Returns the norm before clipping (summed in f64). A non-finite norm leaves the gradients
/// alone. Called on gradients already averaged over ranks, it computes the same norm and makes
/// the same change on every rank.
pub fn clip_grad_norm(grads: &mut [f32], max_norm: f32) -> f64 {
    let norm = grads
        .iter()
        .map(|&g| g as f64 * g as f64)
        .sum::<f64>()
        .sqrt();
    let coef = max_norm as f64 / (norm + 1e-6);
    if norm.is_finite() && coef < 1.0 {
        scale(grads, coef as f32);
    }
    norm
}

/// Test accuracy: every rank evaluates its shard, padding excluded, totals summed over ranks.
pub fn evaluate(
    comm: &mut Communicator,
    model: &mut Model,
    test: &Dataset,
    batch: usize,
) -> Result<(u64, u64), TrainError> {
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

/// Train the FashionMNIST CNN on `train_set`, evaluating on `test_set` after every epoch.
pub fn train(
    cfg: &TrainConfig,
    train_set: &Dataset,
    test_set: &Dataset,
    comm: &mut Communicator,
    obs: &mut dyn Observer,
) -> Result<TrainOutcome, TrainError> {
    cfg.check()?;
    if train_set.rows != 28
        || train_set.cols != 28
        || (!test_set.is_empty() && (test_set.rows != 28 || test_set.cols != 28))
    {
        return Err(TrainError::Config(format!(
            "the CNN expects 28x28 images, the dataset has {}x{}",
            train_set.rows, train_set.cols
        )));
    }
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut model = Model::fashion_cnn(cfg.batch_size)?;
    model.init(cfg.seed);
    model.set_sync_bn(cfg.sync_bn && world > 1);
    let mut opt = Optimizer::new(cfg.optimizer, model.num_params(), cfg.lr, cfg.weight_decay);
    // Optimizer steps taken (Adam keeps its own count too; a resume restores it).
    let mut step_no = 0u64;
    let mut first_epoch = 0;
    if let (Some(path), 0) = (&cfg.save, rank) {
        // A save path that cannot work fails now, not after the first epoch.
        checkpoint::check_target(path, checkpoint::estimate_bytes(model.num_params()))?;
    }
    if let (Some(path), Optimizer::Adam(opt)) = (&cfg.resume, &mut opt) {
        let resumed = checkpoint::resume(path, &mut model, opt)?;
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
        step_no = st.step;
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
    let accum = cfg.grad_accum.max(1);
    for epoch in first_epoch..cfg.epochs {
        let t0 = Instant::now();
        sampler.indices(epoch, &mut idx);
        let micro: Vec<&[usize]> = idx.chunks(cfg.batch_size).collect();
        let steps = micro.len().div_ceil(accum);
        obs.epoch_start(epoch + 1, cfg.epochs, steps);
        let (mut loss_sum, mut loss_n) = (0.0f64, 0.0f64);
        let mut images = 0usize;
        let mut ph = Phases {
            steps_ms: Vec::with_capacity(micro.len()),
            ..Phases::default()
        };
        for (s, group) in micro.chunks(accum).enumerate() {
            let (l, n) = local_gradients(
                &mut model,
                train_set,
                group,
                &mut grads,
                &mut labels,
                comm,
                cfg.sync_bn,
                &mut ph,
            )?;
            let t = Stopwatch::start();
            all_reduce_grads(comm, &mut grads, &buckets)?;
            t.stop(&mut ph.reduce);
            let t = Stopwatch::start();
            step_no += 1;
            if let Some(max) = cfg.clip_grad_norm {
                let norm = clip_grad_norm(&mut grads, max);
                if !norm.is_finite() {
                    return Err(TrainError::NonFinite {
                        norm,
                        step: step_no,
                    });
                }
            }
            opt.step(
                cfg.schedule.lr(cfg.lr, step_no - 1),
                &mut model.params,
                &grads,
            );
            t.stop(&mut ph.optim);
            let t = Stopwatch::start();
            loss_sum += l;
            loss_n += n as f64;
            images += n;
            obs.step(
                s + 1,
                (l / n.max(1) as f64) as f32,
                (images * world) as f64 / t0.elapsed().as_secs_f64().max(1e-9),
            );
            t.stop(&mut ph.observe);
        }
        let train_s = t0.elapsed().as_secs_f64();
        let t = Stopwatch::start();
        let mut tot = [loss_sum, loss_n];
        comm.all_reduce_in_place(&mut tot[..], ReduceOp::Sum)?;
        broadcast_bn_state(comm, &mut model)?;
        let (correct, counted) = evaluate(comm, &mut model, test_set, cfg.batch_size)?;
        t.stop(&mut ph.eval);
        ph.log(rank, epoch + 1, t0.elapsed().as_secs_f64());
        let report = EpochReport {
            epoch: epoch + 1,
            epochs: cfg.epochs,
            train_loss: tot[0] / tot[1].max(1.0),
            test_acc: 100.0 * correct as f64 / counted.max(1) as f64,
            test_count: counted,
            epoch_s: t0.elapsed().as_secs_f64(),
            images_per_s: tot[1] / train_s.max(1e-9),
            steps,
            skipped_steps: 0,
            loss_scale: None,
        };
        if let (Some(path), Optimizer::Adam(opt)) = (&cfg.save, &opt) {
            if rank == 0 {
                let st = TrainState {
                    epoch: epoch + 1,
                    step: opt.step,
                    seed: cfg.seed,
                    world_size: world as u64,
                    loss_scaler: None,
                };
                checkpoint::save(path, &mut model, opt, &st)?;
            }
            // Nobody races ahead (and possibly reads the file) before it is complete.
            comm.barrier()?;
        }
        obs.epoch_end(&report);
        reports.push(report);
    }
    Ok(TrainOutcome {
        reports,
        params: model.params.clone(),
        activation_bytes: model.activation_bytes(),
    })
}
