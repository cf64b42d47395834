//! The commit: a crash-consistent save (the protocol in the module documentation: temporaries,
//! the kept previous pair, the optimizer rename, the commit rename of the model file, each made
//! durable in order), the clean-up of killed saves' temporaries, and the check of a save path
//! before any training.
//!
//! The durable-write steps (temporary `O_CREAT|O_EXCL|O_NOFOLLOW` relative to the directory,
//! `fsync`, `rename`, `fsync` of the directory) are `types::durable`'s, the crate's one
//! implementation; this file decides their order across the checkpoint's four names.

use std::ffi::OsStr;
use std::fs::File;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::Mode;
use nix::unistd::UnlinkatFlags;

use super::super::model::Model;
use super::error::CheckpointError;
use super::fault::{fault_from_env, reached, SaveStep};
use super::format::{encode, TrainState};
use super::layout::{Files, Slot, PAIRS};
use super::resume::Probe;
use crate::ops::optim::Adam;
use lockstep::types::durable::{
    random_hex, temp_name, temp_prefix, temp_writer, Dir, Temp, WriteError,
};

/// A checkpoint file is created readable and writable by all, less the umask, as `File::create`
/// makes files.
const MODE: u32 = 0o666;

/// A durable-write error as the checkpoint reports it: the file and the OS error.
fn io(e: WriteError) -> CheckpointError {
    CheckpointError::Io {
        path: e.path,
        source: e.source,
    }
}

/// The error of a call on `name` in the checkpoint's directory.
fn io_at(dir: &Dir, name: &OsStr, e: Errno) -> CheckpointError {
    io(dir.error(name, "", e))
}

/// A save id or a temporary's name could not be drawn.
fn urandom(source: std::io::Error) -> CheckpointError {
    CheckpointError::Io {
        path: "/dev/urandom".into(),
        source,
    }
}

/// Open the checkpoint's directory, each failure said as what to do about `save`.
fn open_dir(files: &Files, save: &Path) -> Result<Dir, CheckpointError> {
    let dir = &files.dir;
    let target = |why: String| CheckpointError::Target {
        path: save.to_path_buf(),
        why,
    };
    match Dir::open(dir) {
        Ok(d) => Ok(d),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(target(format!(
            "directory {} does not exist; create it first",
            dir.display()
        ))),
        Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => {
            Err(target(format!("{} is not a directory", dir.display())))
        }
        Err(e) => Err(target(format!(
            "cannot open directory {}: {e}",
            dir.display()
        ))),
    }
}

/// Bytes one save of a model with `num_params` parameters needs free: the model file holds the
/// parameters once and the optimizer file twice (both Adam moments), 4 bytes each, plus slack for
/// the headers and the BatchNorm buffers.
pub fn estimate_bytes(num_params: usize) -> u64 {
    num_params as u64 * 12 + (1 << 20)
}

/// Whether a process `pid` exists (a permission error means it does, under another user).
pub(super) fn pid_alive(pid: i32) -> bool {
    !matches!(
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None),
        Err(Errno::ESRCH)
    )
}

/// Remove the temporaries that killed saves of this checkpoint left: our naming, a regular file
/// of ours, written by a process that no longer runs (or by this one, whose earlier save is
/// over). A save still running in another process keeps its files. Returns how many went.
fn remove_stale_temps(dir: &Dir, files: &Files) -> usize {
    let prefixes: Vec<Vec<u8>> = files.all().iter().map(|n| temp_prefix(n)).collect();
    let rd = match std::fs::read_dir(&dir.path) {
        Ok(rd) => rd,
        Err(e) => {
            tracing::warn!(
                "checkpoint: cannot list {} to remove stale temporary files: {e}",
                dir.path.display()
            );
            return 0;
        }
    };
    let (me, uid) = (std::process::id() as i32, nix::unistd::geteuid().as_raw());
    let mut removed = 0;
    for entry in rd.flatten() {
        let name = entry.file_name();
        if !prefixes.iter().any(|p| name.as_bytes().starts_with(p)) {
            continue;
        }
        let Some(pid) = temp_writer(&name) else {
            continue;
        };
        if pid != me && pid_alive(pid) {
            tracing::debug!(
                "checkpoint: leaving {}: process {pid} may still be saving",
                dir.path.join(&name).display()
            );
            continue;
        }
        let ours = matches!(dir.lstat(&name), Ok(Some(st)) if st.st_mode & libc::S_IFMT == libc::S_IFREG && st.st_uid == uid);
        if !ours {
            continue;
        }
        match nix::unistd::unlinkat(dir.fd(), name.as_os_str(), UnlinkatFlags::NoRemoveDir) {
            Ok(()) => {
                removed += 1;
                tracing::debug!(
                    "checkpoint: removed {} (left by a killed save)",
                    dir.path.join(&name).display()
                );
            }
            Err(e) => tracing::warn!(
                "checkpoint: could not remove stale {}: {e}",
                dir.path.join(&name).display()
            ),
        }
    }
    removed
}

