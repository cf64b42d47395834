//! [`DeviceError`]: what can go wrong in device training.

use crate::model::ModelError;
use lockstep::comm::CommError;
use lockstep::cuda::CudaError;

/// Errors of device training, each saying what to do.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// A CUDA call failed.
    #[error("CUDA: {0}; check `lockstep env` and nvidia-smi, or train with --device cpu")]
    Cuda(#[from] CudaError),
    /// A collective failed.
    #[error("collective failed: {0}")]
    Comm(#[from] CommError),
    /// The model could not be built.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The configuration cannot run on the device engine.
    #[error("invalid device training configuration: {0}")]
    Config(String),
    /// The executor cannot run this operation.
    #[error("unsupported on this executor: {0}")]
    Unsupported(String),
    /// The model has a layer (or shape) the device engine has no kernels for.
    #[error(
        "the device engine cannot run layer {layer}: {why}; train this model with --device cpu"
    )]
    UnsupportedModel {
        /// The layer's name (and kind).
        layer: String,
        /// What is missing.
        why: String,
    },
    /// A step clipped with `--clip-grad-norm` found a gradient norm that is not finite.
    #[error("the gradient norm is not finite at optimizer step {step}: training diverged; lower --lr (or the clipping threshold), or check the data")]
    NonFiniteGradNorm {
        /// The first such optimizer step (1-based).
        step: u64,
    },
    /// Writing a checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
}

/// The shared epoch loop's errors (`trainer::epoch`: resume, the model, checkpoints) in the
/// device engine's terms.
impl From<crate::trainer::TrainError> for DeviceError {
    fn from(e: crate::trainer::TrainError) -> DeviceError {
        use crate::trainer::TrainError;
        match e {
            TrainError::Comm(e) => DeviceError::Comm(e),
            TrainError::Model(e) => DeviceError::Model(e),
            TrainError::Checkpoint(e) => DeviceError::Checkpoint(e),
            TrainError::Config(m) => DeviceError::Config(m),
            TrainError::NonFinite { step, .. } => DeviceError::NonFiniteGradNorm { step },
        }
    }
}
