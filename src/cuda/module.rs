//! Loaded kernel modules: the per-context module cache ([`Context::module`],
//! [`Context::function`]), entry points and the shape-checked launch builder.
//!
//! Any [`KernelSource`] can be loaded: the module is compiled (or fetched from the disk cache, see
//! `compile.rs`) for the context's device on first use and kept in the context, keyed by the
//! source's name and a hash of its text, headers and entry-point table.

use std::any::Any;
use std::ffi::c_void;
use std::sync::{Arc, Weak};

use crate::comm::{Buffer, BufferMut, Dtype, Element, MemSpace, RawMem};

use super::compile::compile_cubin_cached;
use super::context::{Context, ModuleKey, Stream};
use super::driver::{self, CUcontext, CUfunction, CUmodule};
use super::error::CudaError;
use super::source::{fnv1a, ArgKind, KernelSig, KernelSource};

/// A loaded module (unloaded on drop).
pub struct Module {
    /// Weak: the context caches its modules, a strong reference would be a cycle.
    ctx: Weak<Context>,
    ctx_raw: CUcontext,
    raw: CUmodule,
    /// The source it was compiled from.
    pub source: KernelSource,
    /// Whether the image came from the disk cache.
    pub from_cache: bool,
}

// SAFETY: a CUmodule may be used from any thread once its context is bound there; lockstep binds
// the context before every use.
unsafe impl Send for Module {}
// SAFETY: as above; module handles are immutable after loading.
unsafe impl Sync for Module {}

impl Module {
    /// Compile (or fetch from the disk cache) and load `src` in `ctx`. Uncached: callers go
    /// through [`Context::module`].
    fn load(ctx: &Arc<Context>, src: &KernelSource) -> Result<Module, CudaError> {
        ctx.bind()?;
        let drv = driver::core()?.driver_version()?;
        let (image, from_cache) = compile_cubin_cached(src, ctx.compute_capability()?, drv)?;
        let raw = driver::module_load_data(&image)?;
        Ok(Module {
            ctx: Arc::downgrade(ctx),
            ctx_raw: ctx.raw(),
            raw,
            source: *src,
            from_cache,
        })
    }

    /// Look up entry point `name` (must be declared in the source's `functions`).
    pub fn function(self: &Arc<Self>, name: &str) -> Result<Function, CudaError> {
        let sig = self
            .source
            .signature(name)
            .ok_or_else(|| CudaError::InvalidArgument {
                op: format!("Module::function({name})"),
                detail: format!(
                    "{} declares no entry point {name}; declared: {:?}",
                    self.source.name,
                    self.source
                        .functions
                        .iter()
                        .map(|s| s.name)
                        .collect::<Vec<_>>()
                ),
            })?;
        driver::ctx_set_current(self.ctx_raw)?;
        let raw = driver::module_get_function(self.raw, name)?;
        Ok(Function {
            module: self.clone(),
            raw,
            sig,
        })
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
                Some(ctx) => ctx.record_err(format!("module {}", self.source.name), e),
                // The context itself is being dropped: no later call can report it.
                None => tracing::warn!("unloading CUDA module {} failed: {e}", self.source.name),
            }
        }
    }
}

/// The per-context module cache. The context stores modules type-erased (so `context.rs` does not
/// depend on this file); only this impl puts them in and takes them out.
impl Context {
    /// The module for `src`, compiled by NVRTC on first use (disk-cached) and kept in this context,
    /// keyed by the source's name and a hash of its text, headers and entry points (two
    /// descriptions of the same text with different tables get their own modules, so a
    /// [`Function`] is always checked against the table it was asked through).
    pub fn module(self: &Arc<Self>, src: &KernelSource) -> Result<Arc<Module>, CudaError> {
        self.check()?;
        let key = cache_key(src);
        let mut m = self.module_cache();
        if let Some(x) = m.get(&key) {
            return Arc::clone(x).downcast::<Module>().map_err(|_| CudaError::InvalidArgument {
                op: format!("Context::module({})", src.name),
                detail: "the context's module cache holds something else under this key (a lockstep bug: please report it)".into(),
            });
        }
        let loaded = Arc::new(Module::load(self, src)?);
        m.insert(key, Arc::clone(&loaded) as Arc<dyn Any + Send + Sync>);
        Ok(loaded)
    }

