//! Device execution of the training engine: the recipe CNN trained with the `kernels/*.cu`
//! kernels.
//!
//! | file | what lives there |
//! |---|---|
//! | `plan.rs` | the step as data: tensors as regions of flat arenas, [`plan::Op`] = one launch with its geometry |
//! | `cpu.rs` | [`CpuExec`]: runs a plan with the kernels' CPU twins (checks the whole device step without a GPU) |
//! | `gpu.rs` | [`GpuExec`]: device arenas, launches through the safe CUDA layer, one CUDA graph per batch size |
//! | `mod.rs` | [`Engine`] (plan + executor: step, eval, read-backs) and [`train_device`] (the epoch loop) |
//!
//! One step on the device: the batch's sample ids are copied (device to device) from the epoch's
//! index list into the step's index buffer, then the captured graph gathers the images from the
//! dataset uploaded once (u8), runs forward, loss and backward, and adds `batch * loss` to a
//! device accumulator. With several ranks the flat gradient buffer is averaged in place by the
//! `Communicator` (NCCL, or the staged shared-memory backend when ranks share a GPU) - the
//! gradients already live in one flat buffer, so the whole buffer is the bucket and
//! `bucket_flatten_f32` has nothing to gather. Adam then runs as one launch outside the graph,
//! because its step count and learning rate are kernel arguments that change every step. The
//! loss accumulator is read back asynchronously every `loss_every` steps.
//!
//! Initialisation comes from the CPU engine (`Model::fashion_cnn` + `Model::init(seed)`), so the
//! same seed gives the same starting point on every rank and on both engines.

pub mod cpu;
pub mod gpu;
pub mod plan;

use std::collections::HashMap;
use std::time::Instant;

pub use cpu::CpuExec;
pub use gpu::GpuExec;
pub use plan::{AdamHyper, Op, Precision, Region, Tensors};

use super::data::Dataset;
use super::model::{Model, ModelError};
use super::sampler::DistributedSampler;
use super::trainer::{EpochReport, Observer, TrainConfig, TrainOutcome};
use crate::comm::{CommError, Communicator};
use crate::cuda::CudaError;
use plan::Builder;

