//! Result layer: one wrapper per MPI call, each turning the return code into an [`MpiError`]
//! that names the call and carries `MPI_Error_string`. Handles are the raw `sys` types; the
//! safe owners are in `comm`.

use std::ffi::{c_char, c_int, c_void, CStr};

use crate::types::{Dtype, ReduceOp};

use super::discovery::{loaded, MpiFns};
use super::error::{hint, MpiError};
use super::sys::{
    MPI_Comm, MPI_Count, MPI_Datatype, MPI_Errhandler, MPI_Op, MPI_Request, MPI_Status,
    MPI_COMM_NULL, MPI_COMM_TYPE_SHARED, MPI_DOUBLE, MPI_FLOAT, MPI_INFO_NULL, MPI_INT32_T,
    MPI_INT64_T, MPI_INT8_T, MPI_MAX, MPI_MAX_ERROR_STRING, MPI_MIN, MPI_PROD, MPI_REQUEST_NULL,
    MPI_SUCCESS, MPI_SUM, MPI_UINT32_T, MPI_UINT64_T, MPI_UINT8_T, MPI_UNDEFINED,
};

/// The function table of the loaded library.
pub(crate) fn api() -> Result<&'static MpiFns, MpiError> {
    Ok(&loaded()?.f)
}

/// `MPI_Error_string` of `code`, or a plain description when the library cannot say.
pub(crate) fn error_string(code: c_int) -> String {
    let Ok(f) = api() else {
        return format!("MPI error {code}");
    };
    let mut buf = vec![0 as c_char; MPI_MAX_ERROR_STRING + 1];
    let mut len: c_int = 0;
    // SAFETY: the buffer holds MPI_MAX_ERROR_STRING characters, the ABI's bound; the extra
    // element keeps it NUL-terminated.
    let rc = unsafe { (f.MPI_Error_string)(code, buf.as_mut_ptr(), &mut len) };
    if rc != MPI_SUCCESS {
        return format!("MPI error {code}");
    }
    // SAFETY: NUL-terminated (see above).
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .trim()
        .to_string()
}

/// `MPI_Error_class` of `code` (the code itself when the library cannot say).
pub(crate) fn error_class(code: c_int) -> c_int {
    let Ok(f) = api() else { return code };
    let mut class = code;
    // SAFETY: valid out-pointer.
    let rc = unsafe { (f.MPI_Error_class)(code, &mut class) };
    if rc == MPI_SUCCESS {
        class
    } else {
        code
    }
}

/// Map a return code to `Result`, naming the call.
pub(crate) fn check(code: c_int, call: impl FnOnce() -> String) -> Result<(), MpiError> {
    if code == MPI_SUCCESS {
        return Ok(());
    }
    let class = error_class(code);
    Err(MpiError::Call {
        call: call(),
        code,
        class,
        message: error_string(code),
        hint: hint(class),
    })
}

/// The shape of every MPI call that answers through a pointer: `post` gets an out-parameter
/// that starts as `init`, and its value is the answer once the return code is checked.
fn answer<T>(
    init: T,
    call: impl FnOnce() -> String,
    post: impl FnOnce(&mut T) -> c_int,
) -> Result<T, MpiError> {
    let mut out = init;
    check(post(&mut out), call)?;
    Ok(out)
}

/// `MPI_Initialized`.
pub(crate) fn initialized() -> Result<bool, MpiError> {
    flag(api()?.MPI_Initialized, "MPI_Initialized")
}

/// `MPI_Finalized`.
pub(crate) fn finalized() -> Result<bool, MpiError> {
    flag(api()?.MPI_Finalized, "MPI_Finalized")
}

/// The flag that `get` (`MPI_Initialized` or `MPI_Finalized`, named `name`) answers.
fn flag(get: unsafe extern "C" fn(*mut c_int) -> c_int, name: &str) -> Result<bool, MpiError> {
    // SAFETY: valid out-pointer; both functions may be called at any time.
    let flag = answer(0, || name.into(), |flag| unsafe { get(flag) })?;
    Ok(flag != 0)
}

