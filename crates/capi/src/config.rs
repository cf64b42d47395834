//! `lockstepConfig_t`: reading and checking a configuration passed from C, as NCCL's
//! `parseCommConfig` does for `ncclConfig_t`, but strictly: a config that
//! LOCKSTEP_CONFIG_INITIALIZER did not initialise, or a field out of range, is refused.

use std::ffi::{c_int, CStr};
use std::time::Duration;

use super::handle::{Failure, Settings, VERSION_CODE};
use super::types::{lockstepConfig_t, LOCKSTEP_API_MAGIC};

/// `LOCKSTEP_CONFIG_UNDEF_INT` (INT_MIN, as `NCCL_CONFIG_UNDEF_INT`): the field keeps its default.
const UNDEF_INT: c_int = c_int::MIN;

/// The first LOCKSTEP_VERSION_CODE whose header declares this `lockstepConfig_t` layout: configs
/// from headers of this version up to the library's own are accepted.
const LAYOUT_SINCE: c_int = 100;

/// The settings of `*config`, or `None` when `config` is NULL.
///
/// # Safety
/// `config` is NULL or points to a readable `lockstepConfig_t` whose `commName` is NULL or a
/// NUL-terminated string.
pub(crate) unsafe fn read(config: *const lockstepConfig_t) -> Result<Option<Settings>, Failure> {
    if config.is_null() {
        return Ok(None);
    }
    if !config.is_aligned() {
        return Err(Failure::invalid_argument(format!(
            "config ({config:p}) is not aligned for a lockstepConfig_t"
        )));
    }
    // The header fields first: `size`, `magic` and `version` open every layout.
    // SAFETY: non-null and aligned (checked), readable (the caller's contract); any bits are a
    // valid unsigned int.
    let magic = unsafe { std::ptr::addr_of!((*config).magic).read() };
    if magic != LOCKSTEP_API_MAGIC {
        return Err(Failure::invalid_argument(format!(
            "config->magic is {magic:#x}, not LOCKSTEP_API_MAGIC ({LOCKSTEP_API_MAGIC:#x}): declare the config as `lockstepConfig_t config = LOCKSTEP_CONFIG_INITIALIZER;` before setting its fields (an uninitialised struct or an ncclConfig_t is refused)"
        )));
    }
    // SAFETY: as for `magic`.
    let version = unsafe { std::ptr::addr_of!((*config).version).read() };
    if c_int::try_from(version).map_or(true, |v| !(LAYOUT_SINCE..=VERSION_CODE).contains(&v)) {
        return Err(Failure::invalid_argument(format!(
            "config->version is {version}, but this liblockstep ({}, LOCKSTEP_VERSION_CODE {VERSION_CODE}) takes configs of lockstep.h versions {LAYOUT_SINCE} to {VERSION_CODE}: build the program against the lockstep.h installed with this library, and leave the version field as LOCKSTEP_CONFIG_INITIALIZER set it",
            env!("CARGO_PKG_VERSION")
        )));
    }
    // SAFETY: as for `magic`; any bits are a valid size_t.
    let size = unsafe { std::ptr::addr_of!((*config).size).read() };
    let want = std::mem::size_of::<lockstepConfig_t>();
    if size != want {
        return Err(Failure::invalid_argument(format!(
            "config->size is {size}, but a lockstepConfig_t of lockstep.h version {version} has {want} bytes: initialise the config with LOCKSTEP_CONFIG_INITIALIZER and leave its size field as it set it"
        )));
    }
    // SAFETY: the struct is readable (the caller's contract) and has this library's layout
    // (size and version checked); any bits are valid values of its fields.
    let c = unsafe { config.read() };
    let blocking = match c.blocking {
        UNDEF_INT | 1 => true,
        0 => false,
        v => {
            return Err(Failure::invalid_argument(format!(
                "config->blocking is {v}: pass 1 (blocking), 0 (non-blocking) or LOCKSTEP_CONFIG_UNDEF_INT (the default, blocking)"
            )))
        }
    };
    let timeout = match c.timeoutMs {
        UNDEF_INT => None,
        v if v > 0 => Some(Duration::from_millis(v as u64)),
        v => {
            return Err(Failure::invalid_argument(format!(
                "config->timeoutMs is {v}: pass a number of milliseconds > 0, or LOCKSTEP_CONFIG_UNDEF_INT for the default (LOCKSTEP_TIMEOUT_S, else 600 s)"
            )))
        }
    };
    let name = if c.commName.is_null() {
        None
    } else {
        // SAFETY: non-null, and a NUL-terminated string (the caller's contract); copied at once.
        Some(
            unsafe { CStr::from_ptr(c.commName) }
                .to_string_lossy()
                .into_owned(),
        )
    };
    Ok(Some(Settings {
        name,
        blocking,
        timeout,
    }))
}
