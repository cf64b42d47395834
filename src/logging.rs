//! What a program embedding lockstep shows of its diagnostics (feature `log`).
//!
//! The library never prints: it emits [`tracing`] events (every communicator's init line at INFO
//! with target `lockstep::init`, warnings such as a stale segment reclaimed or a fallback taken).
//! Each embedding decides where they go, with the same two variables:
//!
//! * `LOCKSTEP_LOG`: a filter in `RUST_LOG` syntax (`info`, `warn,lockstep::shm=debug`); an invalid
//!   one is an error naming it, never silently ignored;
//! * `LOCKSTEP_LOG_TIME`: a flag; `1` prefixes each line written to stderr with the UTC time.
//!
//! The binaries call [`init_stderr`]; the C library installs its own sink (stderr, or the
//! application's callback) with [`filter`]; the Python extension forwards events to Python's
//! `logging` with the same filter.

use tracing_subscriber::EnvFilter;

use crate::types::env;

/// The filter the binaries use when `LOCKSTEP_LOG` is unset: lockstep's notices and everyone's
/// warnings, but not each communicator's init line (one line per rank per communicator is noise
/// unless asked for, as NCCL's with `NCCL_DEBUG=INFO`).
pub const DEFAULT_FILTER: &str = "warn,lockstep=info,lockstep::init=warn";

/// The binaries' filter for their `-q` / `-v` / `-vv` flags (used when `LOCKSTEP_LOG` is unset):
/// errors only, [`DEFAULT_FILTER`], debug, trace.
pub fn verbosity_filter(verbose: u8, quiet: bool) -> &'static str {
    match (quiet, verbose) {
        (true, _) => "error",
        (false, 0) => DEFAULT_FILTER,
        (false, 1) => "info,lockstep=debug",
        (false, _) => "debug,lockstep=trace",
    }
}

/// The filter from `LOCKSTEP_LOG`, or `default` when it is unset. An invalid filter is an error
/// that names the variable and says what it accepts.
pub fn filter(default: &str) -> Result<EnvFilter, String> {
    match env::raw("LOCKSTEP_LOG").map_err(|e| e.to_string())? {
        Some(v) => EnvFilter::try_new(v.trim()).map_err(|e| {
            format!(
                "LOCKSTEP_LOG={v:?} is not a log filter ({e}); use a level (error, warn, info, debug, trace) or directives such as warn,lockstep::shm=debug"
            )
        }),
        None => EnvFilter::try_new(default).map_err(|e| format!("log filter {default:?}: {e}")),
    }
}

/// Whether `LOCKSTEP_LOG_TIME` asks for timestamps (strictly parsed; unset is no).
pub fn with_time() -> Result<bool, String> {
    Ok(env::LOG_TIME
        .flag()
        .map_err(|e| e.to_string())?
        .unwrap_or(false))
}

/// Install the global stderr subscriber of a program that is a lockstep command: `LOCKSTEP_LOG`
/// if set, else `default`; level and message only (and the time with `LOCKSTEP_LOG_TIME=1`).
/// An error when a variable is invalid or another subscriber is already installed.
pub fn init_stderr(default: &str) -> Result<(), String> {
    let filter = filter(default)?;
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false);
    let r = if with_time()? {
        b.try_init()
    } else {
        b.without_time().try_init()
    };
    r.map_err(|e| format!("cannot install the log subscriber: {e}"))
}

/// An event as one line of text: its message, then ` name=value` for every other field (what
/// the C library's and the Python extension's sinks pass on).
pub fn event_text(event: &tracing::Event<'_>) -> String {
    let mut t = Text::default();
    event.record(&mut t);
    t.message + &t.fields
}

#[derive(Default)]
struct Text {
    message: String,
    fields: String,
}

impl tracing::field::Visit for Text {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        use std::fmt::Write as _;
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.fields, " {}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        use std::fmt::Write as _;
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.fields, " {}={value:?}", field.name());
        }
    }
}
