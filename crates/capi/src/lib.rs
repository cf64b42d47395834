//! The C ABI: `liblockstep.so` with `include/lockstep.h`, shaped like NCCL's
//! `nccl.h` (2.30) with `lockstep` in place of `nccl`: the functions it has take NCCL's arguments
//! in NCCL's order, and data types, reduction operators and result codes carry NCCL's values.
//! `docs/c-abi.md` lists exactly what differs from nccl.h: the functions and types it lacks, the
//! fields of `lockstepConfig_t`, and `lockstepCommInitFromEnv` (join the job a launcher started)
//! and `lockstepBarrier`, which have no NCCL twin.
//!
//! The header is generated from this file by cbindgen (build.rs, with `cbindgen.toml`); the doc
//! comments of the items below are the header's documentation. tests/capi.rs fails when the
//! checked-in `include/lockstep.h` differs from what this file generates; regenerate it with
//! `LOCKSTEP_UPDATE_HEADER=1 cargo build --release`.
//!
//! How the boundary is kept:
//! * No panic crosses it: every entry point runs under `catch_unwind` and maps a panic to
//!   `lockstepInternalError` (see `handle::guard`).
//! * A communicator handle is a key into a registry of live communicators, never dereferenced:
//!   a NULL, destroyed or made-up handle is `lockstepInvalidArgument`, not undefined behaviour.
//! * Enum arguments arrive as plain `int`s (typed as the enum in the header, through cbindgen's
//!   rename) and are checked, so a value outside the enum is `lockstepInvalidArgument`.
//! * Buffers are passed to the communicator as raw memory descriptors (`RawMem`, in a `Call`
//!   through `Communicator::run`), never as Rust references, so `sendbuff == recvbuff` (NCCL's
//!   in-place form) aliases nothing.

// The exported names are NCCL's C names.
#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]
// Every unsafe operation sits in its own block with its own `// SAFETY:` line, also inside the
// `unsafe extern "C"` functions.
#![deny(unsafe_op_in_unsafe_fn)]

mod config;
mod exec;
mod handle;
mod id;
mod log;
mod types;

use std::ffi::{c_char, c_int, c_void};

use exec::Op;
use handle::{guard, guard_comm, out_ptr, Failure};
use runtime::comm::Communicator;

pub use handle::{lockstepComm, lockstepComm_t};
pub use log::lockstepLogCallback_t;
pub use types::{
    lockstepConfig_t, lockstepDataType_t, lockstepRedOp_t, lockstepResult_t, lockstepUniqueId,
    DataTypeArg, RedOpArg, ResultArg, LOCKSTEP_API_MAGIC, LOCKSTEP_SHRINK_ABORT,
    LOCKSTEP_SHRINK_DEFAULT, LOCKSTEP_SPLIT_NOCOLOR, LOCKSTEP_UNIQUE_ID_BYTES,
};

/// The library version as `MAJOR * 10000 + MINOR * 100 + PATCH` (NCCL's encoding) in `*version`:
/// LOCKSTEP_VERSION_CODE of the header the library was built with.
///
/// Thread safety: any thread, any time.
///
/// # Safety
/// `version` is NULL (lockstepInvalidArgument) or valid for writing an int.
#[no_mangle]
pub unsafe extern "C" fn lockstepGetVersion(version: *mut c_int) -> lockstepResult_t {
    guard("lockstepGetVersion", || {
        // SAFETY: the caller passes NULL (refused by out_ptr) or a pointer valid for an int write.
        let out = unsafe { out_ptr(version, "version") }?;
        *out = handle::VERSION_CODE;
        Ok(())
    })
}

/// Send lockstep's diagnostics to `callback` (with `user` passed back) instead of stderr; NULL
/// clears it. Without a callback, diagnostics go to stderr only when `LOCKSTEP_LOG` is set (a
/// filter such as `info` or `warn,lockstep::shm=debug`; `LOCKSTEP_LOG_TIME=1` adds the time).
/// With a callback and no `LOCKSTEP_LOG`, it receives every warning and lockstep's INFO lines,
/// among them each communicator's init line (target `lockstep::init`). Not in nccl.h.
///
/// Thread safety: any thread; the callback may be called from any thread running lockstep
/// code, concurrently, and must not call lockstep.
#[no_mangle]
pub extern "C" fn lockstepSetLogCallback(
    callback: lockstepLogCallback_t,
    user: *mut c_void,
) -> lockstepResult_t {
    guard("lockstepSetLogCallback", || {
        log::set_callback(callback, user)
    })
}

/// Make a new unique id (a fresh random job id and this machine's identity) in `*uniqueId`. Call it
/// on one rank and pass the id to every rank's lockstepCommInitRank. Each call gives a new id: a
/// job needs exactly one.
///
/// Thread safety: any thread, any time.
///
/// # Safety
/// `uniqueId` is NULL (lockstepInvalidArgument) or valid for writing a lockstepUniqueId.
#[no_mangle]
pub unsafe extern "C" fn lockstepGetUniqueId(uniqueId: *mut lockstepUniqueId) -> lockstepResult_t {
    guard("lockstepGetUniqueId", || {
        let made = id::make()?;
        // SAFETY: the caller passes NULL (refused by out_ptr) or a pointer valid for the write.
        let out = unsafe { out_ptr(uniqueId, "uniqueId") }?;
        *out = made;
        Ok(())
    })
}

