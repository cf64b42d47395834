//! The shared-memory backend: collectives for the ranks of one node, through one shared segment.
//!
//! * [`ShmJob`] creates a segment for `world` ranks; forked ranks inherit it and call
//!   [`ShmJob::join`]. Ranks exec'd separately call [`ShmComm::join_named`] with a job id.
//! * Messages travel through each rank's two staging slots (see `sync.rs` for the protocol), in
//!   chunks, so any size from 0 bytes up works with bounded memory and no page faults in steady
//!   state. Large reductions are split so each rank reduces its own slice (reduce-scatter then
//!   all-gather); small ones take a one-phase path where every rank reduces the whole message.
//! * Buffers from [`Communicator::alloc_shared`](crate::comm::Communicator::alloc_shared) live in
//!   the segment; when every rank passes such buffers, peers read and write them directly.
//! * The exchanges (all_to_all, all_to_all_v, scatter, all_gather_v, gather_v) go through the
//!   same slots in rounds; point-to-point sends and receives go through a mailbox per ordered
//!   pair of ranks, apart from the collectives (see `algo::p2p`). Large messages of both are
//!   copied once, straight from the peer's memory, where the kernel allows it (`direct`).
//! * Sub-communicators ([`Communicator::split`](crate::comm::Communicator::split)) get a
//!   segment of their own, named after the parent's, so they run beside the parent and each
//!   other without sharing anything; their errors name global ranks (see `split`).
//! * Every reduction sums sources in rank order 0..n, so all ranks get bit-identical results, and
//!   the same inputs give the same bits every run, whatever the path.
//!
//! Files, by concept (as NCCL separates bootstrap, transport and collectives); each depends only
//! on those listed after it, so there is no cycle:
//!
//! * `split`: sub-communicators: the parent's ranks exchange colors and keys, the members of a
//!   color create and join a segment through `bootstrap`.
//! * `bootstrap`: job setup: [`ShmJob`], header initialisation, joining ([`ShmJob::join`],
//!   [`ShmComm::join_named`]), removing the segment's name, leaving.
//! * `backend`: [`ShmComm`] and its [`Backend`](crate::comm::Backend) impl, which dispatches to
//!   the algorithms.
//! * `algo`: the collective algorithms, one family per file.
//! * `channel`: one rank's end of the slot protocol: phases, waiting, peer watching, the
//!   cross-rank argument check, the abort record every rank reports from, the staging mode.
//! * `stale`: segments left behind by killed jobs: who created one, whether it still runs, and
//!   removing the names of dead ones ([`reclaim_stale_segments`], [`unlink_named`]).
//! * `direct`: cross-memory attach (`process_vm_readv`, `process_vm_writev`) between ranks.
//! * `alloc` (shared buffers), `config` (settings), `tune` (staging mode choice), `reduce`
//!   (kernels and copies), `sync` (segment layout, control blocks), `segment` (OS calls, futex,
//!   peer processes, segment names and memory reservation).

mod algo;
mod alloc;
mod backend;
mod bootstrap;
mod channel;
mod config;
mod direct;
mod reduce;
mod segment;
mod split;
mod stale;
mod sync;
mod tune;

pub use backend::ShmComm;
pub use bootstrap::ShmJob;
pub use config::{default_cpu_bind, set_default_cpu_bind, CpuBind, ShmConfig};
pub use reduce::reduce_slices;
pub(crate) use stale::named_segment_path;
pub use stale::{reclaim_stale_segments, unlink_named};
pub use tune::{SingleCopyMode, StageMode};
