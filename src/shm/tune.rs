//! Online choices between two ways of running a class of collectives, made by rank 0 from the
//! times it measures:
//!
//! * how data is written into the slots: cached or streaming (non-temporal) stores;
//! * whether a collective on ordinary buffers copies once, straight between the ranks' buffers
//!   (the CMA path, `shm::path`), or twice, through the slots.
//!
//! The calls are timed by `shm::timing`.
//!
//! Why streaming stores: a peer reading lines that are still dirty in the writer's cache is fast
//! when the two cores share a cache and several times slower when they do not. On virtual
//! machines which of the two holds changes while a job runs, as the hypervisor moves vCPUs.
//! Streaming stores send the slots' data to memory: a little slower when caches are shared, far
//! faster when they are not (`lockstep bench` at 1 MiB and 64 MiB measures both; the figures are
//! in the benchmark results).
//!
//! Why CMA versus the slots: a cross-memory copy saves the slots' second copy but pays a system
//! call and the pinning of the peer's pages, and the kernel copies through the cache. Which wins
//! depends on the size, the collective and the cache placement: with the cores sharing a cache,
//! a 1 MiB all-reduce can be faster through the slots while a 256 KiB broadcast is faster with
//! CMA (`lockstep bench` with `LOCKSTEP_SHM_SINGLE_COPY=always` and `never` shows both).
//!
//! No fixed choice is right, so rank 0 times every call of a class (collective, size bucket) under
//! the way it chose, keeps the faster one and re-measures the other now and then. Every rank
//! follows rank 0's choice, carried in its call descriptor, so one call runs one way and its time
//! measures that way.

use std::time::{Duration, Instant};

/// How data is written into the slots (`LOCKSTEP_SHM_STAGE`): cached or streaming
/// (non-temporal) stores.
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
/// A measurement of the mode in use counts at most this multiple of its estimate.
const OUTLIER: f64 = 1.5;
/// The first calls of a class run the first way, then the second, in runs of PROBE_CALLS, twice
/// over, each way keeping its best time; the very first (cold caches, first touch of the
/// buffers) is not counted. Why twice: the first run of a way pays for the class's first calls
/// (and the stores tuner's own warm-up), which made a 1 MiB all_gather through the slots look twice as
/// slow as it is (104 against 50 µs) and kept CMA for the whole of a benchmark.
const WARMUP: u32 = 1 + 4 * PROBE_CALLS;
/// Calls in a row of the way a probe measures, keeping its best time. Why more than one: the
/// first call after a switch finds the caches as the other way left them (a slots call's slots
/// cold after a run of CMA calls: a 1 MiB all-reduce took 420-500 µs instead of 95 µs), so a
/// lone call would condemn whichever way is probed.
const PROBE_CALLS: u32 = 3;

#[derive(Clone, Copy, Default)]
struct Class {
    /// Estimated seconds per call, the first way (0) and the second (1).
    est: [Option<f64>; 2],
    /// Mode of the last call of this class (rank 0's choice, as every rank last saw it).
    current: bool,
    last_probe: Option<Instant>,
    /// Calls so far, while fewer than WARMUP.
    calls: u32,
    /// Calls of the current probe still to run.
    probe_left: u32,
    /// The next measurement of the probed way starts its estimate afresh (the first of a probe).
    probe_fresh: bool,
    /// The faster mode at the last decision (for the debug log of changes).
    best: Option<bool>,
}

/// How collectives on ordinary buffers choose between a single copy with cross-memory attach
/// (the CMA path) and the slots (`LOCKSTEP_SHM_SINGLE_COPY`), within the sizes
/// `LOCKSTEP_SHM_CMA_BYTES` and `LOCKSTEP_SHM_NT_BYTES` allow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SingleCopyMode {
    /// Measure both and use the faster, re-checking as conditions change (default).
    Auto,
    /// Always CMA where the sizes allow it and the kernel permits it.
    Always,
    /// Always the slots.
    Never,
}

impl SingleCopyMode {
    /// Parse `auto`, `always` or `never`.
    pub fn parse(s: &str) -> Option<SingleCopyMode> {
        match s.trim() {
            "auto" => Some(SingleCopyMode::Auto),
            "always" => Some(SingleCopyMode::Always),
            "never" => Some(SingleCopyMode::Never),
            _ => None,
        }
    }
}

/// Per-communicator state of one choice (see the module docs): `true` picks the second way
/// (streaming stores; CMA).
pub(crate) struct Tuner {
    /// `Some` when the choice is fixed by configuration.
    fixed: Option<bool>,
    /// What is chosen, and the names of the two ways, for the debug log.
    what: &'static str,
    names: [&'static str; 2],
    classes: Vec<Class>,
}

const BUCKETS: usize = 65;

fn index(group: usize, bytes: usize) -> usize {
    group * BUCKETS + (usize::BITS - bytes.leading_zeros()) as usize
}

impl Tuner {
    /// Cached (`false`) or streaming (`true`) stores into the slots.
    pub(crate) fn streaming_stores(mode: StageMode) -> Tuner {
        let fixed = match mode {
            StageMode::Auto => None,
            StageMode::Cached => Some(false),
            StageMode::Streaming => Some(true),
        };
        Tuner::new(
            fixed,
            "shm slot stores",
            ["cached stores", "streaming stores"],
        )
    }

