//! Run-time GPU probe shared by the `gpu_*` tests: the whole binary is one skipped test where
//! there is no GPU, or fails when `LOCKSTEP_REQUIRE_GPU=1`. The binaries include
//! `common/runner.rs` as `runner`, the runner of every test binary.

use std::sync::Arc;

use lockstep::cuda::Context;

/// The binary cannot run here: one skipped test and the summary line, exit 0; under
/// `LOCKSTEP_REQUIRE_GPU=1` a failure.
pub fn skip(why: &str, detail: &str) -> ! {
    crate::runner::skip_all(
        "LOCKSTEP_REQUIRE_GPU",
        env!("CARGO_CRATE_NAME"),
        why,
        detail,
    )
}

/// True when a driver library is present (does not initialise CUDA).
pub fn driver_or_skip() {
    if !lockstep::cuda::driver_present() {
        skip("no CUDA driver", &lockstep::report::env_report());
    }
}

/// Context on device 0, or skip.
pub fn context_or_skip() -> Arc<Context> {
    driver_or_skip();
    match lockstep::cuda::device_count() {
        Ok(n) if n > 0 => {}
        Ok(_) => skip("no CUDA device", "the driver reports 0 devices"),
        Err(e) => skip("no CUDA device", &e.to_string()),
    }
    Context::new(0).unwrap_or_else(|e| panic!("Context::new(0): {e}"))
}

/// Compile the kernels without TF32 unless `LOCKSTEP_NVRTC_OPTIONS` says otherwise (so FP32
/// results are compared at FP32 tolerance), and return whether TF32 is on.
#[allow(dead_code)]
pub fn tf32_unless_disabled() -> bool {
    if std::env::var_os("LOCKSTEP_NVRTC_OPTIONS").is_none() {
        std::env::set_var("LOCKSTEP_NVRTC_OPTIONS", "-DLOCKSTEP_NO_TF32");
    }
    !lockstep::cuda::extra_nvrtc_options()
        .expect("LOCKSTEP_NVRTC_OPTIONS")
        .iter()
        .any(|o| o == "-DLOCKSTEP_NO_TF32" || o == "-DLOCKSTEP_NO_TENSOR_CORES")
}

pub use crate::runner::Runner;

/// End a `gpu_*` binary: the runner's summary, and exit status 1 when a check failed.
pub fn finish(r: Runner) {
    if r.finish() != std::process::ExitCode::SUCCESS {
        std::process::exit(1);
    }
}
