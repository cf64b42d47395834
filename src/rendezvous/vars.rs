//! The variables a launcher sets for its ranks ([`EnvInfo`]), read strictly, and the identity of
//! this machine.

use crate::comm::CommError;

/// The store key under which the node-0 launcher publishes its job id (the name of the
/// shared-memory segment that same-host ranks of a multi-launcher job join).
pub const JOB_ID_KEY: &str = "lockstep/job_id";

/// Which launcher started this process, as told by the variables it sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Launcher {
    /// `lockstep launch` (`LOCKSTEP_JOB_ID`): the launcher hosts the store and names the segment.
    Lockstep,
    /// torchrun / torch.distributed's `env://` (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`).
    Torchrun,
    /// Open MPI's `mpirun` (`OMPI_COMM_WORLD_*`).
    OpenMpi,
    /// Slurm's `srun` (`SLURM_PROCID`, `SLURM_NTASKS`, ...).
    Slurm,
    /// MPICH's `mpiexec` (Hydra: `PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`, `MPI_LOCALNRANKS`).
    Mpich,
}

impl Launcher {
    /// Short name for messages and segment names.
    pub const fn name(self) -> &'static str {
        match self {
            Launcher::Lockstep => "lockstep",
            Launcher::Torchrun => "torchrun",
            Launcher::OpenMpi => "mpirun",
            Launcher::Slurm => "srun",
            Launcher::Mpich => "mpiexec",
        }
    }
}

/// The rendezvous variables a launcher sets, whichever launcher it was.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvInfo {
    /// Who started this process.
    pub launcher: Launcher,
    /// Global rank (`RANK`, `OMPI_COMM_WORLD_RANK`, `SLURM_PROCID`).
    pub rank: usize,
    /// Rank within this node.
    pub local_rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Ranks on this node.
    pub local_world_size: usize,
    /// Number of nodes (1 when every rank is on this node).
    pub nnodes: usize,
    /// The job's identity: the name same-host ranks derive their shared segment from
    /// (`LOCKSTEP_JOB_ID`, or one derived from the launcher's own job id).
    pub job_id: String,
    /// Where the rendezvous store of a multi-node job listens (`MASTER_ADDR`, default 127.0.0.1,
    /// or the first host of the Slurm node list).
    pub master_addr: String,
    /// Its port (only needed with several nodes).
    pub master_port: Option<u16>,
    /// Whether this rank hosts the store (global rank 0 of a job no lockstep launcher started;
    /// under `lockstep launch` the node-0 launcher hosts it).
    pub hosts_store: bool,
    /// `LOCKSTEP_TOKEN` (only needed with several nodes).
    pub token: Option<String>,
}

pub(crate) fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn setup(msg: String) -> CommError {
    CommError::Setup(msg)
}

/// Variable lookup: the process environment, or a fixed table in tests.
type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

fn num(get: Lookup, name: &str) -> Result<Option<usize>, CommError> {
    match get(name) {
        None => Ok(None),
        Some(v) => v
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| setup(format!("{name}={v:?} is not a non-negative integer"))),
    }
}

fn required(get: Lookup, name: &str, launcher: Launcher) -> Result<usize, CommError> {
    num(get, name)?.ok_or_else(|| {
        setup(format!("{name} is not set, but the environment looks like {}: is this process really one of its ranks?", launcher.name()))
    })
}

fn port(get: Lookup, name: &str) -> Result<Option<u16>, CommError> {
    match get(name) {
        None => Ok(None),
        Some(p) => match p.trim().parse::<u16>() {
            Ok(n) if n > 0 => Ok(Some(n)),
            _ => Err(setup(format!(
                "{name}={p:?} is not a port number (1-65535)"
            ))),
        },
    }
}

