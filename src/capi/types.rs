//! The C types of `lockstep.h`: result codes, data types, reduction operators (NCCL's values),
//! the unique id, and the constants.

use std::ffi::{c_char, c_int};

/// Bytes in a `lockstepUniqueId` (as `NCCL_UNIQUE_ID_BYTES`).
pub const LOCKSTEP_UNIQUE_ID_BYTES: usize = 128;

/// `color` for `lockstepCommSplit`: this rank joins no new communicator (as `NCCL_SPLIT_NOCOLOR`).
pub const LOCKSTEP_SPLIT_NOCOLOR: c_int = -1;

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
    /// The number of result codes.
    lockstepNumResults = 8,
}

/// Element types, with NCCL's values (`ncclDataType_t`). NCCL's aliases are macros:
/// `lockstepChar`, `lockstepInt`, `lockstepHalf`, `lockstepFloat`, `lockstepDouble`.
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
    /// The number of element types.
    lockstepNumTypes = 10,
}

/// `lockstepInt8`, as `ncclChar`.
pub const lockstepChar: c_int = 0;
/// `lockstepInt32`, as `ncclInt`.
pub const lockstepInt: c_int = 2;
/// `lockstepFloat16`, as `ncclHalf`.
pub const lockstepHalf: c_int = 6;
/// `lockstepFloat32`, as `ncclFloat`.
pub const lockstepFloat: c_int = 7;
/// `lockstepFloat64`, as `ncclDouble`.
pub const lockstepDouble: c_int = 8;

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
