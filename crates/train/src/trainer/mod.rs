//! The data-parallel training loop: the settings, reports and errors of a run (`config.rs`), the epoch
//! loop both engines run (`epoch.rs`: batches, evaluation, resume, observers, metrics, written
//! once over the `EpochEngine` trait), the CPU engine (`cpu.rs`), and its in-job recovery from a
//! peer's death under `lockstep launch --restart-policy rank` (`recover.rs`).
//!
//! Every rank holds a full model. At start rank 0's parameters are broadcast so all replicas are
//! identical. Each step a rank runs forward and backward on its shard of the batch, then the
//! gradients are averaged with all-reduce in fixed-order buckets (DDP's scheme: ~25 MiB buckets
//! filled from the last parameter backwards), and every rank applies the same optimizer update.
//! The flat gradient buffer lives in `alloc_shared` memory when the backend offers it, so each
//! bucket all-reduce is zero-copy. BatchNorm statistics stay local to each rank (or, with
//! `sync_bn`, are summed over ranks as `SyncBatchNorm` does); before evaluation rank 0's running
//! statistics are broadcast, as DDP's `broadcast_buffers` does.
//!
//! Nothing is allocated per step: activations, gradients, index and label buffers are sized once
//! and reused (a smaller last batch only shrinks the view).
//!
//! Options beyond the reference PyTorch script: SGD with momentum instead of Adam ([`OptimizerKind`]); gradient
//! accumulation over `grad_accum` micro-batches with the all-reduce only after the last one (DDP's
//! `no_sync`), weighted so the step equals one step on the concatenated batch
//! ([`step_gradients`]); and clipping of the global gradient norm after the all-reduce
//! ([`clip_grad_norm`]), identical on every rank because the gradients are.

mod config;
mod cpu;
pub(crate) mod epoch;
pub(crate) mod recover;

pub use config::{
    EpochReport, Observer, OptimizerKind, Silent, TrainConfig, TrainError, TrainOutcome,
};
pub use cpu::{buckets, clip_grad_norm, evaluate, load_batch, step_gradients, train};
