//! `ncclCommSplit`: a new communicator made from the ranks of a live one (NCCL 2.18 or newer),
//! behind [`Backend::split`](crate::comm::Backend::split).
//!
//! Separate from the bootstrap because no unique id is exchanged: the parent communicator is the
//! rendezvous, and a failed child must be aborted without touching the parent.

use std::ffi::c_int;
use std::sync::{Arc, Mutex};

use crate::comm::CommError;
use crate::cuda::{DeviceBuffer, Producers, StreamFence};

use super::abort::{Shared, State};
use super::comm::NcclComm;
use super::error::NcclError;
use super::result::{self, ncclComm_t};

impl NcclComm {
    /// Split this communicator with `ncclCommSplit` (NCCL 2.18 or newer; see
    /// [`Backend::split`](crate::comm::Backend::split)): `None` is `NCCL_SPLIT_NOCOLOR`. Colors
    /// above `i32::MAX` and keys outside `i32` are refused (NCCL takes C ints). The new
    /// communicator has its own stream and this one's options.
    pub fn split_comm(
        &mut self,
        color: Option<u32>,
        key: i64,
    ) -> Result<Option<NcclComm>, CommError> {
        let color = match color {
            None => result::SPLIT_NOCOLOR,
            Some(c) => c_int::try_from(c).map_err(|_| {
                CommError::Unsupported(format!(
                    "split: NCCL takes colors up to {}, not {c}",
                    c_int::MAX
                ))
            })?,
        };
        let key = c_int::try_from(key).map_err(|_| {
            CommError::Unsupported(format!(
                "split: NCCL takes keys that fit a C int, not {key}"
            ))
        })?;
        let Some(split) = result::api().map_err(NcclError::from)?.ncclCommSplit else {
            let lib = result::core()
                .map(|c| {
                    format!(
                        "{} (NCCL {})",
                        c.path,
                        crate::cuda::nccl_version_string(c.version)
                    )
                })
                .unwrap_or_default();
            return Err(CommError::Unsupported(format!(
                "split needs ncclCommSplit, which NCCL has since 2.18, but the loaded library {lib} lacks it; point LOCKSTEP_NCCL_LIBRARY at NCCL 2.18 or newer"
            )));
        };
        Ok(self.split_with(split, color, key)?)
    }

    fn split_with(
        &mut self,
        split: unsafe extern "C" fn(
            ncclComm_t,
            c_int,
            c_int,
            *mut ncclComm_t,
            *mut result::ncclConfig_t,
        ) -> c_int,
        color: c_int,
        key: c_int,
    ) -> Result<Option<NcclComm>, NcclError> {
        self.check_alive("ncclCommSplit")?;
        let api = result::api()?;
        self.ctx.bind()?;
        let what = format!(
            "ncclCommSplit(color={color}, key={key}) on rank {}",
            self.rank
        );
        let mut cfg = result::config(!self.opts.nonblocking_init);
        let mut child: ncclComm_t = std::ptr::null_mut();
        // SAFETY: live parent communicator (not aborted), valid out-pointer, config laid out as
        // NCCL_CONFIG_INITIALIZER makes it.
        let rc = unsafe { split(self.comm, color, key, &mut child, &mut cfg) };
        if child.is_null() {
            // No new communicator (no color, or the call failed): settle the parent's part.
            self.settle(rc, &what)?;
            if color == result::SPLIT_NOCOLOR {
                return Ok(None);
            }
            return Err(NcclError::Call {
                call: what,
                code: 3,
                message: "it returned no communicator for a rank with a color".into(),
                last: String::new(),
                hint: super::error::hint(3),
            });
        }
        let parts = self
            .ctx
            .stream()
            .and_then(|s| DeviceBuffer::<f32>::zeros(&s, 1).map(|b| (s, b)));
        let (stream, scratch) = match parts {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: the communicator NCCL just made; never used again.
                unsafe { (api.ncclCommAbort)(child) };
                return Err(e.into());
            }
        };
        // Until the new ranks are known, failures name this rank (of the parent).
        let shared = Arc::new(Shared {
            comm: child,
            rank: self.rank,
            state: Mutex::new(State::default()),
        });
        let producers = Producers::new(&self.ctx);
        let fence = StreamFence::new(&self.ctx).map_err(NcclError::from)?;
        let mut c = NcclComm {
            ctx: self.ctx.clone(),
            stream,
            comm: child,
            shared,
            rank: self.rank,
            world: 0,
            seq: 0,
            opts: self.opts.clone(),
            scratch,
            producers,
            fence,
            current: crate::comm::CollKind::Barrier,
            membership: None,
            node_view: None,
        };
        // A failed child is aborted (idempotent), so its drop leaves it alone.
        if let Err(e) = c.settle(rc, &what) {
            c.abort(&e.to_string());
            return Err(e);
        }
        let (mut n, mut r): (c_int, c_int) = (0, 0);
        // SAFETY: live, initialised communicator; valid out-pointers.
        let rc = unsafe { (api.ncclCommCount)(child, &mut n) };
        result::check(rc, Some(child), || "ncclCommCount".into())?;
        // SAFETY: as above.
        let rc = unsafe { (api.ncclCommUserRank)(child, &mut r) };
        result::check(rc, Some(child), || "ncclCommUserRank".into())?;
        (c.rank, c.world) = (r as usize, n as usize);
        Ok(Some(c))
    }
}
