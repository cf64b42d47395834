//! What a kernel file is to the CUDA layer: [`KernelSource`] (name, CUDA C++ text, in-memory
//! headers, entry-point signatures) and the launch-checking vocabulary [`KernelSig`] / [`ArgKind`].
//!
//! Nothing here knows which kernels exist: callers describe their own sources (lockstep's training
//! kernels are registered in `lockstep_train::device::kernels`) and the compile cache, the modules and the
//! launch builder work from the description.

use crate::comm::Dtype;

/// Kind of one kernel parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgKind {
    /// `const T*` (read-only device buffer).
    Ptr(Dtype),
    /// `T*` (written device buffer).
    PtrMut(Dtype),
    /// A scalar passed by value.
    Scalar(Dtype),
}

/// An entry point and its parameters, mirrored from the `.cu` file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelSig {
    /// `extern "C"` name.
    pub name: &'static str,
    /// Parameters in order.
    pub args: &'static [ArgKind],
}

/// One CUDA C++ translation unit, compiled by NVRTC at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelSource {
    /// File name (`conv2d.cu`): NVRTC's program name (it appears in compile errors) and the stem
    /// of the disk-cache entry.
    pub name: &'static str,
    /// The CUDA C++ text.
    pub source: &'static str,
    /// Headers it `#include`s, as `(include name, text)`, handed to NVRTC in memory.
    pub headers: &'static [(&'static str, &'static str)],
    /// Its `extern "C"` entry points, with the parameters the launch builder checks against.
    pub functions: &'static [KernelSig],
}

impl KernelSource {
    /// The signature of entry point `name`.
    pub fn signature(&self, name: &str) -> Option<&'static KernelSig> {
        self.functions.iter().find(|s| s.name == name)
    }

    /// A hash of the text and headers (names and contents): two descriptions with the same hash
    /// compile to the same module.
    pub fn content_hash(&self) -> u64 {
        fnv1a(&self.content_parts())
    }

    /// The text, then each header's name and text: the bytes a compiled image depends on besides
    /// the options.
    pub(crate) fn content_parts(&self) -> Vec<&'static [u8]> {
        let mut parts: Vec<&'static [u8]> = vec![self.source.as_bytes()];
        for (name, src) in self.headers {
            parts.push(name.as_bytes());
            parts.push(src.as_bytes());
        }
        parts
    }
}

impl std::fmt::Display for KernelSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

/// 64-bit FNV-1a over `parts`, each followed by a separator byte (stable across Rust versions,
/// unlike `DefaultHasher`, so it can name files in the disk cache).
pub(crate) fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for p in parts {
        for b in p.iter().chain(&[0xffu8]) {
            h ^= *b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIGS: &[KernelSig] = &[KernelSig {
        name: "k",
        args: &[ArgKind::PtrMut(Dtype::F32), ArgKind::Scalar(Dtype::I32)],
    }];

    fn src(text: &'static str, headers: &'static [(&'static str, &'static str)]) -> KernelSource {
        KernelSource {
            name: "t.cu",
            source: text,
            headers,
            functions: SIGS,
        }
    }

    #[test]
    fn fnv_is_stable_and_separates_parts() {
        assert_eq!(fnv1a(&[b"a"]), fnv1a(&[b"a"]));
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
        // The published FNV-1a value of "a" is 0xaf63dc4c8601ec8c; the separator byte follows it.
        let mut h = 0xaf63dc4c8601ec8cu64 ^ 0xff;
        h = h.wrapping_mul(0x100000001b3);
        assert_eq!(fnv1a(&[b"a"]), h);
    }

    #[test]
    fn content_hash_covers_text_and_headers() {
        let base = src("x", &[("h.cuh", "1")]).content_hash();
        assert_eq!(base, src("x", &[("h.cuh", "1")]).content_hash());
        assert_ne!(
            base,
            src("y", &[("h.cuh", "1")]).content_hash(),
            "source text"
        );
        assert_ne!(
            base,
            src("x", &[("h.cuh", "2")]).content_hash(),
            "header text"
        );
        assert_ne!(
            base,
            src("x", &[("g.cuh", "1")]).content_hash(),
            "header name"
        );
        assert_ne!(base, src("x", &[]).content_hash(), "header count");
    }

    #[test]
    fn signature_lookup() {
        let s = src("x", &[]);
        assert_eq!(s.signature("k").map(|k| k.args.len()), Some(2));
        assert!(s.signature("nope").is_none());
        assert_eq!(s.to_string(), "t.cu");
    }
}
