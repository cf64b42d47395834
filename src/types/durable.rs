//! Durable, atomic file writes: the workspace's one implementation, used by every file it
//! replaces ([`write_atomic`] for a single small file; the training engine's checkpoint commit,
//! `lockstep_train::checkpoint`, builds its two-file protocol from the same [`Dir`] and
//! [`Temp`]). A reader sees the old contents or the new ones, never a mix, and a crash leaves one
//! of the two.
//!
//! The steps: a fresh temporary in the target's directory (`O_CREAT|O_EXCL|O_NOFOLLOW`, created
//! relative to the directory's descriptor, so neither a symbolic link planted under the temporary
//! name nor a renamed directory can redirect it), the bytes, `fsync`, `rename` over the target,
//! `fsync` of the directory (making the rename durable). The temporary is removed on any error.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{fstatat, FileStat, Mode};
use nix::unistd::UnlinkatFlags;

/// Why [`write_atomic`] failed: the step, the path, and the OS error.
#[derive(Debug, thiserror::Error)]
#[error("cannot write {path}: {what} failed ({source}); check that the directory exists and is writable")]
pub struct WriteError {
    /// The file being written.
    pub path: PathBuf,
    /// The step that failed (`create the temporary`, `fsync`, `rename`, ...).
    pub what: &'static str,
    /// The OS error.
    #[source]
    pub source: std::io::Error,
}

/// Replace `path` with `bytes` atomically (see the module docs); a new file gets `mode` (before
/// the umask). The directory must exist. A symbolic link at `path` is replaced, not followed.
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<(), WriteError> {
    let fail = |what: &'static str, source: std::io::Error| WriteError {
        path: path.to_path_buf(),
        what,
        source,
    };
    // Every step's error names the file being written, not the temporary.
    let at_target = |e: WriteError| fail(e.what, e.source);
    let name = path.file_name().ok_or_else(|| {
        fail(
            "naming the file",
            std::io::Error::other("the path has no file name"),
        )
    })?;
    let dir_path = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let dir = Dir::open(dir_path).map_err(|e| fail("open the directory", e))?;
    let mut t = Temp::create(&dir, name, mode).map_err(at_target)?;
    t.write(bytes).map_err(at_target)?;
    t.sync().map_err(at_target)?;
    t.rename_to(name).map_err(at_target)?;
    dir.sync().map_err(at_target)
}

/// A directory held open: every name is created, renamed and removed relative to this
/// descriptor, so replacing the directory path midway cannot redirect a write.
pub struct Dir {
    /// The path it was opened by (for messages).
    pub path: PathBuf,
    file: File,
}

impl Dir {
    /// Open `path` as a directory (`O_RDONLY|O_DIRECTORY|O_CLOEXEC`).
    pub fn open(path: &Path) -> std::io::Result<Dir> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY)
            .open(path)?;
        Ok(Dir {
            path: path.to_path_buf(),
            file,
        })
    }

    /// The descriptor names are resolved against.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// The error of step `what` on `name` in this directory.
    pub fn error(&self, name: &OsStr, what: &'static str, e: Errno) -> WriteError {
        WriteError {
            path: self.path.join(name),
            what,
            source: std::io::Error::from(e),
        }
    }

    /// fsync the directory, making the renames in it durable.
    pub fn sync(&self) -> Result<(), WriteError> {
        self.file.sync_all().map_err(|source| WriteError {
            path: self.path.clone(),
            what: "fsync of the directory",
            source,
        })
    }

    /// Type and owner of `name`, without following a symbolic link; `None` if absent.
    pub fn lstat(&self, name: &OsStr) -> Result<Option<FileStat>, WriteError> {
        match fstatat(self.file.as_fd(), name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => Ok(Some(st)),
            Err(Errno::ENOENT) => Ok(None),
            Err(e) => Err(self.error(name, "lstat", e)),
        }
    }
}

