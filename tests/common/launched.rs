//! Helpers of the tests that run their ranks through the fork launcher on the shared-memory
//! backend (`shm_collectives`, `shm_p2p`, `shm_split`; `shm_faults` for [`cpu_time`]): test
//! values exact in every dtype, the small-slot launch configuration, and the checks of what the
//! ranks report (failure lists, errors every rank must give, a rank that died and the survivors
//! that must name it).
//!
//! Included on its own (`#[path = "common/launched.rs"] mod launched;`), as `runner.rs` is.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use half::{bf16, f16};
use lockstep::comm::{CommError, Communicator, Element, ReduceOp};
use lockstep::launch::{LaunchConfig, LaunchError, RankResult};

/// An element the tests fill with small integers (exact in every dtype) and read back as f64.
pub trait TestElem: Element + PartialEq {
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
}

// The primitive numbers convert with `as`, ...
macro_rules! test_elem_num {
    ($($t:ty),*) => {$(
        impl TestElem for $t {
            fn from_f64(v: f64) -> Self { v as $t }
            fn to_f64(self) -> f64 { self as f64 }
        }
    )*};
}
test_elem_num!(f32, f64, i32, i64, u8, i8, u32, u64);

// ... the 16-bit floats with their own conversions.
macro_rules! test_elem_half {
    ($($t:ty),*) => {$(
        impl TestElem for $t {
            fn from_f64(v: f64) -> Self { <$t>::from_f64(v) }
            fn to_f64(self) -> f64 { <$t>::to_f64(self) }
        }
    )*};
}
test_elem_half!(f16, bf16);

/// `n` ranks with small staging slots (8 KiB) and a 1 KiB one-phase threshold, so that small
/// inputs already take the chunked paths and run many rounds; a heap of `heap_bytes` and a
/// `timeout` after which a hang shows as a failure, not a stuck test.
pub fn small_slots(n: usize, heap_bytes: usize, timeout: Duration) -> LaunchConfig {
    let mut cfg = LaunchConfig::new(n);
    cfg.shm.slot_bytes = 8192;
    cfg.shm.small_bytes = 1024;
    cfg.shm.heap_bytes = heap_bytes;
    cfg.shm.timeout = timeout;
    cfg.shm = cfg.shm.clone().normalized();
    cfg
}

/// Every rank's list of failures (`out[r]` for rank `r`): `Ok` when all are empty, else each
/// failure under `context`, naming its rank.
pub fn no_failures(context: &str, out: Vec<Vec<String>>) -> Result<(), String> {
    let bad: Vec<String> = out
        .into_iter()
        .enumerate()
        .flat_map(|(r, b)| {
            b.into_iter()
                .map(move |m| format!("{context}rank {r}: {m}"))
        })
        .collect();
    if bad.is_empty() {
        Ok(())
    } else {
        Err(bad.join("\n"))
    }
}

/// Every rank returned an error message (as its result) that holds every one of its needles:
/// `needles[r]` for rank `r`, the last list serving the ranks after it.
pub fn expect_all_err(
    res: Result<Vec<String>, LaunchError>,
    needles: &[&[&str]],
) -> Result<(), String> {
    let msgs = res.map_err(|e| format!("ranks failed instead of returning errors: {e}"))?;
    for (r, m) in msgs.iter().enumerate() {
        for n in needles[r.min(needles.len() - 1)] {
            if !m.contains(n) {
                return Err(format!("rank {r}'s error lacks '{n}': {m}"));
            }
        }
    }
    Ok(())
}

/// A case of a mismatch test: its name and the needles of [`expect_all_err`].
pub type Case = (&'static str, &'static [&'static [&'static str]]);

