//! The vocabulary every layer shares: element types, reduction operators, collective names and
//! the buffer traits through which a collective sees memory (host, shared segment or device), and
//! strict parsing of `LOCKSTEP_*` environment variables ([`env`](mod@env)), durable, atomic file
//! replacement ([`durable`], [`write_atomic`]), and number lists written as ranges
//! ([`ranges_text`]).
//!
//! This is the bottom layer: it imports nothing from the rest of the crate, so `cuda`, `comm`,
//! the backends and the engine can all speak it without depending on one another.

mod buffer;
mod coll;
mod dtype;
pub mod durable;
pub mod env;
mod ranges;

pub use buffer::{Buffer, BufferMut, MemSpace, RawMem};
pub use coll::CollKind;
pub use dtype::{Dtype, Element, ReduceOp};
pub use durable::{write_atomic, WriteError};
pub use ranges::ranges_text;
