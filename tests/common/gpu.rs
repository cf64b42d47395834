//! Run-time GPU probe shared by the `gpu_*` tests: prints the skip line, or fails when
//! `LOCKSTEP_REQUIRE_GPU=1`.

use std::sync::Arc;

use lockstep::cuda::Context;

/// Whether the run must not skip.
pub fn require_gpu() -> bool {
    std::env::var("LOCKSTEP_REQUIRE_GPU").as_deref() == Ok("1")
}

/// Print `skipped: <why>` and exit 0, or fail under `LOCKSTEP_REQUIRE_GPU=1`.
pub fn skip(why: &str, detail: &str) -> ! {
    if require_gpu() {
        eprintln!("LOCKSTEP_REQUIRE_GPU=1 but {why}:\n{detail}");
        std::process::exit(1);
    }
    println!("skipped: {why}");
    if !detail.is_empty() {
        eprintln!("{detail}");
    }
    std::process::exit(0);
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

/// A tiny harness: run named checks, print ok/FAILED, exit non-zero on failure. The first
/// command-line argument that is not a flag keeps only the checks whose name contains it (as
/// libtest's filter), e.g. to run one group under compute-sanitizer.
pub struct Runner {
    passed: usize,
    failed: Vec<String>,
    filter: Option<String>,
}

impl Runner {
    pub fn new() -> Runner {
        Runner {
            passed: 0,
            failed: Vec::new(),
            filter: std::env::args().skip(1).find(|a| !a.starts_with('-')),
        }
    }

    pub fn run(&mut self, name: &str, f: impl FnOnce() -> Result<(), String>) {
        if self
            .filter
            .as_ref()
            .is_some_and(|p| !name.contains(p.as_str()))
        {
            return;
        }
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
            Ok(Ok(())) => {
                println!("test {name} ... ok");
                self.passed += 1;
            }
            Ok(Err(e)) => {
                println!("test {name} ... FAILED\n{e}");
                self.failed.push(name.into());
            }
            Err(_) => {
                println!("test {name} ... FAILED (panicked)");
                self.failed.push(name.into());
            }
        }
    }

    pub fn finish(self) {
        println!(
            "\ntest result: {}. {} passed; {} failed",
            if self.failed.is_empty() {
                "ok"
            } else {
                "FAILED"
            },
            self.passed,
            self.failed.len()
        );
        if !self.failed.is_empty() {
            std::process::exit(1);
        }
    }
}
