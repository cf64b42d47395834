//! The format of a checkpoint's two files: safetensors with PyTorch `state_dict` names (the model
//! file) and Adam's moments with the training state in the metadata (the optimizer file), both
//! stamped with the save's id; encoding and decoding, nothing about files or directories.

use std::collections::HashMap;
use std::path::Path;
use std::str::FromStr;

use safetensors::{Dtype, SafeTensors, View};

use super::super::model::{Model, StateMut};
use super::super::precision::ScalerState;
use super::error::CheckpointError;
use super::layout::optim_path;
use crate::ops::optim::Adam;

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
pub(super) const SCALER_KEYS: [&str; 6] = [
    "loss_scale",
    "loss_scale_growth_factor",
    "loss_scale_backoff_factor",
    "loss_scale_growth_interval",
    "loss_scale_growth_tracker",
    "loss_scale_skipped",
];

pub(super) struct Raw {
    pub(super) dtype: Dtype,
    pub(super) shape: Vec<usize>,
    pub(super) bytes: Vec<u8>,
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

pub(super) fn serialize(
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
pub(super) fn encode(
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

pub(super) fn file_meta(
    path: &Path,
    bytes: &[u8],
) -> Result<HashMap<String, String>, CheckpointError> {
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(|e| CheckpointError::Format {
        path: path.to_path_buf(),
        msg: e.to_string(),
    })?;
    Ok(header.metadata().clone().unwrap_or_default())
}

/// What ties a model file to its optimizer file: the save id, or for files written before save
/// ids existed, the step.
pub(super) fn pair_key(meta: &HashMap<String, String>) -> Option<(&'static str, &str)> {
    match (meta.get("save_id"), meta.get("step")) {
        (Some(id), _) => Some(("save id", id.as_str())),
        (None, Some(step)) => Some(("step", step.as_str())),
        (None, None) => None,
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
    meta_num(path, meta, key, "missing or not a number")
}

/// The number under `key` in `meta`; `why` is the message when it is missing or does not parse.
fn meta_num<T: FromStr>(
    path: &Path,
    meta: &HashMap<String, String>,
    key: &str,
    why: &str,
) -> Result<T, CheckpointError> {
    meta.get(key)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| CheckpointError::Mismatch {
            path: path.to_path_buf(),
            name: format!("metadata {key}"),
            why: why.into(),
        })
}

/// What a missing or malformed loss-scaler key says.
const SCALER_WHY: &str = "missing or not a number (the loss scaler's keys come together)";

/// The loss scaler's state in an optimizer file's metadata, if it holds one.
fn scaler_state(
    path: &Path,
    meta: &HashMap<String, String>,
) -> Result<Option<ScalerState>, CheckpointError> {
    if !meta.contains_key(SCALER_KEYS[0]) {
        return Ok(None);
    }
    let st = ScalerState {
        scale: meta_num(path, meta, SCALER_KEYS[0], SCALER_WHY)?,
        growth_factor: meta_num(path, meta, SCALER_KEYS[1], SCALER_WHY)?,
        backoff_factor: meta_num(path, meta, SCALER_KEYS[2], SCALER_WHY)?,
        growth_interval: meta_num(path, meta, SCALER_KEYS[3], SCALER_WHY)?,
        good_steps: meta_num(path, meta, SCALER_KEYS[4], SCALER_WHY)?,
        skipped: meta_num(path, meta, SCALER_KEYS[5], SCALER_WHY)?,
    };
    // Checked here, so a resume passes over a damaged file as over any other.
    super::super::precision::LossScaler::from_state(st).map_err(|e| CheckpointError::Mismatch {
        path: path.to_path_buf(),
        name: "metadata loss_scale".into(),
        why: e.to_string(),
    })?;
    Ok(Some(st))
}

pub(super) fn load_model_bytes(
    path: &Path,
    bytes: &[u8],
    model: &mut Model,
) -> Result<(), CheckpointError> {
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

pub(super) fn load_optim_bytes(
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
        for (moment, buf) in [("exp_avg", &mut opt.m), ("exp_avg_sq", &mut opt.v)] {
            let name = format!("{moment}.{}", e.name);
            read_f32(path, &st, &name, &e.dims, &mut buf[e.range.clone()])?;
        }
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

/// What the in-memory form of a state is called in its errors.
const IN_MEMORY: &str = "<state received from a peer>";

/// The bytes of the two files of a checkpoint of `model`, `opt` and `state`, without any file:
/// in-job recovery sends them to a replacement rank ([`decode_state`] reads them), so what it
/// sends is exactly what a checkpoint holds.
pub fn encode_state(
    model: &mut Model,
    opt: &Adam,
    state: &TrainState,
) -> Result<(Vec<u8>, Vec<u8>), CheckpointError> {
    encode(Path::new(IN_MEMORY), model, opt, state, "in-memory")
}

/// Load the bytes [`encode_state`] made into `model` and `opt`; returns the training state.
pub fn decode_state(
    model_bytes: &[u8],
    optim_bytes: &[u8],
    model: &mut Model,
    opt: &mut Adam,
) -> Result<TrainState, CheckpointError> {
    let path = Path::new(IN_MEMORY);
    load_model_bytes(path, model_bytes, model)?;
    load_optim_bytes(path, optim_bytes, model, opt)
}
