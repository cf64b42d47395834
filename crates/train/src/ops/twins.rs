//! CPU twins of every `kernels/*.cu` entry point (as llm.c keeps a CPU reference beside each
//! kernel): the same name and argument order, device pointers become slices (`&mut` where the kernel writes), scalars keep their C
//! types (`i32` for `int`, `i64` for `long long`). Each twin implements the math documented in its
//! `.cu` header and nothing else, so a kernel is checked against its twin on random inputs
//! (`tests/gpu_kernels.rs`) and the twin against the engine's CPU layers (`tests/twins.rs`, which
//! runs everywhere).
//!
//! Arithmetic: f32, with the kernel's conventions (activation gradients OVERWRITTEN, parameter
//! gradients ACCUMULATED). GEMM-shaped sums (conv, linear) accumulate in f32 like the kernels'
//! tiles; per-channel statistics (BatchNorm) and the loss accumulate in f64, a closer stand-in for
//! the kernels' tree reductions than one long sequential f32 sum.
//!
//! FMA contraction: NVRTC compiles with `-fmad=true` (its default, kept because it is faster and
//! more accurate), so the GPU evaluates `a * b + c` as one `fmaf`. Where a rounding difference
//! decides something discrete (BatchNorm's output feeds the fused ReLU's mask: a value that
//! rounds to +0 on one side and to a tiny positive number on the other flips the mask), the twin
//! uses [`f32::mul_add`] for the same expressions, so both sides round once. Elsewhere the
//! tolerances absorb the last-bit differences. `_bf16` and `_f16` twins take
//! `half::bf16` / `half::f16` operands, widen them exactly, and accumulate in f32 as the kernels do.
//! A `NULL`-able pointer (conv/linear bias, BatchNorm `out` when `relu = 0`, the SGD buffer when
//! `momentum = 0`) is an `Option` or may be an empty slice, as documented per function.
//!
//! Sizes are trusted like the kernels trust them: a slice shorter than its shape says panics
//! (index out of bounds), which in a test is the bug report.
//!
//! This module is the index: each twin lives in its op's home, named as the kernel file
//! (`ops/conv2d/twin.rs` for `kernels/conv2d.cu`, `ops/activation.rs` for `kernels/activation.cu`,
//! whose twins are the CPU layer's own functions), and `gemm/twin.rs` holds what the GEMM-shaped
//! twins share with `kernels/common.cuh`.

pub use super::activation::{relu_backward_f32, relu_forward_f32};
pub use super::batchnorm::twin::{
    batchnorm2d_backward_f32, batchnorm2d_forward_eval_f32, batchnorm2d_forward_train_f32, BnStats,
};
pub use super::conv2d::twin::{
    conv2d_backward_bias_bf16, conv2d_backward_bias_f16, conv2d_backward_bias_f32,
    conv2d_backward_input_bf16, conv2d_backward_input_f16, conv2d_backward_input_f32,
    conv2d_backward_weight_bf16, conv2d_backward_weight_f16, conv2d_backward_weight_f32,
    conv2d_forward_bf16, conv2d_forward_f16, conv2d_forward_f32,
};
pub use super::data::{
    bucket_flatten_f32, bucket_unflatten_f32, cast_bf16_f32, cast_f16_f32, cast_f32_bf16,
    cast_f32_f16, gather_batch_f32, BucketDst, BucketSrc,
};
pub use super::elementwise::{axpy_f32, fill_f32, scale_f32, splitk_reduce_f32};
pub use super::linear::twin::{
    linear_backward_bias_bf16, linear_backward_bias_f16, linear_backward_bias_f32,
    linear_backward_input_bf16, linear_backward_input_f16, linear_backward_input_f32,
    linear_backward_weight_bf16, linear_backward_weight_f16, linear_backward_weight_f32,
    linear_forward_bf16, linear_forward_f16, linear_forward_f32,
};
pub use super::loss::twin::{
    softmax_xent_backward_f32, softmax_xent_backward_scaled_f32, softmax_xent_forward_f32,
};
pub use super::optim::twin::{
    adam_step_f32, amp_unscale_f32, clip_grad_scale_f32, grad_norm_coef_f32,
    grad_norm_partials_f32, sgd_step_f32, CLIP_THREADS,
};
pub use super::pool::twin::{maxpool2d_backward_f32, maxpool2d_forward_f32};
pub use crate::gemm::twin::split_k_ranges;

/// Every entry point that has a twin here, by kernel file (checked against the registry by a unit
/// test, so a new kernel without a twin fails CI).
pub const TWINS: &[&str] = &[
    "fill_f32",
    "scale_f32",
    "axpy_f32",
    "splitk_reduce_f32",
    "relu_forward_f32",
    "relu_backward_f32",
    "batchnorm2d_forward_train_f32",
    "batchnorm2d_forward_eval_f32",
    "batchnorm2d_backward_f32",
    "conv2d_forward_f32",
    "conv2d_forward_bf16",
    "conv2d_forward_f16",
    "conv2d_backward_input_f32",
    "conv2d_backward_input_bf16",
    "conv2d_backward_input_f16",
    "conv2d_backward_weight_f32",
    "conv2d_backward_weight_bf16",
    "conv2d_backward_weight_f16",
    "conv2d_backward_bias_f32",
    "conv2d_backward_bias_bf16",
    "conv2d_backward_bias_f16",
    "linear_forward_f32",
    "linear_forward_bf16",
    "linear_forward_f16",
    "linear_backward_input_f32",
    "linear_backward_input_bf16",
    "linear_backward_input_f16",
    "linear_backward_weight_f32",
    "linear_backward_weight_bf16",
    "linear_backward_weight_f16",
    "linear_backward_bias_f32",
    "linear_backward_bias_bf16",
    "linear_backward_bias_f16",
    "softmax_xent_forward_f32",
    "softmax_xent_backward_f32",
    "softmax_xent_backward_scaled_f32",
    "adam_step_f32",
    "sgd_step_f32",
    "amp_unscale_f32",
    "grad_norm_partials_f32",
    "grad_norm_coef_f32",
    "clip_grad_scale_f32",
    "maxpool2d_forward_f32",
    "maxpool2d_backward_f32",
    "gather_batch_f32",
    "bucket_flatten_f32",
    "bucket_unflatten_f32",
    "cast_f32_bf16",
    "cast_bf16_f32",
    "cast_f32_f16",
    "cast_f16_f32",
];
