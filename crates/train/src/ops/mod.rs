//! The training ops, one home per kernel file: each `kernels/<op>.cu` has `ops/<op>` here,
//! holding its CPU layer (explicit `forward` and `backward`, no autograd), the CPU twin of every
//! entry point of the kernel file (`twin.rs`, or beside the layer where the math is the same),
//! and its shape. The launches stay in the device plan (`device/plan/builder.rs`), which reads
//! the model through [`LayerSpec`].
//!
//! | kernel file | home | what lives there |
//! |---|---|---|
//! | `activation.cu` | `activation.rs` | [`Relu`] and its twins, one implementation for both |
//! | `batchnorm.cu` | `batchnorm/` | [`BatchNorm2d`] (fused BatchNorm + ReLU + pool groups), `twin.rs` |
//! | `conv2d.cu` | `conv2d/` | [`Conv2d`], `shape.rs` ([`Conv2dParams`]), `twin.rs`, `winograd.rs` (the F(4x4, 5x5) path) |
//! | `data.cu` | `data.rs` | twins of the batch gather, gradient-bucket copies and casts |
//! | `elementwise.cu` | `elementwise.rs` | twins of fill, scale, axpy, split-K reduce |
//! | `linear.cu` | `linear/` | [`Linear`], `twin.rs` |
//! | `loss.cu` | `loss/` | [`SoftmaxCrossEntropy`], `twin.rs` |
//! | `optim.cu` | `optim/` | [`Adam`](optim::Adam), [`Sgd`](optim::Sgd) (PyTorch semantics), `twin.rs` |
//! | `pool.cu` | `pool/` | [`MaxPool2d`], `twin.rs` |
//! | (none) | `flatten.rs` | [`Flatten`]: NCHW already is the flattened order |
//! | `common.cuh` | `crate::gemm` | the shared GEMM: the CPU entry, its micro-kernels, the tiled core's twin |
//!
//! Where a layer and its twins are separate functions they differ on purpose: the layer is the
//! fast CPU path (GEMM blocking, the Winograd transform, the fused BatchNorm + ReLU + pool groups,
//! f64 statistics where PyTorch keeps them), the twin follows its kernel's summation order and
//! conventions (i32 argmax, split-K planes, f32 tiles), so each checks the other
//! (`tests/twins.rs`). ReLU's math has no order to differ in, so `activation.rs` has one copy.
//!
//! [`twins`] lists every twin under the kernel's name; `layer.rs` holds the [`Layer`] trait and
//! [`LayerSpec`], the model described once for both engines.
//!
//! Conventions, stated once for every layer here (llm.c style):
//! - parameter gradients **accumulate** (`dweight += ...`), so callers zero them once per step;
//! - activation gradients **overwrite** (`dinp = ...`);
//! - a layer receives its parameters as a slice of the model's flat parameter vector (and its
//!   gradients as the matching slice of the flat gradient buffer), so the optimizer and the
//!   gradient all-reduce see one contiguous buffer;
//! - `forward` saves what `backward` needs (argmax, batch statistics); the model keeps every
//!   activation, so `backward` also gets the layer's input and output.

pub mod activation;
pub mod batchnorm;
pub mod conv2d;
pub mod data;
pub mod elementwise;
pub mod flatten;
#[cfg(test)]
pub(crate) mod gradcheck;
mod layer;
pub mod linear;
pub mod loss;
pub mod optim;
pub mod pool;
pub mod twins;

pub use activation::Relu;
pub use batchnorm::{BatchNorm2d, Bn2dShape};
pub use conv2d::{Conv2d, Conv2dParams, Conv2dShape};
pub use flatten::Flatten;
pub use layer::{Backward, BufferMut, Init, Layer, LayerSpec, ParamSpec, SumFn};
pub use linear::{Linear, LinearShape};
pub use loss::SoftmaxCrossEntropy;
pub use pool::{MaxPool2d, Pool2dShape};
