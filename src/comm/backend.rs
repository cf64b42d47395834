//! The [`Backend`] trait: what a transport implements so that [`Communicator`](super::Communicator)
//! can run on it; the collective it receives is a [`Call`].
//!
//! The trait names no backend type: shared allocations come back as a [`SharedRegion`] trait
//! object and device access as the CUDA [`Context`] (a layer below), so the backends (`shm`,
//! `nccl`, `staged`) depend on this module and never the other way round.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::arrival::Arrival;
use super::call::Call;
use super::error::CommError;
use super::shared::SharedRegion;
use crate::cuda::{Context, ForeignStream};
use crate::trace::CallPath;
use crate::types::{CollKind, Dtype, RawMem};

/// Which backend a communicator runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BackendKind {
    /// The shared-memory backend for the ranks of one node (host buffers).
    Shm,
    /// NCCL (device buffers).
    Nccl,
    /// Device buffers staged through pinned host memory into a host backend (ranks sharing a GPU).
    Staged,
    /// Host buffers across nodes: shared memory inside each node, MPI between nodes.
    Hier,
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendKind::Shm => "shm",
            BackendKind::Nccl => "nccl",
            BackendKind::Staged => "staged",
            BackendKind::Hier => "hier",
        })
    }
}

/// The `peer` of a [`P2pOp`] receive that takes a message from whichever other rank's comes first
/// (MPI's `MPI_ANY_SOURCE`; see [`Communicator::recv_any`](super::Communicator::recv_any)). It
/// lies outside every world, so a backend that checks `peer < world` refuses it by default.
pub const ANY_SOURCE: usize = usize::MAX;

/// One point-to-point operation of a group (see [`Communicator::group`](super::Communicator::group)),
/// type-erased and checked locally. Operations on the same ordered pair of ranks match in the
/// order they are posted.
#[derive(Clone, Copy, Debug)]
pub struct P2pOp {
    /// [`CollKind::Send`] or [`CollKind::Recv`].
    pub kind: CollKind,
    /// The rank sent to or received from; for a receive, [`ANY_SOURCE`] takes the first message
    /// from any other rank, and the backend replaces it with that rank (see [`Backend::p2p`]).
    pub peer: usize,
    /// Element type.
    pub dtype: Dtype,
    /// The buffer read (send) or written (recv).
    pub mem: RawMem,
}

/// A peer whose process has exited, as a [`PeerCheck`] reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LostPeer {
    /// Its rank in the communicator the check was taken from.
    pub rank: usize,
    /// Its global rank (the same as `rank` on a world communicator), which errors name.
    pub global: usize,
    /// Its process id.
    pub pid: i32,
}

/// A look at the peers' processes that any thread may take at any time (see
/// [`Backend::peer_check`]): `Some` once one of them has exited. Cheap: one `poll` of a pidfd
/// per peer.
pub type PeerCheck = Arc<dyn Fn() -> Option<LostPeer> + Send + Sync>;

/// The completion of a call a device backend has enqueued, held by a
/// [`Work`](super::Work) handle.
pub trait Completion: Send {
    /// Whether the call has completed; an error when it failed (the backend is then aborted).
    fn query(&self) -> Result<bool, CommError>;
    /// Wait for the call (with the backend's timeout and liveness checks) and return its result.
    fn wait(self: Box<Self>) -> Result<(), CommError>;
}

