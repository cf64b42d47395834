//! # lockstep
//!
//! A collective-communication runtime for data-parallel training, written on raw CUDA/NCCL with a
//! shared-memory backend for CPU-only nodes.
//!
//! | module | what lives there |
//! |---|---|
//! | [`comm`] | the backend-agnostic [`Communicator`](comm::Communicator): all-reduce, broadcast, reduce, all-gather, gather, reduce-scatter, barrier |
//! | [`shm`] | the shared-memory backend for the ranks of one node: segment, synchronisation, reduction kernels |
//! | [`launch`] | the fork-based launcher: ranks, supervision, results |
//!
//! Safety model: `unsafe` lives only in the modules that talk to the OS or to foreign libraries
//! (`shm`, `launch`'s post-fork code, `cuda`, `nccl`); every block carries a `// SAFETY:` line.
//!
//! Fork rules: a process that forks ranks must not have initialised CUDA, and a forked child
//! must not rely on locks another thread of the parent may hold.

pub mod comm;
pub mod launch;
pub mod shm;
pub mod train;

pub use comm::{Buffer, BufferMut, CollKind, CommError, Communicator, Dtype, Element, ReduceOp};
