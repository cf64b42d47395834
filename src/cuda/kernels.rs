//! The kernel registry: one [`KernelId`] per `kernels/*.cu` file, its embedded source, the
//! signatures of its entry points (for the shape-checked launch builder) and the CPU twins.
//!
//! Sources are embedded by `build.rs` (no nvcc); they are compiled by NVRTC on first use and
//! cached per context and on disk (see `module.rs`).

use crate::comm::Dtype;

use super::module::{ArgKind, KernelSig};

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

/// Rust twin of `struct BucketEntry` in `kernels/data.cu`: one tensor of a gradient bucket for
/// `bucket_flatten_f32` / `bucket_unflatten_f32` (24 bytes; offsets and lengths in f32 elements).
/// The kernel signature passes the table as `i64` triplets ([`BucketEntry::to_words`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BucketEntry {
    /// The tensor's device address (`CUdeviceptr`).
    pub ptr: u64,
    /// Offset of the tensor in the bucket.
    pub offset: i64,
    /// Elements of the tensor.
    pub len: i64,
}

impl BucketEntry {
    /// The three 8-byte words of the table entry, as uploaded.
    pub fn to_words(self) -> [i64; 3] {
        [self.ptr as i64, self.offset, self.len]
    }
}

/// One variant per `kernels/*.cu` file (a unit test checks none is missing).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelId {
    /// `kernels/activation.cu`: `relu_forward_f32`, `relu_backward_f32`.
    Activation,
    /// `kernels/batchnorm.cu`: `batchnorm2d_forward_train_f32`, `batchnorm2d_forward_eval_f32`, `batchnorm2d_backward_f32`.
    Batchnorm,
    /// `kernels/conv2d.cu`: `conv2d_forward_f32`, `conv2d_forward_bf16`, `conv2d_backward_input_f32`, `conv2d_backward_input_bf16`, `conv2d_backward_weight_f32`, `conv2d_backward_weight_bf16`, `conv2d_backward_bias_f32`, `conv2d_backward_bias_bf16`.
    Conv2d,
    /// `kernels/data.cu`: `gather_batch_f32`, `bucket_flatten_f32`, `bucket_unflatten_f32`, `cast_f32_bf16`, `cast_bf16_f32`.
    Data,
    /// `kernels/elementwise.cu`: `fill_f32`, `scale_f32`, `axpy_f32`.
    Elementwise,
    /// `kernels/linear.cu`: `linear_forward_f32`, `linear_forward_bf16`, `linear_backward_input_f32`, `linear_backward_input_bf16`, `linear_backward_weight_f32`, `linear_backward_weight_bf16`, `linear_backward_bias_f32`, `linear_backward_bias_bf16`.
    Linear,
    /// `kernels/loss.cu`: `softmax_xent_forward_f32`, `softmax_xent_backward_f32`.
    Loss,
    /// `kernels/optim.cu`: `adam_step_f32`, `sgd_step_f32`.
    Optim,
    /// `kernels/pool.cu`: `maxpool2d_forward_f32`, `maxpool2d_backward_f32`.
    Pool,
}

