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
//! | `gemm/` | the one GEMM entry point (the `gemm` crate, runtime SIMD dispatch), its AVX-512 micro-kernels, the CPU twin of the kernels' tiled core (`kernels/common.cuh`) |
//! | `multiversion.rs` | `dispatch!`: element-wise loops compiled for AVX-512, AVX2 and portable, picked at run time |
//! | `ops/` | one home per `kernels/<op>.cu`: the CPU layer (forward + backward, gradient check), the kernel's CPU twins, the shape; [`Layer`](ops::Layer) and [`LayerSpec`](ops::LayerSpec) (the model described once); Adam / SGD in `ops/optim` |
//! | `model.rs` | [`Model`](model::Model): named layers over flat parameters, the FashionMNIST CNN |
//! | `schedule.rs` | constant, cosine and one-cycle learning-rate schedules |
//! | `precision.rs` | `mixed_precision` (no / fp16 / bf16) per engine, refusals, dynamic loss scaling |
//! | `seed.rs` | [`set_seed`]: one seed for every generator of the engine, checked across ranks (Accelerate's `set_seed`) |
//! | `data.rs`, `sampler.rs` | IDX reader with validation; distributed sampler and metric counts |
//! | `checkpoint/` | safetensors with PyTorch `state_dict` names, atomic writes, resume |
//! | `device/` | the same CNN on CUDA: the kernel registry, a launch plan per step built from the layer specs (CUDA graph), GPU and CPU-twin executors |
//! | `trainer/` | settings and reports (`config.rs`); the epoch loop both engines run (`epoch.rs`: batches, evaluation, resume, checkpoints, observers); the CPU engine (`cpu.rs`: broadcast, bucketed gradient all-reduce, gradient accumulation, clipping) |

// Every `unsafe` block carries a `// SAFETY:` comment in the form clippy recognises.
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod checkpoint;
pub mod data;
pub mod device;
pub mod gemm;
pub mod model;
pub(crate) mod multiversion;
pub mod ops;
pub mod precision;
pub mod rng;
pub mod sampler;
pub mod schedule;
pub mod seed;
pub mod tensor;
pub mod trainer;

pub use seed::set_seed;
