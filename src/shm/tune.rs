//! Online choice of how staged data is written into the slots: cached or streaming stores.
//!
//! Why: a peer reading lines that are still dirty in the writer's cache is fast when the two cores
//! share a cache and several times slower when they do not (measured on the project machine: a
//! 64 MiB staged broadcast 7 ms vs 34 ms). On virtual machines which of the two holds changes while
//! a job runs, as the hypervisor moves vCPUs. Streaming stores send staged data to memory: a little
//! slower when caches are shared (64 MiB: 7.7 vs 7.2 ms; 1 MiB all-reduce: 140 vs 61 µs), far
//! faster when they are not. No fixed choice is right, so rank 0 times every staged collective
//! under the mode it chose, per (collective, size) class, keeps the faster mode and re-measures the
//! other one now and then. Every rank follows rank 0's choice, carried in its call descriptor, so
//! one call runs in one mode and its time measures that mode.

use std::time::{Duration, Instant};

/// How staged data is written (`LOCKSTEP_SHM_STAGE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StageMode {
    /// Measure both and use the faster, re-checking as conditions change (default).
    Auto,
    /// Ordinary stores: best when the ranks' cores share a cache.
    Cached,
    /// Streaming stores: best when they do not.
    Streaming,
}

impl StageMode {
    /// Parse `auto`, `cached` or `streaming`.
    pub fn parse(s: &str) -> Option<StageMode> {
        match s.trim() {
            "auto" => Some(StageMode::Auto),
            "cached" => Some(StageMode::Cached),
            "streaming" | "nt" => Some(StageMode::Streaming),
            _ => None,
        }
    }
}

/// A probe of the mode not in use costs at most about 1/PROBE_RATIO of the time.
const PROBE_RATIO: f64 = 50.0;
/// And happens at most this often per class.
const PROBE_MIN: Duration = Duration::from_millis(200);
/// Weight of a new measurement of the mode in use.
const ALPHA: f64 = 0.25;
/// The first calls of a class alternate the two modes, each keeping its best time; the very
/// first (cold caches, first touch of the buffers) is not counted.
const WARMUP: u32 = 7;

#[derive(Clone, Copy, Default)]
struct Class {
    /// Estimated seconds per call, cached (0) and streaming (1).
    est: [Option<f64>; 2],
    /// Mode of the last call of this class (rank 0's choice, as every rank last saw it).
    current: bool,
    last_probe: Option<Instant>,
    probing: bool,
    /// Calls so far, while fewer than WARMUP.
    calls: u32,
    /// The faster mode at the last decision (for the debug log of changes).
    best: Option<bool>,
}

/// Per-communicator state of the choice (see the module docs).
pub(crate) struct StageTuner {
    mode: StageMode,
    classes: Vec<Class>,
}

const BUCKETS: usize = 65;

fn index(group: usize, bytes: usize) -> usize {
    group * BUCKETS + (usize::BITS - bytes.leading_zeros()) as usize
}

impl StageTuner {
    pub(crate) fn new(mode: StageMode) -> StageTuner {
        StageTuner { mode, classes: vec![Class::default(); 4 * BUCKETS] }
    }

    /// The mode rank 0 chooses for the next call of this class (`group` names the collective).
    pub(crate) fn choose(&mut self, group: usize, bytes: usize, now: Instant) -> bool {
        let c = &mut self.classes[index(group, bytes)];
        c.probing = false;
        match self.mode {
            StageMode::Cached => return false,
            StageMode::Streaming => return true,
            StageMode::Auto => {}
        }
        if c.calls < WARMUP {
            // The next probe comes a while after the warm-up.
            c.last_probe = Some(now);
            return c.calls.is_multiple_of(2) && c.calls > 0;
        }
        let [Some(cached), Some(streaming)] = c.est else {
            return false;
        };
        let best = streaming < cached;
        if c.best != Some(best) {
            c.best = Some(best);
            tracing::debug!(
                group,
                bytes,
                cached_us = cached * 1e6,
                streaming_us = streaming * 1e6,
                "shm staging: {} stores are faster for this collective and size class",
                if best { "streaming" } else { "cached" }
            );
        }
        let other = if best { cached } else { streaming };
        let due = c.last_probe.is_none_or(|t| now.duration_since(t) >= PROBE_MIN.max(Duration::from_secs_f64(other * PROBE_RATIO)));
        if due {
            c.last_probe = Some(now);
            c.probing = true;
            return !best;
        }
        best
    }

    /// The mode a rank other than 0 should guess for the part it stages before the call's
    /// descriptors arrive: the one rank 0 used last for this class.
    pub(crate) fn guess(&self, group: usize, bytes: usize) -> bool {
        match self.mode {
            StageMode::Cached => false,
            StageMode::Streaming => true,
            StageMode::Auto => self.classes[index(group, bytes)].current,
        }
    }

    /// Rank 0's choice for this call, as read from its descriptor.
    pub(crate) fn seen(&mut self, group: usize, bytes: usize, nt: bool) {
        self.classes[index(group, bytes)].current = nt;
    }

