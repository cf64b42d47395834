//! What the `lockstep` command-line tests repeat: the arguments a launch starts with (one node, or
//! one node of two), running a command to its end, and the checks on how it ended (exit code,
//! what it said on stderr, how long it took).
#![allow(dead_code)]

use std::process::{Command, Output};
use std::time::Duration;

use crate::common::{check, show, text};

/// `lockstep launch --nproc-per-node <nproc>`: how every single-node launch here starts.
pub fn launch(nproc: &str) -> [&str; 3] {
    ["launch", "--nproc-per-node", nproc]
}

/// A launch of `nproc` ranks as one node of a two-node job whose rendezvous store listens on
/// `port` (node 0 unless `--node-rank` follows).
pub fn two_nodes<'a>(nproc: &'a str, port: &'a str) -> [&'a str; 7] {
    [
        "launch",
        "--nproc-per-node",
        nproc,
        "--nnodes",
        "2",
        "--master-port",
        port,
    ]
}

/// The program part of a launch: `-- sh -c <script>` (each rank runs the script).
pub fn sh(script: &str) -> [&str; 4] {
    ["--", "sh", "-c", script]
}

/// Runs a command to its end, collecting its output.
pub trait Run {
    /// `output()` with the spawn error as a test failure message.
    fn run(&mut self) -> Result<Output, String>;
}

impl Run for Command {
    fn run(&mut self) -> Result<Output, String> {
        self.output().map_err(|e| e.to_string())
    }
}

/// `o` ended with exit code `code`.
pub fn exits(o: &Output, code: i32, what: &str) -> Result<(), String> {
    check(o.status.code() == Some(code), what, show(o))
}

/// `o` ended with exit code `code` and said `needle` on stderr.
pub fn fails_saying(o: &Output, code: i32, needle: &str, what: &str) -> Result<(), String> {
    check(
        o.status.code() == Some(code) && text(o).1.contains(needle),
        what,
        show(o),
    )
}

/// `o` succeeded and printed each of `needles` on stdout.
pub fn prints(o: &Output, needles: &[&str], what: &str) -> Result<(), String> {
    let out = text(o).0;
    check(
        o.status.success() && needles.iter().all(|n| out.contains(n)),
        what,
        show(o),
    )
}

/// `o` said each of `needles` on stderr, whatever its exit code.
pub fn says(o: &Output, needles: &[&str], what: &str) -> Result<(), String> {
    let err = text(o).1;
    check(needles.iter().all(|n| err.contains(n)), what, show(o))
}

/// Both launchers of a two-node job succeeded.
pub fn both_succeed(oa: &Output, ob: &Output, what: &str) -> Result<(), String> {
    check(
        oa.status.success() && ob.status.success(),
        what,
        format!("{}\n{}", show(oa), show(ob)),
    )
}

/// `took` stayed under `limit_s` seconds.
pub fn within(took: Duration, limit_s: f64, what: &str) -> Result<(), String> {
    check(
        took < Duration::from_secs_f64(limit_s),
        what,
        format!("{took:?}"),
    )
}
