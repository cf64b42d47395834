//! The safe owners: [`Mpi`] (MPI initialised for the process, finalised when the last handle
//! goes if lockstep initialised it), [`MpiComm`] (a private communicator that returns errors
//! instead of aborting) and [`Request`] (a message that owns its buffer).
//!
//! Invariants:
//! - MPI is initialised at most once per process and never again after `MPI_Finalize`: one
//!   shared [`Mpi`] state, handed out by [`Mpi::init`] while any handle lives.
//! - Every communicator and request holds the state, so `MPI_Finalize` runs after all of them
//!   are freed.
//! - lockstep's communicators are duplicates of `MPI_COMM_WORLD` (the program's own traffic on
//!   it never matches lockstep's) with `MPI_ERRORS_RETURN` set, so a failed peer is an error
//!   value here, not an abort of the job.
//! - A message's buffer is owned by its [`Request`]: when a wait times out, or a request is
//!   dropped unfinished, the request is cancelled, and if MPI does not let go of it the buffer
//!   is leaked rather than freed under MPI's feet.

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::types::{Element, ReduceOp};

use super::discovery::{loaded, LibraryInfo};
use super::error::MpiError;
use super::result;
use super::sys::{
    thread_level_name, MPI_Comm, MPI_Request, MPI_Status, MPI_COMM_NULL, MPI_COMM_WORLD,
    MPI_ERRORS_RETURN, MPI_REQUEST_NULL, MPI_THREAD_MULTIPLE,
};

/// Polls of a wait that spin before it starts yielding the core.
const SPIN_POLLS: u32 = 1000;
/// How long a wait polls without sleeping: long enough for a large message to cross while
/// polled, short enough that a late peer soon gets the core back.
const YIELD_FOR: Duration = Duration::from_millis(100);
/// The largest tag lockstep uses: `MPI_TAG_UB` is at least this in every MPI.
const MAX_TAG: u16 = 32767;

/// Default time a wait may take before it is a [`MpiError::Timeout`] (`LOCKSTEP_TIMEOUT_S`
/// overrides it, as for the other backends).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The process's MPI state.
struct State {
    /// Whether lockstep called `MPI_Init_thread` (then it also calls `MPI_Finalize`).
    initialised_here: bool,
    /// The thread level in force.
    thread_level: c_int,
    /// Set once a peer failed or a wait timed out: `MPI_Finalize` may then wait forever for the
    /// lost peer, so the process ends without it (MPI's launcher reports the exit).
    abandoned: AtomicBool,
}

impl Drop for State {
    fn drop(&mut self) {
        if !self.initialised_here {
            return;
        }
        if self.abandoned.load(Ordering::Relaxed) {
            tracing::debug!(
                "MPI_Finalize skipped: a peer failed, and finalising could wait for it"
            );
            return;
        }
        match result::finalized() {
            Ok(false) => {
                if let Err(e) = result::finalize() {
                    tracing::warn!("MPI_Finalize failed: {e}");
                }
            }
            Ok(true) => {}
            Err(e) => tracing::warn!("MPI_Finalized failed: {e}"),
        }
    }
}

/// The live state, if any handle holds it.
static STATE: Mutex<Weak<State>> = Mutex::new(Weak::new());

/// MPI initialised for this process.
///
/// [`Mpi::init`] initialises MPI with `MPI_THREAD_MULTIPLE` (or joins an MPI the program
/// initialised itself, which must provide that level); the last handle, communicator or
/// request to go finalises MPI if lockstep initialised it. MPI cannot be initialised again after
/// that, so a job keeps one handle for its whole life.
#[derive(Clone)]
pub struct Mpi {
    state: Arc<State>,
    library: &'static LibraryInfo,
}

impl std::fmt::Debug for Mpi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mpi")
            .field("initialised_here", &self.state.initialised_here)
            .field("thread_level", &thread_level_name(self.state.thread_level))
            .finish()
    }
}