    /// Rank 0: one call of this class took `secs` under mode `nt`.
    pub(crate) fn record(&mut self, group: usize, bytes: usize, nt: bool, secs: f64) {
        let c = &mut self.classes[index(group, bytes)];
        let e = &mut c.est[nt as usize];
        if c.calls < WARMUP {
            if c.calls > 0 {
                *e = Some(e.map_or(secs, |old| old.min(secs)));
            }
            c.calls += 1;
            return;
        }
        // A probe replaces its mode's estimate: the old one may date from other conditions.
        *e = Some(match *e {
            Some(old) if !c.probing => old + ALPHA * (secs - old),
            _ => secs,
        });
        c.probing = false;
    }
}

/// Whether a collective whose per-rank message is `bytes` long should copy once, straight from the
/// peers' ordinary buffers (`algo::single`), rather than twice through the slots.
///
/// Why by size: a direct copy costs a system call and the pinning of the peer's pages (a few
/// microseconds), paid back from a few tens of KiB on, where staging's second copy costs more,
/// all the more when the two cores share no cache (the staged lines then travel through memory
/// twice). Below `small_bytes` the one-phase paths win. From `nt_bytes` up the message no longer
/// fits the caches and the staged paths write with streaming stores, while the kernel's copy
/// writes through the cache (each destination line is read before it is written): measured on
/// the project machine at 64 MiB, the direct path was 5-25 % slower there (RESULTS.md, session
/// 6), so it stops below `nt_bytes`. `cma_bytes` 0 turns it off.
pub(crate) fn direct_for(bytes: usize, cma_bytes: usize, small_bytes: usize, nt_bytes: usize) -> bool {
    cma_bytes > 0 && bytes >= cma_bytes && bytes > small_bytes && bytes < nt_bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measures_both_then_keeps_the_faster_and_follows_a_change() {
        let mut t = StageTuner::new(StageMode::Auto);
        let t0 = Instant::now();
        // Warm-up: a cold first call (not counted), then both modes in turn.
        assert!(!t.choose(0, 1 << 20, t0));
        t.record(0, 1 << 20, false, 5e-3);
        for i in 1..WARMUP {
            let nt = t.choose(0, 1 << 20, t0);
            assert_eq!(nt, i % 2 == 0);
            t.record(0, 1 << 20, nt, if nt { 140e-6 } else { 60e-6 });
        }
        // Cached is faster; no probe right after measuring (the first choice counts as one).
        let mut probes = 0;
        for i in 0..100 {
            let now = t0 + Duration::from_millis(i);
            if t.choose(0, 1 << 20, now) {
                probes += 1;
                t.record(0, 1 << 20, true, 140e-6);
            } else {
                t.record(0, 1 << 20, false, 60e-6);
            }
        }
        assert!(probes <= 1, "{probes} probes in 100 ms");
        // The machine changes: cached becomes 7x slower; the tuner moves to streaming.
        let mut streaming = 0;
        for i in 0..200 {
            let now = t0 + Duration::from_millis(100 + i);
            let nt = t.choose(0, 1 << 20, now);
            t.record(0, 1 << 20, nt, if nt { 140e-6 } else { 440e-6 });
            streaming += nt as usize;
        }
        assert!(streaming >= 190, "{streaming} of 200 calls streamed");
        // Classes are independent.
        assert!(!t.choose(1, 1 << 20, t0));
        assert!(!t.choose(0, 1 << 26, t0));
    }

    #[test]
    fn probes_cost_a_bounded_share() {
        let mut t = StageTuner::new(StageMode::Auto);
        let t0 = Instant::now();
        let (fast, slow) = (10e-3, 35e-3);
        let (mut clock, mut spent_probing) = (0.0, 0.0);
        for _ in 0..2000 {
            let nt = t.choose(2, 64 << 20, t0 + Duration::from_secs_f64(clock));
            let secs = if nt { fast } else { slow };
            t.record(2, 64 << 20, nt, secs);
            clock += secs;
            if !nt {
                spent_probing += secs;
            }
        }
        assert!(spent_probing / clock < 0.03, "probing took {:.1} % of the time", 100.0 * spent_probing / clock);
    }

    #[test]
    fn direct_copies_from_the_threshold_up() {
        assert!(!direct_for(1 << 20, 0, 16 << 10, 8 << 20), "0 turns it off");
        assert!(!direct_for(16 << 10, 4 << 10, 16 << 10, 8 << 20), "the small path keeps its sizes");
        assert!(!direct_for((32 << 10) - 1, 32 << 10, 16 << 10, 8 << 20));
        assert!(direct_for(32 << 10, 32 << 10, 16 << 10, 8 << 20));
        assert!(direct_for((8 << 20) - 1, 32 << 10, 16 << 10, 8 << 20));
        assert!(!direct_for(8 << 20, 32 << 10, 16 << 10, 8 << 20), "streaming staging from nt_bytes up");
    }

    #[test]
    fn fixed_modes_never_probe() {
        let mut t = StageTuner::new(StageMode::Streaming);
        assert!((0..10).all(|_| t.choose(0, 4096, Instant::now())));
        let mut t = StageTuner::new(StageMode::Cached);
        assert!((0..10).all(|_| !t.choose(0, 4096, Instant::now())));
        assert_eq!(StageMode::parse("streaming"), Some(StageMode::Streaming));
        assert_eq!(StageMode::parse("bogus"), None);
    }
}
