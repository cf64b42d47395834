//! The layout of a checkpoint on disk: the four names it lives under (the live pair and the kept
//! previous pair) and the order a resume tries the model/optimizer pairs in.
//!
//! Its own file because both sides depend on it and must agree: the commit writes the names in
//! an order that keeps one pair complete, and the resume reads them in [`PAIRS`] order.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};

use super::error::CheckpointError;

/// The optimizer file that goes with a model file.
pub fn optim_path(path: &Path) -> PathBuf {
    sibling(path, "optim")
}

/// Where the previous complete model file of the checkpoint at `path` is kept (its optimizer
/// file is [`optim_path`] of this).
pub fn prev_path(path: &Path) -> PathBuf {
    sibling(path, "prev")
}

/// `<stem>.<role>.safetensors` beside `path` (`<stem>` its file name without the extension).
fn sibling(path: &Path, role: &str) -> PathBuf {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!("{stem}.{role}.safetensors"))
}

/// The four names of a checkpoint inside its directory.
pub(super) struct Files {
    /// The directory (`.` for a bare file name).
    pub(super) dir: PathBuf,
    /// Live model file (the path saved to).
    pub(super) model: OsString,
    /// Live optimizer file.
    pub(super) optim: OsString,
    /// Previous model file.
    pub(super) prev_model: OsString,
    /// Previous optimizer file.
    pub(super) prev_optim: OsString,
}

impl Files {
    pub(super) fn of(path: &Path) -> Result<Files, CheckpointError> {
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

    pub(super) fn all(&self) -> [&OsStr; 4] {
        [&self.model, &self.optim, &self.prev_model, &self.prev_optim]
    }

    pub(super) fn name(&self, slot: Slot, what: Kind) -> &OsStr {
        match (slot, what) {
            (Slot::Live, Kind::Model) => &self.model,
            (Slot::Live, Kind::Optim) => &self.optim,
            (Slot::Prev, Kind::Model) => &self.prev_model,
            (Slot::Prev, Kind::Optim) => &self.prev_optim,
        }
    }

    pub(super) fn path(&self, name: &OsStr) -> PathBuf {
        self.dir.join(name)
    }
}

/// Which of the two names of a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Slot {
    Live,
    Prev,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Model,
    Optim,
}

/// Model/optimizer pairs in the order a resume tries them. A model file is only ever renamed
/// into place after its optimizer file is on disk under one of the two optimizer names, so
/// `(Live, Prev)` is the newest complete state right after a save was killed between its
/// optimizer rename and its commit.
pub(super) const PAIRS: [(Slot, Slot); 4] = [
    (Slot::Live, Slot::Live),
    (Slot::Live, Slot::Prev),
    (Slot::Prev, Slot::Prev),
    (Slot::Prev, Slot::Live),
];
