//! A model's device step, derived from its layers: every tensor the step touches laid out as
//! regions of the arenas ([`Tensors`]), and the launch sequence of forward, loss and backward.
//!
//! Nothing about the network is written down here: layer kinds, shapes and BatchNorm settings are
//! read from each layer's [`LayerSpec`], parameter offsets from the [`Model`] (the CPU engine's `Model::fashion_cnn` for
//! `train-cnn`), so both engines share one flat parameter layout. The device engine runs the
//! layers it has kernels for (Conv2d, BatchNorm2d, ReLU, MaxPool2d, Flatten, Linear, then the
//! softmax cross-entropy loss); any other model is refused with
//! [`DeviceError::UnsupportedModel`] naming the layer.
//!
//! A ReLU right after BatchNorm2d or Linear is fused into that layer's forward kernel (`relu = 1`);
//! BatchNorm's backward kernel undoes it itself, Linear's gets a `relu_backward` first. Flatten is
//! free: NCHW already is PyTorch's flatten order, so its output is its input region.
//!
//! Layout order (kept stable so plans stay comparable): parameters, gradients, Adam moments, the
//! 16-bit parameter copy; the BatchNorm running statistics (contiguous, one broadcast), then each
//! BatchNorm's saved batch statistics; the batch's sample ids and labels; the input and every
//! stage's output (and pooling argmax) in forward order; the loss tensors; fp16's loss scale and
//! overflow flag; the gradients in backward order; the split-K workspace of the weight
//! gradients; the 16-bit copies of the GEMM operands (inputs in forward order, output gradients
//! in backward order). 16-bit copies live in the `Bf16` arena in bf16 precision and in the `F16`
//! arena in fp16 precision. Every region is 16-element aligned.
//!
//! Split-K: a weight gradient whose output tile grid is small (conv1's is one tile) splits its
//! K = batch x pixels into slices that run on many SMs. Each slice writes its partial sums to its
//! own plane of the workspace and `splitk_reduce_f32` adds the planes in slice order, so the
//! result does not depend on which block finishes first: the step is bit-identical run to run
//! and between graph replay and plain launches. The workspace is sized for `SPLIT_K_MAX_SMS`
//! (`builder.rs`; the SM count is not known when the arenas are laid out); stages run in stream
//! order, so one workspace serves them all.

use super::builder::{splitk_workspace_len, Builder, CLIP_PARTIALS};
use super::ir::{
    AmpTensors, Arena, BnTensors, ClipTensors, LossTensors, Op, ParamAt, Precision, Region,
};
use crate::device::error::DeviceError;
use crate::model::{Model, ModelError};
use crate::ops::{Bn2dShape, Conv2dShape, Layer, LayerSpec, LinearShape, Pool2dShape};

/// What one stage computes: one model layer, or two when a ReLU is fused into the layer before.
#[derive(Clone, Debug)]
enum Kind {
    /// `conv` for one sample (`batch` 1): each step launches it with its own batch.
    Conv {
        conv: Conv2dShape,
        weight: ParamAt,
        bias: ParamAt,
    },
    /// `bn` for one sample (`batch` 1): each step launches it with its own batch.
    BatchNorm {
        t: BnTensors,
        bn: Bn2dShape,
        weight: ParamAt,
        bias: ParamAt,
    },
    Relu,
    /// `pool` for one sample (`batch` 1): each step launches it with its own batch.
    MaxPool {
        pool: Pool2dShape,
        argmax: Region,
    },
    Flatten,
    /// `linear` for one sample (`batch` 1), as `conv`; `dpre`: the gradient before the fused
    /// ReLU (empty without one).
    Linear {
        linear: LinearShape,
        relu: bool,
        weight: ParamAt,
        bias: ParamAt,
        dpre: Region,
    },
}

impl Kind {
    /// Conv and linear run on the GEMM core and take 16-bit operands in bf16 and fp16 precision.
    fn is_gemm(&self) -> bool {
        matches!(self, Kind::Conv { .. } | Kind::Linear { .. })
    }
}

/// One stage with its tensors, every region sized for the largest batch.
#[derive(Clone, Debug)]
struct Stage {
    kind: Kind,
    /// Input activation, `in_per` elements per sample.
    inp: Region,
    in_per: usize,
    /// Output activation, `out_per` elements per sample.
    out: Region,
    out_per: usize,
    /// Gradient at the output: the next stage's input gradient, or `dlogits` for the last stage.
    dout: Region,
    /// Gradient at the input; `None` only for a conv or linear first stage (nothing upstream needs
    /// it, and their kernels can skip it). Every other stage has one: its kernel writes it.
    din: Option<Region>,
    /// 16-bit copy of the input, made in forward and kept for the weight gradient (GEMM stages in
    /// bf16 or fp16 precision; empty otherwise).
    bf_in: Region,
    /// 16-bit copy of the output gradient (after the fused ReLU's backward, for a linear one).
    bf_dout: Region,
}

