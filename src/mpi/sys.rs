//! The raw types and constants of the MPI-5 standard ABI (`mpi_abi.h`, ABI version 1.0) that
//! lockstep uses. Handles are pointers to incomplete structs; the predefined handles are small
//! integers fixed by the standard, so they are the same in every ABI library (MPICH ≥ 5,
//! Open MPI ≥ 6) and need no symbol lookup. Error classes, thread levels and split types are
//! the header's enum values; `MPI_Status` has the standard's fixed layout.

#![allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    dead_code
)]

use std::ffi::c_int;
use std::ptr::without_provenance_mut;

/// Declares an opaque handle type: a pointer to an incomplete struct, as `mpi_abi.h` does.
macro_rules! opaque_handle {
    ($($(#[$m:meta])* $handle:ident = $incomplete:ident;)*) => {$(
        #[doc(hidden)]
        #[repr(C)]
        pub(crate) struct $incomplete {
            _private: [u8; 0],
        }
        $(#[$m])*
        pub(crate) type $handle = *mut $incomplete;
    )*};
}

opaque_handle! {
    /// `MPI_Comm`.
    MPI_Comm = MPI_ABI_Comm;
    /// `MPI_Datatype`.
    MPI_Datatype = MPI_ABI_Datatype;
    /// `MPI_Op`.
    MPI_Op = MPI_ABI_Op;
    /// `MPI_Info`.
    MPI_Info = MPI_ABI_Info;
    /// `MPI_Errhandler`.
    MPI_Errhandler = MPI_ABI_Errhandler;
    /// `MPI_Request`.
    MPI_Request = MPI_ABI_Request;
}

/// `MPI_Count` (64-bit in the ABI).
pub(crate) type MPI_Count = i64;

/// `MPI_Status`: the three public fields, then five ints the library owns.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct MPI_Status {
    pub MPI_SOURCE: c_int,
    pub MPI_TAG: c_int,
    pub MPI_ERROR: c_int,
    pub MPI_internal: [c_int; 5],
}

/// The ABI version lockstep is written against (`MPI_ABI_VERSION`); minor versions only add.
pub(crate) const MPI_ABI_VERSION: c_int = 1;

pub(crate) const MPI_COMM_NULL: MPI_Comm = without_provenance_mut(0x100);
pub(crate) const MPI_COMM_WORLD: MPI_Comm = without_provenance_mut(0x101);
pub(crate) const MPI_COMM_SELF: MPI_Comm = without_provenance_mut(0x102);

pub(crate) const MPI_INFO_NULL: MPI_Info = without_provenance_mut(0x130);

pub(crate) const MPI_ERRORS_ARE_FATAL: MPI_Errhandler = without_provenance_mut(0x141);
pub(crate) const MPI_ERRORS_RETURN: MPI_Errhandler = without_provenance_mut(0x143);

pub(crate) const MPI_REQUEST_NULL: MPI_Request = without_provenance_mut(0x180);

pub(crate) const MPI_SUM: MPI_Op = without_provenance_mut(0x21);
pub(crate) const MPI_MIN: MPI_Op = without_provenance_mut(0x22);
pub(crate) const MPI_MAX: MPI_Op = without_provenance_mut(0x23);
pub(crate) const MPI_PROD: MPI_Op = without_provenance_mut(0x24);

pub(crate) const MPI_BYTE: MPI_Datatype = without_provenance_mut(0x247);
pub(crate) const MPI_INT32_T: MPI_Datatype = without_provenance_mut(0x250);
pub(crate) const MPI_UINT32_T: MPI_Datatype = without_provenance_mut(0x251);
pub(crate) const MPI_INT64_T: MPI_Datatype = without_provenance_mut(0x258);
pub(crate) const MPI_UINT64_T: MPI_Datatype = without_provenance_mut(0x259);
pub(crate) const MPI_INT8_T: MPI_Datatype = without_provenance_mut(0x240);
pub(crate) const MPI_UINT8_T: MPI_Datatype = without_provenance_mut(0x241);
pub(crate) const MPI_FLOAT: MPI_Datatype = without_provenance_mut(0x210);
pub(crate) const MPI_DOUBLE: MPI_Datatype = without_provenance_mut(0x214);

/// `MPI_STATUS_IGNORE` / `MPI_STATUSES_IGNORE`.
pub(crate) const MPI_STATUS_IGNORE: *mut MPI_Status = std::ptr::null_mut();

pub(crate) const MPI_SUCCESS: c_int = 0;
pub(crate) const MPI_ERR_TRUNCATE: c_int = 15;
pub(crate) const MPI_ERR_OTHER: c_int = 16;
pub(crate) const MPI_ERR_PENDING: c_int = 18;
pub(crate) const MPI_ERR_IN_STATUS: c_int = 19;
pub(crate) const MPI_ERR_PROC_ABORTED: c_int = 58;

pub(crate) const MPI_ANY_SOURCE: c_int = -1;
pub(crate) const MPI_ANY_TAG: c_int = -2;
pub(crate) const MPI_UNDEFINED: c_int = -32766;

pub(crate) const MPI_THREAD_SINGLE: c_int = 0;
pub(crate) const MPI_THREAD_FUNNELED: c_int = 1024;
pub(crate) const MPI_THREAD_SERIALIZED: c_int = 2048;
pub(crate) const MPI_THREAD_MULTIPLE: c_int = 4096;

pub(crate) const MPI_COMM_TYPE_SHARED: c_int = 221;

/// `MPI_MAX_ERROR_STRING` of the ABI (the larger of the implementations' values).
pub(crate) const MPI_MAX_ERROR_STRING: usize = 512;
/// `MPI_MAX_LIBRARY_VERSION_STRING` of the ABI; also large enough for MPICH's and Open MPI's
/// own (non-ABI) values, so one buffer serves when identifying a non-ABI library.
pub(crate) const MPI_MAX_LIBRARY_VERSION_STRING: usize = 8192;

/// The name of a thread level, for messages.
pub(crate) fn thread_level_name(level: c_int) -> &'static str {
    match level {
        MPI_THREAD_SINGLE => "MPI_THREAD_SINGLE",
        MPI_THREAD_FUNNELED => "MPI_THREAD_FUNNELED",
        MPI_THREAD_SERIALIZED => "MPI_THREAD_SERIALIZED",
        MPI_THREAD_MULTIPLE => "MPI_THREAD_MULTIPLE",
        _ => "an unknown thread level",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fixed layout and values of `mpi_abi.h` (ABI 1.0).
    #[test]
    fn layout_and_constants_match_the_abi_header() {
        assert_eq!(std::mem::size_of::<MPI_Status>(), 32);
        assert_eq!(
            std::mem::size_of::<MPI_Comm>(),
            std::mem::size_of::<usize>()
        );
        assert_eq!(MPI_COMM_WORLD as usize, 0x101);
        assert_eq!(MPI_ERRORS_RETURN as usize, 0x143);
        assert_eq!(MPI_REQUEST_NULL as usize, 0x180);
        assert_eq!(MPI_BYTE as usize, 0x247);
        assert_eq!(MPI_DOUBLE as usize, 0x214);
        const { assert!(MPI_THREAD_SERIALIZED < MPI_THREAD_MULTIPLE) };
    }
}
