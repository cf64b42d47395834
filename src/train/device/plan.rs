//! The training step as data: a list of kernel launches ([`Op`]) over regions of a few flat
//! arenas, built once per batch size and run by an executor (the GPU one launches and captures it
//! in a CUDA graph; the CPU one calls the kernels' twins, so the whole device step is checked on
//! machines without a GPU).
//!
//! Every tensor of the recipe CNN is a [`Region`] of one arena per dtype (f32, i32, bf16, and the
//! two u8 dataset arrays), named in [`Tensors`] with its shape. Launch geometry sits next to each
//! launch in the [`Builder`] methods (STYLE item 7), copied from the `.cu` headers.
//!
//! Conventions of the kernels carry over: activation gradients are overwritten, parameter
//! gradients accumulate, so the step starts by zeroing the flat gradient buffer.

use crate::comm::Dtype;
use crate::cuda::{ArgKind, KernelId, LaunchConfig};
use crate::train::layers::Conv2dParams;
use crate::train::model::Model;

/// Which flat allocation a region lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arena {
    /// Parameters, gradients, optimizer state, activations (f32).
    F32,
    /// Labels, sample indices, pooling argmax, correct counts (i32).
    I32,
    /// bf16 copies of parameters, activations and gradients (`--precision bf16`).
    Bf16,
    /// The dataset's pixels, train split then test split (u8).
    Images,
    /// The dataset's labels, same order (u8).
    Labels,
}

impl Arena {
    /// Element type of the arena.
    pub fn dtype(self) -> Dtype {
        match self {
            Arena::F32 => Dtype::F32,
            Arena::I32 => Dtype::I32,
            Arena::Bf16 => Dtype::BF16,
            Arena::Images | Arena::Labels => Dtype::U8,
        }
    }
}

/// A contiguous range of one arena, in elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// The arena.
    pub arena: Arena,
    /// First element.
    pub off: usize,
    /// Elements.
    pub len: usize,
}

impl Region {
    /// The element range.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.off..self.off + self.len
    }
    /// The first `len` elements (a smaller batch in a buffer sized for the largest).
    pub fn prefix(&self, len: usize) -> Region {
        assert!(len <= self.len, "prefix {len} of a region of {}", self.len);
        Region { len, ..*self }
    }
    /// Elements `off..off + len` of this region.
    pub fn sub(&self, off: usize, len: usize) -> Region {
        assert!(off + len <= self.len, "sub {off}+{len} of a region of {}", self.len);
        Region { arena: self.arena, off: self.off + off, len }
    }
}

/// One kernel argument.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arg {
    /// A `const T*` argument.
    In(Region),
    /// A `T*` argument (written).
    Out(Region),
    /// An `int`.
    I32(i32),
    /// A `float`.
    F32(f32),
    /// A `long long`.
    I64(i64),
}

impl Arg {
    /// The parameter kind this argument passes.
    pub fn kind(&self) -> ArgKind {
        match self {
            Arg::In(r) => ArgKind::Ptr(r.arena.dtype()),
            Arg::Out(r) => ArgKind::PtrMut(r.arena.dtype()),
            Arg::I32(_) => ArgKind::Scalar(Dtype::I32),
            Arg::F32(_) => ArgKind::Scalar(Dtype::F32),
            Arg::I64(_) => ArgKind::Scalar(Dtype::I64),
        }
    }
}

/// One kernel launch: entry point, arguments in the kernel's order, geometry.
#[derive(Clone, Debug, PartialEq)]
pub struct Op {
    /// Kernel file.
    pub kernel: KernelId,
    /// Entry point (also the CPU twin's name).
    pub name: &'static str,
    /// Arguments, in order.
    pub args: Vec<Arg>,
    /// Grid and block.
    pub cfg: LaunchConfig,
}

impl Op {
    /// Check the arguments against the registry's signature (count and kinds): the same check
    /// the launch builder makes on a GPU, available without one.
    pub fn check_signature(&self) -> Result<(), String> {
        let sig = self.kernel.signature(self.name).ok_or_else(|| format!("{} declares no entry point {}", self.kernel, self.name))?;
        let got: Vec<ArgKind> = self.args.iter().map(Arg::kind).collect();
        if got != sig.args {
            return Err(format!("{}: arguments {got:?} do not match the signature {:?}", self.name, sig.args));
        }
        Ok(())
    }
}

/// Compute precision of the GEMM layers (conv, linear).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Precision {
    /// f32 everywhere (TF32 tensor cores on sm_80+ unless built with `-DLOCKSTEP_NO_TF32`).
    #[default]
    Fp32,
    /// bf16 operands for conv/linear (`_bf16` kernels, f32 accumulation); f32 master weights,
    /// optimizer state, BatchNorm and loss.
    Bf16,
}

impl std::str::FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Precision, String> {
        match s {
            "fp32" | "f32" => Ok(Precision::Fp32),
            "bf16" => Ok(Precision::Bf16),
            _ => Err(format!("unknown precision {s:?}: use fp32 or bf16")),
        }
    }
}

// ------------------------------------------------------------------------------------------------
// launch geometry helpers (the .cu headers state these)