/// `l`'s spec, or [`DeviceError::UnsupportedModel`] for a layer kind without device kernels.
fn known(name: &str, l: &dyn Layer) -> Result<LayerSpec, DeviceError> {
    match l.spec() {
        LayerSpec::Other(kind) => Err(DeviceError::UnsupportedModel {
            layer: format!("{name} ({kind})"),
            why: "there are no device kernels for this layer kind (supported: conv2d, batchnorm2d, relu, maxpool2d, flatten, linear)"
                .into(),
        }),
        spec => Ok(spec),
    }
}

/// Bump allocator over the four tensor arenas.
struct Alloc {
    len: [usize; 4],
}

impl Alloc {
    fn take(&mut self, arena: Arena, len: usize) -> Region {
        let k = match arena {
            Arena::F32 => 0,
            Arena::I32 => 1,
            Arena::Bf16 => 2,
            Arena::F16 => 3,
            // The dataset arenas are uploaded whole, never carved into tensors.
            Arena::Images | Arena::Labels => {
                unreachable!("the schedule only allocates f32, i32, bf16 and f16 tensors")
            }
        };
        // Keep every region 16-element aligned (64 bytes for f32), so vector loads stay aligned.
        let off = self.len[k].next_multiple_of(16);
        self.len[k] = off + len;
        Region { arena, off, len }
    }
}

/// Placeholder until the allocation pass that owns the region reaches it.
const UNSET: Region = Region {
    arena: Arena::F32,
    off: 0,
    len: 0,
};

/// Every tensor of a model's device step, sized for up to `batch` (B) images, and the step's
/// launch sequence ([`Tensors::train_step`], [`Tensors::eval_step`]).
#[derive(Clone, Debug)]
pub struct Tensors {
    /// Largest batch the activations hold.
    pub batch: usize,
    /// Parameter count.
    pub num_params: usize,
    /// Flat parameters, `state_dict` order `(P)`.
    pub params: Region,
    /// Flat gradients `(P)`.
    pub grads: Region,
    /// Adam first moments `(P)`.
    pub m: Region,
    /// Adam second moments `(P)`.
    pub v: Region,
    /// 16-bit copy of the parameters `(P)`: bf16 in bf16 precision, fp16 (arena `F16`) in fp16
    /// precision, empty in fp32.
    pub params_bf: Region,
    /// Running statistics of every BatchNorm layer (`running_mean` then `running_var`, layer by
    /// layer), contiguous for one broadcast.
    pub bn_state: Region,
    /// The full state name of each part of `bn_state` (`module1.1.running_var`), for checkpoints.
    pub bn_names: Vec<(String, Region)>,
    /// The model's running statistics when the layout was made, in `bn_state` order.
    pub bn_init: Vec<f32>,
    /// Sample ids of the batch `(B)` i32.
    pub indices: Region,
    /// Labels of the batch `(B)` i32.
    pub labels: Region,
    /// Dimensions of one input sample `[C, H, W]`.
    pub sample_dims: [usize; 3],
    /// Input `(B, C, H, W)`.
    pub x: Region,
    /// Number of classes (the last layer's width).
    pub classes: usize,
    /// Last layer's output `(B, classes)`.
    pub logits: Region,
    /// Loss tensors.
    pub loss: LossTensors,
    /// Gradient at the logits `(B, classes)`.
    pub dlogits: Region,
    /// Split-K workspace of the weight gradients (f32; empty when no GEMM needs one).
    pub splitk: Region,
    /// Loss-scaling state (fp16 precision; empty regions otherwise).
    pub amp: AmpTensors,
    /// Gradient-norm clipping state (used with `--clip-grad-norm`).
    pub clip: ClipTensors,
    /// Elements of each arena: (f32, i32, bf16, f16).
    pub arena_len: (usize, usize, usize, usize),
    stages: Vec<Stage>,
}

