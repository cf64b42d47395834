//! Resume: load the newest complete checkpoint, trying the pairs of files newest first
//! ([`PAIRS`](super::layout::PAIRS)), and say which pair was used and why newer ones were passed
//! over.
//!
//! Separate from the commit because it trusts nothing on disk: any file may be missing, torn,
//! damaged or planted (a FIFO, a link), and each is read at most once, never written.

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::super::model::Model;
use super::error::CheckpointError;
use super::format::{file_meta, load_model_bytes, load_optim_bytes, pair_key, TrainState};
use super::layout::{Files, Kind, Slot, PAIRS};
use crate::ops::optim::Adam;

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

/// The four files of a checkpoint, each read at most once.
pub(super) struct Probe<'f> {
    files: &'f Files,
    cache: [Option<Result<Option<Vec<u8>>, String>>; 4],
}

impl<'f> Probe<'f> {
    pub(super) fn new(files: &'f Files) -> Probe<'f> {
        Probe {
            files,
            cache: [None, None, None, None],
        }
    }

    pub(super) fn path(&self, slot: Slot, kind: Kind) -> PathBuf {
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
    pub(super) fn pair(&mut self, m: Slot, o: Slot) -> Result<(&[u8], &[u8]), String> {
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