/// Threads per block of the tiled GEMM core (`GEMM_THREADS` in common.cuh).
const GEMM_THREADS: u32 = 128;
/// Output tile of the GEMM core (`GEMM_BM` = `GEMM_BN` = 64).
const GEMM_TILE: usize = 64;
/// K chunk of the GEMM core (`GEMM_BK`).
const GEMM_BK: usize = 32;

fn cfg(grid: (usize, usize, usize), block: u32) -> LaunchConfig {
    let c = |v: usize| v.clamp(1, 65535) as u32;
    LaunchConfig { grid: (c(grid.0), c(grid.1), c(grid.2)), block: (block, 1, 1), shared_mem: 0 }
}

/// GEMM grid for C[M, N] with `splits` K slices: (ceil(N/64), ceil(M/64), splits), block 128.
fn gemm_cfg(m: usize, n: usize, splits: usize) -> LaunchConfig {
    cfg((n.div_ceil(GEMM_TILE), m.div_ceil(GEMM_TILE), splits.max(1)), GEMM_THREADS)
}

/// Split-K factor for an accumulating GEMM: about two blocks per SM, at most one 32-wide K
/// chunk per slice (conv2d.cu header).
fn split_k(m: usize, n: usize, k: usize, sm_count: usize) -> usize {
    let tiles = n.div_ceil(GEMM_TILE) * m.div_ceil(GEMM_TILE);
    (2 * sm_count / tiles.max(1)).clamp(1, k.div_ceil(GEMM_BK).max(1))
}

fn i(v: usize) -> Arg {
    Arg::I32(v as i32)
}

/// Convolution shape with its batch and input size (the kernels' `shape...` arguments).
#[derive(Clone, Copy, Debug)]
pub struct ConvLaunch {
    /// Shape parameters.
    pub p: Conv2dParams,
    /// Batch.
    pub batch: usize,
    /// Input height.
    pub in_h: usize,
    /// Input width.
    pub in_w: usize,
}

impl ConvLaunch {
    fn shape_args(&self) -> [Arg; 9] {
        let p = &self.p;
        [i(self.batch), i(p.in_c), i(self.in_h), i(self.in_w), i(p.out_c), i(p.kh), i(p.kw), i(p.stride), i(p.pad)]
    }
    fn out_hw(&self) -> (usize, usize) {
        (self.p.out_h(self.in_h), self.p.out_w(self.in_w))
    }
}

/// Emits [`Op`]s with the right entry point, argument order and geometry.
#[derive(Debug)]
pub struct Builder {
    /// The ops so far.
    pub ops: Vec<Op>,
    /// SMs of the device (split-K sizing; any positive value is correct).
    pub sm_count: usize,
}

fn suffix(bf16: bool, f32_name: &'static str, bf16_name: &'static str) -> &'static str {
    if bf16 {
        bf16_name
    } else {
        f32_name
    }
}

impl Builder {
    /// An empty op list.
    pub fn new(sm_count: usize) -> Builder {
        Builder { ops: Vec::new(), sm_count: sm_count.max(1) }
    }

    fn push(&mut self, kernel: KernelId, name: &'static str, args: Vec<Arg>, cfg: LaunchConfig) {
        self.ops.push(Op { kernel, name, args, cfg });
    }

    /// `fill_f32`: 1-D, block 256, grid ceil(n/256) capped (grid-stride).
    pub fn fill(&mut self, out: Region, value: f32) {
        self.push(
            KernelId::Elementwise,
            "fill_f32",
            vec![Arg::Out(out), Arg::F32(value), Arg::I64(out.len as i64)],
            LaunchConfig::for_elements(out.len),
        );
    }

    /// `axpy_f32`: y += alpha * x; 1-D, block 256.
    pub fn axpy(&mut self, y: Region, x: Region, alpha: f32) {
        self.push(
            KernelId::Elementwise,
            "axpy_f32",
            vec![Arg::Out(y), Arg::In(x), Arg::F32(alpha), Arg::I64(y.len as i64)],
            LaunchConfig::for_elements(y.len),
        );
    }

    /// `cast_f32_bf16`: 1-D, block 256.
    pub fn cast_to_bf16(&mut self, out: Region, inp: Region) {
        self.push(KernelId::Data, "cast_f32_bf16", vec![Arg::Out(out), Arg::In(inp), i(inp.len)], LaunchConfig::for_elements(inp.len));
    }

    /// `gather_batch_f32`: block 256, grid (ceil(image_size/256), batch).
    pub fn gather(&mut self, images: Region, labels: Region, indices: Region, batch: usize, image_size: usize) {
        let ds_i = Region { arena: Arena::Images, off: 0, len: 0 };
        let ds_l = Region { arena: Arena::Labels, off: 0, len: 0 };
        self.push(
            KernelId::Data,
            "gather_batch_f32",
            vec![Arg::Out(images), Arg::Out(labels), Arg::In(ds_i), Arg::In(ds_l), Arg::In(indices), i(batch), i(image_size)],
            cfg((image_size.div_ceil(256), batch, 1), 256),
        );
    }

