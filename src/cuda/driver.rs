//! Result layer for the CUDA driver API: our function-pointer tables over `libcuda` and one
//! `Result`-returning wrapper per call.
//!
//! Two tables: [`CoreFns`] holds the handful of calls needed to *probe* the driver (`cuInit`,
//! `cuDeviceGetCount`, `cuDriverGetVersion`, the error strings) and is resolved when the library
//! is loaded; [`DriverFns`] holds everything else and is resolved on first use. That split lets
//! the fork-safety tests run against a tiny fake driver that exports only the probe calls.
//! Return codes are read as plain `c_int` (not cudarc's `CUresult` enum) so that a code newer than
//! the bindings cannot become an invalid Rust enum value.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

pub(crate) use cudarc::driver::sys::{
    CUcontext, CUdevice, CUdeviceptr, CUevent, CUfunction, CUgraph, CUgraphExec, CUmodule, CUstream,
};

use super::discovery::{self, LibKind, Loaded, Verdict};
use super::error::{driver_hint, CudaError, DriverStatus};

/// `CUDA_SUCCESS`.
pub(crate) const SUCCESS: c_int = 0;
/// `CUDA_ERROR_NOT_INITIALIZED`: what probe calls answer before `cuInit`.
pub(crate) const ERROR_NOT_INITIALIZED: c_int = 3;
/// `CUDA_ERROR_NOT_READY`: `cuStreamQuery`/`cuEventQuery` on pending work.
pub(crate) const ERROR_NOT_READY: c_int = 600;

fn_table! {
    /// The probe calls, resolved at load time.
    pub(crate) struct CoreFns {
        required {
            cuInit = "cuInit": fn(c_uint) -> c_int;
            cuDeviceGetCount = "cuDeviceGetCount": fn(*mut c_int) -> c_int;
            cuDriverGetVersion = "cuDriverGetVersion": fn(*mut c_int) -> c_int;
            cuGetErrorString = "cuGetErrorString": fn(c_int, *mut *const c_char) -> c_int;
            cuGetErrorName = "cuGetErrorName": fn(c_int, *mut *const c_char) -> c_int;
        }
        optional {}
    }
}

