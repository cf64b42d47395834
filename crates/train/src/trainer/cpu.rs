//! The CPU engine of the epoch loop: the model's forward and backward on this rank's
//! micro-batches, the bucketed gradient all-reduce, clipping and the optimizer step.

use std::ops::{Deref, DerefMut, Range};
use std::time::Instant;

use super::config::{Observer, OptimizerKind, TrainConfig, TrainError, TrainOutcome};
use super::epoch::{self, EpochEngine};
use super::recover::{exchange_state, Position, Recovery};
use crate::checkpoint::{self, TrainState};
use crate::data::Dataset;
use crate::model::{Model, StateMut};
use crate::ops::optim::{Adam, Sgd};
use crate::sampler::{counts_for_metrics, DistributedSampler};
use lockstep::comm::SharedBuffer;
use lockstep::comm::{CommError, Communicator, ReduceOp};

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

/// Fill the model input with samples `idx` of `data` (pixels / 255) and `labels` with their
/// labels: the CPU engine's batch, and the reference loop's of the tests.
pub fn load_batch(model: &mut Model, data: &Dataset, idx: &[usize], labels: &mut Vec<u8>) {
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
        (sync_bn && comm.world_size() > 1).then_some(&mut *comm),
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
             optimizer {}, evaluation {}; forward+backward per step min {:.1} median {:.1} p90 {:.1} max {:.1} ms",
            wall * 1e3,
            f(&self.batch),
            f(&self.compute),
            f(&self.reduce),
            f(&self.optim),
            f(&self.eval),
            q(0.0),
            q(0.5),
            q(0.9),
            q(1.0)
        );
    }
}

/// [`step_gradients`] without the all-reduce: the gradients of this rank's micro-batches.
/// `sync_bn` is the communicator synchronised BatchNorm sums its statistics over (`None`: each
/// rank normalises with its own batch).
fn local_gradients(
    model: &mut Model,
    data: &Dataset,
    micro: &[&[usize]],
    grads: &mut [f32],
    labels: &mut Vec<u8>,
    mut sync_bn: Option<&mut Communicator>,
    ph: &mut Phases,
) -> Result<(f64, usize), TrainError> {
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
        let loss = if let Some(comm) = sync_bn.as_deref_mut() {
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
    let real = (0..idx.len()).take_while(|&k| sampler.is_real(k)).count();
    let correct = count_correct(model, test, &idx, real, batch);
    Ok(counts_for_metrics(comm, correct, real as u64)?)
}

/// Correct predictions among the first `real` samples of `ids`, in batches of `batch` (the
/// padding after them runs too, so every batch but the last is full, and is not counted).
fn count_correct(
    model: &mut Model,
    test: &Dataset,
    ids: &[usize],
    real: usize,
    batch: usize,
) -> u64 {
    let mut correct = 0u64;
    let (mut labels, mut pred) = (Vec::with_capacity(batch), Vec::with_capacity(batch));
    for (bi, chunk) in ids.chunks(batch).enumerate() {
        load_batch(model, test, chunk, &mut labels);
        model.forward(false);
        model.argmax(&mut pred);
        for (k, (p, l)) in pred.iter().zip(&labels).enumerate() {
            correct += (bi * batch + k < real && p == l) as u64;
        }
    }
    correct
}

/// The CPU engine of one run: the model replica, its optimizer and gradients, and this
/// epoch's loss and phase timings.
struct CpuEngine<'a> {
    cfg: &'a TrainConfig,
    train_set: &'a Dataset,
    comm: &'a mut Communicator,
    model: Model,
    opt: Optimizer,
    grads: Grads,
    buckets: Vec<Range<usize>>,
    labels: Vec<u8>,
    /// Optimizer steps taken (Adam keeps its own count too; a resume restores it).
    step_no: u64,
    loss_sum: f64,
    ph: Phases,
    /// Started when the steps end: the reductions, BatchNorm broadcast and evaluation.
    eval: Option<Stopwatch>,
    /// In-job recovery from a peer's death (`recover`), when the launcher replaces ranks.
    recovery: Option<Recovery>,
    /// The epoch in progress (0-based).
    epoch: u64,
    /// The epoch's loss so far that a replacement rank received, for the epoch it joins.
    joined_loss: Option<f64>,
}

/// BatchNorm running statistics and counters, saved before a step so that a step done again
/// after a recovery updates them once.
struct BnSnapshot {
    f: Vec<f32>,
    i: Vec<i64>,
}

