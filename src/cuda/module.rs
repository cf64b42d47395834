//! Kernel modules: NVRTC compilation with an on-disk cache, loaded modules, functions and the
//! shape-checked launch builder.
//!
//! Compilation targets the device's own arch (`-arch=sm_XY`, CUBIN): PTX from an NVRTC newer than
//! the driver is refused with `CUDA_ERROR_UNSUPPORTED_PTX_VERSION`, CUBIN is not. The disk cache
//! (`$XDG_CACHE_HOME/lockstep` or `~/.cache/lockstep`) is keyed by a hash of the source, headers,
//! options and NVRTC version, plus the GPU arch and driver version.

use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::{Arc, Weak};

use crate::comm::{Buffer, BufferMut, Dtype, Element, MemSpace};

use super::context::{Context, Stream};
use super::driver::{self, CUcontext, CUfunction, CUmodule};
use super::error::CudaError;
use super::kernels::KernelId;
use super::nvrtc::{self, Output};

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
#[derive(Clone, Copy, Debug)]
pub struct KernelSig {
    /// `extern "C"` name.
    pub name: &'static str,
    /// Parameters in order.
    pub args: &'static [ArgKind],
}

/// Which NVRTC lockstep uses.
#[derive(Clone, Debug)]
pub struct NvrtcInfo {
    /// The library file.
    pub path: String,
    /// (major, minor).
    pub version: (i32, i32),
    /// Remarks from discovery (e.g. newer than the driver).
    pub notes: Vec<String>,
}

impl NvrtcInfo {
    /// Load NVRTC (no GPU needed) and describe it.
    pub fn load() -> Result<NvrtcInfo, CudaError> {
        let n = nvrtc::api()?;
        Ok(NvrtcInfo { path: n.path.clone(), version: n.version, notes: n.notes.clone() })
    }
}

/// Compile one kernel file to PTX for a virtual arch such as `compute_80` (no GPU needed).
pub fn compile_ptx(id: KernelId, arch: &str) -> Result<String, CudaError> {
    let n = nvrtc::api()?;
    let opts = vec![format!("--gpu-architecture={arch}"), "-default-device".to_string()];
    let ptx = n.compile(id.file(), id.source(), KernelId::headers(), &opts, Output::Ptx)?;
    Ok(String::from_utf8_lossy(&ptx).trim_end_matches('\0').to_string())
}

/// Extra NVRTC options from `LOCKSTEP_NVRTC_OPTIONS` (whitespace-separated, e.g.
/// `-DLOCKSTEP_NO_TF32` for exact f32 GEMMs in tests). Read once per process; the options take
/// part in the disk-cache key, so switching them never loads a stale image.
pub fn extra_nvrtc_options() -> Vec<String> {
    static OPTS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    OPTS.get_or_init(|| std::env::var("LOCKSTEP_NVRTC_OPTIONS").unwrap_or_default().split_whitespace().map(str::to_string).collect())
        .clone()
}

/// 64-bit FNV-1a (stable across Rust versions, unlike `DefaultHasher`).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for p in parts {
        for b in p.iter().chain(&[0xffu8]) {
            h ^= *b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
    }
    h
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

