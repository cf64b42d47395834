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

mod arrival;
mod backend;
mod call;
pub mod check;
mod communicator;
mod error;
mod shared;

pub use arrival::Arrival;
pub use backend::{Backend, BackendKind, Completion, LostPeer, P2pOp, PeerCheck, ANY_SOURCE};
pub use call::{Call, Splits};
pub use communicator::{Communicator, Group, Work};
pub(crate) use error::{rank_name, TIMEOUT_HINT};
pub use error::{CommError, NonFiniteKind};
pub use shared::{SharedBuffer, SharedRegion};
// The vocabulary, re-exported so `comm` reads as the whole collective API.
pub use crate::types::{Buffer, BufferMut, CollKind, Dtype, Element, MemSpace, RawMem, ReduceOp};
