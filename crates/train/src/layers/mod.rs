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
#[cfg(test)]
pub(crate) mod gradcheck;
mod layer;
pub mod linear;
pub mod loss;
pub mod maxpool;
pub mod relu;

pub use batchnorm::BatchNorm2d;
pub use conv2d::{Conv2d, Conv2dParams};
pub use flatten::Flatten;
pub use layer::{BufferMut, Init, Layer, ParamSpec, SumFn};
pub use linear::Linear;
pub use loss::SoftmaxCrossEntropy;
pub use maxpool::MaxPool2d;
pub use relu::Relu;