/// Join the job of `commId` as rank `rank` of `nranks` (`0 <= rank < nranks`) and store the new
/// communicator in `*comm`. Blocks until all `nranks` ranks have joined (at most
/// LOCKSTEP_JOIN_TIMEOUT_S, default 60 s). The ranks meet in a shared-memory segment named after
/// the id's job id, so they must run on the host the id was made on; they use the shared-memory
/// backend on host buffers (pass stream = NULL). Settings come from the LOCKSTEP_SHM_* variables.
///
/// Thread safety: any thread; the ranks of one job may be threads of one process only if each
/// joins from its own thread (the call blocks until all have joined).
///
/// # Safety
/// `comm` is NULL (lockstepInvalidArgument) or valid for writing a lockstepComm_t.
#[no_mangle]
pub unsafe extern "C" fn lockstepCommInitRank(
    comm: *mut lockstepComm_t,
    nranks: c_int,
    commId: lockstepUniqueId,
    rank: c_int,
) -> lockstepResult_t {
    guard("lockstepCommInitRank", || {
        // SAFETY: the caller passes NULL (refused by out_ptr) or a pointer valid for the write.
        let out = unsafe { out_ptr(comm, "comm") }?;
        *out = std::ptr::null_mut();
        let made = id::init_rank(&commId, nranks, rank, None)?;
        *out = handle::register(made, handle::Settings::default());
        Ok(())
    })
}

/// As lockstepCommInitRank, with the settings of `config` (NULL: the defaults, as
/// lockstepCommInitRank): `timeoutMs` (how long a rank waits for its peers in one call before it
/// fails with lockstepTimeout), `commName` and `blocking`. The config is checked before anything
/// else: one that LOCKSTEP_CONFIG_INITIALIZER did not initialise (wrong size, magic or version),
/// or a field out of range, is lockstepInvalidArgument, and lockstepGetLastError(NULL) says which.
///
/// Thread safety: as lockstepCommInitRank.
///
/// # Safety
/// `comm` is NULL (lockstepInvalidArgument) or valid for writing a lockstepComm_t; `config` is
/// NULL or points to a lockstepConfig_t whose `commName` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn lockstepCommInitRankConfig(
    comm: *mut lockstepComm_t,
    nranks: c_int,
    commId: lockstepUniqueId,
    rank: c_int,
    config: *mut lockstepConfig_t,
) -> lockstepResult_t {
    guard("lockstepCommInitRankConfig", || {
        // SAFETY: the caller passes NULL (refused by out_ptr) or a pointer valid for the write.
        let out = unsafe { out_ptr(comm, "comm") }?;
        *out = std::ptr::null_mut();
        // SAFETY: the caller passes NULL or a readable lockstepConfig_t (this function's contract).
        let settings = unsafe { config::read(config) }?.unwrap_or_default();
        let made = id::init_rank(&commId, nranks, rank, settings.timeout)?;
        *out = handle::register(made, settings);
        Ok(())
    })
}

/// Join the job the launcher started this process in (`lockstep launch`, torchrun, mpirun,
/// srun: the same rules as lockstep's `Communicator::from_env`) and store the new communicator in
/// `*comm`. Blocks until every rank has joined. With LOCKSTEP_BACKEND=nccl the communicator runs
/// NCCL on device buffers (pass a CUDA stream); otherwise the shared-memory backend on host
/// buffers (pass stream = NULL). No NCCL twin.
///
/// Thread safety: any thread; one call per process and job.
///
/// # Safety
/// `comm` is NULL (lockstepInvalidArgument) or valid for writing a lockstepComm_t.
#[no_mangle]
pub unsafe extern "C" fn lockstepCommInitFromEnv(comm: *mut lockstepComm_t) -> lockstepResult_t {
    guard("lockstepCommInitFromEnv", || {
        // SAFETY: the caller passes NULL (refused by out_ptr) or a pointer valid for the write.
        let out = unsafe { out_ptr(comm, "comm") }?;
        *out = std::ptr::null_mut();
        let made = runtime::comm::Communicator::from_env().map_err(Failure::from)?;
        *out = handle::register(made, handle::Settings::default());
        Ok(())
    })
}

/// Finish the communicator's work before it is destroyed: wait for this rank's pending work (none
/// on host communicators), then for every rank to call lockstepCommFinalize, so that no rank is
/// still in a call with `comm` when the ranks destroy it. Collective over `comm`: every rank calls
/// it, outside a group. Afterwards `comm` takes no more operations (lockstepInvalidUsage), only
/// lockstepCommDestroy, lockstepCommAbort and the queries (count, rank, errors). Unlike
/// ncclCommFinalize it blocks until done: lockstepCommGetAsyncError never reports
/// lockstepInProgress.
///
/// Thread safety: as the collectives.
#[no_mangle]
pub extern "C" fn lockstepCommFinalize(comm: lockstepComm_t) -> lockstepResult_t {
    guard_comm("lockstepCommFinalize", comm, |h| {
        if exec::in_group() {
            return Err(Failure::invalid_usage(
                "lockstepCommFinalize inside lockstepGroupStart/lockstepGroupEnd: finalize after the group has ended",
            ));
        }
        h.finalize()
    })
}

/// Wait for the communicator's pending work (none on host communicators), leave it and free it.
/// Local: the other ranks are not waited for; a rank still in a call with this one fails at once
/// with lockstepRemoteError ("left the communicator"). The handle is invalid afterwards (a later
/// call with it returns lockstepInvalidArgument); operations recorded for it in an open group
/// fail at lockstepGroupEnd.
///
/// Thread safety: any thread; a call running on `comm` in another thread finishes first.
#[no_mangle]
pub extern "C" fn lockstepCommDestroy(comm: lockstepComm_t) -> lockstepResult_t {
    guard("lockstepCommDestroy", || handle::destroy(comm, true))
}