/// Each of `cases` in a launch of `cfg`: every rank makes its call of the case (`call(case,
/// rank, comm)`, which returns the rank's error message), all the messages must hold the case's
/// needles, and the communicator must still work ([`still_usable`] with `usable_len` elements).
pub fn mismatch_cases(
    cfg: &LaunchConfig,
    cases: &[Case],
    usable_len: usize,
    call: impl Fn(&str, usize, &mut Communicator) -> RankResult<String>,
) -> Result<(), String> {
    for (case, needles) in cases {
        let res = lockstep::launch::launch(cfg, |mut ctx| -> RankResult<String> {
            let msg = call(case, ctx.rank, &mut ctx.comm)?;
            still_usable(&mut ctx.comm, usable_len)?;
            Ok(msg)
        });
        expect_all_err(res, needles).map_err(|e| format!("case {case}: {e}"))?;
    }
    Ok(())
}

/// The message of the mismatch error that `r` must be; any other outcome is this rank's failure.
pub fn mismatch_message(r: Result<(), CommError>) -> RankResult<String> {
    match r {
        Err(e @ CommError::Mismatch { .. }) => Ok(e.to_string()),
        other => Err(format!("expected a mismatch error, got {other:?}").into()),
    }
}

/// After a mismatch the communicator still works: an all-reduce of `len` elements of rank + 1
/// gives n(n+1)/2 everywhere.
pub fn still_usable(c: &mut Communicator, len: usize) -> RankResult<()> {
    let (me, n) = (c.rank(), c.world_size());
    let mut z = vec![me as f32 + 1.0; len];
    c.all_reduce_in_place(&mut z, ReduceOp::Sum)?;
    if z.iter().any(|v| *v != (n * (n + 1) / 2) as f32) {
        return Err("communicator unusable after mismatch".into());
    }
    Ok(())
}

/// An all-reduce (sum) of `x` that must fail (a peer is late or gone): its error, and how long
/// it took.
pub fn failing_all_reduce(
    c: &mut Communicator,
    x: &mut [f32],
) -> RankResult<(CommError, Duration)> {
    let t = Instant::now();
    let e = c
        .all_reduce_in_place(x, ReduceOp::Sum)
        .err()
        .ok_or("all_reduce passed")?;
    Ok((e, t.elapsed()))
}

/// A survivor's verdict on the error `e` that rank `dead`'s death gave it `took` after its last
/// good call: it must come within 1 s and name the dead rank. Passing, the survivor still fails
/// on purpose (`OK-SURVIVOR ...`), so that its message comes back through the launcher's failure
/// list for [`survivors_reported`].
pub fn survivor_verdict<T>(e: CommError, dead: usize, took: Duration) -> RankResult<T> {
    if took > Duration::from_secs(1) {
        return Err(format!("detection took {took:?}").into());
    }
    let msg = e.to_string();
    if !msg.contains(&format!("rank {dead} (pid")) || !msg.contains("died") {
        return Err(format!("error does not name the dead rank: {e}").into());
    }
    Err(format!("OK-SURVIVOR {e}").into())
}

/// The outcome of a launch in which rank `aborted` (when given) died of SIGABRT and each of
/// `survivors` reported the death with an `OK-SURVIVOR` error.
pub fn survivors_reported(
    res: Result<Vec<String>, LaunchError>,
    aborted: Option<usize>,
    survivors: impl IntoIterator<Item = usize>,
) -> Result<(), String> {
    let f = match res {
        Err(LaunchError::RanksFailed(f)) => f,
        other => return Err(format!("unexpected outcome {other:?}")),
    };
    if let Some(dead) = aborted {
        if !f
            .iter()
            .any(|x| x.rank == dead && x.exit_code == 128 + libc::SIGABRT)
        {
            return Err(format!("rank {dead} should have died of SIGABRT: {f:?}"));
        }
    }
    for s in survivors {
        if !f
            .iter()
            .any(|x| x.rank == s && x.message.starts_with("OK-SURVIVOR"))
        {
            return Err(format!(
                "survivor rank {s} did not report the dead peer properly: {f:?}"
            ));
        }
    }
    Ok(())
}

/// This process's CPU time (user + system), in seconds.
pub fn cpu_time() -> f64 {
    // SAFETY: zeroed rusage is a valid out-parameter.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-parameter.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    ru.ru_utime.tv_sec as f64
        + ru.ru_utime.tv_usec as f64 * 1e-6
        + ru.ru_stime.tv_sec as f64
        + ru.ru_stime.tv_usec as f64 * 1e-6
}
