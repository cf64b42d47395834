//! The abort state of one NCCL handle, shared between the communicator and the completion
//! handles of its pending nonblocking calls (`Work`).
//!
//! Separate because it is the one piece of the communicator that crosses threads: a `Work` may
//! poll `ncclCommGetAsyncError` or call `ncclCommAbort` from another thread while the
//! communicator itself is used (or dropped) through `&mut self`.

use std::ffi::c_int;
use std::sync::Mutex;

use super::error::NcclError;
use super::result::{self, ncclComm_t, SUCCESS};

/// The NCCL handle as the communicator and its pending `Work` handles share it: a `Work` may poll
/// `ncclCommGetAsyncError` and abort the communicator from another thread, and must never touch
/// it after `ncclCommDestroy`, so both happen under `state`'s lock.
pub(super) struct Shared {
    pub(super) comm: ncclComm_t,
    pub(super) rank: usize,
    pub(super) state: Mutex<State>,
}

#[derive(Default)]
pub(super) struct State {
    /// Set once aborted: every later call fails with this reason.
    pub(super) aborted: Option<String>,
    /// Set once `ncclCommDestroy` ran.
    pub(super) destroyed: bool,
}

// SAFETY: `ncclCommGetAsyncError` and `ncclCommAbort` may be called from any thread; every use of
// the handle outside `NcclComm`'s `&mut self` methods holds `state`'s lock and checks `destroyed`.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

impl Shared {
    pub(super) fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn aborted(&self) -> Option<String> {
        self.state().aborted.clone()
    }

    /// Abort the communicator (idempotent) and remember why.
    pub(super) fn abort(&self, reason: &str) {
        let mut st = self.state();
        if st.aborted.is_some() || st.destroyed {
            return;
        }
        st.aborted = Some(reason.to_string());
        if let Ok(api) = result::api() {
            // SAFETY: live communicator (not destroyed, checked under the lock); after abort it is
            // never used again (checked via `aborted`).
            let rc = unsafe { (api.ncclCommAbort)(self.comm) };
            if rc != SUCCESS {
                tracing::error!("ncclCommAbort on rank {} returned {rc}", self.rank);
            }
        }
    }

    /// `ncclCommGetAsyncError`, or `None` once the communicator is gone (destroyed or aborted).
    pub(super) fn async_error(&self) -> Result<Option<c_int>, NcclError> {
        let st = self.state();
        if st.destroyed || st.aborted.is_some() {
            return Ok(None);
        }
        let mut code: c_int = 0;
        // SAFETY: live communicator (checked under the lock, held across the call), valid out-pointer.
        let rc = unsafe { (result::api()?.ncclCommGetAsyncError)(self.comm, &mut code) };
        result::check(rc, Some(self.comm), || "ncclCommGetAsyncError".into())?;
        Ok(Some(code))
    }
}
