//! Result layer for NCCL: function tables over `libnccl` and one wrapper per call.
//!
//! `NcclCore` (version, unique id, error strings) is resolved at load time; `NcclFns`
//! (communicators and collectives) on first use, so a fake library exporting only the core calls
//! is enough for the loading tests. Return codes are read as `c_int`.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

pub(crate) use cudarc::nccl::sys::{
    cudaStream_t, ncclComm_t, ncclConfig_v21700 as ncclConfig_t, ncclDataType_t, ncclRedOp_t,
    ncclUniqueId,
};

use crate::comm::{Dtype, ReduceOp};
use crate::cuda::discovery::{self, LibKind, Verdict};
use crate::cuda::CudaError;

use super::error::{hint, NcclError};

/// `NCCL_SPLIT_NOCOLOR`: `ncclCommSplit`'s color for ranks that join no new communicator.
pub(crate) const SPLIT_NOCOLOR: c_int = -1;
/// `ncclSuccess`.
pub(crate) const SUCCESS: c_int = 0;
/// `ncclInProgress` (non-blocking communicators).
pub(crate) const IN_PROGRESS: c_int = 7;

fn_table! {
    /// Calls that work without CUDA.
    pub(crate) struct NcclCoreFns {
        required {
            ncclGetVersion = "ncclGetVersion": fn(*mut c_int) -> c_int;
            ncclGetUniqueId = "ncclGetUniqueId": fn(*mut ncclUniqueId) -> c_int;
            ncclGetErrorString = "ncclGetErrorString": fn(c_int) -> *const c_char;
        }
        optional {
            ncclGetLastError = "ncclGetLastError": fn(ncclComm_t) -> *const c_char;
        }
    }
}

fn_table! {
    /// Communicators and collectives (NCCL ≥ 2.18).
    pub(crate) struct NcclFns {
        required {
            ncclCommInitRank = "ncclCommInitRank": fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> c_int;
            ncclCommGetAsyncError = "ncclCommGetAsyncError": fn(ncclComm_t, *mut c_int) -> c_int;
            ncclCommAbort = "ncclCommAbort": fn(ncclComm_t) -> c_int;
            ncclCommDestroy = "ncclCommDestroy": fn(ncclComm_t) -> c_int;
            ncclCommCount = "ncclCommCount": fn(ncclComm_t, *mut c_int) -> c_int;
            ncclCommCuDevice = "ncclCommCuDevice": fn(ncclComm_t, *mut c_int) -> c_int;
            ncclCommUserRank = "ncclCommUserRank": fn(ncclComm_t, *mut c_int) -> c_int;
            ncclAllReduce = "ncclAllReduce": fn(*const c_void, *mut c_void, usize, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t) -> c_int;
            ncclBroadcast = "ncclBroadcast": fn(*const c_void, *mut c_void, usize, ncclDataType_t, c_int, ncclComm_t, cudaStream_t) -> c_int;
            ncclReduce = "ncclReduce": fn(*const c_void, *mut c_void, usize, ncclDataType_t, ncclRedOp_t, c_int, ncclComm_t, cudaStream_t) -> c_int;
            ncclAllGather = "ncclAllGather": fn(*const c_void, *mut c_void, usize, ncclDataType_t, ncclComm_t, cudaStream_t) -> c_int;
            ncclReduceScatter = "ncclReduceScatter": fn(*const c_void, *mut c_void, usize, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t) -> c_int;
            ncclSend = "ncclSend": fn(*const c_void, usize, ncclDataType_t, c_int, ncclComm_t, cudaStream_t) -> c_int;
            ncclRecv = "ncclRecv": fn(*mut c_void, usize, ncclDataType_t, c_int, ncclComm_t, cudaStream_t) -> c_int;
            ncclGroupStart = "ncclGroupStart": fn() -> c_int;
            ncclGroupEnd = "ncclGroupEnd": fn() -> c_int;
        }
        optional {
            ncclCommInitRankConfig = "ncclCommInitRankConfig": fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int, *mut ncclConfig_t) -> c_int;
            ncclCommFinalize = "ncclCommFinalize": fn(ncclComm_t) -> c_int;
            // Optional so that a library without it still runs everything but `split`.
            ncclCommSplit = "ncclCommSplit": fn(ncclComm_t, c_int, c_int, *mut ncclComm_t, *mut ncclConfig_t) -> c_int;
        }
    }
}

