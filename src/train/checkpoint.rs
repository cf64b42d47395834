//! Checkpoints in safetensors with PyTorch `state_dict` names, crash-consistent.
//!
//! A checkpoint saved at `PATH` (e.g. `model.safetensors`) is two files, so the model file loads
//! in PyTorch with `load_state_dict(strict=True)` untouched:
//! - `PATH`: parameters and BatchNorm buffers under their PyTorch names (`module1.0.weight`,
//!   `module1.1.running_var`, `module1.1.num_batches_tracked` as a 0-d i64, ...), metadata
//!   `format = pt`, `step` and `save_id`;
//! - `PATH` with extension `optim.safetensors` (e.g. `model.optim.safetensors`): Adam moments
//!   (`exp_avg.NAME`, `exp_avg_sq.NAME`) and, in the metadata, the step, the number of completed
//!   epochs, the seed and the same `save_id`. The data order of an epoch is a pure function of
//!   `seed + epoch`, so seed and epoch are the complete random-generator position. An fp16 run
//!   also stores its loss scaler there (`loss_scale`, `loss_scale_growth_tracker`,
//!   `loss_scale_skipped` and the scaler's settings, [`ScalerState`]); a file without those keys
//!   (fp32 and bf16 runs, and files written before they existed) loads with
//!   [`TrainState::loss_scaler`] `None`.
//!
//! Beside them, `model.prev.safetensors` and `model.prev.optim.safetensors` hold the previous
//! complete pair. Every save draws a fresh random `save_id` and writes it into both of its files:
//! a model file and an optimizer file belong together exactly when their ids agree, so a torn
//! pair can never be mistaken for a state.
//!
//! A save (rank 0, [`save`]) goes:
//! 1. remove temporaries that killed saves of this checkpoint left behind (their process is gone);
//! 2. write both files to fresh temporaries (`O_CREAT|O_EXCL|O_NOFOLLOW`, random names, created
//!    relative to the directory's descriptor) and fsync them;
//! 3. make the `prev` names point at the pair a resume would use now (hard links, renamed into
//!    place), so that pair survives the next two steps;
//! 4. rename the optimizer temporary over `model.optim.safetensors` and fsync the directory;
//! 5. rename the model temporary over `PATH`: **the commit point**, one atomic rename; then fsync
//!    the directory.
//!
//! At every instant at least one complete pair is on disk under the four names, and a kill
//! before step 5 leaves the previous save as the newest complete one. A resume ([`resume`])
//! tries the pairs newest first and says which it used. Every failure path removes the
//! temporaries it created; a killed process cannot, which step 1 of the next save covers.
//!
//! For tests, `LOCKSTEP_FAULT_SAVE=<step>` ([`FAULT_ENV`], [`SaveStep`]) kills the saving
//! process (SIGKILL) right after the named step.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{fstatat, Mode};
use nix::unistd::UnlinkatFlags;
use safetensors::{Dtype, SafeTensors, View};

use super::model::{Model, StateMut};
use super::optim::Adam;
pub use super::precision::ScalerState;

/// Environment variable that kills the saving process after a named step of a save (tests).
pub const FAULT_ENV: &str = "LOCKSTEP_FAULT_SAVE";

/// Errors saving or loading a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// File system error.
    #[error("checkpoint {}: {source}; check the directory exists and is writable", .path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// Not a valid safetensors file.
    #[error("checkpoint {} is not a valid safetensors file: {msg}", .path.display())]
    Format {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        msg: String,
    },
    /// A tensor is absent or has the wrong shape or dtype.
    #[error("checkpoint {} does not match this model: tensor {name}: {why}; was it saved by a different model or version?", .path.display())]
    Mismatch {
        /// The file.
        path: PathBuf,
        /// Tensor name.
        name: String,
        /// What is wrong.
        why: String,
    },
    /// The save path cannot work (found before training starts, by [`check_target`]).
    #[error("cannot save a checkpoint at {}: {why}", .path.display())]
    Target {
        /// The save path.
        path: PathBuf,
        /// What is wrong and what to do.
        why: String,
    },
    /// The file system has too little room for one more checkpoint.
    #[error(
        "cannot save a checkpoint at {}: a save needs about {} MiB free, the file system of {} has {} MiB available; free some space or save elsewhere",
        .path.display(), .need >> 20, .dir.display(), .avail >> 20
    )]
    NoSpace {
        /// The save path.
        path: PathBuf,
        /// Its directory.
        dir: PathBuf,
        /// Bytes one save needs.
        need: u64,
        /// Bytes available to this user.
        avail: u64,
    },
    /// No pair of files forms a complete checkpoint.
    #[error("no complete checkpoint at {}: {tried}; pass the model file written by --save (its .optim.safetensors companion, or the .prev pair, must sit beside it)", .path.display())]
    NoCompleteState {
        /// The path asked for.
        path: PathBuf,
        /// Why each pair was passed over.
        tried: String,
    },
    /// [`FAULT_ENV`] holds something other than a save step.
    #[error("{FAULT_ENV}={value:?} is not a save step; use one of: {valid} (or unset it)")]
    FaultSpec {
        /// The value found.
        value: String,
        /// The valid step names.
        valid: String,
    },
}

/// Training progress stored next to the optimizer moments.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainState {
    /// Completed epochs.
    pub epoch: u64,
    /// Optimizer steps taken.
    pub step: u64,
    /// Base seed (initialisation and shuffling).
    pub seed: u64,
    /// World size the run used (the data order depends on it).
    pub world_size: u64,
    /// The fp16 loss scaler's state (`None` for runs that scale no loss, and for checkpoints
    /// written before it was stored).
    pub loss_scaler: Option<ScalerState>,
}

/// Metadata keys of [`ScalerState`] in the optimizer file (`loss_scale` is written first and
/// decides whether the others must be there).
const SCALER_KEYS: [&str; 6] = [
    "loss_scale",
    "loss_scale_growth_factor",
    "loss_scale_backoff_factor",
    "loss_scale_growth_interval",
    "loss_scale_growth_tracker",
    "loss_scale_skipped",
];

/// The optimizer file that goes with a model file.
pub fn optim_path(path: &Path) -> PathBuf {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!("{stem}.optim.safetensors"))
}

