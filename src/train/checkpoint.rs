//! Checkpoints in safetensors with PyTorch `state_dict` names, written atomically.
//!
//! Two files, so the model file loads in PyTorch with `load_state_dict(strict=True)` untouched:
//! - `PATH` (e.g. `model.safetensors`): parameters and BatchNorm buffers under their PyTorch
//!   names (`module1.0.weight`, `module1.1.running_var`, `module1.1.num_batches_tracked` as a
//!   0-d i64, ...), metadata `format = pt`;
//! - `PATH` with extension `optim.safetensors` (e.g. `model.optim.safetensors`): Adam moments
//!   (`exp_avg.NAME`, `exp_avg_sq.NAME`) and, in the metadata, the step, the number of completed
//!   epochs and the seed. The data order of an epoch is a pure function of `seed + epoch`, so
//!   seed and epoch are the complete random-generator position.
//!
//! Each file is written to a temporary name in the same directory, synced, and renamed, so a
//! crash never leaves a half-written checkpoint under the real name.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors, View};

use super::model::{Model, StateMut};
use super::optim::Adam;

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
}

/// Training progress stored next to the optimizer moments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TrainState {
    /// Completed epochs.
    pub epoch: u64,
    /// Optimizer steps taken.
    pub step: u64,
    /// Base seed (initialisation and shuffling).
    pub seed: u64,
    /// World size the run used (the data order depends on it).
    pub world_size: u64,
}

/// The optimizer file that goes with a model file.
pub fn optim_path(path: &Path) -> PathBuf {
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    path.with_file_name(format!("{stem}.optim.safetensors"))
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
    Raw { dtype: Dtype::F32, shape, bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect() }
}

fn write_atomic(path: &Path, tensors: &[(String, Raw)], meta: HashMap<String, String>) -> Result<(), CheckpointError> {
    let io = |source| CheckpointError::Io { path: path.to_path_buf(), source };
    let bytes = safetensors::serialize(tensors.iter().map(|(n, r)| (n.clone(), r)), Some(meta))
        .map_err(|e| CheckpointError::Format { path: path.to_path_buf(), msg: e.to_string() })?;
    let name = path.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp.{}", std::process::id()));
    let mut f = std::fs::File::create(&tmp).map_err(io)?;
    f.write_all(&bytes).and_then(|_| f.sync_all()).map_err(io)?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io(e)
    })
}

