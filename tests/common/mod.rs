//! Helpers shared by the tests: the runner of every `harness = false` target (`runner.rs`),
//! framed failure messages, and /proc look-ups for checking that no process is left behind.
#![allow(dead_code)]

mod bins;
pub mod capi;
pub mod forked;
mod runner;
#[allow(unused_imports)]
pub use bins::lockstep_bin;
#[allow(unused_imports)]
pub use runner::{run, skip, skip_all, skip_part, Runner, Test};

use std::time::{Duration, Instant};

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

/// `Err` unless `took` is under `limit`; `what` says what had to be that quick.
pub fn within(took: Duration, limit: Duration, what: &str) -> Result<(), String> {
    check(took < limit, what, format!("{took:?}"))
}

/// A finished process's stdout and stderr, lossily decoded.
pub fn text(o: &std::process::Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// A finished process's status, stdout and stderr, framed for a failure message.
pub fn show(o: &std::process::Output) -> String {
    let (a, b) = text(o);
    format!(
        "status: {:?}\n--- stdout ---\n{a}\n--- stderr ---\n{b}",
        o.status
    )
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

/// The pids in /proc, sorted, that `keep` accepts.
fn pids_where(keep: impl Fn(i32) -> bool) -> Vec<i32> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut v: Vec<i32> = rd
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<i32>().ok())
        .filter(|&p| keep(p))
        .collect();
    v.sort_unstable();
    v
}

/// Direct children of `pid`, from /proc.
pub fn children_of(pid: i32) -> Vec<i32> {
    pids_where(|p| {
        std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|s| {
            s.rsplit_once(')').is_some_and(|(_, rest)| {
                rest.split_whitespace()
                    .nth(1)
                    .and_then(|x| x.parse::<i32>().ok())
                    == Some(pid)
            })
        })
    })
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
    pids_where(|p| {
        std::fs::read(format!("/proc/{p}/environ"))
            .is_ok_and(|env| env.split(|b| *b == 0).any(|kv| kv == needle.as_bytes()))
            && alive(p)
    })
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
