//! The collective API: one [`Communicator`] for every backend.
//!
//! Callers use typed methods (`all_reduce`, `broadcast`, ...); each builds a type-erased [`Call`]
//! and goes through the one entry, [`Communicator::run`], which checks it locally against the
//! per-kind rules of [`check`] and hands it to the backend. Bindings (Python, C) build the `Call`
//! themselves and call the same entry. Backends (`shm` for host
//! memory, `nccl` and `staged` for device memory) implement the small [`Backend`] trait, which
//! names none of them. Ordering: host backends complete a call before returning; device backends
//! enqueue it on the communicator's stream, and [`Communicator::synchronize`] waits for it. Code
//! written against the `Communicator` runs unchanged on all of them.
//!
//! Which backend a process gets is decided in one place, [`crate::rendezvous`].

mod backend;
pub mod check;
mod communicator;
mod error;
mod shared;

pub use backend::{
    Backend, BackendKind, Call, Completion, LostPeer, P2pOp, PeerCheck, Splits, ANY_SOURCE,
};
pub use communicator::{Communicator, Group, Work};
pub(crate) use error::{rank_name, TIMEOUT_HINT};
pub use error::{CommError, NonFiniteKind};
pub use shared::{SharedBuffer, SharedRegion};
// The vocabulary, re-exported so `comm` reads as the whole collective API.
pub use crate::types::{Buffer, BufferMut, CollKind, Dtype, Element, MemSpace, RawMem, ReduceOp};