    /// `conv2d_forward_*`: GEMM M = out_c, N = batch*out_h*out_w, splits 1 (it overwrites).
    pub fn conv_forward(&mut self, bf16: bool, out: Region, inp: Region, weight: Region, bias: Region, s: ConvLaunch) {
        let (oh, ow) = s.out_hw();
        let mut a = vec![Arg::Out(out), Arg::In(inp), Arg::In(weight), Arg::In(bias)];
        a.extend(s.shape_args());
        self.push(
            KernelId::Conv2d,
            suffix(bf16, "conv2d_forward_f32", "conv2d_forward_bf16"),
            a,
            gemm_cfg(s.p.out_c, s.batch * oh * ow, 1),
        );
    }

    /// `conv2d_backward_input_*`: GEMM M = in_c, N = batch*in_h*in_w, splits 1 (it overwrites).
    pub fn conv_backward_input(&mut self, bf16: bool, dinp: Region, dout: Region, weight: Region, s: ConvLaunch) {
        let mut a = vec![Arg::Out(dinp), Arg::In(dout), Arg::In(weight)];
        a.extend(s.shape_args());
        let name = suffix(bf16, "conv2d_backward_input_f32", "conv2d_backward_input_bf16");
        self.push(KernelId::Conv2d, name, a, gemm_cfg(s.p.in_c, s.batch * s.in_h * s.in_w, 1));
    }

    /// `conv2d_backward_weight_*`: GEMM M = out_c, N = in_c*kh*kw, K = batch*out_h*out_w, split-K
    /// (atomics into the accumulated dweight).
    pub fn conv_backward_weight(&mut self, bf16: bool, dweight: Region, dout: Region, inp: Region, s: ConvLaunch) {
        let (oh, ow) = s.out_hw();
        let (m, n, k) = (s.p.out_c, s.p.k(), s.batch * oh * ow);
        let mut a = vec![Arg::Out(dweight), Arg::In(dout), Arg::In(inp)];
        a.extend(s.shape_args());
        let name = suffix(bf16, "conv2d_backward_weight_f32", "conv2d_backward_weight_bf16");
        self.push(KernelId::Conv2d, name, a, gemm_cfg(m, n, split_k(m, n, k, self.sm_count)));
    }

    /// `conv2d_backward_bias_*`: grid (out_c), block 256.
    pub fn conv_backward_bias(&mut self, bf16: bool, dbias: Region, dout: Region, s: ConvLaunch) {
        let (oh, ow) = s.out_hw();
        let name = suffix(bf16, "conv2d_backward_bias_f32", "conv2d_backward_bias_bf16");
        self.push(
            KernelId::Conv2d,
            name,
            vec![Arg::Out(dbias), Arg::In(dout), i(s.batch), i(s.p.out_c), i(oh), i(ow)],
            cfg((s.p.out_c, 1, 1), 256),
        );
    }

    /// `linear_forward_*`: GEMM M = batch, N = out_f, K = in_f, splits 1 (fused ReLU allowed).
    #[allow(clippy::too_many_arguments)]
    pub fn linear_forward(
        &mut self,
        bf16: bool,
        out: Region,
        inp: Region,
        weight: Region,
        bias: Region,
        batch: usize,
        in_f: usize,
        out_f: usize,
        relu: bool,
    ) {
        let a = vec![Arg::Out(out), Arg::In(inp), Arg::In(weight), Arg::In(bias), i(batch), i(in_f), i(out_f), i(relu as usize)];
        self.push(KernelId::Linear, suffix(bf16, "linear_forward_f32", "linear_forward_bf16"), a, gemm_cfg(batch, out_f, 1));
    }