/// CUBIN for `id` on arch `sm_{major}{minor}`, from the disk cache or NVRTC. Returns the image
/// and whether it came from the cache.
pub fn compile_cubin_cached(id: KernelId, cc: (i32, i32), driver_version: i32) -> Result<(Vec<u8>, bool), CudaError> {
    let n = nvrtc::api()?;
    let mut opts = vec![format!("--gpu-architecture=sm_{}{}", cc.0, cc.1), "-default-device".to_string()];
    opts.extend(extra_nvrtc_options());
    let mut parts: Vec<&[u8]> = vec![id.source().as_bytes()];
    for (name, src) in KernelId::headers() {
        parts.push(name.as_bytes());
        parts.push(src.as_bytes());
    }
    let optstr = opts.join(" ");
    let nv = format!("{}.{}", n.version.0, n.version.1);
    parts.push(optstr.as_bytes());
    parts.push(nv.as_bytes());
    let hash = fnv1a(&parts);
    let stem = id.file().trim_end_matches(".cu");
    let path = cache_dir().join("kernels").join(format!("{stem}-sm{}{}-drv{driver_version}-{hash:016x}.cubin", cc.0, cc.1));
    if let Ok(bytes) = std::fs::read(&path) {
        if !bytes.is_empty() {
            return Ok((bytes, true));
        }
    }
    let cubin = n.compile(id.file(), id.source(), KernelId::headers(), &opts, Output::Cubin)?;
    // Best effort: a read-only cache folder only costs a recompile next time.
    if let Some(dir) = path.parent() {
        if std::fs::create_dir_all(dir).is_ok() {
            let tmp = path.with_extension(format!("tmp{}", std::process::id()));
            if std::fs::write(&tmp, &cubin).is_ok() {
                let _ = std::fs::rename(&tmp, &path);
            }
        }
    }
    Ok((cubin, false))
}

/// A loaded module (unloaded on drop).
pub struct Module {
    /// Weak: the context caches its modules, a strong reference would be a cycle.
    ctx: Weak<Context>,
    ctx_raw: CUcontext,
    raw: CUmodule,
    /// Which kernel file.
    pub id: KernelId,
    /// Whether the image came from the disk cache.
    pub from_cache: bool,
}

// SAFETY: a CUmodule may be used from any thread once its context is bound there; lockstep binds
// the context before every use.
unsafe impl Send for Module {}
// SAFETY: as above; module handles are immutable after loading.
unsafe impl Sync for Module {}

impl Module {
    /// Compile (or fetch from the cache) and load `id` in `ctx`.
    pub(crate) fn load(ctx: &Arc<Context>, id: KernelId) -> Result<Module, CudaError> {
        ctx.bind()?;
        let drv = driver::core()?.driver_version()?;
        let (image, from_cache) = compile_cubin_cached(id, ctx.compute_capability()?, drv)?;
        let raw = driver::module_load_data(&image)?;
        Ok(Module { ctx: Arc::downgrade(ctx), ctx_raw: ctx.raw(), raw, id, from_cache })
    }

    /// Look up entry point `name` (must be declared in the registry).
    pub fn function(self: &Arc<Self>, name: &str) -> Result<Function, CudaError> {
        let sig = self.id.signature(name).ok_or_else(|| CudaError::InvalidArgument {
            op: format!("Module::function({name})"),
            detail: format!(
                "{} declares no entry point {name}; declared: {:?}",
                self.id,
                self.id.functions().iter().map(|s| s.name).collect::<Vec<_>>()
            ),
        })?;
        driver::ctx_set_current(self.ctx_raw)?;
        let raw = driver::module_get_function(self.raw, name)?;
        Ok(Function { module: self.clone(), raw, sig })
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        let r = driver::ctx_set_current(self.ctx_raw).and_then(|_| {
            // SAFETY: functions hold an Arc to the module, so none is alive here.
            unsafe { driver::module_unload(self.raw) }
        });
        if let Err(e) = r {
            match self.ctx.upgrade() {
                Some(ctx) => ctx.record_err(format!("module {}", self.id), e),
                // The context itself is being dropped: nobody is left to report to.
                None => eprintln!("lockstep: unloading module {} failed: {e}", self.id),
            }
        }
    }
}

/// A kernel entry point.
#[derive(Clone)]
pub struct Function {
    module: Arc<Module>,
    raw: CUfunction,
    sig: &'static KernelSig,
}

// SAFETY: see `Module`.
unsafe impl Send for Function {}

impl Function {
    /// The entry point's signature.
    pub fn signature(&self) -> &'static KernelSig {
        self.sig
    }

    /// Start a launch with geometry `cfg`.
    pub fn launch(&self, cfg: LaunchConfig) -> Launch<'_> {
        Launch { f: self, cfg, args: Vec::new(), min_len: None }
    }
}

