//! [`Engine`] (a model's plans on an executor: step, evaluation, read-backs) and
//! [`train_device`] (the device engine in the epoch loop both engines share, `trainer/epoch.rs`).

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use super::error::DeviceError;
use super::exec::Exec;
use super::plan::{AdamHyper, Builder, Op, Precision, Tensors};
use super::recover;
use crate::checkpoint::{self, ScalerState, TrainState};
use crate::data::Dataset;
use crate::model::{Model, ModelError, StateMut};
use crate::precision::{LossScaler, StepAction};
use crate::trainer::epoch::{self, EpochEngine};
use crate::trainer::recover::{Position, Recovery};
use crate::trainer::{Observer, OptimizerKind, TrainConfig, TrainOutcome};
use lockstep::comm::{CommError, Communicator};

/// Options of the device engine beyond [`TrainConfig`].
#[derive(Clone, Copy, Debug)]
pub struct DeviceOptions {
    /// GEMM precision.
    pub precision: Precision,
    /// Read the loss back every this many steps (at least 1).
    pub loss_every: usize,
    /// The loss scaler fp16 starts from (unused in other precisions): GradScaler's defaults
    /// unless a test forces overflows with a huge initial scale.
    pub loss_scaler: LossScaler,
}

impl Default for DeviceOptions {
    fn default() -> Self {
        DeviceOptions {
            precision: Precision::Fp32,
            loss_every: 50,
            loss_scaler: LossScaler::default(),
        }
    }
}

/// A model's device step on an executor: tensors, cached plans, optimizer step count.
pub struct Engine<E: Exec> {
    /// The executor.
    pub exec: E,
    /// Tensor layout.
    pub t: Tensors,
    /// GEMM precision.
    pub precision: Precision,
    /// Adam hyper-parameters (lr comes per step).
    pub adam: AdamHyper,
    /// Optimizer steps taken (a step skipped by the loss scaler is not one).
    pub step: u64,
    /// Dynamic loss scaling (fp16 only): the host half of it, driven by the device's overflow
    /// flag once per step.
    scaler: Option<LossScaler>,
    /// `--clip-grad-norm`: the threshold of the global L2 norm of the averaged gradients.
    clip_grad_norm: Option<f32>,
    /// Offset of the test split in the dataset arenas (samples).
    test_offset: usize,
    plans: HashMap<u64, Vec<Op>>,
}

impl<E: Exec> Engine<E> {
    /// Lay out the tensors of `model`'s step for `batch` images, upload its parameters and
    /// BatchNorm running statistics, and zero the optimizer state.
    pub fn new(
        mut exec: E,
        model: &Model,
        batch: usize,
        precision: Precision,
    ) -> Result<Engine<E>, DeviceError> {
        let t = Tensors::new(model, batch, precision)?;
        exec.write_f32(t.params, &model.params)?;
        let zeros = vec![0.0f32; t.num_params];
        for r in [t.grads, t.m, t.v] {
            exec.write_f32(r, &zeros)?;
        }
        exec.write_f32(t.bn_state, &t.bn_init)?;
        exec.write_f32(t.loss.loss_sum, &[0.0])?;
        let scaler = precision.scales_loss().then(LossScaler::default);
        if let Some(sc) = scaler {
            exec.write_f32(t.amp.scale, &[sc.scale()])?;
            exec.write_f32(t.amp.found_inf, &[0.0])?;
        }
        Ok(Engine {
            exec,
            t,
            precision,
            adam: AdamHyper::default(),
            step: 0,
            scaler,
            clip_grad_norm: None,
            test_offset: 0,
            plans: HashMap::new(),
        })
    }

    /// Replace the loss scaler (fp16; refused in other precisions, which scale nothing) and upload
    /// its scale.
    pub fn set_loss_scaler(&mut self, scaler: LossScaler) -> Result<(), DeviceError> {
        if self.scaler.is_none() {
            return Err(DeviceError::Config(format!(
                "a loss scaler was given for precision {:?}, which does not scale the loss; only fp16 does",
                self.precision
            )));
        }
        self.exec.write_f32(self.t.amp.scale, &[scaler.scale()])?;
        self.scaler = Some(scaler);
        Ok(())
    }

    /// The loss scaler's state (fp16), e.g. its current scale and the steps it skipped.
    pub fn loss_scaler(&self) -> Option<&LossScaler> {
        self.scaler.as_ref()
    }