    /// `linear_backward_input_*`: GEMM M = batch, N = in_f, splits 1.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_backward_input(
        &mut self,
        bf16: bool,
        dinp: Region,
        dout: Region,
        weight: Region,
        batch: usize,
        in_f: usize,
        out_f: usize,
    ) {
        let a = vec![Arg::Out(dinp), Arg::In(dout), Arg::In(weight), i(batch), i(in_f), i(out_f)];
        self.push(KernelId::Linear, suffix(bf16, "linear_backward_input_f32", "linear_backward_input_bf16"), a, gemm_cfg(batch, in_f, 1));
    }

    /// `linear_backward_weight_*`: GEMM M = out_f, N = in_f, K = batch, split-K.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_backward_weight(
        &mut self,
        bf16: bool,
        dweight: Region,
        dout: Region,
        inp: Region,
        batch: usize,
        in_f: usize,
        out_f: usize,
    ) {
        let a = vec![Arg::Out(dweight), Arg::In(dout), Arg::In(inp), i(batch), i(in_f), i(out_f)];
        let splits = split_k(out_f, in_f, batch, self.sm_count);
        self.push(
            KernelId::Linear,
            suffix(bf16, "linear_backward_weight_f32", "linear_backward_weight_bf16"),
            a,
            gemm_cfg(out_f, in_f, splits),
        );
    }

    /// `linear_backward_bias_*`: grid ceil(out_f/256), block 256.
    pub fn linear_backward_bias(&mut self, bf16: bool, dbias: Region, dout: Region, batch: usize, out_f: usize) {
        let name = suffix(bf16, "linear_backward_bias_f32", "linear_backward_bias_bf16");
        self.push(KernelId::Linear, name, vec![Arg::Out(dbias), Arg::In(dout), i(batch), i(out_f)], cfg((out_f.div_ceil(256), 1, 1), 256));
    }

    /// `relu_backward_f32`: 1-D, block 256.
    pub fn relu_backward(&mut self, dinp: Region, out: Region, dout: Region) {
        self.push(
            KernelId::Activation,
            "relu_backward_f32",
            vec![Arg::Out(dinp), Arg::In(out), Arg::In(dout), i(dinp.len)],
            LaunchConfig::for_elements(dinp.len),
        );
    }

    /// `batchnorm2d_forward_train_f32`: grid (channels), block 256 (one block per channel).
    #[allow(clippy::too_many_arguments)]
    pub fn bn_forward_train(
        &mut self,
        out: Region,
        bn: &BnTensors,
        inp: Region,
        weight: Region,
        bias: Region,
        batch: usize,
        hw: usize,
        relu: bool,
    ) {
        let c = bn.mean.len;
        let a = vec![
            Arg::Out(out),
            Arg::Out(bn.mean),
            Arg::Out(bn.invstd),
            Arg::Out(bn.running_mean),
            Arg::Out(bn.running_var),
            Arg::In(inp),
            Arg::In(weight),
            Arg::In(bias),
            i(batch),
            i(c),
            i(hw),
            Arg::F32(BN_MOMENTUM),
            Arg::F32(BN_EPS),
            i(relu as usize),
        ];
        self.push(KernelId::Batchnorm, "batchnorm2d_forward_train_f32", a, cfg((c, 1, 1), 256));
    }

    /// `batchnorm2d_forward_eval_f32`: 1-D over batch*channels*hw, block 256.
    #[allow(clippy::too_many_arguments)]
    pub fn bn_forward_eval(
        &mut self,
        out: Region,
        bn: &BnTensors,
        inp: Region,
        weight: Region,
        bias: Region,
        batch: usize,
        hw: usize,
        relu: bool,
    ) {
        let c = bn.mean.len;
        let a = vec![
            Arg::Out(out),
            Arg::In(inp),
            Arg::In(weight),
            Arg::In(bias),
            Arg::In(bn.running_mean),
            Arg::In(bn.running_var),
            i(batch),
            i(c),
            i(hw),
            Arg::F32(BN_EPS),
            i(relu as usize),
        ];
        self.push(KernelId::Batchnorm, "batchnorm2d_forward_eval_f32", a, LaunchConfig::for_elements(batch * c * hw));
    }

    /// `batchnorm2d_backward_f32`: grid (channels), block 256.
    #[allow(clippy::too_many_arguments)]
    pub fn bn_backward(
        &mut self,
        dinp: Region,
        dweight: Region,
        dbias: Region,
        dout: Region,
        inp: Region,
        out: Region,
        weight: Region,
        bn: &BnTensors,
        batch: usize,
        hw: usize,
        relu: bool,
    ) {
        let c = bn.mean.len;
        let a = vec![
            Arg::Out(dinp),
            Arg::Out(dweight),
            Arg::Out(dbias),
            Arg::In(dout),
            Arg::In(inp),
            Arg::In(out),
            Arg::In(weight),
            Arg::In(bn.mean),
            Arg::In(bn.invstd),
            i(batch),
            i(c),
            i(hw),
            i(relu as usize),
        ];
        self.push(KernelId::Batchnorm, "batchnorm2d_backward_f32", a, cfg((c, 1, 1), 256));
    }

    /// `maxpool2d_forward_f32`: 1-D over the outputs, block 256.
    #[allow(clippy::too_many_arguments)]
    pub fn maxpool_forward(
        &mut self,
        out: Region,
        indices: Region,
        inp: Region,
        batch: usize,
        channels: usize,
        h: usize,
        w: usize,
        k: usize,
    ) {
        let a = vec![Arg::Out(out), Arg::Out(indices), Arg::In(inp), i(batch), i(channels), i(h), i(w), i(k), i(k)];
        self.push(KernelId::Pool, "maxpool2d_forward_f32", a, LaunchConfig::for_elements(out.len));
    }

    /// `maxpool2d_backward_f32`: 1-D over the inputs, block 256.
    #[allow(clippy::too_many_arguments)]
    pub fn maxpool_backward(
        &mut self,
        dinp: Region,
        dout: Region,
        indices: Region,
        batch: usize,
        channels: usize,
        h: usize,
        w: usize,
        k: usize,
    ) {
        let a = vec![Arg::Out(dinp), Arg::In(dout), Arg::In(indices), i(batch), i(channels), i(h), i(w), i(k), i(k)];
        self.push(KernelId::Pool, "maxpool2d_backward_f32", a, LaunchConfig::for_elements(dinp.len));
    }

    /// `softmax_xent_forward_f32`: grid 1, block 256 (one warp per row).
    pub fn xent_forward(&mut self, t: &LossTensors, logits: Region, labels: Region, batch: usize, classes: usize) {
        let a = vec![
            Arg::Out(t.losses.prefix(batch)),
            Arg::Out(t.probs.prefix(batch * classes)),
            Arg::Out(t.mean_loss),
            Arg::Out(t.correct),
            Arg::In(logits),
            Arg::In(labels),
            i(batch),
            i(classes),
        ];
        self.push(KernelId::Loss, "softmax_xent_forward_f32", a, cfg((1, 1, 1), 256));
    }

    /// `softmax_xent_backward_f32`: 1-D over batch*classes, block 256.
    pub fn xent_backward(&mut self, dlogits: Region, probs: Region, labels: Region, batch: usize, classes: usize) {
        let a = vec![Arg::Out(dlogits), Arg::In(probs), Arg::In(labels), i(batch), i(classes)];
        self.push(KernelId::Loss, "softmax_xent_backward_f32", a, LaunchConfig::for_elements(batch * classes));
    }

    /// `adam_step_f32` over the flat buffers: 1-D, block 256.
    #[allow(clippy::too_many_arguments)]
    pub fn adam(&mut self, params: Region, grads: Region, m: Region, v: Region, h: &AdamHyper, lr: f32, step: u64) {
        let a = vec![
            Arg::Out(params),
            Arg::In(grads),
            Arg::Out(m),
            Arg::Out(v),
            i(params.len),
            Arg::F32(lr),
            Arg::F32(h.beta1),
            Arg::F32(h.beta2),
            Arg::F32(h.eps),
            Arg::F32(h.weight_decay),
            Arg::I32(step as i32),
        ];
        self.push(KernelId::Optim, "adam_step_f32", a, LaunchConfig::for_elements(params.len));
    }
}