/// The launcher the variables name, in order of precedence (a lockstep job id wins; torchrun
/// inside an `srun` allocation sets `RANK` and is torchrun).
pub(crate) fn detect(get: Lookup) -> Option<Launcher> {
    if get("LOCKSTEP_JOB_ID").is_some() {
        Some(Launcher::Lockstep)
    } else if get("RANK").is_some() && get("WORLD_SIZE").is_some() {
        Some(Launcher::Torchrun)
    } else if get("OMPI_COMM_WORLD_RANK").is_some() {
        Some(Launcher::OpenMpi)
    } else if get("SLURM_PROCID").is_some() && get("SLURM_NTASKS").is_some() {
        Some(Launcher::Slurm)
    } else if get("PMI_RANK").is_some() && get("PMI_SIZE").is_some() {
        Some(Launcher::Mpich)
    } else {
        None
    }
}

/// Whether some launcher started this process (so `from_env` has a job to join).
pub fn launched() -> bool {
    detect(&var).is_some()
}

/// The first host of a Slurm node list: `node[01-04,07],gpu5` → `node01`.
pub(crate) fn first_slurm_host(list: &str) -> Option<String> {
    let list = list.trim();
    let end = list.find([',', '[']).unwrap_or(list.len());
    let prefix = &list[..end];
    if list[end..].starts_with('[') {
        let inner = &list[end + 1..list[end..].find(']').map(|k| end + k)?];
        let first = inner.split([',', '-']).next()?;
        return Some(format!("{prefix}{first}"));
    }
    (!prefix.is_empty()).then(|| prefix.to_string())
}

/// Tasks on node `node` from Slurm's compressed per-node counts (`2(x3),1` → 2, 2, 2, 1).
pub(crate) fn slurm_tasks_on_node(spec: &str, node: usize) -> Option<usize> {
    let mut at = 0;
    for part in spec.split(',') {
        let (n, reps) = match part.split_once("(x") {
            Some((n, r)) => (
                n.trim().parse::<usize>().ok()?,
                r.trim_end_matches(')').parse::<usize>().ok()?,
            ),
            None => (part.trim().parse::<usize>().ok()?, 1),
        };
        if node < at + reps {
            return Some(n);
        }
        at += reps;
    }
    None
}

impl EnvInfo {
    /// Read and check the variables of whichever launcher started this process.
    pub fn from_env() -> Result<EnvInfo, CommError> {
        // The lookup treats a value that is not UTF-8 as unset: lockstep's own variables must not
        // vanish silently.
        for name in [
            "LOCKSTEP_TOKEN",
            "LOCKSTEP_JOB_ID",
            "LOCKSTEP_NNODES",
            "LOCKSTEP_STORE_PORT",
        ] {
            crate::types::env::raw(name).map_err(|e| setup(e.to_string()))?;
        }
        EnvInfo::from_lookup(&var)
    }

