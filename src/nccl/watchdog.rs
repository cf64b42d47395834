//! The watchdog: every wait on NCCL (init, a nonblocking call settling, a stream, a `Work`
//! handle) polls completion, `ncclCommGetAsyncError` and the caller's liveness check with a
//! deadline; on an error, a timeout or a failed liveness check it calls `ncclCommAbort`, so a
//! dead peer becomes a `CommError` instead of a hang.
//!
//! Separate from the calls themselves because it is the one policy they all share: how long to
//! wait, what to poll, and when to give up and abort.

use std::ffi::c_int;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::comm::{CollKind, CommError, Completion, PeerCheck};
use crate::cuda::Event;

use super::abort::Shared;
use super::comm::{AbortCheck, NcclComm};
use super::error::{invalid_arg, NcclError};
use super::result::{self, IN_PROGRESS, SUCCESS};

/// The completion of a call enqueued on an [`NcclComm`]: an event recorded after it on the
/// communicator's stream, waited on with the same watchdog as [`NcclComm::wait`].
pub(super) struct NcclCompletion {
    event: Event,
    shared: Arc<Shared>,
    timeout: Duration,
    abort_check: Option<AbortCheck>,
    /// The peer watch, and what its error names: this rank's global rank, the call, its number.
    peers: Option<(PeerCheck, usize, CollKind, u64)>,
    what: String,
}

impl NcclCompletion {
    /// One look: `Ok(true)` when done, an error (after aborting) when NCCL reported one or the
    /// liveness check failed.
    fn poll(&self) -> Result<bool, NcclError> {
        if let Some(reason) = self.shared.aborted() {
            return Err(NcclError::Aborted {
                what: self.what.clone(),
                rank: self.shared.rank,
                reason,
            });
        }
        if self.event.query()? {
            return Ok(true);
        }
        if let Some(st) = self.shared.async_error()? {
            if st != SUCCESS && st != IN_PROGRESS {
                let e = result::check(st, Some(self.shared.comm), || {
                    format!("{} (async)", self.what)
                })
                .unwrap_err();
                self.shared.abort(&e.to_string());
                return Err(e);
            }
        }
        if let Some(reason) = self.abort_check.as_ref().and_then(|c| c()) {
            self.shared.abort(&reason);
            return Err(NcclError::Aborted {
                what: self.what.clone(),
                rank: self.shared.rank,
                reason,
            });
        }
        if let Some((check, rank, op, seq)) = &self.peers {
            if let Some(lost) = check() {
                let e = NcclError::PeerLost {
                    rank: *rank,
                    lost,
                    op: *op,
                    seq: *seq,
                };
                self.shared.abort(&e.to_string());
                return Err(e);
            }
        }
        Ok(false)
    }
}

impl Completion for NcclCompletion {
    fn query(&self) -> Result<bool, CommError> {
        self.poll().map_err(CommError::from)
    }

    fn wait(self: Box<Self>) -> Result<(), CommError> {
        let deadline = Instant::now() + self.timeout;
        if wait_until(deadline, || self.poll())? {
            return Ok(());
        }
        self.shared.abort(&format!("{} timed out", self.what));
        Err(NcclError::Timeout {
            what: self.what.clone(),
            rank: self.shared.rank,
            secs: self.timeout.as_secs_f64(),
        }
        .into())
    }
}