impl BnSnapshot {
    fn take(model: &mut Model) -> BnSnapshot {
        let (mut f, mut i) = (Vec::new(), Vec::new());
        for s in model.state_mut() {
            match s {
                StateMut::F32(_, v) => f.extend_from_slice(v),
                StateMut::I64(_, v) => i.push(*v),
            }
        }
        BnSnapshot { f, i }
    }

    fn restore(&self, model: &mut Model) {
        let (mut f, mut i) = (&self.f[..], self.i.iter());
        for s in model.state_mut() {
            match s {
                StateMut::F32(_, v) => {
                    let (head, rest) = f.split_at(v.len());
                    v.copy_from_slice(head);
                    f = rest;
                }
                StateMut::I64(_, v) => *v = i.next().copied().unwrap_or(*v),
            }
        }
    }
}

/// The flat gradient buffer: shared memory for zero-copy all-reduce when the backend offers it
/// and there are peers, else a plain vector.
fn alloc_grads(comm: &mut Communicator, n: usize) -> Grads {
    match comm.alloc_shared::<f32>(n) {
        Ok(b) if comm.world_size() > 1 => Grads::Shared(b),
        _ => Grads::Local(vec![0.0; n]),
    }
}

impl CpuEngine<'_> {
    /// One optimizer step over the micro-batches `group`: local gradients, all-reduce,
    /// clipping and the update. A failure leaves the parameters and the optimizer untouched.
    fn step_once(&mut self, group: &[&[usize]]) -> Result<Option<f32>, TrainError> {
        let (cfg, ph) = (self.cfg, &mut self.ph);
        let (l, n) = local_gradients(
            &mut self.model,
            self.train_set,
            group,
            &mut self.grads,
            &mut self.labels,
            (cfg.sync_bn && self.comm.world_size() > 1).then_some(&mut *self.comm),
            ph,
        )?;
        let t = Stopwatch::start();
        all_reduce_grads(self.comm, &mut self.grads, &self.buckets)?;
        t.stop(&mut ph.reduce);
        let t = Stopwatch::start();
        self.step_no += 1;
        if let Some(max) = cfg.clip_grad_norm {
            let norm = clip_grad_norm(&mut self.grads, max);
            if !norm.is_finite() {
                return Err(TrainError::NonFinite {
                    norm,
                    step: self.step_no,
                });
            }
        }
        self.opt.step(
            cfg.schedule.lr(cfg.lr, self.step_no - 1),
            &mut self.model.params,
            &self.grads,
        );
        t.stop(&mut ph.optim);
        self.loss_sum += l;
        Ok(Some((l / n.max(1) as f64) as f32))
    }

    /// After `cause` (a peer died in step `s` of the epoch): grow the communicator back with
    /// the replacement, send it the state, and get ready to do step `s` again.
    fn recover(&mut self, s: usize, cause: &TrainError) -> Result<(), TrainError> {
        let t = Instant::now();
        let (Some(rec), Optimizer::Adam(opt)) = (self.recovery.as_mut(), &mut self.opt) else {
            return Err(TrainError::Config(format!(
                "in-job recovery is not set up for this run (Adam and --restart-policy rank are needed) after: {cause}"
            )));
        };
        let grow_s = rec.grow(self.comm, cause)?;
        self.grads = alloc_grads(self.comm, self.model.num_params());
        let mut pos = Position {
            epoch: self.epoch,
            step_in_epoch: s as u64,
            step_no: self.step_no,
            loss_sum: self.loss_sum,
        };
        exchange_state(
            self.comm,
            false,
            &mut self.model,
            opt,
            &mut pos,
            self.cfg.seed,
        )?;
        tracing::info!(
            "rank {}: recovered in {:.2} s (grow {:.2} s): doing epoch {} step {} again with the replacement",
            self.comm.rank(),
            t.elapsed().as_secs_f64(),
            grow_s,
            self.epoch + 1,
            s + 1
        );
        Ok(())
    }
}

