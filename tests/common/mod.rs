//! Helpers shared by the launcher tests: a sequential runner for `harness = false` targets (prints
//! `test name ... ok` and a final `N passed, M skipped, F failed`), skips that are counted as such
//! ([`skip`], [`skip_part`]), framed failure messages, and /proc look-ups for checking that no
//! process is left behind.
#![allow(dead_code)]

mod bins;
#[allow(unused_imports)]
pub use bins::lockstep_bin;

use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

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

/// A named test returning a message on failure.
pub type Test = (&'static str, fn() -> Result<(), String>);

/// Run `tests` one after another (optionally only those whose name contains the first CLI
/// argument) and report like the default harness.
pub fn run(tests: &[Test]) -> ExitCode {
    let filter: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let (mut passed, mut skipped, mut failed) = (0, 0, 0);
    let mut failures = Vec::new();
    for (name, f) in tests {
        if filter.as_ref().is_some_and(|p| !name.contains(p.as_str())) {
            continue;
        }
        let t = Instant::now();
        let r = std::panic::catch_unwind(f).unwrap_or_else(|p| {
            Err(p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panicked".into()))
        });
        match r {
            Ok(()) => {
                passed += 1;
                println!("test {name} ... ok ({:.2} s)", t.elapsed().as_secs_f64());
            }
            Err(m) if m.starts_with(SKIP) => {
                skipped += 1;
                println!("test {name} ... skipped: {}", &m[SKIP.len()..]);
            }
            Err(m) => {
                failed += 1;
                println!(
                    "test {name} ... FAILED ({:.2} s)",
                    t.elapsed().as_secs_f64()
                );
                failures.push((name, m));
            }
        }
    }
    for (name, m) in &failures {
        println!("\n---- {name} ----\n{m}\n{}", "-".repeat(60));
    }
    let parts = PARTS_SKIPPED.load(Ordering::Relaxed);
    let parts = if parts > 0 {
        format!(" ({parts} parts of passing tests skipped)")
    } else {
        String::new()
    };
    println!("\n{passed} passed, {skipped} skipped, {failed} failed{parts}");
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// `Err` with a framed expected/actual message unless `cond`.
pub fn check(cond: bool, what: &str, detail: impl std::fmt::Display) -> Result<(), String> {
    if cond {
        Ok(())
    } else {
        Err(format!(
            "{what}\n{}\n{detail}\n{}",
            "=".repeat(60),
            "=".repeat(60)
        ))
    }
}

/// Whether `pid` exists and is not a zombie.
pub fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => s
            .rsplit_once(')')
            .map(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X']))
            .unwrap_or(false),
        Err(_) => false,
    }
}

/// Direct children of `pid`, from /proc.
pub fn children_of(pid: i32) -> Vec<i32> {
    let mut v = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return v;
    };
    for e in rd.flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if let Ok(s) = std::fs::read_to_string(format!("/proc/{p}/stat")) {
            if let Some((_, rest)) = s.rsplit_once(')') {
                let f: Vec<&str> = rest.split_whitespace().collect();
                if f.get(1).and_then(|x| x.parse::<i32>().ok()) == Some(pid) {
                    v.push(p);
                }
            }
        }
    }
    v.sort_unstable();
    v
}

/// Children of the children of `pid` (the launchers' ranks, one level below their guards).
pub fn grandchildren_of(pid: i32) -> Vec<i32> {
    let mut v: Vec<i32> = children_of(pid).into_iter().flat_map(children_of).collect();
    v.sort_unstable();
    v
}

/// Live (not zombie) processes whose environment holds `LOCKSTEP_TEST_MARK=<mark>`: what a test
/// started, however deep and wherever re-parented.
pub fn marked(mark: &str) -> Vec<i32> {
    let needle = format!("LOCKSTEP_TEST_MARK={mark}");
    let mut v = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return v;
    };
    for e in rd.flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(env) = std::fs::read(format!("/proc/{p}/environ")) else {
            continue;
        };
        if env.split(|b| *b == 0).any(|kv| kv == needle.as_bytes()) && alive(p) {
            v.push(p);
        }
    }
    v.sort_unstable();
    v
}

/// A mark unique to this test process and `name`.
pub fn new_mark(name: &str) -> String {
    format!("{}-{name}", std::process::id())
}

/// Poll `f` every 10 ms until it returns true or `timeout` passes.
pub fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < timeout {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    f()
}

/// Send `sig` to `pid`.
pub fn signal(pid: i32, sig: i32) {
    // SAFETY: plain syscall.
    unsafe { libc::kill(pid, sig) };
}

/// A fresh scratch directory under the temporary directory, removed with its contents when the
/// process that made it drops it (a forked child that drops a copy leaves it alone).
pub fn scratch(name: &str) -> Scratch {
    let path = std::env::temp_dir().join(format!("lockstep-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&path);
    std::fs::create_dir_all(&path).expect("scratch dir");
    Scratch {
        path,
        owner: std::process::id(),
    }
}

/// See [`scratch`]; derefs to its path.
pub struct Scratch {
    path: std::path::PathBuf,
    owner: u32,
}

impl std::ops::Deref for Scratch {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.path
    }
}

impl AsRef<std::path::Path> for Scratch {
    fn as_ref(&self) -> &std::path::Path {
        &self.path
    }
}

impl AsRef<std::ffi::OsStr> for Scratch {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.path.as_os_str()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if std::process::id() == self.owner {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// A TCP port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}