impl Mpi {
    /// Load the MPI library and initialise MPI (or join the program's own initialisation).
    ///
    /// Errors: the library cannot be found or is not the MPI-5 standard ABI; MPI was finalised
    /// already; the thread level in force is below `MPI_THREAD_MULTIPLE`; `MPI_Init_thread` failed
    /// (MPI's initial error handler may abort the process instead, as the standard allows).
    pub fn init() -> Result<Mpi, MpiError> {
        let library = &loaded()?.info;
        let mut slot = STATE.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(state) = slot.upgrade() {
            return Ok(Mpi { state, library });
        }
        if result::finalized()? {
            return Err(MpiError::Finalized);
        }
        let (initialised_here, level) = if result::initialized()? {
            (false, result::query_thread()?)
        } else {
            (true, result::init_thread(MPI_THREAD_MULTIPLE)?)
        };
        // Built before the level check, so that a refused level still finalises what lockstep
        // initialised.
        let state = Arc::new(State {
            initialised_here,
            thread_level: level,
            abandoned: AtomicBool::new(false),
        });
        if level < MPI_THREAD_MULTIPLE {
            return Err(MpiError::ThreadLevel {
                provided: thread_level_name(level),
            });
        }
        *slot = Arc::downgrade(&state);
        tracing::debug!(
            "MPI initialised ({}; by lockstep: {initialised_here})",
            thread_level_name(level)
        );
        Ok(Mpi { state, library })
    }

    /// The library in use.
    pub fn library(&self) -> &'static LibraryInfo {
        self.library
    }

    /// Whether lockstep initialised MPI (and will finalise it).
    pub fn initialised_here(&self) -> bool {
        self.state.initialised_here
    }

    /// A private duplicate of `MPI_COMM_WORLD` with `MPI_ERRORS_RETURN` (collective over the
    /// world).
    pub fn world(&self) -> Result<MpiComm, MpiError> {
        let timeout = crate::types::env::TIMEOUT_S
            .secs()?
            .unwrap_or(DEFAULT_TIMEOUT);
        let comm = result::comm_dup(MPI_COMM_WORLD)?;
        MpiComm::adopt(self.state.clone(), comm, timeout)
    }
}

/// A communicator lockstep owns: errors are returned (`MPI_ERRORS_RETURN`), waits time out,
/// and it is freed on drop.
pub struct MpiComm {
    state: Arc<State>,
    comm: MPI_Comm,
    rank: usize,
    size: usize,
    timeout: Duration,
}

// SAFETY: MPI runs at MPI_THREAD_MULTIPLE (checked in `Mpi::init`), so any thread may call MPI
// on this communicator, concurrently too; the handle is a plain value valid in the whole process.
unsafe impl Send for MpiComm {}
// SAFETY: as above; every method takes `&self` and MPI serialises what needs it.
unsafe impl Sync for MpiComm {}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiComm")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