impl KernelId {
    /// Every kernel file.
    pub const ALL: &'static [KernelId] = &[
        KernelId::Activation,
        KernelId::Batchnorm,
        KernelId::Conv2d,
        KernelId::Data,
        KernelId::Elementwise,
        KernelId::Linear,
        KernelId::Loss,
        KernelId::Optim,
        KernelId::Pool,
    ];

    /// File name under `kernels/`.
    pub const fn file(self) -> &'static str {
        match self {
            KernelId::Activation => "activation.cu",
            KernelId::Batchnorm => "batchnorm.cu",
            KernelId::Conv2d => "conv2d.cu",
            KernelId::Data => "data.cu",
            KernelId::Elementwise => "elementwise.cu",
            KernelId::Linear => "linear.cu",
            KernelId::Loss => "loss.cu",
            KernelId::Optim => "optim.cu",
            KernelId::Pool => "pool.cu",
        }
    }

    /// The embedded source.
    pub fn source(self) -> &'static str {
        KERNEL_SOURCES.iter().find(|(f, _)| *f == self.file()).map(|(_, s)| *s).unwrap_or("")
    }

    /// The shared headers, as NVRTC in-memory headers.
    pub fn headers() -> &'static [(&'static str, &'static str)] {
        KERNEL_HEADERS
    }

    /// The `extern "C"` entry points and their parameter kinds, in order.
    pub const fn functions(self) -> &'static [KernelSig] {
        match self {
            KernelId::Activation => &[
                KernelSig {
                    name: "relu_forward_f32",
                    args: &[ArgKind::PtrMut(Dtype::F32), ArgKind::Ptr(Dtype::F32), ArgKind::Scalar(Dtype::I32)],
                },
                KernelSig {
                    name: "relu_backward_f32",
                    args: &[ArgKind::PtrMut(Dtype::F32), ArgKind::Ptr(Dtype::F32), ArgKind::Ptr(Dtype::F32), ArgKind::Scalar(Dtype::I32)],
                },
            ],
            KernelId::Batchnorm => &[
                KernelSig {
                    name: "batchnorm2d_forward_train_f32",
                    args: &[
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::F32),
                        ArgKind::Scalar(Dtype::F32),
                        ArgKind::Scalar(Dtype::I32),
                    ],
                },
                KernelSig {
                    name: "batchnorm2d_forward_eval_f32",
                    args: &[
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::F32),
                        ArgKind::Scalar(Dtype::I32),
                    ],
                },
                KernelSig {
                    name: "batchnorm2d_backward_f32",
                    args: &[
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                    ],
                },
            ],
            KernelId::Conv2d => &[
                KernelSig {
                    name: "conv2d_forward_f32",
                    args: &[
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                    ],
                },
                KernelSig {
                    name: "conv2d_forward_bf16",
                    args: &[
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::Ptr(Dtype::BF16),
                        ArgKind::Ptr(Dtype::BF16),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                    ],
                },
                KernelSig {
                    name: "conv2d_backward_input_f32",
                    args: &[
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                    ],
                },
                KernelSig {
                    name: "conv2d_backward_input_bf16",
                    args: &[
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::Ptr(Dtype::BF16),
                        ArgKind::Ptr(Dtype::BF16),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                    ],
                },
                KernelSig {
                    name: "conv2d_backward_weight_f32",
                    args: &[
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                    ],
                },
                KernelSig {
                    name: "conv2d_backward_weight_bf16",
                    args: &[
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::Ptr(Dtype::BF16),
                        ArgKind::Ptr(Dtype::BF16),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                    ],
                },
                KernelSig {
                    name: "conv2d_backward_bias_f32",
                    args: &[
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                    ],
                },
                KernelSig {
                    name: "conv2d_backward_bias_bf16",
                    args: &[
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::Ptr(Dtype::BF16),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                    ],
                },
            ],
            KernelId::Data => &[
                KernelSig {
                    name: "gather_batch_f32",
                    args: &[
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::PtrMut(Dtype::I32),
                        ArgKind::Ptr(Dtype::U8),
                        ArgKind::Ptr(Dtype::U8),
                        ArgKind::Ptr(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                    ],
                },
                KernelSig {
                    name: "bucket_flatten_f32",
                    args: &[ArgKind::PtrMut(Dtype::F32), ArgKind::Ptr(Dtype::I64), ArgKind::Scalar(Dtype::I32)],
                },
                KernelSig {
                    name: "bucket_unflatten_f32",
                    args: &[ArgKind::Ptr(Dtype::I64), ArgKind::Ptr(Dtype::F32), ArgKind::Scalar(Dtype::I32), ArgKind::Scalar(Dtype::F32)],
                },
                KernelSig {
                    name: "cast_f32_bf16",
                    args: &[ArgKind::PtrMut(Dtype::BF16), ArgKind::Ptr(Dtype::F32), ArgKind::Scalar(Dtype::I32)],
                },
                KernelSig {
                    name: "cast_bf16_f32",
                    args: &[ArgKind::PtrMut(Dtype::F32), ArgKind::Ptr(Dtype::BF16), ArgKind::Scalar(Dtype::I32)],
                },
            ],
            KernelId::Elementwise => &[
                KernelSig {
                    name: "fill_f32",
                    args: &[ArgKind::PtrMut(Dtype::F32), ArgKind::Scalar(Dtype::F32), ArgKind::Scalar(Dtype::I64)],
                },
                KernelSig {
                    name: "scale_f32",
                    args: &[ArgKind::PtrMut(Dtype::F32), ArgKind::Scalar(Dtype::F32), ArgKind::Scalar(Dtype::I64)],
                },
                KernelSig {
                    name: "axpy_f32",
                    args: &[
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Scalar(Dtype::F32),
                        ArgKind::Scalar(Dtype::I64),
                    ],
                },
            ],
            KernelId::Linear => &[
                KernelSig {
                    name: "linear_forward_f32",
                    args: &[
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                    ],
                },
                KernelSig {
                    name: "linear_forward_bf16",
                    args: &[
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::Ptr(Dtype::BF16),
                        ArgKind::Ptr(Dtype::BF16),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                    ],
                },
                KernelSig {
                    name: "linear_backward_input_f32",
                    args: &[
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                    ],
                },
                KernelSig {
                    name: "linear_backward_input_bf16",
                    args: &[
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::Ptr(Dtype::BF16),
                        ArgKind::Ptr(Dtype::BF16),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                    ],
                },
                KernelSig {
                    name: "linear_backward_weight_f32",
                    args: &[
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                    ],
                },
                KernelSig {
                    name: "linear_backward_weight_bf16",
                    args: &[
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::Ptr(Dtype::BF16),
                        ArgKind::Ptr(Dtype::BF16),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                    ],
                },
                KernelSig {
                    name: "linear_backward_bias_f32",
                    args: &[
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                    ],
                },
                KernelSig {
                    name: "linear_backward_bias_bf16",
                    args: &[
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::Ptr(Dtype::BF16),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                    ],
                },
            ],
            KernelId::Loss => &[
                KernelSig {
                    name: "softmax_xent_forward_f32",
                    args: &[
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::PtrMut(Dtype::I32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Ptr(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                    ],
                },
                KernelSig {
                    name: "softmax_xent_backward_f32",
                    args: &[
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Ptr(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                    ],
                },
            ],
            KernelId::Optim => &[
                KernelSig {
                    name: "adam_step_f32",
                    args: &[
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::F32),
                        ArgKind::Scalar(Dtype::F32),
                        ArgKind::Scalar(Dtype::F32),
                        ArgKind::Scalar(Dtype::F32),
                        ArgKind::Scalar(Dtype::F32),
                        ArgKind::Scalar(Dtype::I32),
                    ],
                },
                KernelSig {
                    name: "sgd_step_f32",
                    args: &[
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::F32),
                        ArgKind::Scalar(Dtype::F32),
                        ArgKind::Scalar(Dtype::F32),
                        ArgKind::Scalar(Dtype::F32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                    ],
                },
            ],
            KernelId::Pool => &[
                KernelSig {
                    name: "maxpool2d_forward_f32",
                    args: &[
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::PtrMut(Dtype::I32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                    ],
                },
                KernelSig {
                    name: "maxpool2d_backward_f32",
                    args: &[
                        ArgKind::PtrMut(Dtype::F32),
                        ArgKind::Ptr(Dtype::F32),
                        ArgKind::Ptr(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                        ArgKind::Scalar(Dtype::I32),
                    ],
                },
            ],
        }
    }

    /// The signature of entry point `name`.
    pub fn signature(self, name: &str) -> Option<&'static KernelSig> {
        self.functions().iter().find(|s| s.name == name)
    }
}

impl std::fmt::Display for KernelId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.file())
    }
}