impl EpochEngine for CpuEngine<'_> {
    type Error = TrainError;

    fn rank_world(&self) -> (usize, usize) {
        (self.comm.rank(), self.comm.world_size())
    }

    fn start_epoch(&mut self, epoch: u64, idx: &[usize]) -> Result<(), TrainError> {
        self.epoch = epoch;
        self.loss_sum = self.joined_loss.take().unwrap_or(0.0);
        self.ph = Phases {
            steps_ms: Vec::with_capacity(idx.len().div_ceil(self.cfg.batch_size)),
            ..Phases::default()
        };
        Ok(())
    }

    fn train_step(
        &mut self,
        s: usize,
        _start: usize,
        group: &[&[usize]],
    ) -> Result<Option<f32>, TrainError> {
        loop {
            let bn = self.recovery.map(|_| BnSnapshot::take(&mut self.model));
            match self.step_once(group) {
                Err(e) if self.recovery.is_some_and(|r| r.can_recover(&e)) => {
                    // The step is done again from its start: its gradients are dropped, and
                    // the statistics its forward passes moved are put back.
                    if let Some(bn) = bn {
                        bn.restore(&mut self.model);
                    }
                    self.recover(s, &e)?;
                }
                r => return r,
            }
        }
    }

    fn finish_steps(&mut self) -> Result<f64, TrainError> {
        self.eval = Some(Stopwatch::start());
        Ok(self.loss_sum)
    }

    fn sum_over_ranks(&mut self, v: &mut [f64]) -> Result<(), TrainError> {
        Ok(self.comm.all_reduce_in_place(v, ReduceOp::Sum)?)
    }

    fn broadcast_buffers(&mut self) -> Result<(), TrainError> {
        Ok(broadcast_bn_state(self.comm, &mut self.model)?)
    }

    fn count_correct(
        &mut self,
        test: &Dataset,
        ids: &[usize],
        real: usize,
    ) -> Result<u64, TrainError> {
        Ok(count_correct(
            &mut self.model,
            test,
            ids,
            real,
            self.cfg.batch_size,
        ))
    }

    fn epoch_done(&mut self, epoch: u64, wall: f64) {
        if let Some(t) = self.eval.take() {
            t.stop(&mut self.ph.eval);
        }
        self.ph.log(self.comm.rank(), epoch, wall);
    }

    fn optimizer_step(&self) -> u64 {
        match &self.opt {
            Optimizer::Adam(a) => a.step,
            Optimizer::Sgd(_) => self.step_no,
        }
    }

    fn save(&mut self, path: &std::path::Path, st: &TrainState) -> Result<(), TrainError> {
        // `TrainConfig::check` refuses --save without Adam: checkpoints hold Adam's state only.
        if let Optimizer::Adam(opt) = &self.opt {
            checkpoint::save(path, &mut self.model, opt, st)?;
        }
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), TrainError> {
        Ok(self.comm.barrier()?)
    }
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
    let mut model = epoch::new_model(cfg, rank)?;
    model.set_sync_bn(cfg.sync_bn && world > 1);
    let mut opt = Optimizer::new(cfg.optimizer, model.num_params(), cfg.lr, cfg.weight_decay);
    let (mut step_no, mut first_epoch, mut first_step) = (0u64, 0u64, 0usize);
    let recovery = Recovery::from_env()?;
    if recovery.is_some() && !matches!(opt, Optimizer::Adam(_)) {
        return Err(TrainError::Config(
            "--restart-policy rank: in-job recovery sends the replacement Adam's state (what a checkpoint holds); train with Adam, or run under --restart-policy job".into(),
        ));
    }
    let replacement = recovery.is_some_and(|r| r.replacement);
    let mut joined_loss = None;
    if let (Some(path), Optimizer::Adam(opt), false) = (&cfg.resume, &mut opt, replacement) {
        let st = epoch::resume(path, &mut model, opt, rank, world)?;
        first_epoch = st.epoch;
        step_no = st.step;
    }
    if let (true, Optimizer::Adam(opt)) = (replacement, &mut opt) {
        // A replacement for a lost rank: the survivors' state, not its own start.
        let mut pos = Position {
            epoch: 0,
            step_in_epoch: 0,
            step_no: 0,
            loss_sum: 0.0,
        };
        exchange_state(comm, true, &mut model, opt, &mut pos, cfg.seed)?;
        (first_epoch, first_step, step_no) = (pos.epoch, pos.step_in_epoch as usize, pos.step_no);
        joined_loss = Some(pos.loss_sum);
    } else if world > 1 {
        // Replicas start identical: rank 0's parameters (and BN state) win.
        comm.broadcast_in_place(&mut model.params[..], 0)?;
        broadcast_bn_state(comm, &mut model)?;
    }
    let grads = alloc_grads(comm, model.num_params());
    let mut eng = CpuEngine {
        cfg,
        train_set,
        buckets: buckets(&model, cfg.bucket_bytes),
        comm,
        model,
        opt,
        grads,
        labels: Vec::with_capacity(cfg.batch_size),
        step_no,
        loss_sum: 0.0,
        ph: Phases::default(),
        eval: None,
        recovery,
        epoch: first_epoch,
        joined_loss,
    };
    let reports = epoch::run(
        &mut eng,
        cfg,
        first_epoch,
        first_step,
        train_set,
        test_set,
        obs,
    )?;
    Ok(TrainOutcome {
        reports,
        params: eng.model.params.clone(),
        activation_bytes: eng.model.activation_bytes(),
    })
}
