//! Communicator handles, failures and the boundary guard.
//!
//! * A `lockstepComm_t` is the address of a registered [`lockstepComm`], used only as a key into
//!   the registry of live communicators: every call looks its handle up (an `Arc`), so a NULL,
//!   destroyed or made-up handle is an error and a destroy racing a running call cannot free it
//!   under that call.
//! * [`guard`] runs an entry point under `catch_unwind` and turns its [`Failure`] (or a panic)
//!   into a result code, keeping the message per communicator and per thread.

use std::any::Any;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use super::types::{lockstepResult_t, ResultArg};
use runtime::comm::{CommError, Communicator};
use runtime::cuda::Context;

/// `MAJOR * 10000 + MINOR * 100 + PATCH` of this crate, as NCCL encodes its version.
pub(crate) const VERSION_CODE: c_int = digits(env!("CARGO_PKG_VERSION_MAJOR")) * 10000
    + digits(env!("CARGO_PKG_VERSION_MINOR")) * 100
    + digits(env!("CARGO_PKG_VERSION_PATCH"));

const fn digits(s: &str) -> c_int {
    let b = s.as_bytes();
    let mut v = 0;
    let mut i = 0;
    while i < b.len() {
        v = v * 10 + (b[i] - b'0') as c_int;
        i += 1;
    }
    v
}

/// What a communicator was made with: its config, or the defaults.
#[derive(Clone, Debug)]
pub(crate) struct Settings {
    /// `commName`, quoted in the communicator's error messages.
    pub(crate) name: Option<String>,
    /// `blocking` (every call completes before it returns either way).
    pub(crate) blocking: bool,
    /// `timeoutMs`: how long a rank waits for its peers in one call; `None`: LOCKSTEP_TIMEOUT_S
    /// or the backend's default.
    pub(crate) timeout: Option<Duration>,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            name: None,
            blocking: true,
            timeout: None,
        }
    }
}

/// Why a call failed: its result code and a message saying what went wrong and what to do next.
#[derive(Clone, Debug)]
pub(crate) struct Failure {
    pub(crate) code: lockstepResult_t,
    pub(crate) msg: String,
    /// The communicator cannot be used again (a peer died, timed out or aborted it).
    pub(crate) fatal: bool,
}

impl Failure {
    pub(crate) fn new(code: lockstepResult_t, msg: impl Into<String>) -> Failure {
        Failure {
            code,
            msg: msg.into(),
            fatal: false,
        }
    }

    pub(crate) fn invalid_argument(msg: impl Into<String>) -> Failure {
        Failure::new(lockstepResult_t::lockstepInvalidArgument, msg)
    }

    pub(crate) fn invalid_usage(msg: impl Into<String>) -> Failure {
        Failure::new(lockstepResult_t::lockstepInvalidUsage, msg)
    }

    pub(crate) fn system(msg: impl Into<String>) -> Failure {
        Failure::new(lockstepResult_t::lockstepSystemError, msg)
    }
}

impl From<CommError> for Failure {
    fn from(e: CommError) -> Failure {
        use lockstepResult_t::*;
        let (code, fatal) = match &e {
            CommError::InvalidArgument { .. } => (lockstepInvalidArgument, false),
            // A NaN or infinity in a reduction's input (LOCKSTEP_CHECK_FINITE=1): bad data, the
            // same on every rank; the communicator stays usable.
            CommError::NonFinite { .. } => (lockstepInvalidArgument, false),
            // The ranks disagree on the call: a usage error, reported on every rank.
            CommError::Mismatch { .. } | CommError::Unsupported(_) => (lockstepInvalidUsage, false),
            CommError::PeerLost { .. } | CommError::Aborted { .. } | CommError::Excluded { .. } => {
                (lockstepRemoteError, true)
            }
            // Calls on a communicator lockstepCommShrink replaced: use the new one.
            CommError::Shrunk { .. } => (lockstepInvalidUsage, false),
            CommError::Timeout { .. } => (lockstepTimeout, true),
            CommError::Setup(_) | CommError::Os { .. } => (lockstepSystemError, false),
            CommError::Backend {
                backend: "cuda", ..
            } => (lockstepUnhandledCudaError, false),
            CommError::Backend { .. } => (lockstepSystemError, false),
            #[allow(unreachable_patterns)]
            _ => (lockstepInternalError, false),
        };
        let mut msg = e.to_string();
        if code == lockstepTimeout {
            msg.push_str("; a communicator made with a lockstepConfig_t takes its timeout from the config's timeoutMs instead");
        }
        Failure { code, msg, fatal }
    }
}