/// Leave and free the communicator at once, without waiting for pending device work. Otherwise
/// as lockstepCommDestroy.
///
/// Thread safety: as lockstepCommDestroy.
#[no_mangle]
pub extern "C" fn lockstepCommAbort(comm: lockstepComm_t) -> lockstepResult_t {
    guard("lockstepCommAbort", || handle::destroy(comm, false))
}

/// Split `comm` into sub-communicators: the ranks passing the same `color` (>= 0) form one, ranked
/// by `key` (ties by rank in `comm`); a rank passing LOCKSTEP_SPLIT_NOCOLOR gets `*newcomm = NULL`.
/// Collective over `comm`: every rank calls it, outside a group. With `config` NULL the new
/// communicator inherits `comm`'s settings; otherwise it takes the config's `commName` and
/// `blocking`, checked as by lockstepCommInitRankConfig, while `timeoutMs` must stay
/// LOCKSTEP_CONFIG_UNDEF_INT (the new communicator inherits `comm`'s timeout). The ranks first
/// agree that every rank's arguments passed its checks: a rank whose arguments are refused
/// (lockstepInvalidArgument) makes the others' split fail too (lockstepInvalidUsage, naming it)
/// instead of leaving them waiting. The new communicator has its own backend state (a shared-memory
/// segment or an NCCL communicator from ncclCommSplit, NCCL >= 2.18) and is freed by
/// lockstepCommDestroy; `comm` stays usable. On failure `*newcomm` is NULL.
///
/// Thread safety: as the collectives.
///
/// # Safety
/// `newcomm` is NULL (lockstepInvalidArgument) or valid for writing a lockstepComm_t; `config` is
/// NULL or points to a lockstepConfig_t whose `commName` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn lockstepCommSplit(
    comm: lockstepComm_t,
    color: c_int,
    key: c_int,
    newcomm: *mut lockstepComm_t,
    config: *mut lockstepConfig_t,
) -> lockstepResult_t {
    guard_comm("lockstepCommSplit", comm, |h| {
        // SAFETY: the caller passes NULL (refused) or a pointer valid for the write.
        let out = unsafe { new_comm_out(newcomm, "lockstepCommSplit", "split") }?;
        // SAFETY: the caller passes NULL or a readable lockstepConfig_t (this function's contract).
        let checked = unsafe { split_settings(h.settings(), color, config) };
        let sub = h.with_comm(|c| {
            // Every rank learns whether every rank's arguments passed, so that a refused rank
            // makes the split fail everywhere instead of leaving its peers waiting in it.
            let passed = c.all_gather_u64(u64::from(checked.is_ok()), SPLIT_CHECKS).map_err(Failure::from)?;
            let refused: Vec<String> = (0..passed.len()).filter(|&r| passed[r] == 0).map(|r| r.to_string()).collect();
            if let Err(f) = &checked {
                return Err(f.clone());
            }
            if !refused.is_empty() {
                let who = if refused.len() == 1 { format!("rank {}", refused[0]) } else { format!("ranks {}", refused.join(", ")) };
                return Err(Failure::invalid_usage(format!(
                    "{who} of this communicator refused their lockstepCommSplit arguments (their lockstepGetLastError says why), so no rank split: fix the arguments there"
                )));
            }
            c.split(u32::try_from(color).ok(), i64::from(key)).map_err(Failure::from)
        })?;
        let settings = checked?;
        *out = sub.map_or(std::ptr::null_mut(), |c| handle::register(c, settings));
        Ok(())
    })
}

/// After a failure (lockstepRemoteError: a peer died; lockstepTimeout), the communicator of the
/// ranks that remain, as ncclCommShrink (NCCL >= 2.27): every surviving rank calls it and gets in
/// `*newcomm` a communicator of the survivors, ranked 0.. in their order in `comm`. The members
/// are agreed through the shared segment, so every survivor gets the same ones: ranks in
/// `excludeRanksList` (ranks of `comm`; one that already called lockstepCommShrink stays in),
/// ranks whose process is gone, and ranks still running that do not call it within 1 s are left
/// out. A rank left out gets lockstepRemoteError ("excluded") from its next call or shrink.
/// `shrinkFlags` is LOCKSTEP_SHRINK_DEFAULT or LOCKSTEP_SHRINK_ABORT (the same: calls still
/// running on `comm` fail either way). `config` as for lockstepCommSplit. Afterwards every call
/// on `comm` fails with lockstepInvalidUsage ("shrunk"); free it with lockstepCommDestroy. The
/// shared-memory backend, and device communicators of one node (NCCL, staged: their host
/// communicator agrees on the members and a new NCCL communicator is made over them); others
/// return lockstepInvalidUsage. On failure `*newcomm` is NULL.
///
/// Thread safety: as the collectives.
///
/// # Safety
/// `newcomm` is NULL (lockstepInvalidArgument) or valid for writing a lockstepComm_t;
/// `excludeRanksList` is valid for reading `excludeRanksCount` ints (or NULL with a count of 0);
/// `config` as for lockstepCommSplit.
#[no_mangle]
pub unsafe extern "C" fn lockstepCommShrink(
    comm: lockstepComm_t,
    excludeRanksList: *const c_int,
    excludeRanksCount: c_int,
    newcomm: *mut lockstepComm_t,
    config: *mut lockstepConfig_t,
    shrinkFlags: c_int,
) -> lockstepResult_t {
    guard_comm("lockstepCommShrink", comm, |h| {
        // SAFETY: the caller passes NULL (refused) or a pointer valid for the write.
        let out = unsafe { new_comm_out(newcomm, "lockstepCommShrink", "shrink") }?;
        if shrinkFlags != LOCKSTEP_SHRINK_DEFAULT && shrinkFlags != LOCKSTEP_SHRINK_ABORT {
            return Err(Failure::invalid_argument(format!(
                "shrinkFlags {shrinkFlags}: pass LOCKSTEP_SHRINK_DEFAULT (0) or LOCKSTEP_SHRINK_ABORT (1)"
            )));
        }
        let n = usize::try_from(excludeRanksCount).map_err(|_| {
            Failure::invalid_argument(format!("excludeRanksCount {excludeRanksCount} is negative"))
        })?;
        if n > 0 && excludeRanksList.is_null() {
            return Err(Failure::invalid_argument(format!(
                "excludeRanksList is NULL with excludeRanksCount {n}: pass the ranks, or a count of 0"
            )));
        }
        let exclude: Vec<usize> = if n == 0 {
            Vec::new()
        } else {
            // SAFETY: the caller passes a list valid for reading `n` ints (checked non-NULL).
            let list = unsafe { std::slice::from_raw_parts(excludeRanksList, n) };
            list.iter()
                .map(|&r| {
                    usize::try_from(r).map_err(|_| {
                        Failure::invalid_argument(format!(
                            "excludeRanksList holds {r}: ranks are >= 0"
                        ))
                    })
                })
                .collect::<Result<_, _>>()?
        };
        // SAFETY: the caller passes NULL or a readable lockstepConfig_t (this function's contract).
        let settings = unsafe { inherited_settings(h.settings(), config, "lockstepCommShrink") }?;
        let new = h.with_comm(|c| {
            c.shrink_excluding(&exclude, Communicator::SHRINK_WAIT)
                .map_err(Failure::from)
        })?;
        *out = handle::register(new, settings);
        Ok(())
    })
}

