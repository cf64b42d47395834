//! The one backend-selection policy for device buffers, used by `Communicator::from_env`,
//! `lockstep`, `train-cnn` and the benchmarks alike.
//!
//! | ranks on this node vs GPUs | NCCL | result |
//! |---|---|---|
//! | one rank | loads | NCCL (a one-rank communicator: what torch's `nccl` backend runs at world size 1, a device copy per out-of-place call) |
//! | one rank | missing, or `LOCKSTEP_CHECK_FINITE=1` | [`StagedBackend`] over the host communicator (no NCCL needed; logged at info level) |
//! | every rank has its own GPU | loads | NCCL |
//! | every rank has its own GPU | missing | error naming the library search and `LOCKSTEP_BACKEND=shm` |
//! | ranks share a GPU, `NCCL_MULTI_RANK_GPU_ENABLE=1`, NCCL ≥ 2.30 | loads | NCCL multi-rank mode |
//! | ranks share a GPU otherwise | any | [`StagedBackend`] (logged at info level, with the reason at warn level when the user asked for NCCL's mode) |
//!
//! "Ranks on this node" is the size of the host communicator the policy gets: a shared-memory
//! communicator, so every one of its ranks runs on this node (never the job's global world
//! size). A communicator that is already a device one (NCCL from [`nccl_across_nodes`], or one
//! this policy built) is kept as it is.
//!
//! Multi-node jobs with `LOCKSTEP_BACKEND=nccl` need one GPU per rank; their unique id travels
//! through the rendezvous store ([`nccl_across_nodes`]).

use std::sync::Arc;
use std::time::Duration;

use super::vars::{node_of, var, EnvInfo, JOB_ID_KEY};
use crate::comm::{CommError, Communicator};
use crate::cuda::{Context, CudaError};
use crate::shm::{ShmComm, ShmConfig};
use crate::staged::StagedBackend;
use crate::store::{Store, TcpStore};

/// NCCL 2.30 runs several ranks on one GPU when `NCCL_MULTI_RANK_GPU_ENABLE=1` (experimental);
/// older versions refuse with "Duplicate GPU detected". The user opts in through NCCL's own
/// variable; without it, or with an older NCCL, ranks that share a GPU stage through shared memory.
fn nccl_multi_rank_gpu() -> bool {
    let wanted = var("NCCL_MULTI_RANK_GPU_ENABLE").is_some_and(|v| v.trim() == "1");
    if !wanted {
        return false;
    }
    match crate::nccl::version() {
        Ok(v) if v >= 23000 => {
            tracing::info!(
                "ranks share a GPU: NCCL {v} multi-rank mode (NCCL_MULTI_RANK_GPU_ENABLE=1)"
            );
            true
        }
        Ok(v) => {
            tracing::warn!(
                "NCCL_MULTI_RANK_GPU_ENABLE=1 needs NCCL 2.30 or newer, the loaded one is {v}: staging through shared memory instead"
            );
            false
        }
        Err(e) => {
            tracing::warn!("NCCL_MULTI_RANK_GPU_ENABLE=1 but NCCL does not load ({e}): staging through shared memory instead");
            false
        }
    }
}

/// A lone rank takes NCCL when it loads, as torch's `nccl` backend does at world size 1 (an
/// out-of-place call is one device copy, an in-place one nothing), and stages through host memory
/// otherwise, so a one-GPU job needs no NCCL. `LOCKSTEP_CHECK_FINITE=1` keeps it staged, where the
/// host kernels run the check NCCL's cannot.
fn nccl_serves_one_rank() -> bool {
    if matches!(finite_check_asked(), Ok(true)) {
        tracing::info!("one rank with LOCKSTEP_CHECK_FINITE=1: device calls stage through host memory, where the finite check runs");
        return false;
    }
    match crate::nccl::version() {
        Ok(_) => true,
        Err(e) => {
            tracing::info!(
                "one rank and NCCL does not load ({e}): device calls stage through host memory"
            );
            false
        }
    }
}