/// Where the previous complete model file of the checkpoint at `path` is kept (its optimizer
/// file is [`optim_path`] of this).
pub fn prev_path(path: &Path) -> PathBuf {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!("{stem}.prev.safetensors"))
}

/// Bytes one save of a model with `num_params` parameters needs free: the model file holds the
/// parameters once and the optimizer file twice (both Adam moments), 4 bytes each, plus slack for
/// the headers and the BatchNorm buffers.
pub fn estimate_bytes(num_params: usize) -> u64 {
    num_params as u64 * 12 + (1 << 20)
}

/// A step of [`save`] after which [`FAULT_ENV`] can kill the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SaveStep {
    /// The optimizer temporary is written (not yet synced).
    OptimWritten,
    /// The model temporary is written (not yet synced).
    ModelWritten,
    /// Both temporaries are fsynced.
    Synced,
    /// The previous model file is kept under its `prev` name.
    PrevModelKept,
    /// The previous optimizer file is kept under its `prev` name.
    PrevOptimKept,
    /// The optimizer temporary is renamed into place, the directory not yet fsynced.
    OptimRenamed,
    /// The directory is fsynced; the commit rename is next.
    OptimDurable,
    /// The model temporary is renamed into place (committed), the directory not yet fsynced.
    Committed,
    /// The save is complete and durable.
    Done,
}

impl SaveStep {
    /// Every step, in the order a save passes them.
    pub const ALL: [SaveStep; 9] = [
        SaveStep::OptimWritten,
        SaveStep::ModelWritten,
        SaveStep::Synced,
        SaveStep::PrevModelKept,
        SaveStep::PrevOptimKept,
        SaveStep::OptimRenamed,
        SaveStep::OptimDurable,
        SaveStep::Committed,
        SaveStep::Done,
    ];

    /// The name [`FAULT_ENV`] uses.
    pub fn name(self) -> &'static str {
        match self {
            SaveStep::OptimWritten => "optim-written",
            SaveStep::ModelWritten => "model-written",
            SaveStep::Synced => "synced",
            SaveStep::PrevModelKept => "prev-model-kept",
            SaveStep::PrevOptimKept => "prev-optim-kept",
            SaveStep::OptimRenamed => "optim-renamed",
            SaveStep::OptimDurable => "optim-durable",
            SaveStep::Committed => "committed",
            SaveStep::Done => "done",
        }
    }

    /// Whether a save killed right after this step has already committed the new pair.
    pub fn is_committed(self) -> bool {
        matches!(self, SaveStep::Committed | SaveStep::Done)
    }
}

impl std::fmt::Display for SaveStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for SaveStep {
    type Err = CheckpointError;
    fn from_str(s: &str) -> Result<SaveStep, CheckpointError> {
        SaveStep::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| CheckpointError::FaultSpec {
                value: s.to_string(),
                valid: SaveStep::ALL.map(SaveStep::name).join(", "),
            })
    }
}

/// The save step [`FAULT_ENV`] names, if it is set (an empty value counts as unset).
pub fn fault_from_env() -> Result<Option<SaveStep>, CheckpointError> {
    match std::env::var_os(FAULT_ENV) {
        None => Ok(None),
        Some(v) if v.is_empty() => Ok(None),
        Some(v) => match v.to_str() {
            Some(s) => s.parse().map(Some),
            None => Err(CheckpointError::FaultSpec {
                value: v.to_string_lossy().into_owned(),
                valid: SaveStep::ALL.map(SaveStep::name).join(", "),
            }),
        },
    }
}

/// Kill this process if `fault` names `step` (fault injection: no destructor, no cleanup runs,
/// exactly as when the machine or an operator kills a trainer).
fn reached(fault: Option<SaveStep>, step: SaveStep, path: &Path) {
    if fault == Some(step) {
        tracing::warn!(
            "{FAULT_ENV}={step}: killing this process during the save of {}",
            path.display()
        );
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
        std::process::abort();
    }
}

/// The four names of a checkpoint inside its directory.
struct Files {
    /// The directory (`.` for a bare file name).
    dir: PathBuf,
    /// Live model file (the path saved to).
    model: OsString,
    /// Live optimizer file.
    optim: OsString,
    /// Previous model file.
    prev_model: OsString,
    /// Previous optimizer file.
    prev_optim: OsString,
}

impl Files {
    fn of(path: &Path) -> Result<Files, CheckpointError> {
        let name = |p: PathBuf| p.file_name().map(OsStr::to_os_string);
        let model =
            path.file_name()
                .map(OsStr::to_os_string)
                .ok_or_else(|| {
                    CheckpointError::Target {
                path: path.to_path_buf(),
                why:
                    "the path names no file; pass a file path such as checkpoints/model.safetensors"
                        .into(),
            }
                })?;
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let prev = prev_path(path);
        // All three derived names exist whenever `path` has a file name.
        let (Some(optim), Some(prev_optim), Some(prev_model)) =
            (name(optim_path(path)), name(optim_path(&prev)), name(prev))
        else {
            return Err(CheckpointError::Target {
                path: path.to_path_buf(),
                why: "the path names no file".into(),
            });
        };
        Ok(Files {
            dir,
            model,
            optim,
            prev_model,
            prev_optim,
        })
    }

    fn all(&self) -> [&OsStr; 4] {
        [&self.model, &self.optim, &self.prev_model, &self.prev_optim]
    }

    fn name(&self, slot: Slot, what: Kind) -> &OsStr {
        match (slot, what) {
            (Slot::Live, Kind::Model) => &self.model,
            (Slot::Live, Kind::Optim) => &self.optim,
            (Slot::Prev, Kind::Model) => &self.prev_model,
            (Slot::Prev, Kind::Optim) => &self.prev_optim,
        }
    }

    fn path(&self, name: &OsStr) -> PathBuf {
        self.dir.join(name)
    }
}

/// Which of the two names of a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    Live,
    Prev,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Model,
    Optim,
}