/// After a peer was lost and `lockstep launch --restart-policy rank` started its replacement,
/// the communicator of the whole world again, with every rank's number from before, as
/// ncclCommGrow (NCCL >= 2.29): every surviving rank calls it on the communicator whose call
/// failed (it shrinks first) and gets the new one in `*newcomm`; the replacement joins the same
/// communicator through lockstepCommInitFromEnv. The survivors wait for the replacement up to
/// LOCKSTEP_JOIN_TIMEOUT_S (60 s by default); one that does not come is lockstepSystemError
/// naming its rank. `config` as for lockstepCommSplit. Afterwards every call on `comm` fails
/// with lockstepInvalidUsage ("shrunk"); free it with lockstepCommDestroy. The shared-memory
/// backend (not a split's communicators) and device communicators of one node (NCCL, staged);
/// others return lockstepInvalidUsage. On failure `*newcomm` is NULL.
///
/// Thread safety: as the collectives.
///
/// # Safety
/// `newcomm` is NULL (lockstepInvalidArgument) or valid for writing a lockstepComm_t; `config`
/// as for lockstepCommSplit.
#[no_mangle]
pub unsafe extern "C" fn lockstepCommGrow(
    comm: lockstepComm_t,
    newcomm: *mut lockstepComm_t,
    config: *mut lockstepConfig_t,
) -> lockstepResult_t {
    guard_comm("lockstepCommGrow", comm, |h| {
        // SAFETY: the caller passes NULL (refused) or a pointer valid for the write.
        let out = unsafe { new_comm_out(newcomm, "lockstepCommGrow", "grow") }?;
        // SAFETY: the caller passes NULL or a readable lockstepConfig_t (this function's contract).
        let settings = unsafe { inherited_settings(h.settings(), config, "lockstepCommGrow") }?;
        let new = h.with_comm(|c| c.grow().map_err(Failure::from))?;
        *out = handle::register(new, settings);
        Ok(())
    })
}

/// Where a call that makes a communicator (split, shrink, grow) writes it: `newcomm` checked and
/// set to NULL first, so a failure leaves it NULL; refused inside a group, since the new
/// communicator is needed at once.
///
/// # Safety
/// `newcomm` is NULL (refused) or valid for writing a lockstepComm_t.
unsafe fn new_comm_out<'a>(
    newcomm: *mut lockstepComm_t,
    func: &str,
    verb: &str,
) -> Result<&'a mut lockstepComm_t, Failure> {
    // SAFETY: forwarded from the caller's contract.
    let out = unsafe { out_ptr(newcomm, "newcomm") }?;
    *out = std::ptr::null_mut();
    if exec::in_group() {
        return Err(Failure::invalid_usage(format!(
            "{func} inside lockstepGroupStart/lockstepGroupEnd: {verb} before the group starts (the new communicator is needed at once)"
        )));
    }
    Ok(out)
}

/// What lockstepCommSplit exchanges before splitting: whether each rank's arguments passed its
/// local checks (named in the error of a failed CUDA step of the exchange).
const SPLIT_CHECKS: &str = "lockstepCommSplit: exchanging the argument checks";

/// The local checks of lockstepCommSplit, and the new communicator's settings.
///
/// # Safety
/// As for lockstepCommSplit's `config`.
unsafe fn split_settings(
    parent: &handle::Settings,
    color: c_int,
    config: *const lockstepConfig_t,
) -> Result<handle::Settings, Failure> {
    if color < LOCKSTEP_SPLIT_NOCOLOR {
        return Err(Failure::invalid_argument(format!(
            "color {color} is negative: pass a color >= 0, or LOCKSTEP_SPLIT_NOCOLOR (-1) to join no new communicator"
        )));
    }
    // SAFETY: forwarded contract.
    unsafe { inherited_settings(parent, config, "lockstepCommSplit") }
}