    /// Clip the global L2 norm of the averaged gradients to `max_norm` before every optimizer
    /// step, as `torch.nn.utils.clip_grad_norm_` and the CPU engine's `--clip-grad-norm` do
    /// (`None`: no clipping). The threshold must be a positive number.
    pub fn set_clip_grad_norm(&mut self, max_norm: Option<f32>) -> Result<(), DeviceError> {
        if let Some(c) = max_norm {
            if !(c.is_finite() && c > 0.0) {
                return Err(DeviceError::Config(format!(
                    "gradient clipping threshold {c}: use a positive number"
                )));
            }
        }
        self.clip_grad_norm = max_norm;
        Ok(())
    }

    /// The global gradient norm the last clipped step computed (waits); `None` without clipping.
    pub fn last_grad_norm(&mut self) -> Result<Option<f32>, DeviceError> {
        match self.clip_grad_norm {
            Some(_) => Ok(Some(self.exec.read_f32(self.t.clip.norm)?[0])),
            None => Ok(None),
        }
    }

    /// Fail if a clipped step found a gradient norm that is not finite (waits; the device
    /// records the first such step, which the CPU engine would have stopped at).
    pub fn check_grad_norm(&mut self) -> Result<(), DeviceError> {
        if self.clip_grad_norm.is_none() {
            return Ok(());
        }
        match self.exec.read_i32(self.t.clip.nonfinite_step)?[0] {
            0 => Ok(()),
            step => Err(DeviceError::NonFiniteGradNorm { step: step as u64 }),
        }
    }

