//! [`Communicator::from_env`]: join the job a launcher started this process in, and choose its
//! backend. The launcher may be `lockstep launch`, torchrun (or torch's `env://` variables),
//! Open MPI's `mpirun` or Slurm's `srun` (see `vars`).
//!
//! * One node (every rank on this machine): the local ranks join a named shared-memory segment
//!   derived from the job's identity (`LOCKSTEP_JOB_ID`, torchrun's run id and master address,
//!   mpirun's job id, or Slurm's job and step ids); local rank 0 creates it. No port is used.
//! * Several nodes: every rank connects to the rendezvous store at `MASTER_ADDR` (under srun: the
//!   first host of the step's node list) with `LOCKSTEP_TOKEN` and publishes a host id. The store
//!   is hosted by the node-0 launcher under `lockstep launch`, and by global rank 0 otherwise, on
//!   `MASTER_PORT + 1` under torchrun (whose own store holds `MASTER_PORT`), `MASTER_PORT` under
//!   mpirun, a port derived from the job id under srun, or `LOCKSTEP_STORE_PORT` in every case.
//!   When all ranks turn out to share one host, they form one shared-memory communicator. A CPU
//!   job that spans hosts joins through MPI (`hier`: shared memory in each host, MPI between
//!   them) when an MPI launcher started it (mpirun, srun); under `lockstep launch` and torchrun
//!   it is refused with an error that says how to start it under mpiexec.
//! * MPICH's `mpiexec` on several hosts joins through MPI directly, without the store;
//!   `LOCKSTEP_MPI=on` does so under any launcher (and on one host: the nodes are then MPI's
//!   shared-memory split, or `LOCKSTEP_MPI_NODE_SIZE`), `LOCKSTEP_MPI=off` never.
//! * `LOCKSTEP_BACKEND` picks the backend: `shm` (the default) or `nccl`. With `nccl` on one node
//!   the unique id travels through the node's shared-memory communicator (and ranks that share a
//!   GPU stage through it); across nodes every rank needs its own GPU and the id travels through
//!   the rendezvous store.

use std::time::Duration;

use super::select::{self, device_communicator};
use super::vars::{host_id, host_key, EnvInfo, Launcher, JOB_ID_KEY};
use crate::comm::{CommError, Communicator};
use crate::hier::{self, MpiMode};
use crate::shm::{ShmComm, ShmConfig};
use crate::store::{Store, StoreServer, TcpStore};
use crate::types::ranges_text;

fn setup(msg: String) -> CommError {
    CommError::Setup(msg)
}

fn env_err(e: crate::types::env::EnvError) -> CommError {
    setup(e.to_string())
}

/// `0,1,2,5` as `0-2, 5`.
fn ranges(v: &[usize]) -> String {
    ranges_text(v, ", ")
}

/// The rendezvous timed out: name only the ranks (and their nodes) that never published their
/// host, so the message points at what is missing. `present` tells whether rank `r` arrived.
fn missing_peers(info: &EnvInfo, timeout: Duration, present: impl Fn(usize) -> bool) -> String {
    let missing: Vec<usize> = (0..info.world_size).filter(|r| !present(*r)).collect();
    let rs = if missing.len() == 1 { "" } else { "s" };
    if info.launcher != Launcher::Lockstep {
        // Other launchers may place ranks on nodes in any order: name the ranks only.
        return format!(
            "rank {}: rank{rs} {} did not reach the rendezvous within {:.1} s (LOCKSTEP_RDZV_TIMEOUT_S); did every rank of this {} job start, with the same MASTER_ADDR and store port on every node?",
            info.rank,
            ranges(&missing),
            timeout.as_secs_f64(),
            info.launcher.name()
        );
    }
    // `lockstep launch` numbers ranks node by node, LOCAL_WORLD_SIZE per node.
    let per_node = info.local_world_size.max(1);
    let mut nodes: Vec<usize> = missing.iter().map(|r| r / per_node).collect();
    nodes.dedup();
    let ns = if nodes.len() == 1 { "" } else { "s" };
    format!(
        "rank {}: rank{rs} {} (node{ns} {}) did not reach the rendezvous within {:.1} s (LOCKSTEP_RDZV_TIMEOUT_S, which `lockstep launch` sets from --rdzv-timeout-s); did the launcher of node{ns} {} start, with the same --nnodes, --nproc-per-node, --master-addr and --master-port?",
        info.rank,
        ranges(&missing),
        ranges(&nodes),
        timeout.as_secs_f64(),
        ranges(&nodes)
    )
}

