//! The diagnostics subscriber of `train-cnn` (the `lockstep` command has the same rules, in
//! `crates/cli/src/logging.rs`).
//!
//! The library never prints; it emits `tracing` events. A binary decides what its user sees:
//! `LOCKSTEP_LOG` (a `RUST_LOG`-style filter such as `debug` or `warn,lockstep::shm=debug`) wins,
//! else `-q` (errors only), default (lockstep's notices and everyone's warnings, but not each
//! communicator's init line), `-v` (debug), `-vv` (trace).

use tracing_subscriber::EnvFilter;

/// Install the stderr subscriber. An invalid `LOCKSTEP_LOG` is an error that names it.
pub fn init_logging(verbose: u8, quiet: bool) -> Result<(), String> {
    let filter = match lockstep::types::env::raw("LOCKSTEP_LOG").map_err(|e| e.to_string())? {
        Some(v) => EnvFilter::try_new(v.trim()).map_err(|e| {
            format!("LOCKSTEP_LOG={v:?} is not a log filter ({e}); use a level (error, warn, info, debug, trace) or directives such as warn,lockstep::shm=debug")
        })?,
        _ => EnvFilter::new(match (quiet, verbose) {
            (true, _) => "error",
            // Each communicator's init line only on request (-v, or LOCKSTEP_LOG=info), as NCCL's
            // with NCCL_DEBUG=INFO: one line per rank per communicator is noise by default.
            (false, 0) => "warn,lockstep=info,lockstep::init=warn",
            (false, 1) => "info,lockstep=debug",
            (false, _) => "debug,lockstep=trace",
        }),
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .without_time()
        .with_target(false)
        .try_init()
        .map_err(|e| format!("cannot install the log subscriber: {e}"))
}