/// The settings of a communicator `call` (lockstepCommSplit, lockstepCommShrink,
/// lockstepCommGrow) makes from one
/// with `parent`'s: the parent's with `config` NULL, else the config's, whose timeout must be
/// left unset (the new communicator inherits the parent's).
///
/// # Safety
/// `config` is NULL or points to a lockstepConfig_t whose `commName` is NULL or a NUL-terminated
/// string.
unsafe fn inherited_settings(
    parent: &handle::Settings,
    config: *const lockstepConfig_t,
    call: &str,
) -> Result<handle::Settings, Failure> {
    // SAFETY: forwarded contract.
    let Some(mut s) = (unsafe { config::read(config) })? else {
        return Ok(parent.clone());
    };
    if s.timeout.is_some() {
        return Err(Failure::invalid_argument(format!(
            "config->timeoutMs is set, but a communicator made by {call} inherits the timeout of the one it comes from: leave timeoutMs as LOCKSTEP_CONFIG_UNDEF_INT (set the timeout in lockstepCommInitRankConfig's config, or with LOCKSTEP_TIMEOUT_S)"
        )));
    }
    s.timeout = parent.timeout;
    Ok(s)
}

/// The number of ranks of `comm` in `*count`.
///
/// Thread safety: any thread, any time (does not wait for running calls).
///
/// # Safety
/// `count` is NULL (lockstepInvalidArgument) or valid for writing an int.
#[no_mangle]
pub unsafe extern "C" fn lockstepCommCount(
    comm: lockstepComm_t,
    count: *mut c_int,
) -> lockstepResult_t {
    guard_comm("lockstepCommCount", comm, |h| {
        // SAFETY: the caller passes NULL (refused by out_ptr) or a pointer valid for an int write.
        let out = unsafe { out_ptr(count, "count") }?;
        *out = h.world() as c_int;
        Ok(())
    })
}

/// This process's rank in `comm` in `*rank`.
///
/// Thread safety: any thread, any time (does not wait for running calls).
///
/// # Safety
/// `rank` is NULL (lockstepInvalidArgument) or valid for writing an int.
#[no_mangle]
pub unsafe extern "C" fn lockstepCommUserRank(
    comm: lockstepComm_t,
    rank: *mut c_int,
) -> lockstepResult_t {
    guard_comm("lockstepCommUserRank", comm, |h| {
        // SAFETY: the caller passes NULL (refused by out_ptr) or a pointer valid for an int write.
        let out = unsafe { out_ptr(rank, "rank") }?;
        *out = h.rank() as c_int;
        Ok(())
    })
}

/// Whether `comm` has failed for good, in `*asyncError`: lockstepSuccess while it works, otherwise
/// the code of the failure that broke it (lockstepRemoteError when a peer died, timed out or
/// aborted; lockstepInternalError after a caught panic). Calls complete before they return, so
/// lockstepInProgress is never reported. Once broken, every call on `comm` fails: destroy it.
///
/// Thread safety: any thread, any time (does not wait for running calls).
///
/// # Safety
/// `asyncError` is NULL (lockstepInvalidArgument) or valid for writing a lockstepResult_t.
#[no_mangle]
pub unsafe extern "C" fn lockstepCommGetAsyncError(
    comm: lockstepComm_t,
    asyncError: *mut lockstepResult_t,
) -> lockstepResult_t {
    guard_comm("lockstepCommGetAsyncError", comm, |h| {
        // SAFETY: the caller passes NULL (refused by out_ptr) or a pointer valid for the write.
        let out = unsafe { out_ptr(asyncError, "asyncError") }?;
        *out = h.async_error();
        Ok(())
    })
}

/// Write this rank's flight-recorder records of `comm` (its last `LOCKSTEP_TRACE_BUFFER` calls,
/// 2000 by default) into the directory `dir` (made when missing): one JSON-lines file named for the
/// rank and the communicator, replaced atomically; `lockstep trace DIR` reads a directory of them.
/// Local: the other ranks write nothing unless asked too (with `LOCKSTEP_TRACE_DIR` set, every rank
/// writes there by itself when a call fails for the job, and on SIGUSR1). lockstepInvalidUsage when
/// the recorder is off (`LOCKSTEP_TRACE_BUFFER=0`), lockstepSystemError when the file cannot be
/// written.
///
/// Thread safety: any thread; waits for a call running on `comm` to return.
///
/// # Safety
/// `dir` is NULL (lockstepInvalidArgument) or a NUL-terminated path.
#[no_mangle]
pub unsafe extern "C" fn lockstepCommDumpTrace(
    comm: lockstepComm_t,
    dir: *const c_char,
) -> lockstepResult_t {
    guard_comm("lockstepCommDumpTrace", comm, |h| {
        if dir.is_null() {
            return Err(Failure::invalid_argument(
                "dir is NULL: pass the directory to write the trace into",
            ));
        }
        // SAFETY: the caller passes a NUL-terminated string (checked non-NULL above).
        let bytes = unsafe { std::ffi::CStr::from_ptr(dir) }.to_bytes();
        let path = std::path::Path::new(
            <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(bytes),
        );
        h.with_comm(|c| match c.dump_trace(path) {
            Ok(_) => Ok(()),
            Err(e @ runtime::trace::DumpError::Off) => Err(Failure::invalid_usage(e.to_string())),
            Err(e) => Err(Failure::system(e.to_string())),
        })
    })
}