impl MpiComm {
    /// Own `comm`: set `MPI_ERRORS_RETURN` and read rank and size (freeing it on failure).
    fn adopt(state: Arc<State>, comm: MPI_Comm, timeout: Duration) -> Result<MpiComm, MpiError> {
        let mut c = MpiComm {
            state,
            comm,
            rank: 0,
            size: 0,
            timeout,
        };
        result::comm_set_errhandler(comm, MPI_ERRORS_RETURN)?;
        c.rank = result::comm_rank(comm)?;
        c.size = result::comm_size(comm)?;
        Ok(c)
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// How long a wait may take before it is an error.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Change the wait timeout.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// The ranks that share memory with this one (`MPI_Comm_split_type` with
    /// `MPI_COMM_TYPE_SHARED`), ordered as here (collective). MPICH's
    /// `MPIR_CVAR_NUM_CLIQUES=N` makes one host look like N such groups.
    pub fn split_shared(&self) -> Result<MpiComm, MpiError> {
        let key = i32::try_from(self.rank).unwrap_or(i32::MAX);
        let c = result::comm_split_shared(self.comm, key)?;
        MpiComm::adopt(self.state.clone(), c, self.timeout)
    }

    /// `MPI_Comm_split` (collective): ranks with the same `color` form a communicator, ordered
    /// by `key` then rank; `None` joins none and gets `None`.
    pub fn split(&self, color: Option<u32>, key: i32) -> Result<Option<MpiComm>, MpiError> {
        let c = result::comm_split(self.comm, color, key)?;
        if c == MPI_COMM_NULL {
            return Ok(None);
        }
        MpiComm::adopt(self.state.clone(), c, self.timeout).map(Some)
    }

    fn peer(&self, peer: usize) -> Result<c_int, MpiError> {
        if peer >= self.size {
            return Err(MpiError::InvalidArgument(format!(
                "rank {peer} is out of range for a communicator of {} ranks",
                self.size
            )));
        }
        Ok(peer as c_int)
    }

    /// A tag MPI accepts everywhere: at most 32767, the least `MPI_TAG_UB` the standard allows.
    fn tag(tag: u16) -> Result<c_int, MpiError> {
        if tag > MAX_TAG {
            return Err(MpiError::InvalidArgument(format!(
                "tag {tag} is above {MAX_TAG}, the largest tag every MPI accepts"
            )));
        }
        Ok(c_int::from(tag))
    }

    /// Start sending `data` to `peer` with `tag` (at most 32767); the request owns the buffer
    /// until it completes.
    pub fn isend(&self, peer: usize, tag: u16, data: Vec<u8>) -> Result<Request, MpiError> {
        let dest = self.peer(peer)?;
        let tag = Self::tag(tag)?;
        // SAFETY: the buffer moves into the returned request, which keeps it (or leaks it) until
        // MPI is done with it; a Vec's heap block does not move when the Vec does.
        let req = unsafe { result::isend_bytes(data.as_ptr(), data.len(), dest, tag, self.comm) }?;
        Ok(Request::new(
            self.state.clone(),
            req,
            data,
            peer,
            Kind::Send,
        ))
    }

    /// Start receiving up to `len` bytes from `peer` with `tag` (at most 32767).
    pub fn irecv(&self, peer: usize, tag: u16, len: usize) -> Result<Request, MpiError> {
        self.irecv_into(peer, tag, len, Vec::new())
    }

    /// [`irecv`](Self::irecv) into `data`, whose allocation is reused when large enough (a
    /// fresh one costs a page fault per page as MPI writes it). Bytes `data` already holds are
    /// not zeroed first: MPI overwrites them, and a completed receive keeps only the bytes that
    /// arrived.
    pub fn irecv_into(
        &self,
        peer: usize,
        tag: u16,
        len: usize,
        mut data: Vec<u8>,
    ) -> Result<Request, MpiError> {
        let source = self.peer(peer)?;
        let tag = Self::tag(tag)?;
        if data.len() >= len {
            data.truncate(len);
        } else {
            data.resize(len, 0);
        }
        // SAFETY: as in `isend`; nothing else touches the buffer while the request holds it.
        let req = unsafe { result::irecv_bytes(data.as_mut_ptr(), len, source, tag, self.comm) }?;
        Ok(Request::new(
            self.state.clone(),
            req,
            data,
            peer,
            Kind::Recv,
        ))
    }

    /// Wait for every request (polling `MPI_Test`), up to the timeout. On a timeout or an
    /// error the unfinished requests stay unfinished: dropping them cancels them.
    pub fn wait_all(&self, what: &str, reqs: &mut [Request]) -> Result<(), MpiError> {
        match self.poll(what, reqs, &mut [], self.timeout) {
            Waited::Done | Waited::Watched(_) => Ok(()),
            Waited::Failed { error, .. } => Err(error),
            Waited::TimedOut { secs } => Err(MpiError::Timeout {
                what: what.to_string(),
                rank: self.rank,
                secs,
            }),
        }
    }

    /// Wait for every request of `reqs` (polling `MPI_Test`) until they are all done, one of
    /// `watch` completes first (a message that ends the wait early: a peer's failure notice), a
    /// request fails, or `timeout` passes. Unfinished requests stay unfinished (dropping them
    /// cancels them); a completed watched request is left done for the caller to read.
    pub fn poll(
        &self,
        what: &str,
        reqs: &mut [Request],
        watch: &mut [Request],
        timeout: Duration,
    ) -> Waited {
        let start = Instant::now();
        let mut polls: u32 = 0;
        loop {
            let mut pending = 0;
            for (index, r) in reqs.iter_mut().enumerate().filter(|(_, r)| !r.done) {
                match r.test(what) {
                    Ok(true) => {}
                    Ok(false) => pending += 1,
                    Err(error) => return Waited::Failed { index, error },
                }
            }
            if pending == 0 {
                return Waited::Done;
            }
            // The watched requests are rarely done: test them every 64th round only.
            if polls.is_multiple_of(64) {
                for (i, r) in watch.iter_mut().enumerate().filter(|(_, r)| !r.done) {
                    if matches!(r.test(what), Ok(true)) {
                        return Waited::Watched(i);
                    }
                }
            }
            if start.elapsed() >= timeout {
                return Waited::TimedOut {
                    secs: start.elapsed().as_secs_f64(),
                };
            }
            polls = polls.wrapping_add(1);
            // MPI moves a message only inside MPI_Test (a large one chunk by chunk), so a wait
            // keeps polling: spinning at first, then yielding the core between polls (a rank
            // sharing it, the peer perhaps, runs), and only after YIELD_FOR sleeping between
            // polls (a peer that is late for long, still computing, gets the core).
            if polls <= SPIN_POLLS {
                std::hint::spin_loop();
            } else if start.elapsed() < YIELD_FOR {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// Mark MPI as not to be finalised by this process: a peer failed (or stopped answering),
    /// and `MPI_Finalize` could wait for it forever. Without `MPI_Finalize` the process still
    /// exits, and MPI's launcher reports it.
    pub fn abandon(&self) {
        self.state.abandoned.store(true, Ordering::Relaxed);
    }

    /// Wait until every rank arrives (`MPI_Ibarrier`, with the timeout).
    pub fn barrier(&self) -> Result<(), MpiError> {
        let req = result::ibarrier(self.comm)?;
        self.wait_collective("barrier", req, Vec::new()).map(drop)
    }

    /// Wait for collective `req`, whose buffer is `buf` (the request keeps it, or leaks it on a
    /// timeout), and give the buffer back.
    fn wait_collective(
        &self,
        what: &str,
        req: MPI_Request,
        buf: Vec<u8>,
    ) -> Result<Vec<u8>, MpiError> {
        let mut reqs = [Request::new(
            self.state.clone(),
            req,
            buf,
            0,
            Kind::Collective,
        )];
        self.wait_all(what, &mut reqs)?;
        let [r] = reqs;
        Ok(r.into_data())
    }

    /// Every rank's `mine` (all the same length), concatenated in rank order.
    pub fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<u8>, MpiError> {
        let n = mine.len();
        let total = n.checked_mul(self.size).ok_or_else(|| {
            MpiError::InvalidArgument(format!("{n} bytes × {} ranks overflows", self.size))
        })?;
        // Both buffers live in one owned allocation: the request keeps (or leaks) it.
        let mut buf = vec![0u8; n + total];
        buf[..n].copy_from_slice(mine);
        let (send, recv) = buf.split_at_mut(n);
        // SAFETY: both halves belong to `buf`, which moves into the request below and outlives
        // MPI's use of it; they do not overlap.
        let req =
            unsafe { result::iallgather_bytes(send.as_ptr(), n, recv.as_mut_ptr(), self.comm) }?;
        let mut out = self.wait_collective("all-gather", req, buf)?;
        out.drain(..n);
        Ok(out)
    }

    /// MPI's own all-reduce of `data` in place (`MPI_Iallreduce_c`, with the timeout): the
    /// baseline the hierarchical all-reduce is measured against. Its summation order is MPI's.
    /// 16-bit floats and `Avg` are refused (the ABI has no predefined type or operator for them).
    pub fn all_reduce<T: Element>(&self, data: &mut [T], op: ReduceOp) -> Result<(), MpiError> {
        let dtype = result::datatype(T::DTYPE).ok_or_else(|| {
            MpiError::InvalidArgument(format!("MPI has no predefined type for {:?}", T::DTYPE))
        })?;
        let mop = result::op(op).ok_or_else(|| {
            MpiError::InvalidArgument(format!("MPI has no predefined operator for {op:?}"))
        })?;
        let bytes = std::mem::size_of_val(data);
        // Staged through an owned buffer, so a timed-out reduction can be leaked safely.
        let mut buf = vec![0u8; bytes];
        // SAFETY: `T` is a plain numeric type (`Element` is sealed to them); `buf` has `bytes`.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr().cast::<u8>(), buf.as_mut_ptr(), bytes)
        };
        // SAFETY: `buf` holds `data.len()` elements of `dtype` and moves into the request.
        let req = unsafe {
            result::iallreduce_in_place(buf.as_mut_ptr().cast(), data.len(), dtype, mop, self.comm)
        }?;
        let out = self.wait_collective("all-reduce", req, buf)?;
        // SAFETY: `out` is `buf`, `bytes` long; `data` is `bytes` long and does not overlap it;
        // a byte copy into numeric elements.
        unsafe {
            std::ptr::copy_nonoverlapping(out.as_ptr(), data.as_mut_ptr().cast::<u8>(), bytes)
        };
        Ok(())
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        if self.comm != MPI_COMM_NULL {
            if let Err(e) = result::comm_free(&mut self.comm) {
                tracing::warn!("freeing an MPI communicator failed: {e}");
            }
        }
    }
}

/// How [`MpiComm::poll`] ended.
#[derive(Debug)]
pub enum Waited {
    /// Every request completed.
    Done,
    /// The watched request at this index completed first.
    Watched(usize),
    /// The request at this index failed.
    Failed {
        /// Its index in the requests waited for.
        index: usize,
        /// MPI's error.
        error: MpiError,
    },
    /// The timeout passed first.
    TimedOut {
        /// Seconds waited.
        secs: f64,
    },
}

/// What a request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Send,
    Recv,
    Collective,
}

/// A pending message or collective that owns its buffer.
pub struct Request {
    /// Keeps MPI initialised while the request lives.
    _state: Arc<State>,
    req: MPI_Request,
    buf: Vec<u8>,
    peer: usize,
    kind: Kind,
    done: bool,
}

// SAFETY: MPI runs at MPI_THREAD_MULTIPLE, so the request may be completed from any thread; the
// buffer is owned.
unsafe impl Send for Request {}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request")
            .field("kind", &self.kind)
            .field("peer", &self.peer)
            .field("bytes", &self.buf.len())
            .field("done", &self.done)
            .finish()
    }
}

