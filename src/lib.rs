//! # lockstep
//!
//! A collective-communication runtime for data-parallel training, written on raw CUDA/NCCL with a
//! shared-memory backend for CPU-only nodes.
//!
//! Modules, bottom to top; each imports only from the ones before it (checked by
//! `.ci/layers.py`, which also finds import cycles between files):
//!
//! | module | what lives there |
//! |---|---|
//! | [`types`] | the vocabulary: [`Dtype`], [`ReduceOp`], [`CollKind`], the [`Buffer`]/[`BufferMut`] traits |
//! | [`store`] | the TCP rendezvous store that multi-node jobs meet through |
//! | `logging` (feature `log`) | the stderr subscriber and the `LOCKSTEP_LOG` filter every embedding shares |
//! | [`trace`] | the flight recorder: each communicator's last calls, written on failure or `SIGUSR1` (`LOCKSTEP_TRACE_DIR`), and read back by `lockstep trace` |
//! | [`cuda`] | CUDA driver + NVRTC loaded at run time: discovery, the single-init guard, contexts, streams, memory, a source-keyed compile cache, graphs |
//! | `config` (feature `config`) | the configuration file `lockstep config` writes and `lockstep launch` reads |
//! | [`comm`] | the backend-agnostic [`Communicator`], the [`Backend`](comm::Backend) trait, [`CommError`] |
//! | [`reference`](mod@reference) | the canonical reduction as a plain loop ([`reference::reduce`]): the bits the shared-memory backend's reductions produce |
//! | [`shm`] | the shared-memory backend for the ranks of one node |
//! | [`nccl`] | NCCL loaded at run time: a backend on device buffers with an abort watchdog |
//! | [`mpi`] | MPI through the MPI-5 standard ABI, loaded at run time: the transport between nodes of CPU jobs |
//! | [`staged`] | device buffers staged through a host communicator (ranks sharing a GPU) |
//! | [`rendezvous`] | `Communicator::from_env` and [`device_communicator`](rendezvous::device_communicator), the one backend policy |
//! | [`report`] | the environment report (`lockstep env`, and any embedding's bug report) |
//! | [`status`] | `lockstep status`: this user's running jobs and, per rank, the collective it is in and whom it waits for, read from another process |
//! | [`launch`](mod@launch) | [`launch()`] forks ranks running a closure; [`launch::run_job`] backs `lockstep launch` |
//!
//! With `default-features = false` the configuration file is left out too. The library never
//! prints: diagnostics are [`tracing`] events. The training engine is the crate `lockstep-train`
//! (crates/train), the command `lockstep` the crate `crates/cli`, the C ABI (`liblockstep.so`)
//! the crate `crates/capi`, the Python extension `python/`.
//!
//! Safety model: `unsafe` lives only in the modules that talk to the OS or to foreign libraries
//! (`shm`, `launch`'s post-fork code, `trace`'s SIGUSR1 handler, `cuda`, `nccl`, `mpi`); every block carries a `// SAFETY:` line.
//!
//! Fork rules: a process that forks ranks must not have initialised CUDA, and a forked child
//! must not rely on locks another thread of the parent may hold.

// Every `unsafe` block carries a `// SAFETY:` comment in the form clippy recognises.
#![warn(clippy::undocumented_unsafe_blocks)]

// Layers, bottom to top; each module imports only from the ones above it in this list.
pub mod store;
pub mod types;
#[macro_use]
pub mod cuda;
pub mod comm;
#[cfg(feature = "config")]
pub mod config;
mod hier;
pub mod launch;
#[cfg(feature = "log")]
pub mod logging;
pub mod mpi;
pub mod nccl;
pub mod reference;
pub mod rendezvous;
pub mod report;
pub mod shm;
pub mod staged;
pub mod status;
pub mod trace;

pub use comm::{
    Buffer, BufferMut, CollKind, CommError, Communicator, Dtype, Element, ReduceOp, SharedBuffer,
};
pub use half;
pub use launch::{launch, LaunchConfig, RankContext, RankResult};