impl Tensors {
    /// Derive the stages from `model`'s layers and lay out every tensor for up to `batch`
    /// images; parameter offsets are the model's own (`Model::entries`).
    pub fn new(model: &Model, batch: usize, precision: Precision) -> Result<Tensors, DeviceError> {
        if batch == 0 {
            return Err(DeviceError::Config("batch size must be at least 1".into()));
        }
        let sample_dims: [usize; 3] =
            model
                .sample_dims()
                .try_into()
                .map_err(|_| DeviceError::UnsupportedModel {
                    layer: "input".into(),
                    why: format!(
                    "the device engine feeds image batches [N, C, H, W]; the model takes [N, {:?}]",
                    model.sample_dims()
                ),
                })?;
        let param = |layer: &str, p: &str, want: usize| -> Result<ParamAt, DeviceError> {
            let full = format!("{layer}.{p}");
            match model.entries.iter().find(|e| e.name == full) {
                Some(e) if e.range.len() == want => Ok(ParamAt {
                    off: e.range.start,
                    len: e.range.len(),
                }),
                found => Err(DeviceError::UnsupportedModel {
                    layer: layer.into(),
                    why: format!(
                        "parameter {full} should hold {want} elements, the model has {:?}",
                        found.map(|e| e.range.len())
                    ),
                }),
            }
        };

        // Pass 1: stages, shapes and parameters, from the layers.
        let layers: Vec<(&str, &dyn Layer)> = model.layers().collect();
        if layers.is_empty() {
            return Err(DeviceError::UnsupportedModel {
                layer: "(none)".into(),
                why: "the model has no layers".into(),
            });
        }
        // The BatchNorm layers, in stage order, for their running statistics: (name, channels, layer).
        let mut bns: Vec<(&str, usize, &dyn Layer)> = Vec::new();
        let mut stages: Vec<Stage> = Vec::new();
        let mut dims: Vec<usize> = sample_dims.to_vec();
        let mut k = 0;
        while k < layers.len() {
            let (name, l) = layers[k];
            let relu_next = layers
                .get(k + 1)
                .is_some_and(|(_, n)| n.spec() == LayerSpec::Relu);
            let with_batch: Vec<usize> =
                std::iter::once(batch).chain(dims.iter().copied()).collect();
            let out_dims = l.out_dims(&with_batch).map_err(|why| ModelError::Shape {
                name: name.into(),
                kind: l.kind(),
                dims: with_batch.clone(),
                why,
            })?[1..]
                .to_vec();
            let (kind, consumed) = match known(name, l)? {
                LayerSpec::Conv2d(p) => {
                    let weight = param(name, "weight", p.out_c * p.k())?;
                    (
                        Kind::Conv {
                            conv: p.for_input(1, dims[1], dims[2]),
                            weight,
                            bias: param(name, "bias", p.out_c)?,
                        },
                        1,
                    )
                }
                LayerSpec::BatchNorm2d {
                    channels: c,
                    momentum,
                    eps,
                    sync,
                } => {
                    if sync {
                        return Err(DeviceError::UnsupportedModel {
                            layer: name.into(),
                            why: "synchronised BatchNorm (--sync-bn) has no device kernels".into(),
                        });
                    }
                    bns.push((name, c, l));
                    let (weight, bias) = (param(name, "weight", c)?, param(name, "bias", c)?);
                    let t = BnTensors {
                        mean: UNSET,
                        invstd: UNSET,
                        running_mean: UNSET,
                        running_var: UNSET,
                    };
                    let bn = Bn2dShape {
                        batch: 1,
                        channels: c,
                        hw: dims[1] * dims[2],
                        momentum,
                        eps,
                        relu: relu_next,
                    };
                    let kind = Kind::BatchNorm {
                        t,
                        bn,
                        weight,
                        bias,
                    };
                    (kind, 1 + relu_next as usize)
                }
                LayerSpec::Relu => (Kind::Relu, 1),
                LayerSpec::MaxPool2d { kernel, stride } => (
                    Kind::MaxPool {
                        pool: Pool2dShape {
                            batch: 1,
                            channels: dims[0],
                            in_h: dims[1],
                            in_w: dims[2],
                            kernel,
                            stride,
                        },
                        argmax: UNSET,
                    },
                    1,
                ),
                LayerSpec::Flatten => (Kind::Flatten, 1),
                LayerSpec::Linear { in_f, out_f } => {
                    let (weight, bias) = (
                        param(name, "weight", out_f * in_f)?,
                        param(name, "bias", out_f)?,
                    );
                    (
                        Kind::Linear {
                            linear: LinearShape {
                                batch: 1,
                                in_f,
                                out_f,
                            },
                            relu: relu_next,
                            weight,
                            bias,
                            dpre: UNSET,
                        },
                        1 + relu_next as usize,
                    )
                }
                LayerSpec::Other(_) => unreachable!("`known` refuses layers without kernels"),
            };
            let (in_per, out_per) = (dims.iter().product(), out_dims.iter().product());
            stages.push(Stage {
                kind,
                inp: UNSET,
                in_per,
                out: UNSET,
                out_per,
                dout: UNSET,
                din: None,
                bf_in: UNSET,
                bf_dout: UNSET,
            });
            dims = out_dims;
            k += consumed;
        }
        let classes = match dims[..] {
            [c] if c > 0 => c,
            _ => {
                return Err(DeviceError::UnsupportedModel {
                    layer: layers[layers.len() - 1].0.into(),
                    why: format!("the softmax cross-entropy loss needs [N, classes] logits, the model ends in [N, {dims:?}]"),
                })
            }
        };
        let largest = stages
            .iter()
            .map(|s| s.in_per.max(s.out_per))
            .max()
            .unwrap_or(0);
        if batch
            .checked_mul(largest)
            .is_none_or(|n| n > i32::MAX as usize)
        {
            return Err(DeviceError::Config(format!(
                "batch {batch} x {largest} elements per sample overflows the kernels' 32-bit sizes: use a smaller batch"
            )));
        }

        // Pass 2: the layout, in the order the module documentation gives.
        let np = model.num_params();
        let half = precision.half_arena();
        let (f, i32a, b16) = (Arena::F32, Arena::I32, half.unwrap_or(Arena::Bf16));
        let mut a = Alloc { len: [0; 4] };
        let params = a.take(f, np);
        let grads = a.take(f, np);
        let m = a.take(f, np);
        let v = a.take(f, np);
        let params_bf = a.take(b16, if half.is_some() { np } else { 0 });
        let bn_state = a.take(f, bns.iter().map(|(_, c, _)| 2 * c).sum());
        let (mut bn_names, mut bn_init, mut at) = (Vec::new(), Vec::new(), 0);
        let bn_stages = stages.iter_mut().filter_map(|s| match &mut s.kind {
            Kind::BatchNorm { t, .. } => Some(t),
            _ => None,
        });
        for (t, &(name, c, l)) in bn_stages.zip(&bns) {
            let buffers = l.f32_buffers();
            let buffer = |what: &str| -> &[f32] {
                buffers
                    .iter()
                    .find(|(n, _)| *n == what)
                    .map_or(&[], |(_, v)| *v)
            };
            *t = BnTensors {
                mean: a.take(f, c),
                invstd: a.take(f, c),
                running_mean: bn_state.sub(at, c),
                running_var: bn_state.sub(at + c, c),
            };
            for (what, r, init) in [
                ("running_mean", t.running_mean, buffer("running_mean")),
                ("running_var", t.running_var, buffer("running_var")),
            ] {
                if init.len() != c {
                    return Err(DeviceError::UnsupportedModel {
                        layer: name.into(),
                        why: format!("{what} holds {} values for {c} channels", init.len()),
                    });
                }
                bn_names.push((format!("{name}.{what}"), r));
                bn_init.extend_from_slice(init);
            }
            at += 2 * c;
        }
        let indices = a.take(i32a, batch);
        let labels = a.take(i32a, batch);
        let x = a.take(f, batch * stages[0].in_per);
        let mut cur = x;
        for s in &mut stages {
            s.inp = cur;
            s.out = match s.kind {
                Kind::Flatten => cur,
                _ => a.take(f, batch * s.out_per),
            };
            if let Kind::MaxPool { argmax, .. } = &mut s.kind {
                *argmax = a.take(i32a, batch * s.out_per);
            }
            cur = s.out;
        }
        let logits = cur;
        let loss = LossTensors {
            losses: a.take(f, batch),
            probs: a.take(f, batch * classes),
            mean_loss: a.take(f, 1),
            loss_sum: a.take(f, 1),
            correct: a.take(i32a, 1),
        };
        let amp_len = if precision.scales_loss() { 1 } else { 0 };
        let amp = AmpTensors {
            scale: a.take(f, amp_len),
            found_inf: a.take(f, amp_len),
        };
        let clip = ClipTensors {
            partials: a.take(f, CLIP_PARTIALS),
            coef: a.take(f, 1),
            norm: a.take(f, 1),
            nonfinite_step: a.take(i32a, 1),
        };
        let dlogits = a.take(f, batch * classes);
        let mut dout = dlogits;
        for (k, s) in stages.iter_mut().enumerate().rev() {
            s.dout = dout;
            if let Kind::Linear {
                relu: true, dpre, ..
            } = &mut s.kind
            {
                *dpre = a.take(f, batch * s.out_per);
            }
            s.din = match s.kind {
                Kind::Flatten => Some(dout),
                Kind::Conv { .. } | Kind::Linear { .. } if k == 0 => None,
                _ => Some(a.take(f, batch * s.in_per)),
            };
            dout = s.din.unwrap_or(UNSET);
        }
        // The largest split-K workspace any weight gradient wants, at the full batch (more K,
        // more slices).
        let splitk_len = stages
            .iter()
            .map(|s| match s.kind {
                Kind::Conv { conv: c, .. } => splitk_workspace_len(
                    c.params.out_c,
                    c.params.k(),
                    batch * c.out_h() * c.out_w(),
                ),
                Kind::Linear { linear: l, .. } => splitk_workspace_len(l.out_f, l.in_f, batch),
                _ => 0,
            })
            .max()
            .unwrap_or(0);
        let splitk = a.take(f, splitk_len);
        let mut t_bf = |n: usize| a.take(b16, if half.is_some() { n } else { 0 });
        for s in stages.iter_mut().filter(|s| s.kind.is_gemm()) {
            s.bf_in = t_bf(batch * s.in_per);
        }
        for s in stages.iter_mut().rev().filter(|s| s.kind.is_gemm()) {
            s.bf_dout = t_bf(batch * s.out_per);
        }
        Ok(Tensors {
            batch,
            num_params: np,
            params,
            grads,
            m,
            v,
            params_bf,
            bn_state,
            bn_names,
            bn_init,
            indices,
            labels,
            sample_dims,
            x,
            classes,
            logits,
            loss,
            dlogits,
            splitk,
            amp,
            clip,
            arena_len: (a.len[0], a.len[1], a.len[2], a.len[3]),
            stages,
        })
    }