fn_table! {
    /// Everything else the safe layer uses, resolved on first use.
    pub(crate) struct DriverFns {
        required {
            cuDeviceGet = "cuDeviceGet": fn(*mut CUdevice, c_int) -> c_int;
            cuDeviceGetName = "cuDeviceGetName": fn(*mut c_char, c_int, CUdevice) -> c_int;
            cuDeviceGetAttribute = "cuDeviceGetAttribute": fn(*mut c_int, c_int, CUdevice) -> c_int;
            cuDeviceTotalMem = "cuDeviceTotalMem_v2": fn(*mut usize, CUdevice) -> c_int;
            cuDevicePrimaryCtxRetain = "cuDevicePrimaryCtxRetain": fn(*mut CUcontext, CUdevice) -> c_int;
            cuDevicePrimaryCtxRelease = "cuDevicePrimaryCtxRelease_v2": fn(CUdevice) -> c_int;
            cuCtxSetCurrent = "cuCtxSetCurrent": fn(CUcontext) -> c_int;
            cuCtxSynchronize = "cuCtxSynchronize": fn() -> c_int;
            cuStreamCreate = "cuStreamCreate": fn(*mut CUstream, c_uint) -> c_int;
            cuStreamDestroy = "cuStreamDestroy_v2": fn(CUstream) -> c_int;
            cuStreamSynchronize = "cuStreamSynchronize": fn(CUstream) -> c_int;
            cuStreamQuery = "cuStreamQuery": fn(CUstream) -> c_int;
            cuStreamWaitEvent = "cuStreamWaitEvent": fn(CUstream, CUevent, c_uint) -> c_int;
            cuEventCreate = "cuEventCreate": fn(*mut CUevent, c_uint) -> c_int;
            cuEventDestroy = "cuEventDestroy_v2": fn(CUevent) -> c_int;
            cuEventRecord = "cuEventRecord": fn(CUevent, CUstream) -> c_int;
            cuEventSynchronize = "cuEventSynchronize": fn(CUevent) -> c_int;
            cuEventQuery = "cuEventQuery": fn(CUevent) -> c_int;
            cuMemAlloc = "cuMemAlloc_v2": fn(*mut CUdeviceptr, usize) -> c_int;
            cuMemFree = "cuMemFree_v2": fn(CUdeviceptr) -> c_int;
            cuMemHostAlloc = "cuMemHostAlloc": fn(*mut *mut c_void, usize, c_uint) -> c_int;
            cuMemFreeHost = "cuMemFreeHost": fn(*mut c_void) -> c_int;
            cuMemGetInfo = "cuMemGetInfo_v2": fn(*mut usize, *mut usize) -> c_int;
            cuMemsetD8Async = "cuMemsetD8Async": fn(CUdeviceptr, u8, usize, CUstream) -> c_int;
            cuMemcpyHtoDAsync = "cuMemcpyHtoDAsync_v2": fn(CUdeviceptr, *const c_void, usize, CUstream) -> c_int;
            cuMemcpyDtoHAsync = "cuMemcpyDtoHAsync_v2": fn(*mut c_void, CUdeviceptr, usize, CUstream) -> c_int;
            cuMemcpyDtoDAsync = "cuMemcpyDtoDAsync_v2": fn(CUdeviceptr, CUdeviceptr, usize, CUstream) -> c_int;
            cuModuleLoadData = "cuModuleLoadData": fn(*mut CUmodule, *const c_void) -> c_int;
            cuModuleUnload = "cuModuleUnload": fn(CUmodule) -> c_int;
            cuModuleGetFunction = "cuModuleGetFunction": fn(*mut CUfunction, CUmodule, *const c_char) -> c_int;
            cuLaunchKernel = "cuLaunchKernel": fn(CUfunction, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, CUstream, *mut *mut c_void, *mut *mut c_void) -> c_int;
            cuStreamBeginCapture = "cuStreamBeginCapture_v2": fn(CUstream, c_int) -> c_int;
            cuStreamEndCapture = "cuStreamEndCapture": fn(CUstream, *mut CUgraph) -> c_int;
            cuGraphInstantiateWithFlags = "cuGraphInstantiateWithFlags": fn(*mut CUgraphExec, CUgraph, u64) -> c_int;
            cuGraphLaunch = "cuGraphLaunch": fn(CUgraphExec, CUstream) -> c_int;
            cuGraphExecDestroy = "cuGraphExecDestroy": fn(CUgraphExec) -> c_int;
            cuGraphDestroy = "cuGraphDestroy": fn(CUgraph) -> c_int;
        }
        optional {
            cuEventElapsedTime_v2 = "cuEventElapsedTime_v2": fn(*mut f32, CUevent, CUevent) -> c_int;
            cuEventElapsedTime = "cuEventElapsedTime": fn(*mut f32, CUevent, CUevent) -> c_int;
        }
    }
}

/// The loaded driver library and its probe table.
pub(crate) struct DriverCore {
    pub loaded: Loaded,
    pub path: String,
    pub origin: String,
    pub f: CoreFns,
}

impl std::ops::Deref for DriverCore {
    type Target = CoreFns;
    fn deref(&self) -> &CoreFns {
        &self.f
    }
}

static CORE: OnceLock<Result<DriverCore, CudaError>> = OnceLock::new();
static FULL: OnceLock<Result<DriverFns, CudaError>> = OnceLock::new();

/// Load the driver library (once per process). Does not call `cuInit`.
pub(crate) fn core() -> Result<&'static DriverCore, CudaError> {
    discovery::cached(&CORE, load_core)
}

fn load_core() -> Result<DriverCore, CudaError> {
    let mut missing: Option<CudaError> = None;
    let loaded = discovery::load(
        LibKind::Driver,
        "cuInit",
        |lib, path| match CoreFns::resolve(lib) {
            Ok(_) => Verdict::Accept,
            Err((sym, detail)) => {
                missing.get_or_insert(LibKind::Driver.missing_symbol(path, (sym, detail)));
                Verdict::Reject(format!("no symbol {sym}"))
            }
        },
    );
    let loaded = match loaded {
        Ok(l) => l,
        // A lone candidate (the override) that lacked a symbol: say which symbol.
        Err(e) => {
            return Err(if std::env::var(LibKind::Driver.env_var()).is_ok() {
                missing.unwrap_or(e)
            } else {
                e
            })
        }
    };
    let f = LibKind::Driver.resolve(&loaded, CoreFns::resolve)?;
    Ok(DriverCore {
        path: loaded.path.clone(),
        origin: loaded.origin.clone(),
        loaded,
        f,
    })
}