/// BatchNorm momentum and eps (PyTorch defaults, as the CPU layer).
pub const BN_MOMENTUM: f32 = 0.1;
/// See [`BN_MOMENTUM`].
pub const BN_EPS: f32 = 1e-5;

/// Adam hyper-parameters other than the learning rate (PyTorch defaults).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamHyper {
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Denominator epsilon.
    pub eps: f32,
    /// L2 penalty.
    pub weight_decay: f32,
}

impl Default for AdamHyper {
    fn default() -> Self {
        AdamHyper { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }
    }
}

// ------------------------------------------------------------------------------------------------
// the recipe CNN's tensors

/// Saved statistics and running estimates of one BatchNorm layer (each `(C)`).
#[derive(Clone, Copy, Debug)]
pub struct BnTensors {
    /// Batch mean saved for backward.
    pub mean: Region,
    /// Batch 1/std saved for backward.
    pub invstd: Region,
    /// Running mean.
    pub running_mean: Region,
    /// Running (unbiased) variance.
    pub running_var: Region,
}

/// Loss outputs.
#[derive(Clone, Copy, Debug)]
pub struct LossTensors {
    /// Per-sample loss `(B)`.
    pub losses: Region,
    /// Softmax `(B, 10)`.
    pub probs: Region,
    /// Mean loss of the batch `(1)`.
    pub mean_loss: Region,
    /// Σ over steps of batch * mean loss `(1)`, read back every few steps.
    pub loss_sum: Region,
    /// Correct predictions of the batch `(1)`, i32.
    pub correct: Region,
}

/// Where one parameter tensor of the model lives (same offsets in params, grads, m, v and the
/// bf16 copy).
#[derive(Clone, Copy, Debug)]
pub struct ParamAt {
    /// Offset in the flat vectors.
    pub off: usize,
    /// Elements.
    pub len: usize,
}

/// Every tensor of the recipe CNN's device step, sized for `batch` (B) images.
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
    /// bf16 copy of the parameters `(P)` (bf16 precision only; empty otherwise).
    pub params_bf: Region,
    /// Parameter offsets: conv1 w/b, bn1 w/b, conv2 w/b, bn2 w/b, fc1 w/b, fc2 w/b.
    pub p: [ParamAt; 12],
    /// BatchNorm state, both layers, contiguous `(2*32 + 2*64)` for one broadcast.
    pub bn_state: Region,
    /// Layer 1 BatchNorm.
    pub bn1: BnTensors,
    /// Layer 2 BatchNorm.
    pub bn2: BnTensors,
    /// Sample ids of the batch `(B)` i32.
    pub indices: Region,
    /// Labels of the batch `(B)` i32.
    pub labels: Region,
    /// Input `(B, 1, 28, 28)`.
    pub x: Region,
    /// conv1 output `(B, 32, 28, 28)`.
    pub c1: Region,
    /// bn1 + ReLU output `(B, 32, 28, 28)`.
    pub a1: Region,
    /// pool1 output `(B, 32, 14, 14)`.
    pub p1: Region,
    /// pool1 argmax `(B, 32, 14, 14)` i32.
    pub idx1: Region,
    /// conv2 output `(B, 64, 14, 14)`.
    pub c2: Region,
    /// bn2 + ReLU output `(B, 64, 14, 14)`.
    pub a2: Region,
    /// pool2 output, flattened `(B, 3136)`.
    pub p2: Region,
    /// pool2 argmax `(B, 64, 7, 7)` i32.
    pub idx2: Region,
    /// fc1 + ReLU output `(B, 64)`.
    pub h: Region,
    /// fc2 output `(B, 10)`.
    pub logits: Region,
    /// Loss tensors.
    pub loss: LossTensors,
    /// `(B, 10)`.
    pub dlogits: Region,
    /// Gradient at h, post-ReLU `(B, 64)`.
    pub dh: Region,
    /// Gradient at h, pre-ReLU `(B, 64)`.
    pub dh_pre: Region,
    /// `(B, 3136)`.
    pub dp2: Region,
    /// `(B, 64, 14, 14)`.
    pub da2: Region,
    /// `(B, 64, 14, 14)`.
    pub dc2: Region,
    /// `(B, 32, 14, 14)`.
    pub dp1: Region,
    /// `(B, 32, 28, 28)`.
    pub da1: Region,
    /// `(B, 32, 28, 28)`.
    pub dc1: Region,
    /// bf16 copies of the GEMM operands: x, p1, p2, h, dlogits, dh_pre, dc2, dc1 (bf16 only).
    pub bf: BfTensors,
    /// Elements of each arena: (f32, i32, bf16).
    pub arena_len: (usize, usize, usize),
}

