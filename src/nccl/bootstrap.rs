//! Bootstrap: how the ranks of an NCCL communicator find each other. Rank 0 creates the unique
//! id (after the fork) and hands it to the other ranks through a caller-provided
//! [`UniqueIdExchange`] (the launcher's pipe, a TCP store, ...); then every rank joins with
//! `ncclCommInitRankConfig`, created non-blocking (`blocking = 0`) and polled with a timeout.
//!
//! Separate from the communicator's calls because it runs once, before any of them, and is the
//! only part that talks to a peer outside NCCL (the exchange).

use std::ffi::c_int;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::comm::Communicator;
use crate::cuda::{Context, DeviceBuffer, Producers, StreamFence};

use super::abort::{Shared, State};
use super::comm::{NcclComm, NcclOptions};
use super::error::{invalid_arg, NcclError};
use super::result::{self, ncclComm_t, ncclUniqueId, IN_PROGRESS};

/// Hands the NCCL unique id from rank 0 to every rank.
pub trait UniqueIdExchange {
    /// Rank 0 passes `Some(id)` and gets it back; other ranks pass `None` and receive rank 0's id.
    fn exchange(&mut self, rank: usize, id: Option<&[u8; 128]>) -> Result<[u8; 128], String>;
}

impl<F: FnMut(usize, Option<&[u8; 128]>) -> Result<[u8; 128], String>> UniqueIdExchange for F {
    fn exchange(&mut self, rank: usize, id: Option<&[u8; 128]>) -> Result<[u8; 128], String> {
        self(rank, id)
    }
}

/// Exchange through an existing host communicator (e.g. the launcher's shm `Communicator`):
/// rank 0 broadcasts the id to every rank. This plugs NCCL straight into `lockstep::launch`.
impl UniqueIdExchange for Communicator {
    fn exchange(&mut self, rank: usize, id: Option<&[u8; 128]>) -> Result<[u8; 128], String> {
        if rank != self.rank() {
            return Err(format!(
                "exchange called as rank {rank} on the communicator of rank {}",
                self.rank()
            ));
        }
        let mut buf: Vec<u8> = id.map(|i| i.to_vec()).unwrap_or_else(|| vec![0u8; 128]);
        self.broadcast_in_place(&mut buf, 0)
            .map_err(|e| e.to_string())?;
        let mut out = [0u8; 128];
        out.copy_from_slice(&buf);
        Ok(out)
    }
}

/// Exchange through the rendezvous store, for jobs that span nodes: rank 0 publishes the id under
/// `key`, every other rank waits up to `timeout` for it. Use a fresh key per communicator.
pub struct StoreExchange<'a> {
    /// The job's store (see `lockstep::store`).
    pub store: &'a mut dyn crate::store::Store,
    /// Key of this communicator's id.
    pub key: String,
    /// Longest wait for rank 0's id.
    pub timeout: Duration,
}

impl UniqueIdExchange for StoreExchange<'_> {
    fn exchange(&mut self, rank: usize, id: Option<&[u8; 128]>) -> Result<[u8; 128], String> {
        if let Some(id) = id {
            self.store
                .set(&self.key, id)
                .map_err(|e| format!("publishing the NCCL unique id: {e}"))?;
            return Ok(*id);
        }
        let v = self.store.wait_get(&self.key, self.timeout).map_err(|e| {
            format!(
                "rank {rank} waiting for rank 0's NCCL unique id under {:?}: {e}",
                self.key
            )
        })?;
        v.as_slice().try_into().map_err(|_| {
            format!(
                "the store holds {} bytes under {:?}, not a 128-byte NCCL unique id",
                v.len(),
                self.key
            )
        })
    }
}

/// Create a unique id (rank 0, after the fork).
pub fn unique_id() -> Result<[u8; 128], NcclError> {
    let id = result::get_unique_id()?;
    Ok(id.internal.map(|c| c as u8))
}

impl NcclComm {
    /// Join the communicator of `world` ranks as `rank` on `ctx`'s device.
    pub fn new(
        ctx: &Arc<Context>,
        rank: usize,
        world: usize,
        exchange: &mut dyn UniqueIdExchange,
        opts: NcclOptions,
    ) -> Result<NcclComm, NcclError> {
        if world == 0 || rank >= world {
            return Err(invalid_arg(format!(
                "rank {rank} out of range for world size {world}"
            )));
        }
        let api = result::api()?;
        ctx.bind()?;
        let id_bytes = if rank == 0 {
            let id = unique_id()?;
            exchange
                .exchange(0, Some(&id))
                .map_err(|detail| NcclError::Exchange { rank, detail })?
        } else {
            exchange
                .exchange(rank, None)
                .map_err(|detail| NcclError::Exchange { rank, detail })?
        };
        let id = ncclUniqueId {
            internal: id_bytes.map(|b| b as _),
        };
        let stream = ctx.stream()?;
        let scratch = DeviceBuffer::<f32>::zeros(&stream, 1)?;
        let mut comm: ncclComm_t = std::ptr::null_mut();
        let what = format!(
            "ncclCommInitRank(rank={rank}, nranks={world}, device={})",
            ctx.ordinal()
        );
        match (opts.nonblocking_init, api.ncclCommInitRankConfig) {
            (true, Some(init_cfg)) => {
                let mut cfg = result::config(false);
                // SAFETY: valid out-pointer, id by value, config initialised as NCCL_CONFIG_INITIALIZER.
                let rc =
                    unsafe { init_cfg(&mut comm, world as c_int, id, rank as c_int, &mut cfg) };
                if rc != IN_PROGRESS {
                    if let Err(e) = result::check(rc, Some(comm), || what.clone()) {
                        if !comm.is_null() {
                            // SAFETY: a communicator NCCL handed back from a failed init; never used again.
                            unsafe { (api.ncclCommAbort)(comm) };
                        }
                        return Err(e);
                    }
                }
            }
            _ => {
                // SAFETY: valid out-pointer, id by value; blocks until every rank has joined.
                let rc =
                    unsafe { (api.ncclCommInitRank)(&mut comm, world as c_int, id, rank as c_int) };
                result::check(rc, None, || what.clone())?;
            }
        }
        let shared = Arc::new(Shared {
            comm,
            rank,
            state: Mutex::new(State::default()),
        });
        let producers = Producers::new(ctx);
        let fence = StreamFence::new(ctx)?;
        let mut me = NcclComm {
            ctx: ctx.clone(),
            stream,
            comm,
            shared,
            rank,
            world,
            seq: 0,
            opts,
            scratch,
            producers,
            fence,
            current: crate::comm::CollKind::Barrier,
            membership: None,
            node_view: None,
        };
        me.settle(IN_PROGRESS, &what)?;
        Ok(me)
    }
}