/// A communicator (opaque): the ranks of one job, joined by lockstepCommInitRank,
/// lockstepCommInitRankConfig, lockstepCommInitFromEnv or lockstepCommSplit, freed by
/// lockstepCommDestroy or lockstepCommAbort.
pub struct lockstepComm {
    /// `None` once destroyed (operations still recorded for it in a group fail).
    comm: Mutex<Option<Communicator>>,
    rank: usize,
    world: usize,
    /// The device context of a device communicator (NCCL, staged).
    device: Option<Arc<Context>>,
    /// The message of the last failed call on this communicator.
    last_error: Mutex<String>,
    /// `lockstepSuccess` until a failure breaks the communicator for good.
    async_error: AtomicI32,
    /// What it was made with (lockstepConfig_t, or the defaults).
    settings: Settings,
    /// lockstepCommFinalize has run: only destroying it and asking about it remain.
    finalized: AtomicBool,
}

impl lockstepComm {
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    pub(crate) fn world(&self) -> usize {
        self.world
    }

    pub(crate) fn device(&self) -> Option<&Arc<Context>> {
        self.device.as_ref()
    }

    pub(crate) fn settings(&self) -> &Settings {
        &self.settings
    }

    /// lockstepCommFinalize: wait for this rank's pending work, then for every rank to get here,
    /// so that no peer is still in a call with this communicator; afterwards only destroying it
    /// and asking about it remain.
    pub(crate) fn finalize(&self) -> Result<(), Failure> {
        self.with_comm(|c| {
            c.synchronize()
                .and_then(|()| c.barrier())
                .and_then(|()| c.synchronize())
                .map_err(Failure::from)
        })?;
        self.finalized.store(true, Ordering::Release);
        Ok(())
    }

    pub(crate) fn async_error(&self) -> lockstepResult_t {
        code_from_int(self.async_error.load(Ordering::Acquire))
            .unwrap_or(lockstepResult_t::lockstepInternalError)
    }