/// bf16 copies of the GEMM operands (empty regions in fp32 mode).
#[derive(Clone, Copy, Debug)]
pub struct BfTensors {
    /// `(B, 1, 28, 28)`.
    pub x: Region,
    /// `(B, 32, 14, 14)`.
    pub p1: Region,
    /// `(B, 3136)`.
    pub p2: Region,
    /// `(B, 64)`.
    pub h: Region,
    /// `(B, 10)`.
    pub dlogits: Region,
    /// `(B, 64)`.
    pub dh_pre: Region,
    /// `(B, 64, 14, 14)`.
    pub dc2: Region,
    /// `(B, 32, 28, 28)`.
    pub dc1: Region,
}

/// Bump allocator over the three arenas.
struct Alloc {
    len: [usize; 3],
}

impl Alloc {
    fn take(&mut self, arena: Arena, len: usize) -> Region {
        let k = match arena {
            Arena::F32 => 0,
            Arena::I32 => 1,
            Arena::Bf16 => 2,
            _ => unreachable!("dataset arenas are not allocated here"),
        };
        // Keep every region 16-element aligned (64 bytes for f32), so vector loads stay aligned.
        let off = self.len[k].next_multiple_of(16);
        self.len[k] = off + len;
        Region { arena, off, len }
    }
}

/// The recipe CNN's parameter names, in the order of [`Tensors::p`].
pub const PARAM_NAMES: [&str; 12] = [
    "module1.0.weight",
    "module1.0.bias",
    "module1.1.weight",
    "module1.1.bias",
    "module2.0.weight",
    "module2.0.bias",
    "module2.1.weight",
    "module2.1.bias",
    "linear1.weight",
    "linear1.bias",
    "linear2.weight",
    "linear2.bias",
];

/// conv1 and conv2 of the recipe (5x5, padding 2).
pub const CONV1: Conv2dParams = Conv2dParams { in_c: 1, out_c: 32, kh: 5, kw: 5, stride: 1, pad: 2 };
/// See [`CONV1`].
pub const CONV2: Conv2dParams = Conv2dParams { in_c: 32, out_c: 64, kh: 5, kw: 5, stride: 1, pad: 2 };

impl Tensors {
    /// Lay out every tensor for up to `batch` images, with parameter offsets taken from `model`
    /// (the CPU engine's `Model::fashion_cnn`, so both engines share one flat layout).
    pub fn new(model: &Model, batch: usize, precision: Precision) -> Result<Tensors, String> {
        let mut p = [ParamAt { off: 0, len: 0 }; 12];
        for (k, name) in PARAM_NAMES.iter().enumerate() {
            let e = model
                .entries
                .iter()
                .find(|e| e.name == *name)
                .ok_or_else(|| format!("the model has no parameter {name}; the device engine runs the recipe CNN only"))?;
            p[k] = ParamAt { off: e.range.start, len: e.range.len() };
        }
        let np = model.num_params();
        let bf = precision == Precision::Bf16;
        let mut a = Alloc { len: [0; 3] };
        let (f, i32a, b16) = (Arena::F32, Arena::I32, Arena::Bf16);
        let params = a.take(f, np);
        let grads = a.take(f, np);
        let m = a.take(f, np);
        let v = a.take(f, np);
        let params_bf = a.take(b16, if bf { np } else { 0 });
        // Running statistics first and contiguous: one broadcast before evaluation.
        let state = a.take(f, 2 * 32 + 2 * 64);
        let bn = |a: &mut Alloc, c: usize, rm: usize| BnTensors {
            mean: a.take(f, c),
            invstd: a.take(f, c),
            running_mean: state.sub(rm, c),
            running_var: state.sub(rm + c, c),
        };
        let bn1 = bn(&mut a, 32, 0);
        let bn2 = bn(&mut a, 64, 64);
        let bsz = batch;
        let sz = |c: usize, hw: usize| bsz * c * hw;
        let t_bf = |a: &mut Alloc, n: usize| a.take(b16, if bf { n } else { 0 });
        Ok(Tensors {
            batch,
            num_params: np,
            params,
            grads,
            m,
            v,
            params_bf,
            p,
            bn_state: state,
            bn1,
            bn2,
            indices: a.take(i32a, bsz),
            labels: a.take(i32a, bsz),
            x: a.take(f, sz(1, 784)),
            c1: a.take(f, sz(32, 784)),
            a1: a.take(f, sz(32, 784)),
            p1: a.take(f, sz(32, 196)),
            idx1: a.take(i32a, sz(32, 196)),
            c2: a.take(f, sz(64, 196)),
            a2: a.take(f, sz(64, 196)),
            p2: a.take(f, sz(64, 49)),
            idx2: a.take(i32a, sz(64, 49)),
            h: a.take(f, sz(64, 1)),
            logits: a.take(f, sz(10, 1)),
            loss: LossTensors {
                losses: a.take(f, bsz),
                probs: a.take(f, sz(10, 1)),
                mean_loss: a.take(f, 1),
                loss_sum: a.take(f, 1),
                correct: a.take(i32a, 1),
            },
            dlogits: a.take(f, sz(10, 1)),
            dh: a.take(f, sz(64, 1)),
            dh_pre: a.take(f, sz(64, 1)),
            dp2: a.take(f, sz(64, 49)),
            da2: a.take(f, sz(64, 196)),
            dc2: a.take(f, sz(64, 196)),
            dp1: a.take(f, sz(32, 196)),
            da1: a.take(f, sz(32, 784)),
            dc1: a.take(f, sz(32, 784)),
            bf: BfTensors {
                x: t_bf(&mut a, sz(1, 784)),
                p1: t_bf(&mut a, sz(32, 196)),
                p2: t_bf(&mut a, sz(64, 49)),
                h: t_bf(&mut a, sz(64, 1)),
                dlogits: t_bf(&mut a, sz(10, 1)),
                dh_pre: t_bf(&mut a, sz(64, 1)),
                dc2: t_bf(&mut a, sz(64, 196)),
                dc1: t_bf(&mut a, sz(32, 784)),
            },
            arena_len: (a.len[0], a.len[1], a.len[2]),
        })
    }