    /// Read and check the variables through `get` (empty values count as unset).
    pub(crate) fn from_lookup(get: Lookup) -> Result<EnvInfo, CommError> {
        let Some(launcher) = detect(get) else {
            return Err(setup(
                "no launcher variables found (RANK/WORLD_SIZE, OMPI_COMM_WORLD_*, SLURM_PROCID, PMI_RANK or LOCKSTEP_JOB_ID): start this program with `lockstep launch --nproc-per-node N -- program ...`, torchrun, mpirun, mpiexec or srun".into(),
            ));
        };
        let token = get("LOCKSTEP_TOKEN");
        let mut master_addr = get("MASTER_ADDR");
        let mut master_port = port(get, "MASTER_PORT")?;
        // A store port of our own when the launcher's MASTER_PORT is taken by its own store.
        let store_port = port(get, "LOCKSTEP_STORE_PORT")?;
        let (rank, world_size, local_rank, local_world_size, nnodes, job_id, hosts_store);
        match launcher {
            Launcher::Lockstep => {
                rank = required(get, "RANK", launcher)?;
                world_size = required(get, "WORLD_SIZE", launcher)?;
                local_rank = num(get, "LOCAL_RANK")?.unwrap_or(rank);
                local_world_size = num(get, "LOCAL_WORLD_SIZE")?.unwrap_or(world_size);
                // No silent clamp of 0 nodes to 1.
                nnodes = match get("LOCKSTEP_NNODES") {
                    None => 1,
                    Some(v) => crate::types::env::NNODES
                        .parse_count(&v)
                        .map_err(|e| setup(e.to_string()))? as usize,
                };
                job_id = get("LOCKSTEP_JOB_ID").unwrap_or_default();
                // A multi-node launch gives its ranks the launchers' store here, and MASTER_PORT
                // free for a store of rank 0's own (torch's env://).
                master_port = store_port.or(master_port);
                hosts_store = false;
            }
            Launcher::Torchrun => {
                rank = required(get, "RANK", launcher)?;
                world_size = required(get, "WORLD_SIZE", launcher)?;
                local_rank = num(get, "LOCAL_RANK")?.unwrap_or(rank);
                local_world_size = num(get, "LOCAL_WORLD_SIZE")?.unwrap_or(world_size);
                nnodes = num(get, "GROUP_WORLD_SIZE")?
                    .unwrap_or_else(|| world_size.div_ceil(local_world_size.max(1)))
                    .max(1);
                // torchrun's own store listens on MASTER_PORT; ours takes the next port.
                let base = master_port.ok_or_else(|| {
                    setup("MASTER_PORT is not set: torchrun and torch's env:// set it; set it to the port rank 0 can listen on".into())
                })?;
                let run = get("TORCHELASTIC_RUN_ID").unwrap_or_else(|| "env".into());
                let addr = master_addr.clone().unwrap_or_else(|| "127.0.0.1".into());
                job_id = format!("torchrun-{run}-{addr}-{base}");
                master_port = Some(store_port.unwrap_or(base.checked_add(1).ok_or_else(|| {
                    setup(format!("MASTER_PORT={base} leaves no next port for lockstep's store; set LOCKSTEP_STORE_PORT"))
                })?));
                hosts_store = rank == 0;
            }
            Launcher::OpenMpi => {
                rank = required(get, "OMPI_COMM_WORLD_RANK", launcher)?;
                world_size = required(get, "OMPI_COMM_WORLD_SIZE", launcher)?;
                local_rank = required(get, "OMPI_COMM_WORLD_LOCAL_RANK", launcher)?;
                local_world_size = required(get, "OMPI_COMM_WORLD_LOCAL_SIZE", launcher)?;
                nnodes = if local_world_size == world_size {
                    1
                } else {
                    world_size.div_ceil(local_world_size.max(1)).max(2)
                };
                let id = get("OMPI_MCA_ess_base_jobid")
                    .or_else(|| get("PMIX_NAMESPACE"))
                    .ok_or_else(|| setup("mpirun set OMPI_COMM_WORLD_RANK but neither OMPI_MCA_ess_base_jobid nor PMIX_NAMESPACE: cannot tell this job from another".into()))?;
                job_id = format!("mpirun-{id}");
                master_port = store_port.or(master_port);
                hosts_store = rank == 0;
            }
            Launcher::Mpich => {
                rank = required(get, "PMI_RANK", launcher)?;
                world_size = required(get, "PMI_SIZE", launcher)?;
                local_rank = required(get, "MPI_LOCALRANKID", launcher)?;
                local_world_size = required(get, "MPI_LOCALNRANKS", launcher)?;
                nnodes = if local_world_size == world_size {
                    1
                } else {
                    world_size.div_ceil(local_world_size.max(1)).max(2)
                };
                // Hydra starts the ranks of a node from one proxy process: its pid tells this
                // job's ranks on this node from another job's.
                job_id = format!("mpiexec-{}", std::os::unix::process::parent_id());
                master_port = store_port.or(master_port);
                hosts_store = rank == 0;
            }
            Launcher::Slurm => {
                rank = required(get, "SLURM_PROCID", launcher)?;
                world_size = required(get, "SLURM_NTASKS", launcher)?;
                local_rank = required(get, "SLURM_LOCALID", launcher)?;
                let nodes = num(get, "SLURM_STEP_NUM_NODES")?
                    .or(num(get, "SLURM_NNODES")?)
                    .unwrap_or(1)
                    .max(1);
                let node = num(get, "SLURM_NODEID")?.unwrap_or(0);
                local_world_size = match get("SLURM_STEP_TASKS_PER_NODE").or_else(|| get("SLURM_TASKS_PER_NODE")) {
                    Some(spec) => slurm_tasks_on_node(&spec, node)
                        .ok_or_else(|| setup(format!("SLURM_STEP_TASKS_PER_NODE={spec:?} names no count for node {node}")))?,
                    None if nodes == 1 => world_size,
                    None => {
                        return Err(setup("srun did not set SLURM_STEP_TASKS_PER_NODE: cannot tell how many ranks share this node".into()))
                    }
                };
                nnodes = nodes;
                let job = required(get, "SLURM_JOB_ID", launcher)?;
                let step = get("SLURM_STEP_ID").unwrap_or_else(|| "0".into());
                job_id = format!("srun-{job}-{step}");
                if master_addr.is_none() {
                    master_addr = get("SLURM_STEP_NODELIST")
                        .or_else(|| get("SLURM_JOB_NODELIST"))
                        .and_then(|l| first_slurm_host(&l));
                }
                // A port derived from the job id, so every node computes the same one without
                // talking to the others; MASTER_PORT or LOCKSTEP_STORE_PORT override it.
                master_port = store_port
                    .or(master_port)
                    .or(Some(20000 + (job % 20000) as u16));
                hosts_store = rank == 0;
            }
        }
        if world_size == 0
            || rank >= world_size
            || local_rank >= local_world_size
            || local_world_size > world_size
        {
            return Err(setup(format!(
                "inconsistent rank variables from {}: rank {rank}, world size {world_size}, local rank {local_rank}, local world size {local_world_size}",
                launcher.name()
            )));
        }
        Ok(EnvInfo {
            launcher,
            rank,
            local_rank,
            world_size,
            local_world_size,
            nnodes,
            job_id,
            master_addr: master_addr.unwrap_or_else(|| "127.0.0.1".into()),
            master_port,
            hosts_store,
            token,
        })
    }

