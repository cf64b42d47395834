//! # lockstep-train
//!
//! The autograd-free training engine on the [`lockstep`] runtime: tensors, layers with explicit
//! forward/backward, a sequential model with PyTorch names, optimizers, schedules, the
//! FashionMNIST reader, a distributed sampler, safetensors checkpoints, the data-parallel trainer,
//! and the same CNN on CUDA (the `kernels/*.cu` kernels, compiled at run time by NVRTC). The
//! `train-cnn` binary (`src/bin/train_cnn.rs`) drives it.
//!
//! | file | what lives there |
//! |---|---|
//! | `tensor.rs` | [`Tensor`](tensor::Tensor): shape + contiguous f32 storage, reused across steps |
//! | `rng.rs` | [`Rng`](rng::Rng): seeded PCG32 for initialisation and shuffling |
//! | `kernels.rs` | the one GEMM entry point (the `gemm` crate, runtime SIMD dispatch) |
//! | `multiversion.rs` | `dispatch!`: element-wise loops compiled for AVX-512, AVX2 and portable, picked at run time |
//! | `layers/` | one file per layer: forward + backward, CPU reference, gradient check |
//! | `model.rs` | [`Model`](model::Model): named layers over flat parameters, the FashionMNIST CNN |
//! | `optim.rs`, `schedule.rs` | Adam / SGD with PyTorch semantics; constant, cosine, one-cycle |
//! | `precision.rs` | `mixed_precision` (no / fp16 / bf16) per engine, refusals, dynamic loss scaling |
//! | `seed.rs` | [`set_seed`]: one seed for every generator of the engine, checked across ranks (Accelerate's `set_seed`) |
//! | `data.rs`, `sampler.rs` | IDX reader with validation; distributed sampler and metric counts |
//! | `checkpoint/` | safetensors with PyTorch `state_dict` names, atomic writes, resume |
//! | `device/` | the same CNN on CUDA: a launch plan per step (CUDA graph), GPU and CPU-twin executors |
//! | `trainer.rs` | the data-parallel loop: broadcast, bucketed gradient all-reduce (gradient accumulation, clipping), evaluation |

// Every `unsafe` block carries a `// SAFETY:` comment in the form clippy recognises.
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod checkpoint;
pub mod data;
pub mod device;
pub mod kernels;
pub mod layers;
pub(crate) mod microgemm;
pub mod model;
pub(crate) mod multiversion;
pub mod optim;
pub mod precision;
pub mod rng;
pub mod sampler;
pub mod schedule;
pub mod seed;
pub mod tensor;
pub mod trainer;
pub(crate) mod winograd;

pub use seed::set_seed;
