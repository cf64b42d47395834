//! Tunables of the shared-memory backend, read once from `LOCKSTEP_*` environment variables.

use std::path::{Path, PathBuf};
use std::time::Duration;

use std::sync::atomic::{AtomicU8, Ordering};

use super::tune::{SingleCopyMode, StageMode};
use crate::comm::CommError;

/// Settings of one shared-memory communicator.
#[derive(Clone, Debug)]
pub struct ShmConfig {
    /// Bytes of each of a rank's two slots, through which the slots path moves data
    /// (`LOCKSTEP_SHM_SLOT_BYTES`, default 1 MiB; at least 4 KiB per peer).
    pub slot_bytes: usize,
    /// All-reduce/reduce messages up to this size take the one-phase path
    /// (`LOCKSTEP_SHM_SMALL_BYTES`, default 16 KiB, at most `slot_bytes`).
    pub small_bytes: usize,
    /// Collectives whose per-rank payload (what one rank contributes: its input, or a rooted
    /// call's whole input on the root) is at most this many bytes take the inline path, where
    /// the call's arguments and data cross between cores together, in one exchange (default
    /// 4 KiB, at most 4 KiB; 0 turns the inline path off except for the barrier, which carries
    /// no data).
    pub fast_bytes: usize,
    /// Virtual size of each rank's shared heap for `alloc_shared` (`LOCKSTEP_SHM_HEAP_BYTES`,
    /// default 4 GiB; only touched pages use memory).
    pub heap_bytes: usize,
    /// Overall time a rank waits for its peers in one collective (`LOCKSTEP_TIMEOUT_S`, default 600).
    pub timeout: Duration,
    /// How often a waiting rank checks that its peers are alive (`LOCKSTEP_PEER_CHECK_MS`, default 100).
    pub peer_check: Duration,
    /// Time to spin before yielding (`LOCKSTEP_SPIN_US`, default 20 µs, 2 µs when oversubscribed).
    pub spin: Option<Duration>,
    /// Messages whose output is at least this large are written with streaming stores
    /// (`LOCKSTEP_SHM_NT_BYTES`, default 8 MiB): they would not stay in cache anyway.
    pub nt_bytes: usize,
    /// How staged data is written into the slots (`LOCKSTEP_SHM_STAGE=auto|cached|streaming`,
    /// default auto: measured online, see [`StageMode`]).
    pub stage: StageMode,
    /// How each rank is bound to CPUs when it joins (`LOCKSTEP_CPU_BIND`, see [`CpuBind`];
    /// default [`default_cpu_bind`]).
    pub cpu_bind: CpuBind,
    /// Time to wait for all ranks to join (`LOCKSTEP_JOIN_TIMEOUT_S`, default 60).
    pub join_timeout: Duration,
    /// Directory for named segments (`LOCKSTEP_SHM_DIR`, e.g. a larger tmpfs when `/dev/shm` is
    /// Docker's 64 MiB); `None`: `/dev/shm` through `shm_open`. Must be an existing directory,
    /// given as an absolute path (checked when a named segment is used, see
    /// [`checked_shm_dir`](Self::checked_shm_dir)). Segments of forked ranks are anonymous and do
    /// not use it.
    pub shm_dir: Option<PathBuf>,
    /// Point-to-point messages of at least this many bytes are copied once, straight from the
    /// sender's buffer into the receiver's, with cross-memory attach (CMA: `process_vm_readv`),
    /// instead of twice through the pair's mailbox; so are exchange blocks, and collectives on
    /// ordinary buffers may take the CMA path from this size (see `single_copy`)
    /// (`LOCKSTEP_SHM_CMA_BYTES`, default 32 KiB; 0 turns it off). Where the kernel refuses (Yama `ptrace_scope` 2 or 3, a seccomp filter, another pid
    /// namespace), the message goes through the mailbox. Under Yama `ptrace_scope` 1 each rank
    /// declares `PR_SET_PTRACER_ANY`, as Open MPI's shared-memory transport does, so that its
    /// sibling ranks may read its buffers; that restores the classic same-user ptrace rule for the
    /// rank.
    pub cma_bytes: usize,
    /// Whether collectives on ordinary buffers take the CMA path (one copy, straight between the
    /// ranks' buffers) or the slots path (two copies), where `cma_bytes` and `nt_bytes` allow both
    /// (`LOCKSTEP_SHM_SINGLE_COPY=auto|always|never`, default auto: rank 0 times both and keeps
    /// the faster, see [`SingleCopyMode`]).
    pub single_copy: SingleCopyMode,
    /// Fail every all_reduce, reduce and reduce_scatter of floating-point data (f32, f64, f16,
    /// bf16) whose input holds a NaN or an infinity on any rank, with the same
    /// [`CommError::NonFinite`] on every rank, naming the rank, the call and the first such
    /// element (`LOCKSTEP_CHECK_FINITE=1`; default off). The check runs inside the reduction's
    /// own pass over the data. Integer reductions have no non-finite values and are unaffected.
    /// Every rank must set it alike (the first phase of a call compares it).
    pub check_finite: bool,
    /// Fault injection for tests: receivers refuse every direct copy, as a kernel that forbids
    /// cross-memory attach would, so the fallback to the mailbox is exercised.
    #[doc(hidden)]
    pub fault_refuse_direct: bool,
}