/// Turn the finite check on (`enable` nonzero) or off for the calls on `comm` that follow, as
/// `LOCKSTEP_CHECK_FINITE=1` sets it for every call: a reduction (all-reduce, reduce,
/// reduce-scatter) whose input holds a NaN or an infinity then fails on every rank with
/// lockstepInvalidArgument, and lockstepGetLastError names the rank, the element and the call
/// ("rank 1 contributed NaN at element 17 of all_reduce #41 (f32, 262144 elements)"); the
/// communicator stays usable. Local, but every rank must set it alike before the same call: a
/// reduction whose ranks differ fails on every rank with lockstepInvalidUsage naming them. The
/// shared-memory backend and device communicators staged through it have the check; others
/// return lockstepInvalidUsage when asked to turn it on. No NCCL twin.
///
/// Thread safety: any thread; waits for a call running on `comm` to return.
#[no_mangle]
pub extern "C" fn lockstepCommSetCheckFinite(
    comm: lockstepComm_t,
    enable: c_int,
) -> lockstepResult_t {
    guard_comm("lockstepCommSetCheckFinite", comm, |h| {
        h.with_comm(|c| c.set_check_finite(enable != 0).map_err(Failure::from))
    })
}

/// Whether the finite check is on for `comm`'s calls (1) or off (0), in `*enabled`: as
/// lockstepCommSetCheckFinite set it, otherwise as `LOCKSTEP_CHECK_FINITE` did.
///
/// Thread safety: any thread; waits for a call running on `comm` to return.
///
/// # Safety
/// `enabled` is NULL (lockstepInvalidArgument) or valid for writing an int.
#[no_mangle]
pub unsafe extern "C" fn lockstepCommGetCheckFinite(
    comm: lockstepComm_t,
    enabled: *mut c_int,
) -> lockstepResult_t {
    guard_comm("lockstepCommGetCheckFinite", comm, |h| {
        // SAFETY: the caller passes NULL (refused by out_ptr) or a pointer valid for an int write.
        let out = unsafe { out_ptr(enabled, "enabled") }?;
        *out = h.with_comm(|c| Ok(c_int::from(c.check_finite())))?;
        Ok(())
    })
}

/// A static, NUL-terminated description of `result` ("unknown result code" for a value outside
/// the enum).
///
/// Thread safety: any thread, any time.
#[no_mangle]
pub extern "C" fn lockstepGetErrorString(result: ResultArg) -> *const c_char {
    handle::error_string(result).as_ptr()
}

/// The message of the last failed call: on `comm` (the last call on it that failed), or with
/// `comm = NULL` the last failed call of this thread, whatever its communicator. It says what went
/// wrong and what to do next. "" when there was none; an unknown `comm` gives a message saying so.
/// The string is a copy owned by the calling thread, one per `comm` argument: valid until this
/// thread calls lockstepGetLastError with the same `comm` again and the message has changed.
///
/// Thread safety: any thread, any time.
#[no_mangle]
pub extern "C" fn lockstepGetLastError(comm: lockstepComm_t) -> *const c_char {
    handle::last_error(comm)
}

/// Element-wise reduction of every rank's `sendbuff` (`count` elements) into every rank's
/// `recvbuff`. In place when `sendbuff == recvbuff`.
///
/// Thread safety: calls on one communicator are serialised (a lock); every rank must issue the
/// same collectives in the same order, so use a communicator from one thread at a time.
///
/// # Safety
/// The buffers are valid for `count` elements of `datatype` (read, respectively written) until
/// the call returns, aligned for it, and do not overlap unless equal. Host memory when `stream`
/// is NULL; device memory of the communicator's GPU when it is a CUDA stream (`cudaStream_t`).
#[no_mangle]
pub unsafe extern "C" fn lockstepAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: DataTypeArg,
    op: RedOpArg,
    comm: lockstepComm_t,
    stream: *mut c_void,
) -> lockstepResult_t {
    exec::submit(
        "lockstepAllReduce",
        comm,
        stream,
        Op::AllReduce {
            send: sendbuff as usize,
            recv: recvbuff as usize,
            count,
            dtype: datatype,
            op,
        },
    )
}

/// Copy `count` elements of `buff` on rank `root` into `buff` on every other rank: lockstepBroadcast
/// in place (NCCL marks ncclBcast deprecated, and keeps it).
///
/// Thread safety: as lockstepAllReduce.
///
/// # Safety
/// `buff` is valid for `count` elements of `datatype` (read on the root, written elsewhere) until
/// the call returns, aligned for it; host or device memory as for lockstepAllReduce.
#[no_mangle]
pub unsafe extern "C" fn lockstepBcast(
    buff: *mut c_void,
    count: usize,
    datatype: DataTypeArg,
    root: c_int,
    comm: lockstepComm_t,
    stream: *mut c_void,
) -> lockstepResult_t {
    exec::submit(
        "lockstepBcast",
        comm,
        stream,
        Op::Broadcast {
            send: buff as usize,
            recv: buff as usize,
            count,
            dtype: datatype,
            root,
        },
    )
}

/// Copy `count` elements of `sendbuff` on rank `root` into `recvbuff` on every rank. `sendbuff` is
/// read on the root only (other ranks may pass NULL). In place when `sendbuff == recvbuff`.
///
/// Thread safety: as lockstepAllReduce.
///
/// # Safety
/// As lockstepAllReduce (`sendbuff` on the root only).
#[no_mangle]
pub unsafe extern "C" fn lockstepBroadcast(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: DataTypeArg,
    root: c_int,
    comm: lockstepComm_t,
    stream: *mut c_void,
) -> lockstepResult_t {
    exec::submit(
        "lockstepBroadcast",
        comm,
        stream,
        Op::Broadcast {
            send: sendbuff as usize,
            recv: recvbuff as usize,
            count,
            dtype: datatype,
            root,
        },
    )
}