/// Communicators created through the store by this process so far: each gets its own key, and
/// every rank creates them in the same order.
static NCCL_GENERATION: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// NCCL for a job that spans nodes: one GPU per rank (local rank → device), the unique id through
/// the rendezvous store. CUDA is first initialised here, in the rank.
///
/// The ranks of each host also form a shared-memory communicator of their own (its segment
/// tagged as [`node_of`] says), where every NCCL call is shown as on one node: `lockstep status`
/// reads it there, and that node's launcher answers for it through the store.
pub(crate) fn nccl_across_nodes(
    info: &EnvInfo,
    store: &mut TcpStore,
    hosts: &[String],
    cfg: ShmConfig,
    timeout: Duration,
) -> Result<Communicator, CommError> {
    let cuda = |e: CudaError| CommError::Backend {
        backend: "cuda",
        message: e.to_string(),
    };
    // The environment is checked before CUDA is touched.
    let opts = crate::nccl::NcclOptions::from_env().map_err(|e| CommError::Setup(e.to_string()))?;
    refuse_check_finite()?;
    let gpus = crate::cuda::device_count().map_err(cuda)?.max(0) as usize;
    let here = hosts.iter().filter(|h| **h == hosts[info.rank]).count();
    if here > gpus {
        let name = hosts[info.rank]
            .split('/')
            .next()
            .unwrap_or("?")
            .to_string();
        return Err(CommError::Unsupported(format!(
            "LOCKSTEP_BACKEND=nccl across nodes: {here} ranks run on host {name}, which has {gpus} visible GPU(s); every rank of a multi-node job needs its own GPU (ranks may share a GPU only in a one-node job, through staging); start at most {gpus} rank(s) per node"
        )));
    }
    let job = store
        .wait_get(JOB_ID_KEY, timeout)
        .map_err(|e| CommError::Setup(format!("rank {}: {e}", info.rank)))?;
    let job = String::from_utf8(job)
        .map_err(|_| CommError::Setup("the job id in the rendezvous store is not UTF-8".into()))?;
    let node = node_of(&job, hosts, &hosts[info.rank]).expect("this rank's own host is listed");
    let local = node
        .members
        .iter()
        .position(|&r| r == info.rank)
        .expect("a rank is a member of its own host's node");
    let view = ShmComm::join_named(&node.tag, local, node.members.len(), cfg.status_only())?;
    let ctx = Context::new(info.local_rank as i32).map_err(cuda)?;
    let generation = NCCL_GENERATION.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut ex = crate::nccl::StoreExchange {
        store,
        key: format!("lockstep/nccl/unique-id/{generation}"),
        timeout,
    };
    let mut nccl = crate::nccl::NcclComm::new(&ctx, info.rank, info.world_size, &mut ex, opts)
        .map_err(|e| CommError::Backend {
            backend: "nccl",
            message: e.to_string(),
        })?;
    nccl.show_in(Communicator::from_backend(Box::new(view)));
    Ok(Communicator::from_backend(Box::new(nccl)))
}

/// `LOCKSTEP_CHECK_FINITE=1` where NCCL would run the reductions: an error, never a check that
/// silently does not happen (NCCL reduces in its own kernels, which have no pass lockstep owns).
/// The staged backend runs the host communicator's kernels and checks.
fn refuse_check_finite() -> Result<(), CommError> {
    if finite_check_asked()? {
        return Err(CommError::Unsupported(format!(
            "{}=1 is not supported on the NCCL backend: its reductions run in NCCL's own kernels, which lockstep cannot check for NaN and infinities; set it to 0 and check the inputs before the call (torch.isfinite), or run host buffers on LOCKSTEP_BACKEND=shm",
            crate::types::env::CHECK_FINITE.name
        )));
    }
    Ok(())
}

/// Whether `LOCKSTEP_CHECK_FINITE=1` asks for the finite check (a malformed value is an error).
fn finite_check_asked() -> Result<bool, CommError> {
    match crate::types::env::CHECK_FINITE.choice() {
        Ok(v) => Ok(v == Some("1")),
        Err(e) => Err(CommError::Setup(e.to_string())),
    }
}

/// What [`device_communicator`] builds for a node's ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DeviceChoice {
    /// NCCL, one GPU per rank (or NCCL's multi-rank mode when `multi_rank`).
    Nccl { multi_rank: bool },
    /// Stage device buffers through pinned host memory into the host communicator.
    Staged,
}

