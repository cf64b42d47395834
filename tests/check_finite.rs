//! The finite check (`ShmConfig::check_finite`, `LOCKSTEP_CHECK_FINITE=1`): a NaN or an
//! infinity in any rank's input to all_reduce, reduce or reduce_scatter fails the call on every
//! rank with the same `CommError::NonFinite`, naming the first such element (lowest index, then
//! lowest rank), on every shared-memory path (inline, one-phase, slots, registered, CMA, forced
//! by sizes and settings), for every op and float dtype; the communicator works afterwards; with
//! the check off the same calls succeed and the NaN propagates.
//!
//! `harness = false`: the process forks (the fork launcher), so it stays single-threaded.

#[path = "common/runner.rs"]
mod runner;

use std::time::Duration;

use half::{bf16, f16};
use lockstep::comm::{CollKind, CommError, Communicator, Dtype, Element, NonFiniteKind, ReduceOp};
use lockstep::launch::{launch, LaunchConfig, RankContext, RankResult};
use lockstep::shm::SingleCopyMode;

trait Elem: Element {
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
}

impl Elem for f32 {
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
}
impl Elem for f64 {
    fn from_f64(v: f64) -> Self {
        v
    }
    fn to_f64(self) -> f64 {
        self
    }
}
impl Elem for f16 {
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
}
impl Elem for bf16 {
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
}

/// How a case passes its buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bufs {
    /// Ordinary vectors, send and recv apart.
    Plain,
    /// Both in the shared heap (`alloc_shared`): the registered path above the one-phase size.
    Shared,
    /// One ordinary vector, in place.
    InPlace,
}

/// One run's settings: the paths its sizes reach.
#[derive(Clone, Copy, Debug)]
struct Setup {
    name: &'static str,
    /// Message sizes in bytes (per rank's input for all_reduce/reduce; the whole input for
    /// reduce_scatter).
    sizes: &'static [usize],
    bufs: &'static [Bufs],
    /// CMA forced where the sizes allow (all_reduce and reduce_scatter).
    cma: bool,
}

fn launch_cfg(n: usize, s: &Setup, check: bool) -> LaunchConfig {
    let mut cfg = LaunchConfig::new(n);
    // Inline up to 64 bytes, one-phase up to 2 KiB, slots of 8 KiB: several rounds from 40 KB.
    cfg.shm.fast_bytes = 64;
    cfg.shm.small_bytes = 2048;
    cfg.shm.slot_bytes = 8192;
    cfg.shm.heap_bytes = 64 << 20;
    cfg.shm.nt_bytes = 16 << 10;
    cfg.shm.timeout = Duration::from_secs(60);
    if s.cma {
        cfg.shm.cma_bytes = 4096;
        cfg.shm.single_copy = SingleCopyMode::Always;
    } else {
        cfg.shm.cma_bytes = 0;
        cfg.shm.single_copy = SingleCopyMode::Never;
    }
    cfg.shm.check_finite = check;
    cfg.shm = cfg.shm.clone().normalized();
    cfg
}

const KINDS: [CollKind; 3] = [
    CollKind::AllReduce,
    CollKind::Reduce,
    CollKind::ReduceScatter,
];

/// The non-finite values each case places: (rank, element of its input, value).
fn placements(case: usize, n: usize, len: usize, salt: usize) -> Vec<(usize, usize, f64)> {
    match case {
        // One NaN near the end (the last round of a chunked path), on a rank that varies.
        0 => vec![(salt % n, len - 1, f64::NAN)],
        // Two ranks: the lower element wins, though its rank is higher.
        1 => vec![
            (n - 1, len / 3, f64::INFINITY),
            (0, (2 * len / 3).max(len / 3 + 1).min(len - 1), f64::NAN),
        ],
        // One element on two ranks: the lower rank wins.
        _ => vec![
            ((n > 1) as usize, len / 2, f64::NAN),
            (0, len / 2, f64::NEG_INFINITY),
        ],
    }
}

fn classify(v: f64) -> NonFiniteKind {
    if v.is_nan() {
        NonFiniteKind::NaN
    } else if v > 0.0 {
        NonFiniteKind::PosInf
    } else {
        NonFiniteKind::NegInf
    }
}