    /// Elements of one input image (`C * H * W`).
    pub fn image_size(&self) -> usize {
        self.sample_dims.iter().product()
    }

    /// The forward pass for `b` images whose ids are in `indices[..b]` (train: batch statistics;
    /// eval: running statistics), ending with the loss and the correct count.
    pub fn forward(&self, ops: &mut Builder, b: usize, precision: Precision, train: bool) {
        assert!(
            b >= 1 && b <= self.batch,
            "batch {b} outside 1..={}",
            self.batch
        );
        let bf = precision.half_arena().is_some();
        let (pr, pbf) = (self.params, if bf { self.params_bf } else { self.params });
        let n = |r: Region, per: usize| r.prefix(b * per);
        let at = |flat: Region, p: ParamAt| flat.sub(p.off, p.len);
        if bf {
            ops.cast_to_half(self.params_bf, self.params);
        }
        let image = self.image_size();
        ops.gather(
            n(self.x, image),
            n(self.labels, 1),
            n(self.indices, 1),
            b,
            image,
        );
        for s in &self.stages {
            let (inp, out) = (n(s.inp, s.in_per), n(s.out, s.out_per));
            // Operand of a GEMM: the 16-bit copy (made here) in bf16/fp16 mode, the f32 tensor
            // otherwise.
            let gemm_in = |ops: &mut Builder| {
                if bf {
                    ops.cast_to_half(n(s.bf_in, s.in_per), inp);
                    n(s.bf_in, s.in_per)
                } else {
                    inp
                }
            };
            match s.kind {
                Kind::Conv { conv, weight, bias } => {
                    let x = gemm_in(ops);
                    let shape = Conv2dShape { batch: b, ..conv };
                    let params = (at(pbf, weight), at(pr, bias));
                    ops.conv_forward(precision, out, x, params, shape);
                }
                Kind::BatchNorm {
                    t,
                    bn,
                    weight,
                    bias,
                } => {
                    let (params, shape) =
                        ((at(pr, weight), at(pr, bias)), Bn2dShape { batch: b, ..bn });
                    if train {
                        ops.bn_forward_train(out, &t, inp, params, shape);
                    } else {
                        ops.bn_forward_eval(out, &t, inp, params, shape);
                    }
                }
                Kind::Relu => ops.relu_forward(out, inp),
                Kind::MaxPool { pool, argmax } => {
                    let shape = Pool2dShape { batch: b, ..pool };
                    ops.maxpool_forward(out, n(argmax, s.out_per), inp, shape);
                }
                Kind::Flatten => {}
                Kind::Linear {
                    linear,
                    relu,
                    weight,
                    bias,
                    ..
                } => {
                    let x = gemm_in(ops);
                    let shape = LinearShape { batch: b, ..linear };
                    let params = (at(pbf, weight), at(pr, bias));
                    ops.linear_forward(precision, out, x, params, shape, relu);
                }
            }
        }
        ops.xent_forward(
            &self.loss,
            n(self.logits, self.classes),
            n(self.labels, 1),
            b,
            self.classes,
        );
    }