/// `MPI_Init_thread(NULL, NULL, required, &provided)`: the level provided.
pub(crate) fn init_thread(required: c_int) -> Result<c_int, MpiError> {
    let f = api()?;
    let call = || format!("MPI_Init_thread(required {required})");
    // SAFETY: null argc/argv are allowed since MPI-2; valid out-pointer. The caller ensures MPI
    // is neither initialised nor finalised.
    answer(0, call, |provided| unsafe {
        (f.MPI_Init_thread)(
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            required,
            provided,
        )
    })
}

/// `MPI_Query_thread`.
pub(crate) fn query_thread() -> Result<c_int, MpiError> {
    let f = api()?;
    // SAFETY: valid out-pointer; MPI is initialised (the caller checked).
    answer(
        0,
        || "MPI_Query_thread".into(),
        |provided| unsafe { (f.MPI_Query_thread)(provided) },
    )
}

/// `MPI_Finalize`.
pub(crate) fn finalize() -> Result<(), MpiError> {
    let f = api()?;
    // SAFETY: the caller initialised MPI and holds no communicator or request any more.
    check(unsafe { (f.MPI_Finalize)() }, || "MPI_Finalize".into())
}

/// `MPI_Comm_rank`.
pub(crate) fn comm_rank(comm: MPI_Comm) -> Result<usize, MpiError> {
    comm_number(comm, api()?.MPI_Comm_rank, "MPI_Comm_rank")
}

/// `MPI_Comm_size`.
pub(crate) fn comm_size(comm: MPI_Comm) -> Result<usize, MpiError> {
    comm_number(comm, api()?.MPI_Comm_size, "MPI_Comm_size")
}

/// The number that `get` (`MPI_Comm_rank` or `MPI_Comm_size`, named `name`) answers of `comm`.
fn comm_number(
    comm: MPI_Comm,
    get: unsafe extern "C" fn(MPI_Comm, *mut c_int) -> c_int,
    name: &str,
) -> Result<usize, MpiError> {
    // SAFETY: `comm` is a live communicator; valid out-pointer.
    let v = answer(0, || name.into(), |v| unsafe { get(comm, v) })?;
    Ok(v.max(0) as usize)
}

/// `MPI_Comm_dup` (collective over `comm`).
pub(crate) fn comm_dup(comm: MPI_Comm) -> Result<MPI_Comm, MpiError> {
    let f = api()?;
    // SAFETY: `comm` is a live communicator; valid out-pointer.
    answer(
        MPI_COMM_NULL,
        || "MPI_Comm_dup".into(),
        |out| unsafe { (f.MPI_Comm_dup)(comm, out) },
    )
}

/// `MPI_Comm_split` (collective): `None` as color joins no new communicator (`MPI_UNDEFINED`),
/// and gets `MPI_COMM_NULL`.
pub(crate) fn comm_split(
    comm: MPI_Comm,
    color: Option<u32>,
    key: i32,
) -> Result<MPI_Comm, MpiError> {
    let f = api()?;
    let c = match color {
        Some(c) => c_int::try_from(c).map_err(|_| {
            MpiError::InvalidArgument(format!("split color {c} does not fit a C int"))
        })?,
        None => MPI_UNDEFINED,
    };
    let call = || format!("MPI_Comm_split(color {c}, key {key})");
    // SAFETY: `comm` is a live communicator; valid out-pointer.
    answer(MPI_COMM_NULL, call, |out| unsafe {
        (f.MPI_Comm_split)(comm, c, key, out)
    })
}

/// `MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, key, MPI_INFO_NULL)` (collective): the
/// ranks that can share memory with this one.
pub(crate) fn comm_split_shared(comm: MPI_Comm, key: i32) -> Result<MPI_Comm, MpiError> {
    let f = api()?;
    let call = || format!("MPI_Comm_split_type(MPI_COMM_TYPE_SHARED, key {key})");
    // SAFETY: `comm` is a live communicator; MPI_INFO_NULL is a predefined handle; valid
    // out-pointer.
    answer(MPI_COMM_NULL, call, |out| unsafe {
        (f.MPI_Comm_split_type)(comm, MPI_COMM_TYPE_SHARED, key, MPI_INFO_NULL, out)
    })
}