/// CPU twins of every kernel: same names, same argument order (STYLE item 8), in `twins.rs`.
#[path = "twins.rs"]
pub mod cpu;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_file_has_a_variant() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
        let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".cu"))
            .collect();
        on_disk.sort();
        let mut registered: Vec<String> = KernelId::ALL.iter().map(|k| k.file().to_string()).collect();
        registered.sort();
        assert_eq!(on_disk, registered, "kernels/*.cu and KernelId::ALL differ: add a variant per file");
        let mut embedded: Vec<String> = KERNEL_SOURCES.iter().map(|(f, _)| f.to_string()).collect();
        embedded.sort();
        assert_eq!(embedded, registered, "build.rs table is stale");
    }

    #[test]
    fn every_signature_names_an_entry_point_in_the_source() {
        for k in KernelId::ALL {
            assert!(!k.source().is_empty(), "{k} has no embedded source");
            for sig in k.functions() {
                // The name follows `void` or `__launch_bounds__(...)` after whitespace.
                let needle = format!("{}(", sig.name);
                let at = k
                    .source()
                    .match_indices(&needle)
                    .map(|(i, _)| i)
                    .find(|&i| i > 0 && k.source().as_bytes()[i - 1].is_ascii_whitespace());
                let at = at.unwrap_or_else(|| panic!("{k}: no `extern \"C\" __global__ void {needle}...` for its signature"));
                let params = k.source()[at + needle.len()..].split(')').next().unwrap();
                assert_eq!(params.split(',').count(), sig.args.len(), "{k}::{}: parameter count differs from the signature", sig.name);
            }
        }
    }

    #[test]
    fn every_entry_point_has_a_cpu_twin() {
        let mut declared: Vec<&str> = KernelId::ALL.iter().flat_map(|k| k.functions().iter().map(|s| s.name)).collect();
        let mut twins = cpu::TWINS.to_vec();
        declared.sort_unstable();
        twins.sort_unstable();
        assert_eq!(declared, twins, "every kernel entry point needs a CPU twin in src/cuda/twins.rs (and a TWINS entry)");
    }

    #[test]
    fn cpu_twins() {
        let mut y = vec![1.0f32; 4];
        cpu::axpy_f32(&mut y, &[1.0, 2.0, 3.0, 4.0], 2.0, 4);
        assert_eq!(y, vec![3.0, 5.0, 7.0, 9.0]);
        cpu::scale_f32(&mut y, 0.5, 2);
        assert_eq!(y, vec![1.5, 2.5, 7.0, 9.0]);
        cpu::fill_f32(&mut y, 0.0, 4);
        assert_eq!(y, vec![0.0; 4]);
    }
}