    /// The slots (`false`) or CMA (`true`) for collectives on ordinary buffers.
    pub(crate) fn cma_path(mode: SingleCopyMode) -> Tuner {
        let fixed = match mode {
            SingleCopyMode::Auto => None,
            SingleCopyMode::Always => Some(true),
            SingleCopyMode::Never => Some(false),
        };
        Tuner::new(fixed, "shm path", ["the slots", "CMA"])
    }

    fn new(fixed: Option<bool>, what: &'static str, names: [&'static str; 2]) -> Tuner {
        Tuner {
            fixed,
            what,
            names,
            classes: vec![Class::default(); 4 * BUCKETS],
        }
    }

    /// The mode rank 0 chooses for the next call of this class (`group` names the collective).
    pub(crate) fn choose(&mut self, group: usize, bytes: usize, now: Instant) -> bool {
        let c = &mut self.classes[index(group, bytes)];
        if let Some(f) = self.fixed {
            return f;
        }
        if c.calls < WARMUP {
            // The next probe comes a while after the warm-up.
            c.last_probe = Some(now);
            return c.calls > 0 && ((c.calls - 1) / PROBE_CALLS) % 2 == 1;
        }
        let [Some(first), Some(second)] = c.est else {
            return false;
        };
        let best = second < first;
        if c.best != Some(best) {
            c.best = Some(best);
            tracing::debug!(
                group,
                bytes,
                first_us = first * 1e6,
                second_us = second * 1e6,
                "{}: {} is faster for this collective and size class (first: {}, second: {})",
                self.what,
                self.names[best as usize],
                self.names[0],
                self.names[1]
            );
        }
        if c.probe_left > 0 {
            c.probe_left -= 1;
            return !best;
        }
        let other = if best { first } else { second };
        let due = c.last_probe.is_none_or(|t| {
            now.duration_since(t)
                >= PROBE_MIN.max(Duration::from_secs_f64(
                    other * PROBE_RATIO * PROBE_CALLS as f64,
                ))
        });
        if due {
            c.last_probe = Some(now);
            c.probe_left = PROBE_CALLS - 1;
            c.probe_fresh = true;
            return !best;
        }
        best
    }

    /// The mode a rank other than 0 should guess for the part it stages before the call's
    /// descriptors arrive: the one rank 0 used last for this class.
    pub(crate) fn guess(&self, group: usize, bytes: usize) -> bool {
        self.fixed
            .unwrap_or(self.classes[index(group, bytes)].current)
    }

    /// Whether `nt` is the way this class has settled on: the warm-up is over and it was the
    /// faster way at the last decision.
    pub(crate) fn settled_on(&self, group: usize, bytes: usize, nt: bool) -> bool {
        let c = &self.classes[index(group, bytes)];
        self.fixed
            .map_or(c.calls >= WARMUP && c.best == Some(nt), |f| f == nt)
    }

    /// Rank 0's choice for this call, as read from its descriptor.
    pub(crate) fn seen(&mut self, group: usize, bytes: usize, nt: bool) {
        self.classes[index(group, bytes)].current = nt;
    }