    /// Backward for the last forward of `b` images, in exactly the reverse layer order; zeroes the
    /// flat gradients first (parameter gradients accumulate). In fp16 the loss gradient is
    /// multiplied by the loss scale (`amp.scale`, read on the device), so every gradient below is
    /// scaled, and the overflow flag `amp.found_inf` is zeroed for the unscale that follows the
    /// all-reduce.
    pub fn backward(&self, ops: &mut Builder, b: usize, precision: Precision) {
        let bf = precision.half_arena().is_some();
        let (g, pbf) = (self.grads, if bf { self.params_bf } else { self.params });
        let n = |r: Region, per: usize| r.prefix(b * per);
        let at = |flat: Region, p: ParamAt| flat.sub(p.off, p.len);
        ops.fill(g, 0.0);
        let (dz, probs, labels) = (
            n(self.dlogits, self.classes),
            n(self.loss.probs, self.classes),
            n(self.labels, 1),
        );
        let scale = precision.scales_loss().then_some(self.amp.scale);
        if scale.is_some() {
            ops.fill(self.amp.found_inf, 0.0);
        }
        ops.xent_backward(dz, probs, labels, (b, self.classes), scale);
        for s in self.stages.iter().rev() {
            let (inp, out, dout) = (
                n(s.inp, s.in_per),
                n(s.out, s.out_per),
                n(s.dout, s.out_per),
            );
            let din = s.din.map(|d| n(d, s.in_per));
            // The output gradient as a GEMM operand (16-bit copy made here in bf16/fp16 mode), and
            // the input saved by forward (its 16-bit copy is still in place).
            let gemm_dout = |ops: &mut Builder, d: Region| {
                if bf {
                    ops.cast_to_half(n(s.bf_dout, s.out_per), d);
                    n(s.bf_dout, s.out_per)
                } else {
                    d
                }
            };
            let saved_in = || if bf { n(s.bf_in, s.in_per) } else { inp };
            match s.kind {
                Kind::Conv { conv, weight, bias } => {
                    let shape = Conv2dShape { batch: b, ..conv };
                    let dy = gemm_dout(ops, dout);
                    ops.conv_backward_weight(precision, at(g, weight), dy, saved_in(), shape);
                    ops.conv_backward_bias(precision, at(g, bias), dy, shape);
                    if let Some(dx) = din {
                        ops.conv_backward_input(precision, dx, dy, at(pbf, weight), shape);
                    }
                }
                Kind::BatchNorm {
                    t,
                    bn,
                    weight,
                    bias,
                } => {
                    if let Some(dx) = din {
                        let grads = (dx, at(g, weight), at(g, bias));
                        let w = at(self.params, weight);
                        let shape = Bn2dShape { batch: b, ..bn };
                        ops.bn_backward(grads, dout, (inp, out), w, &t, shape);
                    }
                }
                Kind::Relu => {
                    if let Some(dx) = din {
                        ops.relu_backward(dx, out, dout);
                    }
                }
                Kind::MaxPool { pool, argmax } => {
                    if let Some(dx) = din {
                        let shape = Pool2dShape { batch: b, ..pool };
                        ops.maxpool_backward(dx, dout, n(argmax, s.out_per), shape);
                    }
                }
                Kind::Flatten => {}
                Kind::Linear {
                    linear,
                    relu,
                    weight,
                    bias,
                    dpre,
                } => {
                    let d = if relu {
                        ops.relu_backward(n(dpre, s.out_per), out, dout);
                        n(dpre, s.out_per)
                    } else {
                        dout
                    };
                    let dy = gemm_dout(ops, d);
                    let shape = LinearShape { batch: b, ..linear };
                    ops.linear_backward_weight(precision, at(g, weight), dy, saved_in(), shape);
                    ops.linear_backward_bias(precision, at(g, bias), dy, b, linear.out_f);
                    if let Some(dx) = din {
                        ops.linear_backward_input(precision, dx, dy, at(pbf, weight), shape);
                    }
                }
            }
        }
    }