/// `MPI_Comm_free`.
pub(crate) fn comm_free(comm: &mut MPI_Comm) -> Result<(), MpiError> {
    let f = api()?;
    // SAFETY: `comm` is a communicator this process created and no longer uses.
    check(unsafe { (f.MPI_Comm_free)(comm) }, || {
        "MPI_Comm_free".into()
    })
}

/// `MPI_Comm_set_errhandler`.
pub(crate) fn comm_set_errhandler(comm: MPI_Comm, eh: MPI_Errhandler) -> Result<(), MpiError> {
    let f = api()?;
    // SAFETY: `comm` is a live communicator, `eh` a predefined error handler.
    check(unsafe { (f.MPI_Comm_set_errhandler)(comm, eh) }, || {
        "MPI_Comm_set_errhandler".into()
    })
}

/// `MPI_Isend_c` of `len` bytes.
///
/// # Safety
/// `buf..buf+len` must stay valid and unchanged until the request completes or is freed.
pub(crate) unsafe fn isend_bytes(
    buf: *const u8,
    len: usize,
    dest: c_int,
    tag: c_int,
    comm: MPI_Comm,
) -> Result<MPI_Request, MpiError> {
    let f = api()?;
    let call = || format!("MPI_Isend_c({len} bytes to rank {dest}, tag {tag})");
    let (buf, n, byte) = (buf.cast::<c_void>(), len as MPI_Count, super::sys::MPI_BYTE);
    // SAFETY: the caller keeps the buffer alive; `comm` is live; valid out-pointer.
    answer(MPI_REQUEST_NULL, call, |req| unsafe {
        (f.MPI_Isend_c)(buf, n, byte, dest, tag, comm, req)
    })
}

/// `MPI_Irecv_c` of up to `len` bytes.
///
/// # Safety
/// `buf..buf+len` must stay valid and otherwise untouched until the request completes or is
/// freed.
pub(crate) unsafe fn irecv_bytes(
    buf: *mut u8,
    len: usize,
    source: c_int,
    tag: c_int,
    comm: MPI_Comm,
) -> Result<MPI_Request, MpiError> {
    let f = api()?;
    let call = || format!("MPI_Irecv_c({len} bytes from rank {source}, tag {tag})");
    let (buf, n, byte) = (buf.cast::<c_void>(), len as MPI_Count, super::sys::MPI_BYTE);
    // SAFETY: the caller keeps the buffer alive and unaliased; `comm` is live; valid out-pointer.
    answer(MPI_REQUEST_NULL, call, |req| unsafe {
        (f.MPI_Irecv_c)(buf, n, byte, source, tag, comm, req)
    })
}

/// `MPI_Ibarrier`.
pub(crate) fn ibarrier(comm: MPI_Comm) -> Result<MPI_Request, MpiError> {
    let f = api()?;
    // SAFETY: `comm` is live; valid out-pointer.
    answer(
        MPI_REQUEST_NULL,
        || "MPI_Ibarrier".into(),
        |req| unsafe { (f.MPI_Ibarrier)(comm, req) },
    )
}

/// `MPI_Iallreduce_c(MPI_IN_PLACE, buf, count, ...)`.
///
/// # Safety
/// `buf` must hold `count` elements of `dtype` and stay valid and untouched until the request
/// completes or is freed.
pub(crate) unsafe fn iallreduce_in_place(
    buf: *mut c_void,
    count: usize,
    dtype: MPI_Datatype,
    op: MPI_Op,
    comm: MPI_Comm,
) -> Result<MPI_Request, MpiError> {
    let f = api()?;
    // MPI_IN_PLACE is `(void*)1` in the ABI.
    let in_place = std::ptr::without_provenance::<c_void>(1);
    let call = || format!("MPI_Iallreduce_c({count} elements)");
    // SAFETY: the caller keeps the buffer alive; `comm`, `dtype`, `op` are valid handles.
    answer(MPI_REQUEST_NULL, call, |req| unsafe {
        (f.MPI_Iallreduce_c)(in_place, buf, count as MPI_Count, dtype, op, comm, req)
    })
}