/// The loaded NCCL library.
pub(crate) struct NcclCore {
    #[allow(dead_code)]
    loaded: discovery::Loaded,
    pub path: String,
    pub origin: String,
    /// Why this library was chosen.
    pub reason: String,
    /// `ncclGetVersion` code.
    pub version: i32,
    pub f: NcclCoreFns,
}

static CORE: OnceLock<Result<NcclCore, CudaError>> = OnceLock::new();
static FULL: OnceLock<Result<NcclFns, CudaError>> = OnceLock::new();

/// Minimum NCCL: 2.18.
pub(crate) const MIN_VERSION: i32 = 21800;

/// Load NCCL (once per process).
pub(crate) fn core() -> Result<&'static NcclCore, CudaError> {
    discovery::cached(&CORE, load_core)
}

fn load_core() -> Result<NcclCore, CudaError> {
    let loaded =
        discovery::load(
            LibKind::Nccl,
            "ncclGetVersion",
            |lib, _| match NcclCoreFns::resolve(lib) {
                Err((sym, _)) => Verdict::Reject(format!("no symbol {sym}")),
                Ok(f) => {
                    let mut v = 0;
                    // SAFETY: valid out-pointer.
                    unsafe { (f.ncclGetVersion)(&mut v) };
                    if v < MIN_VERSION {
                        Verdict::Reject(format!(
                            "NCCL {} is older than 2.18",
                            discovery::nccl_version_string(v)
                        ))
                    } else {
                        Verdict::Accept
                    }
                }
            },
        )?;
    let f = LibKind::Nccl.resolve(&loaded, NcclCoreFns::resolve)?;
    let mut version = 0;
    // SAFETY: valid out-pointer.
    unsafe { (f.ncclGetVersion)(&mut version) };
    Ok(NcclCore {
        path: loaded.path.clone(),
        origin: loaded.origin.clone(),
        reason: loaded.reason.clone(),
        loaded,
        version,
        f,
    })
}

/// The full table.
pub(crate) fn api() -> Result<&'static NcclFns, CudaError> {
    let c = core()?;
    discovery::cached(&FULL, || LibKind::Nccl.resolve(&c.loaded, NcclFns::resolve))
}

/// Map a status to `Result`, naming the call; `comm` adds `ncclGetLastError` text.
pub(crate) fn check(
    code: c_int,
    comm: Option<ncclComm_t>,
    call: impl FnOnce() -> String,
) -> Result<(), NcclError> {
    if code == SUCCESS {
        return Ok(());
    }
    let (mut message, mut last) = (format!("ncclResult_t {code}"), String::new());
    if let Ok(c) = core() {
        // SAFETY: ncclGetErrorString returns a static string for any code.
        let p = unsafe { (c.f.ncclGetErrorString)(code) };
        if !p.is_null() {
            // SAFETY: see above.
            message = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
        }
        if let Some(gle) = c.f.ncclGetLastError {
            // SAFETY: ncclGetLastError accepts a communicator or null and returns a static/owned
            // NUL-terminated string valid until the next NCCL call on this thread.
            let p = unsafe { gle(comm.unwrap_or(std::ptr::null_mut())) };
            if !p.is_null() {
                // SAFETY: see above.
                let s = unsafe { CStr::from_ptr(p) }
                    .to_string_lossy()
                    .trim()
                    .to_string();
                if !s.is_empty() {
                    last = format!("; {s}");
                }
            }
        }
    }
    Err(NcclError::Call {
        call: call(),
        code,
        message,
        last,
        hint: hint(code),
    })
}

