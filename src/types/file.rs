//! Atomic replacement of a small file ([`write_atomic`]): a reader sees the old contents or the
//! new ones, never a mix, and a crash leaves one of the two.
//!
//! The steps: a fresh temporary in the target's directory (`O_CREAT|O_EXCL|O_NOFOLLOW`, created
//! relative to the directory's descriptor, so neither a symbolic link planted under the temporary
//! name nor a renamed directory can redirect it), the bytes, `fsync`, `rename` over the target,
//! `fsync` of the directory (making the rename durable). The temporary is removed on any error.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

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
    let errno = |what: &'static str| move |e: Errno| fail(what, std::io::Error::from(e));
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
    let dir_flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
    let dir = File::from(
        nix::fcntl::open(dir_path, dir_flags, Mode::empty())
            .map_err(errno("open the directory"))?,
    );
    let create =
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    // A name no other writer uses and nobody can plant ahead: pid and random bits, retried on
    // the (vanishing) chance of a collision.
    let (tmp, fd) = {
        let mut attempt = 0u32;
        loop {
            let tmp = temp_name(name)
                .map_err(|e| fail("read /dev/urandom for the temporary's name", e))?;
            match nix::fcntl::openat(
                dir.as_fd(),
                tmp.as_os_str(),
                create,
                Mode::from_bits_truncate(mode),
            ) {
                Ok(fd) => break (tmp, fd),
                Err(Errno::EEXIST) if attempt < 100 => attempt += 1,
                Err(e) => return Err(errno("create the temporary")(e)),
            }
        }
    };
    let remove = |e: WriteError| {
        let _ = nix::unistd::unlinkat(
            dir.as_fd(),
            tmp.as_os_str(),
            nix::unistd::UnlinkatFlags::NoRemoveDir,
        );
        e
    };
    let mut f = File::from(fd);
    f.write_all(bytes).map_err(|e| remove(fail("write", e)))?;
    f.sync_all().map_err(|e| remove(fail("fsync", e)))?;
    drop(f);
    nix::fcntl::renameat(dir.as_fd(), tmp.as_os_str(), dir.as_fd(), name)
        .map_err(|e| remove(errno("rename")(e)))?;
    dir.sync_all()
        .map_err(|e| fail("fsync of the directory", e))
}

/// `.NAME.tmp-PID-RANDOM`: hidden, tied to the writing process, and not guessable ahead by
/// another user of a shared directory.
fn temp_name(target: &OsStr) -> std::io::Result<OsString> {
    let mut b = [0u8; 8];
    File::open("/dev/urandom")?.read_exact(&mut b)?;
    let mut v = b".".to_vec();
    v.extend_from_slice(target.as_bytes());
    v.extend_from_slice(format!(".tmp-{}-", std::process::id()).as_bytes());
    v.extend(b.iter().flat_map(|x| format!("{x:02x}").into_bytes()));
    Ok(OsString::from_vec(v))
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