    /// Whether every rank is on this node, so no rendezvous is needed.
    pub fn single_node(&self) -> bool {
        self.nnodes == 1 || self.world_size == self.local_world_size
    }
}

/// The ranks of a multi-node job that share one host, and the tag of their node's segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NodeOf {
    /// `<job id>.h<k>` for the `k`-th host in order of its first rank, or the job id itself when
    /// every rank runs on one host (then one segment holds the whole job).
    pub tag: String,
    /// The global ranks on that host, ascending: the node segment's rank `i` is `members[i]`.
    pub members: Vec<usize>,
}

/// Which ranks of `hosts` (each global rank's host id, from the store) share `host`, and their
/// node segment's tag: what NCCL ranks across nodes show their calls in, and what the launcher
/// of that node reads to answer `lockstep status` through the store. `None` when no rank runs
/// on `host`.
pub(crate) fn node_of(job: &str, hosts: &[String], host: &str) -> Option<NodeOf> {
    let mut distinct: Vec<&str> = Vec::new();
    for h in hosts {
        if !distinct.contains(&h.as_str()) {
            distinct.push(h);
        }
    }
    let k = distinct.iter().position(|h| *h == host)?;
    let members = (0..hosts.len()).filter(|&r| hosts[r] == host).collect();
    let tag = if distinct.len() == 1 {
        job.to_string()
    } else {
        format!("{job}.h{k}")
    };
    Some(NodeOf { tag, members })
}