    fn break_with(&self, code: lockstepResult_t) {
        let _ =
            self.async_error
                .compare_exchange(0, code as i32, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Run `f` on the communicator, under its lock. A panic inside breaks the communicator (its
    /// state may be half-updated): later calls are refused.
    pub(crate) fn with_comm<R>(
        &self,
        f: impl FnOnce(&mut Communicator) -> Result<R, Failure>,
    ) -> Result<R, Failure> {
        let mut guard: MutexGuard<'_, Option<Communicator>> =
            self.comm.lock().unwrap_or_else(PoisonError::into_inner);
        if self.async_error() == lockstepResult_t::lockstepInternalError {
            return Err(Failure::invalid_usage(
                "this communicator is unusable after an internal error in an earlier call (see that call's message); destroy it and create a new one",
            ));
        }
        let Some(c) = guard.as_mut() else {
            return Err(Failure::invalid_usage(
                "the communicator was destroyed before this operation ran (lockstepCommDestroy inside the group)",
            ));
        };
        if self.finalized.load(Ordering::Acquire) {
            return Err(Failure::invalid_usage(
                "the communicator was finalized (lockstepCommFinalize): it takes no more operations; destroy it with lockstepCommDestroy",
            ));
        }
        match catch_unwind(AssertUnwindSafe(|| f(c))) {
            Ok(Err(e)) => {
                if e.fatal {
                    self.break_with(e.code);
                }
                Err(e)
            }
            Ok(r) => r,
            Err(p) => {
                self.break_with(lockstepResult_t::lockstepInternalError);
                Err(panic_failure(p.as_ref()))
            }
        }
    }
}

/// A communicator handle, as `ncclComm_t`.
pub type lockstepComm_t = *mut lockstepComm;

/// Live communicators by handle address.
static COMMS: Mutex<BTreeMap<usize, Arc<lockstepComm>>> = Mutex::new(BTreeMap::new());

fn comms() -> MutexGuard<'static, BTreeMap<usize, Arc<lockstepComm>>> {
    // Nothing panics under this lock; should it ever, the map itself is still consistent.
    COMMS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Register a new communicator, made with `settings`, and return its handle.
pub(crate) fn register(c: Communicator, settings: Settings) -> lockstepComm_t {
    tracing::debug!(
        rank = c.rank(),
        world = c.world_size(),
        name = settings.name.as_deref().unwrap_or(""),
        blocking = settings.blocking,
        timeout_ms = settings.timeout.map_or(0, |t| t.as_millis() as u64),
        "C communicator registered"
    );
    let h = Arc::new(lockstepComm {
        rank: c.rank(),
        world: c.world_size(),
        device: c.device_context(),
        comm: Mutex::new(Some(c)),
        last_error: Mutex::new(String::new()),
        async_error: AtomicI32::new(lockstepResult_t::lockstepSuccess as i32),
        settings,
        finalized: AtomicBool::new(false),
    });
    let ptr = Arc::as_ptr(&h) as lockstepComm_t;
    comms().insert(ptr as usize, h);
    ptr
}

/// The live communicator behind `comm`.
pub(crate) fn lookup(comm: lockstepComm_t) -> Result<Arc<lockstepComm>, Failure> {
    if comm.is_null() {
        return Err(Failure::invalid_argument("comm is NULL: pass a communicator made by lockstepCommInitRank or lockstepCommInitFromEnv"));
    }
    comms().get(&(comm as usize)).cloned().ok_or_else(|| {
        Failure::invalid_argument(format!(
            "comm {comm:p} is not a live communicator (never made by lockstepCommInitRank/lockstepCommInitFromEnv, or destroyed already)"
        ))
    })
}

/// lockstepCommDestroy (`wait`) and lockstepCommAbort.
pub(crate) fn destroy(comm: lockstepComm_t, wait: bool) -> Result<(), Failure> {
    let h = lookup(comm)?;
    comms().remove(&(comm as usize));
    // Waits for a call running in another thread; a panic poisoned nothing we still rely on.
    let taken = h.comm.lock().unwrap_or_else(PoisonError::into_inner).take();
    match taken {
        Some(mut c) if wait => {
            let r = c.synchronize().map_err(Failure::from);
            drop(c);
            r
        }
        _ => Ok(()),
    }
}

thread_local! {
    /// The message of this thread's last failed call.
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
    /// What lockstepGetLastError returned on this thread, per `comm` argument (0: NULL).
    static RETURNED: RefCell<BTreeMap<usize, CString>> = const { RefCell::new(BTreeMap::new()) };
    /// What lockstepStatusJson returned last on this thread.
    static STATUS_JSON: RefCell<CString> = RefCell::new(CString::default());
}

/// Keep `json` for this thread until its next lockstepStatusJson call, and return it as C text.
pub(crate) fn keep_status_json(json: String) -> *const c_char {
    STATUS_JSON.with(|s| {
        let mut s = s.borrow_mut();
        *s = CString::new(json.replace('\0', " ")).unwrap_or_default();
        s.as_ptr()
    })
}

/// Keep `f`'s message for lockstepGetLastError: on the thread, and on `comm` when there is one
/// (quoting the communicator's `commName`, when it has one).
pub(crate) fn record(name: &str, comm: Option<&lockstepComm>, f: &Failure) -> String {
    let msg = match comm.and_then(|h| h.settings.name.as_deref()) {
        Some(n) => format!("{name} on communicator {n:?}: {}", f.msg),
        None => format!("{name}: {}", f.msg),
    };
    tracing::debug!(code = f.code as i32, "{msg}");
    if let Some(h) = comm {
        *h.last_error.lock().unwrap_or_else(PoisonError::into_inner) = msg.clone();
    }
    LAST_ERROR.with(|l| l.borrow_mut().clone_from(&msg));
    msg
}

fn panic_failure(p: &(dyn Any + Send)) -> Failure {
    let what = p
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_default();
    Failure::new(
        lockstepResult_t::lockstepInternalError,
        format!(
            "internal error (a bug in lockstep; please report it with this message): panic: {what}"
        ),
    )
}

fn finish(
    name: &str,
    comm: Option<&lockstepComm>,
    r: std::thread::Result<Result<(), Failure>>,
) -> lockstepResult_t {
    let f = match r {
        Ok(Ok(())) => return lockstepResult_t::lockstepSuccess,
        Ok(Err(f)) => f,
        Err(p) => panic_failure(p.as_ref()),
    };
    record(name, comm, &f);
    f.code
}

/// Once, before the first call runs: the library is embedded in a program that owns its threads'
/// placement, so ranks bind to no CPU unless `LOCKSTEP_CPU_BIND` asks.
fn embedded_defaults() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| runtime::shm::set_default_cpu_bind(runtime::shm::CpuBind::None));
}

/// Run entry point `name` (no communicator) and map its outcome to a result code.
pub(crate) fn guard(name: &str, f: impl FnOnce() -> Result<(), Failure>) -> lockstepResult_t {
    finish(
        name,
        None,
        catch_unwind(AssertUnwindSafe(|| {
            embedded_defaults();
            crate::log::ensure()?;
            f()
        })),
    )
}

/// Run entry point `name` on communicator `comm` (looked up first) and map its outcome to a
/// result code; a failure's message is kept on the communicator too.
pub(crate) fn guard_comm(
    name: &str,
    comm: lockstepComm_t,
    f: impl FnOnce(&Arc<lockstepComm>) -> Result<(), Failure>,
) -> lockstepResult_t {
    let mut found: Option<Arc<lockstepComm>> = None;
    let r = catch_unwind(AssertUnwindSafe(|| {
        embedded_defaults();
        crate::log::ensure()?;
        let h = lookup(comm)?;
        found = Some(h.clone());
        f(&h)
    }));
    finish(name, found.as_deref(), r)
}

/// `p` as a writable reference, or lockstepInvalidArgument naming `what` when it is NULL or
/// misaligned.
///
/// # Safety
/// `p` is NULL or valid for writes of a `T` for the returned lifetime.
pub(crate) unsafe fn out_ptr<'a, T>(p: *mut T, what: &str) -> Result<&'a mut T, Failure> {
    if p.is_null() {
        return Err(Failure::invalid_argument(format!(
            "{what} is NULL: pass a pointer to where the result goes"
        )));
    }
    if !p.is_aligned() {
        return Err(Failure::invalid_argument(format!(
            "{what} ({p:p}) is not aligned for its type"
        )));
    }
    // SAFETY: non-null and aligned (checked), valid for writes (the caller's contract).
    Ok(unsafe { &mut *p })
}

fn code_from_int(v: c_int) -> Option<lockstepResult_t> {
    use lockstepResult_t::*;
    Some(match v {
        0 => lockstepSuccess,
        1 => lockstepUnhandledCudaError,
        2 => lockstepSystemError,
        3 => lockstepInternalError,
        4 => lockstepInvalidArgument,
        5 => lockstepInvalidUsage,
        6 => lockstepRemoteError,
        7 => lockstepInProgress,
        8 => lockstepTimeout,
        _ => return None,
    })
}

/// lockstepGetErrorString.
pub(crate) fn error_string(result: ResultArg) -> &'static CStr {
    use lockstepResult_t::*;
    match code_from_int(result) {
        Some(lockstepSuccess) => c"no error",
        Some(lockstepUnhandledCudaError) => {
            c"unhandled cuda error (run with NCCL_DEBUG=INFO for details)"
        }
        Some(lockstepSystemError) => {
            c"unhandled system error (an operating-system call or the communicator's setup failed)"
        }
        Some(lockstepInternalError) => {
            c"internal error - please report this issue to the lockstep developers"
        }
        Some(lockstepInvalidArgument) => c"invalid argument",
        Some(lockstepInvalidUsage) => c"invalid usage",
        Some(lockstepRemoteError) => {
            c"remote process exited, timed out or aborted the communicator"
        }
        Some(lockstepInProgress) => c"lockstep operation in progress",
        Some(lockstepTimeout) => {
            c"timeout (a rank waited for its peers longer than the communicator's timeout)"
        }
        Some(lockstepNumResults) | None => c"unknown result code",
    }
}

