//! Building the hierarchical communicator under MPI.

use std::time::{SystemTime, UNIX_EPOCH};

use super::backend::HierBackend;
use super::layout::Layout;
use crate::comm::{CommError, Communicator};
use crate::mpi::{Mpi, MpiComm};
use crate::shm::{ShmComm, ShmConfig};
use crate::types::env::{self, EnvError};

/// `LOCKSTEP_MPI`: whether `Communicator::from_env` joins a CPU job through MPI.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MpiMode {
    /// When the launcher's variables (or the rendezvous) place ranks on several hosts, and the
    /// launcher is an MPI one (`mpiexec`, `mpirun`, `srun`): the default.
    Auto,
    /// Always, nodes found by MPI: also on one host (with `MPIR_CVAR_NUM_CLIQUES` or
    /// `LOCKSTEP_MPI_NODE_SIZE` to make several nodes of it, for tests).
    On,
    /// Never: a CPU job across hosts is refused.
    Off,
}

/// `LOCKSTEP_MPI`, checked.
pub(crate) fn mpi_mode() -> Result<MpiMode, EnvError> {
    Ok(match env::MPI.choice()? {
        None | Some("auto") => MpiMode::Auto,
        Some("on") => MpiMode::On,
        Some(_) => MpiMode::Off,
    })
}

fn setup(msg: String) -> CommError {
    CommError::Setup(msg)
}

fn words(b: &[u8]) -> Vec<u64> {
    b.chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
        .collect()
}

/// The ranks of this rank's node: MPI's shared-memory split, or blocks of
/// `LOCKSTEP_MPI_NODE_SIZE` consecutive ranks, which must each share memory.
fn node_comm(world: &MpiComm) -> Result<MpiComm, CommError> {
    let shared = world.split_shared()?;
    let Some(size) = env::MPI_NODE_SIZE
        .count()
        .map_err(|e| setup(e.to_string()))?
    else {
        return Ok(shared);
    };
    let size = size as usize;
    let rank = world.rank();
    let block = world
        .split(Some((rank / size) as u32), rank as i32)?
        .ok_or_else(|| setup("MPI_Comm_split gave this rank no communicator".into()))?;
    // Every rank of a block must share memory: the block's ranks agree on the lowest rank of
    // their shared-memory group.
    let lowest = words(&shared.all_gather_bytes(&(rank as u64).to_le_bytes())?)
        .into_iter()
        .min()
        .unwrap_or(0);
    let seen = words(&block.all_gather_bytes(&lowest.to_le_bytes())?);
    if seen.iter().any(|&s| s != lowest) {
        return Err(setup(format!(
            "LOCKSTEP_MPI_NODE_SIZE={size} puts rank {rank} in a node with ranks that do not share memory with it (MPI's shared-memory split disagrees): unset it, or make it divide the ranks of each host"
        )));
    }
    Ok(block)
}

/// Join the job MPI started this process in: one [`Communicator`] over every rank of
/// `MPI_COMM_WORLD`, ranked as there, with shared memory inside each node.
pub(crate) fn join(cfg: ShmConfig) -> Result<Communicator, CommError> {
    if cfg.check_finite {
        // Its reductions run on the node leaders and along the chain of nodes (`fold`), not in
        // the shared-memory kernels that check: refused rather than silently unchecked.
        return Err(CommError::Unsupported(
            "LOCKSTEP_CHECK_FINITE=1 is not supported on a job joined through MPI (the hierarchical backend reduces outside the shared-memory kernels that run the check); set it to 0, or run on one node without MPI".into(),
        ));
    }
    let mpi = Mpi::init()?;
    let world = mpi.world()?;
    let rank = world.rank();
    let node = node_comm(&world)?;
    let members = words(&node.all_gather_bytes(&(rank as u64).to_le_bytes())?);
    let leader = members.iter().copied().min().unwrap_or(rank as u64);
    drop(node);
    // Every rank's node (by its lowest rank) and pid; rank 0's pid and clock name the job.
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut mine = leader.to_le_bytes().to_vec();
    mine.extend((std::process::id() as u64).to_le_bytes());
    mine.extend(nanos.to_le_bytes());
    let all = words(&world.all_gather_bytes(&mine)?);
    let leader_of: Vec<usize> = all.chunks_exact(3).map(|w| w[0] as usize).collect();
    let pids: Vec<i32> = all.chunks_exact(3).map(|w| w[1] as i32).collect();
    let layout = Layout::from_leaders(&leader_of).map_err(setup)?;
    let (k, local) = layout.place[rank];
    let job = format!("mpi-{:x}-{:x}-node{}", all[1], all[2], layout.global(k, 0));
    tracing::debug!(
        rank,
        node = k,
        local,
        nodes = layout.nodes.len(),
        "joining through MPI: node {k} of {}, shared segment {job}",
        layout.nodes.len()
    );
    let shm = ShmComm::join_named(&job, local, layout.nodes[k].len(), cfg)?;
    let node = Communicator::from_backend(Box::new(shm));
    let backend = HierBackend::new(world, layout, node, pids)?;
    Ok(Communicator::from_backend(Box::new(backend)))
}