impl Request {
    fn new(state: Arc<State>, req: MPI_Request, buf: Vec<u8>, peer: usize, kind: Kind) -> Request {
        Request {
            _state: state,
            req,
            buf,
            peer,
            kind,
            done: req == MPI_REQUEST_NULL,
        }
    }

    /// Record completion: a receive keeps only the bytes that arrived.
    fn finish(&mut self, st: &MPI_Status) {
        self.done = true;
        if self.kind == Kind::Recv {
            if let Ok(n) = result::get_count_bytes(st) {
                self.buf.truncate(n);
            }
        }
    }

    /// Test once (`MPI_Test`): whether it completed; an error when it failed (it is then done).
    fn test(&mut self, what: &str) -> Result<bool, MpiError> {
        if self.done {
            return Ok(true);
        }
        let mut st = MPI_Status::default();
        let (kind, peer) = (self.kind, self.peer);
        let res = result::test(&mut self.req, &mut st, || {
            format!("{what}: {kind:?} with rank {peer}")
        });
        // A request that completed, also in error, became MPI_REQUEST_NULL.
        if self.req == MPI_REQUEST_NULL {
            self.finish(&st);
        }
        res
    }

    /// The rank sent to or received from (0 for a collective).
    pub fn peer(&self) -> usize {
        self.peer
    }

