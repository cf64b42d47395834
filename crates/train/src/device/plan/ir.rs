//! The step as data: tensors are [`Region`]s of a few flat [`Arena`]s, and one kernel launch is
//! an [`Op`] (entry point, arguments in the kernel's order, geometry). A plan is a `Vec<Op>`,
//! built once per batch size by the schedule (`schedule.rs`) through the launch builder
//! (`builder.rs`) and run by an executor (the GPU one launches it and captures it in a CUDA graph;
//! the CPU one calls the kernels' twins, so the whole device step is checked on machines without
//! a GPU).

use crate::device::kernels::KernelId;
use lockstep::comm::Dtype;
use lockstep::cuda::{ArgKind, KernelGrid};

/// Which flat allocation a region lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arena {
    /// Parameters, gradients, optimizer state, activations (f32).
    F32,
    /// Labels, sample indices, pooling argmax, correct counts (i32).
    I32,
    /// bf16 copies of parameters, activations and gradients (`--precision bf16`).
    Bf16,
    /// IEEE fp16 copies of parameters, activations and gradients (`--precision fp16`).
    F16,
    /// The dataset's pixels, train split then test split (u8).
    Images,
    /// The dataset's labels, same order (u8).
    Labels,
}

impl Arena {
    /// Element type of the arena.
    pub fn dtype(self) -> Dtype {
        match self {
            Arena::F32 => Dtype::F32,
            Arena::I32 => Dtype::I32,
            Arena::Bf16 => Dtype::BF16,
            Arena::F16 => Dtype::F16,
            Arena::Images | Arena::Labels => Dtype::U8,
        }
    }
}

/// A contiguous range of one arena, in elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// The arena.
    pub arena: Arena,
    /// First element.
    pub off: usize,
    /// Elements.
    pub len: usize,
}

impl Region {
    /// The element range.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.off..self.off + self.len
    }
    /// The first `len` elements (a smaller batch in a buffer sized for the largest).
    pub fn prefix(&self, len: usize) -> Region {
        assert!(len <= self.len, "prefix {len} of a region of {}", self.len);
        Region { len, ..*self }
    }
    /// Elements `off..off + len` of this region.
    pub fn sub(&self, off: usize, len: usize) -> Region {
        assert!(
            off + len <= self.len,
            "sub {off}+{len} of a region of {}",
            self.len
        );
        Region {
            arena: self.arena,
            off: self.off + off,
            len,
        }
    }
}

/// One kernel argument.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arg {
    /// A `const T*` argument.
    In(Region),
    /// A `T*` argument (written).
    Out(Region),
    /// An `int`.
    I32(i32),
    /// A `float`.
    F32(f32),
    /// A `long long`.
    I64(i64),
}

impl Arg {
    /// The parameter kind this argument passes.
    pub fn kind(&self) -> ArgKind {
        match self {
            Arg::In(r) => ArgKind::Ptr(r.arena.dtype()),
            Arg::Out(r) => ArgKind::PtrMut(r.arena.dtype()),
            Arg::I32(_) => ArgKind::Scalar(Dtype::I32),
            Arg::F32(_) => ArgKind::Scalar(Dtype::F32),
            Arg::I64(_) => ArgKind::Scalar(Dtype::I64),
        }
    }
}

/// One kernel launch: entry point, arguments in the kernel's order, geometry.
#[derive(Clone, Debug, PartialEq)]
pub struct Op {
    /// Kernel file.
    pub kernel: KernelId,
    /// Entry point (also the CPU twin's name).
    pub name: &'static str,
    /// Arguments, in order.
    pub args: Vec<Arg>,
    /// Grid and block.
    pub cfg: KernelGrid,
}

impl Op {
    /// Check the arguments against the registry's signature (count and kinds): the same check
    /// the launch builder makes on a GPU, available without one.
    pub fn check_signature(&self) -> Result<(), String> {
        let sig = self
            .kernel
            .signature(self.name)
            .ok_or_else(|| format!("{} declares no entry point {}", self.kernel, self.name))?;
        let got: Vec<ArgKind> = self.args.iter().map(Arg::kind).collect();
        if got != sig.args {
            return Err(format!(
                "{}: arguments {got:?} do not match the signature {:?}",
                self.name, sig.args
            ));
        }
        Ok(())
    }
}

