//! The flight recorder: each communicator keeps its last calls (`LOCKSTEP_TRACE_BUFFER`, default
//! 2000; 0 turns it off) in a ring of plain records, and writes them to `LOCKSTEP_TRACE_DIR` when
//! a call fails for the job (timeout, lost peer, abort, mismatch), on `SIGUSR1`, or when asked
//! ([`Communicator::dump_trace`](crate::Communicator::dump_trace)). `lockstep trace DIR` reads the
//! ranks' files back and says where they diverged ([`read`]).
//!
//! What a record holds: its number (`id`, every call; `seq`, collectives only, from 1: the
//! number the communicator's errors give), the operation, dtype, reduction, count, root or peer,
//! whether the buffers were host, device or registered (in the shared segment), the path the
//! backend took ([`CallPath`]), start and end times (of every call of 64 KiB or more and of every
//! 64th smaller collective, the same calls on every rank), and the outcome (ok, the error's text, or
//! still running).
//!
//! The files (feature `trace`, on by default): JSON lines, one file per rank and communicator,
//! each written atomically ([`crate::types::durable`]); the first line is a header (job, rank,
//! world, global ranks, host, pid, backend, version, and the clock: times are Unix nanoseconds
//! (`CLOCK_REALTIME` at the recorder's start plus the monotonic clock since, read through the
//! CPU's time-stamp counter where the kernel keeps time with it: `clock.rs`), so ranks of one
//! host compare directly).
//!
//! `SIGUSR1`: only when `LOCKSTEP_TRACE_DIR` is set does lockstep install a handler, when the
//! first recording communicator is made; it chains any handler installed before it (a host
//! program's own), and only writes a byte to a pipe, which is async-signal-safe. A thread started
//! with the handler (`lockstep-trace`) reads the pipe and writes every live communicator's
//! records from ordinary code: ranks stuck in a call are dumped too; an embedding runs its own
//! dump there after lockstep's ([`on_signal`]). Without the variable,
//! `SIGUSR1` keeps whatever disposition the program gave it.

mod clock;
#[cfg(feature = "trace")]
mod dump;
// Without the files (feature `trace`), what only they read is unused.
#[cfg_attr(not(feature = "trace"), allow(dead_code))]
mod meta;
#[cfg(feature = "trace")]
pub mod read;
// Without the files (feature `trace`), what only they read is unused.
#[cfg_attr(not(feature = "trace"), allow(dead_code))]
mod record;
mod signal;
// Without the files (feature `trace`), what only they read is unused.
#[cfg_attr(not(feature = "trace"), allow(dead_code))]
mod tracer;

pub(crate) use meta::{sub_name, world_file_name, Meta, Reason};
pub use meta::{trace_dir, DumpError, TRACE_DIR};
pub use record::{BufferKind, CallInfo, CallPath, Outcome, Record};
pub(crate) use tracer::Tracer;
pub use tracer::{on_signal, TraceReader, DEFAULT_BUFFER};