/// Name of the variable that moves named segments out of `/dev/shm`.
pub(crate) const SHM_DIR_VAR: &str = "LOCKSTEP_SHM_DIR";

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig {
            slot_bytes: 1 << 20,
            small_bytes: 16 << 10,
            fast_bytes: 4 << 10,
            heap_bytes: 4 << 30,
            timeout: Duration::from_secs(600),
            peer_check: Duration::from_millis(100),
            spin: None,
            join_timeout: Duration::from_secs(60),
            nt_bytes: 8 << 20,
            stage: StageMode::Auto,
            cpu_bind: default_cpu_bind(),
            shm_dir: None,
            cma_bytes: 32 << 10,
            single_copy: SingleCopyMode::Auto,
            check_finite: false,
            fault_refuse_direct: false,
        }
    }
}

impl ShmConfig {
    /// Defaults overridden by the environment. Each variable is parsed strictly (see
    /// [`crate::types::env`]): a malformed or out-of-range value is an error naming it, never a
    /// silent default. Sizes are then rounded up to the page (slots) or 2 MiB (heap).
    pub fn from_env() -> Result<ShmConfig, CommError> {
        use crate::types::env as v;
        let bad = |e: v::EnvError| CommError::Setup(e.to_string());
        let mut c = ShmConfig::default();
        if let Some(n) = v::SHM_SLOT_BYTES.count().map_err(bad)? {
            c.slot_bytes = n as usize;
        }
        if let Some(n) = v::SHM_SMALL_BYTES.count().map_err(bad)? {
            c.small_bytes = n as usize;
        }
        if let Some(n) = v::SHM_HEAP_BYTES.count().map_err(bad)? {
            c.heap_bytes = n as usize;
        }
        if let Some(t) = v::TIMEOUT_S.secs().map_err(bad)? {
            c.timeout = t;
        }
        if let Some(n) = v::PEER_CHECK_MS.count().map_err(bad)? {
            c.peer_check = Duration::from_millis(n);
        }
        if let Some(n) = v::SPIN_US.count().map_err(bad)? {
            c.spin = Some(Duration::from_micros(n));
        }
        if let Some(n) = v::SHM_NT_BYTES.count().map_err(bad)? {
            c.nt_bytes = n as usize;
        }
        if let Some(m) = v::SHM_STAGE.choice().map_err(bad)? {
            // `m` is one of SHM_STAGE's choices: auto, cached, streaming or nt.
            c.stage = match m {
                "cached" => StageMode::Cached,
                "streaming" | "nt" => StageMode::Streaming,
                _ => StageMode::Auto,
            };
        }
        if let Some(m) = v::CPU_BIND.choice().map_err(bad)? {
            // `m` is one of CPU_BIND's choices.
            c.cpu_bind = match m {
                "core" => CpuBind::Core,
                "none" => CpuBind::None,
                _ => CpuBind::Block,
            };
        }
        if let Some(n) = v::SHM_CMA_BYTES.count().map_err(bad)? {
            c.cma_bytes = n as usize;
        }
        if let Some(m) = v::SHM_SINGLE_COPY.choice().map_err(bad)? {
            // `m` is one of SHM_SINGLE_COPY's choices.
            c.single_copy = SingleCopyMode::parse(m).unwrap_or(SingleCopyMode::Auto);
        }
        if let Some(m) = v::CHECK_FINITE.choice().map_err(bad)? {
            c.check_finite = m == "1";
        }
        if let Some(t) = v::JOIN_TIMEOUT_S.secs().map_err(bad)? {
            c.join_timeout = t;
        }
        // Kept as given, even empty: `checked_shm_dir` refuses what is not a usable directory
        // rather than falling back to /dev/shm.
        c.shm_dir = std::env::var_os(SHM_DIR_VAR).map(PathBuf::from);
        Ok(c.normalized())
    }