/// Run `kind` on `send` (this rank's input of `len` elements) with `bufs`; returns the call's
/// result and this rank's output.
fn call<T: Elem>(
    c: &mut Communicator,
    kind: CollKind,
    op: ReduceOp,
    bufs: Bufs,
    send: &[T],
    root: usize,
) -> Result<(Result<(), CommError>, Vec<T>), CommError> {
    let n = c.world_size();
    let out = if kind == CollKind::ReduceScatter {
        send.len() / n
    } else {
        send.len()
    };
    let me = c.rank();
    Ok(match bufs {
        Bufs::Plain => {
            let mut recv = vec![T::default(); out];
            let r = match kind {
                CollKind::AllReduce => c.all_reduce(send, &mut recv[..], op),
                CollKind::Reduce => c.reduce(send, &mut recv[..], op, root),
                _ => c.reduce_scatter(send, &mut recv[..], op),
            };
            (r, recv)
        }
        Bufs::Shared => {
            let mut s = c.alloc_shared::<T>(send.len())?;
            s.copy_from_slice(send);
            let mut recv = c.alloc_shared::<T>(out)?;
            let r = match kind {
                CollKind::AllReduce => c.all_reduce(&s, &mut recv, op),
                CollKind::Reduce => c.reduce(&s, &mut recv, op, root),
                _ => c.reduce_scatter(&s, &mut recv, op),
            };
            (r, recv.to_vec())
        }
        Bufs::InPlace => {
            let mut b = send.to_vec();
            let r = match kind {
                CollKind::AllReduce => c.all_reduce_in_place(&mut b[..], op),
                CollKind::Reduce => c.reduce_in_place(&mut b[..], op, root),
                _ => c.reduce_scatter_in_place(&mut b[..], op),
            };
            let out = if kind == CollKind::ReduceScatter {
                b[me * out..(me + 1) * out].to_vec()
            } else {
                b
            };
            (r, out)
        }
    })
}

/// Every kind, op, size and buffer kind of `s` for dtype `T`, with the check on: each placement
/// is reported exactly on this rank, and a clean call right after succeeds with the right result.
/// Returns one line per failed call (the error's text), which the ranks must agree on.
fn checked_cases<T: Elem>(c: &mut Communicator, s: &Setup) -> Result<Vec<String>, String> {
    let (n, me) = (c.world_size(), c.rank());
    let esz = std::mem::size_of::<T>();
    let mut log = Vec::new();
    let mut salt = 0;
    for kind in KINDS {
        for op in ReduceOp::ALL {
            for &bytes in s.sizes {
                for &bufs in s.bufs {
                    let rs = kind == CollKind::ReduceScatter;
                    let count = if rs {
                        (bytes / esz / n).max(1)
                    } else {
                        (bytes / esz).max(1)
                    };
                    let len = if rs { n * count } else { count };
                    let root = n - 1;
                    for case in 0..3 {
                        salt += 1;
                        let places = placements(case, n, len, salt);
                        let (want_e, want_r) = places.iter().map(|p| (p.1, p.0)).min().unwrap();
                        let want_v = places
                            .iter()
                            .rev()
                            .find(|p| (p.1, p.0) == (want_e, want_r))
                            .unwrap()
                            .2;
                        let mut send = vec![T::from_f64(1.0); len];
                        for &(r, e, v) in &places {
                            if r == me {
                                send[e] = T::from_f64(v);
                            }
                        }
                        let what = format!(
                            "{} {kind} {op} {bytes} B {bufs:?} case {case} ({} {})",
                            T::DTYPE,
                            s.name,
                            n
                        );
                        let (r, _) = call(c, kind, op, bufs, &send, root)
                            .map_err(|e| format!("{what}: setup: {e}"))?;
                        let seq = c.seq();
                        match r {
                            Err(CommError::NonFinite {
                                rank,
                                seq: s2,
                                kind: k,
                                op: o,
                                element,
                                dtype,
                                count: cnt,
                            }) if rank == want_r
                                && s2 == seq
                                && k == classify(want_v)
                                && o == kind
                                && element == want_e
                                && dtype == T::DTYPE
                                && cnt == len =>
                            {
                                log.push(
                                    format!("{rank} {s2} {k} {o} {element} {dtype} {cnt}"),
                                );
                            }
                            other => {
                                return Err(format!(
                                    "{what}: expected rank {want_r} {} at element {want_e} of #{seq}, got {other:?}",
                                    classify(want_v)
                                ))
                            }
                        }
                        if case != 0 {
                            continue;
                        }
                        // Still usable: the same call on finite data.
                        let clean = vec![T::from_f64(1.0); len];
                        let (r, out) = call(c, kind, op, bufs, &clean, root)
                            .map_err(|e| format!("{what}: setup: {e}"))?;
                        r.map_err(|e| format!("{what}: the clean call after failed: {e}"))?;
                        let want = if op == ReduceOp::Sum { n as f64 } else { 1.0 };
                        let receives = kind != CollKind::Reduce || me == root;
                        if receives && out.iter().any(|v| v.to_f64() != want) {
                            return Err(format!("{what}: the clean call after gave wrong data"));
                        }
                    }
                }
            }
        }
    }
    Ok(log)
}