/// Give the file named `src` the name `dst` too (replacing what `dst` named): a hard link under
/// a temporary name renamed over `dst`, or a synced copy where the file system has no hard links.
fn keep_as(dir: &Dir, src: &OsStr, dst: &OsStr) -> Result<(), CheckpointError> {
    // Already two names of one file (a save killed after this step): nothing to do, and a
    // rename between two links of one file would do nothing, leaving the temporary link behind.
    if let (Some(a), Some(b)) = (dir.lstat(src).map_err(io)?, dir.lstat(dst).map_err(io)?) {
        if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino) {
            return Ok(());
        }
    }
    let name = temp_name(dst).map_err(urandom)?;
    let fd = dir.fd();
    match nix::unistd::linkat(fd, src, fd, name.as_os_str(), AtFlags::empty()) {
        Ok(()) => {
            Temp::adopt(dir, name.clone()).rename_to(dst).map_err(io)?;
            // Should `dst` have become a link of `src` meanwhile, the rename did nothing.
            match nix::unistd::unlinkat(fd, name.as_os_str(), UnlinkatFlags::NoRemoveDir) {
                Ok(()) | Err(Errno::ENOENT) => Ok(()),
                Err(e) => Err(io_at(dir, &name, e)),
            }
        }
        Err(Errno::EPERM | Errno::EOPNOTSUPP | Errno::EMLINK) => {
            tracing::debug!(
                "checkpoint: {} cannot be hard-linked; copying it",
                dir.path.join(src).display()
            );
            let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
            let mut bytes = Vec::new();
            let f = nix::fcntl::openat(fd, src, flags, Mode::empty())
                .map_err(|e| io_at(dir, src, e))?;
            File::from(f)
                .read_to_end(&mut bytes)
                .map_err(|source| CheckpointError::Io {
                    path: dir.path.join(src),
                    source,
                })?;
            let mut t = Temp::create(dir, dst, MODE).map_err(io)?;
            t.write(&bytes).map_err(io)?;
            t.sync().map_err(io)?;
            t.rename_to(dst).map_err(io)
        }
        Err(e) => Err(io_at(dir, src, e)),
    }
}

