//! What the launcher prepares before it forks a guard: how the rank is set up ([`RankSetup`]) and
//! the program it execs ([`ExecImage`]), with every string, path and pointer array built here,
//! where allocation is still allowed.
//!
//! Separate from the code after the fork, which may only read these.

use std::ffi::{CStr, CString, OsString};
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;

/// A program prepared for `execve` in the rank: every string built before the fork.
pub(crate) struct ExecImage {
    pub(super) path: CString,
    _argv: Vec<CString>,
    pub(super) argv_ptrs: Vec<*const libc::c_char>,
    _envp: Vec<CString>,
    pub(super) envp_ptrs: Vec<*const libc::c_char>,
}

impl ExecImage {
    /// `program args`, found on `PATH` when it has no `/`, with this process's environment plus
    /// `env` (which overrides).
    pub fn new(program: &[OsString], env: &[(String, String)]) -> std::io::Result<ExecImage> {
        let (first, _) = program
            .split_first()
            .ok_or_else(|| std::io::Error::other("no program given"))?;
        let cstr = |b: &[u8]| {
            CString::new(b)
                .map_err(|_| std::io::Error::other("an argument or variable contains a NUL byte"))
        };
        let path = cstr(resolve(first)?.as_os_str().as_bytes())?;
        let argv: Vec<CString> = program
            .iter()
            .map(|a| cstr(a.as_bytes()))
            .collect::<Result<_, _>>()?;
        let mut envp = Vec::new();
        for (k, v) in std::env::vars_os() {
            if env.iter().all(|(n, _)| n.as_bytes() != k.as_bytes()) {
                let mut kv = k.as_bytes().to_vec();
                kv.push(b'=');
                kv.extend_from_slice(v.as_bytes());
                envp.push(cstr(&kv)?);
            }
        }
        for (k, v) in env {
            envp.push(cstr(format!("{k}={v}").as_bytes())?);
        }
        let ptrs = |v: &[CString]| {
            v.iter()
                .map(|c| c.as_ptr())
                .chain(std::iter::once(std::ptr::null()))
                .collect()
        };
        Ok(ExecImage {
            argv_ptrs: ptrs(&argv),
            envp_ptrs: ptrs(&envp),
            path,
            _argv: argv,
            _envp: envp,
        })
    }
}

/// `program` as a path: itself when it contains a `/`, else the first executable file of that
/// name on `PATH` (what `execvp` would run).
fn resolve(program: &OsString) -> std::io::Result<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    if program.as_bytes().contains(&b'/') {
        return Ok(program.into());
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
    for dir in std::env::split_paths(&path) {
        let p = if dir.as_os_str().is_empty() {
            std::path::PathBuf::from(".")
        } else {
            dir
        }
        .join(program);
        if std::fs::metadata(&p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0) {
            return Ok(p);
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::NotFound,
        format!("{} not found on PATH", program.to_string_lossy()),
    ))
}

/// How to set up the rank process.
pub(crate) struct RankSetup<'a> {
    /// Process group: `Some(0)` leads a new one, `Some(g)` joins `g` (or leads a new one when
    /// `g` is gone), `None` stays in the guard's.
    pub pgid: Option<i32>,
    /// The group to join comes later, through the control pipe ([`Pending::tell_group`](super::parent::Pending::tell_group)): the
    /// guard waits for it before it starts the rank, so that the launcher can fork this guard
    /// while the group's leader (rank 0) is still being started.
    pub pgid_from_launcher: bool,
    /// The rank leads a group that other ranks join after it has started: the guard keeps it
    /// unreaped once it exits (a zombie still holds its process group) until the launcher
    /// releases it ([`Guard::release`](super::parent::Guard::release)), asks for a SIGKILL, or dies. Its exit is still reported
    /// at once. Without this, a rank 0 that ends at once takes the group with it and the ranks
    /// that join later find none.
    pub hold_leader: bool,
    /// stdout and stderr through pipes to the launcher.
    pub capture: bool,
    /// stdin from /dev/null.
    pub stdin_null: bool,
    /// Descriptors of the launcher that neither the guard nor the rank may keep: other ranks'
    /// pipes and log files, the launcher's own ends of this rank's pipes (needed by the library
    /// launcher, whose ranks do not exec and so keep what close-on-exec would close).
    pub close: &'a [RawFd],
    /// The program to exec; `None` runs the body instead.
    pub exec: Option<&'a ExecImage>,
    /// Path of the job's named shared-memory segment, removed when the launcher dies.
    pub unlink_on_launcher_death: Option<&'a CStr>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolve_finds_programs_on_path() {
        assert!(resolve(&"sh".into()).is_ok_and(|p| p.is_absolute() || p.starts_with(".")));
        assert!(resolve(&"no-such-program-lockstep".into()).is_err());
        assert_eq!(
            resolve(&"./x".into()).unwrap(),
            std::path::PathBuf::from("./x")
        );
    }
}