    /// Whether the request completed.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// The buffer: for a completed receive, the bytes received; empty while MPI still holds it.
    pub fn into_data(mut self) -> Vec<u8> {
        if !self.done {
            return Vec::new();
        }
        std::mem::take(&mut self.buf)
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        if self.done || self.req == MPI_REQUEST_NULL {
            return;
        }
        // Cancel, then give MPI a moment to let go of the buffer.
        let _ = result::cancel(&mut self.req);
        let deadline = Instant::now() + Duration::from_millis(100);
        while Instant::now() < deadline {
            let mut st = MPI_Status::default();
            let res = result::test(&mut self.req, &mut st, String::new);
            // Completed (cancelled, or finished after all, or failed): MPI let go of the buffer.
            if self.req == MPI_REQUEST_NULL {
                return;
            }
            if res.is_err() {
                break;
            }
            std::thread::yield_now();
        }
        // MPI still holds the buffer: free the request (it completes on its own) and leak the
        // buffer, which MPI may still write.
        let _ = result::request_free(&mut self.req);
        tracing::warn!(
            "an unfinished MPI {:?} with rank {} was abandoned; its {} bytes are leaked",
            self.kind,
            self.peer,
            self.buf.len()
        );
        std::mem::forget(std::mem::take(&mut self.buf));
    }
}
