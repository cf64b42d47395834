//! What the user of `train-cnn` sees of the library's `tracing` events: `LOCKSTEP_LOG`
//! (a `RUST_LOG`-style filter) wins, else `-q` (errors only), the default (lockstep's notices and
//! everyone's warnings, but not each communicator's init line), `-v` (debug), `-vv` (trace).
//! `LOCKSTEP_LOG_TIME=1` adds timestamps (`lockstep::logging`).

/// Install the stderr subscriber. An invalid `LOCKSTEP_LOG` or `LOCKSTEP_LOG_TIME` is an error
/// that names it.
pub fn init_logging(verbose: u8, quiet: bool) -> Result<(), String> {
    lockstep::logging::init_stderr(lockstep::logging::verbosity_filter(verbose, quiet))
}