    /// Entry point `name` of `src` (loading the module on first use).
    pub fn function(
        self: &Arc<Self>,
        src: &KernelSource,
        name: &str,
    ) -> Result<Function, CudaError> {
        self.module(src)?.function(name)
    }
}

/// The per-context cache key of `src`.
fn cache_key(src: &KernelSource) -> ModuleKey {
    let table = format!("{:?}", src.functions);
    let mut parts: Vec<&[u8]> = src.content_parts();
    parts.push(table.as_bytes());
    (src.name, fnv1a(&parts))
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
    pub fn launch(&self, cfg: KernelGrid) -> Launch<'_> {
        Launch {
            f: self,
            cfg,
            args: Vec::new(),
            min_len: None,
        }
    }
}

/// Grid and block sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelGrid {
    /// Blocks.
    pub grid: (u32, u32, u32),
    /// Threads per block.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory in bytes.
    pub shared_mem: u32,
}

impl KernelGrid {
    /// 1-D launch covering `n` elements with 256-thread blocks (grid capped; kernels use a
    /// grid-stride loop).
    pub fn for_elements(n: usize) -> KernelGrid {
        let block = 256u32;
        let grid = n.div_ceil(block as usize).clamp(1, 65535) as u32;
        KernelGrid {
            grid: (grid, 1, 1),
            block: (block, 1, 1),
            shared_mem: 0,
        }
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
    Ptr {
        addr: u64,
        len: usize,
        space: MemSpace,
        dtype: Dtype,
        mutable: bool,
    },
    Scalar {
        dtype: Dtype,
        bits: u64,
    },
}

/// A launch under construction: arguments are checked against the entry point's signature
/// (count, kinds, dtypes, device, minimum buffer length) before anything is enqueued.
pub struct Launch<'a> {
    f: &'a Function,
    cfg: KernelGrid,
    args: Vec<ArgVal>,
    min_len: Option<usize>,
}

impl<'a> Launch<'a> {
    /// A read-only device buffer argument.
    pub fn arg<T: Element, B: Buffer<T> + ?Sized>(self, b: &'a B) -> Self {
        self.ptr(b.raw(), T::DTYPE, false)
    }

    /// A written device buffer argument.
    pub fn arg_mut<T: Element, B: BufferMut<T> + ?Sized>(self, b: &'a mut B) -> Self {
        self.ptr(b.raw_mut(), T::DTYPE, true)
    }

    /// A buffer argument of either direction; the check before [`Launch::run`] matches `mutable`
    /// against the kernel's parameter (read-only or written).
    fn ptr(mut self, r: RawMem, dtype: Dtype, mutable: bool) -> Self {
        self.args.push(ArgVal::Ptr {
            addr: r.addr as u64,
            len: r.len,
            space: r.space,
            dtype,
            mutable,
        });
        self
    }

    /// A scalar argument.
    pub fn scalar<T: KernelScalar>(mut self, v: T) -> Self {
        self.args.push(ArgVal::Scalar {
            dtype: T::DTYPE,
            bits: v.bits(),
        });
        self
    }

    /// Require every buffer argument to hold at least `n` elements.
    pub fn elements(mut self, n: usize) -> Self {
        self.min_len = Some(n);
        self
    }