impl Communicator {
    /// Join the job described by the launcher's environment variables (see the module docs of
    /// `rendezvous`). `LOCKSTEP_RDZV_TIMEOUT_S` (default 60) bounds each wait of the multi-node
    /// rendezvous. Every `LOCKSTEP_*` variable of [`crate::types::env::CHECKED`] is checked first:
    /// a malformed one is an error naming it.
    pub fn from_env() -> Result<Communicator, CommError> {
        crate::types::env::check_all().map_err(env_err)?;
        // Backend choice (`LOCKSTEP_BACKEND`, default shm).
        let backend = crate::types::env::BACKEND
            .choice()
            .map_err(env_err)?
            .unwrap_or("shm");
        let mpi = hier::mpi_mode().map_err(env_err)?;
        let cfg = ShmConfig::from_env()?;
        // Host buffers over MPI when asked: MPI itself tells the ranks and nodes.
        if backend == "shm" && mpi == MpiMode::On {
            return hier::join(cfg);
        }
        let info = EnvInfo::from_env()?;
        // MPICH's mpiexec on several hosts: no store is needed, MPI joins the nodes.
        if backend == "shm"
            && mpi == MpiMode::Auto
            && info.launcher == Launcher::Mpich
            && !info.single_node()
        {
            return hier::join(cfg);
        }
        tracing::debug!(
            rank = info.rank,
            world = info.world_size,
            nodes = info.nnodes,
            backend = %backend,
            "joining job {}: {}",
            info.job_id,
            if info.single_node() { "one node, shared memory" } else { "several nodes, rendezvous store" }
        );
        if info.single_node() {
            let c = if crate::types::env::REPLACEMENT.choice().map_err(env_err)? == Some("1") {
                // On NCCL too: the survivors grow the host communicator and make a new NCCL one
                // over it, which this rank joins through `device_communicator` below.
                let count = crate::types::env::RESTART_COUNT
                    .count()
                    .map_err(env_err)?
                    .unwrap_or(1);
                ShmComm::join_replacement(
                    &info.job_id,
                    info.local_rank,
                    info.local_world_size,
                    count,
                    cfg,
                )?
            } else {
                ShmComm::join_named(&info.job_id, info.local_rank, info.local_world_size, cfg)?
            };
            let host = Communicator::from_backend(Box::new(c));
            if backend == "nccl" {
                return device_communicator(host, info.local_rank).map(|(c, _)| c);
            }
            return Ok(host);
        }
        let timeout = crate::types::env::RDZV_TIMEOUT_S
            .secs()
            .map_err(env_err)?
            .unwrap_or(Duration::from_secs(60));
        let port = info.master_port.ok_or_else(|| {
            setup(format!(
                "MASTER_PORT is not set, but this {}-node job started by {} needs a port for lockstep's rendezvous store (set MASTER_PORT or LOCKSTEP_STORE_PORT, the same on every node)",
                info.nnodes,
                info.launcher.name()
            ))
        })?;
        let token = info.token.clone().ok_or_else(|| {
            setup(format!(
                "LOCKSTEP_TOKEN is not set, but a multi-node job needs it to talk to the rendezvous store: export the same secret of at least 16 bytes on every node (e.g. LOCKSTEP_TOKEN=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n')) before starting {}",
                info.launcher.name()
            ))
        })?;
        let st = |e: crate::store::StoreError| setup(format!("rank {}: {e}", info.rank));
        // No lockstep launcher hosts the store under torchrun, mpirun or srun: global rank 0 does,
        // until every rank has finished its rendezvous.
        let server = if info.hosts_store {
            let server = StoreServer::start(&info.master_addr, port, &token).map_err(st)?;
            server.set_local(JOB_ID_KEY, info.job_id.as_bytes());
            tracing::debug!(
                "rank 0 hosts the rendezvous store on {}:{port} for {}",
                info.master_addr,
                info.launcher.name()
            );
            Some(server)
        } else {
            None
        };
        let mut store = TcpStore::connect(&info.master_addr, port, &token, timeout).map_err(st)?;
        let joined = rendezvous_through_store(&info, &mut store, backend, mpi, cfg, timeout);
        // Tell the host we are done with the store (even on failure, so it does not wait for us).
        let _ = store.set(&format!("lockstep/joined/{}", info.rank), b"1");
        if let Some(server) = server {
            let keys: Vec<String> = (0..info.world_size)
                .map(|r| format!("lockstep/joined/{r}"))
                .collect();
            let refs: Vec<&str> = keys.iter().map(|s| s.as_str()).collect();
            let done = store.wait(&refs, timeout).map_err(st);
            drop(server);
            done?;
        }
        joined
    }
}

/// `LOCKSTEP_MPI`, checked: `"auto"` (also when unset), `"on"` or `"off"`. For joiners other
/// than [`Communicator::from_env`] (the torch backend) that choose between a node's shared
/// memory and [`join_mpi`] themselves.
pub fn mpi_mode() -> Result<&'static str, CommError> {
    Ok(match hier::mpi_mode().map_err(env_err)? {
        MpiMode::Auto => "auto",
        MpiMode::On => "on",
        MpiMode::Off => "off",
    })
}