/// What a backend implements. Callers never see it: they use [`Communicator`](super::Communicator).
pub trait Backend: Send {
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// Which backend this is.
    fn kind(&self) -> BackendKind;
    /// Run (or enqueue) one collective.
    fn run(&mut self, call: &Call) -> Result<(), CommError>;
    /// [`run`](Self::run), with the flight recorder on: the backend calls
    /// [`Arrival::note`] once this rank has arrived at the call (see [`Arrival`]'s module:
    /// a backend that waits for its peers notes it after publishing its part, before reading
    /// theirs). By default it notes first and runs.
    fn run_noting(&mut self, call: &Call, arrival: &Arrival<'_>) -> Result<(), CommError> {
        arrival.note();
        self.run(call)
    }
    /// The path the last call ([`run`](Self::run) or [`p2p`](Self::p2p)) took, for the flight
    /// recorder ([`crate::trace`]): read once after each call, so it must be cheap (a stored
    /// value). [`CallPath::Unknown`] where a backend does not say.
    fn last_path(&self) -> CallPath {
        CallPath::Unknown
    }
    /// Wait until every call issued so far has completed.
    fn synchronize(&mut self) -> Result<(), CommError>;
    /// Number of collectives this rank has issued.
    fn seq(&self) -> u64;
    /// The longest a call waits for its peers before it fails with [`CommError::Timeout`];
    /// `None` for backends whose calls have no timeout of their own.
    fn timeout(&self) -> Option<Duration> {
        None
    }
    /// Set that timeout for the calls that follow on this rank.
    fn set_timeout(&mut self, timeout: Duration) -> Result<(), CommError> {
        let _ = timeout;
        Err(CommError::Unsupported(format!(
            "the {} backend's timeout cannot be changed once it is made (it comes from LOCKSTEP_TIMEOUT_S)",
            self.kind()
        )))
    }
    /// Whether this rank runs the finite check (`LOCKSTEP_CHECK_FINITE`, see
    /// [`CommError::NonFinite`]). `false` for backends that have none.
    fn check_finite(&self) -> bool {
        false
    }
    /// Turn the finite check on or off for the calls that follow on this rank. Backends whose
    /// reductions run in kernels lockstep does not own refuse to turn it on.
    fn set_check_finite(&mut self, on: bool) -> Result<(), CommError> {
        if !on {
            return Ok(());
        }
        Err(CommError::Unsupported(format!(
            "the {} backend has no finite check (its reductions run outside lockstep's shared-memory kernels); check the inputs before the call, or run host buffers on LOCKSTEP_BACKEND=shm",
            self.kind()
        )))
    }
    /// A call this rank refused locally (bad buffer lengths, root out of range, wrong memory
    /// space): backends that can, make the peers' matching call fail too, so the ranks stay in step.
    fn reject(&mut self, kind: CollKind, dtype: Dtype, reason: &CommError) {
        let _ = (kind, dtype, reason);
    }
    /// The CUDA context whose device memory this backend's collectives take (device backends).
    fn device(&self) -> Option<Arc<Context>> {
        None
    }
    /// Device backends: later calls wait (on the device) for the work enqueued so far on
    /// `caller`.
    fn wait_stream(&mut self, caller: &ForeignStream) -> Result<(), CommError> {
        let _ = caller;
        Err(CommError::Unsupported(format!(
            "the {} backend takes host buffers and has no CUDA stream to order",
            self.kind()
        )))
    }
    /// Device backends: later work on `caller` waits (on the device) for the calls issued so far.
    fn signal_stream(&mut self, caller: &ForeignStream) -> Result<(), CommError> {
        let _ = caller;
        Err(CommError::Unsupported(format!(
            "the {} backend takes host buffers and has no CUDA stream to order",
            self.kind()
        )))
    }
    /// What the communicator's init line says of this backend beyond rank, world and kind
    /// (the shared-memory backend's CPU binding and single-copy threshold, NCCL's version and
    /// device), as `key value` pairs separated by spaces.
    fn describe(&self) -> String {
        String::new()
    }
    /// Run a group of point-to-point operations: all of them complete before it returns (host
    /// backends) or are enqueued together (device backends), so sends and receives posted in one
    /// group never wait on one another in a cycle. A receive posted from [`ANY_SOURCE`] has its
    /// `peer` replaced by the rank whose message it took, once matched (also when another
    /// operation of the group fails); a backend without receives from any source refuses the
    /// group instead.
    fn p2p(&mut self, ops: &mut [P2pOp]) -> Result<(), CommError> {
        let _ = ops;
        Err(CommError::Unsupported(format!(
            "send/recv (point-to-point) is not supported on the {} backend yet; use the shm backend",
            self.kind()
        )))
    }
    /// A handle on the completion of the last call issued, for backends whose calls return once
    /// enqueued (device backends); `None` when every call has completed by the time it returns.
    fn completion(&mut self) -> Result<Option<Box<dyn Completion>>, CommError> {
        Ok(None)
    }
    /// Split the communicator into disjoint sub-communicators, as `ncclCommSplit` and
    /// `MPI_Comm_split` do. Collective: every rank calls it, at the same point of its sequence of
    /// calls. Ranks passing the same `color` form one new communicator, ranked by `(key, rank in
    /// this communicator)`; ranks passing `None` take part but get `Ok(None)`. The new
    /// communicators run independently of this one and of each other (this one stays usable).
    fn split(
        &mut self,
        color: Option<u32>,
        key: i64,
    ) -> Result<Option<Box<dyn Backend>>, CommError> {
        let _ = (color, key);
        Err(CommError::Unsupported(format!(
            "split (sub-communicators) is not supported on the {} backend; use the shm or nccl backend",
            self.kind()
        )))
    }
    /// The communicator of the ranks that call this after a failure (see
    /// [`Communicator::shrink`](super::Communicator::shrink)): the ranks in `exclude`, those
    /// that are gone, and those that do not call it within `wait` are left out.
    fn shrink(&mut self, exclude: &[usize], wait: Duration) -> Result<Box<dyn Backend>, CommError> {
        let _ = (exclude, wait);
        Err(CommError::Unsupported(format!(
            "shrink is not supported on the {} backend: the shm backend and the device communicators of one node (nccl, staged) shrink; restart the job instead",
            self.kind()
        )))
    }
    /// The communicator of the world again, with the same rank numbers, after lost ranks were
    /// replaced (see [`Communicator::grow`](super::Communicator::grow)); `wait` bounds the wait
    /// for the replacements (`None`: the backend's join timeout).
    fn grow(&mut self, wait: Option<Duration>) -> Result<Box<dyn Backend>, CommError> {
        let _ = wait;
        Err(CommError::Unsupported(format!(
            "grow is not supported on the {} backend: the shm backend and the device communicators of one node (nccl, staged) grow; restart the job instead (lockstep launch --restart-policy job)",
            self.kind()
        )))
    }
    /// A watch over the peers' processes, for a layer that carries these ranks' data on another
    /// transport and must notice a death its own waits cannot (NCCL, whose kernels wait on a
    /// dead peer until a timeout). `None` where the backend does not know the processes.
    fn peer_check(&self) -> Option<PeerCheck> {
        None
    }
    /// Show call `seq` of a communicator that another transport carries for these ranks (NCCL
    /// made over a host communicator) where `lockstep status` reads this backend's own calls,
    /// so a status of the job names each rank's collective. A few plain stores; nothing waits.
    /// Default: nothing (a backend that `lockstep status` does not read).
    fn show_carried(&self, call: &Call, seq: u64) {
        let _ = (call, seq);
    }
    /// Show that this rank began waiting in carried call `seq` (see
    /// [`show_carried`](Self::show_carried)): called once per wait that outlasts its first look.
    fn show_carried_wait(&self, seq: u64) {
        let _ = seq;
    }
    /// For a sub-communicator made by [`split`](Self::split): the global rank (the rank in the
    /// world communicator the splits started from) of each of its ranks. `None` for a world
    /// communicator, and for backends that do not track it (the caller then asks the ranks).
    fn global_ranks(&self) -> Option<Vec<usize>> {
        None
    }
    /// Allocate `bytes` of memory that peers can read directly (zero-copy collectives).
    fn alloc_shared(&mut self, bytes: usize) -> Result<Box<dyn SharedRegion>, CommError> {
        let _ = bytes;
        Err(CommError::Unsupported(format!(
            "the {} backend has no shared host buffers",
            self.kind()
        )))
    }
}
