//! [`Tracer`]: one communicator's recorder with what its files say of it, the communicators a
//! SIGUSR1 dumps, and the dump after a failure.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use super::meta::{trace_dir, DumpError, Meta, Reason, TRACE_DIR};
use super::record::{CallInfo, CallPath, Record, Recorder};
use super::signal;
use crate::types::env::TRACE_BUFFER;

/// Calls each communicator keeps when `LOCKSTEP_TRACE_BUFFER` is unset.
pub const DEFAULT_BUFFER: usize = 2000;

/// The communicators a SIGUSR1 dumps (dropped ones are pruned as they are found).
static LIVE: Mutex<Vec<Weak<Tracer>>> = Mutex::new(Vec::new());

/// What else a SIGUSR1 runs, after the records are written ([`on_signal`]).
static ALSO: Mutex<Vec<fn()>> = Mutex::new(Vec::new());

/// Run `f` on the thread `lockstep-trace` after each `SIGUSR1` that writes the records (so only
/// while `LOCKSTEP_TRACE_DIR` is set, once a recording communicator has installed the handler),
/// after they are written: an embedding writes its own view of them there (the Python package:
/// torch's Flight Recorder format). `f` runs on that thread, never in the signal handler; a
/// function registered twice runs once.
pub fn on_signal(f: fn()) {
    let mut also = ALSO.lock().unwrap_or_else(|p| p.into_inner());
    if !also.iter().any(|&g| std::ptr::fn_addr_eq(g, f)) {
        also.push(f);
    }
}

/// SIGUSR1 (on the thread `lockstep-trace`): write every live communicator's records, then run
/// what [`on_signal`] registered.
fn dump_live() {
    let Some(dir) = trace_dir() else { return };
    let live: Vec<Arc<Tracer>> = {
        let mut l = LIVE.lock().unwrap_or_else(|p| p.into_inner());
        l.retain(|w| w.strong_count() > 0);
        l.iter().filter_map(Weak::upgrade).collect()
    };
    for t in live {
        match t.dump(&dir, Reason::Signal) {
            Ok(p) => tracing::info!("flight recorder: SIGUSR1: wrote {}", p.display()),
            Err(e) => tracing::warn!("flight recorder: SIGUSR1: {e}"),
        }
    }
    let also = ALSO.lock().unwrap_or_else(|p| p.into_inner()).clone();
    for f in also {
        f();
    }
}

/// One communicator's recorder and what its files say of it: shared between the communicator
/// (which records) and the SIGUSR1 thread (which reads).
#[derive(Debug)]
pub(crate) struct Tracer {
    rec: Recorder,
    meta: Meta,
    /// Set once the records were written after a failure: later failures of the same
    /// communicator (every call after the first fails) write nothing more.
    failed_dump: AtomicBool,
}

impl Tracer {
    /// The recorder `LOCKSTEP_TRACE_BUFFER` asks for (`None` for 0), registered for SIGUSR1 when
    /// `LOCKSTEP_TRACE_DIR` is set.
    pub(crate) fn from_env(meta: Meta) -> Option<Arc<Tracer>> {
        let n = match TRACE_BUFFER.count() {
            Ok(n) => n.map_or(DEFAULT_BUFFER, |n| n as usize),
            Err(e) => {
                // `env::check_all` (the launchers, `Communicator::from_env`) refuses it first;
                // a communicator made otherwise keeps the default.
                tracing::warn!("{e}; keeping the last {DEFAULT_BUFFER} calls");
                DEFAULT_BUFFER
            }
        };
        if n == 0 {
            return None;
        }
        let t = Arc::new(Tracer {
            rec: Recorder::new(n),
            meta,
            failed_dump: AtomicBool::new(false),
        });
        if trace_dir().is_some() {
            LIVE.lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(Arc::downgrade(&t));
            signal::install_once(dump_live);
        }
        Some(t)
    }

    /// Record the start of a call.
    #[inline]
    pub(crate) fn start(&self, info: &CallInfo) -> u64 {
        self.rec.start(info)
    }

    /// Record the start of a call whose path the backend knows as it starts; returns its id and
    /// whether a success may end by [`end_quick`](Self::end_quick).
    #[inline]
    pub(crate) fn start_on(&self, info: &CallInfo, path: CallPath) -> (u64, bool) {
        self.rec.start_on(info, Some(path))
    }

    /// The successful end of call `id`, as [`start_on`](Self::start_on) allowed.
    #[inline]
    pub(crate) fn end_quick(&self, id: u64) {
        self.rec.end_quick(id)
    }

    /// Count `n` collectives that were made without being recorded (a paused recorder).
    pub(crate) fn skip_collectives(&self, n: u64) {
        self.rec.skip_collectives(n);
    }

    /// Record the end of call `id`.
    #[inline]
    pub(crate) fn end(&self, id: u64, path: CallPath, error: Option<&dyn std::fmt::Display>) {
        self.rec.end(id, path, error)
    }

    /// The records held, oldest first.
    pub(crate) fn records(&self) -> Vec<Record> {
        self.rec.records()
    }

    /// After a failure that ends the job: write the records to `LOCKSTEP_TRACE_DIR` once.
    /// Returns where, or `None` (not set, already written, or the write failed: logged).
    pub(crate) fn on_failure(&self) -> Option<PathBuf> {
        if self.failed_dump.swap(true, Ordering::Relaxed) {
            return None;
        }
        let Some(dir) = trace_dir() else {
            tracing::info!("flight recorder: {}", hint(None));
            return None;
        };
        match self.dump(&dir, Reason::Failure) {
            Ok(p) => {
                tracing::warn!("flight recorder: {}", hint(Some(&p)));
                Some(p)
            }
            Err(e) => {
                tracing::warn!("flight recorder: {e}");
                None
            }
        }
    }

    /// Write the records into `dir` (see [`dump`]); returns the file's path.
    #[cfg(feature = "trace")]
    pub(crate) fn dump(&self, dir: &std::path::Path, reason: Reason) -> Result<PathBuf, DumpError> {
        super::dump::write(&self.meta, &self.rec, dir, reason)
    }

    /// Without the `trace` feature there is no file format.
    #[cfg(not(feature = "trace"))]
    pub(crate) fn dump(&self, dir: &std::path::Path, reason: Reason) -> Result<PathBuf, DumpError> {
        let _ = (dir, reason);
        Err(DumpError::NotBuilt)
    }
}

/// A communicator's flight recorder, read apart from the communicator
/// ([`Communicator::trace_reader`](crate::Communicator::trace_reader)): its records can be read
/// while a call runs on the communicator (from another thread, a signal's dump), since the ring
/// takes no lock.
#[derive(Clone, Debug)]
pub struct TraceReader(pub(crate) Arc<Tracer>);

impl TraceReader {
    /// The records held, oldest first (as [`Communicator::trace`](crate::Communicator::trace)).
    pub fn records(&self) -> Vec<Record> {
        self.0.records()
    }
}

/// The hint a failure's message can end with: where the trace went, or how to get one.
pub(crate) fn hint(written: Option<&std::path::Path>) -> String {
    match written {
        Some(p) => format!(
            "the last calls of this rank are in {}; `lockstep trace {}` compares the ranks'",
            p.display(),
            p.parent().map_or_else(String::new, |d| d.display().to_string())
        ),
        None => format!(
            "set {TRACE_DIR}=DIR to have every rank write its last calls there, then run `lockstep trace DIR`"
        ),
    }
}
