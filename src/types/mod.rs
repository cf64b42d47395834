//! The vocabulary every layer shares: element types, reduction operators, collective names and
//! the buffer traits through which a collective sees memory (host, shared segment or device), and
//! strict parsing of `LOCKSTEP_*` environment variables ([`env`](mod@env)), and atomic file
//! replacement ([`write_atomic`]).
//!
//! This is the bottom layer: it imports nothing from the rest of the crate, so `cuda`, `comm`,
//! the backends and the engine can all speak it without depending on one another.

mod buffer;
mod coll;
mod dtype;
mod durable;
pub mod env;

pub use buffer::{Buffer, BufferMut, MemSpace, RawMem};
pub use coll::CollKind;
pub use dtype::{Dtype, Element, ReduceOp};
// The checkpoint's commit (feature `train`) builds on the same pieces as `write_atomic`.
#[cfg_attr(not(feature = "train"), allow(unused_imports))]
pub(crate) use durable::{random_hex, temp_name, temp_prefix, Dir, Temp};
pub use durable::{write_atomic, WriteError};
