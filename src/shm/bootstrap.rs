//! Job setup: creating a segment and initialising its header, joining it as a rank (forked ranks
//! through [`ShmJob`], separately exec'd ranks through [`ShmComm::join_named`] and a job id),
//! removing the segment's name once everyone has mapped it, and leaving.

use std::sync::atomic::Ordering::{Acquire, Relaxed, Release, SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::alloc::Heap;
use super::backend::ShmComm;
use super::channel::Channel;
use super::config::{CpuBind, ShmConfig};
use super::segment::{
    available_cpus, futex_wait, futex_wake_all, room_hint, show_bytes, NoSpace, PeerWatch, SegName,
    Segment,
};
use super::stale::{creator_identity, creator_in, creator_of, Creator};
use super::sync::{Header, Layout, HEADER_BYTES, MAGIC, STATE_JOINED, STATE_LEFT, VERSION};
use crate::comm::{rank_name, CommError, Communicator};

/// A shared segment prepared for `world` ranks, created by the parent before it forks.
#[derive(Debug, Clone)]
pub struct ShmJob {
    seg: Arc<Segment>,
    layout: Layout,
    cfg: ShmConfig,
}

pub(crate) fn init_header(seg: &Segment, layout: &Layout, cfg: &ShmConfig) {
    // SAFETY: the segment starts with a Header-sized, 64-byte aligned (page-aligned mapping) region
    // that nobody else reads before `magic` is set.
    let h = unsafe { &*(seg.base() as *const Header) };
    h.version.store(VERSION, Relaxed);
    h.world.store(layout.world as u32, Relaxed);
    h.slot_bytes.store(layout.slot_bytes as u64, Relaxed);
    h.heap_bytes.store(layout.heap_bytes as u64, Relaxed);
    h.total_bytes.store(layout.total as u64, Relaxed);
    h.small_bytes
        .store(cfg.small_bytes.min(layout.slot_bytes) as u64, Relaxed);
    h.nt_bytes.store(cfg.nt_bytes as u64, Relaxed);
    let (pid, pidns, start) = creator_identity();
    h.creator_pid.store(pid, Relaxed);
    h.creator_pidns.store(pidns, Relaxed);
    h.creator_start.store(start, Relaxed);
    h.magic.store(MAGIC, Release);
}

/// Back the fixed part of a new segment (header, control blocks, slots, mailboxes) so that no
/// rank ever meets a SIGBUS there, and a small `/dev/shm` is an error here, at creation.
///
/// A named segment reserves only what every rank touches from its first call (header, control
/// blocks, inline entries) and checks that its file system has room for the rest: each rank maps
/// its own staging slots when it first runs a collective that stages data, and each mailbox when
/// it first sends or receives through it ([`Segment::populate`], which allocates the pages and
/// fails cleanly when there is no room after all, e.g. when another job took it meanwhile). So a
/// job pays only for the memory it uses: a start-up whose collectives all take the inline path
/// touches a few pages instead of reserving, mapping and freeing 2 MiB per rank (issue 16). An
/// anonymous segment (a memfd: no file system to ask, only the memory cgroup) reserves all of it.
pub(crate) fn reserve_backed(seg: &Segment, layout: &Layout) -> Result<(), CommError> {
    if !seg.is_named() {
        return seg
            .reserve(0, layout.backed())
            .map_err(|e| no_room(&e, layout));
    }
    seg.check_room(layout.backed())
        .map_err(|e| no_room(&e, layout))?;
    seg.reserve(0, layout.slots_off)
        .map_err(|e| no_room(&e, layout))?;
    seg.reserve(layout.inline_off, layout.p2p_off - layout.inline_off)
        .map_err(|e| no_room(&e, layout))
}

/// Where to make room, for the errors of a segment that does not fit.
/// The error for a segment whose fixed part does not fit: what was needed, why, what to change.
fn no_room(e: &NoSpace, layout: &Layout) -> CommError {
    CommError::Setup(format!(
        "{e}: the shared segment of {} ranks needs that much for its header, two staging slots of {} per rank and its mailboxes. Lower LOCKSTEP_SHM_SLOT_BYTES (at least 4096 per peer), run fewer ranks per node, or {}",
        layout.world,
        show_bytes(layout.slot_bytes as u64),
        room_hint(e)
    ))
}

impl ShmJob {
    /// Create an anonymous segment for `world` ranks with settings from the environment (a
    /// malformed `LOCKSTEP_*` tuning variable is an error naming it).
    pub fn new(world: usize) -> Result<ShmJob, CommError> {
        ShmJob::with_config(world, ShmConfig::from_env()?)
    }

    /// Create an anonymous segment for `world` ranks.
    pub fn with_config(world: usize, cfg: ShmConfig) -> Result<ShmJob, CommError> {
        if world == 0 || world > 1024 {
            return Err(CommError::Setup(format!(
                "world size {world} is out of range 1..=1024"
            )));
        }
        let cfg = cfg.normalized_for(world);
        let layout = Layout::new(world, cfg.slot_bytes, cfg.heap_bytes)?;
        let seg = Segment::anonymous(layout.total)?;
        reserve_backed(&seg, &layout)?;
        init_header(&seg, &layout, &cfg);
        Ok(ShmJob {
            seg: Arc::new(seg),
            layout,
            cfg,
        })
    }

    /// Number of ranks the segment was made for.
    pub fn world_size(&self) -> usize {
        self.layout.world
    }

    /// Join as `rank` (called in each forked child).
    pub fn join(&self, rank: usize) -> Result<ShmComm, CommError> {
        join(
            self.seg.clone(),
            self.layout,
            self.cfg.clone(),
            rank,
            None,
            None,
        )
    }

    /// Join, as the replacement of `rank`, the communicator the survivors of a lost rank grow
    /// ([`Communicator::grow`]) from a communicator of this job: the forked counterpart of
    /// [`ShmComm::join_replacement`], for a process forked after the loss from the one that
    /// made the job. `replaced` is the number of ranks replaced so far in all, this one
    /// included (1 for the first replacement).
    pub fn join_replacement(&self, rank: usize, replaced: u64) -> Result<Communicator, CommError> {
        // SAFETY: the segment starts with an initialised Header (page-aligned mapping); its
        // fields are atomics.
        let h = unsafe { &*(self.seg.base() as *const Header) };
        let tag = anonymous_tag(h);
        let c =
            ShmComm::join_replacement(&tag, rank, self.layout.world, replaced, self.cfg.clone())?;
        Ok(Communicator::from_backend(Box::new(c)))
    }

    /// A read-only descriptor of the segment (for the status reader's tests).
    #[cfg(test)]
    pub(crate) fn segment_file(&self) -> Option<std::fs::File> {
        self.seg.reopen_read_only()
    }

    /// Join as `rank` and wrap the result in a [`Communicator`].
    pub fn communicator(&self, rank: usize) -> Result<Communicator, CommError> {
        Ok(Communicator::from_backend(Box::new(self.join(rank)?)))
    }
}

/// How the ranks of a sub-communicator join its segment (see `shm::split`).
pub(crate) struct SubJoin {
    /// The global rank of each rank, which its errors name; `None` when they are the ranks
    /// themselves (a grown world communicator, see `shm::grow`).
    pub global: Option<Arc<[usize]>>,
    /// Each rank's process (known from the parent communicator), so that a member that dies
    /// before it has joined fails the join at once rather than at the join timeout.
    pub pids: Vec<i32>,
    /// The parent's spin time. The process is placed already: a sub-communicator binds no CPU.
    pub spin: Duration,
}

/// Join a segment whose header is initialised as `rank`: claim the rank's control block, wait for
/// every rank to arrive, then watch the peers' processes. With `name`, the last rank to arrive
/// removes the segment's name. `sub`: the segment is a sub-communicator's.
pub(crate) fn join(
    seg: Arc<Segment>,
    layout: Layout,
    cfg: ShmConfig,
    rank: usize,
    name: Option<&SegName>,
    sub: Option<&SubJoin>,
) -> Result<ShmComm, CommError> {
    let world = layout.world;
    if rank >= world {
        return Err(CommError::Setup(format!(
            "rank {rank} is out of range for world size {world}"
        )));
    }
    let heap = Arc::new(Mutex::new(Heap::new(
        layout.heap_off(rank),
        layout.heap_bytes,
    )));
    let spin = match sub {
        Some(s) => s.spin,
        None => cfg.spin.unwrap_or(if world > available_cpus() {
            Duration::from_micros(2)
        } else {
            Duration::from_micros(20)
        }),
    };
    if sub.is_none() {
        bind_cpus(cfg.cpu_bind, rank, world);
    }
    let global = sub.and_then(|s| s.global.clone());
    let who = |r: usize| rank_name(global.as_deref(), r);
    let join_timeout = cfg.join_timeout;
    // From here on, an early return drops `c`, which marks this rank's control block as left
    // (see the Drop below), as the communicator would.
    let mut c = Channel::new(seg, layout, cfg, rank, spin);
    if let Some(g) = &global {
        c.set_global(g.clone());
    }
    let me = c.ctrl(rank);
    if me
        .state
        .compare_exchange(0, STATE_JOINED, SeqCst, SeqCst)
        .is_err()
    {
        return Err(CommError::Setup(format!(
            "{} has already joined this communicator (pid {})",
            who(rank),
            me.pid.load(Relaxed)
        )));
    }
    // The rank's slots are mapped when it first stages data (Channel::ensure_slots), not here:
    // a job whose collectives all take the inline path never touches them.
    me.progress.store(0, Relaxed);
    me.pid.store(std::process::id() as i32, Relaxed);
    let h = c.header();
    let joined = h.joined.fetch_add(1, SeqCst) + 1;
    // Wake the ranks asleep below: they recheck the count.
    h.wake.0.fetch_add(1, SeqCst);
    futex_wake_all(&h.wake.0);
    if joined as usize == world {
        if let Some(name) = name {
            // Everyone has mapped the named segment: remove its name so nothing can leak.
            name.unlink();
        }
    }
    // Wait for the others to join, asleep on the header's futex word (every join bumps it), so a
    // rank that waits long for a late peer costs no CPU. Reading the word before the count means
    // a join in between changes the word, and the futex call then returns at once.
    // Every 200 ms it also checks that the ranks that joined are still there, so a job whose rank
    // died while the others were starting fails at once rather than at the join timeout.
    let start = Instant::now();
    let mut watches: Vec<Option<PeerWatch>> = (0..world).map(|_| None).collect();
    loop {
        let w = h.wake.0.load(SeqCst);
        if (h.joined.load(SeqCst) as usize) >= world {
            break;
        }
        let waited = start.elapsed();
        if waited > join_timeout {
            let missing: Vec<String> = (0..world)
                .filter(|&r| c.ctrl(r).state.load(Acquire) == 0)
                .map(who)
                .collect();
            return Err(CommError::Setup(format!(
                "{}: {} did not join within {:.0} s (LOCKSTEP_JOIN_TIMEOUT_S); did every rank start?",
                who(rank),
                missing.join(", "),
                join_timeout.as_secs_f64()
            )));
        }
        for (r, watch) in watches.iter_mut().enumerate() {
            let peer = c.ctrl(r);
            let (state, mut pid) = (peer.state.load(Acquire), peer.pid.load(Acquire));
            if r == rank {
                continue;
            }
            if state == 0 || pid == 0 {
                // Not joined yet: the members of a sub-communicator are known processes.
                match sub.and_then(|s| s.pids.get(r)) {
                    Some(&p) if p > 0 => pid = p,
                    _ => continue,
                }
            }
            if state == STATE_LEFT || watch.get_or_insert_with(|| PeerWatch::new(pid)).is_dead() {
                return Err(CommError::Setup(format!(
                    "{}: {} (pid {pid}) {} before all ranks had joined; the {} cannot start: restart it (the launcher reports that rank's exit status)",
                    who(rank),
                    who(r),
                    if state == STATE_LEFT { "gave up" } else { "died" },
                    if sub.is_some() { "sub-communicator" } else { "job" }
                )));
            }
        }
        futex_wait(
            &h.wake.0,
            w,
            (join_timeout - waited).min(Duration::from_millis(200)) + Duration::from_millis(1),
        );
    }
    c.watch_peers();
    Ok(ShmComm::new(c, heap))
}

impl ShmComm {
    /// Join the named segment of job `job_id` as `rank` of `world` (ranks exec'd separately on one
    /// node). Rank 0 creates the segment (in `/dev/shm`, or `cfg.shm_dir`); the others wait for
    /// it. The name is removed once all ranks have mapped it.
    pub fn join_named(
        job_id: &str,
        rank: usize,
        world: usize,
        cfg: ShmConfig,
    ) -> Result<ShmComm, CommError> {
        let cfg = cfg.normalized_for(world);
        let name = SegName::new(cfg.checked_shm_dir()?, job_id)?;
        let layout = Layout::new(world, cfg.slot_bytes, cfg.heap_bytes)?;
        if rank == 0 {
            let seg = create_ready(&name, job_id, &layout, &cfg)?;
            return join(Arc::new(seg), layout, cfg, rank, Some(&name), None)
                .map(|c| c.with_tag(job_id));
        }
        let start = Instant::now();
        // Poll for the segment with exponential back-off (it has no futex to sleep on before it
        // exists): quick when all ranks start together, cheap when rank 0 comes late. The cap
        // bounds how long a rank oversleeps a segment that appeared (a 5 ms cap cost up to 5 ms
        // of a 5 ms launch); a look costs a failed open, ~1 000 a second at most.
        let mut nap = Duration::from_micros(50);
        loop {
            if let Some((seg, layout)) = open_ready(&name, world)? {
                return join(Arc::new(seg), layout, cfg, rank, Some(&name), None)
                    .map(|c| c.with_tag(job_id));
            }
            if start.elapsed() > cfg.join_timeout {
                return Err(CommError::Setup(format!(
                    "rank {rank}: shared segment {name} did not appear within {:.0} s; is rank 0 of job {job_id} running on this node (with the same LOCKSTEP_SHM_DIR)?",
                    cfg.join_timeout.as_secs_f64()
                )));
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(1));
        }
    }
}

/// The tag of an anonymous segment: its creator's pid and start time (see `shm::split`).
pub(crate) fn anonymous_tag(h: &Header) -> String {
    format!(
        "p{}.{}",
        h.creator_pid.load(Relaxed),
        h.creator_start.load(Relaxed)
    )
}

/// Open the named segment `name` of a communicator of `world` ranks when it is ready to join:
/// `None` while it does not exist, is not initialised yet, or is the leftover of a killed run
/// (its creator is dead: the rank that creates it is about to replace it); an error when it
/// was made for another world size or layout version (another job with the same id).
pub(crate) fn open_ready(
    name: &SegName,
    world: usize,
) -> Result<Option<(Segment, Layout)>, CommError> {
    let Some(seg) = Segment::open_named(name, HEADER_BYTES)? else {
        return Ok(None);
    };
    // SAFETY: the mapping is at least HEADER_BYTES long and page-aligned.
    let h = unsafe { &*(seg.base() as *const Header) };
    if h.magic.load(Acquire) != MAGIC {
        return Ok(None);
    }
    let (w, slot, heap) = (
        h.world.load(Relaxed) as usize,
        h.slot_bytes.load(Relaxed) as usize,
        h.heap_bytes.load(Relaxed) as usize,
    );
    if h.version.load(Relaxed) != VERSION || w != world {
        return Err(CommError::Setup(format!(
            "segment {name} was made for world size {w} (layout v{}), this rank expects {world} (v{VERSION}); are two jobs using the same job id?",
            h.version.load(Relaxed)
        )));
    }
    // The creator's sizes win, so every rank agrees on the layout.
    let layout = Layout::new(world, slot, heap)?;
    // A segment whose creator is dead is a leftover of a killed run with this job id: joining
    // it would wait for nobody.
    let leftover = matches!(creator_in(h), Creator::Dead(_));
    Ok((seg.len() >= layout.total && !leftover).then_some((seg, layout)))
}

/// Create job `job_id`'s named segment ([`create_named`]), back its fixed part
/// ([`reserve_backed`], removing the name again when there is no room) and initialise its header:
/// ready for the ranks to join.
pub(crate) fn create_ready(
    name: &SegName,
    job_id: &str,
    layout: &Layout,
    cfg: &ShmConfig,
) -> Result<Segment, CommError> {
    let seg = create_named(name, job_id, layout)?;
    if let Err(e) = reserve_backed(&seg, layout) {
        name.unlink();
        return Err(e);
    }
    init_header(&seg, layout, cfg);
    Ok(seg)
}

/// Create job `job_id`'s named segment. A segment of that name whose creator is dead (a job
/// killed before all its ranks joined, run again with the same id) is removed at once and the
/// creation retried; one whose creator lives, or cannot be checked, is an error that says so.
pub(crate) fn create_named(
    name: &SegName,
    job_id: &str,
    layout: &Layout,
) -> Result<Segment, CommError> {
    let exists = |e: &CommError| matches!(e, CommError::Os { source, .. } if source.raw_os_error() == Some(libc::EEXIST));
    match Segment::create_named(name, layout.total) {
        Err(e) if exists(&e) => match creator_of(name) {
            Creator::Dead(pid) => {
                if name.unlink() {
                    tracing::info!("removed the shared-memory segment {name} left behind by a killed job: its creator (pid {pid}) is gone");
                }
                Segment::create_named(name, layout.total)
            }
            Creator::Alive(pid) => Err(CommError::Setup(format!(
                "shared segment {name} already exists and its creator (pid {pid}) is running: another job uses job id {job_id}; give each job its own LOCKSTEP_JOB_ID"
            ))),
            Creator::Unknown => Err(CommError::Setup(format!(
                "shared segment {name} already exists and its creator cannot be checked (another lockstep version, or another pid namespace); if no job with id {job_id} runs, remove it (rm {name}), or use another LOCKSTEP_JOB_ID"
            ))),
        },
        r => r,
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

/// Bind this rank's thread (and the threads it starts later) to its CPUs among those its affinity
/// mask allows (see [`CpuBind`]): one CPU, the rank-th, for `Core`; a block of
/// `allowed / world` consecutive CPUs for `Block`. Nothing when the ranks outnumber the CPUs:
/// ranks sharing CPUs are better left to the scheduler.
fn bind_cpus(mode: CpuBind, rank: usize, world: usize) {
    if mode == CpuBind::None {
        return;
    }
    // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity takes a valid pointer
    // and its size.
    let set = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return;
        }
        set
    };
    // SAFETY: CPU_ISSET reads a valid set for indexes below CPU_SETSIZE.
    let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect();
    if cpus.len() < world || world == 0 {
        tracing::debug!(
            "rank {rank}: {world} ranks on {} CPUs: no CPU binding",
            cpus.len()
        );
        return;
    }
    let per = match mode {
        CpuBind::Core => 1,
        _ => cpus.len() / world,
    };
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes indexes below
    // CPU_SETSIZE (they come from the allowed set); sched_setaffinity takes a valid pointer and
    // its size.
    unsafe {
        let mut mine: libc::cpu_set_t = std::mem::zeroed();
        for &c in &cpus[rank * per..(rank + 1) * per] {
            libc::CPU_SET(c, &mut mine);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mine);
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
