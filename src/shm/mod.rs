//! The shared-memory backend: collectives for the ranks of one node, through one shared segment.
//!
//! * [`ShmJob`] creates a segment for `world` ranks; forked ranks inherit it and call
//!   [`ShmJob::join`]. Ranks exec'd separately call [`ShmComm::join_named`] with a job id.
//! * Each collective takes one of five paths, decided once per call (`path`): **inline** (the
//!   call's arguments and a small payload in one line per rank, no phase: `inline`),
//!   **one-phase** (a small all-reduce: whole inputs through the slots), **registered** (every
//!   buffer lies in the segment: peers read and write it directly), **CMA** (ordinary buffers,
//!   one copy straight between the ranks' buffers with cross-memory attach: `cma`), or
//!   **slots** (ordinary buffers, chunk by chunk through each rank's two slots, so any size works
//!   with bounded memory and no page faults in steady state; see `sync.rs` for the protocol).
//!   Large slot and registered reductions are split so each rank reduces its own slice
//!   (reduce-scatter then all-gather).
//! * Buffers from [`Communicator::alloc_shared`](crate::comm::Communicator::alloc_shared) live in
//!   the segment, which is what makes a call registered.
//! * The exchanges (all_to_all, all_to_all_v, scatter, all_gather_v, gather_v) go through the
//!   same slots in rounds; point-to-point sends and receives go through a mailbox per ordered
//!   pair of ranks, apart from the collectives (see `p2p`). Large messages of both are copied
//!   once, straight from the peer's memory, where the kernel allows it (`cma`).
//! * Sub-communicators ([`Communicator::split`](crate::comm::Communicator::split)) get a
//!   segment of their own, named after the parent's, so they run beside the parent and each
//!   other without sharing anything; their errors name global ranks (see `split`).
//! * Every reduction sums sources in rank order 0..n, so all ranks get bit-identical results, and
//!   the same inputs give the same bits every run, whatever the path.
//!
//! Files, by concept (as NCCL separates bootstrap, transport and collectives); each depends only
//! on those listed after it, so there is no cycle:
//!
//! * `grow`: the communicator of the world again after lost ranks were replaced
//!   ([`Communicator::grow`](crate::comm::Communicator::grow)): the survivors shrink, create a
//!   segment named after the world's and the number of ranks replaced, and join it with the
//!   replacements ([`ShmComm::join_replacement`]), each with its rank from before.
//! * `shrink`: the communicator of the ranks that remain after a failure
//!   ([`Communicator::shrink`](crate::comm::Communicator::shrink)): agreeing on the members
//!   through the control blocks, then meeting in a new segment through `split`'s join.
//! * `split`: sub-communicators: the parent's ranks exchange colors and keys, the members of a
//!   color create and join a segment through `bootstrap`.
//! * `bootstrap`: job setup: [`ShmJob`], header initialisation, joining ([`ShmJob::join`],
//!   [`ShmComm::join_named`]), removing the segment's name, leaving.
//! * `backend`: [`ShmComm`] and its [`Backend`](crate::comm::Backend) impl, which runs each call
//!   through its collective's body for its path.
//! * `coll`: the collectives, one file per collective, one body per path.
//! * `p2p`: point-to-point sends and receives through the per-pair mailboxes (no phases).
//! * `path`: the five paths, and the first phase in which the ranks agree on one.
//! * `inline`: the inline entries: eligibility, the exchange, reading the peers' payloads.
//! * `channel`: one rank's end of the phase protocol: phases, waiting, the first phase (`begin`),
//!   slots, and the fences after streaming stores.
//! * `liveness`: peers' processes, the abort record every rank reports from, the timeout, and how
//!   errors name ranks.
//! * `check`: the cross-rank argument check and its mismatch text.
//! * `timing`: timing calls for rank 0's tuners (cached or streaming stores; slots or CMA).
//! * `stale`: segments left behind by killed jobs: who created one, whether it still runs, and
//!   removing the names of dead ones ([`reclaim_stale_segments`], [`unlink_named`]).
//! * `status`: a read-only view of a running segment from another process (`pread`, never
//!   mapped or written), for [`status`](crate::status).
//! * `cma`: cross-memory attach (`process_vm_readv`, `process_vm_writev`) between ranks, when the
//!   collectives may use it, and what a communicator learnt about it.
//! * `alloc` (shared buffers), `config` (settings), `tune` (the tuners: choosing between two ways
//!   from measured times), `reduce` (kernels and copies), `sync` (segment layout, control
//!   blocks), `segment` (OS calls, futex, peer processes, segment names and memory reservation).
//!
//! Names: one mechanism, one name. The settings keep their historical names: `fast_bytes`
//! bounds the inline path, `small_bytes` the one-phase path, `cma_bytes` and `single_copy` the CMA
//! path; `stage` chooses cached or streaming (non-temporal) stores into the slots.

mod alloc;
mod backend;
mod bootstrap;
mod channel;
mod check;
mod cma;
mod coll;
mod config;
mod grow;
mod inline;
mod liveness;
mod p2p;
mod path;
mod reduce;
mod segment;
mod shrink;
mod split;
mod stale;
mod status;
mod sync;
mod timing;
mod tune;

pub use backend::ShmComm;
pub use bootstrap::ShmJob;
pub use config::{default_cpu_bind, set_default_cpu_bind, CpuBind, ShmConfig};
pub use reduce::reduce_slices;
pub(crate) use segment::coarse_now_ns;
pub(crate) use stale::named_segment_path;
pub use stale::{reclaim_stale_segments, unlink_named};
#[cfg(test)]
pub(crate) use status::CallView;
pub use status::SegmentError;
pub(crate) use status::{read_segment, RankView, SegmentView};
pub use tune::{SingleCopyMode, StageMode};
