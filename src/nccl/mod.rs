//! NCCL, loaded at run time (`libnccl.so.2`), behind a safe communicator that implements
//! [`comm::Backend`](crate::comm::Backend) on device buffers.
//!
//! Layers as in `cuda`: cudarc's `nccl::sys` gives the C types, `result` our function tables and
//! one wrapper per call, `comm` the RAII communicator with a watchdog that turns a
//! failed or hung peer into a `CommError` (via `ncclCommAbort`) instead of a hang.
//!
//! | file | holds |
//! |---|---|
//! | `comm.rs` | [`NcclComm`] and [`NcclOptions`]: the native calls, the `Backend` impl, teardown |
//! | `bootstrap.rs` | the unique id and its exchange ([`UniqueIdExchange`]), `ncclCommInitRank` |
//! | `split.rs` | `ncclCommSplit`: a communicator made from a live one |
//! | `membership.rs` | the host communicator of one node kept beside NCCL: the peer watch, the calls shown to `lockstep status`, the members of shrink and grow |
//! | `over_host.rs` | [`NcclComm::over_host`]: NCCL made over that host communicator, and made again over its members to shrink and grow |
//! | `watchdog.rs` | every wait polled with a deadline and a liveness check, abort on failure |
//! | `abort.rs` | the handle's abort state, shared with pending `Work` handles across threads |
//! | `checks.rs` | the argument checks made before anything is enqueued |
//! | `composite.rs` | gather, scatter, all-to-all and the v-variants as grouped send/recv |
//! | `result.rs`, `error.rs` | the function tables, one wrapper per call; [`NcclError`] |
//!
//! One process per GPU: NCCL before 2.30 refuses two ranks of one communicator on the same device.
//! NCCL ≥ 2.30 accepts them when the user sets `NCCL_MULTI_RANK_GPU_ENABLE=1`. When ranks
//! outnumber GPUs otherwise, [`StagedBackend`](crate::staged::StagedBackend) stages device buffers
//! through pinned host memory into the shared-memory backend. Which of these a job gets is
//! decided in one place: [`rendezvous::device_communicator`](crate::rendezvous::device_communicator).

mod abort;
mod bootstrap;
mod checks;
mod comm;
mod composite;
mod error;
mod membership;
mod over_host;
pub(crate) mod result;
mod split;
mod watchdog;

pub use bootstrap::{unique_id, StoreExchange, UniqueIdExchange};
pub use comm::{AbortCheck, NcclComm, NcclOptions};
pub use error::NcclError;

/// NCCL's version code (e.g. 21803), loading the library if needed. Does not touch CUDA.
pub fn version() -> Result<i32, NcclError> {
    Ok(result::core()?.version)
}

/// True when an NCCL library can be loaded.
pub fn present() -> bool {
    result::core().is_ok()
}

/// Load NCCL and resolve every function the communicator needs (no CUDA involved): an error names
/// the missing library or symbol.
pub fn check_library() -> Result<(), NcclError> {
    result::api()?;
    Ok(())
}