/// Model/optimizer pairs in the order a resume tries them. A model file is only ever renamed
/// into place after its optimizer file is on disk under one of the two optimizer names, so
/// `(Live, Prev)` is the newest complete state right after a save was killed between its
/// optimizer rename and its commit.
const PAIRS: [(Slot, Slot); 4] = [
    (Slot::Live, Slot::Live),
    (Slot::Live, Slot::Prev),
    (Slot::Prev, Slot::Prev),
    (Slot::Prev, Slot::Live),
];

/// The checkpoint's directory, held open: every name is created, renamed and removed relative
/// to this descriptor, so replacing the directory path midway cannot redirect a save.
struct Dir {
    path: PathBuf,
    file: File,
}

impl Dir {
    fn open(files: &Files, save: &Path) -> Result<Dir, CheckpointError> {
        let dir = &files.dir;
        let target = |why: String| CheckpointError::Target {
            path: save.to_path_buf(),
            why,
        };
        match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY)
            .open(dir)
        {
            Ok(file) => Ok(Dir {
                path: dir.clone(),
                file,
            }),
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

    fn io(&self, name: &OsStr, e: Errno) -> CheckpointError {
        CheckpointError::Io {
            path: self.path.join(name),
            source: std::io::Error::from(e),
        }
    }

    /// fsync the directory, making the renames in it durable.
    fn sync(&self) -> Result<(), CheckpointError> {
        self.file.sync_all().map_err(|source| CheckpointError::Io {
            path: self.path.clone(),
            source,
        })
    }

    /// Type and owner of `name`, without following a symbolic link; `None` if absent.
    fn lstat(&self, name: &OsStr) -> Result<Option<nix::sys::stat::FileStat>, CheckpointError> {
        match fstatat(self.file.as_fd(), name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => Ok(Some(st)),
            Err(Errno::ENOENT) => Ok(None),
            Err(e) => Err(self.io(name, e)),
        }
    }
}

/// 16 random hex digits from the kernel (temporary names nobody can guess ahead).
fn random_hex() -> Result<String, CheckpointError> {
    let mut b = [0u8; 8];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|source| CheckpointError::Io {
            path: PathBuf::from("/dev/urandom"),
            source,
        })?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// `.{target}.tmp-` : every temporary made for `target` starts so.
fn temp_prefix(target: &OsStr) -> Vec<u8> {
    [b".".as_slice(), target.as_bytes(), b".tmp-"].concat()
}

/// `.{target}.tmp-{pid}-{random}`: the pid lets a later save tell a killed save's leftovers
/// from a save still running; the random part makes the name unpredictable.
fn temp_name(target: &OsStr) -> Result<OsString, CheckpointError> {
    let mut n = temp_prefix(target);
    n.extend_from_slice(format!("{}-{}", std::process::id(), random_hex()?).as_bytes());
    Ok(OsString::from_vec(n))
}

/// A temporary file in the checkpoint directory, removed on drop unless renamed into place.
struct Temp<'d> {
    dir: &'d Dir,
    name: OsString,
    file: Option<File>,
    live: bool,
}

impl<'d> Temp<'d> {
    /// Create a fresh temporary for `target`: `O_EXCL` refuses any existing name, symbolic
    /// links included, so nothing planted in the directory is ever opened.
    fn create(dir: &'d Dir, target: &OsStr) -> Result<Temp<'d>, CheckpointError> {
        let flags =
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let mut last = Errno::EEXIST;
        // A clash of 64 random bits means someone is guessing; a few tries settle it.
        for _ in 0..4 {
            let name = temp_name(target)?;
            match nix::fcntl::openat(
                dir.file.as_fd(),
                name.as_os_str(),
                flags,
                Mode::from_bits_truncate(0o666),
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
                Err(e) => return Err(dir.io(&name, e)),
            }
        }
        Err(dir.io(target, last))
    }

    /// A name `link` already gave a file: owned from here on (removed on drop).
    fn adopt(dir: &'d Dir, name: OsString) -> Temp<'d> {
        Temp {
            dir,
            name,
            file: None,
            live: true,
        }
    }

    fn path(&self) -> PathBuf {
        self.dir.path.join(&self.name)
    }

    fn write(&mut self, bytes: &[u8]) -> Result<(), CheckpointError> {
        let path = self.path();
        match &mut self.file {
            Some(f) => f
                .write_all(bytes)
                .map_err(|source| CheckpointError::Io { path, source }),
            None => Ok(()),
        }
    }

    fn sync(&mut self) -> Result<(), CheckpointError> {
        let path = self.path();
        match &mut self.file {
            Some(f) => f
                .sync_all()
                .map_err(|source| CheckpointError::Io { path, source }),
            None => Ok(()),
        }
    }

    /// Rename over `target` (atomically replacing whatever entry is there, a symbolic link
    /// included, without following it).
    fn rename_to(mut self, target: &OsStr) -> Result<(), CheckpointError> {
        self.file = None;
        let fd = self.dir.file.as_fd();
        nix::fcntl::renameat(fd, self.name.as_os_str(), fd, target)
            .map_err(|e| self.dir.io(target, e))?;
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
                    "checkpoint: could not remove the temporary file {}: {e}",
                    self.path().display()
                );
            }
        }
    }
}