/// `ncclGetUniqueId` (rank 0 only, after the fork).
pub(crate) fn get_unique_id() -> Result<ncclUniqueId, NcclError> {
    let c = core()?;
    let mut id = ncclUniqueId { internal: [0; 128] };
    // SAFETY: valid out-pointer.
    let rc = unsafe { (c.f.ncclGetUniqueId)(&mut id) };
    check(rc, None, || "ncclGetUniqueId()".into())?;
    Ok(id)
}

/// The NCCL type of a lockstep dtype.
pub(crate) fn nccl_dtype(d: Dtype) -> ncclDataType_t {
    match d {
        Dtype::F32 => ncclDataType_t::ncclFloat32,
        Dtype::F64 => ncclDataType_t::ncclFloat64,
        Dtype::F16 => ncclDataType_t::ncclFloat16,
        Dtype::BF16 => ncclDataType_t::ncclBfloat16,
        Dtype::I32 => ncclDataType_t::ncclInt32,
        Dtype::I64 => ncclDataType_t::ncclInt64,
        Dtype::U8 => ncclDataType_t::ncclUint8,
        Dtype::I8 => ncclDataType_t::ncclInt8,
        Dtype::U32 => ncclDataType_t::ncclUint32,
        Dtype::U64 => ncclDataType_t::ncclUint64,
    }
}

/// The NCCL operator of a lockstep op (`Avg` → `ncclAvg`, NCCL ≥ 2.10).
pub(crate) fn nccl_op(o: ReduceOp) -> ncclRedOp_t {
    match o {
        ReduceOp::Sum => ncclRedOp_t::ncclSum,
        ReduceOp::Prod => ncclRedOp_t::ncclProd,
        ReduceOp::Min => ncclRedOp_t::ncclMin,
        ReduceOp::Max => ncclRedOp_t::ncclMax,
        ReduceOp::Avg => ncclRedOp_t::ncclAvg,
    }
}

/// `NCCL_CONFIG_INITIALIZER` for the 2.18 config layout, with `blocking` set.
pub(crate) fn config(blocking: bool) -> ncclConfig_t {
    const UNDEF_INT: c_int = i32::MIN;
    ncclConfig_t {
        size: std::mem::size_of::<ncclConfig_t>(),
        magic: 0xcafebeef,
        version: 21800,
        blocking: blocking as c_int,
        cgaClusterSize: UNDEF_INT,
        minCTAs: UNDEF_INT,
        maxCTAs: UNDEF_INT,
        netName: std::ptr::null(),
        splitShare: UNDEF_INT,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_and_op_mapping_matches_nccl_h() {
        assert_eq!(nccl_dtype(Dtype::I8) as u32, 0);
        assert_eq!(nccl_dtype(Dtype::U8) as u32, 1);
        assert_eq!(nccl_dtype(Dtype::I32) as u32, 2);
        assert_eq!(nccl_dtype(Dtype::U32) as u32, 3);
        assert_eq!(nccl_dtype(Dtype::I64) as u32, 4);
        assert_eq!(nccl_dtype(Dtype::U64) as u32, 5);
        assert_eq!(nccl_dtype(Dtype::F16) as u32, 6);
        assert_eq!(nccl_dtype(Dtype::F32) as u32, 7);
        assert_eq!(nccl_dtype(Dtype::F64) as u32, 8);
        assert_eq!(nccl_dtype(Dtype::BF16) as u32, 9);
        assert_eq!(nccl_op(ReduceOp::Sum) as u32, 0);
        assert_eq!(nccl_op(ReduceOp::Prod) as u32, 1);
        assert_eq!(nccl_op(ReduceOp::Max) as u32, 2);
        assert_eq!(nccl_op(ReduceOp::Min) as u32, 3);
        assert_eq!(nccl_op(ReduceOp::Avg) as u32, 4);
    }

    #[test]
    fn config_initializer() {
        let c = config(false);
        assert_eq!(c.magic, 0xcafebeef);
        assert_eq!(c.blocking, 0);
        assert_eq!(c.size, std::mem::size_of::<ncclConfig_t>());
        assert_eq!(std::mem::size_of::<ncclUniqueId>(), 128);
    }
}