/// The store key where rank `rank` of a multi-node job publishes its host id.
pub(crate) fn host_key(rank: usize) -> String {
    format!("lockstep/host/{rank}")
}

/// An id of this machine: `LOCKSTEP_HOST_ID` if set (for containers that share a kernel but not
/// memory, and for tests; text without control characters), else its name plus the kernel's boot
/// id.
pub fn host_id() -> Result<String, crate::types::env::EnvError> {
    if let Some(h) = crate::types::env::HOST_ID.text()? {
        return Ok(h);
    }
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    };
    Ok(format!(
        "{}/{}",
        read("/proc/sys/kernel/hostname"),
        read("/proc/sys/kernel/random/boot_id")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_of_hosts() {
        let hosts: Vec<String> = ["a", "b", "a", "c"].iter().map(|s| s.to_string()).collect();
        let n = node_of("j", &hosts, "a").unwrap();
        assert_eq!((n.tag.as_str(), n.members), ("j.h0", vec![0, 2]));
        let n = node_of("j", &hosts, "c").unwrap();
        assert_eq!((n.tag.as_str(), n.members), ("j.h2", vec![3]));
        assert_eq!(node_of("j", &hosts, "d"), None);
        let one: Vec<String> = vec!["a".into(); 3];
        let n = node_of("j", &one, "a").unwrap();
        assert_eq!((n.tag.as_str(), n.members), ("j", vec![0, 1, 2]));
    }

    fn info(vars: &[(&str, &str)]) -> Result<EnvInfo, CommError> {
        let table: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        EnvInfo::from_lookup(&move |k: &str| {
            table
                .iter()
                .find(|(n, v)| n == k && !v.is_empty())
                .map(|(_, v)| v.clone())
        })
    }

    #[test]
    fn lockstep_single_node_needs_no_port() {
        let i = info(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCKSTEP_JOB_ID", "j")]).unwrap();
        assert_eq!(i.launcher, Launcher::Lockstep);
        assert_eq!(
            (
                i.rank,
                i.local_rank,
                i.world_size,
                i.local_world_size,
                i.master_port
            ),
            (1, 1, 2, 2, None)
        );
        assert!(i.single_node() && !i.hosts_store);
    }

    #[test]
    fn lockstep_multi_node_and_errors() {
        let base = [
            ("RANK", "3"),
            ("LOCAL_RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("LOCKSTEP_NNODES", "2"),
        ];
        let mut v = base.to_vec();
        v.extend([("LOCKSTEP_JOB_ID", "j"), ("MASTER_PORT", "29500")]);
        let i = info(&v).unwrap();
        assert!(!i.single_node());
        assert_eq!(i.master_port, Some(29500));
        let e = info(&[("WORLD_SIZE", "2"), ("LOCKSTEP_JOB_ID", "j")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("RANK is not set, but the environment looks like lockstep"),
            "{e}"
        );
        let e = info(&[("RANK", "2"), ("WORLD_SIZE", "2"), ("LOCKSTEP_JOB_ID", "j")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("inconsistent rank variables"), "{e}");
        let e = info(&[("RANK", "x"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("RANK=\"x\" is not a non-negative integer"),
            "{e}"
        );
        let e = info(&[("MASTER_PORT", "1")]).unwrap_err().to_string();
        assert!(
            e.contains("no launcher variables found")
                && e.contains("torchrun, mpirun, mpiexec or srun"),
            "{e}"
        );
        // No silent clamp of 0 nodes to 1.
        let e = info(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCKSTEP_JOB_ID", "j"),
            ("LOCKSTEP_NNODES", "0"),
        ])
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("LOCKSTEP_NNODES=\"0\" is invalid: expected a whole number from 1"),
            "{e}"
        );
    }

    #[test]
    fn torchrun() {
        let v = [
            ("RANK", "3"),
            ("LOCAL_RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_RUN_ID", "abc"),
        ];
        let i = info(&v).unwrap();
        assert_eq!(i.launcher, Launcher::Torchrun);
        assert_eq!(
            (i.rank, i.local_rank, i.nnodes, i.master_port, i.hosts_store),
            (3, 1, 2, Some(29501), false)
        );
        assert_eq!(
            (i.job_id.as_str(), i.master_addr.as_str()),
            ("torchrun-abc-10.0.0.1-29500", "10.0.0.1")
        );
        let e = info(&[("RANK", "0"), ("WORLD_SIZE", "2")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("MASTER_PORT is not set"), "{e}");
        let i = info(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_PORT", "29500"),
            ("LOCKSTEP_STORE_PORT", "4000"),
        ])
        .unwrap();
        assert_eq!(
            (i.master_port, i.hosts_store, i.single_node()),
            (Some(4000), true, true)
        );
    }

    #[test]
    fn open_mpi() {
        let v = [
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("OMPI_MCA_ess_base_jobid", "737083393"),
        ];
        let i = info(&v).unwrap();
        assert_eq!(i.launcher, Launcher::OpenMpi);
        assert_eq!(
            (
                i.rank,
                i.local_rank,
                i.world_size,
                i.nnodes,
                i.job_id.as_str()
            ),
            (1, 1, 2, 1, "mpirun-737083393")
        );
        let e = info(&v[..4]).unwrap_err().to_string();
        assert!(
            e.contains("neither OMPI_MCA_ess_base_jobid nor PMIX_NAMESPACE"),
            "{e}"
        );
    }

    #[test]
    fn mpich_hydra() {
        let v = [
            ("PMI_RANK", "3"),
            ("PMI_SIZE", "4"),
            ("MPI_LOCALRANKID", "1"),
            ("MPI_LOCALNRANKS", "2"),
        ];
        let i = info(&v).unwrap();
        assert_eq!(i.launcher, Launcher::Mpich);
        assert_eq!(
            (
                i.rank,
                i.local_rank,
                i.world_size,
                i.nnodes,
                i.single_node()
            ),
            (3, 1, 4, 2, false)
        );
        assert!(i.job_id.starts_with("mpiexec-"), "{}", i.job_id);
        let one = info(&[
            ("PMI_RANK", "0"),
            ("PMI_SIZE", "2"),
            ("MPI_LOCALRANKID", "0"),
            ("MPI_LOCALNRANKS", "2"),
        ])
        .unwrap();
        assert!(one.single_node());
        let e = info(&v[..2]).unwrap_err().to_string();
        assert!(e.contains("MPI_LOCALRANKID is not set"), "{e}");
    }

    #[test]
    fn slurm() {
        let v = [
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "7"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "2"),
            ("SLURM_STEP_NUM_NODES", "4"),
            ("SLURM_STEP_TASKS_PER_NODE", "2(x3),1"),
            ("SLURM_JOB_ID", "12345"),
            ("SLURM_STEP_ID", "3"),
            ("SLURM_STEP_NODELIST", "gpu[07-10]"),
        ];
        let i = info(&v).unwrap();
        assert_eq!(i.launcher, Launcher::Slurm);
        assert_eq!(
            (
                i.rank,
                i.local_rank,
                i.world_size,
                i.local_world_size,
                i.nnodes
            ),
            (5, 1, 7, 2, 4)
        );
        assert_eq!(
            (i.job_id.as_str(), i.master_addr.as_str(), i.master_port),
            ("srun-12345-3", "gpu07", Some(20000 + 12345))
        );
        assert_eq!(
            first_slurm_host("node[01-04,07],gpu5").as_deref(),
            Some("node01")
        );
        assert_eq!(first_slurm_host("login3,node2").as_deref(), Some("login3"));
        assert_eq!(slurm_tasks_on_node("2(x3),1", 3), Some(1));
        assert_eq!(slurm_tasks_on_node("2(x3),1", 4), None);
    }
}
