//! Layers with explicit `forward` and `backward` side by side (no autograd).
//!
//! Conventions, stated once for every file here (llm.c style):
//! - parameter gradients **accumulate** (`dweight += ...`), so callers zero them once per step;
//! - activation gradients **overwrite** (`dinp = ...`);
//! - a layer receives its parameters as a slice of the model's flat parameter vector (and its
//!   gradients as the matching slice of the flat gradient buffer), so the optimizer and the
//!   gradient all-reduce see one contiguous buffer;
//! - `forward` saves what `backward` needs (argmax, batch statistics); the model keeps every
//!   activation, so `backward` also gets the layer's input and output.

pub mod batchnorm;
pub mod conv2d;
pub mod flatten;
pub mod linear;
pub mod loss;
pub mod maxpool;
pub mod relu;

pub use batchnorm::BatchNorm2d;
pub use conv2d::{Conv2d, Conv2dParams};
pub use flatten::Flatten;
pub use linear::Linear;
pub use loss::SoftmaxCrossEntropy;
pub use maxpool::MaxPool2d;
pub use relu::Relu;

use super::rng::Rng;
use super::tensor::Tensor;

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
}

/// A non-trainable state tensor (BatchNorm running statistics), exposed for checkpoints.
#[derive(Debug)]
pub enum BufferMut<'a> {
    /// `f32` values (`running_mean`, `running_var`).
    F32(&'static str, &'a mut Vec<f32>),
    /// An `i64` counter (`num_batches_tracked`).
    I64(&'static str, &'a mut i64),
}

/// A layer: shape math, parameters, forward and backward.
///
/// `Any` lets engines that run layers their own way (the device engine) read a layer's concrete
/// type and shape parameters (`(layer as &dyn Any).downcast_ref::<Conv2d>()`).
pub trait Layer: Send + std::any::Any {
    /// Short kind name for messages (`conv2d`, `relu`, ...).
    fn kind(&self) -> &'static str;
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
    /// This layer as a BatchNorm, for the trainer's synchronised-BatchNorm path.
    fn as_batchnorm(&mut self) -> Option<&mut BatchNorm2d> {
        None
    }
    /// `out = f(inp)`; `train` selects training behaviour (batch statistics in BatchNorm).
    fn forward(&mut self, p: &[f32], inp: &Tensor, out: &mut Tensor, train: bool);
    /// Accumulate parameter gradients into `dp` and, when `dinp` is given, overwrite it with the
    /// gradient of the loss with respect to `inp`.
    fn backward(&mut self, p: &[f32], dp: &mut [f32], inp: &Tensor, out: &Tensor, dout: &Tensor, dinp: Option<&mut Tensor>);
}

/// Finite-difference gradient checks shared by the layer tests.
#[cfg(test)]
pub(crate) mod gradcheck {
    use super::*;

    /// Check `backward` of `layer` against central differences of `L = sum(out * w)` for a fixed
    /// random `w`, for every parameter and (optionally) input element. Uses f64-free f32 math
    /// with a step and tolerance suited to f32.
    pub fn check(layer: &mut dyn Layer, inp_dims: &[usize], check_input: bool, seed: u64) {
        check_with_step(layer, inp_dims, check_input, seed, 1e-2)
    }

    /// [`check`] with an explicit finite-difference step (smaller for layers with kinks, where a
    /// large step could move an input across a max or zero).
    pub fn check_with_step(layer: &mut dyn Layer, inp_dims: &[usize], check_input: bool, seed: u64, h: f32) {
        let mut rng = Rng::new(seed, 99);
        let specs = layer.param_specs();
        let np: usize = specs.iter().map(|s| s.numel()).sum();
        let mut p: Vec<f32> = (0..np).map(|_| rng.uniform(-1.0, 1.0)).collect();
        let inp_n: usize = inp_dims.iter().product();
        let mut inp = Tensor::from_vec(inp_dims, (0..inp_n).map(|_| rng.uniform(-1.0, 1.0)).collect()).unwrap();
        let od = layer.out_dims(inp_dims).unwrap();
        let on: usize = od.iter().product();
        let w: Vec<f32> = (0..on).map(|_| rng.uniform(-1.0, 1.0)).collect();
        let loss = |layer: &mut dyn Layer, p: &[f32], inp: &Tensor| -> f64 {
            let mut out = Tensor::zeros(&od);
            layer.forward(p, inp, &mut out, true);
            out.data().iter().zip(&w).map(|(a, b)| *a as f64 * *b as f64).sum()
        };
        let mut out = Tensor::zeros(&od);
        layer.forward(&p, &inp, &mut out, true);
        let dout = Tensor::from_vec(&od, w.clone()).unwrap();
        let mut dp = vec![0.0f32; np];
        let mut dinp = Tensor::zeros(inp_dims);
        layer.backward(&p, &mut dp, &inp, &out, &dout, if check_input { Some(&mut dinp) } else { None });
        let kind = layer.kind();
        let mut num_dp = vec![0.0f64; np];
        for i in 0..np {
            let orig = p[i];
            p[i] = orig + h;
            let lp = loss(layer, &p, &inp);
            p[i] = orig - h;
            let lm = loss(layer, &p, &inp);
            p[i] = orig;
            num_dp[i] = (lp - lm) / (2.0 * h as f64);
        }
        assert_close(&format!("{kind} dparam"), &dp, &num_dp, 2e-2, 2e-2);
        if check_input {
            let mut num_dinp = vec![0.0f64; inp_n];
            for i in 0..inp_n {
                let orig = inp.data()[i];
                inp.data_mut()[i] = orig + h;
                let lp = loss(layer, &p, &inp);
                inp.data_mut()[i] = orig - h;
                let lm = loss(layer, &p, &inp);
                inp.data_mut()[i] = orig;
                num_dinp[i] = (lp - lm) / (2.0 * h as f64);
            }
            assert_close(&format!("{kind} dinp"), dinp.data(), &num_dinp, 2e-2, 2e-2);
        }
    }

    /// llm.c-style checker: `|got - want| <= atol + rtol * |want|`, non-finite references
    /// skipped, the first mismatches printed with tensor name and index, at most 10 listed.
    pub fn assert_close(name: &str, got: &[f32], want: &[f64], atol: f64, rtol: f64) {
        let mut bad = Vec::new();
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            if w.is_finite() && (g as f64 - w).abs() > atol + rtol * w.abs() {
                bad.push(format!("  {name}[{i}]: got {g}, want {w}"));
                if bad.len() == 10 {
                    break;
                }
            }
        }
        assert!(bad.is_empty(), "{name}: mismatches (first {}):\n{}", bad.len(), bad.join("\n"));
    }
}