/// Reduce every rank's `sendbuff` (`count` elements) into `recvbuff` on rank `root`. `recvbuff`
/// is written on the root only (other ranks may pass NULL). In place when `sendbuff == recvbuff`.
///
/// Thread safety: as lockstepAllReduce.
///
/// # Safety
/// As lockstepAllReduce (`recvbuff` on the root only).
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn lockstepReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: DataTypeArg,
    op: RedOpArg,
    root: c_int,
    comm: lockstepComm_t,
    stream: *mut c_void,
) -> lockstepResult_t {
    exec::submit(
        "lockstepReduce",
        comm,
        stream,
        Op::Reduce {
            send: sendbuff as usize,
            recv: recvbuff as usize,
            count,
            dtype: datatype,
            op,
            root,
        },
    )
}

/// Gather every rank's `sendbuff` (`sendcount` elements) into every rank's `recvbuff`
/// (`nranks * sendcount` elements), in rank order. In place when
/// `sendbuff == recvbuff + rank * sendcount` elements.
///
/// Thread safety: as lockstepAllReduce.
///
/// # Safety
/// As lockstepAllReduce, with `recvbuff` valid for `nranks * sendcount` elements.
#[no_mangle]
pub unsafe extern "C" fn lockstepAllGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: DataTypeArg,
    comm: lockstepComm_t,
    stream: *mut c_void,
) -> lockstepResult_t {
    exec::submit(
        "lockstepAllGather",
        comm,
        stream,
        Op::AllGather {
            send: sendbuff as usize,
            recv: recvbuff as usize,
            count: sendcount,
            dtype: datatype,
        },
    )
}

/// Reduce every rank's `sendbuff` (`nranks * recvcount` elements) and leave block `rank` of the
/// result (`recvcount` elements) in `recvbuff`. In place when
/// `recvbuff == sendbuff + rank * recvcount` elements.
///
/// Thread safety: as lockstepAllReduce.
///
/// # Safety
/// As lockstepAllReduce, with `sendbuff` valid for `nranks * recvcount` elements.
#[no_mangle]
pub unsafe extern "C" fn lockstepReduceScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: DataTypeArg,
    op: RedOpArg,
    comm: lockstepComm_t,
    stream: *mut c_void,
) -> lockstepResult_t {
    exec::submit(
        "lockstepReduceScatter",
        comm,
        stream,
        Op::ReduceScatter {
            send: sendbuff as usize,
            recv: recvbuff as usize,
            count: recvcount,
            dtype: datatype,
            op,
        },
    )
}

/// Personalised exchange: block `j` of `sendbuff` (`count` elements at `sendbuff + j * count`) goes
/// to rank `j`, and block `i` of `recvbuff` comes from rank `i`; both buffers hold
/// `nranks * count` elements. No in-place form: `sendbuff == recvbuff` is lockstepInvalidArgument.
///
/// Thread safety: as lockstepAllReduce.
///
/// # Safety
/// As lockstepAllReduce, with both buffers valid for `nranks * count` elements.
#[no_mangle]
pub unsafe extern "C" fn lockstepAlltoAll(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: DataTypeArg,
    comm: lockstepComm_t,
    stream: *mut c_void,
) -> lockstepResult_t {
    exec::submit(
        "lockstepAlltoAll",
        comm,
        stream,
        Op::AllToAll {
            send: sendbuff as usize,
            recv: recvbuff as usize,
            count,
            dtype: datatype,
        },
    )
}

/// Gather every rank's `sendbuff` (`count` elements) into `recvbuff` on rank `root`, rank `i`'s at
/// `recvbuff + i * count` (`nranks * count` elements). `recvbuff` is written on the root only
/// (other ranks may pass NULL). In place when `sendbuff == recvbuff + root * count` elements on
/// the root.
///
/// Thread safety: as lockstepAllReduce.
///
/// # Safety
/// As lockstepAllReduce, with `recvbuff` valid for `nranks * count` elements on the root.
#[no_mangle]
pub unsafe extern "C" fn lockstepGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: DataTypeArg,
    root: c_int,
    comm: lockstepComm_t,
    stream: *mut c_void,
) -> lockstepResult_t {
    exec::submit(
        "lockstepGather",
        comm,
        stream,
        Op::Gather {
            send: sendbuff as usize,
            recv: recvbuff as usize,
            count,
            dtype: datatype,
            root,
        },
    )
}

/// Hand block `i` of `sendbuff` on rank `root` (`count` elements at `sendbuff + i * count`,
/// `nranks * count` in all) to rank `i`'s `recvbuff` (`count` elements). `sendbuff` is read on
/// the root only (other ranks may pass NULL). In place when
/// `recvbuff == sendbuff + root * count` elements on the root.
///
/// Thread safety: as lockstepAllReduce.
///
/// # Safety
/// As lockstepAllReduce, with `sendbuff` valid for `nranks * count` elements on the root.
#[no_mangle]
pub unsafe extern "C" fn lockstepScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: DataTypeArg,
    root: c_int,
    comm: lockstepComm_t,
    stream: *mut c_void,
) -> lockstepResult_t {
    exec::submit(
        "lockstepScatter",
        comm,
        stream,
        Op::Scatter {
            send: sendbuff as usize,
            recv: recvbuff as usize,
            count,
            dtype: datatype,
            root,
        },
    )
}

