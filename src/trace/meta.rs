//! What a trace file says of its communicator ([`Meta`]), why it was written, where to, and why
//! it could not be.

use std::path::PathBuf;

/// The environment variable naming the directory trace files are written to.
pub const TRACE_DIR: &str = "LOCKSTEP_TRACE_DIR";

/// `LOCKSTEP_TRACE_DIR`, if set (an empty value counts as unset).
pub fn trace_dir() -> Option<PathBuf> {
    std::env::var_os(TRACE_DIR)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// The file name of global rank `rank`'s world communicator's records (the one a launcher
/// watches for).
pub(crate) fn world_file_name(rank: usize) -> String {
    format!("rank{rank:05}.jsonl")
}

/// The name of a sub-communicator of global ranks `global` in trace files:
/// `sub<n>-<hash of the members>`, where `n` counts the earlier sub-communicators of the same
/// members made in this process, so every member names it alike (members make their
/// sub-communicators in the same order: `split` is collective).
pub(crate) fn sub_name(global: &[usize]) -> String {
    static MADE: std::sync::Mutex<Vec<(u64, u32)>> = std::sync::Mutex::new(Vec::new());
    let h = global.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &r| {
        (h ^ r as u64).wrapping_mul(0x100_0000_01b3)
    });
    let mut made = MADE.lock().unwrap_or_else(|p| p.into_inner());
    let n = match made.iter_mut().find(|(k, _)| *k == h) {
        Some((_, n)) => {
            *n += 1;
            *n
        }
        None => {
            made.push((h, 0));
            0
        }
    };
    format!("sub{n}-{:08x}", h as u32)
}

/// What a trace file's header says of its communicator.
#[derive(Clone, Debug)]
pub(crate) struct Meta {
    pub rank: usize,
    pub world: usize,
    /// Global ranks of a sub-communicator; `None` for a world communicator.
    pub global: Option<Vec<usize>>,
    pub backend: String,
    /// `world`, or `sub<n>-<hash of the members>`: the same on every member.
    pub comm: String,
}

impl Meta {
    /// This rank's global rank.
    pub fn global_rank(&self) -> usize {
        self.global
            .as_ref()
            .and_then(|g| g.get(self.rank).copied())
            .unwrap_or(self.rank)
    }
}

/// Why records were written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reason {
    /// A call failed for the whole job.
    Failure,
    /// SIGUSR1.
    Signal,
    /// The program asked.
    Request,
}

impl Reason {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Reason::Failure => "failure",
            Reason::Signal => "signal",
            Reason::Request => "request",
        }
    }
}

/// Why a trace could not be written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DumpError {
    /// This communicator records nothing.
    #[error("this communicator keeps no trace: LOCKSTEP_TRACE_BUFFER is 0 (unset it, or set a number of calls to keep)")]
    Off,
    /// Writing the file failed.
    #[error(transparent)]
    Write(#[from] crate::types::WriteError),
    /// The library was built without the trace files.
    #[error(
        "lockstep was built without the `trace` feature, which writes trace files: rebuild with it"
    )]
    NotBuilt,
}