/// 16 random hex digits from the kernel (temporary names nobody can guess ahead).
pub fn random_hex() -> std::io::Result<String> {
    let mut b = [0u8; 8];
    File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// `.{target}.tmp-` : every temporary made for `target` starts so.
pub fn temp_prefix(target: &OsStr) -> Vec<u8> {
    [b".".as_slice(), target.as_bytes(), b".tmp-"].concat()
}

/// `.{target}.tmp-{pid}-{random}`: hidden; the pid lets a later writer tell a killed writer's
/// leftovers from a write still running; the random part makes the name unpredictable to
/// another user of a shared directory.
pub fn temp_name(target: &OsStr) -> std::io::Result<OsString> {
    let mut n = temp_prefix(target);
    n.extend_from_slice(format!("{}-{}", std::process::id(), random_hex()?).as_bytes());
    Ok(OsString::from_vec(n))
}

/// The writer's pid in a temporary's name (`.{target}.tmp-{pid}-{random}`), or `None` for a name
/// that is not one.
pub fn temp_writer(name: &OsStr) -> Option<i32> {
    let b = name.as_bytes().strip_prefix(b".")?;
    let at = b.windows(5).rposition(|w| w == b".tmp-")?;
    let rest = &b[at + 5..];
    let pid = rest.split(|&c| c == b'-').next()?;
    std::str::from_utf8(pid)
        .ok()?
        .parse::<i32>()
        .ok()
        .filter(|&p| p > 0)
}

/// Remove from `dir` the temporaries that the processes `pids`, all exited, left when they were
/// killed in the middle of a write (our naming, a regular file of this user). Returns how many
/// went; a directory that cannot be read removes nothing.
pub fn remove_temps_of(dir: &Path, pids: &[i32]) -> usize {
    let Ok(d) = Dir::open(dir) else {
        return 0;
    };
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    let uid = nix::unistd::geteuid().as_raw();
    let mut removed = 0;
    for entry in rd.flatten() {
        let name = entry.file_name();
        if !temp_writer(&name).is_some_and(|p| pids.contains(&p)) {
            continue;
        }
        let ours = matches!(d.lstat(&name), Ok(Some(st)) if st.st_mode & libc::S_IFMT == libc::S_IFREG && st.st_uid == uid);
        if ours
            && nix::unistd::unlinkat(d.fd(), name.as_os_str(), UnlinkatFlags::NoRemoveDir).is_ok()
        {
            removed += 1;
        }
    }
    removed
}

/// A temporary file in a [`Dir`], removed on drop unless renamed into place.
pub struct Temp<'d> {
    dir: &'d Dir,
    name: OsString,
    file: Option<File>,
    live: bool,
}