    /// Rank 0: one call of this class took `secs` (on its slowest rank) under mode `nt`.
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
        // A probe (a call of the way that was slower at the last decision) replaces its way's
        // estimate: the old one may date from other conditions. Rank 0 records a call one
        // collective late (when the peers' times arrive), so this is told from the way, not from
        // the last choice.
        let probe = c.best.is_some_and(|b| b != nt);
        *e = Some(match *e {
            // One slow call (the rank was preempted, an interrupt) must not flip the choice to
            // the slower way until the next probe: a sample counts at most OUTLIER times the
            // estimate; a lasting change still moves the estimate by a factor per call.
            Some(old) if !probe => old + ALPHA * (secs.min(old * OUTLIER) - old),
            // A probe's first call replaces the estimate (the old one may date from other
            // conditions), the rest of its run keep the best.
            Some(old) if !c.probe_fresh => old.min(secs),
            _ => secs,
        });
        if probe {
            c.probe_fresh = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measures_both_then_keeps_the_faster_and_follows_a_change() {
        let mut t = Tuner::streaming_stores(StageMode::Auto);
        let t0 = Instant::now();
        // Warm-up: a cold first call (not counted), then a run of each mode.
        assert!(!t.choose(0, 1 << 20, t0));
        t.record(0, 1 << 20, false, 5e-3);
        for i in 1..WARMUP {
            let nt = t.choose(0, 1 << 20, t0);
            assert_eq!(nt, ((i - 1) / PROBE_CALLS) % 2 == 1);
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
        assert!(probes <= PROBE_CALLS, "{probes} probe calls in 100 ms");
        // The machine changes: cached becomes 7x slower; the tuner moves to streaming.
        let mut streaming = 0;
        for i in 0..200 {
            let now = t0 + Duration::from_millis(100 + i);
            let nt = t.choose(0, 1 << 20, now);
            t.record(0, 1 << 20, nt, if nt { 140e-6 } else { 440e-6 });
            streaming += nt as usize;
        }
        // (Each slow call counts at most OUTLIER times the estimate: the move takes about 8 calls.)
        assert!(streaming >= 180, "{streaming} of 200 calls streamed");
        // Classes are independent.
        assert!(!t.choose(1, 1 << 20, t0));
        assert!(!t.choose(0, 1 << 26, t0));
    }

    #[test]
    fn probes_cost_a_bounded_share() {
        let mut t = Tuner::streaming_stores(StageMode::Auto);
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
        assert!(
            spent_probing / clock < 0.03,
            "probing took {:.1} % of the time",
            100.0 * spent_probing / clock
        );
    }

    /// Rank 0 records a call when the next one begins, after choosing for that one: the choice
    /// still settles on the faster way, and follows a change of conditions through the probes.
    #[test]
    fn lagged_records_pick_the_faster_way_and_follow_a_change() {
        let mut t = Tuner::cma_path(SingleCopyMode::Auto);
        let t0 = Instant::now();
        let (mut clock, mut last): (f64, Option<bool>) = (0.0, None);
        let mut run = |t: &mut Tuner, calls: usize, cost: &dyn Fn(bool) -> f64| {
            let mut singles = 0;
            for _ in 0..calls {
                let pick = t.choose(1, 256 << 10, t0 + Duration::from_secs_f64(clock));
                if let Some(prev) = last {
                    t.record(1, 256 << 10, prev, cost(prev));
                }
                clock += cost(pick);
                last = Some(pick);
                singles += pick as usize;
            }
            singles
        };
        // Staging faster: after the warm-up only the probes copy once.
        let staged_faster = |single: bool| if single { 30e-6 } else { 15e-6 };
        run(&mut t, 20, &staged_faster);
        let singles = run(&mut t, 20_000, &staged_faster);
        assert!(
            singles <= 2 * PROBE_CALLS as usize,
            "{singles} of 20000 calls took the slower single copy"
        );
        // Then the single copy gets faster: a probe finds it and the choice follows.
        let single_faster = |single: bool| if single { 10e-6 } else { 15e-6 };
        run(&mut t, 50_000, &single_faster);
        let singles = run(&mut t, 20_000, &single_faster);
        assert!(
            singles >= 19_990,
            "only {singles} of 20000 calls took the faster single copy"
        );
    }

    /// The path tuner counts a staged call only in the staging mode that has settled: none
    /// during the staging tuner's warm-up, then only the faster mode's, and a fixed mode at once.
    #[test]
    fn settled_only_after_the_warm_up_and_only_the_faster_mode() {
        let mut t = Tuner::streaming_stores(StageMode::Auto);
        let t0 = Instant::now();
        for _ in 0..WARMUP {
            let nt = t.choose(3, 1 << 20, t0);
            assert!(!t.settled_on(3, 1 << 20, nt), "settled during the warm-up");
            t.record(3, 1 << 20, nt, if nt { 90e-6 } else { 45e-6 });
        }
        let nt = t.choose(3, 1 << 20, t0);
        assert!(!nt, "cached stores were faster");
        assert!(t.settled_on(3, 1 << 20, false));
        assert!(
            !t.settled_on(3, 1 << 20, true),
            "a probe of the slower mode is not settled"
        );
        assert!(
            !t.settled_on(3, 4 << 20, false),
            "another class has its own warm-up"
        );
        let fixed = Tuner::streaming_stores(StageMode::Streaming);
        assert!(fixed.settled_on(3, 1 << 20, true) && !fixed.settled_on(3, 1 << 20, false));
    }

    #[test]
    fn fixed_modes_never_probe() {
        let mut t = Tuner::cma_path(SingleCopyMode::Always);
        assert!((0..10).all(|_| t.choose(1, 1 << 20, Instant::now())));
        assert!(t.guess(1, 1 << 20));
        let mut t = Tuner::cma_path(SingleCopyMode::Never);
        assert!((0..10).all(|_| !t.choose(1, 1 << 20, Instant::now())));
        assert_eq!(
            SingleCopyMode::parse("always"),
            Some(SingleCopyMode::Always)
        );
        assert_eq!(SingleCopyMode::parse("sometimes"), None);
        let mut t = Tuner::streaming_stores(StageMode::Streaming);
        assert!((0..10).all(|_| t.choose(0, 4096, Instant::now())));
        let mut t = Tuner::streaming_stores(StageMode::Cached);
        assert!((0..10).all(|_| !t.choose(0, 4096, Instant::now())));
        assert_eq!(StageMode::parse("streaming"), Some(StageMode::Streaming));
        assert_eq!(StageMode::parse("bogus"), None);
    }
}