    fn check(&self, ordinal: i32) -> Result<(), CudaError> {
        let sig = self.f.sig;
        let bad = |detail: String| CudaError::InvalidArgument {
            op: format!("launch {}", sig.name),
            detail,
        };
        if self.args.len() != sig.args.len() {
            return Err(bad(format!(
                "{} arguments given, the kernel takes {} ({:?})",
                self.args.len(),
                sig.args.len(),
                sig.args
            )));
        }
        for (i, (a, k)) in self.args.iter().zip(sig.args).enumerate() {
            match (a, k) {
                (
                    ArgVal::Ptr {
                        dtype,
                        mutable,
                        space,
                        len,
                        ..
                    },
                    ArgKind::Ptr(want) | ArgKind::PtrMut(want),
                ) => {
                    if dtype != want {
                        return Err(bad(format!(
                            "argument {i} is a {dtype} buffer, the kernel expects {want}"
                        )));
                    }
                    if matches!(k, ArgKind::PtrMut(_)) && !mutable {
                        return Err(bad(format!(
                            "argument {i} is written by the kernel: pass it with arg_mut"
                        )));
                    }
                    if *space != MemSpace::Device(ordinal) {
                        return Err(bad(format!(
                            "argument {i} lives in {space:?}, the launch runs on Device({ordinal})"
                        )));
                    }
                    if let Some(n) = self.min_len {
                        if *len < n {
                            return Err(bad(format!(
                                "argument {i} holds {len} elements, the launch covers {n}"
                            )));
                        }
                    }
                }
                (ArgVal::Scalar { dtype, .. }, ArgKind::Scalar(want)) => {
                    if dtype != want {
                        return Err(bad(format!(
                            "argument {i} is a {dtype} scalar, the kernel expects {want}"
                        )));
                    }
                }
                (got, want) => {
                    return Err(bad(format!(
                        "argument {i} is {got:?}, the kernel expects {want:?}"
                    )))
                }
            }
        }
        let (g, b) = (self.cfg.grid, self.cfg.block);
        if g.0 == 0
            || g.1 == 0
            || g.2 == 0
            || b.0 == 0
            || b.1 == 0
            || b.2 == 0
            || b.0 * b.1 * b.2 > 1024
        {
            return Err(bad(format!(
                "invalid geometry grid={g:?} block={b:?} (each ≥ 1, ≤ 1024 threads per block)"
            )));
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
        let mut params: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| s as *mut u64 as *mut c_void)
            .collect();
        // SAFETY: `check` verified one argument per parameter with matching kind and dtype, that
        // every buffer is device memory of this context holding the required elements (the
        // borrows in `self` keep them alive until this call returns; device memory is freed with
        // cuMemFree, which waits for pending work). Scalars are stored little-endian in 8-byte
        // slots, so the first sizeof(T) bytes hold the value.
        unsafe {
            driver::launch_kernel(
                self.f.raw,
                self.cfg.grid,
                self.cfg.block,
                self.cfg.shared_mem,
                stream.raw(),
                params.as_mut_ptr(),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_key_covers_text_headers_and_entry_points() {
        const F: &[KernelSig] = &[KernelSig {
            name: "f",
            args: &[ArgKind::Scalar(Dtype::I32)],
        }];
        const G: &[KernelSig] = &[KernelSig {
            name: "f",
            args: &[ArgKind::Scalar(Dtype::I64)],
        }];
        let a = KernelSource {
            name: "a.cu",
            source: "x",
            headers: &[("h.cuh", "1")],
            functions: F,
        };
        assert_eq!(cache_key(&a), cache_key(&a), "stable");
        assert_ne!(
            cache_key(&a),
            cache_key(&KernelSource { functions: G, ..a }),
            "entry-point table"
        );
        assert_ne!(
            cache_key(&a),
            cache_key(&KernelSource { source: "y", ..a }),
            "text"
        );
        assert_ne!(
            cache_key(&a),
            cache_key(&KernelSource { headers: &[], ..a }),
            "headers"
        );
        assert_ne!(
            cache_key(&a),
            cache_key(&KernelSource { name: "b.cu", ..a }),
            "name"
        );
    }

    #[test]
    fn launch_config_covers_elements() {
        let c = KernelGrid::for_elements(1000);
        assert_eq!(c.block.0, 256);
        assert_eq!(c.grid.0, 4);
        assert_eq!(KernelGrid::for_elements(0).grid.0, 1);
    }
}
