//! `lockstepUniqueId`: what lockstepGetUniqueId makes and lockstepCommInitRank joins.
//!
//! Layout of the 128 bytes (version 1):
//!
//! | bytes | content |
//! |---|---|
//! | 0..8 | `lockstep` (magic) |
//! | 8..12 | layout version, little-endian `u32` |
//! | 16..48 | job id: 16 random bytes as 32 lowercase hex digits |
//! | 48..56 | FNV-1a hash of this machine's identity (`rendezvous::host_id`), little-endian |
//! | the rest | zero |
//!
//! The ranks meet in the shared-memory segment named after `capi-<job id>` (`ShmComm::join_named`):
//! rank 0 creates it, the others wait for it, and the last to arrive removes its name.

use std::ffi::{c_char, c_int};
use std::io::Read;
use std::time::Duration;

use super::handle::Failure;
use super::types::{lockstepUniqueId, LOCKSTEP_UNIQUE_ID_BYTES};
use runtime::comm::Communicator;
use runtime::shm::{ShmComm, ShmConfig};

const MAGIC: &[u8; 8] = b"lockstep";
const LAYOUT: u32 = 1;
const JOB: std::ops::Range<usize> = 16..48;
const HOST: std::ops::Range<usize> = 48..56;

/// FNV-1a of this machine's identity (host name and boot id, or LOCKSTEP_HOST_ID).
fn host_hash() -> Result<u64, Failure> {
    let id = runtime::rendezvous::host_id().map_err(|e| Failure::system(e.to_string()))?;
    Ok(id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    }))
}

/// A fresh id: a random job id made on this machine.
pub(crate) fn make() -> Result<lockstepUniqueId, Failure> {
    let mut random = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut random))
        .map_err(|e| {
            Failure::system(format!(
                "reading 16 random bytes from /dev/urandom for the job id failed: {e}"
            ))
        })?;
    let mut b = [0u8; LOCKSTEP_UNIQUE_ID_BYTES];
    b[..8].copy_from_slice(MAGIC);
    b[8..12].copy_from_slice(&LAYOUT.to_le_bytes());
    let hex: String = random.iter().map(|x| format!("{x:02x}")).collect();
    b[JOB].copy_from_slice(hex.as_bytes());
    b[HOST].copy_from_slice(&host_hash()?.to_le_bytes());
    Ok(lockstepUniqueId {
        internal: b.map(|x| x as c_char),
    })
}

/// Join the job of `id` as `rank` of `nranks`; `timeout` replaces the configured collective
/// timeout (LOCKSTEP_TIMEOUT_S) when given.
pub(crate) fn init_rank(
    id: &lockstepUniqueId,
    nranks: c_int,
    rank: c_int,
    timeout: Option<Duration>,
) -> Result<Communicator, Failure> {
    let world = usize::try_from(nranks)
        .ok()
        .filter(|&n| n >= 1)
        .ok_or_else(|| {
            Failure::invalid_argument(format!(
                "nranks is {nranks}; a communicator needs at least 1 rank"
            ))
        })?;
    let me = usize::try_from(rank)
        .ok()
        .filter(|&r| r < world)
        .ok_or_else(|| {
            Failure::invalid_argument(format!(
                "rank {rank} is out of range for nranks {nranks} (0..{nranks})"
            ))
        })?;
    let b: Vec<u8> = id.internal.iter().map(|&x| x as u8).collect();
    let job = &b[JOB];
    if &b[..8] != MAGIC
        || b[8..12] != LAYOUT.to_le_bytes()
        || !job
            .iter()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
    {
        return Err(Failure::invalid_argument(
            "commId is not an id made by lockstepGetUniqueId (of this lockstep version): pass every rank the id one rank got, unchanged",
        ));
    }
    if b[HOST] != host_hash()?.to_le_bytes() {
        return Err(Failure::invalid_usage(
            "commId was made on another host: ranks joined through a lockstepUniqueId meet in shared memory, so they must all run on the host that called lockstepGetUniqueId (jobs across hosts: lockstepCommInitFromEnv under a launcher, with LOCKSTEP_BACKEND=nccl)",
        ));
    }
    let job = format!("capi-{}", String::from_utf8_lossy(job));
    let mut cfg = ShmConfig::from_env().map_err(Failure::from)?;
    if let Some(t) = timeout {
        cfg.timeout = t;
    }
    let c = ShmComm::join_named(&job, me, world, cfg).map_err(Failure::from)?;
    Ok(Communicator::from_backend(Box::new(c)))
}