    /// Upload both splits once; evaluation ids are offset past the training split.
    pub fn upload_dataset(&mut self, train: &Dataset, test: &Dataset) -> Result<(), DeviceError> {
        let [c, h, w] = self.t.sample_dims;
        let check = |d: &Dataset| {
            if c != 1 || (d.rows, d.cols) != (h, w) {
                return Err(DeviceError::Config(format!(
                    "the model expects {c}x{h}x{w} images, the dataset has 1x{}x{}: use the model's dataset",
                    d.rows, d.cols
                )));
            }
            Ok(())
        };
        check(train)?;
        if !test.is_empty() {
            check(test)?;
        }
        let mut images = Vec::with_capacity(train.images.len() + test.images.len());
        images.extend_from_slice(&train.images);
        images.extend_from_slice(&test.images);
        let mut labels = Vec::with_capacity(train.len() + test.len());
        labels.extend_from_slice(&train.labels);
        labels.extend_from_slice(&test.labels);
        let classes = self.t.classes;
        if let Some(&l) = labels.iter().find(|&&l| l as usize >= classes) {
            return Err(DeviceError::Model(ModelError::Label { label: l, classes }));
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

    /// Run the step (`train`) or evaluation plan for ids `start..start + b` of the index list;
    /// `what` names the pass in the message refusing a `b` the engine was not built for.
    fn run_batch(
        &mut self,
        what: &str,
        start: usize,
        b: usize,
        train: bool,
    ) -> Result<(), DeviceError> {
        if b == 0 || b > self.t.batch {
            return Err(DeviceError::Config(format!(
                "{what} of {b} images: the engine was built for 1..={}",
                self.t.batch
            )));
        }
        self.exec.select_indices(self.t.indices.prefix(b), start)?;
        let (key, _) = self.plan(b, train);
        let ops = self.plans.remove(&key).unwrap_or_default();
        let r = self.exec.run_step(key, &ops);
        self.plans.insert(key, ops);
        r
    }

    fn plan(&mut self, b: usize, train: bool) -> (u64, &[Op]) {
        let key = ((b as u64) << 1) | train as u64;
        let sm = self.exec.sm_count();
        let (t, p) = (&self.t, self.precision);
        let ops = self.plans.entry(key).or_insert_with(|| {
            if train {
                t.train_step(b, p, sm)
            } else {
                t.eval_step(b, p, sm)
            }
        });
        (key, ops)
    }

    /// Forward + backward on ids `start..start + b` of the index list (adds `b * loss` to the
    /// device loss accumulator), the gradient average over ranks when `comm` has several, then
    /// one Adam step with learning rate `lr`.
    ///
    /// In fp16 the backward is loss-scaled (inside the captured step), and after the all-reduce
    /// `amp_unscale_f32` divides the gradients by the scale and flags an inf or NaN; the flag
    /// (4 bytes) is read back, [`LossScaler::update`] decides, and on overflow the Adam launch is
    /// skipped: parameters, moments and [`Engine::step`] stay as they were, and the returned
    /// action is [`StepAction::Skip`]. Every rank unscales the same averaged gradients, so every
    /// rank skips the same steps and the replicas stay identical.
    ///
    /// With [`Engine::set_clip_grad_norm`], the gradients of an applied step are clipped right
    /// before Adam (after the all-reduce and the unscale): three launches compute the norm and
    /// the coefficient on the device and scale the gradients, with nothing read back. A norm that
    /// is not finite leaves the gradients alone and is reported by [`Engine::check_grad_norm`].
    pub fn train_step(
        &mut self,
        start: usize,
        b: usize,
        lr: f32,
        comm: Option<&mut Communicator>,
    ) -> Result<StepAction, DeviceError> {
        self.run_batch("step", start, b, true)?;
        if let Some(c) = comm {
            if c.world_size() > 1 {
                self.exec.all_reduce_mean(c, self.t.grads)?;
            }
        }
        if let Some(mut sc) = self.scaler {
            let mut ops = Builder::new(1);
            ops.amp_unscale(self.t.grads, self.t.amp.found_inf, self.t.amp.scale);
            self.exec.run(&ops.ops[0])?;
            let found_inf = self.exec.read_f32(self.t.amp.found_inf)?[0] != 0.0;
            let before = sc.scale();
            let action = sc.update(found_inf);
            if sc.scale() != before {
                // Stream-ordered before the next step's backward reads it.
                self.exec.write_f32(self.t.amp.scale, &[sc.scale()])?;
            }
            self.scaler = Some(sc);
            if action == StepAction::Skip {
                return Ok(StepAction::Skip);
            }
        }
        self.step += 1;
        let mut ops = Builder::new(1);
        if let Some(max_norm) = self.clip_grad_norm {
            ops.clip_grad_norm(self.t.grads, &self.t.clip, max_norm, self.step);
        }
        let moments = (self.t.m, self.t.v);
        ops.adam(
            self.t.params,
            self.t.grads,
            moments,
            &self.adam,
            lr,
            self.step,
        );
        for op in &ops.ops {
            self.exec.run(op)?;
        }
        Ok(StepAction::Apply)
    }

    /// Evaluate ids `start..start + b` of the index list; returns the correct predictions.
    pub fn eval_batch(&mut self, start: usize, b: usize) -> Result<u64, DeviceError> {
        self.run_batch("evaluation", start, b, false)?;
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

/// Train the FashionMNIST CNN (`Model::fashion_cnn`) on the executor `make_exec` builds for the given arena sizes (f32, i32,
/// bf16, f16 elements): the GPU one in `train-cnn --device cuda`, the CPU twins in tests. `comm` joins the ranks (gradient average, metrics); `None` trains alone.
///
/// As the CPU trainer: `cfg.resume` loads a checkpoint (parameters, BatchNorm statistics, Adam
/// moments and step, and in fp16 the loss scaler's state) on every rank and continues from its
/// epoch; rank 0's parameters and BatchNorm statistics are then broadcast, so replicas start
/// identical whatever each rank initialised or loaded; `cfg.save` is written by rank 0 after
/// every epoch (all ranks wait for it). `cfg.clip_grad_norm` clips on the device
/// ([`Engine::set_clip_grad_norm`]); a non-finite norm stops training at the end of its epoch.
pub fn train_device<E: Exec>(
    cfg: &TrainConfig,
    opts: &DeviceOptions,
    train_set: &Dataset,
    test_set: &Dataset,
    make_exec: impl FnOnce((usize, usize, usize, usize)) -> Result<E, DeviceError>,
    mut comm: Option<&mut Communicator>,
    obs: &mut dyn Observer,
) -> Result<TrainOutcome, DeviceError> {
    if cfg.sync_bn {
        return Err(DeviceError::Config(
            "--sync-bn is not supported with --device cuda yet; drop it or use --device cpu".into(),
        ));
    }
    cfg.check()
        .map_err(|e| DeviceError::Config(e.to_string()))?;
    // The device step is one Adam launch after one all-reduce per batch: the options that change
    // that are CPU-only for now, and said so rather than ignored.
    if cfg.optimizer != OptimizerKind::Adam {
        return Err(DeviceError::Config(
            "--optimizer sgd is not supported with --device cuda yet; use --optimizer adam or --device cpu".into(),
        ));
    }
    if cfg.grad_accum != 1 {
        return Err(DeviceError::Config(
            "--grad-accum is not supported with --device cuda yet; drop it or use --device cpu"
                .into(),
        ));
    }
    let (rank, world) = comm
        .as_deref()
        .map(|c| (c.rank(), c.world_size()))
        .unwrap_or((0, 1));
    let mut model = epoch::new_model(cfg, rank)?;
    let mut opt = crate::ops::optim::Adam::new(model.num_params(), cfg.lr);
    let recovery = Recovery::from_env()?;
    if recovery.is_some() && opts.precision.scales_loss() {
        return Err(DeviceError::Config(
            "--restart-policy rank: the device engine's in-job recovery does not carry the fp16 loss scaler's state; train in fp32 or bf16, or run under --restart-policy job (with --save/--resume)".into(),
        ));
    }
    let replacement = recovery.is_some_and(|r| r.replacement);
    let resumed = match (&cfg.resume, replacement) {
        // A replacement takes the survivors' state, not a checkpoint's.
        (Some(path), false) => Some(epoch::resume(path, &mut model, &mut opt, rank, world)?),
        _ => None,
    };
    let first_epoch = resumed.as_ref().map_or(0, |st| st.epoch);
    // The layout reads the (possibly resumed) BatchNorm statistics from the model.
    let layout = Tensors::new(&model, cfg.batch_size, opts.precision)?;
    let mut eng = Engine::new(
        make_exec(layout.arena_len)?,
        &model,
        cfg.batch_size,
        opts.precision,
    )?;
    if opts.precision.scales_loss() {
        // A resumed fp16 run continues with the scale, growth count and skip count it saved.
        let scaler = match resumed.as_ref().map(|st| st.loss_scaler) {
            Some(Some(saved)) => LossScaler::from_state(saved)
                .map_err(|e| DeviceError::Config(format!("resume: {e}")))?,
            Some(None) => {
                if rank == 0 {
                    tracing::warn!(
                        "resume: the checkpoint holds no loss-scaler state (written by an fp32 or bf16 run, or by an older lockstep); fp16 continues with a fresh scaler at scale {}",
                        opts.loss_scaler.scale()
                    );
                }
                opts.loss_scaler
            }
            None => opts.loss_scaler,
        };
        eng.set_loss_scaler(scaler)?;
    } else if let (Some(Some(_)), 0) = (resumed.as_ref().map(|st| st.loss_scaler), rank) {
        tracing::info!(
            "resume: the checkpoint's loss-scaler state (an fp16 run) is not used: precision {:?} scales no loss",
            opts.precision
        );
    }
    eng.set_clip_grad_norm(cfg.clip_grad_norm)?;
    if cfg.resume.is_some() {
        eng.exec.write_f32(eng.t.m, &opt.m)?;
        eng.exec.write_f32(eng.t.v, &opt.v)?;
        eng.step = opt.step;
    }
    let (mut first_step, mut joined_loss) = (0usize, None);
    let mut first_epoch = first_epoch;
    if let Some(c) = comm.as_deref_mut() {
        if replacement {
            // A replacement for a lost rank: the survivors' state and position, not its own start.
            let mut pos = Position {
                epoch: 0,
                step_in_epoch: 0,
                step_no: 0,
                loss_sum: 0.0,
            };
            recover::exchange_state(&mut eng.exec, &eng.t, c, true, &mut pos, cfg.seed)?;
            eng.step = pos.step_no;
            (first_epoch, first_step) = (pos.epoch, pos.step_in_epoch as usize);
            joined_loss = Some(pos.loss_sum);
        } else if world > 1 {
            // Replicas start identical: rank 0's parameters and running statistics win (DDP's
            // initial broadcast), instead of trusting every rank to derive the same ones.
            eng.exec.broadcast(c, eng.t.params, 0)?;
            eng.exec.broadcast(c, eng.t.bn_state, 0)?;
        }
    }
    eng.adam.weight_decay = cfg.weight_decay;
    eng.upload_dataset(train_set, test_set)?;
    let mut run = DeviceRun {
        cfg,
        eng,
        model,
        comm,
        rank,
        world,
        every: opts.loss_every.max(1),
        pending: None,
        last_sum: 0.0,
        last_images: 0,
        images: 0,
        skipped: 0,
        recovery,
        epoch: first_epoch,
        joined_loss,
    };
    let reports = epoch::run(
        &mut run,
        cfg,
        first_epoch,
        first_step,
        train_set,
        test_set,
        obs,
    )?;
    let eng = &mut run.eng;
    let params = eng.params()?;
    Ok(TrainOutcome {
        reports,
        params,
        activation_bytes: eng.t.arena_len.0 * 4
            + eng.t.arena_len.1 * 4
            + (eng.t.arena_len.2 + eng.t.arena_len.3) * 2,
    })
}

/// The device engine in the shared epoch loop: the engine, the model it checkpoints through,
/// and the asynchronous loss read-back of the current epoch.
struct DeviceRun<'a, 'c, E: Exec> {
    cfg: &'a TrainConfig,
    eng: Engine<E>,
    model: Model,
    comm: Option<&'c mut Communicator>,
    rank: usize,
    world: usize,
    /// Steps between loss read-backs.
    every: usize,
    /// Images seen when the pending read-back was started.
    pending: Option<usize>,
    /// The loss sum and image count the last collected read-back reported.
    last_sum: f64,
    last_images: usize,
    /// Images of this epoch so far.
    images: usize,
    /// Steps of this epoch the loss scaler skipped.
    skipped: u64,
    /// In-job recovery from a peer's death (`recover.rs`), when the launcher replaces ranks.
    recovery: Option<Recovery>,
    /// The epoch in progress (0-based).
    epoch: u64,
    /// The epoch's loss so far that a replacement rank received, for the epoch it joins.
    joined_loss: Option<f64>,
}

impl<E: Exec> DeviceRun<'_, '_, E> {
    /// After `cause` (a peer died in step `s` of the epoch): grow the communicator back with the
    /// replacement, send it the state, and get ready to do step `s` again.
    fn recover(&mut self, s: usize, cause: &CommError) -> Result<(), DeviceError> {
        let t = Instant::now();
        let (Some(rec), Some(comm)) = (self.recovery.as_mut(), self.comm.as_deref_mut()) else {
            return Err(DeviceError::Comm(CommError::Unsupported(format!(
                "in-job recovery is not set up for this run after: {cause}"
            ))));
        };
        let grow_s = rec.grow(comm, cause)?;
        let mut pos = Position {
            epoch: self.epoch,
            step_in_epoch: s as u64,
            step_no: self.eng.step,
            loss_sum: self.eng.exec.read_f32(self.eng.t.loss.loss_sum)?[0] as f64,
        };
        let eng = &mut self.eng;
        recover::exchange_state(&mut eng.exec, &eng.t, comm, false, &mut pos, self.cfg.seed)?;
        tracing::info!(
            "rank {}: recovered in {:.2} s (grow {:.2} s): doing epoch {} step {} again with the replacement",
            comm.rank(),
            t.elapsed().as_secs_f64(),
            grow_s,
            self.epoch + 1,
            s + 1
        );
        Ok(())
    }
}

impl<E: Exec> EpochEngine for DeviceRun<'_, '_, E> {
    type Error = DeviceError;

    fn rank_world(&self) -> (usize, usize) {
        (self.rank, self.world)
    }

    fn start_epoch(&mut self, epoch: u64, idx: &[usize]) -> Result<(), DeviceError> {
        self.epoch = epoch;
        self.eng.set_index_list(idx, false)?;
        self.eng.reset_loss_sum()?;
        if let Some(l) = self.joined_loss.take() {
            self.eng
                .exec
                .write_f32(self.eng.t.loss.loss_sum, &[l as f32])?;
        }
        (self.pending, self.last_sum, self.last_images, self.images) = (None, 0.0, 0, 0);
        self.skipped = 0;
        Ok(())
    }

    fn train_step(
        &mut self,
        s: usize,
        start: usize,
        group: &[&[usize]],
    ) -> Result<Option<f32>, DeviceError> {
        // `grad_accum` is 1 on the device engine (checked above): one micro-batch per step.
        let b = group.iter().map(|c| c.len()).sum::<usize>();
        let lr = self.cfg.schedule.lr(self.cfg.lr, self.eng.step);
        let action = loop {
            let snap = match self.recovery {
                Some(_) => Some(recover::StepSnapshot::take(
                    &mut self.eng.exec,
                    &self.eng.t,
                )?),
                None => None,
            };
            match self.eng.train_step(start, b, lr, self.comm.as_deref_mut()) {
                Err(DeviceError::Comm(e))
                    if self.recovery.is_some_and(|r| r.can_recover_comm(&e)) =>
                {
                    // The step is done again from its start: its gradients are dropped, and
                    // what its forward pass moved is put back.
                    if let Some(snap) = snap {
                        snap.restore(&mut self.eng.exec, &self.eng.t)?;
                    }
                    self.recover(s, &e)?;
                }
                r => break r?,
            }
        };
        if action == StepAction::Skip {
            self.skipped += 1;
        }
        self.images += b;
        let mut shown = None;
        if (s + 1).is_multiple_of(self.every) {
            // Collect the read-back started `every` steps ago (long finished), start a new one.
            if let Some(at) = self.pending.take() {
                let sum = self.eng.exec.finish_read()?[0] as f64;
                let loss = (sum - self.last_sum) / (at - self.last_images).max(1) as f64;
                (self.last_sum, self.last_images) = (sum, at);
                shown = Some(loss as f32);
            }
            self.eng.exec.start_read(self.eng.t.loss.loss_sum)?;
            self.pending = Some(self.images);
        }
        Ok(shown)
    }

    fn finish_steps(&mut self) -> Result<f64, DeviceError> {
        if self.pending.take().is_some() {
            self.eng.exec.finish_read()?;
        }
        let loss_sum = self.eng.exec.read_f32(self.eng.t.loss.loss_sum)?[0] as f64;
        // Every rank clipped the same averaged gradients, so every rank stops here alike.
        self.eng.check_grad_norm()?;
        Ok(loss_sum)
    }

    fn sum_over_ranks(&mut self, v: &mut [f64]) -> Result<(), DeviceError> {
        if let (Some(c), true) = (self.comm.as_deref_mut(), self.world > 1) {
            self.eng.exec.all_reduce_sum_host(c, v)?;
        }
        Ok(())
    }

    fn broadcast_buffers(&mut self) -> Result<(), DeviceError> {
        if let (Some(c), true) = (self.comm.as_deref_mut(), self.world > 1) {
            self.eng.exec.broadcast(c, self.eng.t.bn_state, 0)?;
        }
        Ok(())
    }

    fn count_correct(
        &mut self,
        _test: &Dataset,
        ids: &[usize],
        real: usize,
    ) -> Result<u64, DeviceError> {
        // The test split is on the device already (`upload_dataset`); padding is not run.
        let mut correct = 0u64;
        if real > 0 {
            self.eng.set_index_list(&ids[..real], true)?;
            for start in (0..real).step_by(self.cfg.batch_size) {
                let b = self.cfg.batch_size.min(real - start);
                correct += self.eng.eval_batch(start, b)?;
            }
        }
        Ok(correct)
    }

    fn skipped_steps(&self) -> u64 {
        self.skipped
    }

    fn loss_scaler(&self) -> Option<ScalerState> {
        self.eng.loss_scaler().map(LossScaler::state)
    }

    fn optimizer_step(&self) -> u64 {
        self.eng.step
    }

    fn save(&mut self, path: &Path, st: &TrainState) -> Result<(), DeviceError> {
        save_checkpoint(&mut self.eng, &mut self.model, self.cfg.lr, path, st)
    }

    fn barrier(&mut self) -> Result<(), DeviceError> {
        if let Some(c) = self.comm.as_deref_mut() {
            c.barrier()?;
        }
        Ok(())
    }
}

/// Write the device state as a checkpoint (the CPU trainer's format: PyTorch names, Adam state
/// beside): parameters, moments and BatchNorm statistics read back into `model` and an Adam.
fn save_checkpoint<E: Exec>(
    eng: &mut Engine<E>,
    model: &mut Model,
    lr: f32,
    path: &Path,
    ts: &TrainState,
) -> Result<(), DeviceError> {
    model.params.copy_from_slice(&eng.params()?);
    let mut opt = crate::ops::optim::Adam::new(model.num_params(), lr);
    opt.step = eng.step;
    opt.m = eng.exec.read_f32(eng.t.m)?;
    opt.v = eng.exec.read_f32(eng.t.v)?;
    let st = eng.exec.read_f32(eng.t.bn_state)?;
    let base = eng.t.bn_state.off;
    for s in model.state_mut() {
        match s {
            StateMut::F32(name, v) => {
                let r = eng.t.bn_names.iter().find(|(n, _)| *n == name).map(|(_, r)| *r).ok_or_else(|| {
                    DeviceError::Config(format!("the device engine keeps no copy of state {name}, so it cannot checkpoint it"))
                })?;
                v.copy_from_slice(&st[r.off - base..r.off - base + r.len]);
            }
            StateMut::I64(_, v) => *v = eng.step as i64,
        }
    }
    checkpoint::save(path, model, &opt, ts)?;
    Ok(())
}
