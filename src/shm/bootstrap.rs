//! Job setup: creating a segment and initialising its header, joining it as a rank (forked ranks
//! through [`ShmJob`], separately exec'd ranks through [`ShmComm::join_named`] and a job id),
//! removing the segment's name once everyone has mapped it, and leaving.

use std::sync::atomic::Ordering::{Acquire, Relaxed, Release, SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::alloc::Heap;
use super::backend::ShmComm;
use super::channel::Channel;
use super::config::ShmConfig;
use super::segment::{available_cpus, futex_wake_all, shm_name, unlink_named, Segment};
use super::sync::{Header, Layout, HEADER_BYTES, MAGIC, STATE_JOINED, STATE_LEFT, VERSION};
use crate::comm::{CommError, Communicator};

/// A shared segment prepared for `world` ranks, created by the parent before it forks.
#[derive(Debug, Clone)]
pub struct ShmJob {
    seg: Arc<Segment>,
    layout: Layout,
    cfg: ShmConfig,
}

fn init_header(seg: &Segment, layout: &Layout, cfg: &ShmConfig) {
    // SAFETY: the segment starts with a Header-sized, 64-byte aligned (page-aligned mapping) region
    // that nobody else reads before `magic` is set.
    let h = unsafe { &*(seg.base() as *const Header) };
    h.version.store(VERSION, Relaxed);
    h.world.store(layout.world as u32, Relaxed);
    h.slot_bytes.store(layout.slot_bytes as u64, Relaxed);
    h.heap_bytes.store(layout.heap_bytes as u64, Relaxed);
    h.total_bytes.store(layout.total as u64, Relaxed);
    h.small_bytes.store(cfg.small_bytes.min(layout.slot_bytes) as u64, Relaxed);
    h.nt_bytes.store(cfg.nt_bytes as u64, Relaxed);
    h.magic.store(MAGIC, Release);
}

impl ShmJob {
    /// Create an anonymous segment for `world` ranks with settings from the environment.
    pub fn new(world: usize) -> Result<ShmJob, CommError> {
        ShmJob::with_config(world, ShmConfig::from_env())
    }

    /// Create an anonymous segment for `world` ranks.
    pub fn with_config(world: usize, cfg: ShmConfig) -> Result<ShmJob, CommError> {
        if world == 0 || world > 1024 {
            return Err(CommError::Setup(format!("world size {world} is out of range 1..=1024")));
        }
        let cfg = cfg.normalized_for(world);
        let layout = Layout::new(world, cfg.slot_bytes, cfg.heap_bytes)?;
        let seg = Segment::anonymous(layout.total)?;
        init_header(&seg, &layout, &cfg);
        Ok(ShmJob { seg: Arc::new(seg), layout, cfg })
    }

    /// Number of ranks the segment was made for.
    pub fn world_size(&self) -> usize {
        self.layout.world
    }

    /// Join as `rank` (called in each forked child).
    pub fn join(&self, rank: usize) -> Result<ShmComm, CommError> {
        join(self.seg.clone(), self.layout, self.cfg.clone(), rank, None)
    }

    /// Join as `rank` and wrap the result in a [`Communicator`].
    pub fn communicator(&self, rank: usize) -> Result<Communicator, CommError> {
        Ok(Communicator::from_backend(Box::new(self.join(rank)?)))
    }
}

/// Join a segment whose header is initialised as `rank`: claim the rank's control block, wait for
/// every rank to arrive, then watch the peers' processes. With `job_id`, the last rank to arrive
/// removes the segment's name.
fn join(seg: Arc<Segment>, layout: Layout, cfg: ShmConfig, rank: usize, job_id: Option<&str>) -> Result<ShmComm, CommError> {
    let world = layout.world;
    if rank >= world {
        return Err(CommError::Setup(format!("rank {rank} is out of range for world size {world}")));
    }
    let heap = Arc::new(Mutex::new(Heap::new(layout.heap_off(rank), layout.heap_bytes)));
    let spin = cfg.spin.unwrap_or(if world > available_cpus() { Duration::from_micros(2) } else { Duration::from_micros(20) });
    if cfg.bind_cpu {
        bind_to_cpu(rank, world);
    }
    let join_timeout = cfg.join_timeout;
    // From here on, an early return drops `c`, which marks this rank's control block as left
    // (see the Drop below), as the communicator would.
    let mut c = Channel::new(seg, layout, cfg, rank, spin);
    let me = c.ctrl(rank);
    if me.state.compare_exchange(0, STATE_JOINED, SeqCst, SeqCst).is_err() {
        return Err(CommError::Setup(format!("rank {rank} has already joined this communicator (pid {})", me.pid.load(Relaxed))));
    }
    // Touch our own slots now so collectives never page-fault on them.
    c.seg().prefault(layout.slot_off(rank, 0), 2 * layout.slot_bytes);
    me.progress.store(0, Relaxed);
    me.pid.store(std::process::id() as i32, Relaxed);
    let joined = c.header().joined.fetch_add(1, SeqCst) + 1;
    if joined as usize == world {
        if let Some(id) = job_id {
            // Everyone has mapped the named segment: remove its name so nothing can leak.
            unlink_named(id);
        }
    }
    // Wait for the others to join, watching the clock.
    let start = Instant::now();
    while (c.header().joined.load(Acquire) as usize) < world {
        if start.elapsed() > join_timeout {
            let missing: Vec<usize> = (0..world).filter(|&r| c.ctrl(r).state.load(Acquire) == 0).collect();
            return Err(CommError::Setup(format!(
                "rank {rank}: ranks {missing:?} did not join within {:.0} s (LOCKSTEP_JOIN_TIMEOUT_S); did every rank start?",
                join_timeout.as_secs_f64()
            )));
        }
        std::thread::sleep(Duration::from_micros(if start.elapsed() < Duration::from_millis(2) { 20 } else { 500 }));
    }
    c.watch_peers();
    Ok(ShmComm::new(c, heap))
}

impl ShmComm {
    /// Join the named segment of job `job_id` as `rank` of `world` (ranks exec'd separately on one
    /// node). Rank 0 creates the segment; the others wait for it. The name is removed once all
    /// ranks have mapped it.
    pub fn join_named(job_id: &str, rank: usize, world: usize, cfg: ShmConfig) -> Result<ShmComm, CommError> {
        let cfg = cfg.normalized_for(world);
        let layout = Layout::new(world, cfg.slot_bytes, cfg.heap_bytes)?;
        if rank == 0 {
            let seg = Segment::create_named(job_id, layout.total)?;
            init_header(&seg, &layout, &cfg);
            return join(Arc::new(seg), layout, cfg, rank, Some(job_id));
        }
        let start = Instant::now();
        loop {
            if let Some(seg) = Segment::open_named(job_id, HEADER_BYTES)? {
                // SAFETY: the mapping is at least HEADER_BYTES long and page-aligned.
                let h = unsafe { &*(seg.base() as *const Header) };
                if h.magic.load(Acquire) == MAGIC {
                    let (w, slot, heap) =
                        (h.world.load(Relaxed) as usize, h.slot_bytes.load(Relaxed) as usize, h.heap_bytes.load(Relaxed) as usize);
                    if h.version.load(Relaxed) != VERSION || w != world {
                        return Err(CommError::Setup(format!(
                            "segment {} was made for world size {w} (layout v{}), this rank expects {world} (v{VERSION}); are two jobs using the same job id?",
                            shm_name(job_id),
                            h.version.load(Relaxed)
                        )));
                    }
                    // The creator's sizes win, so every rank agrees on the layout.
                    let layout = Layout::new(world, slot, heap)?;
                    if seg.len() >= layout.total {
                        return join(Arc::new(seg), layout, cfg, rank, Some(job_id));
                    }
                }
            }
            if start.elapsed() > cfg.join_timeout {
                return Err(CommError::Setup(format!(
                    "rank {rank}: shared segment {} did not appear within {:.0} s; is rank 0 of job {job_id} running on this node?",
                    shm_name(job_id),
                    cfg.join_timeout.as_secs_f64()
                )));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// Leaving: the rank's channel goes away with its communicator (or with a failed join).
impl Drop for Channel {
    fn drop(&mut self) {
        // Peers still waiting on us learn at once that we are gone, rather than at the timeout.
        self.ctrl(self.rank()).state.store(STATE_LEFT, SeqCst);
        let h = self.header();
        h.wake.0.fetch_add(1, SeqCst);
        futex_wake_all(&h.wake.0);
    }
}

/// Pin this rank to one CPU of its allowed set (rank-th, when there are at least as many CPUs as
/// ranks), as MPI does by default: migrations and two ranks landing on one CPU cost far more than
/// the collectives themselves. Skipped when oversubscribed.
fn bind_to_cpu(rank: usize, world: usize) {
    // SAFETY: zeroed cpu_set_t is a valid empty set; sched_getaffinity/setaffinity take a valid
    // pointer and its size.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return;
        }
        let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect();
        if cpus.len() < world {
            return;
        }
        let mut one: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpus[rank], &mut one);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &one);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::ReduceOp;

    #[test]
    fn single_rank_all_reduce() {
        let job = ShmJob::with_config(1, ShmConfig::default()).unwrap();
        let mut c = job.communicator(0).unwrap();
        let x: Vec<f32> = (0..100_000).map(|i| i as f32).collect();
        let mut y = vec![0f32; x.len()];
        c.all_reduce(&x, &mut y, ReduceOp::Avg).unwrap();
        assert_eq!(x, y);
        let mut s = c.alloc_shared::<f32>(1000).unwrap();
        s[3] = 2.0;
        c.all_reduce_in_place(&mut s, ReduceOp::Sum).unwrap();
        assert_eq!(s[3], 2.0);
        c.barrier().unwrap();
        // Absurd sizes are refused, not overflowed.
        assert!(c.alloc_shared::<i64>(usize::MAX / 8).is_err());
        assert!(c.alloc_shared::<u8>(usize::MAX).is_err());
    }
}