/// Save the model (PyTorch names) and the optimizer with the training state.
pub fn save(path: &Path, model: &mut Model, opt: &Adam, state: &TrainState) -> Result<(), CheckpointError> {
    let mut tensors: Vec<(String, Raw)> = Vec::new();
    for e in &model.entries {
        tensors.push((e.name.clone(), f32_raw(e.dims.clone(), &model.params[e.range.clone()])));
    }
    for s in model.state_mut() {
        match s {
            StateMut::F32(n, v) => {
                let len = v.len();
                tensors.push((n, f32_raw(vec![len], v)))
            }
            StateMut::I64(n, v) => tensors.push((n, Raw { dtype: Dtype::I64, shape: vec![], bytes: v.to_le_bytes().to_vec() })),
        }
    }
    let mut opt_tensors = Vec::new();
    for e in &model.entries {
        opt_tensors.push((format!("exp_avg.{}", e.name), f32_raw(e.dims.clone(), &opt.m[e.range.clone()])));
        opt_tensors.push((format!("exp_avg_sq.{}", e.name), f32_raw(e.dims.clone(), &opt.v[e.range.clone()])));
    }
    let meta: HashMap<String, String> = [
        ("step", state.step.to_string()),
        ("epoch", state.epoch.to_string()),
        ("seed", state.seed.to_string()),
        ("world_size", state.world_size.to_string()),
        ("lr", opt.lr.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    // Optimizer first: a crash between the two renames leaves a new optimizer file beside an old
    // model file, which `load` detects through the step count stored in both.
    write_atomic(&optim_path(path), &opt_tensors, meta.clone())?;
    let mut model_meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    model_meta.insert("step".into(), state.step.to_string());
    write_atomic(path, &tensors, model_meta)
}

fn read(path: &Path) -> Result<Vec<u8>, CheckpointError> {
    std::fs::read(path).map_err(|source| CheckpointError::Io { path: path.to_path_buf(), source })
}

fn read_f32(path: &Path, st: &SafeTensors, name: &str, dims: &[usize], dst: &mut [f32]) -> Result<(), CheckpointError> {
    let mm = |why: String| CheckpointError::Mismatch { path: path.to_path_buf(), name: name.to_string(), why };
    let t = st.tensor(name).map_err(|_| mm("missing".into()))?;
    if t.dtype() != Dtype::F32 || t.shape() != dims {
        return Err(mm(format!("expected f32 {dims:?}, found {:?} {:?}", t.dtype(), t.shape())));
    }
    for (d, c) in dst.iter_mut().zip(t.data().chunks_exact(4)) {
        *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
    Ok(())
}

fn meta_u64(path: &Path, meta: &HashMap<String, String>, key: &str) -> Result<u64, CheckpointError> {
    meta.get(key).and_then(|v| v.parse().ok()).ok_or_else(|| CheckpointError::Mismatch {
        path: path.to_path_buf(),
        name: format!("metadata {key}"),
        why: "missing or not a number".into(),
    })
}

/// Load the model weights and buffers from `path` (a PyTorch-named safetensors file).
pub fn load_model(path: &Path, model: &mut Model) -> Result<(), CheckpointError> {
    let bytes = read(path)?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| CheckpointError::Format { path: path.to_path_buf(), msg: e.to_string() })?;
    let entries = model.entries.clone();
    for e in &entries {
        read_f32(path, &st, &e.name, &e.dims, &mut model.params[e.range.clone()])?;
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
                    _ => return Err(CheckpointError::Mismatch { path: path.to_path_buf(), name: n, why: "expected one i64".into() }),
                }
            }
        }
    }
    Ok(())
}

/// Load model, optimizer moments and training state (for `--resume`).
pub fn load(path: &Path, model: &mut Model, opt: &mut Adam) -> Result<TrainState, CheckpointError> {
    load_model(path, model)?;
    let op = optim_path(path);
    let bytes = read(&op)?;
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|e| CheckpointError::Format { path: op.clone(), msg: e.to_string() })?;
    let meta = header.metadata().clone().unwrap_or_default();
    let st = SafeTensors::deserialize(&bytes).map_err(|e| CheckpointError::Format { path: op.clone(), msg: e.to_string() })?;
    for e in model.entries.clone() {
        read_f32(&op, &st, &format!("exp_avg.{}", e.name), &e.dims, &mut opt.m[e.range.clone()])?;
        read_f32(&op, &st, &format!("exp_avg_sq.{}", e.name), &e.dims, &mut opt.v[e.range.clone()])?;
    }
    let state = TrainState {
        epoch: meta_u64(&op, &meta, "epoch")?,
        step: meta_u64(&op, &meta, "step")?,
        seed: meta_u64(&op, &meta, "seed")?,
        world_size: meta_u64(&op, &meta, "world_size")?,
    };
    let model_bytes = read(path)?;
    if let Ok((_, mh)) = SafeTensors::read_metadata(&model_bytes) {
        let model_step = mh.metadata().as_ref().and_then(|m| m.get("step").cloned());
        if model_step.as_deref().is_some_and(|s| s != state.step.to_string()) {
            return Err(CheckpointError::Mismatch {
                path: path.to_path_buf(),
                name: "metadata step".into(),
                why: format!(
                    "model file is at step {}, optimizer file {} at step {}",
                    model_step.unwrap_or_default(),
                    op.display(),
                    state.step
                ),
            });
        }
    }
    opt.step = state.step;
    Ok(state)
}