/// Grid and block sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks.
    pub grid: (u32, u32, u32),
    /// Threads per block.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory in bytes.
    pub shared_mem: u32,
}

impl LaunchConfig {
    /// 1-D launch covering `n` elements with 256-thread blocks (grid capped; kernels use a
    /// grid-stride loop).
    pub fn for_elements(n: usize) -> LaunchConfig {
        let block = 256u32;
        let grid = n.div_ceil(block as usize).clamp(1, 65535) as u32;
        LaunchConfig { grid: (grid, 1, 1), block: (block, 1, 1), shared_mem: 0 }
    }
}

/// A scalar kernel argument.
pub trait KernelScalar: Element {
    /// The value's bits, zero-extended to 8 bytes (little-endian layout matches the C type).
    fn bits(self) -> u64;
}

impl KernelScalar for f32 {
    fn bits(self) -> u64 {
        self.to_bits() as u64
    }
}
impl KernelScalar for f64 {
    fn bits(self) -> u64 {
        self.to_bits()
    }
}
impl KernelScalar for i32 {
    fn bits(self) -> u64 {
        self as u32 as u64
    }
}
impl KernelScalar for i64 {
    fn bits(self) -> u64 {
        self as u64
    }
}

#[derive(Clone, Copy, Debug)]
enum ArgVal {
    Ptr { addr: u64, len: usize, space: MemSpace, dtype: Dtype, mutable: bool },
    Scalar { dtype: Dtype, bits: u64 },
}

/// A launch under construction: arguments are checked against the entry point's signature
/// (count, kinds, dtypes, device, minimum buffer length) before anything is enqueued.
pub struct Launch<'a> {
    f: &'a Function,
    cfg: LaunchConfig,
    args: Vec<ArgVal>,
    min_len: Option<usize>,
}

impl<'a> Launch<'a> {
    /// A read-only device buffer argument.
    pub fn arg<T: Element, B: Buffer<T> + ?Sized>(mut self, b: &'a B) -> Self {
        let r = b.raw();
        self.args.push(ArgVal::Ptr { addr: r.addr as u64, len: r.len, space: r.space, dtype: T::DTYPE, mutable: false });
        self
    }

    /// A written device buffer argument.
    pub fn arg_mut<T: Element, B: BufferMut<T> + ?Sized>(mut self, b: &'a mut B) -> Self {
        let r = b.raw_mut();
        self.args.push(ArgVal::Ptr { addr: r.addr as u64, len: r.len, space: r.space, dtype: T::DTYPE, mutable: true });
        self
    }

    /// A scalar argument.
    pub fn scalar<T: KernelScalar>(mut self, v: T) -> Self {
        self.args.push(ArgVal::Scalar { dtype: T::DTYPE, bits: v.bits() });
        self
    }

    /// Require every buffer argument to hold at least `n` elements.
    pub fn elements(mut self, n: usize) -> Self {
        self.min_len = Some(n);
        self
    }

    fn check(&self, ordinal: i32) -> Result<(), CudaError> {
        let sig = self.f.sig;
        let bad = |detail: String| CudaError::InvalidArgument { op: format!("launch {}", sig.name), detail };
        if self.args.len() != sig.args.len() {
            return Err(bad(format!("{} arguments given, the kernel takes {} ({:?})", self.args.len(), sig.args.len(), sig.args)));
        }
        for (i, (a, k)) in self.args.iter().zip(sig.args).enumerate() {
            match (a, k) {
                (ArgVal::Ptr { dtype, mutable, space, len, .. }, ArgKind::Ptr(want) | ArgKind::PtrMut(want)) => {
                    if dtype != want {
                        return Err(bad(format!("argument {i} is a {dtype} buffer, the kernel expects {want}")));
                    }
                    if matches!(k, ArgKind::PtrMut(_)) && !mutable {
                        return Err(bad(format!("argument {i} is written by the kernel: pass it with arg_mut")));
                    }
                    if *space != MemSpace::Device(ordinal) {
                        return Err(bad(format!("argument {i} lives in {space:?}, the launch runs on Device({ordinal})")));
                    }
                    if let Some(n) = self.min_len {
                        if *len < n {
                            return Err(bad(format!("argument {i} holds {len} elements, the launch covers {n}")));
                        }
                    }
                }
                (ArgVal::Scalar { dtype, .. }, ArgKind::Scalar(want)) => {
                    if dtype != want {
                        return Err(bad(format!("argument {i} is a {dtype} scalar, the kernel expects {want}")));
                    }
                }
                (got, want) => return Err(bad(format!("argument {i} is {got:?}, the kernel expects {want:?}"))),
            }
        }
        let (g, b) = (self.cfg.grid, self.cfg.block);
        if g.0 == 0 || g.1 == 0 || g.2 == 0 || b.0 == 0 || b.1 == 0 || b.2 == 0 || b.0 * b.1 * b.2 > 1024 {
            return Err(bad(format!("invalid geometry grid={g:?} block={b:?} (each ≥ 1, ≤ 1024 threads per block)")));
        }
        Ok(())
    }