    /// The captured part of a training step for `b` images: forward, loss (added into
    /// `loss_sum` as `b * mean_loss`), backward. The gradient all-reduce and the optimizer run
    /// outside (the collective is on another stream; Adam's step count changes every step), and
    /// so do fp16's unscale and overflow check, which must see the all-reduced gradients.
    pub fn train_step(&self, b: usize, precision: Precision, sm_count: usize) -> Vec<Op> {
        let mut ops = Builder::with_splitk(sm_count, self.splitk);
        self.forward(&mut ops, b, precision, true);
        ops.axpy(self.loss.loss_sum, self.loss.mean_loss, b as f32);
        self.backward(&mut ops, b, precision);
        ops.ops
    }

    /// Evaluation of `b` images: forward with running statistics (the correct count lands in
    /// `loss.correct`).
    pub fn eval_step(&self, b: usize, precision: Precision, sm_count: usize) -> Vec<Op> {
        let mut ops = Builder::new(sm_count);
        self.forward(&mut ops, b, precision, false);
        ops.ops
    }
}

#[cfg(test)]
mod tests {
    use super::super::ir::Arg;
    use super::*;
    use crate::ops::{BatchNorm2d, Conv2d, Flatten, Linear, MaxPool2d, Relu};
    use crate::tensor::Tensor;