/// lockstepGetLastError: a thread-owned copy of the message, one per `comm` argument, replaced
/// only when that argument's message has changed.
pub(crate) fn last_error(comm: lockstepComm_t) -> *const c_char {
    let r = catch_unwind(AssertUnwindSafe(|| {
        let msg = if comm.is_null() {
            LAST_ERROR.with(|l| l.borrow().clone())
        } else {
            match lookup(comm) {
                Ok(h) => h
                    .last_error
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clone(),
                Err(f) => format!("lockstepGetLastError: {}", f.msg),
            }
        };
        // Messages hold no NUL; should one ever, cut there rather than fail.
        let bytes: Vec<u8> = msg
            .into_bytes()
            .into_iter()
            .take_while(|&b| b != 0)
            .collect();
        RETURNED.with(|r| {
            let mut r = r.borrow_mut();
            // Copies for communicators destroyed since are not needed any more.
            if r.len() > 16 {
                let live = comms();
                r.retain(|k, _| *k == 0 || live.contains_key(k));
            }
            let slot = r.entry(comm as usize).or_default();
            if slot.as_bytes() != bytes.as_slice() {
                *slot = CString::new(bytes).unwrap_or_default();
            }
            slot.as_ptr()
        })
    }));
    r.unwrap_or(c"lockstepGetLastError: internal error while reading the message".as_ptr())
}