/// The full driver table (loads the library first).
pub(crate) fn api() -> Result<&'static DriverFns, CudaError> {
    let c = core()?;
    discovery::cached(&FULL, || {
        LibKind::Driver.resolve(&c.loaded, DriverFns::resolve)
    })
}

impl DriverCore {
    /// `cuDriverGetVersion` (works before `cuInit`).
    pub fn driver_version(&self) -> Result<i32, CudaError> {
        let mut v: c_int = 0;
        // SAFETY: `v` is a valid out-pointer.
        let rc = unsafe { (self.cuDriverGetVersion)(&mut v) };
        check(rc, || "cuDriverGetVersion()".into())?;
        Ok(v)
    }

    /// Raw `cuDeviceGetCount` status and count (used to detect foreign initialisation).
    pub fn device_count_raw(&self) -> (c_int, i32) {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer; before cuInit the driver only answers NOT_INITIALIZED.
        let rc = unsafe { (self.cuDeviceGetCount)(&mut n) };
        (rc, n)
    }
}

/// The driver's name and description of `code` (works without `cuInit`).
pub(crate) fn status(code: c_int) -> DriverStatus {
    let (mut name, mut message) = (format!("CUresult {code}"), String::from("unknown error"));
    if let Ok(c) = core() {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: out-pointer is valid; on success the driver returns a static NUL-terminated string.
        if unsafe { (c.cuGetErrorName)(code, &mut p) } == SUCCESS && !p.is_null() {
            // SAFETY: see above.
            name = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
        }
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: as above.
        if unsafe { (c.cuGetErrorString)(code, &mut p) } == SUCCESS && !p.is_null() {
            // SAFETY: see above.
            message = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
        }
    }
    DriverStatus {
        code,
        name,
        message,
    }
}

