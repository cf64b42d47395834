//! Leftover named segments. A job killed before all its ranks joined leaves its segment's name
//! behind: the last rank to join is the one that removes it. The header records who created the
//! segment (pid, pid namespace, start time), so the next launch, or the next rank 0 with the same
//! job id, tells at once whether that process is gone and removes the name, instead of waiting
//! until the file is old enough to be surely abandoned.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::{Acquire, Relaxed};
use std::time::Duration;

use super::config::{ShmConfig, SHM_DIR_VAR};
use super::segment::{pid_namespace, proc_start, SegName, Segment, SHM_DIR};
use super::sync::{Header, HEADER_BYTES, MAGIC, VERSION};

/// What a named segment's header says about the process that created it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Creator {
    /// Still running.
    Alive(i32),
    /// Exited (its pid is free, a zombie, or now another process's: the start time differs).
    Dead(i32),
    /// Cannot tell: no readable header of this version (another lockstep version, a creator
    /// killed before it finished the header, not a lockstep file), or a creator in another pid
    /// namespace, whose pid means nothing here.
    Unknown,
}

/// Who created the named segment `name`, and whether it still runs.
pub(crate) fn creator_of(name: &SegName) -> Creator {
    let Ok(Some(seg)) = Segment::peek_named(name, HEADER_BYTES) else {
        return Creator::Unknown;
    };
    // SAFETY: the read-only mapping is HEADER_BYTES long and page-aligned; the header's fields
    // are atomics and only loaded here.
    creator_in(unsafe { &*(seg.base() as *const Header) })
}

/// Who created the segment with header `h`, and whether it still runs.
pub(crate) fn creator_in(h: &Header) -> Creator {
    if h.magic.load(Acquire) != MAGIC || h.version.load(Relaxed) != VERSION {
        return Creator::Unknown;
    }
    let (pid, ns, start) = (
        h.creator_pid.load(Relaxed),
        h.creator_pidns.load(Relaxed),
        h.creator_start.load(Relaxed),
    );
    if pid <= 0 || ns == 0 || ns != pid_namespace() {
        return Creator::Unknown;
    }
    match proc_start(pid) {
        Some((s, exited)) if s == start && !exited => Creator::Alive(pid),
        _ => Creator::Dead(pid),
    }
}

/// This process as a segment creator: (pid, pid namespace, start time), for the header.
pub(crate) fn creator_identity() -> (i32, u64, u64) {
    let pid = std::process::id() as i32;
    (
        pid,
        pid_namespace(),
        proc_start(pid).map(|s| s.0).unwrap_or(0),
    )
}

/// The named-segment directory the environment chooses (`None`: `/dev/shm`); an invalid
/// `LOCKSTEP_SHM_DIR` counts as unset here, since no segment can have been made in it.
fn env_dir() -> Option<PathBuf> {
    let cfg = ShmConfig {
        shm_dir: std::env::var_os(SHM_DIR_VAR).map(PathBuf::from),
        ..ShmConfig::default()
    };
    cfg.checked_shm_dir().ok().flatten().map(Path::to_path_buf)
}

/// Remove a job's named segment (in `LOCKSTEP_SHM_DIR` when set, else `/dev/shm`); a name that
/// does not exist is not an error.
pub fn unlink_named(job_id: &str) {
    if let Ok(name) = SegName::new(env_dir().as_deref(), job_id) {
        name.unlink();
    }
}

/// Where a job's named segment lives (in `LOCKSTEP_SHM_DIR` when set, else `/dev/shm`): the path
/// the launcher's guards remove if the launcher dies (see `launch::guard`). `None` for a job id
/// that cannot name a segment.
pub(crate) fn named_segment_path(job_id: &str) -> Option<PathBuf> {
    SegName::new(env_dir().as_deref(), job_id)
        .ok()
        .map(|n| n.path())
}

/// Remove the named segments (`lockstep-*` in `/dev/shm`, and in `LOCKSTEP_SHM_DIR` when set)
/// whose creator is gone, at once: the header records the creator's pid, pid namespace and start
/// time, so a reused pid is not mistaken for it. For those whose creator cannot be checked (no
/// header of this version, or a creator in another pid namespace), `unknown_is_stale(job id, age
/// of the file)` decides. Returns the paths removed; each is logged with `tracing::info!`.
pub fn reclaim_stale_segments(
    unknown_is_stale: &dyn Fn(&str, Option<Duration>) -> bool,
) -> Vec<PathBuf> {
    let mut dirs: Vec<Option<PathBuf>> = vec![None];
    if let Some(d) = env_dir().filter(|d| d != Path::new(SHM_DIR)) {
        dirs.push(Some(d));
    }
    let mut removed = Vec::new();
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir.as_deref().unwrap_or(Path::new(SHM_DIR))) else {
            continue;
        };
        for e in entries.flatten() {
            let file = e.file_name().to_string_lossy().into_owned();
            let Some(id) = file.strip_prefix("lockstep-") else {
                continue;
            };
            let Ok(name) = SegName::new(dir.as_deref(), id) else {
                continue;
            };
            // Only plain files: never follow a link someone else planted.
            let Ok(meta) = std::fs::symlink_metadata(name.path()) else {
                continue;
            };
            if !meta.is_file() {
                continue;
            }
            let why = match creator_of(&name) {
                Creator::Alive(_) => continue,
                Creator::Dead(pid) => format!("its creator (pid {pid}) is gone"),
                Creator::Unknown => {
                    let age = meta.modified().ok().and_then(|m| m.elapsed().ok());
                    if !unknown_is_stale(id, age) {
                        continue;
                    }
                    "its job is gone".to_string()
                }
            };
            if name.unlink() {
                tracing::info!(
                    "removed the shared-memory segment {name} left behind by a killed job: {why}"
                );
                removed.push(name.path());
            }
        }
    }
    removed
}
