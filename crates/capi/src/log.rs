//! Diagnostics of the C library: lockstep's `tracing` events go to stderr when `LOCKSTEP_LOG` is
//! set (NCCL_DEBUG's habit), or to the application's callback (`lockstepSetLogCallback`), which
//! then replaces stderr. Nothing is installed otherwise, and nothing is ever printed unasked.
//!
//! One global subscriber is installed, at the first API call that finds `LOCKSTEP_LOG` set, or
//! when a callback is set: its filter is `LOCKSTEP_LOG`, or [`CALLBACK_FILTER`] for a callback
//! without it. An invalid `LOCKSTEP_LOG` or `LOCKSTEP_LOG_TIME` makes every call fail with
//! lockstepInvalidArgument naming the variable. If the process already has a global subscriber
//! (a Rust program using this library), lockstep's events go to that one.

use std::ffi::{c_char, c_int, c_void, CString};
use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::{Mutex, OnceLock, PoisonError};

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

use crate::handle::Failure;

/// The filter of a callback installed while `LOCKSTEP_LOG` is unset: every warning, and
/// lockstep's INFO lines (the init line of each communicator); the callback picks by level.
pub(crate) const CALLBACK_FILTER: &str = "warn,lockstep=info";

/// A log callback: `level` (1 error, 2 warn, 3 info, 4 debug, 5 trace), the event's target (the
/// lockstep module, e.g. `lockstep::init`), the message, and the `user` pointer given to
/// lockstepSetLogCallback. Both strings are valid only during the call. It may be called from
/// any thread that runs lockstep code, concurrently, and must not call back into lockstep.
pub type lockstepLogCallback_t = Option<
    unsafe extern "C" fn(
        level: c_int,
        target: *const c_char,
        message: *const c_char,
        user: *mut c_void,
    ),
>;

/// The callback and its user pointer (as an address: the application owns what it points to).
#[derive(Clone, Copy)]
struct Callback {
    f: unsafe extern "C" fn(c_int, *const c_char, *const c_char, *mut c_void),
    user: usize,
}

static CALLBACK: Mutex<Option<Callback>> = Mutex::new(None);
/// Whether the subscriber is installed, or why it cannot be (an invalid variable).
static INSTALLED: OnceLock<Result<(), String>> = OnceLock::new();
/// The logging variables read once per process: whether they are valid (`Err` says why not).
static CHECKED: OnceLock<Result<(), String>> = OnceLock::new();

/// At every API call: the first one installs the stderr subscriber when `LOCKSTEP_LOG` is set,
/// and every call is refused when a logging variable is invalid. The variables are read once, so
/// a collective pays one load here.
pub(crate) fn ensure() -> Result<(), Failure> {
    CHECKED
        .get_or_init(|| match runtime::types::env::raw("LOCKSTEP_LOG") {
            Err(e) => Err(e.to_string()),
            Ok(None) => runtime::logging::with_time().map(drop),
            Ok(Some(_)) => install(CALLBACK_FILTER).map_err(|f| f.msg),
        })
        .clone()
        .map_err(Failure::invalid_argument)
}

/// Install the subscriber (once; later calls return the first outcome).
fn install(default: &str) -> Result<(), Failure> {
    INSTALLED
        .get_or_init(|| {
            let filter = runtime::logging::filter(default)?;
            let time = runtime::logging::with_time()?;
            let stderr = matches!(runtime::types::env::raw("LOCKSTEP_LOG"), Ok(Some(_)));
            let sub = tracing_subscriber::registry()
                .with(filter)
                .with(Sink { time, stderr });
            // Another global subscriber (a Rust host program) keeps lockstep's events: fine.
            let _ = tracing::subscriber::set_global_default(sub);
            Ok(())
        })
        .clone()
        .map_err(Failure::invalid_argument)
}

/// Set (or with NULL, clear) the callback; installs the subscriber if it is not yet.
pub(crate) fn set_callback(cb: lockstepLogCallback_t, user: *mut c_void) -> Result<(), Failure> {
    *CALLBACK.lock().unwrap_or_else(PoisonError::into_inner) = cb.map(|f| Callback {
        f,
        user: user as usize,
    });
    install(CALLBACK_FILTER)
}

/// Formats an event and hands it to the callback, or (when `LOCKSTEP_LOG` was set at install)
/// writes it to stderr as one line.
struct Sink {
    time: bool,
    stderr: bool,
}

impl<S: Subscriber> Layer<S> for Sink {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let meta = event.metadata();
        let text = runtime::logging::event_text(event);
        let cb = *CALLBACK.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(cb) = cb {
            let target = CString::new(meta.target()).unwrap_or_default();
            let msg = CString::new(text.replace('\0', " ")).unwrap_or_default();
            // SAFETY: the application registered `f` for exactly this signature; both strings
            // live until it returns, and `user` is the application's own pointer, passed back.
            unsafe {
                (cb.f)(
                    level_code(meta.level()),
                    target.as_ptr(),
                    msg.as_ptr(),
                    cb.user as *mut c_void,
                )
            };
            return;
        }
        if !self.stderr {
            return;
        }
        let mut line = String::new();
        if self.time {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            let _ = write!(line, "{}.{:06} ", now.as_secs(), now.subsec_micros());
        }
        let _ = writeln!(
            line,
            "lockstep {} {}: {}",
            meta.level(),
            meta.target(),
            text
        );
        // One write per line, so lines of concurrent ranks do not interleave mid-line.
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }
}

/// 1 error, 2 warn, 3 info, 4 debug, 5 trace.
fn level_code(l: &Level) -> c_int {
    match *l {
        Level::ERROR => 1,
        Level::WARN => 2,
        Level::INFO => 3,
        Level::DEBUG => 4,
        _ => 5,
    }
}