    fn boxed(l: Vec<(&str, Box<dyn Layer>)>, input: &[usize]) -> Model {
        Model::new(
            l.into_iter().map(|(n, b)| (n.to_string(), b)).collect(),
            input,
        )
        .unwrap()
    }

    /// Every parameter's offset, the BatchNorm state names and initial values, the input and the
    /// classes come from the model: nothing of the FashionMNIST CNN is written down.
    #[test]
    fn the_fashion_cnn_is_read_from_the_model() {
        let model = Model::fashion_cnn(4).unwrap();
        let t = Tensors::new(&model, 4, Precision::Fp32).unwrap();
        assert_eq!(
            (t.sample_dims, t.classes, t.image_size()),
            ([1, 28, 28], 10, 784)
        );
        let names: Vec<&str> = t.bn_names.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "module1.1.running_mean",
                "module1.1.running_var",
                "module2.1.running_mean",
                "module2.1.running_var"
            ]
        );
        let mut want = vec![0.0f32; 32];
        want.extend([1.0; 32]);
        want.extend([0.0; 64]);
        want.extend([1.0; 64]);
        assert_eq!(
            t.bn_init, want,
            "PyTorch's initial running statistics, from the layers"
        );
        assert_eq!(
            t.bn_names.iter().map(|(_, r)| r.len).sum::<usize>(),
            t.bn_state.len
        );
        // Each parameter tensor of the model is used by exactly one stage, at the model's offset.
        let mut used: Vec<(usize, usize)> = t
            .stages
            .iter()
            .flat_map(|s| match s.kind {
                Kind::Conv { weight, bias, .. }
                | Kind::BatchNorm { weight, bias, .. }
                | Kind::Linear { weight, bias, .. } => {
                    vec![(weight.off, weight.len), (bias.off, bias.len)]
                }
                _ => vec![],
            })
            .collect();
        used.sort_unstable();
        let entries: Vec<(usize, usize)> = model
            .entries
            .iter()
            .map(|e| (e.range.start, e.range.len()))
            .collect();
        assert_eq!(used, entries);
        // conv-bn(+relu)-pool x2, flatten, linear(+relu), linear: ReLUs fused, nothing else.
        let kinds: Vec<String> = t
            .stages
            .iter()
            .map(|s| {
                format!("{:?}", s.kind)
                    .split([' ', '{'])
                    .next()
                    .unwrap()
                    .to_string()
            })
            .collect();
        assert_eq!(
            kinds,
            [
                "Conv",
                "BatchNorm",
                "MaxPool",
                "Conv",
                "BatchNorm",
                "MaxPool",
                "Flatten",
                "Linear",
                "Linear"
            ]
        );
        assert!(
            t.stages[0].din.is_none(),
            "no input gradient for the first layer"
        );
        assert!(t.stages[1..].iter().all(|s| s.din.is_some()));
    }

    /// Another architecture gets its own schedule: stride, padding, overlapping pooling, a
    /// standalone ReLU, BatchNorm without ReLU, a linear layer without ReLU before the last one.
    #[test]
    fn another_model_gets_its_own_schedule() {
        use crate::ops::Conv2dParams;
        let model = boxed(
            vec![
                ("c", Box::new(Conv2d::new(Conv2dParams::new(3, 6, 3, 2, 1)))),
                ("r", Box::new(Relu)),
                ("p", Box::new(MaxPool2d::new(3, 1))),
                ("bn", Box::new(BatchNorm2d::new(6))),
                ("f", Box::new(Flatten)),
                ("l1", Box::new(Linear::new(72, 7))),
                ("l2", Box::new(Linear::new(7, 5))),
            ],
            &[2, 3, 12, 10],
        );
        let t = Tensors::new(&model, 2, Precision::Bf16).unwrap();
        assert_eq!((t.sample_dims, t.classes), ([3, 12, 10], 5));
        let ops = t.train_step(2, Precision::Bf16, 4);
        for op in &ops {
            op.check_signature().unwrap();
        }
        let names: Vec<&str> = ops
            .iter()
            .map(|o| o.name)
            .filter(|n| !n.starts_with("cast"))
            .collect();
        assert_eq!(
            names,
            [
                "gather_batch_f32",
                "conv2d_forward_bf16",
                "relu_forward_f32",
                "maxpool2d_forward_f32",
                "batchnorm2d_forward_train_f32",
                "linear_forward_bf16",
                "linear_forward_bf16",
                "softmax_xent_forward_f32",
                "axpy_f32",
                "fill_f32",
                "softmax_xent_backward_f32",
                "linear_backward_weight_bf16",
                "linear_backward_bias_bf16",
                "linear_backward_input_bf16",
                "linear_backward_weight_bf16",
                "linear_backward_bias_bf16",
                "linear_backward_input_bf16",
                "batchnorm2d_backward_f32",
                "maxpool2d_backward_f32",
                "relu_backward_f32",
                "conv2d_backward_weight_bf16",
                "splitk_reduce_f32",
                "conv2d_backward_bias_bf16",
            ]
        );
        // The `N` int arguments of the first `name` op from `at` on (-1 for any other kind).
        fn ints<const N: usize>(ops: &[Op], name: &str, at: usize) -> [i32; N] {
            let op = ops.iter().find(|o| o.name == name).unwrap();
            std::array::from_fn(|j| {
                if let Arg::I32(v) = op.args[at + j] {
                    v
                } else {
                    -1
                }
            })
        }
        assert_eq!(
            ints(&ops, "conv2d_forward_bf16", 4),
            [2, 3, 12, 10, 6, 3, 3, 2, 1],
            "batch, in_c, in_h, in_w, out_c, kh, kw, stride, pad"
        );
        assert_eq!(
            ints(&ops, "maxpool2d_forward_f32", 3),
            [2, 6, 6, 5, 3, 1],
            "batch, channels, h, w, kernel, stride"
        );
        let bn = ops
            .iter()
            .find(|o| o.name == "batchnorm2d_forward_train_f32")
            .unwrap();
        assert_eq!(bn.args[13], Arg::I32(0), "no ReLU after this BatchNorm");
    }

    /// A layer the device has no kernel for.
    struct Square;
    impl Layer for Square {
        fn spec(&self) -> LayerSpec {
            LayerSpec::Other("square")
        }
        fn out_dims(&self, inp: &[usize]) -> Result<Vec<usize>, String> {
            Ok(inp.to_vec())
        }
        fn forward(&mut self, _p: &[f32], inp: &Tensor, out: &mut Tensor, _train: bool) {
            out.resize(inp.dims());
            out.data_mut()
                .iter_mut()
                .zip(inp.data())
                .for_each(|(o, i)| *o = i * i);
        }
        fn backward(&mut self, _: crate::ops::Backward<'_>) {}
    }

    #[test]
    fn unsupported_models_are_refused_with_the_layer_named() {
        let err = |m: &Model| Tensors::new(m, 2, Precision::Fp32).unwrap_err().to_string();
        let m = boxed(
            vec![
                ("f", Box::new(Flatten)),
                ("sq", Box::new(Square)),
                ("l", Box::new(Linear::new(4, 3))),
            ],
            &[2, 1, 2, 2],
        );
        let e = err(&m);
        assert!(
            e.contains("layer sq (square)") && e.contains("--device cpu"),
            "{e}"
        );
        let m = boxed(vec![("bn", Box::new(BatchNorm2d::new(1)))], &[2, 1, 2, 2]);
        let e = err(&m);
        assert!(
            e.contains("layer bn") && e.contains("[N, classes] logits"),
            "{e}"
        );
        let mut m = Model::fashion_cnn(2).unwrap();
        m.set_sync_bn(true);
        let e = err(&m);
        assert!(
            e.contains("layer module1.1") && e.contains("synchronised BatchNorm"),
            "{e}"
        );
        let m = boxed(vec![("l", Box::new(Linear::new(4, 3)))], &[2, 4]);
        let e = err(&m);
        assert!(
            e.contains("layer input") && e.contains("[N, C, H, W]"),
            "{e}"
        );
        let e = Tensors::new(&Model::fashion_cnn(1).unwrap(), 0, Precision::Fp32)
            .unwrap_err()
            .to_string();
        assert!(e.contains("batch size must be at least 1"), "{e}");
        let e = Tensors::new(&Model::fashion_cnn(1).unwrap(), 100_000, Precision::Fp32)
            .unwrap_err()
            .to_string();
        assert!(e.contains("overflows the kernels' 32-bit sizes"), "{e}");
    }
}