    /// Check the arguments and enqueue the kernel on `stream`.
    pub fn run(self, stream: &Stream) -> Result<(), CudaError> {
        let ctx = stream.context();
        if ctx.raw() != self.f.module.ctx_raw {
            return Err(CudaError::InvalidArgument {
                op: format!("launch {}", self.f.sig.name),
                detail: "the stream belongs to another context than the module".into(),
            });
        }
        self.check(ctx.ordinal())?;
        ctx.bind()?;
        // One 8-byte slot per argument; the driver reads sizeof(param) bytes from each.
        let mut slots: Vec<u64> = self
            .args
            .iter()
            .map(|a| match a {
                ArgVal::Ptr { addr, .. } => *addr,
                ArgVal::Scalar { bits, .. } => *bits,
            })
            .collect();
        let mut params: Vec<*mut c_void> = slots.iter_mut().map(|s| s as *mut u64 as *mut c_void).collect();
        // SAFETY: `check` verified one argument per parameter with matching kind and dtype, that
        // every buffer is device memory of this context holding the required elements (the
        // borrows in `self` keep them alive until this call returns; device memory is freed with
        // cuMemFree, which waits for pending work). Scalars are stored little-endian in 8-byte
        // slots, so the first sizeof(T) bytes hold the value.
        unsafe { driver::launch_kernel(self.f.raw, self.cfg.grid, self.cfg.block, self.cfg.shared_mem, stream.raw(), params.as_mut_ptr()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv_is_stable() {
        assert_eq!(fnv1a(&[b"a"]), fnv1a(&[b"a"]));
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
    }

    #[test]
    fn launch_config_covers_elements() {
        let c = LaunchConfig::for_elements(1000);
        assert_eq!(c.block.0, 256);
        assert_eq!(c.grid.0, 4);
        assert_eq!(LaunchConfig::for_elements(0).grid.0, 1);
    }

    /// A compile error carries the NVRTC log with the line (runs when NVRTC is installed, e.g.
    /// after `.ci/install-nvrtc.sh`; otherwise there is nothing to check).
    #[test]
    fn compile_error_reports_the_nvrtc_log() {
        let Ok(n) = nvrtc::api() else {
            eprintln!("skipped: no NVRTC library");
            return;
        };
        if driver::core().is_ok() {
            // Compiling would initialise CUDA in this (multi-threaded, possibly forking) test
            // process; tests/nvrtc_kernels.rs covers compilation on machines with a driver.
            eprintln!("skipped: a CUDA driver is present");
            return;
        }
        let src = "extern \"C\" __global__ void broken(float* x) {\n  x[0] = undefined_name;\n}\n";
        let e = n.compile("broken.cu", src, &[], &["--gpu-architecture=compute_80".into()], Output::Ptx).unwrap_err().to_string();
        assert!(e.contains("broken.cu") && e.contains("undefined_name") && e.contains("(2)"), "{e}");
        assert!(e.contains("--gpu-architecture=compute_80"), "{e}");
    }
}