    /// Parameter `k` (index into [`PARAM_NAMES`]) inside the flat region `flat` (params, grads or
    /// the bf16 copy).
    pub fn param(&self, flat: Region, k: usize) -> Region {
        flat.sub(self.p[k].off, self.p[k].len)
    }

    /// The forward pass for `b` images whose ids are in `indices[..b]` (train: batch statistics;
    /// eval: running statistics), ending with the loss and the correct count.
    pub fn forward(&self, ops: &mut Builder, b: usize, precision: Precision, train: bool) {
        assert!(b >= 1 && b <= self.batch, "batch {b} outside 1..={}", self.batch);
        let bf = precision == Precision::Bf16;
        let (pr, pbf) = (self.params, if bf { self.params_bf } else { self.params });
        let n = |r: Region, per: usize| r.prefix(b * per);
        // Operand of a GEMM: the bf16 copy (made here) in bf16 mode, the f32 tensor otherwise.
        let gemm_in = |ops: &mut Builder, f: Region, h: Region, per: usize| {
            if bf {
                ops.cast_to_bf16(h.prefix(b * per), f.prefix(b * per));
                h.prefix(b * per)
            } else {
                f.prefix(b * per)
            }
        };
        if bf {
            ops.cast_to_bf16(self.params_bf, self.params);
        }
        ops.gather(n(self.x, 784), n(self.labels, 1), n(self.indices, 1), b, 784);
        // module1: conv -> bn (+relu fused) -> pool
        let s1 = ConvLaunch { p: CONV1, batch: b, in_h: 28, in_w: 28 };
        let x = gemm_in(ops, self.x, self.bf.x, 784);
        ops.conv_forward(bf, n(self.c1, 32 * 784), x, self.param(pbf, 0), self.param(pr, 1), s1);
        self.bn_forward(ops, train, n(self.a1, 32 * 784), &self.bn1, n(self.c1, 32 * 784), 2, b, 784);
        ops.maxpool_forward(n(self.p1, 32 * 196), n(self.idx1, 32 * 196), n(self.a1, 32 * 784), b, 32, 28, 28, 2);
        // module2
        let s2 = ConvLaunch { p: CONV2, batch: b, in_h: 14, in_w: 14 };
        let p1 = gemm_in(ops, self.p1, self.bf.p1, 32 * 196);
        ops.conv_forward(bf, n(self.c2, 64 * 196), p1, self.param(pbf, 4), self.param(pr, 5), s2);
        self.bn_forward(ops, train, n(self.a2, 64 * 196), &self.bn2, n(self.c2, 64 * 196), 6, b, 196);
        ops.maxpool_forward(n(self.p2, 3136), n(self.idx2, 3136), n(self.a2, 64 * 196), b, 64, 14, 14, 2);
        // flatten is free (NCHW is already PyTorch's flatten order); fc1 (+relu fused), fc2
        let p2 = gemm_in(ops, self.p2, self.bf.p2, 3136);
        ops.linear_forward(bf, n(self.h, 64), p2, self.param(pbf, 8), self.param(pr, 9), b, 3136, 64, true);
        let h = gemm_in(ops, self.h, self.bf.h, 64);
        ops.linear_forward(bf, n(self.logits, 10), h, self.param(pbf, 10), self.param(pr, 11), b, 64, 10, false);
        ops.xent_forward(&self.loss, n(self.logits, 10), n(self.labels, 1), b, 10);
    }