/// Errors of device training, each saying what to do.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// A CUDA call failed.
    #[error("CUDA: {0}; check `lockstep env` and nvidia-smi, or train with --device cpu")]
    Cuda(#[from] CudaError),
    /// A collective failed.
    #[error("collective failed: {0}")]
    Comm(#[from] CommError),
    /// The model could not be built.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The configuration cannot run on the device engine.
    #[error("invalid device training configuration: {0}")]
    Config(String),
    /// The executor cannot run this operation.
    #[error("unsupported on this executor: {0}")]
    Unsupported(String),
    /// Writing a checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] super::checkpoint::CheckpointError),
}

/// What the engine needs from an executor: arenas laid out as [`Tensors`] says, kernel launches,
/// a few copies, and the two collectives of data-parallel training.
pub trait Exec {
    /// SMs of the device (sizes split-K grids; 1 for the CPU).
    fn sm_count(&self) -> usize;
    /// Upload the whole dataset once (pixels and labels, train split then test split).
    fn upload_dataset(&mut self, images: &[u8], labels: &[u8]) -> Result<(), DeviceError>;
    /// Overwrite an f32 region from host memory (waits).
    fn write_f32(&mut self, r: Region, data: &[f32]) -> Result<(), DeviceError>;
    /// Read an f32 region (waits for all queued work).
    fn read_f32(&mut self, r: Region) -> Result<Vec<f32>, DeviceError>;
    /// Read an i32 region (waits for all queued work).
    fn read_i32(&mut self, r: Region) -> Result<Vec<i32>, DeviceError>;
    /// Upload the epoch's sample ids (one copy per epoch).
    fn load_index_list(&mut self, idx: &[i32]) -> Result<(), DeviceError>;
    /// Copy `dst.len` ids starting at `start` of the index list into `dst` (in stream order).
    fn select_indices(&mut self, dst: Region, start: usize) -> Result<(), DeviceError>;
    /// Enqueue one launch.
    fn run(&mut self, op: &Op) -> Result<(), DeviceError>;
    /// Enqueue a whole step; executors that can, capture it once per `key` and replay it.
    fn run_step(&mut self, _key: u64, ops: &[Op]) -> Result<(), DeviceError> {
        ops.iter().try_for_each(|op| self.run(op))
    }
    /// Average an f32 region over ranks, in place, ordered after all queued work.
    fn all_reduce_mean(&mut self, comm: &mut Communicator, r: Region) -> Result<(), DeviceError>;
    /// Copy rank 0's f32 region to every rank.
    fn broadcast(&mut self, comm: &mut Communicator, r: Region) -> Result<(), DeviceError>;
    /// Sum host values over ranks through the same communicator (device buffers when it needs them).
    fn all_reduce_sum_host(&mut self, comm: &mut Communicator, v: &mut [f64]) -> Result<(), DeviceError> {
        comm.all_reduce_in_place(v, crate::comm::ReduceOp::Sum)?;
        Ok(())
    }
    /// Start reading an f32 region back without waiting (default: read now).
    fn start_read(&mut self, r: Region) -> Result<(), DeviceError> {
        let v = self.read_f32(r)?;
        self.stash(v);
        Ok(())
    }
    /// Finish the read started by [`Exec::start_read`].
    fn finish_read(&mut self) -> Result<Vec<f32>, DeviceError> {
        Ok(self.take_stash())
    }
    /// Default read-back storage (CPU).
    fn stash(&mut self, _v: Vec<f32>) {}
    /// See [`Exec::stash`].
    fn take_stash(&mut self) -> Vec<f32> {
        Vec::new()
    }
}

/// Options of the device engine beyond [`TrainConfig`].
#[derive(Clone, Copy, Debug)]
pub struct DeviceOptions {
    /// GEMM precision.
    pub precision: Precision,
    /// Read the loss back every this many steps (at least 1).
    pub loss_every: usize,
}

impl Default for DeviceOptions {
    fn default() -> Self {
        DeviceOptions { precision: Precision::Fp32, loss_every: 50 }
    }
}

/// The recipe CNN on an executor: tensors, cached plans, optimizer step count.
pub struct Engine<E: Exec> {
    /// The executor.
    pub exec: E,
    /// Tensor layout.
    pub t: Tensors,
    /// GEMM precision.
    pub precision: Precision,
    /// Adam hyper-parameters (lr comes per step).
    pub adam: AdamHyper,
    /// Optimizer steps taken.
    pub step: u64,
    /// Offset of the test split in the dataset arenas (samples).
    test_offset: usize,
    plans: HashMap<u64, Vec<Op>>,
}

impl<E: Exec> Engine<E> {
    /// Lay out the tensors for `batch` images, upload `model`'s parameters, zero the optimizer
    /// state and set the BatchNorm running statistics to PyTorch's initial values (mean 0, var 1).
    pub fn new(mut exec: E, model: &Model, batch: usize, precision: Precision) -> Result<Engine<E>, DeviceError> {
        if batch == 0 {
            return Err(DeviceError::Config("batch size must be at least 1".into()));
        }
        let t = Tensors::new(model, batch, precision).map_err(DeviceError::Config)?;
        exec.write_f32(t.params, &model.params)?;
        let zeros = vec![0.0f32; t.num_params];
        for r in [t.grads, t.m, t.v] {
            exec.write_f32(r, &zeros)?;
        }
        let mut st = vec![0.0f32; t.bn_state.len];
        st[32..64].fill(1.0);
        st[128..192].fill(1.0);
        exec.write_f32(t.bn_state, &st)?;
        exec.write_f32(t.loss.loss_sum, &[0.0])?;
        Ok(Engine { exec, t, precision, adam: AdamHyper::default(), step: 0, test_offset: 0, plans: HashMap::new() })
    }

    /// Upload both splits once; evaluation ids are offset past the training split.
    pub fn upload_dataset(&mut self, train: &Dataset, test: &Dataset) -> Result<(), DeviceError> {
        if (train.rows, train.cols) != (28, 28) || (!test.is_empty() && (test.rows, test.cols) != (28, 28)) {
            return Err(DeviceError::Config(format!("the CNN expects 28x28 images, the dataset has {}x{}", train.rows, train.cols)));
        }
        let mut images = Vec::with_capacity(train.images.len() + test.images.len());
        images.extend_from_slice(&train.images);
        images.extend_from_slice(&test.images);
        let mut labels = Vec::with_capacity(train.len() + test.len());
        labels.extend_from_slice(&train.labels);
        labels.extend_from_slice(&test.labels);
        if let Some(&l) = labels.iter().find(|&&l| l >= 10) {
            return Err(DeviceError::Model(ModelError::Label { label: l, classes: 10 }));
        }
        self.test_offset = train.len();
        self.exec.upload_dataset(&images, &labels)
    }

    /// Use `idx` (sample ids of one split; `test` selects the test split) for the next steps.
    pub fn set_index_list(&mut self, idx: &[usize], test: bool) -> Result<(), DeviceError> {
        let off = if test { self.test_offset } else { 0 };
        let v: Vec<i32> = idx.iter().map(|&i| (i + off) as i32).collect();
        self.exec.load_index_list(&v)
    }

    fn plan(&mut self, b: usize, train: bool) -> (u64, &[Op]) {
        let key = ((b as u64) << 1) | train as u64;
        let sm = self.exec.sm_count();
        let (t, p) = (&self.t, self.precision);
        let ops = self.plans.entry(key).or_insert_with(|| if train { t.train_step(b, p, sm) } else { t.eval_step(b, p, sm) });
        (key, ops)
    }

    /// Forward + backward on ids `start..start + b` of the index list (adds `b * loss` to the
    /// device loss accumulator), the gradient average over ranks when `comm` has several, then
    /// one Adam step with learning rate `lr`.
    pub fn train_step(&mut self, start: usize, b: usize, lr: f32, comm: Option<&mut Communicator>) -> Result<(), DeviceError> {
        if b == 0 || b > self.t.batch {
            return Err(DeviceError::Config(format!("step of {b} images: the engine was built for 1..={}", self.t.batch)));
        }
        self.exec.select_indices(self.t.indices.prefix(b), start)?;
        let (key, _) = self.plan(b, true);
        let ops = self.plans.remove(&key).unwrap_or_default();
        let r = self.exec.run_step(key, &ops);
        self.plans.insert(key, ops);
        r?;
        if let Some(c) = comm {
            if c.world_size() > 1 {
                self.exec.all_reduce_mean(c, self.t.grads)?;
            }
        }
        self.step += 1;
        let mut ops = Builder::new(1);
        ops.adam(self.t.params, self.t.grads, self.t.m, self.t.v, &self.adam, lr, self.step);
        self.exec.run(&ops.ops[0])
    }

    /// Evaluate ids `start..start + b` of the index list; returns the correct predictions.
    pub fn eval_batch(&mut self, start: usize, b: usize) -> Result<u64, DeviceError> {
        self.exec.select_indices(self.t.indices.prefix(b), start)?;
        let (key, _) = self.plan(b, false);
        let ops = self.plans.remove(&key).unwrap_or_default();
        let r = self.exec.run_step(key, &ops);
        self.plans.insert(key, ops);
        r?;
        Ok(self.exec.read_i32(self.t.loss.correct)?[0].max(0) as u64)
    }

    /// The mean loss of the last step (waits for it).
    pub fn last_loss(&mut self) -> Result<f32, DeviceError> {
        Ok(self.exec.read_f32(self.t.loss.mean_loss)?[0])
    }

    /// Zero the device loss accumulator.
    pub fn reset_loss_sum(&mut self) -> Result<(), DeviceError> {
        self.exec.write_f32(self.t.loss.loss_sum, &[0.0])
    }

    /// The flat parameters (waits).
    pub fn params(&mut self) -> Result<Vec<f32>, DeviceError> {
        self.exec.read_f32(self.t.params)
    }
}

/// Train the recipe CNN on the executor `make_exec` builds for the given arena sizes (f32, i32,
/// bf16 elements): the GPU one in `train-cnn --device cuda`, the CPU twins in tests. `comm` joins the ranks (gradient average, metrics); `None` trains alone.
pub fn train_device<E: Exec>(
    cfg: &TrainConfig,
    opts: &DeviceOptions,
    train_set: &Dataset,
    test_set: &Dataset,
    make_exec: impl FnOnce((usize, usize, usize)) -> Result<E, DeviceError>,
    mut comm: Option<&mut Communicator>,
    obs: &mut dyn Observer,
) -> Result<TrainOutcome, DeviceError> {
    if cfg.resume.is_some() {
        return Err(DeviceError::Config("--resume is not supported with --device cuda yet; resume on --device cpu".into()));
    }
    if cfg.sync_bn {
        return Err(DeviceError::Config("--sync-bn is not supported with --device cuda yet; drop it or use --device cpu".into()));
    }
    let (rank, world) = comm.as_deref().map(|c| (c.rank(), c.world_size())).unwrap_or((0, 1));
    let mut model = Model::fashion_cnn(cfg.batch_size)?;
    model.init(cfg.seed);
    let layout = Tensors::new(&model, cfg.batch_size, opts.precision).map_err(DeviceError::Config)?;
    let mut eng = Engine::new(make_exec(layout.arena_len)?, &model, cfg.batch_size, opts.precision)?;
    eng.upload_dataset(train_set, test_set)?;
    let mut sampler = DistributedSampler::new(train_set.len(), world, rank, true, cfg.seed);
    let mut idx = Vec::with_capacity(sampler.num_samples());
    let mut reports = Vec::new();
    let every = opts.loss_every.max(1);
    for epoch in 0..cfg.epochs {
        let t0 = Instant::now();
        sampler.indices(epoch, &mut idx);
        eng.set_index_list(&idx, false)?;
        eng.reset_loss_sum()?;
        let steps = idx.len().div_ceil(cfg.batch_size);
        obs.epoch_start(epoch + 1, cfg.epochs, steps);
        // (images seen when the pending read-back was started, the sum it will report)
        let (mut pending, mut last_sum, mut last_images, mut images) = (None::<usize>, 0.0f64, 0usize, 0usize);
        for (s, start) in (0..idx.len()).step_by(cfg.batch_size).enumerate() {
            let b = cfg.batch_size.min(idx.len() - start);
            let lr = cfg.schedule.lr(cfg.lr, eng.step);
            eng.train_step(start, b, lr, comm.as_deref_mut())?;
            images += b;
            if (s + 1) % every == 0 {
                // Collect the read-back started `every` steps ago (long finished), start a new one.
                if let Some(at) = pending.take() {
                    let sum = eng.exec.finish_read()?[0] as f64;
                    let loss = (sum - last_sum) / (at - last_images).max(1) as f64;
                    (last_sum, last_images) = (sum, at);
                    obs.step(s + 1, loss as f32, (images * world) as f64 / t0.elapsed().as_secs_f64().max(1e-9));
                }
                eng.exec.start_read(eng.t.loss.loss_sum)?;
                pending = Some(images);
            }
        }
        if pending.is_some() {
            eng.exec.finish_read()?;
        }
        let loss_sum = eng.exec.read_f32(eng.t.loss.loss_sum)?[0] as f64;
        let train_s = t0.elapsed().as_secs_f64();
        let mut tot = [loss_sum, images as f64];
        if let Some(c) = comm.as_deref_mut() {
            if world > 1 {
                eng.exec.all_reduce_sum_host(c, &mut tot)?;
                // DDP's broadcast_buffers: rank 0's running statistics for evaluation.
                eng.exec.broadcast(c, eng.t.bn_state)?;
            }
        }
        // Evaluation: this rank's shard of the test set, padding dropped.
        let mut ts = DistributedSampler::new(test_set.len(), world, rank, false, 0);
        let mut tidx = Vec::new();
        ts.indices(0, &mut tidx);
        let real: Vec<usize> = tidx.iter().enumerate().filter(|(k, _)| ts.is_real(*k)).map(|(_, &i)| i).collect();
        let mut correct = 0u64;
        if !real.is_empty() {
            eng.set_index_list(&real, true)?;
            for start in (0..real.len()).step_by(cfg.batch_size) {
                correct += eng.eval_batch(start, cfg.batch_size.min(real.len() - start))?;
            }
        }
        let mut counts = [correct as f64, real.len() as f64];
        if let Some(c) = comm.as_deref_mut() {
            if world > 1 {
                eng.exec.all_reduce_sum_host(c, &mut counts)?;
            }
        }
        let report = EpochReport {
            epoch: epoch + 1,
            epochs: cfg.epochs,
            train_loss: tot[0] / tot[1].max(1.0),
            test_acc: 100.0 * counts[0] / counts[1].max(1.0),
            test_count: counts[1] as u64,
            epoch_s: t0.elapsed().as_secs_f64(),
            images_per_s: tot[1] / train_s.max(1e-9),
            steps,
        };
        obs.epoch_end(&report);
        reports.push(report);
    }
    let params = eng.params()?;
    if let Some(path) = &cfg.save {
        if rank == 0 {
            model.params.copy_from_slice(&params);
            let mut opt = super::optim::Adam::new(model.num_params(), cfg.lr);
            opt.step = eng.step;
            opt.m = eng.exec.read_f32(eng.t.m)?;
            opt.v = eng.exec.read_f32(eng.t.v)?;
            let st = eng.exec.read_f32(eng.t.bn_state)?;
            let mut k = 0;
            for s in model.state_mut() {
                match s {
                    super::model::StateMut::F32(_, v) => {
                        let n = v.len();
                        v.copy_from_slice(&st[k..k + n]);
                        k += n;
                    }
                    super::model::StateMut::I64(_, v) => *v = eng.step as i64,
                }
            }
            let ts = super::checkpoint::TrainState { epoch: cfg.epochs, step: eng.step, seed: cfg.seed, world_size: world as u64 };
            super::checkpoint::save(path, &mut model, &opt, &ts)?;
        }
    }
    Ok(TrainOutcome { reports, params, activation_bytes: eng.t.arena_len.0 * 4 + eng.t.arena_len.1 * 4 + eng.t.arena_len.2 * 2 })
}