/// Map a driver status to `Result`, naming the call.
pub(crate) fn check(code: c_int, call: impl FnOnce() -> String) -> Result<(), CudaError> {
    if code == SUCCESS {
        Ok(())
    } else {
        Err(CudaError::Driver {
            call: call(),
            status: status(code),
            hint: driver_hint(code),
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Devices and contexts

/// `cuDeviceGetCount` (requires `cuInit`, done by the caller through `init::ensure_init`).
pub(crate) fn device_get_count() -> Result<i32, CudaError> {
    let (rc, n) = core()?.device_count_raw();
    check(rc, || "cuDeviceGetCount()".into())?;
    Ok(n)
}

/// `cuDeviceGet`.
pub(crate) fn device_get(ordinal: i32) -> Result<CUdevice, CudaError> {
    let mut d: CUdevice = 0;
    // SAFETY: valid out-pointer.
    let rc = unsafe { (api()?.cuDeviceGet)(&mut d, ordinal) };
    check(rc, || format!("cuDeviceGet(ordinal={ordinal})"))?;
    Ok(d)
}

/// `cuDeviceGetName`.
pub(crate) fn device_get_name(dev: CUdevice) -> Result<String, CudaError> {
    let mut buf = [0 as c_char; 256];
    // SAFETY: `buf` holds 256 bytes, the length passed.
    let rc = unsafe { (api()?.cuDeviceGetName)(buf.as_mut_ptr(), buf.len() as c_int, dev) };
    check(rc, || format!("cuDeviceGetName(device={dev})"))?;
    // SAFETY: the driver NUL-terminates within the buffer.
    Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

/// `CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT`.
pub(crate) const ATTR_SM_COUNT: c_int = 16;
/// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR`.
pub(crate) const ATTR_CC_MAJOR: c_int = 75;
/// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR`.
pub(crate) const ATTR_CC_MINOR: c_int = 76;

/// `cuDeviceGetAttribute`.
pub(crate) fn device_get_attribute(dev: CUdevice, attr: c_int) -> Result<i32, CudaError> {
    let mut v: c_int = 0;
    // SAFETY: valid out-pointer.
    let rc = unsafe { (api()?.cuDeviceGetAttribute)(&mut v, attr, dev) };
    check(rc, || {
        format!("cuDeviceGetAttribute(attr={attr}, device={dev})")
    })?;
    Ok(v)
}

/// `cuDeviceTotalMem_v2`.
pub(crate) fn device_total_mem(dev: CUdevice) -> Result<usize, CudaError> {
    let mut v = 0usize;
    // SAFETY: valid out-pointer.
    let rc = unsafe { (api()?.cuDeviceTotalMem)(&mut v, dev) };
    check(rc, || format!("cuDeviceTotalMem(device={dev})"))?;
    Ok(v)
}

/// `cuDevicePrimaryCtxRetain`.
pub(crate) fn primary_ctx_retain(dev: CUdevice) -> Result<CUcontext, CudaError> {
    let mut c: CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    let rc = unsafe { (api()?.cuDevicePrimaryCtxRetain)(&mut c, dev) };
    check(rc, || format!("cuDevicePrimaryCtxRetain(device={dev})"))?;
    Ok(c)
}

/// `cuDevicePrimaryCtxRelease_v2`.
pub(crate) fn primary_ctx_release(dev: CUdevice) -> Result<(), CudaError> {
    // SAFETY: plain value argument.
    let rc = unsafe { (api()?.cuDevicePrimaryCtxRelease)(dev) };
    check(rc, || format!("cuDevicePrimaryCtxRelease(device={dev})"))
}

/// `cuCtxSetCurrent`.
pub(crate) fn ctx_set_current(ctx: CUcontext) -> Result<(), CudaError> {
    // SAFETY: `ctx` is a retained context handle (or null, which unbinds).
    let rc = unsafe { (api()?.cuCtxSetCurrent)(ctx) };
    check(rc, || "cuCtxSetCurrent".into())
}

/// `cuCtxSynchronize`.
pub(crate) fn ctx_synchronize() -> Result<(), CudaError> {
    // SAFETY: no arguments.
    let rc = unsafe { (api()?.cuCtxSynchronize)() };
    check(rc, || "cuCtxSynchronize()".into())
}

/// `cuMemGetInfo_v2` → (free, total).
pub(crate) fn mem_get_info() -> Result<(usize, usize), CudaError> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: valid out-pointers.
    let rc = unsafe { (api()?.cuMemGetInfo)(&mut free, &mut total) };
    check(rc, || "cuMemGetInfo()".into())?;
    Ok((free, total))
}

// ---------------------------------------------------------------------------------------------
// Streams and events

/// `CU_STREAM_NON_BLOCKING`.
pub(crate) const STREAM_NON_BLOCKING: c_uint = 1;
/// `CU_EVENT_DISABLE_TIMING`.
pub(crate) const EVENT_DISABLE_TIMING: c_uint = 2;

/// `cuStreamCreate`.
pub(crate) fn stream_create(flags: c_uint) -> Result<CUstream, CudaError> {
    let mut s: CUstream = std::ptr::null_mut();
    // SAFETY: valid out-pointer; a context is current (callers bind one first).
    let rc = unsafe { (api()?.cuStreamCreate)(&mut s, flags) };
    check(rc, || format!("cuStreamCreate(flags={flags})"))?;
    Ok(s)
}

/// `cuStreamDestroy_v2`.
///
/// # Safety
/// `s` must be a live stream created by [`stream_create`], not used afterwards.
pub(crate) unsafe fn stream_destroy(s: CUstream) -> Result<(), CudaError> {
    let rc = (api()?.cuStreamDestroy)(s);
    check(rc, || "cuStreamDestroy".into())
}

/// `cuStreamSynchronize`.
pub(crate) fn stream_synchronize(s: CUstream) -> Result<(), CudaError> {
    // SAFETY: `s` is a live stream owned by the caller's `Stream`.
    let rc = unsafe { (api()?.cuStreamSynchronize)(s) };
    check(rc, || "cuStreamSynchronize".into())
}

/// `cuStreamQuery`: `Ok(true)` when all work is done, `Ok(false)` while pending.
pub(crate) fn stream_query(s: CUstream) -> Result<bool, CudaError> {
    // SAFETY: `s` is a live stream.
    let rc = unsafe { (api()?.cuStreamQuery)(s) };
    if rc == ERROR_NOT_READY {
        return Ok(false);
    }
    check(rc, || "cuStreamQuery".into())?;
    Ok(true)
}

/// `cuStreamWaitEvent`.
pub(crate) fn stream_wait_event(s: CUstream, e: CUevent) -> Result<(), CudaError> {
    // SAFETY: live stream and event.
    let rc = unsafe { (api()?.cuStreamWaitEvent)(s, e, 0) };
    check(rc, || "cuStreamWaitEvent".into())
}

/// `cuEventCreate` (flags 0: timing enabled).
pub(crate) fn event_create(flags: c_uint) -> Result<CUevent, CudaError> {
    let mut e: CUevent = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    let rc = unsafe { (api()?.cuEventCreate)(&mut e, flags) };
    check(rc, || format!("cuEventCreate(flags={flags})"))?;
    Ok(e)
}

/// `cuEventDestroy_v2`.
///
/// # Safety
/// `e` must be a live event, not used afterwards.
pub(crate) unsafe fn event_destroy(e: CUevent) -> Result<(), CudaError> {
    let rc = (api()?.cuEventDestroy)(e);
    check(rc, || "cuEventDestroy".into())
}

/// `cuEventRecord`.
pub(crate) fn event_record(e: CUevent, s: CUstream) -> Result<(), CudaError> {
    // SAFETY: live event and stream.
    let rc = unsafe { (api()?.cuEventRecord)(e, s) };
    check(rc, || "cuEventRecord".into())
}

/// `cuEventQuery`: `Ok(true)` once the work before the event's record has completed.
pub(crate) fn event_query(e: CUevent) -> Result<bool, CudaError> {
    // SAFETY: live event.
    let rc = unsafe { (api()?.cuEventQuery)(e) };
    if rc == ERROR_NOT_READY {
        return Ok(false);
    }
    check(rc, || "cuEventQuery".into())?;
    Ok(true)
}

/// `cuEventSynchronize`.
pub(crate) fn event_synchronize(e: CUevent) -> Result<(), CudaError> {
    // SAFETY: live event.
    let rc = unsafe { (api()?.cuEventSynchronize)(e) };
    check(rc, || "cuEventSynchronize".into())
}

/// `cuEventElapsedTime_v2` (CUDA ≥ 12.8) or `cuEventElapsedTime`, in milliseconds.
pub(crate) fn event_elapsed_ms(start: CUevent, end: CUevent) -> Result<f32, CudaError> {
    let a = api()?;
    let f = a
        .cuEventElapsedTime_v2
        .or(a.cuEventElapsedTime)
        .ok_or_else(|| {
            let path = core().map(|c| c.path.clone()).unwrap_or_default();
            let detail = "neither cuEventElapsedTime_v2 nor cuEventElapsedTime is exported";
            LibKind::Driver.missing_symbol(&path, ("cuEventElapsedTime", detail.into()))
        })?;
    let mut ms = 0f32;
    // SAFETY: live events, valid out-pointer.
    let rc = unsafe { f(&mut ms, start, end) };
    check(rc, || "cuEventElapsedTime".into())?;
    Ok(ms)
}

// ---------------------------------------------------------------------------------------------
// Memory

/// `cuMemAlloc_v2`.
pub(crate) fn mem_alloc(bytes: usize) -> Result<CUdeviceptr, CudaError> {
    let mut p: CUdeviceptr = 0;
    // SAFETY: valid out-pointer; a context is current.
    let rc = unsafe { (api()?.cuMemAlloc)(&mut p, bytes) };
    check(rc, || format!("cuMemAlloc(bytes={bytes})"))?;
    Ok(p)
}

/// `cuMemFree_v2`.
///
/// # Safety
/// `p` must come from [`mem_alloc`] and not be used afterwards.
pub(crate) unsafe fn mem_free(p: CUdeviceptr) -> Result<(), CudaError> {
    let rc = (api()?.cuMemFree)(p);
    check(rc, || format!("cuMemFree(ptr={p:#x})"))
}

/// `cuMemHostAlloc` (page-locked host memory).
pub(crate) fn mem_host_alloc(bytes: usize) -> Result<*mut c_void, CudaError> {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointer; flags 0 = plain pinned memory.
    let rc = unsafe { (api()?.cuMemHostAlloc)(&mut p, bytes, 0) };
    check(rc, || format!("cuMemHostAlloc(bytes={bytes})"))?;
    Ok(p)
}

/// `cuMemFreeHost`.
///
/// # Safety
/// `p` must come from [`mem_host_alloc`] and not be used afterwards.
pub(crate) unsafe fn mem_free_host(p: *mut c_void) -> Result<(), CudaError> {
    let rc = (api()?.cuMemFreeHost)(p);
    check(rc, || "cuMemFreeHost".into())
}

/// `cuMemsetD8Async`.
///
/// # Safety
/// `[p, p+bytes)` must be device memory that stays allocated until the stream reaches the call.
pub(crate) unsafe fn memset_d8_async(
    p: CUdeviceptr,
    value: u8,
    bytes: usize,
    s: CUstream,
) -> Result<(), CudaError> {
    let rc = (api()?.cuMemsetD8Async)(p, value, bytes, s);
    check(rc, || format!("cuMemsetD8Async(ptr={p:#x}, bytes={bytes})"))
}

/// `cuMemcpyHtoDAsync_v2`.
///
/// # Safety
/// `src` must be readable for `bytes` and `dst` writable device memory, both valid until the
/// stream reaches the copy.
pub(crate) unsafe fn memcpy_htod_async(
    dst: CUdeviceptr,
    src: *const c_void,
    bytes: usize,
    s: CUstream,
) -> Result<(), CudaError> {
    let rc = (api()?.cuMemcpyHtoDAsync)(dst, src, bytes, s);
    check(rc, || {
        format!("cuMemcpyHtoDAsync(dst={dst:#x}, bytes={bytes})")
    })
}

/// `cuMemcpyDtoHAsync_v2`.
///
/// # Safety
/// `dst` must be writable for `bytes` and `src` device memory, both valid until the stream reaches
/// the copy.
pub(crate) unsafe fn memcpy_dtoh_async(
    dst: *mut c_void,
    src: CUdeviceptr,
    bytes: usize,
    s: CUstream,
) -> Result<(), CudaError> {
    let rc = (api()?.cuMemcpyDtoHAsync)(dst, src, bytes, s);
    check(rc, || {
        format!("cuMemcpyDtoHAsync(src={src:#x}, bytes={bytes})")
    })
}

/// `cuMemcpyDtoDAsync_v2`.
///
/// # Safety
/// Both ranges must be device memory valid until the stream reaches the copy.
pub(crate) unsafe fn memcpy_dtod_async(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    bytes: usize,
    s: CUstream,
) -> Result<(), CudaError> {
    let rc = (api()?.cuMemcpyDtoDAsync)(dst, src, bytes, s);
    check(rc, || {
        format!("cuMemcpyDtoDAsync(dst={dst:#x}, src={src:#x}, bytes={bytes})")
    })
}

// ---------------------------------------------------------------------------------------------
// Modules and launches

/// `cuModuleLoadData` from a CUBIN or NUL-terminated PTX image.
pub(crate) fn module_load_data(image: &[u8]) -> Result<CUmodule, CudaError> {
    let mut m: CUmodule = std::ptr::null_mut();
    // SAFETY: `image` is a complete CUBIN/PTX image (PTX is NUL-terminated by the caller) that
    // the driver copies during the call.
    let rc = unsafe { (api()?.cuModuleLoadData)(&mut m, image.as_ptr().cast()) };
    check(rc, || {
        format!("cuModuleLoadData(image of {} bytes)", image.len())
    })?;
    Ok(m)
}

/// `cuModuleUnload`.
///
/// # Safety
/// `m` must be a loaded module whose functions are no longer launched.
pub(crate) unsafe fn module_unload(m: CUmodule) -> Result<(), CudaError> {
    let rc = (api()?.cuModuleUnload)(m);
    check(rc, || "cuModuleUnload".into())
}

/// `cuModuleGetFunction`.
pub(crate) fn module_get_function(m: CUmodule, name: &str) -> Result<CUfunction, CudaError> {
    let cname = std::ffi::CString::new(name).map_err(|_| CudaError::InvalidArgument {
        op: "cuModuleGetFunction".into(),
        detail: format!("name {name:?} contains NUL"),
    })?;
    let mut f: CUfunction = std::ptr::null_mut();
    // SAFETY: live module, NUL-terminated name, valid out-pointer.
    let rc = unsafe { (api()?.cuModuleGetFunction)(&mut f, m, cname.as_ptr()) };
    check(rc, || format!("cuModuleGetFunction(name={name})"))?;
    Ok(f)
}

/// `cuLaunchKernel`.
///
/// # Safety
/// `params` must point to one pointer per kernel parameter, each pointing at a value of the
/// parameter's exact type; every device pointer among them must stay valid until the kernel ends.
pub(crate) unsafe fn launch_kernel(
    f: CUfunction,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    shared: u32,
    s: CUstream,
    params: *mut *mut c_void,
) -> Result<(), CudaError> {
    let rc = (api()?.cuLaunchKernel)(
        f,
        grid.0,
        grid.1,
        grid.2,
        block.0,
        block.1,
        block.2,
        shared,
        s,
        params,
        std::ptr::null_mut(),
    );
    check(rc, || {
        format!("cuLaunchKernel(grid={grid:?}, block={block:?}, shared={shared})")
    })
}

// ---------------------------------------------------------------------------------------------
// Graphs

/// `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`.
pub(crate) const CAPTURE_MODE_THREAD_LOCAL: c_int = 1;

/// `cuStreamBeginCapture_v2`.
pub(crate) fn stream_begin_capture(s: CUstream) -> Result<(), CudaError> {
    // SAFETY: live stream.
    let rc = unsafe { (api()?.cuStreamBeginCapture)(s, CAPTURE_MODE_THREAD_LOCAL) };
    check(rc, || "cuStreamBeginCapture".into())
}

/// `cuStreamEndCapture`.
pub(crate) fn stream_end_capture(s: CUstream) -> Result<CUgraph, CudaError> {
    let mut g: CUgraph = std::ptr::null_mut();
    // SAFETY: live stream in capture mode, valid out-pointer.
    let rc = unsafe { (api()?.cuStreamEndCapture)(s, &mut g) };
    check(rc, || "cuStreamEndCapture".into())?;
    Ok(g)
}

/// `cuGraphInstantiateWithFlags`.
pub(crate) fn graph_instantiate(g: CUgraph) -> Result<CUgraphExec, CudaError> {
    let mut e: CUgraphExec = std::ptr::null_mut();
    // SAFETY: live graph, valid out-pointer.
    let rc = unsafe { (api()?.cuGraphInstantiateWithFlags)(&mut e, g, 0) };
    check(rc, || "cuGraphInstantiateWithFlags".into())?;
    Ok(e)
}

/// `cuGraphLaunch`.
pub(crate) fn graph_launch(e: CUgraphExec, s: CUstream) -> Result<(), CudaError> {
    // SAFETY: live executable graph and stream.
    let rc = unsafe { (api()?.cuGraphLaunch)(e, s) };
    check(rc, || "cuGraphLaunch".into())
}

/// `cuGraphExecDestroy` + `cuGraphDestroy`.
///
/// # Safety
/// Both handles must be live and unused afterwards.
pub(crate) unsafe fn graph_destroy(e: CUgraphExec, g: CUgraph) -> Result<(), CudaError> {
    let a = api()?;
    let r1 = (a.cuGraphExecDestroy)(e);
    let r2 = (a.cuGraphDestroy)(g);
    check(r1, || "cuGraphExecDestroy".into())?;
    check(r2, || "cuGraphDestroy".into())
}
