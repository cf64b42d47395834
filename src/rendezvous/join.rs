//! [`Communicator::from_env`]: join the job a launcher (`lockstep launch`, or anything that sets
//! the same variables) started this process in, and choose its backend.
//!
//! * One node (`LOCKSTEP_NNODES` = 1, or `WORLD_SIZE` = `LOCAL_WORLD_SIZE`): the local ranks
//!   join the named shared-memory segment of `LOCKSTEP_JOB_ID`; no port is used.
//! * Several nodes: every rank connects to the rendezvous store at `MASTER_ADDR:MASTER_PORT`
//!   with `LOCKSTEP_TOKEN` and publishes a host id. When all ranks turn out to share one host
//!   (for example two launchers on loopback), they form one shared-memory communicator under the
//!   node-0 launcher's job id, with global ranks. A CPU job that spans hosts is refused with an
//!   error: no cross-host CPU transport exists (the NCCL backend provides one for GPUs).
//! * `LOCKSTEP_BACKEND` picks the backend: `shm` (the default) or `nccl`. With `nccl` on one node
//!   the unique id travels through the node's shared-memory communicator (and ranks that share a
//!   GPU stage through it); across nodes every rank needs its own GPU and the id travels through
//!   the rendezvous store.

use std::time::Duration;

use super::select::{self, device_communicator};
use super::vars::{host_id, EnvInfo, JOB_ID_KEY};
use crate::comm::{CommError, Communicator};
use crate::shm::{ShmComm, ShmConfig};
use crate::store::{Store, TcpStore};

fn setup(msg: String) -> CommError {
    CommError::Setup(msg)
}

fn env_err(e: crate::types::env::EnvError) -> CommError {
    setup(e.to_string())
}

/// `0,1,2,5` as `0-2, 5`.
fn ranges(v: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        out.push(if j == i { v[i].to_string() } else { format!("{}-{}", v[i], v[j]) });
        i = j + 1;
    }
    out.join(", ")
}

/// The rendezvous timed out: name only the ranks (and their nodes) that never published their
/// host, so the message points at what is missing. `present` tells whether rank `r` arrived.
fn missing_peers(info: &EnvInfo, timeout: Duration, present: impl Fn(usize) -> bool) -> String {
    let missing: Vec<usize> = (0..info.world_size).filter(|r| !present(*r)).collect();
    // `lockstep launch` numbers ranks node by node, LOCAL_WORLD_SIZE per node.
    let per_node = info.local_world_size.max(1);
    let mut nodes: Vec<usize> = missing.iter().map(|r| r / per_node).collect();
    nodes.dedup();
    let (rs, ns) = (if missing.len() == 1 { "" } else { "s" }, if nodes.len() == 1 { "" } else { "s" });
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
        let info = EnvInfo::from_env()?;
        // Backend choice (`LOCKSTEP_BACKEND`, default shm).
        let backend = crate::types::env::choice("LOCKSTEP_BACKEND", crate::types::env::BACKENDS).map_err(env_err)?.unwrap_or("shm");
        let cfg = ShmConfig::from_env();
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
            let c = ShmComm::join_named(&info.job_id, info.local_rank, info.local_world_size, cfg)?;
            let host = Communicator::from_backend(Box::new(c));
            if backend == "nccl" {
                return device_communicator(host, info.local_rank).map(|(c, _)| c);
            }
            return Ok(host);
        }
        let timeout = crate::types::env::secs("LOCKSTEP_RDZV_TIMEOUT_S").map_err(env_err)?.unwrap_or(Duration::from_secs(60));
        let port = info
            .master_port
            .ok_or_else(|| setup("MASTER_PORT is not set, but a multi-node job needs the rendezvous store's port".into()))?;
        let token = info
            .token
            .clone()
            .ok_or_else(|| setup("LOCKSTEP_TOKEN is not set, but a multi-node job needs it to talk to the rendezvous store".into()))?;
        let st = |e: crate::store::StoreError| setup(format!("rank {}: {e}", info.rank));
        let mut store = TcpStore::connect(&info.master_addr, port, &token, timeout).map_err(st)?;
        // Publish where this rank runs, then learn where every rank runs.
        let me = host_id().map_err(env_err)?;
        store.set(&format!("lockstep/host/{}", info.rank), me.as_bytes()).map_err(st)?;
        let keys: Vec<String> = (0..info.world_size).map(|r| format!("lockstep/host/{r}")).collect();
        let refs: Vec<&str> = keys.iter().map(|s| s.as_str()).collect();
        match store.wait(&refs, timeout) {
            Err(crate::store::StoreError::Timeout { .. }) => {
                let arrived: Vec<bool> = keys.iter().map(|k| store.get(k).ok().flatten().is_some()).collect();
                return Err(setup(missing_peers(&info, timeout, |r| arrived[r])));
            }
            r => r.map_err(st)?,
        }
        let mut hosts = Vec::with_capacity(info.world_size);
        for k in &keys {
            hosts.push(String::from_utf8_lossy(&store.get(k).map_err(st)?.unwrap_or_default()).into_owned());
        }
        let spans_hosts = hosts.iter().any(|h| *h != me);
        if backend == "nccl" && spans_hosts {
            return select::nccl_across_nodes(&info, &mut store, &hosts, timeout);
        }
        if let Some(r) = hosts.iter().position(|h| *h != me) {
            let name = |h: &str| h.split('/').next().unwrap_or("?").to_string();
            return Err(setup(format!(
                "rank {} runs on host {} but rank {r} runs on host {}: a cross-host CPU communicator is not available (the shared-memory backend needs every rank on one host); run multi-host jobs on GPUs with the NCCL backend, or start all ranks on one host",
                info.rank,
                name(&me),
                name(&hosts[r])
            )));
        }
        // Every rank shares this host: one shared-memory communicator under the node-0 job id.
        let job = store.wait_get(JOB_ID_KEY, timeout).map_err(st)?;
        let job = String::from_utf8(job).map_err(|_| setup("the job id in the rendezvous store is not UTF-8".into()))?;
        let c = ShmComm::join_named(&job, info.rank, info.world_size, cfg)?;
        let host = Communicator::from_backend(Box::new(c));
        if backend == "nccl" {
            // One host: devices are numbered by global rank, as if one launcher had started all.
            return device_communicator(host, info.rank).map(|(c, _)| c);
        }
        Ok(host)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeout_names_only_missing_peers() {
        let info = EnvInfo {
            rank: 1,
            local_rank: 1,
            world_size: 6,
            local_world_size: 2,
            nnodes: 3,
            job_id: "j".into(),
            master_addr: "127.0.0.1".into(),
            master_port: Some(1),
            token: None,
        };
        let m = missing_peers(&info, Duration::from_millis(1500), |r| r < 2 || r == 3);
        assert!(m.starts_with("rank 1: ranks 2, 4-5 (nodes 1-2) did not reach the rendezvous within 1.5 s"), "{m}");
        let m = missing_peers(&info, Duration::from_secs(2), |r| r != 5);
        assert!(m.contains("rank 5 (node 2) did not") && m.contains("launcher of node 2 start"), "{m}");
        assert_eq!(ranges(&[0, 1, 2, 5, 7, 8]), "0-2, 5, 7-8");
    }
}