impl<'d> Temp<'d> {
    /// Create a fresh temporary for `target` with `mode` (before the umask): `O_EXCL` refuses
    /// any existing name, symbolic links included, so nothing planted in the directory is ever
    /// opened.
    pub fn create(dir: &'d Dir, target: &OsStr, mode: u32) -> Result<Temp<'d>, WriteError> {
        let flags =
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let mut last = Errno::EEXIST;
        // A clash of 64 random bits means someone is guessing; a few tries settle it.
        for _ in 0..4 {
            let name = temp_name(target).map_err(|source| WriteError {
                path: PathBuf::from("/dev/urandom"),
                what: "read /dev/urandom for the temporary's name",
                source,
            })?;
            match nix::fcntl::openat(
                dir.file.as_fd(),
                name.as_os_str(),
                flags,
                Mode::from_bits_truncate(mode),
            ) {
                Ok(fd) => {
                    return Ok(Temp {
                        dir,
                        name,
                        file: Some(File::from(fd)),
                        live: true,
                    })
                }
                Err(Errno::EEXIST) => last = Errno::EEXIST,
                Err(e) => return Err(dir.error(&name, "create the temporary", e)),
            }
        }
        Err(dir.error(target, "create the temporary", last))
    }

    /// A name a hard link already gave a file: owned from here on (removed on drop).
    pub fn adopt(dir: &'d Dir, name: OsString) -> Temp<'d> {
        Temp {
            dir,
            name,
            file: None,
            live: true,
        }
    }

    /// Where the temporary is.
    pub fn path(&self) -> PathBuf {
        self.dir.path.join(&self.name)
    }

    /// Write all of `bytes` (nothing for an adopted name).
    pub fn write(&mut self, bytes: &[u8]) -> Result<(), WriteError> {
        let path = self.path();
        match &mut self.file {
            Some(f) => f.write_all(bytes).map_err(|source| WriteError {
                path,
                what: "write",
                source,
            }),
            None => Ok(()),
        }
    }

    /// fsync the file's contents (nothing for an adopted name).
    pub fn sync(&mut self) -> Result<(), WriteError> {
        let path = self.path();
        match &mut self.file {
            Some(f) => f.sync_all().map_err(|source| WriteError {
                path,
                what: "fsync",
                source,
            }),
            None => Ok(()),
        }
    }

    /// Rename over `target` (atomically replacing whatever entry is there, a symbolic link
    /// included, without following it). Durable once the directory is synced ([`Dir::sync`]).
    pub fn rename_to(mut self, target: &OsStr) -> Result<(), WriteError> {
        self.file = None;
        let fd = self.dir.file.as_fd();
        nix::fcntl::renameat(fd, self.name.as_os_str(), fd, target)
            .map_err(|e| self.dir.error(target, "rename", e))?;
        self.live = false;
        Ok(())
    }
}

impl Drop for Temp<'_> {
    fn drop(&mut self) {
        if self.live {
            if let Err(e) = nix::unistd::unlinkat(
                self.dir.file.as_fd(),
                self.name.as_os_str(),
                UnlinkatFlags::NoRemoveDir,
            ) {
                tracing::warn!(
                    "could not remove the temporary file {}: {e}",
                    self.path().display()
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("lockstep-file-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn temporaries_of_exited_writers_are_removed_and_nothing_else() {
        let d = scratch("temps");
        let mine = temp_name(OsStr::new("rank00001.jsonl")).unwrap();
        assert_eq!(temp_writer(&mine), Some(std::process::id() as i32));
        assert_eq!(temp_writer(OsStr::new(".a.tmp-b.tmp-42-ff")), Some(42));
        for n in [
            "rank00001.jsonl",
            ".rank00001.jsonl.tmp-x-ff",
            "a.tmp-42-ff",
        ] {
            assert_eq!(temp_writer(OsStr::new(n)), None, "{n}");
        }
        let names = [
            ".rank00001.jsonl.tmp-42-00ff",      // the dead writer's: goes
            ".sub0-ab.rank00001.jsonl.tmp-42-1", // its other file: goes
            ".rank00002.jsonl.tmp-43-00ff",      // another writer's: stays
            "rank00001.jsonl",                   // a finished file: stays
            ".rank00001.jsonl.tmp-42x-00ff",     // not our naming: stays
        ];
        for n in names {
            std::fs::write(d.join(n), b"x").unwrap();
        }
        std::fs::create_dir(d.join(".dir.tmp-42-1")).unwrap(); // not a regular file: stays
        assert_eq!(remove_temps_of(&d, &[42]), 2);
        let mut left: Vec<String> = std::fs::read_dir(&d)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(
            left,
            [
                ".dir.tmp-42-1",
                ".rank00001.jsonl.tmp-42x-00ff",
                ".rank00002.jsonl.tmp-43-00ff",
                "rank00001.jsonl"
            ]
        );
        assert_eq!(remove_temps_of(&d.join("missing"), &[42]), 0);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn writes_replaces_and_leaves_no_temporary() {
        let d = scratch("replace");
        let p = d.join("a.toml");
        write_atomic(&p, b"one\n", 0o600).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"one\n");
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o077,
            0
        );
        write_atomic(&p, b"two\n", 0o600).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two\n");
        let names: Vec<_> = std::fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![OsString::from("a.toml")]);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_link_is_replaced_not_followed_and_a_missing_directory_is_named() {
        let d = scratch("link");
        let victim = d.join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        let p = d.join("cfg");
        std::os::unix::fs::symlink(&victim, &p).unwrap();
        write_atomic(&p, b"new", 0o600).unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
        assert!(!std::fs::symlink_metadata(&p)
            .unwrap()
            .file_type()
            .is_symlink());
        let e = write_atomic(&d.join("no/such/file"), b"x", 0o600).unwrap_err();
        assert!(
            e.to_string().contains("open the directory") && e.to_string().contains("no/such/file"),
            "{e}"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_directory_in_the_way_is_an_error_and_leaves_nothing() {
        let d = scratch("dir");
        std::fs::create_dir_all(d.join("sub")).unwrap();
        assert!(write_atomic(&d.join("sub"), b"x", 0o600).is_err());
        let names: Vec<_> = std::fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![OsString::from("sub")]);
        assert!(write_atomic(Path::new("/"), b"x", 0o600).is_err());
        std::fs::remove_dir_all(&d).unwrap();
    }
}