/// `MPI_Iallgather_c` of `len` bytes from each rank into `recv` (`len * size` bytes).
///
/// # Safety
/// Both buffers must stay valid (and `recv` untouched) until the request completes or is freed.
pub(crate) unsafe fn iallgather_bytes(
    send: *const u8,
    len: usize,
    recv: *mut u8,
    comm: MPI_Comm,
) -> Result<MPI_Request, MpiError> {
    let f = api()?;
    let (n, byte) = (len as MPI_Count, super::sys::MPI_BYTE);
    let (send, recv) = (send.cast::<c_void>(), recv.cast::<c_void>());
    let call = || format!("MPI_Iallgather_c({len} bytes per rank)");
    // SAFETY: the caller keeps the buffers alive; `comm` is live; valid out-pointer.
    answer(MPI_REQUEST_NULL, call, |req| unsafe {
        (f.MPI_Iallgather_c)(send, n, byte, recv, n, byte, comm, req)
    })
}

/// `MPI_Test` on one request: whether it completed (then it became `MPI_REQUEST_NULL` and
/// `status` describes it). A request that failed is an error named by `call`.
///
/// One request at a time, not `MPI_Testall`: MPICH raises a failed request of `MPI_Testall` on
/// the fatal error handler instead of the request's communicator, so `MPI_ERRORS_RETURN` would
/// not hold.
pub(crate) fn test(
    req: &mut MPI_Request,
    status: &mut MPI_Status,
    call: impl FnOnce() -> String,
) -> Result<bool, MpiError> {
    let f = api()?;
    let mut flag = 0;
    // SAFETY: `req` is live or null; `status` is a valid out-parameter.
    let rc = unsafe { (f.MPI_Test)(req, &mut flag, status) };
    check(rc, call)?;
    Ok(flag != 0)
}

/// `MPI_Cancel`.
pub(crate) fn cancel(req: &mut MPI_Request) -> Result<(), MpiError> {
    let f = api()?;
    // SAFETY: `req` is a live request.
    check(unsafe { (f.MPI_Cancel)(req) }, || "MPI_Cancel".into())
}

/// `MPI_Request_free`: the request completes on its own; its buffer must outlive it.
pub(crate) fn request_free(req: &mut MPI_Request) -> Result<(), MpiError> {
    let f = api()?;
    // SAFETY: `req` is a live request; the caller keeps its buffer alive for good.
    check(unsafe { (f.MPI_Request_free)(req) }, || {
        "MPI_Request_free".into()
    })
}

/// `MPI_Get_count_c` in bytes.
pub(crate) fn get_count_bytes(status: &MPI_Status) -> Result<usize, MpiError> {
    let f = api()?;
    // SAFETY: `status` is a status MPI filled in; valid out-pointer.
    let n: MPI_Count = answer(
        0,
        || "MPI_Get_count_c".into(),
        |n| unsafe { (f.MPI_Get_count_c)(status, super::sys::MPI_BYTE, n) },
    )?;
    Ok(n.max(0) as usize)
}

/// The ABI datatype of a lockstep dtype (`None`: the ABI has no predefined 16-bit float).
pub(crate) fn datatype(d: Dtype) -> Option<MPI_Datatype> {
    Some(match d {
        Dtype::F32 => MPI_FLOAT,
        Dtype::F64 => MPI_DOUBLE,
        Dtype::I32 => MPI_INT32_T,
        Dtype::I64 => MPI_INT64_T,
        Dtype::U32 => MPI_UINT32_T,
        Dtype::U64 => MPI_UINT64_T,
        Dtype::I8 => MPI_INT8_T,
        Dtype::U8 => MPI_UINT8_T,
        Dtype::F16 | Dtype::BF16 => return None,
    })
}

/// The ABI operator of a lockstep op (`None`: MPI has no average).
pub(crate) fn op(o: ReduceOp) -> Option<MPI_Op> {
    Some(match o {
        ReduceOp::Sum => MPI_SUM,
        ReduceOp::Prod => MPI_PROD,
        ReduceOp::Min => MPI_MIN,
        ReduceOp::Max => MPI_MAX,
        ReduceOp::Avg => return None,
    })
}
