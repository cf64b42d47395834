//! The variables a launcher sets for its ranks ([`EnvInfo`]), read strictly, and the identity of
//! this host.

use crate::comm::CommError;

/// The store key under which the node-0 launcher publishes its job id (the name of the
/// shared-memory segment that same-host ranks of a multi-launcher job join).
pub const JOB_ID_KEY: &str = "lockstep/job_id";

/// The rendezvous variables a launcher sets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvInfo {
    /// `RANK`.
    pub rank: usize,
    /// `LOCAL_RANK`.
    pub local_rank: usize,
    /// `WORLD_SIZE`.
    pub world_size: usize,
    /// `LOCAL_WORLD_SIZE` (defaults to `WORLD_SIZE`).
    pub local_world_size: usize,
    /// `LOCKSTEP_NNODES` (default 1).
    pub nnodes: usize,
    /// `LOCKSTEP_JOB_ID`.
    pub job_id: String,
    /// `MASTER_ADDR` (default 127.0.0.1).
    pub master_addr: String,
    /// `MASTER_PORT` (only needed with several nodes).
    pub master_port: Option<u16>,
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
        Some(v) => v.trim().parse().map(Some).map_err(|_| setup(format!("{name}={v:?} is not a non-negative integer"))),
    }
}

fn required(get: Lookup, name: &str) -> Result<usize, CommError> {
    num(get, name)?.ok_or_else(|| setup(format!("{name} is not set: start this program with `lockstep launch --nproc-per-node N -- program ...` (or set RANK, WORLD_SIZE and LOCKSTEP_JOB_ID yourself)")))
}

impl EnvInfo {
    /// Read and check the variables.
    pub fn from_env() -> Result<EnvInfo, CommError> {
        EnvInfo::from_lookup(&var)
    }

    /// Read and check the variables through `get` (empty values count as unset).
    fn from_lookup(get: Lookup) -> Result<EnvInfo, CommError> {
        let rank = required(get, "RANK")?;
        let world_size = required(get, "WORLD_SIZE")?;
        let local_rank = num(get, "LOCAL_RANK")?.unwrap_or(rank);
        let local_world_size = num(get, "LOCAL_WORLD_SIZE")?.unwrap_or(world_size);
        let nnodes = match get("LOCKSTEP_NNODES") {
            None => 1,
            Some(v) => crate::types::env::parse_count("LOCKSTEP_NNODES", &v, 1, 1 << 20).map_err(|e| setup(e.to_string()))? as usize,
        };
        let job_id = get("LOCKSTEP_JOB_ID")
            .ok_or_else(|| setup("LOCKSTEP_JOB_ID is not set: start this program with `lockstep launch`, which names the job".into()))?;
        if rank >= world_size || local_rank >= local_world_size || local_world_size > world_size {
            return Err(setup(format!(
                "inconsistent rank variables: RANK={rank} WORLD_SIZE={world_size} LOCAL_RANK={local_rank} LOCAL_WORLD_SIZE={local_world_size}"
            )));
        }
        let master_port = match get("MASTER_PORT") {
            None => None,
            Some(p) => Some(p.trim().parse::<u16>().map_err(|_| setup(format!("MASTER_PORT={p:?} is not a port number")))?),
        };
        Ok(EnvInfo {
            rank,
            local_rank,
            world_size,
            local_world_size,
            nnodes,
            job_id,
            master_addr: get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into()),
            master_port,
            token: get("LOCKSTEP_TOKEN"),
        })
    }

    /// Whether every rank is on this node, so no rendezvous is needed.
    pub fn single_node(&self) -> bool {
        self.nnodes == 1 || self.world_size == self.local_world_size
    }
}

/// An id of this host: `LOCKSTEP_HOST_ID` if set (for containers that share a kernel but not
/// memory, and for tests; text without control characters), else its name plus the kernel's boot
/// id.
pub fn host_id() -> Result<String, crate::types::env::EnvError> {
    if let Some(h) = crate::types::env::text("LOCKSTEP_HOST_ID")? {
        return Ok(h);
    }
    let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_string()).unwrap_or_default();
    Ok(format!("{}/{}", read("/proc/sys/kernel/hostname"), read("/proc/sys/kernel/random/boot_id")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(vars: &[(&str, &str)]) -> Result<EnvInfo, CommError> {
        let table: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        EnvInfo::from_lookup(&move |k: &str| table.iter().find(|(n, v)| n == k && !v.is_empty()).map(|(_, v)| v.clone()))
    }

    #[test]
    fn single_node_needs_no_port() {
        let i = info(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCKSTEP_JOB_ID", "j")]).unwrap();
        assert_eq!((i.rank, i.local_rank, i.world_size, i.local_world_size, i.master_port), (1, 1, 2, 2, None));
        assert!(i.single_node());
    }

    #[test]
    fn multi_node_and_errors() {
        let base = [("RANK", "3"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "4"), ("LOCAL_WORLD_SIZE", "2"), ("LOCKSTEP_NNODES", "2")];
        let mut v = base.to_vec();
        v.extend([("LOCKSTEP_JOB_ID", "j"), ("MASTER_PORT", "29500")]);
        let i = info(&v).unwrap();
        assert!(!i.single_node());
        assert_eq!(i.master_port, Some(29500));
        let e = info(&[("WORLD_SIZE", "2"), ("LOCKSTEP_JOB_ID", "j")]).unwrap_err().to_string();
        assert!(e.contains("RANK is not set: start this program with `lockstep launch"), "{e}");
        let e = info(&[("RANK", "2"), ("WORLD_SIZE", "2"), ("LOCKSTEP_JOB_ID", "j")]).unwrap_err().to_string();
        assert!(e.contains("inconsistent rank variables"), "{e}");
        let e = info(&[("RANK", "x"), ("WORLD_SIZE", "2")]).unwrap_err().to_string();
        assert!(e.contains("RANK=\"x\" is not a non-negative integer"), "{e}");
        let e = info(&[("RANK", "0"), ("WORLD_SIZE", "2")]).unwrap_err().to_string();
        assert!(e.contains("LOCKSTEP_JOB_ID is not set"), "{e}");
        // No silent clamp of 0 nodes to 1.
        let e = info(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCKSTEP_JOB_ID", "j"), ("LOCKSTEP_NNODES", "0")]).unwrap_err().to_string();
        assert!(e.contains("LOCKSTEP_NNODES=\"0\" is invalid: expected a whole number from 1"), "{e}");
    }
}