pub(super) fn wait_until(
    deadline: Instant,
    mut done: impl FnMut() -> Result<bool, NcclError>,
) -> Result<bool, NcclError> {
    let mut sleep = Duration::from_micros(20);
    loop {
        if done()? {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        std::thread::sleep(sleep);
        sleep = (sleep * 2).min(Duration::from_millis(2));
    }
}

impl NcclComm {
    pub(super) fn async_error(&self) -> Result<c_int, NcclError> {
        match self.shared.async_error()? {
            Some(code) => Ok(code),
            None => Err(self
                .check_alive("ncclCommGetAsyncError")
                .err()
                .unwrap_or_else(|| invalid_arg("the communicator is gone".into()))),
        }
    }

    /// Abort the communicator (idempotent) and remember why.
    pub fn abort(&mut self, reason: &str) {
        self.shared.abort(reason);
    }

    pub(super) fn check_alive(&self, op: &str) -> Result<(), NcclError> {
        if let Some(generation) = self.membership.as_ref().and_then(|m| m.replaced()) {
            return Err(NcclError::Replaced {
                rank: self.global_rank(),
                generation,
            });
        }
        match self.shared.aborted() {
            Some(r) => Err(NcclError::Aborted {
                what: op.into(),
                rank: self.rank,
                reason: format!("the communicator was aborted earlier: {r}"),
            }),
            None => Ok(()),
        }
    }

    /// After a call that may return `ncclInProgress` (non-blocking communicator), wait until
    /// NCCL settles; abort on an async error, a liveness failure or the timeout.
    pub(super) fn settle(&mut self, rc: c_int, what: &str) -> Result<(), NcclError> {
        if rc != IN_PROGRESS {
            return result::check(rc, Some(self.comm), || what.to_string());
        }
        let deadline = Instant::now() + self.opts.timeout;
        let mut last = IN_PROGRESS;
        let mut lost = None;
        let mut looks = 0u32;
        let ok = wait_until(deadline, || {
            last = self.async_error()?;
            if last != IN_PROGRESS {
                return Ok(true);
            }
            self.show_wait(&mut looks);
            // A call in progress may wait on a peer (NCCL connects lazily at its first use).
            lost = self.lost_peer();
            Ok(lost.is_some())
        })?;
        if let Some(e) = lost {
            return Err(self.failed(e));
        }
        if !ok {
            return Err(self.timed_out(what));
        }
        if last != SUCCESS {
            let e = result::check(last, Some(self.comm), || what.to_string()).unwrap_err();
            return Err(self.failed(e));
        }
        Ok(())
    }

    /// Abort the communicator because `e` broke it (its peers' calls then fail too instead of
    /// waiting), and give `e` back for the caller to return.
    fn failed(&mut self, e: NcclError) -> NcclError {
        self.abort(&e.to_string());
        e
    }

    /// Abort the communicator because `what` outlived the timeout, and the error that says so.
    fn timed_out(&mut self, what: &str) -> NcclError {
        self.abort(&format!("{what} timed out"));
        NcclError::Timeout {
            what: what.into(),
            rank: self.rank,
            secs: self.opts.timeout.as_secs_f64(),
        }
    }

    /// Wait for the stream with the watchdog: poll completion, `ncclCommGetAsyncError` and the
    /// liveness check; abort on any failure or on the timeout.
    pub fn wait(&mut self, what: &str) -> Result<(), NcclError> {
        self.check_alive(what)?;
        self.ctx.bind()?;
        let deadline = Instant::now() + self.opts.timeout;
        let mut failure: Option<NcclError> = None;
        let mut looks = 0u32;
        let done = wait_until(deadline, || {
            if self.stream.is_done()? {
                return Ok(true);
            }
            self.show_wait(&mut looks);
            let st = self.async_error()?;
            if st != SUCCESS && st != IN_PROGRESS {
                failure = Some(
                    result::check(st, Some(self.comm), || format!("{what} (async)")).unwrap_err(),
                );
                return Ok(true);
            }
            if let Some(reason) = self.opts.abort_check.as_ref().and_then(|c| c()) {
                failure = Some(NcclError::Aborted {
                    what: what.into(),
                    rank: self.rank,
                    reason,
                });
                return Ok(true);
            }
            failure = self.lost_peer();
            Ok(failure.is_some())
        });
        let done = done.map_err(|e| self.failed(e))?;
        if let Some(e) = failure {
            return Err(self.failed(e));
        }
        if !done {
            return Err(self.timed_out(what));
        }
        Ok(())
    }

    /// The completion handle of the calls enqueued so far: an event recorded on the stream now,
    /// waited on with this watchdog (see [`Backend::completion`](crate::comm::Backend::completion)).
    pub(super) fn watched_completion(&mut self) -> Result<Box<dyn Completion>, CommError> {
        self.check_alive("a nonblocking call")?;
        let event = self.ctx.sync_event().map_err(NcclError::from)?;
        event.record(&self.stream).map_err(NcclError::from)?;
        Ok(Box::new(NcclCompletion {
            event,
            shared: self.shared.clone(),
            timeout: self.opts.timeout,
            abort_check: self.opts.abort_check.clone(),
            peers: self
                .membership
                .as_ref()
                .and_then(|m| m.peers.clone())
                .map(|c| (c, self.global_rank(), self.current, self.seq)),
            what: format!("nonblocking call {} on rank {}", self.seq, self.rank),
        }))
    }

    /// This rank's global rank (its rank here, unless a shrink renumbered it), which errors name.
    pub(super) fn global_rank(&self) -> usize {
        self.membership
            .as_ref()
            .map_or(self.rank, |m| m.global_rank())
    }

    /// After a look that found the call unfinished: on the second, show `lockstep status` that
    /// this rank waits in its last call (waits that end at once read no clock).
    fn show_wait(&self, looks: &mut u32) {
        *looks += 1;
        if *looks == 2 {
            if let Some(m) = &self.membership {
                m.show_wait(self.seq);
            } else if let Some(v) = &self.node_view {
                v.show_carried_wait(self.seq);
            }
        }
    }

    /// One look at the peer watch: the error for a peer whose process has exited.
    fn lost_peer(&self) -> Option<NcclError> {
        let check = self.membership.as_ref()?.peers.as_ref()?;
        check().map(|lost| NcclError::PeerLost {
            rank: self.global_rank(),
            lost,
            op: self.current,
            seq: self.seq,
        })
    }
}