    /// The directory for named segments: `None` for `/dev/shm`, or `shm_dir` once checked to be
    /// an absolute path to an existing directory (every rank must name the same one, whatever its
    /// working directory).
    pub fn checked_shm_dir(&self) -> Result<Option<&Path>, CommError> {
        let Some(d) = self.shm_dir.as_deref() else {
            return Ok(None);
        };
        let bad = |why: String| {
            Err(CommError::Setup(format!(
                "{SHM_DIR_VAR}={:?} {why}; set it to an existing directory on a tmpfs with room for the segment (e.g. mount -t tmpfs -o size=2g tmpfs /mnt/lockstep-shm), or unset it to use /dev/shm",
                d.display().to_string()
            )))
        };
        if !d.is_absolute() {
            return bad("is not an absolute path".into());
        }
        match std::fs::metadata(d) {
            Ok(m) if m.is_dir() => Ok(Some(d)),
            Ok(_) => bad("is not a directory".into()),
            Err(e) => bad(format!("cannot be used: {e}")),
        }
    }

    /// [`normalized`](Self::normalized), plus room in each slot for a 4 KiB piece per peer, which
    /// the chunked paths need for any world size.
    pub fn normalized_for(self, world: usize) -> ShmConfig {
        let mut c = self.normalized();
        c.slot_bytes = c.slot_bytes.max(4096 * world.saturating_sub(1));
        c
    }

    /// For a communicator that carries no data of its own, only shows the calls another transport
    /// carries (`lockstep status` of NCCL ranks across nodes): the smallest slots and heap, the
    /// rest (timeouts, CPU binding, directory) as configured.
    pub(crate) fn status_only(mut self) -> ShmConfig {
        self.slot_bytes = 0;
        self.heap_bytes = 0;
        self
    }

    /// Clamp values into workable ranges (slots page-aligned, one-phase path within a slot).
    pub fn normalized(mut self) -> ShmConfig {
        self.slot_bytes = self.slot_bytes.clamp(4096, 1 << 30).next_multiple_of(4096);
        self.small_bytes = self.small_bytes.min(self.slot_bytes);
        self.fast_bytes = self.fast_bytes.min(super::sync::INLINE_MAX);
        self.heap_bytes = self.heap_bytes.max(2 << 20).next_multiple_of(2 << 20);
        self.peer_check = self.peer_check.max(Duration::from_micros(100));
        self
    }
}

/// How a rank is bound to CPUs when it joins a shared-memory communicator, among the CPUs its
/// affinity mask allows. Nothing is bound when the ranks of the node outnumber those CPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuBind {
    /// Leave the affinity as it is (`LOCKSTEP_CPU_BIND=none`).
    None,
    /// One CPU per rank, the rank-th (`core`), as MPI binds by default: right for single-threaded
    /// ranks, wrong for ranks with intra-op, OpenMP or GEMM threads, which would share that CPU.
    Core,
    /// A block of CPUs / local ranks consecutive CPUs per rank (`block`): each rank's threads
    /// stay on its own cores, and a single rank keeps them all.
    Block,
}

/// The binding when `LOCKSTEP_CPU_BIND` is unset (0 none, 1 core, 2 block).
static DEFAULT_CPU_BIND: AtomicU8 = AtomicU8::new(2);

/// The binding used when `LOCKSTEP_CPU_BIND` is unset: [`CpuBind::Block`] unless an embedding
/// chose otherwise with [`set_default_cpu_bind`].
pub fn default_cpu_bind() -> CpuBind {
    match DEFAULT_CPU_BIND.load(Ordering::Relaxed) {
        0 => CpuBind::None,
        1 => CpuBind::Core,
        _ => CpuBind::Block,
    }
}

/// Set the binding used when `LOCKSTEP_CPU_BIND` is unset, for this process: the Python package
/// and the C library choose [`CpuBind::None`], since the program they are embedded in owns its
/// threads' placement.
pub fn set_default_cpu_bind(b: CpuBind) {
    let v = match b {
        CpuBind::None => 0,
        CpuBind::Core => 1,
        CpuBind::Block => 2,
    };
    DEFAULT_CPU_BIND.store(v, Ordering::Relaxed);
}