/// Compute precision of the GEMM layers (conv, linear).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Precision {
    /// f32 everywhere (TF32 tensor cores on sm_80+ unless built with `-DLOCKSTEP_NO_TF32`).
    #[default]
    Fp32,
    /// bf16 operands for conv/linear (`_bf16` kernels, f32 accumulation); f32 master weights,
    /// optimizer state, BatchNorm and loss.
    Bf16,
    /// IEEE fp16 operands for conv/linear (`_f16` kernels, f32 accumulation), f32 master weights
    /// as for bf16, plus dynamic loss scaling: the loss gradient is multiplied by the scale, the
    /// averaged gradients are unscaled and checked for inf/NaN, and an overflowing step is
    /// skipped (`Engine::train_step`, `precision::LossScaler`).
    Fp16,
}

impl Precision {
    /// The arena of the 16-bit operand copies (`None` in fp32).
    pub fn half_arena(self) -> Option<Arena> {
        match self {
            Precision::Fp32 => None,
            Precision::Bf16 => Some(Arena::Bf16),
            Precision::Fp16 => Some(Arena::F16),
        }
    }

    /// Whether the step scales the loss (fp16 only).
    pub fn scales_loss(self) -> bool {
        self == Precision::Fp16
    }
}

impl From<lockstep::config::MixedPrecision> for Precision {
    /// The GEMM precision of a run's `mixed_precision` request (every request runs on CUDA).
    fn from(request: lockstep::config::MixedPrecision) -> Precision {
        use lockstep::config::MixedPrecision as M;
        match request {
            M::No => Precision::Fp32,
            M::Bf16 => Precision::Bf16,
            M::Fp16 => Precision::Fp16,
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Precision, String> {
        match s {
            "fp32" | "f32" => Ok(Precision::Fp32),
            "bf16" => Ok(Precision::Bf16),
            "fp16" | "f16" => Ok(Precision::Fp16),
            _ => Err(format!("unknown precision {s:?}: use fp32, bf16 or fp16")),
        }
    }
}

pub use crate::ops::optim::AdamHyper;

// ------------------------------------------------------------------------------------------------
// region groups the kernels take together

/// Saved statistics and running estimates of one BatchNorm layer (each `(C)`).
#[derive(Clone, Copy, Debug)]
pub struct BnTensors {
    /// Batch mean saved for backward.
    pub mean: Region,
    /// Batch 1/std saved for backward.
    pub invstd: Region,
    /// Running mean.
    pub running_mean: Region,
    /// Running (unbiased) variance.
    pub running_var: Region,
}

/// Loss outputs.
#[derive(Clone, Copy, Debug)]
pub struct LossTensors {
    /// Per-sample loss `(B)`.
    pub losses: Region,
    /// Softmax `(B, 10)`.
    pub probs: Region,
    /// Mean loss of the batch `(1)`.
    pub mean_loss: Region,
    /// Σ over steps of batch * mean loss `(1)`, read back every few steps.
    pub loss_sum: Region,
    /// Correct predictions of the batch `(1)`, i32.
    pub correct: Region,
}

/// Dynamic loss scaling's device state (fp16; both regions empty otherwise).
#[derive(Clone, Copy, Debug)]
pub struct AmpTensors {
    /// The current loss scale `(1)`: read by the scaled loss backward inside the captured step
    /// and by the unscale after the all-reduce, written by the host when the scaler changes it.
    pub scale: Region,
    /// 1.0 when the last unscaled gradients held an inf or NaN, else 0.0 `(1)`; zeroed in the
    /// captured step, read back by the host after the unscale.
    pub found_inf: Region,
}

/// Gradient-norm clipping's device state (`--clip-grad-norm`; laid out in every precision, a
/// few hundred floats). The coefficient never leaves the device, so clipping adds no read-back.
#[derive(Clone, Copy, Debug)]
pub struct ClipTensors {
    /// Partial norms, one per block of `grad_norm_partials_f32` (`CLIP_PARTIALS`).
    pub partials: Region,
    /// The clipping coefficient `(1)`, 1 when the norm is within the threshold.
    pub coef: Region,
    /// The global gradient norm of the last clipped step `(1)`.
    pub norm: Region,
    /// The first optimizer step whose gradient norm was not finite, 0 if none `(1)`, i32.
    pub nonfinite_step: Region,
}

/// Where one parameter tensor of the model lives (same offsets in params, grads, m, v and the
/// 16-bit copy).
#[derive(Clone, Copy, Debug)]
pub struct ParamAt {
    /// Offset in the flat vectors.
    pub off: usize,
    /// Elements.
    pub len: usize,
}
