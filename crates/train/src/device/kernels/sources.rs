//! The embedded `kernels/*.cu` and `kernels/*.cuh`, each `.cu` as a [`KernelSource`] whose
//! signature table `build.rs` parsed from the file's `extern "C" __global__` declarations (so it
//! cannot drift from the source: a changed declaration changes the table, or fails the build).

use lockstep::comm::Dtype;
use lockstep::cuda::{ArgKind, KernelSig, KernelSource};

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
