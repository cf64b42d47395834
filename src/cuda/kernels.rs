//! The kernel registry: one [`KernelId`] per `kernels/*.cu` file, its embedded source, the
//! signatures of its entry points (for the shape-checked launch builder) and the CPU twins.
//!
//! Sources are embedded by `build.rs` (no nvcc); they are compiled by NVRTC on first use and
//! cached per context and on disk (see `module.rs`).

use crate::comm::Dtype;

use super::module::{ArgKind, KernelSig};

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

/// One variant per `kernels/*.cu` file (a unit test checks none is missing).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelId {
    /// `kernels/elementwise.cu`: `fill_f32`, `scale_f32`, `axpy_f32`.
    Elementwise,
}

impl KernelId {
    /// Every kernel file.
    pub const ALL: &'static [KernelId] = &[KernelId::Elementwise];

    /// File name under `kernels/`.
    pub const fn file(self) -> &'static str {
        match self {
            KernelId::Elementwise => "elementwise.cu",
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

/// CPU twins of the kernels: same names, same argument order (STYLE item 8).
pub mod cpu {
    /// `out[i] = value` for `i < n`.
    pub fn fill_f32(out: &mut [f32], value: f32, n: i64) {
        out[..n as usize].iter_mut().for_each(|v| *v = value);
    }
    /// `x[i] *= alpha` for `i < n`.
    pub fn scale_f32(x: &mut [f32], alpha: f32, n: i64) {
        x[..n as usize].iter_mut().for_each(|v| *v *= alpha);
    }
    /// `y[i] += alpha * x[i]` for `i < n`.
    pub fn axpy_f32(y: &mut [f32], x: &[f32], alpha: f32, n: i64) {
        y[..n as usize].iter_mut().zip(x).for_each(|(y, x)| *y += alpha * x);
    }
}

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
                let needle = format!("void {}(", sig.name);
                assert!(k.source().contains(&needle), "{k}: no `extern \"C\" __global__ {needle}...` for its signature");
                let params = k.source().split(&needle).nth(1).unwrap().split(')').next().unwrap();
                assert_eq!(params.split(',').count(), sig.args.len(), "{k}::{}: parameter count differs from the signature", sig.name);
            }
        }
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
