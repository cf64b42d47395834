//! The one runner of the `harness = false` test binaries: tests run one after another in this
//! process (those that fork or time must not share the process with other threads), each printed
//! as `test NAME ... ok`, `... FAILED` or `... skipped: WHY`, then one summary line
//! `N passed, M skipped, F failed` that `scripts/test.sh` adds up over every binary. A test that
//! cannot run here is counted as skipped, never as passed, and fails under the matching
//! `LOCKSTEP_REQUIRE_*=1`. The first command-line argument that is not a flag keeps only the
//! tests whose name contains it, as libtest's filter.
//!
//! Included on its own (`#[path = "common/runner.rs"] mod runner;`) by binaries that do not take
//! the rest of `common`.
#![allow(dead_code)]

use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// Marks a test's `Err` as a skip (see [`skip`]).
const SKIP: &str = "\u{1}skip\u{1}";
/// Parts of passing tests that were skipped ([`skip_part`]).
static PARTS_SKIPPED: AtomicUsize = AtomicUsize::new(0);

/// A test that cannot run here: `return common::skip("LOCKSTEP_REQUIRE_X", "why")`. The runner
/// prints `test NAME ... skipped: why` and counts it as skipped, never as passed; with the
/// `require` variable set to 1 it is a failure instead.
pub fn skip(require: &str, why: &str) -> Result<(), String> {
    if std::env::var(require).as_deref() == Ok("1") {
        return Err(format!("{require}=1, but {why}"));
    }
    Err(format!("{SKIP}{why}"))
}

/// A part of a test (one case among several) that cannot run here: printed as `  skipped: why`
/// and counted in the summary's "parts skipped", while the test's other parts still decide it.
pub fn skip_part(why: &str) {
    PARTS_SKIPPED.fetch_add(1, Ordering::Relaxed);
    println!("  skipped: {why}");
}

/// The whole binary cannot run here (no GPU, no NVRTC): one skipped test named `what` with the
/// summary line, exit 0; with `require` set to 1, one failed test and exit 1. `detail` (the
/// probe's report) goes to stderr.
pub fn skip_all(require: &str, what: &str, why: &str, detail: &str) -> ! {
    let mut r = Runner::new();
    r.filter = None;
    r.run(what, || {
        skip(require, why).map_err(|e| format!("{e}\n{detail}"))
    });
    if !detail.is_empty() && r.failed == 0 {
        eprintln!("{detail}");
    }
    std::process::exit(if r.finish() == ExitCode::SUCCESS {
        0
    } else {
        1
    })
}

/// A named test returning a message on failure.
pub type Test = (&'static str, fn() -> Result<(), String>);

/// Run `tests` one after another and report (see the module docs).
pub fn run(tests: &[Test]) -> ExitCode {
    let mut r = Runner::new();
    for (name, f) in tests {
        r.run(name, f);
    }
    r.finish()
}

/// Tests given one by one, for binaries whose tests are closures (`r.run("name", || ...)`), then
/// [`finish`](Runner::finish).
pub struct Runner {
    filter: Option<String>,
    passed: usize,
    skipped: usize,
    failed: usize,
    failures: Vec<(String, String)>,
}

impl Default for Runner {
    fn default() -> Runner {
        Runner::new()
    }
}

impl Runner {
    /// A runner with the command line's filter.
    pub fn new() -> Runner {
        Runner {
            filter: std::env::args().skip(1).find(|a| !a.starts_with('-')),
            passed: 0,
            skipped: 0,
            failed: 0,
            failures: Vec::new(),
        }
    }

    /// Whether `name` passes the filter (a binary may skip expensive set-up for filtered tests).
    pub fn selected(&self, name: &str) -> bool {
        self.filter
            .as_ref()
            .is_none_or(|p| name.contains(p.as_str()))
    }

    /// Run one test (unless filtered out): `Ok` passes, [`skip`]'s `Err` skips, any other `Err`
    /// or a panic fails.
    pub fn run(&mut self, name: &str, f: impl FnOnce() -> Result<(), String>) {
        if !self.selected(name) {
            return;
        }
        let t = Instant::now();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
            Err(p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panicked".into()))
        });
        match r {
            Ok(()) => {
                self.passed += 1;
                println!("test {name} ... ok ({:.2} s)", t.elapsed().as_secs_f64());
            }
            Err(m) if m.starts_with(SKIP) => {
                self.skipped += 1;
                println!("test {name} ... skipped: {}", &m[SKIP.len()..]);
            }
            Err(m) => {
                self.failed += 1;
                println!(
                    "test {name} ... FAILED ({:.2} s)",
                    t.elapsed().as_secs_f64()
                );
                self.failures.push((name.to_string(), m));
            }
        }
    }

    /// Print the failures and the summary line; the exit status.
    pub fn finish(self) -> ExitCode {
        for (name, m) in &self.failures {
            println!("\n---- {name} ----\n{m}\n{}", "-".repeat(60));
        }
        let parts = PARTS_SKIPPED.load(Ordering::Relaxed);
        let parts = if parts > 0 {
            format!(" ({parts} parts of passing tests skipped)")
        } else {
            String::new()
        };
        println!(
            "\n{} passed, {} skipped, {} failed{parts}",
            self.passed, self.skipped, self.failed
        );
        if self.failed == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }
    }
}
