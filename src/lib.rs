//! # lockstep
//!
//! A collective-communication runtime for data-parallel training, written on raw CUDA/NCCL with a
//! shared-memory backend for CPU-only nodes.
//!
//! | module | what lives there |
//! |---|---|
//! | [`comm`] | the backend-agnostic [`Communicator`](comm::Communicator): all-reduce, broadcast, reduce, all-gather, gather, reduce-scatter, barrier |
//! | [`shm`] | the shared-memory backend for the ranks of one node: segment, synchronisation, reduction kernels |
//! | [`launch`] | the launchers: [`launch::launch`] forks ranks running a function; [`launch::run_job`] backs `lockstep launch` (exec'd ranks); output, supervision, failure reports |
//! | [`store`] | the TCP rendezvous store that multi-node jobs meet through |
//! | [`cuda`] | CUDA driver + NVRTC loaded at run time: discovery, the single-init guard, contexts, streams, device memory, kernels, graphs |
//! | [`nccl`] | NCCL loaded at run time: a `Backend` on device buffers with an abort watchdog |
//! | [`train`] | the autograd-free training engine: layers with explicit forward/backward, optimizers, FashionMNIST data, data-parallel trainer |
//! | [`bench`] | `lockstep bench`: nccl-tests-style collective benchmark |
//!
//! Safety model: `unsafe` lives only in the modules that talk to the OS or to foreign libraries
//! (`shm`, `launch`'s post-fork code, `cuda`, `nccl`); every block carries a `// SAFETY:` line.
//!
//! Fork rules: a process that forks ranks must not have initialised CUDA, and a forked child
//! must not rely on locks another thread of the parent may hold.

// Layers, bottom to top; each module imports only from the ones above it in this list.
pub mod store;
pub mod types;
#[macro_use]
pub mod cuda;
pub mod bench;
pub mod comm;
pub mod launch;
pub mod nccl;
pub mod rendezvous;
pub mod report;
pub mod shm;
pub mod staged;
#[cfg(feature = "train")]
pub mod train;

pub use comm::{Buffer, BufferMut, CollKind, CommError, Communicator, Dtype, Element, ReduceOp, SharedBuffer};
pub use half;