/// The policy, without side effects: `local_ranks` ranks on this node (not the global world
/// size: a 16-rank job on two 8-GPU nodes has 8 here), `gpus` visible devices, whether NCCL can
/// serve a lone rank (`alone_ok`: it loads and no finite check was asked for) and whether NCCL's
/// multi-rank mode was asked for and is available (`multi_rank_ok`). Both are evaluated lazily,
/// only where the answer matters: they load NCCL.
pub(crate) fn choose(
    local_ranks: usize,
    gpus: usize,
    alone_ok: impl FnOnce() -> bool,
    multi_rank_ok: impl FnOnce() -> bool,
) -> DeviceChoice {
    if local_ranks <= 1 {
        if alone_ok() {
            DeviceChoice::Nccl { multi_rank: false }
        } else {
            DeviceChoice::Staged
        }
    } else if gpus >= local_ranks {
        DeviceChoice::Nccl { multi_rank: false }
    } else if multi_rank_ok() {
        DeviceChoice::Nccl { multi_rank: true }
    } else {
        DeviceChoice::Staged
    }
}

/// Device communicator for the ranks of one node, chosen by the policy in the module docs: NCCL
/// when every rank has its own GPU (or NCCL's multi-rank mode is asked for and available),
/// otherwise the host communicator staging device buffers through pinned host memory. The NCCL
/// unique id travels through the host communicator, so CUDA is first initialised here, in the
/// rank.
///
/// Returns the communicator and the CUDA context of the rank's device (local rank modulo the
/// number of visible devices), on which device buffers for it must be allocated.
///
/// `host` is normally the node's shared-memory communicator, whose ranks all run on this node.
/// A communicator that already is a device one (`Communicator::from_env` with
/// `LOCKSTEP_BACKEND=nccl`, which across nodes builds NCCL directly) is returned unchanged, with
/// its context: wrapping it again would stage device buffers into a communicator that takes only
/// device buffers.
pub fn device_communicator(
    host: Communicator,
    local_rank: usize,
) -> Result<(Communicator, Arc<Context>), CommError> {
    if let Some(ctx) = host.device_context() {
        tracing::debug!(rank = host.rank(), backend = ?host.backend_kind(), "already a device communicator: kept as it is");
        return Ok((host, ctx));
    }
    let cuda = |e: CudaError| CommError::Backend {
        backend: "cuda",
        message: e.to_string(),
    };
    // The environment is checked before CUDA is touched.
    let opts = crate::nccl::NcclOptions::from_env().map_err(|e| CommError::Setup(e.to_string()))?;
    let gpus = crate::cuda::device_count().map_err(cuda)?;
    if gpus <= 0 {
        return Err(CommError::Unsupported(
            "device collectives need a CUDA device, but none is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES); for host buffers use LOCKSTEP_BACKEND=shm".into(),
        ));
    }
    let gpus = gpus as usize;
    let ordinal = (local_rank % gpus) as i32;
    let ctx = Context::new(ordinal).map_err(cuda)?;
    // A host (shared-memory) communicator: all of its ranks share this node.
    let (rank, world) = (host.rank(), host.world_size());
    let choice = choose(world, gpus, nccl_serves_one_rank, nccl_multi_rank_gpu);
    tracing::debug!(
        rank,
        world,
        gpus,
        device = ordinal,
        ?choice,
        "device backend selected"
    );
    match choice {
        DeviceChoice::Staged => {
            let staged = StagedBackend::new(&ctx, host).map_err(cuda)?;
            Ok((Communicator::from_backend(Box::new(staged)), ctx))
        }
        DeviceChoice::Nccl { .. } => {
            refuse_check_finite()?;
            // The host communicator stays beside NCCL: its peer watch turns a death into an
            // error within a poll, and its segment agrees on the members of shrink and grow.
            let nccl = crate::nccl::NcclComm::over_host(&ctx, host, opts).map_err(|e| {
                CommError::Backend {
                    backend: "nccl",
                    message: e.to_string(),
                }
            })?;
            Ok((Communicator::from_backend(Box::new(nccl)), ctx))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_table() {
        let never = || -> bool { unreachable!() };
        assert_eq!(
            choose(1, 8, || true, never),
            DeviceChoice::Nccl { multi_rank: false }
        );
        assert_eq!(choose(1, 8, || false, never), DeviceChoice::Staged);
        assert_eq!(
            choose(2, 2, never, never),
            DeviceChoice::Nccl { multi_rank: false }
        );
        assert_eq!(
            choose(4, 2, never, || true),
            DeviceChoice::Nccl { multi_rank: true }
        );
        assert_eq!(choose(4, 2, never, || false), DeviceChoice::Staged);
        // Two nodes of 8 GPUs and 8 ranks each: the policy sees the node's 8 ranks, not 16.
        assert_eq!(
            choose(8, 8, never, never),
            DeviceChoice::Nccl { multi_rank: false }
        );
    }
}
