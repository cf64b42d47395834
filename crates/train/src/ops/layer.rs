//! The [`Layer`] trait and what layers share: parameter specs, initialisers, the gradient-buffer
//! view, and the cross-rank sum used by synchronised BatchNorm.

use super::conv2d::Conv2dParams;
use crate::rng::Rng;
use crate::tensor::Tensor;

/// A cross-rank sum of partial statistics (synchronised BatchNorm): the trainer passes an
/// all-reduce; a single process passes nothing and layers use their local values.
pub type SumFn<'a, E> = dyn FnMut(&mut [f64]) -> Result<(), E> + 'a;

/// How a parameter is initialised (PyTorch defaults).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Uniform in `[-bound, bound]`: Kaiming-uniform with a = √5 gives `bound = 1/√fan_in`, and
    /// PyTorch's default bias init uses the same bound.
    Uniform(f32),
    /// Every element set to this value (BatchNorm weight 1, bias 0).
    Const(f32),
}

impl Init {
    /// Fill `p` from `rng`.
    pub fn fill(self, p: &mut [f32], rng: &mut Rng) {
        match self {
            Init::Uniform(b) => p.iter_mut().for_each(|x| *x = rng.uniform(-b, b)),
            Init::Const(c) => p.fill(c),
        }
    }
}

/// One named parameter of a layer (`weight`, `bias`).
#[derive(Clone, Debug)]
pub struct ParamSpec {
    /// Name within the layer, as PyTorch spells it.
    pub name: &'static str,
    /// Dimensions, PyTorch layout (`[out_c, in_c, kh, kw]` for conv weights).
    pub dims: Vec<usize>,
    /// Default initialisation.
    pub init: Init,
}

impl ParamSpec {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }

    /// A `weight` of `dims` and a `bias` of `dims[0]` (the output channels or features), both
    /// PyTorch's default for convolutions and linear layers: uniform within `1/√fan_in`.
    pub fn weight_and_bias(dims: Vec<usize>, fan_in: usize) -> Vec<ParamSpec> {
        let init = Init::Uniform(1.0 / (fan_in as f32).sqrt());
        let bias = vec![dims[0]];
        vec![
            ParamSpec {
                name: "weight",
                dims,
                init,
            },
            ParamSpec {
                name: "bias",
                dims: bias,
                init,
            },
        ]
    }
}

/// A non-trainable state tensor (BatchNorm running statistics), exposed for checkpoints.
#[derive(Debug)]
pub enum BufferMut<'a> {
    /// `f32` values (`running_mean`, `running_var`).
    F32(&'static str, &'a mut Vec<f32>),
    /// An `i64` counter (`num_batches_tracked`).
    I64(&'static str, &'a mut i64),
}

/// What a layer computes and its hyperparameters: the model described once. The CPU engine runs
/// the [`Layer`] objects; the device engine builds its launch plan from the specs alone.
#[derive(Clone, Debug, PartialEq)]
pub enum LayerSpec {
    /// 2-D convolution (`kernels/conv2d.cu`).
    Conv2d(Conv2dParams),
    /// BatchNorm2d over `channels` (`kernels/batchnorm.cu`); `sync` sums statistics over ranks.
    BatchNorm2d {
        /// Channels.
        channels: usize,
        /// Running-statistics momentum (PyTorch's convention).
        momentum: f32,
        /// Variance epsilon.
        eps: f32,
        /// Synchronised BatchNorm (statistics summed over ranks).
        sync: bool,
    },
    /// Element-wise rectifier (`kernels/activation.cu`).
    Relu,
    /// 2-D max pooling (`kernels/pool.cu`).
    MaxPool2d {
        /// Window side.
        kernel: usize,
        /// Stride (both directions).
        stride: usize,
    },
    /// `[N, C, H, W]` to `[N, C*H*W]` (no kernel: NCHW already is the flattened order).
    Flatten,
    /// Fully connected layer (`kernels/linear.cu`).
    Linear {
        /// Input features.
        in_f: usize,
        /// Output features.
        out_f: usize,
    },
    /// A layer the device engine has no kernels for, by its kind name.
    Other(&'static str),
}

impl LayerSpec {
    /// Short kind name for messages (`conv2d`, `relu`, ...): one per variant, so the layers need
    /// not spell their own.
    pub fn kind(&self) -> &'static str {
        match self {
            LayerSpec::Conv2d(_) => "conv2d",
            LayerSpec::BatchNorm2d { .. } => "batchnorm2d",
            LayerSpec::Relu => "relu",
            LayerSpec::MaxPool2d { .. } => "maxpool2d",
            LayerSpec::Flatten => "flatten",
            LayerSpec::Linear { .. } => "linear",
            LayerSpec::Other(kind) => kind,
        }
    }
}

/// A layer: shape math, parameters, forward and backward.
///
/// `Any` lets the CPU model's fused groups (BatchNorm + ReLU + pool, streamed into the
/// convolution before) reach the concrete layers they fuse; every other reader describes a layer
/// by its [`LayerSpec`].
pub trait Layer: Send + std::any::Any {
    /// Short kind name for messages (`conv2d`, `relu`, ...), [`LayerSpec::kind`] of its spec.
    fn kind(&self) -> &'static str {
        self.spec().kind()
    }
    /// What the layer computes, with its hyperparameters (the device plan is built from these);
    /// a layer the device has no kernels for says [`LayerSpec::Other`] with its kind name.
    fn spec(&self) -> LayerSpec;
    /// Non-trainable `f32` state by name (BatchNorm's running statistics), read-only; the
    /// device engine uploads it.
    fn f32_buffers(&self) -> Vec<(&'static str, &[f32])> {
        Vec::new()
    }
    /// Output dimensions for an input of `inp` dimensions, or a message saying what is wrong.
    fn out_dims(&self, inp: &[usize]) -> Result<Vec<usize>, String>;
    /// Parameters in PyTorch order; empty for parameter-free layers.
    fn param_specs(&self) -> Vec<ParamSpec> {
        Vec::new()
    }
    /// Non-trainable state for checkpoints.
    fn buffers_mut(&mut self) -> Vec<BufferMut<'_>> {
        Vec::new()
    }
    /// `out = f(inp)`; `train` selects training behaviour (batch statistics in BatchNorm).
    fn forward(&mut self, p: &[f32], inp: &Tensor, out: &mut Tensor, train: bool);
    /// Accumulate parameter gradients into `g.dp` and, when `g.dinp` is given, overwrite it with
    /// the gradient of the loss with respect to `g.inp`.
    fn backward(&mut self, g: Backward<'_>);
}

/// The arguments of [`Layer::backward`]: what the forward pass read and wrote, the gradient
/// arriving from the layer above, and where this layer's gradients go.
pub struct Backward<'a> {
    /// The layer's parameters, as the forward pass read them.
    pub p: &'a [f32],
    /// Where the parameter gradients accumulate (same layout as `p`).
    pub dp: &'a mut [f32],
    /// The forward pass's input.
    pub inp: &'a Tensor,
    /// The forward pass's output.
    pub out: &'a Tensor,
    /// Gradient of the loss with respect to `out`.
    pub dout: &'a Tensor,
    /// Where the gradient with respect to `inp` goes; `None` where nobody needs it (the first
    /// layer).
    pub dinp: Option<&'a mut Tensor>,
}
