//! Finding this user's lockstep segments on this machine, from `/proc`.
//!
//! Every rank keeps its segment's descriptor open for as long as it is a member (to reserve heap
//! ranges later), and so does the parent that forked the ranks of a `launch()`: the segments are
//! the descriptors whose link reads `/memfd:lockstep-shm` (a forked job's memfd) or names a file
//! `lockstep-<job id>` (an exec'd job's named segment, in `/dev/shm` or `LOCKSTEP_SHM_DIR`, whose
//! name is removed once every rank has mapped it, hence ` (deleted)`). Opening
//! `/proc/<pid>/fd/<n>` read-only gives a descriptor of the same file, which `/proc` allows to the
//! process's owner; `/proc/<pid>/map_files`, the other way in, needs `CAP_SYS_ADMIN`.
//!
//! Only processes owned by the caller's effective user are looked at. Processes exit while the
//! scan runs: whatever vanishes is skipped, never an error.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::MetadataExt;

/// One segment: its descriptor (read-only), how the first holder's `/proc` link names it, and
/// the processes holding it.
pub(crate) struct Found {
    pub file: File,
    pub link: String,
    pub holders: Vec<i32>,
}

/// The memfd name forked jobs use (`Segment::anonymous`).
const MEMFD_LINK: &str = "/memfd:lockstep-shm";

/// Whether a descriptor's link names a lockstep segment.
pub(crate) fn is_segment_link(link: &str) -> bool {
    let path = link.strip_suffix(" (deleted)").unwrap_or(link);
    path == MEMFD_LINK
        || (path.starts_with('/')
            && path
                .rsplit('/')
                .next()
                .is_some_and(|f| f.starts_with("lockstep-") && f.len() > "lockstep-".len()))
}

/// The owner (uid) of process `pid`, `None` if it is gone.
pub(crate) fn owner(pid: i32) -> Option<u32> {
    std::fs::metadata(format!("/proc/{pid}"))
        .ok()
        .map(|m| m.uid())
}

/// The effective uid of this process.
pub(crate) fn my_uid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// Every lockstep segment some process of `uid` holds, by file identity (device, inode).
pub(crate) fn scan(uid: u32) -> std::io::Result<Vec<Found>> {
    let mut found: BTreeMap<(u64, u64), Found> = BTreeMap::new();
    for e in std::fs::read_dir("/proc")?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if e.metadata().map(|m| m.uid()).ok() != Some(uid) {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            let Ok(target) = std::fs::read_link(fd.path()) else {
                continue;
            };
            let link = target.to_string_lossy();
            if !is_segment_link(&link) {
                continue;
            }
            let Ok(file) = File::open(fd.path()) else {
                continue;
            };
            let Ok(m) = file.metadata() else {
                continue;
            };
            let f = found.entry((m.dev(), m.ino())).or_insert_with(|| Found {
                file,
                link: link.into_owned(),
                holders: Vec::new(),
            });
            if !f.holders.contains(&pid) {
                f.holders.push(pid);
            }
        }
    }
    Ok(found.into_values().collect())
}

/// The state letter of process `pid` (`R`, `S`, `D`, `T` stopped, `t` traced, `Z`...), from
/// `/proc/<pid>/stat`; `None` when it is gone.
pub(crate) fn proc_state(pid: i32) -> Option<char> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = s.rsplit_once(')')?;
    rest.trim_start().chars().next()
}

/// The values of `keys` in the environment process `pid` started with
/// (`/proc/<pid>/environ`, which `/proc` shows to the process's owner); `None` for each key it
/// does not have, and for all when the process is gone.
pub(crate) fn environ(pid: i32, keys: &[&str]) -> Vec<Option<String>> {
    let raw = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    let mut out = vec![None; keys.len()];
    for entry in raw.split(|&b| b == 0) {
        let Some(eq) = entry.iter().position(|&b| b == b'=') else {
            continue;
        };
        if let Some(k) = keys.iter().position(|k| k.as_bytes() == &entry[..eq]) {
            out[k] = Some(String::from_utf8_lossy(&entry[eq + 1..]).into_owned());
        }
    }
    out
}

/// This machine's host name.
pub(crate) fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "?".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_environment() {
        let me = std::process::id() as i32;
        let v = environ(me, &["PATH", "LOCKSTEP_NO_SUCH_VARIABLE"]);
        assert_eq!(v[0], std::env::var("PATH").ok());
        assert_eq!(v[1], None);
        assert_eq!(environ(-1, &["PATH"]), vec![None]);
    }

    #[test]
    fn segment_links() {
        assert!(is_segment_link("/memfd:lockstep-shm (deleted)"));
        assert!(is_segment_link("/dev/shm/lockstep-abc (deleted)"));
        assert!(is_segment_link("/tmp/x/lockstep-abc.s1c0"));
        assert!(!is_segment_link("/dev/shm/lockstep-"));
        assert!(!is_segment_link("/memfd:other (deleted)"));
        assert!(!is_segment_link("socket:[1234]"));
        assert!(!is_segment_link("/dev/shm/other"));
    }
}