    #[allow(clippy::too_many_arguments)]
    fn bn_forward(&self, ops: &mut Builder, train: bool, out: Region, bn: &BnTensors, inp: Region, k: usize, b: usize, hw: usize) {
        let (w, bias) = (self.param(self.params, k), self.param(self.params, k + 1));
        if train {
            ops.bn_forward_train(out, bn, inp, w, bias, b, hw, true);
        } else {
            ops.bn_forward_eval(out, bn, inp, w, bias, b, hw, true);
        }
    }

    /// Backward for the last forward of `b` images, in exactly the reverse layer order; zeroes the
    /// flat gradients first (parameter gradients accumulate).
    pub fn backward(&self, ops: &mut Builder, b: usize, precision: Precision) {
        let bf = precision == Precision::Bf16;
        let (g, pbf) = (self.grads, if bf { self.params_bf } else { self.params });
        let n = |r: Region, per: usize| r.prefix(b * per);
        let gemm_in = |ops: &mut Builder, f: Region, h: Region, per: usize| {
            if bf {
                ops.cast_to_bf16(h.prefix(b * per), f.prefix(b * per));
                h.prefix(b * per)
            } else {
                f.prefix(b * per)
            }
        };
        // The bf16 copies of forward activations are still in place from forward.
        let saved = |f: Region, h: Region, per: usize| if bf { h.prefix(b * per) } else { f.prefix(b * per) };
        ops.fill(g, 0.0);
        ops.xent_backward(n(self.dlogits, 10), n(self.loss.probs, 10), n(self.labels, 1), b, 10);
        // fc2
        let dl = gemm_in(ops, self.dlogits, self.bf.dlogits, 10);
        let h = saved(self.h, self.bf.h, 64);
        ops.linear_backward_weight(bf, self.param(g, 10), dl, h, b, 64, 10);
        ops.linear_backward_bias(bf, self.param(g, 11), dl, b, 10);
        ops.linear_backward_input(bf, n(self.dh, 64), dl, self.param(pbf, 10), b, 64, 10);
        // relu (fused into fc1's forward)
        ops.relu_backward(n(self.dh_pre, 64), n(self.h, 64), n(self.dh, 64));
        // fc1
        let dhp = gemm_in(ops, self.dh_pre, self.bf.dh_pre, 64);
        let p2 = saved(self.p2, self.bf.p2, 3136);
        ops.linear_backward_weight(bf, self.param(g, 8), dhp, p2, b, 3136, 64);
        ops.linear_backward_bias(bf, self.param(g, 9), dhp, b, 64);
        ops.linear_backward_input(bf, n(self.dp2, 3136), dhp, self.param(pbf, 8), b, 3136, 64);
        // module2: pool, bn (+relu), conv
        ops.maxpool_backward(n(self.da2, 64 * 196), n(self.dp2, 3136), n(self.idx2, 3136), b, 64, 14, 14, 2);
        let (w2, b2) = (self.param(self.params, 6), (self.param(g, 6), self.param(g, 7)));
        ops.bn_backward(
            n(self.dc2, 64 * 196),
            b2.0,
            b2.1,
            n(self.da2, 64 * 196),
            n(self.c2, 64 * 196),
            n(self.a2, 64 * 196),
            w2,
            &self.bn2,
            b,
            196,
            true,
        );
        let s2 = ConvLaunch { p: CONV2, batch: b, in_h: 14, in_w: 14 };
        let dc2 = gemm_in(ops, self.dc2, self.bf.dc2, 64 * 196);
        let p1 = saved(self.p1, self.bf.p1, 32 * 196);
        ops.conv_backward_weight(bf, self.param(g, 4), dc2, p1, s2);
        ops.conv_backward_bias(bf, self.param(g, 5), dc2, s2);
        ops.conv_backward_input(bf, n(self.dp1, 32 * 196), dc2, self.param(pbf, 4), s2);
        // module1 (no input gradient for the first layer)
        ops.maxpool_backward(n(self.da1, 32 * 784), n(self.dp1, 32 * 196), n(self.idx1, 32 * 196), b, 32, 28, 28, 2);
        let w1 = self.param(self.params, 2);
        ops.bn_backward(
            n(self.dc1, 32 * 784),
            self.param(g, 2),
            self.param(g, 3),
            n(self.da1, 32 * 784),
            n(self.c1, 32 * 784),
            n(self.a1, 32 * 784),
            w1,
            &self.bn1,
            b,
            784,
            true,
        );
        let s1 = ConvLaunch { p: CONV1, batch: b, in_h: 28, in_w: 28 };
        let dc1 = gemm_in(ops, self.dc1, self.bf.dc1, 32 * 784);
        let x = saved(self.x, self.bf.x, 784);
        ops.conv_backward_weight(bf, self.param(g, 0), dc1, x, s1);
        ops.conv_backward_bias(bf, self.param(g, 1), dc1, s1);
    }

    /// The captured part of a training step for `b` images: forward, loss (added into
    /// `loss_sum` as `b * mean_loss`), backward. The gradient all-reduce and the optimizer run
    /// outside (the collective is on another stream; Adam's step count changes every step).
    pub fn train_step(&self, b: usize, precision: Precision, sm_count: usize) -> Vec<Op> {
        let mut ops = Builder::new(sm_count);
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
