//! The C types of `lockstep.h`: result codes, data types, reduction operators (NCCL's values),
//! the unique id, the communicator configuration, and the constants.

use std::ffi::{c_char, c_int, c_uint};

/// Bytes in a `lockstepUniqueId` (as `NCCL_UNIQUE_ID_BYTES`).
pub const LOCKSTEP_UNIQUE_ID_BYTES: usize = 128;

/// `color` for `lockstepCommSplit`: this rank joins no new communicator (as `NCCL_SPLIT_NOCOLOR`).
pub const LOCKSTEP_SPLIT_NOCOLOR: c_int = -1;

/// `shrinkFlags` of `lockstepCommShrink` (as `NCCL_SHRINK_DEFAULT`): shrink after a failure.
pub const LOCKSTEP_SHRINK_DEFAULT: c_int = 0;
/// `shrinkFlags` of `lockstepCommShrink` (as `NCCL_SHRINK_ABORT`): the same here, since a shrink
/// always fails the calls still running on the old communicator.
pub const LOCKSTEP_SHRINK_ABORT: c_int = 1;

/// The `magic` of a `lockstepConfig_t` that LOCKSTEP_CONFIG_INITIALIZER initialised (as
/// `NCCL_API_MAGIC`, with another value, so an `ncclConfig_t` passed by mistake is refused).
pub const LOCKSTEP_API_MAGIC: c_uint = 0x6c6b7374;

/// Result codes, with NCCL's values (`ncclResult_t`). Every function returns one.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum lockstepResult_t {
    /// The call succeeded.
    lockstepSuccess = 0,
    /// A CUDA call failed (device communicators only).
    lockstepUnhandledCudaError = 1,
    /// The operating system refused something (shared memory, a file, a process), or setting
    /// up the communicator failed.
    lockstepSystemError = 2,
    /// A bug in lockstep (a panic caught at the boundary): please report it with the message of
    /// lockstepGetLastError.
    lockstepInternalError = 3,
    /// An argument is wrong: a NULL or unknown pointer or communicator, a value outside its
    /// enum, buffer sizes that do not fit.
    lockstepInvalidArgument = 4,
    /// The call does not fit the state or the other ranks: ranks disagree on a collective's
    /// count, type, operator or root; a stream on a host communicator; GroupEnd without Start.
    lockstepInvalidUsage = 5,
    /// Another rank failed: it died, left, timed out or aborted the communicator.
    lockstepRemoteError = 6,
    /// An operation is still in progress (never returned: every lockstep call completes).
    lockstepInProgress = 7,
    /// A rank waited for its peers longer than the communicator's timeout (the config's
    /// `timeoutMs`, or LOCKSTEP_TIMEOUT_S): the communicator is broken, destroy it.
    lockstepTimeout = 8,
    /// The number of result codes.
    lockstepNumResults = 9,
}

/// Element types, with NCCL's values (`ncclDataType_t`). NCCL's aliases are macros naming the
/// enumerators: `lockstepChar`, `lockstepInt`, `lockstepHalf`, `lockstepFloat`, `lockstepDouble`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum lockstepDataType_t {
    /// `int8_t`.
    lockstepInt8 = 0,
    /// `uint8_t`.
    lockstepUint8 = 1,
    /// `int32_t`.
    lockstepInt32 = 2,
    /// `uint32_t`.
    lockstepUint32 = 3,
    /// `int64_t`.
    lockstepInt64 = 4,
    /// `uint64_t`.
    lockstepUint64 = 5,
    /// IEEE 754 half precision.
    lockstepFloat16 = 6,
    /// `float`.
    lockstepFloat32 = 7,
    /// `double`.
    lockstepFloat64 = 8,
    /// bfloat16.
    lockstepBfloat16 = 9,
    /// FP8 E4M3, NCCL's value reserved: not supported yet (lockstepInvalidArgument).
    lockstepFloat8e4m3 = 10,
    /// FP8 E5M2, NCCL's value reserved: not supported yet (lockstepInvalidArgument).
    lockstepFloat8e5m2 = 11,
    /// The number of element types.
    lockstepNumTypes = 12,
}

/// Reduction operators, with NCCL's values (`ncclRedOp_t`). Integer sums and products wrap;
/// `lockstepAvg` divides the sum by the number of ranks (integer division for integer types).
/// Every rank gets bit-identical results: sources are combined in rank order.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum lockstepRedOp_t {
    /// Element-wise sum.
    lockstepSum = 0,
    /// Element-wise product.
    lockstepProd = 1,
    /// Element-wise maximum.
    lockstepMax = 2,
    /// Element-wise minimum.
    lockstepMin = 3,
    /// Element-wise average.
    lockstepAvg = 4,
    /// The number of operators.
    lockstepNumOps = 5,
    /// Keeps the enum int-sized, as NCCL's.
    lockstepMaxRedOp = 2147483647,
}

/// A data type as C passes it: checked before use (named `lockstepDataType_t` in the header).
pub type DataTypeArg = c_int;
/// A reduction operator as C passes it: checked before use (named `lockstepRedOp_t` in the header).
pub type RedOpArg = c_int;
/// A result code as C passes it: checked before use (named `lockstepResult_t` in the header).
pub type ResultArg = c_int;

/// What ranks need to find each other: made by lockstepGetUniqueId on one rank, handed to the
/// others (by any means: a file, a socket, MPI, fork) and passed to lockstepCommInitRank. It holds
/// a fresh random job id, naming the shared-memory segment the ranks meet in, and the host it was
/// made on: the ranks must share that host. Plain bytes: copy it freely.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct lockstepUniqueId {
    /// Opaque contents.
    pub internal: [c_char; LOCKSTEP_UNIQUE_ID_BYTES],
}

/// Communicator settings for lockstepCommInitRankConfig and lockstepCommSplit, shaped like
/// `ncclConfig_t`: declare it as `lockstepConfig_t config = LOCKSTEP_CONFIG_INITIALIZER;`, then
/// set the fields you need. A field left at LOCKSTEP_CONFIG_UNDEF_INT / LOCKSTEP_CONFIG_UNDEF_PTR
/// keeps its default. A config that LOCKSTEP_CONFIG_INITIALIZER did not initialise (wrong `size`,
/// `magic` or `version`), or a field out of range, is lockstepInvalidArgument.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct lockstepConfig_t {
    /// `sizeof(lockstepConfig_t)` (set by the initializer; do not change).
    pub size: usize,
    /// LOCKSTEP_API_MAGIC (set by the initializer; do not change).
    pub magic: c_uint,
    /// LOCKSTEP_VERSION_CODE of the header the program was built with (set by the initializer; do
    /// not change).
    pub version: c_uint,
    /// 1 or 0, as NCCL's `blocking`. Every lockstep call completes before it returns, so both
    /// behave alike: a non-blocking communicator never reports lockstepInProgress.
    pub blocking: c_int,
    /// Milliseconds a rank waits for its peers in one call before it fails with lockstepTimeout
    /// (> 0; default LOCKSTEP_TIMEOUT_S, 600 s). No NCCL twin.
    pub timeoutMs: c_int,
    /// A name for the communicator (NUL-terminated, copied), quoted in its error messages, as
    /// NCCL's `commName`.
    pub commName: *const c_char,
}