/// Whether a process `pid` exists (a permission error means it does, under another user).
fn pid_alive(pid: i32) -> bool {
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
        let Some(rest) = prefixes
            .iter()
            .find_map(|p| name.as_bytes().strip_prefix(p.as_slice()))
        else {
            continue;
        };
        let pid = rest
            .split(|&c| c == b'-')
            .next()
            .and_then(|p| std::str::from_utf8(p).ok()?.parse::<i32>().ok());
        let Some(pid) = pid.filter(|&p| p > 0) else {
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
        match nix::unistd::unlinkat(
            dir.file.as_fd(),
            name.as_os_str(),
            UnlinkatFlags::NoRemoveDir,
        ) {
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
    if let (Some(a), Some(b)) = (dir.lstat(src)?, dir.lstat(dst)?) {
        if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino) {
            return Ok(());
        }
    }
    let name = temp_name(dst)?;
    let fd = dir.file.as_fd();
    match nix::unistd::linkat(fd, src, fd, name.as_os_str(), AtFlags::empty()) {
        Ok(()) => {
            Temp::adopt(dir, name.clone()).rename_to(dst)?;
            // Should `dst` have become a link of `src` meanwhile, the rename did nothing.
            match nix::unistd::unlinkat(fd, name.as_os_str(), UnlinkatFlags::NoRemoveDir) {
                Ok(()) | Err(Errno::ENOENT) => Ok(()),
                Err(e) => Err(dir.io(&name, e)),
            }
        }
        Err(Errno::EPERM | Errno::EOPNOTSUPP | Errno::EMLINK) => {
            tracing::debug!(
                "checkpoint: {} cannot be hard-linked; copying it",
                dir.path.join(src).display()
            );
            let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
            let mut bytes = Vec::new();
            let f =
                nix::fcntl::openat(fd, src, flags, Mode::empty()).map_err(|e| dir.io(src, e))?;
            File::from(f)
                .read_to_end(&mut bytes)
                .map_err(|source| CheckpointError::Io {
                    path: dir.path.join(src),
                    source,
                })?;
            let mut t = Temp::create(dir, dst)?;
            t.write(&bytes)?;
            t.sync()?;
            t.rename_to(dst)
        }
        Err(e) => Err(dir.io(src, e)),
    }
}

/// Check, before any training, that a checkpoint can be saved at `path`: its directory exists,
/// none of the checkpoint's names is a directory or a special file, a file can be created and
/// removed there, and the file system has `need_bytes` free (see [`estimate_bytes`]). Also
/// checks [`FAULT_ENV`]. Each error names the path and what to do.
pub fn check_target(path: &Path, need_bytes: u64) -> Result<(), CheckpointError> {
    fault_from_env()?;
    let files = Files::of(path)?;
    let dir = Dir::open(&files, path)?;
    let target = |why: String| CheckpointError::Target {
        path: path.to_path_buf(),
        why,
    };
    for name in files.all() {
        let Some(st) = dir.lstat(name)? else { continue };
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
    match Temp::create(&dir, &files.model) {
        Ok(t) => drop(t),
        Err(CheckpointError::Io { source, .. }) => {
            return Err(target(format!(
                "cannot create a file in {}: {source}; make the directory writable or choose another path",
                dir.path.display()
            )))
        }
        Err(e) => return Err(e),
    }
    let vfs =
        nix::sys::statvfs::fstatvfs(dir.file.as_fd()).map_err(|e| dir.io(OsStr::new(""), e))?;
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

struct Raw {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl View for &Raw {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

fn f32_raw(shape: Vec<usize>, v: &[f32]) -> Raw {
    Raw {
        dtype: Dtype::F32,
        shape,
        bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

fn serialize(
    path: &Path,
    tensors: &[(String, Raw)],
    meta: HashMap<String, String>,
) -> Result<Vec<u8>, CheckpointError> {
    safetensors::serialize(tensors.iter().map(|(n, r)| (n.clone(), r)), Some(meta)).map_err(|e| {
        CheckpointError::Format {
            path: path.to_path_buf(),
            msg: e.to_string(),
        }
    })
}

/// The bytes of the model file and of the optimizer file, both stamped with `save_id`.
fn encode(
    path: &Path,
    model: &mut Model,
    opt: &Adam,
    state: &TrainState,
    save_id: &str,
) -> Result<(Vec<u8>, Vec<u8>), CheckpointError> {
    let mut tensors: Vec<(String, Raw)> = Vec::new();
    for e in &model.entries {
        tensors.push((
            e.name.clone(),
            f32_raw(e.dims.clone(), &model.params[e.range.clone()]),
        ));
    }
    for s in model.state_mut() {
        match s {
            StateMut::F32(n, v) => {
                let len = v.len();
                tensors.push((n, f32_raw(vec![len], v)))
            }
            StateMut::I64(n, v) => tensors.push((
                n,
                Raw {
                    dtype: Dtype::I64,
                    shape: vec![],
                    bytes: v.to_le_bytes().to_vec(),
                },
            )),
        }
    }
    let mut opt_tensors = Vec::new();
    for e in &model.entries {
        opt_tensors.push((
            format!("exp_avg.{}", e.name),
            f32_raw(e.dims.clone(), &opt.m[e.range.clone()]),
        ));
        opt_tensors.push((
            format!("exp_avg_sq.{}", e.name),
            f32_raw(e.dims.clone(), &opt.v[e.range.clone()]),
        ));
    }
    let mut meta: HashMap<String, String> = [
        ("step", state.step.to_string()),
        ("epoch", state.epoch.to_string()),
        ("seed", state.seed.to_string()),
        ("world_size", state.world_size.to_string()),
        ("lr", opt.lr.to_string()),
        ("save_id", save_id.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    if let Some(sc) = &state.loss_scaler {
        // Rust prints an f32 with the fewest digits that parse back to the same bits.
        let values = [
            sc.scale.to_string(),
            sc.growth_factor.to_string(),
            sc.backoff_factor.to_string(),
            sc.growth_interval.to_string(),
            sc.good_steps.to_string(),
            sc.skipped.to_string(),
        ];
        meta.extend(SCALER_KEYS.iter().map(|k| k.to_string()).zip(values));
    }
    let model_meta = HashMap::from([
        ("format".to_string(), "pt".to_string()),
        ("step".to_string(), state.step.to_string()),
        ("save_id".to_string(), save_id.to_string()),
    ]);
    Ok((
        serialize(path, &tensors, model_meta)?,
        serialize(&optim_path(path), &opt_tensors, meta)?,
    ))
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
    let dir = Dir::open(&files, path)?;
    let stale = remove_stale_temps(&dir, &files);
    if stale > 0 {
        tracing::info!(
            "checkpoint: removed {stale} temporary file(s) left by an interrupted save of {}",
            path.display()
        );
    }
    let save_id = random_hex()?;
    let (model_bytes, optim_bytes) = encode(path, model, opt, state, &save_id)?;

    let mut t_optim = Temp::create(&dir, &files.optim)?;
    t_optim.write(&optim_bytes)?;
    reached(fault, SaveStep::OptimWritten, path);
    let mut t_model = Temp::create(&dir, &files.model)?;
    t_model.write(&model_bytes)?;
    reached(fault, SaveStep::ModelWritten, path);
    t_optim.sync()?;
    t_model.sync()?;
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

    t_optim.rename_to(&files.optim)?;
    reached(fault, SaveStep::OptimRenamed, path);
    // The optimizer file (and the kept pair) must be durable before the commit can be.
    dir.sync()?;
    reached(fault, SaveStep::OptimDurable, path);
    t_model.rename_to(&files.model)?;
    reached(fault, SaveStep::Committed, path);
    dir.sync()?;
    reached(fault, SaveStep::Done, path);
    tracing::debug!(
        "checkpoint: saved {} (epoch {}, step {}, save id {save_id})",
        path.display(),
        state.epoch,
        state.step
    );
    Ok(())
}

/// The whole of a regular file; `None` if absent. Opened non-blocking so a FIFO planted under a
/// checkpoint name cannot hang the reader.
fn read_regular(path: &Path) -> Result<Option<Vec<u8>>, String> {
    let mut f = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    match f.metadata() {
        Ok(m) if m.is_file() => {}
        Ok(_) => return Err(format!("{} is not a regular file", path.display())),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    }
    let mut bytes = Vec::new();
    f.read_to_end(&mut bytes)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(Some(bytes))
}

fn file_meta(path: &Path, bytes: &[u8]) -> Result<HashMap<String, String>, CheckpointError> {
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(|e| CheckpointError::Format {
        path: path.to_path_buf(),
        msg: e.to_string(),
    })?;
    Ok(header.metadata().clone().unwrap_or_default())
}

/// What ties a model file to its optimizer file: the save id, or for files written before save
/// ids existed, the step.
fn pair_key(meta: &HashMap<String, String>) -> Option<(&'static str, &str)> {
    match (meta.get("save_id"), meta.get("step")) {
        (Some(id), _) => Some(("save id", id.as_str())),
        (None, Some(step)) => Some(("step", step.as_str())),
        (None, None) => None,
    }
}

/// The four files of a checkpoint, each read at most once.
struct Probe<'f> {
    files: &'f Files,
    cache: [Option<Result<Option<Vec<u8>>, String>>; 4],
}

impl<'f> Probe<'f> {
    fn new(files: &'f Files) -> Probe<'f> {
        Probe {
            files,
            cache: [None, None, None, None],
        }
    }

    fn path(&self, slot: Slot, kind: Kind) -> PathBuf {
        self.files.path(self.files.name(slot, kind))
    }

    fn fetch(&mut self, slot: Slot, kind: Kind) {
        let i = slot as usize * 2 + kind as usize;
        if self.cache[i].is_none() {
            self.cache[i] = Some(read_regular(&self.path(slot, kind)));
        }
    }

    fn bytes(&self, slot: Slot, kind: Kind) -> Result<&[u8], String> {
        match &self.cache[slot as usize * 2 + kind as usize] {
            Some(Ok(Some(b))) => Ok(b),
            Some(Ok(None)) | None => Err(format!(
                "{} does not exist",
                self.path(slot, kind).display()
            )),
            Some(Err(e)) => Err(e.clone()),
        }
    }

    /// The model file in `m` and the optimizer file in `o` exist, parse, and come from one save.
    fn pair(&mut self, m: Slot, o: Slot) -> Result<(&[u8], &[u8]), String> {
        self.fetch(m, Kind::Model);
        self.fetch(o, Kind::Optim);
        let (mp, op) = (self.path(m, Kind::Model), self.path(o, Kind::Optim));
        let (mb, ob) = (self.bytes(m, Kind::Model)?, self.bytes(o, Kind::Optim)?);
        let mm = file_meta(&mp, mb).map_err(|e| e.to_string())?;
        let om = file_meta(&op, ob).map_err(|e| e.to_string())?;
        match (pair_key(&mm), pair_key(&om)) {
            (Some(a), Some(b)) if a == b => Ok((mb, ob)),
            (a, b) => {
                let show = |k: Option<(&str, &str)>| {
                    k.map(|(what, v)| format!("{what} {v}"))
                        .unwrap_or_else(|| "no save id".into())
                };
                Err(format!(
                    "{} ({}) and {} ({}) come from different saves (an interrupted save)",
                    mp.display(),
                    show(a),
                    op.display(),
                    show(b)
                ))
            }
        }
    }
}

fn read_f32(
    path: &Path,
    st: &SafeTensors,
    name: &str,
    dims: &[usize],
    dst: &mut [f32],
) -> Result<(), CheckpointError> {
    let mm = |why: String| CheckpointError::Mismatch {
        path: path.to_path_buf(),
        name: name.to_string(),
        why,
    };
    let t = st.tensor(name).map_err(|_| mm("missing".into()))?;
    if t.dtype() != Dtype::F32 || t.shape() != dims {
        return Err(mm(format!(
            "expected f32 {dims:?}, found {:?} {:?}",
            t.dtype(),
            t.shape()
        )));
    }
    for (d, c) in dst.iter_mut().zip(t.data().chunks_exact(4)) {
        *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
    Ok(())
}

fn meta_u64(
    path: &Path,
    meta: &HashMap<String, String>,
    key: &str,
) -> Result<u64, CheckpointError> {
    meta.get(key)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| CheckpointError::Mismatch {
            path: path.to_path_buf(),
            name: format!("metadata {key}"),
            why: "missing or not a number".into(),
        })
}

fn meta_num<T: FromStr>(
    path: &Path,
    meta: &HashMap<String, String>,
    key: &str,
) -> Result<T, CheckpointError> {
    meta.get(key)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| CheckpointError::Mismatch {
            path: path.to_path_buf(),
            name: format!("metadata {key}"),
            why: "missing or not a number (the loss scaler's keys come together)".into(),
        })
}

/// The loss scaler's state in an optimizer file's metadata, if it holds one.
fn scaler_state(
    path: &Path,
    meta: &HashMap<String, String>,
) -> Result<Option<ScalerState>, CheckpointError> {
    if !meta.contains_key(SCALER_KEYS[0]) {
        return Ok(None);
    }
    let st = ScalerState {
        scale: meta_num(path, meta, SCALER_KEYS[0])?,
        growth_factor: meta_num(path, meta, SCALER_KEYS[1])?,
        backoff_factor: meta_num(path, meta, SCALER_KEYS[2])?,
        growth_interval: meta_num(path, meta, SCALER_KEYS[3])?,
        good_steps: meta_num(path, meta, SCALER_KEYS[4])?,
        skipped: meta_num(path, meta, SCALER_KEYS[5])?,
    };
    // Checked here, so a resume passes over a damaged file as over any other.
    super::precision::LossScaler::from_state(st).map_err(|e| CheckpointError::Mismatch {
        path: path.to_path_buf(),
        name: "metadata loss_scale".into(),
        why: e.to_string(),
    })?;
    Ok(Some(st))
}

fn load_model_bytes(path: &Path, bytes: &[u8], model: &mut Model) -> Result<(), CheckpointError> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| CheckpointError::Format {
        path: path.to_path_buf(),
        msg: e.to_string(),
    })?;
    let entries = model.entries.clone();
    for e in &entries {
        read_f32(
            path,
            &st,
            &e.name,
            &e.dims,
            &mut model.params[e.range.clone()],
        )?;
    }
    for s in model.state_mut() {
        match s {
            StateMut::F32(n, v) => {
                let len = v.len();
                read_f32(path, &st, &n, &[len], v)?
            }
            StateMut::I64(n, v) => {
                let t = st.tensor(&n).map_err(|_| CheckpointError::Mismatch {
                    path: path.to_path_buf(),
                    name: n.clone(),
                    why: "missing".into(),
                })?;
                match (t.dtype(), <[u8; 8]>::try_from(t.data())) {
                    (Dtype::I64, Ok(b)) => *v = i64::from_le_bytes(b),
                    _ => {
                        return Err(CheckpointError::Mismatch {
                            path: path.to_path_buf(),
                            name: n,
                            why: "expected one i64".into(),
                        })
                    }
                }
            }
        }
    }
    Ok(())
}

fn load_optim_bytes(
    path: &Path,
    bytes: &[u8],
    model: &Model,
    opt: &mut Adam,
) -> Result<TrainState, CheckpointError> {
    let meta = file_meta(path, bytes)?;
    let st = SafeTensors::deserialize(bytes).map_err(|e| CheckpointError::Format {
        path: path.to_path_buf(),
        msg: e.to_string(),
    })?;
    for e in &model.entries {
        read_f32(
            path,
            &st,
            &format!("exp_avg.{}", e.name),
            &e.dims,
            &mut opt.m[e.range.clone()],
        )?;
        read_f32(
            path,
            &st,
            &format!("exp_avg_sq.{}", e.name),
            &e.dims,
            &mut opt.v[e.range.clone()],
        )?;
    }
    let state = TrainState {
        epoch: meta_u64(path, &meta, "epoch")?,
        step: meta_u64(path, &meta, "step")?,
        seed: meta_u64(path, &meta, "seed")?,
        world_size: meta_u64(path, &meta, "world_size")?,
        loss_scaler: scaler_state(path, &meta)?,
    };
    opt.step = state.step;
    Ok(state)
}

/// Load the model weights and buffers from `path` (a PyTorch-named safetensors file).
pub fn load_model(path: &Path, model: &mut Model) -> Result<(), CheckpointError> {
    let bytes = std::fs::read(path).map_err(|source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    load_model_bytes(path, &bytes, model)
}

/// Which saved pair a resume used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The model file at the checkpoint path: the newest committed save.
    Latest,
    /// The kept `prev` model file: the save before it (the newest was unreadable or torn).
    Previous,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Source::Latest => "latest",
            Source::Previous => "previous",
        })
    }
}

/// What [`resume`] loaded.
#[derive(Clone, Debug)]
pub struct Resumed {
    /// The training state of the loaded pair.
    pub state: TrainState,
    /// Whether the model file was the latest or the previous one.
    pub source: Source,
    /// The model file loaded.
    pub model_file: PathBuf,
    /// The optimizer file loaded.
    pub optim_file: PathBuf,
    /// Why each newer pair was passed over (empty when the live pair loaded).
    pub passed_over: Vec<String>,
}

/// Load the newest complete checkpoint saved at `path` into `model` and `opt` (for `--resume`):
/// the live pair, else the live model with the kept optimizer file (a save killed before its
/// commit), else the kept previous pair. On error `model` and `opt` may hold a partial load.
pub fn resume(path: &Path, model: &mut Model, opt: &mut Adam) -> Result<Resumed, CheckpointError> {
    let files = Files::of(path).map_err(|_| CheckpointError::NoCompleteState {
        path: path.to_path_buf(),
        tried: "the path names no file".into(),
    })?;
    let mut probe = Probe::new(&files);
    let mut passed_over: Vec<String> = Vec::new();
    for (m, o) in PAIRS {
        let (mp, op) = (probe.path(m, Kind::Model), probe.path(o, Kind::Optim));
        let loaded = probe.pair(m, o).and_then(|(mb, ob)| {
            load_model_bytes(&mp, mb, model).map_err(|e| e.to_string())?;
            load_optim_bytes(&op, ob, model, opt).map_err(|e| e.to_string())
        });
        match loaded {
            Ok(state) => {
                let source = if m == Slot::Live {
                    Source::Latest
                } else {
                    Source::Previous
                };
                return Ok(Resumed {
                    state,
                    source,
                    model_file: mp,
                    optim_file: op,
                    passed_over,
                });
            }
            Err(why) if !passed_over.contains(&why) => passed_over.push(why),
            Err(_) => {}
        }
    }
    Err(CheckpointError::NoCompleteState {
        path: path.to_path_buf(),
        tried: passed_over.join("; "),
    })
}

/// Load model, optimizer moments and training state (for `--resume`); see [`resume`], which
/// also says which pair of files it used.
pub fn load(path: &Path, model: &mut Model, opt: &mut Adam) -> Result<TrainState, CheckpointError> {
    resume(path, model, opt).map(|r| r.state)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("lockstep-ckpt-unit-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn model_and_opt() -> (Model, Adam) {
        let mut m = Model::fashion_cnn(1).unwrap();
        m.init(7);
        let n = m.num_params();
        (m, Adam::new(n, 0.01))
    }

    /// Save a state recognisable by `epoch` (in the metadata, a parameter and a moment).
    fn save_epoch(path: &Path, epoch: u64) -> Result<(), CheckpointError> {
        let (mut m, mut opt) = model_and_opt();
        m.params[0] = epoch as f32;
        opt.m[0] = epoch as f32;
        save(
            path,
            &mut m,
            &opt,
            &TrainState {
                epoch,
                step: epoch * 10,
                seed: 1,
                world_size: 1,
                loss_scaler: None,
            },
        )
    }

    /// (source, epoch from the metadata, epoch from the parameter, epoch from the moment).
    fn resumed(path: &Path) -> Result<(Source, u64, f32, f32, Vec<String>), CheckpointError> {
        let (mut m, mut opt) = model_and_opt();
        let r = resume(path, &mut m, &mut opt)?;
        Ok((
            r.source,
            r.state.epoch,
            m.params[0],
            opt.m[0],
            r.passed_over,
        ))
    }

    fn names(d: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    const FOUR: [&str; 4] = [
        "m.optim.safetensors",
        "m.prev.optim.safetensors",
        "m.prev.safetensors",
        "m.safetensors",
    ];

    /// The loss scaler's state goes through a save and a resume bit for bit; a file without it
    /// (fp32 runs, older files) resumes with none; a file with only some of its keys is passed
    /// over like any damaged file.
    #[test]
    fn loss_scaler_state_round_trips_and_older_files_load_without_it() {
        let d = tmpdir("scaler");
        let p = d.join("m.safetensors");
        let sc = ScalerState {
            scale: 2f32.powi(-3) * 3.0,
            growth_factor: 1.7,
            backoff_factor: 0.3,
            growth_interval: 7,
            good_steps: 5,
            skipped: 11,
        };
        let (mut m, opt) = model_and_opt();
        let st = TrainState {
            epoch: 1,
            step: 9,
            seed: 1,
            world_size: 2,
            loss_scaler: Some(sc),
        };
        save(&p, &mut m, &opt, &st).unwrap();
        let (mut m2, mut opt2) = model_and_opt();
        let r = resume(&p, &mut m2, &mut opt2).unwrap();
        assert_eq!(r.state, st);
        let got = r.state.loss_scaler.unwrap();
        assert_eq!(
            (got.scale.to_bits(), got.growth_factor.to_bits()),
            (sc.scale.to_bits(), sc.growth_factor.to_bits())
        );

        // An older file: the same metadata without the scaler keys.
        save_epoch(&p, 2).unwrap();
        let r = resume(&p, &mut m2, &mut opt2).unwrap();
        assert_eq!((r.state.epoch, r.state.loss_scaler), (2, None));

        // One scaler key lost: this pair is refused (naming the key) and the previous one used.
        let opath = optim_path(&p);
        let bytes = std::fs::read(&opath).unwrap();
        let mut meta = file_meta(&opath, &bytes).unwrap();
        let st3 = TrainState {
            epoch: 3,
            step: 30,
            seed: 1,
            world_size: 1,
            loss_scaler: Some(sc),
        };
        save(&p, &mut m, &opt, &st3).unwrap();
        let bytes = std::fs::read(&opath).unwrap();
        let full = file_meta(&opath, &bytes).unwrap();
        for k in SCALER_KEYS.iter().take(5) {
            meta.insert(k.to_string(), full[*k].clone());
        }
        meta.insert("save_id".into(), full["save_id"].clone());
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let raws: Vec<(String, Raw)> = st
            .tensors()
            .into_iter()
            .map(|(n, t)| {
                (
                    n,
                    Raw {
                        dtype: t.dtype(),
                        shape: t.shape().to_vec(),
                        bytes: t.data().to_vec(),
                    },
                )
            })
            .collect();
        std::fs::remove_file(&opath).unwrap();
        std::fs::write(&opath, serialize(&opath, &raws, meta).unwrap()).unwrap();
        let r = resume(&p, &mut m2, &mut opt2).unwrap();
        assert_eq!((r.source, r.state.epoch), (Source::Previous, 2));
        assert!(
            r.passed_over
                .iter()
                .any(|w| w.contains("metadata loss_scale_skipped")),
            "{:?}",
            r.passed_over
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn fault_step_names_parse_strictly() {
        for s in SaveStep::ALL {
            assert_eq!(s.name().parse::<SaveStep>().unwrap(), s);
        }
        let e = "bogus".parse::<SaveStep>().unwrap_err().to_string();
        assert!(e.contains("\"bogus\"") && e.contains(FAULT_ENV), "{e}");
        for s in SaveStep::ALL {
            assert!(e.contains(s.name()), "{e} must list {s}");
        }
        assert!("Committed".parse::<SaveStep>().is_err(), "names are exact");
    }

    #[test]
    fn latest_then_previous_then_a_clear_error() {
        let d = tmpdir("order");
        let p = d.join("m.safetensors");
        save_epoch(&p, 1).unwrap();
        save_epoch(&p, 2).unwrap();
        assert_eq!(
            names(&d),
            FOUR,
            "the live and the previous pair, nothing else"
        );
        let (src, epoch, w, m, passed) = resumed(&p).unwrap();
        assert_eq!((src, epoch, w, m), (Source::Latest, 2, 2.0, 2.0));
        assert!(passed.is_empty(), "{passed:?}");

        // A damaged live model file: the previous pair is complete and used, and said so.
        std::fs::write(&p, b"torn").unwrap();
        let (src, epoch, w, m, passed) = resumed(&p).unwrap();
        assert_eq!((src, epoch, w, m), (Source::Previous, 1, 1.0, 1.0));
        assert!(
            passed
                .iter()
                .any(|r| r.contains("m.safetensors") && r.contains("not a valid safetensors")),
            "{passed:?}"
        );

        std::fs::remove_file(d.join("m.prev.safetensors")).unwrap();
        let e = resumed(&p).unwrap_err().to_string();
        assert!(
            e.contains("no complete checkpoint") && e.contains("m.prev.safetensors does not exist"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn torn_pair_resumes_the_committed_state_and_the_next_save_keeps_it() {
        let d = tmpdir("torn");
        let p = d.join("m.safetensors");
        save_epoch(&p, 1).unwrap();
        save_epoch(&p, 2).unwrap();
        // The files of a third save killed right after its optimizer rename: the kept pair is
        // the live one (2), and the live optimizer file is already 3's.
        let other = d.join("other");
        std::fs::create_dir(&other).unwrap();
        save_epoch(&other.join("m.safetensors"), 3).unwrap();
        // Kept as a save keeps them: hard links.
        for (live, prev) in [
            ("m.safetensors", "m.prev.safetensors"),
            ("m.optim.safetensors", "m.prev.optim.safetensors"),
        ] {
            std::fs::remove_file(d.join(prev)).unwrap();
            std::fs::hard_link(d.join(live), d.join(prev)).unwrap();
        }
        // A new file, as the rename makes it (copying onto the name would write into the link).
        std::fs::remove_file(d.join("m.optim.safetensors")).unwrap();
        std::fs::copy(
            other.join("m.optim.safetensors"),
            d.join("m.optim.safetensors"),
        )
        .unwrap();
        std::fs::remove_dir_all(&other).unwrap();

        let (src, epoch, w, m, passed) = resumed(&p).unwrap();
        assert_eq!(
            (src, epoch, w, m),
            (Source::Latest, 2, 2.0, 2.0),
            "the committed save, with its kept optimizer file"
        );
        assert!(
            passed.iter().any(|r| r.contains("different saves")),
            "{passed:?}"
        );

        // The next save must keep (model 2, optimizer 2) as the previous pair, not the torn 3.
        save_epoch(&p, 4).unwrap();
        assert_eq!(
            names(&d),
            FOUR,
            "no temporary left (the kept model file was a link of the live one)"
        );
        assert_eq!(resumed(&p).unwrap().1, 4);
        std::fs::write(&p, b"torn").unwrap();
        let (src, epoch, w, m, _) = resumed(&p).unwrap();
        assert_eq!((src, epoch, w, m), (Source::Previous, 2, 2.0, 2.0));
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn stale_temporaries_go_running_saves_and_other_files_stay() {
        let d = tmpdir("stale");
        let p = d.join("m.safetensors");
        let dead = (100_000..4_000_000)
            .rev()
            .find(|&pid| !pid_alive(pid))
            .expect("a free pid");
        let stale = [
            format!(".m.safetensors.tmp-{dead}-00ff00ff00ff00ff"),
            format!(".m.prev.optim.safetensors.tmp-{dead}-1"),
        ];
        // Pid 1 runs: a save there may be in progress. The last one is not ours.
        let keep = [
            ".m.optim.safetensors.tmp-1-abcdef".to_string(),
            format!(".x.safetensors.tmp-{dead}-1"),
            "notes.txt".into(),
        ];
        for n in stale.iter().chain(&keep) {
            std::fs::write(d.join(n), b"x").unwrap();
        }
        save_epoch(&p, 1).unwrap();
        let left = names(&d);
        for n in &stale {
            assert!(!left.contains(n), "{n} must be removed: {left:?}");
        }
        for n in &keep {
            assert!(left.contains(n), "{n} must stay: {left:?}");
        }
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn failed_save_removes_its_temporaries_and_keeps_the_last_state() {
        let d = tmpdir("failed");
        let p = d.join("m.safetensors");
        save_epoch(&p, 1).unwrap();
        // A non-empty directory under the previous-model name: keeping the pair fails midway.
        std::fs::create_dir(d.join("m.prev.safetensors")).unwrap();
        std::fs::write(d.join("m.prev.safetensors").join("f"), b"x").unwrap();
        assert!(save_epoch(&p, 2).is_err());
        let left = names(&d);
        assert!(
            !left.iter().any(|n| n.contains(".tmp-")),
            "temporaries left: {left:?}"
        );
        assert_eq!(resumed(&p).unwrap().1, 1);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn links_under_checkpoint_names_are_replaced_never_followed() {
        let d = tmpdir("links");
        let victims = d.join("victims");
        let ck = d.join("ck");
        std::fs::create_dir_all(&victims).unwrap();
        std::fs::create_dir_all(&ck).unwrap();
        for n in FOUR {
            std::fs::write(victims.join(n), b"precious").unwrap();
            std::os::unix::fs::symlink(victims.join(n), ck.join(n)).unwrap();
        }
        let p = ck.join("m.safetensors");
        check_target(&p, 1).unwrap();
        save_epoch(&p, 1).unwrap();
        save_epoch(&p, 2).unwrap();
        for n in FOUR {
            assert_eq!(
                std::fs::read(victims.join(n)).unwrap(),
                b"precious",
                "{n} was written through"
            );
            assert!(
                std::fs::symlink_metadata(ck.join(n))
                    .unwrap()
                    .file_type()
                    .is_file(),
                "{n} is a file now"
            );
        }
        assert_eq!(names(&ck), FOUR);
        assert_eq!(resumed(&p).unwrap().1, 2);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn check_target_refuses_paths_that_cannot_work() {
        let d = tmpdir("target");
        let msg = |p: &Path, need| check_target(p, need).unwrap_err().to_string();
        let e = msg(&d, 1);
        assert!(
            e.contains(&d.display().to_string()) && e.contains("is a directory"),
            "{e}"
        );
        let e = msg(&d.join("no/such/m.safetensors"), 1);
        assert!(e.contains("does not exist; create it first"), "{e}");
        nix::unistd::mkfifo(
            &d.join("m.optim.safetensors"),
            Mode::from_bits_truncate(0o600),
        )
        .unwrap();
        let e = msg(&d.join("m.safetensors"), 1);
        assert!(
            e.contains("m.optim.safetensors is not a regular file"),
            "{e}"
        );
        std::fs::remove_file(d.join("m.optim.safetensors")).unwrap();
        let e = msg(&d.join("m.safetensors"), u64::MAX);
        assert!(e.contains("MiB available"), "{e}");
        check_target(&d.join("m.safetensors"), estimate_bytes(1000)).unwrap();
        assert!(
            names(&d).is_empty(),
            "the probe file is removed: {:?}",
            names(&d)
        );
        let _ = std::fs::remove_dir_all(&d);
    }
}
