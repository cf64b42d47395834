//! The recorder's clock: the CPU's time-stamp counter where the kernel itself keeps time with it,
//! else the monotonic clock.
//!
//! A recorded call's start and end are read on the call's own path, so the read must be cheap
//! where it stands: `clock_gettime` goes through the vDSO's shared page, which the timer
//! interrupt rewrites, and costs a miss there as often as not, where `rdtsc` reads a register.
//! Ticks are turned into nanoseconds only when records are read: by the ratio of monotonic time
//! to ticks elapsed since the clock was made, measured at that moment, so a time between the
//! two ends is off by no more than the two ends' reads (the counter runs at a constant rate when
//! the kernel uses it as its clocksource: invariant, and the same on every CPU).

use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Where the kernel names the clocksource it keeps time with.
const CLOCKSOURCE: &str = "/sys/devices/system/clocksource/clocksource0/current_clocksource";

/// Whether the time-stamp counter is what the kernel keeps time with (read once per process).
fn tsc_usable() -> bool {
    static USABLE: OnceLock<bool> = OnceLock::new();
    *USABLE.get_or_init(|| {
        cfg!(target_arch = "x86_64")
            && std::fs::read_to_string(CLOCKSOURCE).is_ok_and(|s| s.trim() == "tsc")
    })
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn read_tsc() -> u64 {
    // SAFETY: `rdtsc` has no preconditions: it reads the time-stamp counter, which every x86_64
    // CPU has; the intrinsic is unsafe only as every `core::arch` function is.
    unsafe { core::arch::x86_64::_rdtsc() }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
fn read_tsc() -> u64 {
    0
}

/// Nanoseconds as a `u64` (saturating: 584 years).
pub(crate) fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// A clock whose zero is when it was made (see the module docs).
#[derive(Debug)]
pub(crate) struct Clock {
    base: Instant,
    /// The counter at `base`, when the counter is used.
    tsc_base: Option<u64>,
}

/// How a [`Clock`]'s ticks turn into nanoseconds, measured by [`Clock::scale`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Scale {
    ns: u64,
    ticks: u64,
}

impl Clock {
    pub(crate) fn new() -> Clock {
        let tsc_base = tsc_usable().then(read_tsc);
        Clock {
            base: Instant::now(),
            tsc_base,
        }
    }

    /// Ticks since the clock was made.
    #[inline(always)]
    pub(crate) fn ticks(&self) -> u64 {
        match self.tsc_base {
            Some(b) => read_tsc().wrapping_sub(b),
            None => ns(self.base.elapsed()),
        }
    }

    /// The ratio of nanoseconds to ticks since the clock was made, as of now.
    pub(crate) fn scale(&self) -> Scale {
        match self.tsc_base {
            Some(b) => {
                let ticks = read_tsc().wrapping_sub(b);
                Scale {
                    ns: ns(self.base.elapsed()),
                    ticks,
                }
            }
            None => Scale { ns: 1, ticks: 1 },
        }
    }
}

impl Scale {
    /// `ticks` as nanoseconds since the clock was made.
    pub(crate) fn ns(&self, ticks: u64) -> u64 {
        if self.ticks == 0 {
            return ticks;
        }
        let v = ticks as u128 * self.ns as u128 / self.ticks as u128;
        u64::try_from(v).unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_read_back_as_the_monotonic_clock_does() {
        let c = Clock::new();
        let t0 = Instant::now();
        let a = c.ticks();
        std::thread::sleep(Duration::from_millis(30));
        let b = c.ticks();
        let took = ns(t0.elapsed());
        std::thread::sleep(Duration::from_millis(5));
        let s = c.scale();
        let (a, b) = (s.ns(a), s.ns(b));
        assert!(b > a);
        // Between the two reads: at least the sleep, at most the whole measured span.
        assert!(
            b - a >= 30_000_000 && b - a <= took + 1_000_000,
            "{a} {b} {took}"
        );
        // Converted times never run backwards.
        let mut last = 0;
        for _ in 0..1000 {
            let t = s.ns(c.ticks());
            assert!(t >= last);
            last = t;
        }
    }
}