/// With the check off: the same placements succeed, and a NaN in a sum reaches the output.
fn unchecked_cases<T: Elem>(c: &mut Communicator, s: &Setup) -> Result<(), String> {
    let (n, me) = (c.world_size(), c.rank());
    let esz = std::mem::size_of::<T>();
    for &bytes in s.sizes {
        for &bufs in s.bufs {
            let count = (bytes / esz).max(1);
            let mut send = vec![T::from_f64(1.0); count];
            if me == n - 1 {
                send[count - 1] = T::from_f64(f64::NAN);
            }
            let what = format!("{} {bytes} B {bufs:?} ({})", T::DTYPE, s.name);
            let (r, out) = call(c, CollKind::AllReduce, ReduceOp::Sum, bufs, &send, 0)
                .map_err(|e| format!("{what}: setup: {e}"))?;
            r.map_err(|e| format!("{what}: check off, the call failed: {e}"))?;
            if !out[count - 1].to_f64().is_nan() || out[0].to_f64() != n as f64 {
                return Err(format!(
                    "{what}: check off, the NaN did not propagate alone"
                ));
            }
        }
    }
    Ok(())
}

fn run_setup(n: usize, s: Setup) -> Result<(), String> {
    let logs = launch(
        &launch_cfg(n, &s, true),
        |mut ctx: RankContext| -> RankResult<Vec<String>> {
            let c = &mut ctx.comm;
            let mut log = checked_cases::<f32>(c, &s)?;
            log.extend(checked_cases::<f64>(c, &s)?);
            log.extend(checked_cases::<f16>(c, &s)?);
            log.extend(checked_cases::<bf16>(c, &s)?);
            // Integers have no non-finite values: a reduction runs as without the check.
            let mut x = vec![c.rank() as i32; 1000];
            c.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
            let want = (0..c.world_size() as i32).sum::<i32>();
            if x.iter().any(|v| *v != want) {
                return Err("i32 all_reduce under the check: wrong sum".into());
            }
            Ok(log)
        },
    )
    .map_err(|e| format!("{} world {n}, check on: {e}", s.name))?;
    if logs.iter().any(|l| *l != logs[0]) {
        return Err(format!(
            "{} world {n}: the ranks reported different errors",
            s.name
        ));
    }
    launch(
        &launch_cfg(n, &s, false),
        |mut ctx: RankContext| -> RankResult<()> {
            let c = &mut ctx.comm;
            unchecked_cases::<f32>(c, &s)?;
            unchecked_cases::<f64>(c, &s)?;
            unchecked_cases::<f16>(c, &s)?;
            unchecked_cases::<bf16>(c, &s)?;
            Ok(())
        },
    )
    .map_err(|e| format!("{} world {n}, check off: {e}", s.name))?;
    Ok(())
}

/// Inline (40 B), one-phase (1.5 KB) and slots (40 KB, several rounds), out of place and in
/// place.
const STAGED: Setup = Setup {
    name: "inline, one-phase, slots",
    sizes: &[40, 1500, 40_000],
    bufs: &[Bufs::Plain, Bufs::InPlace],
    cma: false,
};

/// Buffers in the shared heap: the registered path (above the one-phase size).
const REGISTERED: Setup = Setup {
    name: "registered",
    sizes: &[40_000],
    bufs: &[Bufs::Shared],
    cma: false,
};