/// Send `count` elements of `sendbuff` to rank `peer`, matched by that rank's next lockstepRecv
/// from this rank (same count and type). Outside a group it blocks until `peer` has posted the
/// matching receive and taken the data, so two ranks that send to each other first must put their
/// sends and receives in one lockstepGroupStart/lockstepGroupEnd. Sending to oneself needs a group
/// with the matching receive.
///
/// Thread safety: as lockstepAllReduce.
///
/// # Safety
/// `sendbuff` is valid for reading `count` elements of `datatype`, aligned for it, until the
/// call returns (inside a group: until lockstepGroupEnd returns).
#[no_mangle]
pub unsafe extern "C" fn lockstepSend(
    sendbuff: *const c_void,
    count: usize,
    datatype: DataTypeArg,
    peer: c_int,
    comm: lockstepComm_t,
    stream: *mut c_void,
) -> lockstepResult_t {
    exec::submit(
        "lockstepSend",
        comm,
        stream,
        Op::Send {
            buf: sendbuff as usize,
            count,
            dtype: datatype,
            peer,
        },
    )
}

/// Receive `count` elements from rank `peer` into `recvbuff` (see lockstepSend).
///
/// Thread safety: as lockstepAllReduce.
///
/// # Safety
/// `recvbuff` is valid for writing `count` elements of `datatype`, aligned for it, until the call
/// returns (inside a group: until lockstepGroupEnd returns).
#[no_mangle]
pub unsafe extern "C" fn lockstepRecv(
    recvbuff: *mut c_void,
    count: usize,
    datatype: DataTypeArg,
    peer: c_int,
    comm: lockstepComm_t,
    stream: *mut c_void,
) -> lockstepResult_t {
    exec::submit(
        "lockstepRecv",
        comm,
        stream,
        Op::Recv {
            buf: recvbuff as usize,
            count,
            dtype: datatype,
            peer,
        },
    )
}

/// Start a group: until the matching lockstepGroupEnd, this thread's calls on communicators
/// (collectives, sends, receives) are recorded, not run; they return lockstepSuccess once their
/// communicator is known to be valid, and their other errors come from lockstepGroupEnd. Groups
/// nest: only the outermost lockstepGroupEnd runs them.
///
/// Thread safety: the group belongs to the calling thread.
#[no_mangle]
pub extern "C" fn lockstepGroupStart() -> lockstepResult_t {
    guard("lockstepGroupStart", exec::group_start)
}

/// End a group; the outermost one runs the recorded calls in the order they were made, each run
/// of consecutive sends and receives on one communicator together (so a ring exchange, where every
/// rank sends before it receives, completes), and returns the first failure (each communicator's
/// lockstepGetLastError has its own). Calls on different communicators run one after another.
/// lockstepInvalidUsage without a matching lockstepGroupStart.
///
/// Thread safety: the group belongs to the calling thread.
#[no_mangle]
pub extern "C" fn lockstepGroupEnd() -> lockstepResult_t {
    guard("lockstepGroupEnd", exec::group_end)
}

/// Wait until every rank of `comm` has called lockstepBarrier. No NCCL twin.
///
/// Thread safety: as lockstepAllReduce.
///
/// # Safety
/// `stream` is NULL or a live CUDA stream (device communicators).
#[no_mangle]
pub unsafe extern "C" fn lockstepBarrier(
    comm: lockstepComm_t,
    stream: *mut c_void,
) -> lockstepResult_t {
    exec::submit("lockstepBarrier", comm, stream, Op::Barrier)
}

/// What `lockstep status --json` prints, in `*json`: with `job` NULL, this user's running jobs
/// on this machine (`{"jobs": [...], "unreadable": [...]}`); otherwise the job `job` names (its
/// id or the pid of any of its processes): per rank the collective it is in, for how long,
/// whom it waits for, who is behind. Read from the jobs' shared segments without writing them
/// or taking their locks, so it works on a job that hangs. No NCCL twin.
///
/// A job that is not found (or belongs to another user) is lockstepInvalidArgument, one whose
/// segment cannot be read lockstepSystemError; lockstepGetLastError(NULL) says why.
///
/// The string is owned by the calling thread: valid until its next lockstepStatusJson call.
///
/// Thread safety: any thread, any time; no communicator is needed.
///
/// # Safety
/// `job` is NULL or a NUL-terminated string; `json` is valid for writing a pointer.
#[no_mangle]
pub unsafe extern "C" fn lockstepStatusJson(
    job: *const c_char,
    json: *mut *const c_char,
) -> lockstepResult_t {
    guard("lockstepStatusJson", || {
        // SAFETY: the caller passes NULL (refused by out_ptr) or a pointer valid for a write.
        let out = unsafe { out_ptr(json, "json") }?;
        let job = if job.is_null() {
            None
        } else {
            // SAFETY: non-null, and NUL-terminated by the caller's contract.
            let s = unsafe { std::ffi::CStr::from_ptr(job) };
            Some(
                s.to_str()
                    .map_err(|_| Failure::invalid_argument("job is not UTF-8"))?
                    .to_string(),
            )
        };
        let text = match job {
            None => runtime::status::list_jobs().map(|l| l.to_json()),
            Some(j) => runtime::status::job_status(&j).map(|s| s.to_json()),
        }
        .map_err(|e| {
            let code = match e {
                runtime::status::StatusError::NotFound { .. }
                | runtime::status::StatusError::OtherUser { .. } => {
                    lockstepResult_t::lockstepInvalidArgument
                }
                _ => lockstepResult_t::lockstepSystemError,
            };
            Failure::new(code, e.to_string())
        })?;
        *out = handle::keep_status_json(text);
        Ok(())
    })
}
