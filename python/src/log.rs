//! lockstep's diagnostics in Python's `logging`: the library's `tracing` events become records
//! of the logger named after the event's target (`lockstep::init` -> `lockstep.init`), at the
//! matching level (TRACE is 5). `LOCKSTEP_LOG` filters them as in the binaries (default: every
//! warning and lockstep's INFO lines); `lockstep/__init__.py` gives the `lockstep` logger a
//! stderr handler when `LOCKSTEP_LOG` is set and no handler is configured.
//!
//! Events are queued, never logged from the thread that emits them: most come from code running
//! with the GIL released (a collective, a join), some from lockstep's own threads, and taking the
//! GIL there could deadlock with a thread that holds it while waiting for that code. The queue is
//! delivered, with the GIL, when each call into the extension returns ([`deliver`]), and by
//! `lockstep._native._deliver_logs()`. The queue is bounded, and a contended or full queue drops
//! the event and counts it (reported with the next delivery): emitting never blocks, also in a
//! child forked while another thread held the lock.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

/// Events kept between deliveries; more are dropped (and counted).
const CAPACITY: usize = 4096;
/// The filter without `LOCKSTEP_LOG`: every warning and lockstep's INFO lines (each
/// communicator's init line among them); Python's logger levels decide what is shown.
const DEFAULT_FILTER: &str = "warn,lockstep=info";

struct Record {
    level: u8,
    logger: String,
    message: String,
}

static QUEUE: Mutex<VecDeque<Record>> = Mutex::new(VecDeque::new());
/// Records queued and not yet delivered (read without the lock on every return).
static PENDING: AtomicUsize = AtomicUsize::new(0);
static DROPPED: AtomicUsize = AtomicUsize::new(0);
static INSTALLED: OnceLock<Result<(), String>> = OnceLock::new();

/// Install the forwarding subscriber (once per process). An invalid `LOCKSTEP_LOG` or
/// `LOCKSTEP_LOG_TIME` is a ValueError naming it; another global subscriber already installed
/// (the `lockstep` command run in this process) keeps the events.
pub(crate) fn install() -> PyResult<()> {
    INSTALLED
        .get_or_init(|| {
            let filter = lockstep::logging::filter(DEFAULT_FILTER)?;
            lockstep::logging::with_time()?;
            let sub = tracing_subscriber::registry().with(filter).with(Forward);
            let _ = tracing::subscriber::set_global_default(sub);
            Ok(())
        })
        .clone()
        .map_err(PyValueError::new_err)
}

/// Hand the queued records to Python's `logging` (a no-op when none are queued).
pub(crate) fn deliver(py: Python<'_>) {
    if PENDING.load(Ordering::Acquire) == 0 && DROPPED.load(Ordering::Relaxed) == 0 {
        return;
    }
    let records: Vec<Record> = match QUEUE.try_lock() {
        Ok(mut q) => {
            PENDING.store(0, Ordering::Release);
            q.drain(..).collect()
        }
        Err(_) => return,
    };
    let Ok(logging) = py.import("logging") else {
        return;
    };
    let log = |logger: &str, level: u8, message: &str| {
        if let Ok(l) = logging.call_method1("getLogger", (logger,)) {
            // A failing handler is Python's business (logging reports it itself).
            let _ = l.call_method1("log", (level, message));
        }
    };
    let dropped = DROPPED.swap(0, Ordering::Relaxed);
    if dropped > 0 {
        log(
            "lockstep",
            30,
            &format!("{dropped} diagnostic records were dropped (queue full or busy)"),
        );
    }
    for r in records {
        log(&r.logger, r.level, &r.message);
    }
}

/// `lockstep._native._deliver_logs()`: deliver what lockstep's own threads logged since the last
/// call into the extension.
#[pyfunction]
pub(crate) fn _deliver_logs(py: Python<'_>) {
    deliver(py);
}

struct Forward;

impl<S: Subscriber> Layer<S> for Forward {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let meta = event.metadata();
        let record = Record {
            level: python_level(meta.level()),
            logger: meta.target().replace("::", "."),
            message: lockstep::logging::event_text(event),
        };
        match QUEUE.try_lock() {
            Ok(mut q) if q.len() < CAPACITY => {
                q.push_back(record);
                PENDING.fetch_add(1, Ordering::Release);
            }
            _ => {
                DROPPED.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Python's numeric levels; TRACE below DEBUG.
fn python_level(l: &Level) -> u8 {
    match *l {
        Level::ERROR => 40,
        Level::WARN => 30,
        Level::INFO => 20,
        Level::DEBUG => 10,
        _ => 5,
    }
}