/// Cross-memory attach forced (all_reduce and reduce_scatter; reduce takes the slots).
const CMA: Setup = Setup {
    name: "cma",
    sizes: &[9000, 40_000],
    bufs: &[Bufs::Plain, Bufs::InPlace],
    cma: true,
};

fn t_staged_1() -> Result<(), String> {
    run_setup(1, STAGED)
}

fn t_staged_2() -> Result<(), String> {
    run_setup(2, STAGED)
}

fn t_staged_3() -> Result<(), String> {
    run_setup(3, STAGED)
}

fn t_registered() -> Result<(), String> {
    run_setup(2, REGISTERED)?;
    run_setup(3, REGISTERED)
}

fn t_cma() -> Result<(), String> {
    run_setup(2, CMA)?;
    run_setup(3, CMA)
}

/// `Communicator::set_check_finite`: a job started without the check turns it on and off on
/// every rank between calls (inline, one-phase and slots sizes); a rank that turns it on alone
/// makes the next call fail on every rank with a mismatch naming the check, and the ranks go on
/// once they agree again.
fn t_toggled() -> Result<(), String> {
    let n = 3;
    launch(
        &launch_cfg(n, &STAGED, false),
        |mut ctx: RankContext| -> RankResult<()> {
            let c = &mut ctx.comm;
            let me = c.rank();
            if c.check_finite() {
                return Err("the check is on in a job started without it".into());
            }
            for &bytes in STAGED.sizes {
                let count = bytes / 4;
                let mut send = vec![1f32; count];
                if me == 1 {
                    send[count / 2] = f32::NAN;
                }
                let mut recv = vec![0f32; count];
                c.set_check_finite(true)?;
                if !c.check_finite() {
                    return Err("set_check_finite(true) left the check off".into());
                }
                let seq = c.seq() + 1;
                match c.all_reduce(&send, &mut recv, ReduceOp::Sum) {
                    Err(CommError::NonFinite {
                        rank: 1,
                        seq: s,
                        element,
                        ..
                    }) if s == seq && element == count / 2 => {}
                    other => {
                        return Err(format!(
                            "{bytes} B, check turned on: expected rank 1's NaN at element {} of #{seq}, got {other:?}",
                            count / 2
                        )
                        .into())
                    }
                }
                c.set_check_finite(false)?;
                c.all_reduce(&send, &mut recv, ReduceOp::Sum)
                    .map_err(|e| format!("{bytes} B, check turned off: {e}"))?;
                if !recv[count / 2].is_nan() || recv[0] != n as f32 {
                    return Err(format!(
                        "{bytes} B, check turned off: the NaN did not propagate alone"
                    )
                    .into());
                }
                // Rank 2 alone: every rank fails the call, naming the check, and nobody hangs.
                c.set_check_finite(me == 2)?;
                match c.all_reduce(&send, &mut recv, ReduceOp::Sum) {
                    Err(CommError::Mismatch { detail, .. })
                        if detail.contains("the finite check")
                            && detail.contains("on on rank 2") => {}
                    other => {
                        return Err(format!(
                            "{bytes} B, check on rank 2 only: expected a mismatch naming it, got {other:?}"
                        )
                        .into())
                    }
                }
                c.set_check_finite(false)?;
                let clean = vec![1f32; count];
                c.all_reduce(&clean, &mut recv, ReduceOp::Sum)
                    .map_err(|e| format!("{bytes} B, after the mismatch: {e}"))?;
                if recv.iter().any(|v| *v != n as f32) {
                    return Err(format!("{bytes} B, after the mismatch: wrong sum").into());
                }
            }
            Ok(())
        },
    )
    .map(|_| ())
    .map_err(|e| format!("toggled, world {n}: {e}"))
}

/// A named test body.
type TestFn = fn() -> Result<(), String>;

fn main() -> std::process::ExitCode {
    let _ = Dtype::ALL;
    let tests: Vec<(&str, TestFn)> = vec![
        ("staged_1", t_staged_1),
        ("staged_2", t_staged_2),
        ("staged_3", t_staged_3),
        ("registered", t_registered),
        ("cma", t_cma),
        ("toggled", t_toggled),
    ];
    runner::run(&tests)
}
