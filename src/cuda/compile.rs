//! NVRTC compilation of a [`KernelSource`], with an on-disk cache of CUBIN images. No GPU needed.
//!
//! Compilation targets the device's own arch (`-arch=sm_XY`, CUBIN): PTX from an NVRTC newer than
//! the driver is refused with `CUDA_ERROR_UNSUPPORTED_PTX_VERSION`, CUBIN is not. The disk cache
//! (`$XDG_CACHE_HOME/lockstep` or `~/.cache/lockstep`) is keyed by a hash of the source, headers,
//! options and NVRTC version, plus the GPU arch and driver version.

use std::path::PathBuf;

use super::error::CudaError;
use super::nvrtc::{self, Output};
use super::source::{fnv1a, KernelSource};

/// Which NVRTC lockstep uses.
#[derive(Clone, Debug)]
pub struct NvrtcInfo {
    /// The library file.
    pub path: String,
    /// (major, minor).
    pub version: (i32, i32),
    /// Remarks from discovery (e.g. newer than the driver).
    pub notes: Vec<String>,
    /// Why discovery chose this NVRTC (and which others it found).
    pub reason: String,
    /// The `libnvrtc-builtins` preloaded for it.
    pub builtins: String,
}

impl NvrtcInfo {
    /// Load NVRTC (no GPU needed) and describe it.
    pub fn load() -> Result<NvrtcInfo, CudaError> {
        let n = nvrtc::api()?;
        Ok(NvrtcInfo {
            path: n.path.clone(),
            version: n.version,
            notes: n.notes.clone(),
            reason: n.reason.clone(),
            builtins: n.builtins.path.clone(),
        })
    }
}

/// Compile `src` to PTX for a virtual arch such as `compute_80` (no GPU needed).
pub fn compile_ptx(src: &KernelSource, arch: &str) -> Result<String, CudaError> {
    let n = nvrtc::api()?;
    let opts = vec![
        format!("--gpu-architecture={arch}"),
        "-default-device".to_string(),
    ];
    let ptx = n.compile(src.name, src.source, src.headers, &opts, Output::Ptx)?;
    Ok(String::from_utf8_lossy(&ptx)
        .trim_end_matches('\0')
        .to_string())
}

/// Extra NVRTC options from `LOCKSTEP_NVRTC_OPTIONS` (whitespace-separated, e.g.
/// `-DLOCKSTEP_NO_TF32` for exact f32 GEMMs in tests). Read once per process; the options take
/// part in the disk-cache key, so switching them never loads a stale image. A value that is not
/// UTF-8 is an error naming the variable (never silently no options).
pub fn extra_nvrtc_options() -> Result<Vec<String>, crate::types::env::EnvError> {
    static OPTS: std::sync::OnceLock<Result<Vec<String>, crate::types::env::EnvError>> =
        std::sync::OnceLock::new();
    OPTS.get_or_init(|| {
        Ok(crate::types::env::raw("LOCKSTEP_NVRTC_OPTIONS")?
            .unwrap_or_default()
            .split_whitespace()
            .map(str::to_string)
            .collect())
    })
    .clone()
}

/// The kernel cache folder.
pub fn cache_dir() -> PathBuf {
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(x).join("lockstep");
    }
    if let Some(h) = std::env::var_os("HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(h).join(".cache/lockstep");
    }
    std::env::temp_dir().join("lockstep-cache")
}

/// The cache file of `src` compiled with `opts` by NVRTC `nvrtc_version` for `cc` and driver
/// `driver_version`: the hash covers the text, the headers, the options and the NVRTC version.
fn cache_path(
    src: &KernelSource,
    opts: &[String],
    nvrtc_version: (i32, i32),
    cc: (i32, i32),
    driver_version: i32,
) -> PathBuf {
    let optstr = opts.join(" ");
    let nv = format!("{}.{}", nvrtc_version.0, nvrtc_version.1);
    let mut parts = src.content_parts();
    parts.push(optstr.as_bytes());
    parts.push(nv.as_bytes());
    let hash = fnv1a(&parts);
    let stem = src.name.trim_end_matches(".cu");
    cache_dir().join("kernels").join(format!(
        "{stem}-sm{}{}-drv{driver_version}-{hash:016x}.cubin",
        cc.0, cc.1
    ))
}

/// CUBIN for `src` on arch `sm_{major}{minor}`, from the disk cache or NVRTC. Returns the image
/// and whether it came from the cache.
pub fn compile_cubin_cached(
    src: &KernelSource,
    cc: (i32, i32),
    driver_version: i32,
) -> Result<(Vec<u8>, bool), CudaError> {
    let n = nvrtc::api()?;
    let mut opts = vec![
        format!("--gpu-architecture=sm_{}{}", cc.0, cc.1),
        "-default-device".to_string(),
    ];
    opts.extend(
        extra_nvrtc_options().map_err(|e| CudaError::InvalidArgument {
            op: "NVRTC options".into(),
            detail: e.to_string(),
        })?,
    );
    let path = cache_path(src, &opts, n.version, cc, driver_version);
    if let Ok(bytes) = std::fs::read(&path) {
        if !bytes.is_empty() {
            return Ok((bytes, true));
        }
    }
    let cubin = n.compile(src.name, src.source, src.headers, &opts, Output::Cubin)?;
    // A cache that cannot be written only costs a recompile next time: say so, and carry on.
    let stored = match path.parent() {
        Some(dir) => std::fs::create_dir_all(dir).map_err(|e| e.to_string()),
        None => Err("the cache path has no folder".into()),
    }
    .and_then(|()| crate::types::write_atomic(&path, &cubin, 0o644).map_err(|e| e.to_string()));
    if let Err(e) = stored {
        tracing::warn!(
            "kernel cache: could not store {}: {e}; {} will be compiled again next time",
            path.display(),
            src.name
        );
    }
    Ok((cubin, false))
}

#[cfg(test)]
mod tests {
    use super::*;

    static SRC: KernelSource = KernelSource {
        name: "t.cu",
        source: "x",
        headers: &[("h.cuh", "1")],
        functions: &[],
    };

    #[test]
    fn cache_key_covers_options_versions_and_arch() {
        let o = |s: &str| vec![s.to_string()];
        let base = cache_path(&SRC, &o("-a"), (12, 9), (8, 0), 12040);
        assert_eq!(base, cache_path(&SRC, &o("-a"), (12, 9), (8, 0), 12040));
        let name = base.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            name.starts_with("t-sm80-drv12040-") && name.ends_with(".cubin"),
            "{name}"
        );
        // Each input of the key changed alone: (what, source, options, NVRTC, arch, driver).
        let changed_header = KernelSource {
            headers: &[("h.cuh", "2")],
            ..SRC
        };
        let changed_source = KernelSource { source: "y", ..SRC };
        let cases = [
            ("options", &SRC, "-b", (12, 9), (8, 0), 12040),
            ("NVRTC version", &SRC, "-a", (13, 0), (8, 0), 12040),
            ("arch", &SRC, "-a", (12, 9), (9, 0), 12040),
            ("driver", &SRC, "-a", (12, 9), (8, 0), 13000),
            ("source text", &changed_source, "-a", (12, 9), (8, 0), 12040),
            ("header text", &changed_header, "-a", (12, 9), (8, 0), 12040),
        ];
        for (what, src, opts, nvrtc, arch, driver) in cases {
            assert_ne!(
                base,
                cache_path(src, &o(opts), nvrtc, arch, driver),
                "{what}"
            );
        }
    }
}
