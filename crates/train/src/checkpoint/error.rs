//! [`CheckpointError`]: every way a save or a load fails, each naming the file and what to do.
//!
//! Its own file because every part of the checkpoint (format, commit, resume) returns it.

use std::path::PathBuf;

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
    /// The save path cannot work (found before training starts, by [`check_target`](super::check_target)).
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
    /// `LOCKSTEP_FAULT_SAVE` (the crash tests' fault injection) holds something other than a
    /// save step. Not part of the API, like the fault injection itself.
    #[doc(hidden)]
    // The variable is `fault::FAULT_ENV`, spelt out: that file uses this one (a unit test there
    // checks that this message names it).
    #[error("LOCKSTEP_FAULT_SAVE={value:?} is not a save step; use one of: {valid} (or unset it)")]
    FaultSpec {
        /// The value found.
        value: String,
        /// The valid step names.
        valid: String,
    },
}