/// Join the job MPI started this process in through the hierarchical backend (`hier`: shared
/// memory inside each node, MPI between nodes), whatever `LOCKSTEP_MPI` says: one communicator
/// over every rank of `MPI_COMM_WORLD`, ranked as there. Every rank of the job must call it at
/// the same time. `cfg` sets each node's shared memory (its timeout is the collectives').
pub fn join_mpi(cfg: ShmConfig) -> Result<Communicator, CommError> {
    hier::join(cfg)
}

/// The multi-node part of [`Communicator::from_env`], over a connected store.
fn rendezvous_through_store(
    info: &EnvInfo,
    store: &mut TcpStore,
    backend: &str,
    mpi: MpiMode,
    cfg: ShmConfig,
    timeout: Duration,
) -> Result<Communicator, CommError> {
    let st = |e: crate::store::StoreError| setup(format!("rank {}: {e}", info.rank));
    // Publish where this rank runs, then learn where every rank runs.
    let me = host_id().map_err(env_err)?;
    store.set(&host_key(info.rank), me.as_bytes()).map_err(st)?;
    let keys: Vec<String> = (0..info.world_size).map(host_key).collect();
    let refs: Vec<&str> = keys.iter().map(|s| s.as_str()).collect();
    match store.wait(&refs, timeout) {
        Err(crate::store::StoreError::Timeout { .. }) => {
            let arrived: Vec<bool> = keys
                .iter()
                .map(|k| store.get(k).ok().flatten().is_some())
                .collect();
            return Err(setup(missing_peers(info, timeout, |r| arrived[r])));
        }
        r => r.map_err(st)?,
    }
    let mut hosts = Vec::with_capacity(info.world_size);
    for k in &keys {
        hosts.push(
            String::from_utf8_lossy(&store.get(k).map_err(st)?.unwrap_or_default()).into_owned(),
        );
    }
    let spans_hosts = hosts.iter().any(|h| *h != me);
    if backend == "nccl" && spans_hosts {
        return select::nccl_across_nodes(info, store, &hosts, cfg, timeout);
    }
    if let Some(r) = hosts.iter().position(|h| *h != me) {
        // An MPI launcher started the ranks: MPI joins the hosts, shared memory each host's ranks.
        if mpi == MpiMode::Auto && matches!(info.launcher, Launcher::OpenMpi | Launcher::Slurm) {
            return hier::join(cfg);
        }
        let name = |h: &str| h.split('/').next().unwrap_or("?").to_string();
        return Err(setup(format!(
            "rank {} runs on host {} but rank {r} runs on host {}: a cross-host CPU communicator is not available under {} (the shared-memory backend needs every rank on one host); start a multi-host CPU job with MPI instead, e.g. `mpiexec -n 8 -ppn 4 -hosts a,b program` or srun, where lockstep joins the hosts through MPI (docs/mpi.md), run it on GPUs with the NCCL backend, or start all ranks on one host",
            info.rank,
            name(&me),
            name(&hosts[r]),
            if mpi == MpiMode::Off { "LOCKSTEP_MPI=off" } else { info.launcher.name() }
        )));
    }
    // Every rank shares this machine: one shared-memory communicator under the store host's job id.
    let job = store.wait_get(JOB_ID_KEY, timeout).map_err(st)?;
    let job = String::from_utf8(job)
        .map_err(|_| setup("the job id in the rendezvous store is not UTF-8".into()))?;
    let c = ShmComm::join_named(&job, info.rank, info.world_size, cfg)?;
    let host = Communicator::from_backend(Box::new(c));
    if backend == "nccl" {
        // One host: devices are numbered by global rank, as if one launcher had started all.
        return device_communicator(host, info.rank).map(|(c, _)| c);
    }
    Ok(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeout_names_only_missing_peers() {
        let info = EnvInfo {
            launcher: Launcher::Lockstep,
            rank: 1,
            local_rank: 1,
            world_size: 6,
            local_world_size: 2,
            nnodes: 3,
            job_id: "j".into(),
            master_addr: "127.0.0.1".into(),
            master_port: Some(1),
            hosts_store: false,
            token: None,
        };
        let m = missing_peers(&info, Duration::from_millis(1500), |r| r < 2 || r == 3);
        assert!(
            m.starts_with(
                "rank 1: ranks 2, 4-5 (nodes 1-2) did not reach the rendezvous within 1.5 s"
            ),
            "{m}"
        );
        let m = missing_peers(&info, Duration::from_secs(2), |r| r != 5);
        assert!(
            m.contains("rank 5 (node 2) did not") && m.contains("launcher of node 2 start"),
            "{m}"
        );
        assert_eq!(ranges(&[0, 1, 2, 5, 7, 8]), "0-2, 5, 7-8");
        let torchrun = EnvInfo {
            launcher: Launcher::Torchrun,
            ..info
        };
        let m = missing_peers(&torchrun, Duration::from_secs(2), |r| r != 4);
        assert!(
            m.starts_with("rank 1: rank 4 did not reach the rendezvous within 2.0 s")
                && m.contains("torchrun job"),
            "{m}"
        );
    }
}