/// Check, before any training, that a checkpoint can be saved at `path`: its directory exists,
/// none of the checkpoint's names is a directory or a special file, a file can be created and
/// removed there, and the file system has `need_bytes` free (see [`estimate_bytes`]). Also
/// checks the crash tests' fault injection (`LOCKSTEP_FAULT_SAVE`). Each error names the path and
/// what to do.
pub fn check_target(path: &Path, need_bytes: u64) -> Result<(), CheckpointError> {
    fault_from_env()?;
    let files = Files::of(path)?;
    let dir = open_dir(&files, path)?;
    let target = |why: String| CheckpointError::Target {
        path: path.to_path_buf(),
        why,
    };
    for name in files.all() {
        let Some(st) = dir.lstat(name).map_err(io)? else {
            continue;
        };
        let p = files.path(name);
        match st.st_mode & libc::S_IFMT {
            // A symbolic link is replaced by the rename, never written through.
            libc::S_IFREG | libc::S_IFLNK => {}
            libc::S_IFDIR => {
                return Err(target(format!(
                    "{} is a directory; pass a file path such as {}",
                    p.display(),
                    p.join("model.safetensors").display()
                )))
            }
            _ => {
                return Err(target(format!(
                    "{} is not a regular file; remove it or choose another path",
                    p.display()
                )))
            }
        }
    }
    match Temp::create(&dir, &files.model, MODE) {
        Ok(t) => drop(t),
        Err(WriteError { source, .. }) => {
            return Err(target(format!(
                "cannot create a file in {}: {source}; make the directory writable or choose another path",
                dir.path.display()
            )))
        }
    }
    let vfs = nix::sys::statvfs::fstatvfs(dir.fd()).map_err(|e| io_at(&dir, OsStr::new(""), e))?;
    let avail = (vfs.blocks_available() as u64).saturating_mul(vfs.fragment_size() as u64);
    if avail < need_bytes {
        return Err(CheckpointError::NoSpace {
            path: path.to_path_buf(),
            dir: dir.path.clone(),
            need: need_bytes,
            avail,
        });
    }
    Ok(())
}

/// Save the model (PyTorch names) and the optimizer with the training state, crash-consistently
/// (see the module documentation for the protocol; the rename of the model file commits).
pub fn save(
    path: &Path,
    model: &mut Model,
    opt: &Adam,
    state: &TrainState,
) -> Result<(), CheckpointError> {
    let fault = fault_from_env()?;
    let files = Files::of(path)?;
    let dir = open_dir(&files, path)?;
    let stale = remove_stale_temps(&dir, &files);
    if stale > 0 {
        tracing::info!(
            "checkpoint: removed {stale} temporary file(s) left by an interrupted save of {}",
            path.display()
        );
    }
    let save_id = random_hex().map_err(urandom)?;
    let (model_bytes, optim_bytes) = encode(path, model, opt, state, &save_id)?;

    let mut t_optim = Temp::create(&dir, &files.optim, MODE).map_err(io)?;
    t_optim.write(&optim_bytes).map_err(io)?;
    reached(fault, SaveStep::OptimWritten, path);
    let mut t_model = Temp::create(&dir, &files.model, MODE).map_err(io)?;
    t_model.write(&model_bytes).map_err(io)?;
    reached(fault, SaveStep::ModelWritten, path);
    t_optim.sync().map_err(io)?;
    t_model.sync().map_err(io)?;
    reached(fault, SaveStep::Synced, path);

    // The pair a resume would use now moves under the `prev` names (where it is not there
    // already), so it survives the optimizer rename below, and stays as the fallback after it.
    let newest = {
        let mut probe = Probe::new(&files);
        PAIRS.into_iter().find(|&(m, o)| probe.pair(m, o).is_ok())
    };
    if newest.is_none() {
        tracing::debug!(
            "checkpoint: no complete checkpoint at {} yet; nothing to keep as the previous one",
            path.display()
        );
    }
    if let Some((Slot::Live, _)) = newest {
        keep_as(&dir, &files.model, &files.prev_model)?;
    }
    reached(fault, SaveStep::PrevModelKept, path);
    if let Some((_, Slot::Live)) = newest {
        keep_as(&dir, &files.optim, &files.prev_optim)?;
    }
    reached(fault, SaveStep::PrevOptimKept, path);

    t_optim.rename_to(&files.optim).map_err(io)?;
    reached(fault, SaveStep::OptimRenamed, path);
    // The optimizer file (and the kept pair) must be durable before the commit can be.
    dir.sync().map_err(io)?;
    reached(fault, SaveStep::OptimDurable, path);
    t_model.rename_to(&files.model).map_err(io)?;
    reached(fault, SaveStep::Committed, path);
    dir.sync().map_err(io)?;
    reached(fault, SaveStep::Done, path);
    tracing::debug!(
        "checkpoint: saved {} (epoch {}, step {}, save id {save_id})",
        path.display(),
        state.epoch,
        state.step
    );
    Ok(())
}
