//! Multi-process tests of the shared-memory backend, through the fork launcher.
//!
//! `harness = false`: the process forks, so it stays single-threaded; each test runs in turn and
//! the binary ends with `N passed, M failed`.

#[path = "common/launched.rs"]
mod launched;
#[path = "common/runner.rs"]
mod runner;

use std::time::{Duration, Instant};

use half::{bf16, f16};
use launched::{
    cpu_time, failing_all_reduce, mismatch_cases, mismatch_message, no_failures, small_slots,
    survivor_verdict, survivors_reported, Case, TestElem,
};
use lockstep::comm::{CollKind, CommError, Communicator, Dtype, Element, ReduceOp};
use lockstep::launch::{launch, LaunchConfig, RankContext, RankResult};
use lockstep::shm::{ShmComm, ShmConfig, SingleCopyMode, StageMode};

// -------------------------------------------------------------------------------------------------
// Test values with exact references

/// Input of `rank` at index `i` for `op`: small integers, so every reference is exact in every
/// dtype (for prod: a single 2 per index among ranks, so the product is exactly 2).
fn value(op: ReduceOp, rank: usize, i: usize, n: usize) -> f64 {
    match op {
        ReduceOp::Prod => {
            if i % n == rank {
                2.0
            } else {
                1.0
            }
        }
        _ => ((rank * 3 + i * 7 + i / 5) % 9) as f64,
    }
}

fn reference(op: ReduceOp, i: usize, n: usize, dtype: Dtype) -> f64 {
    let vals: Vec<f64> = (0..n).map(|r| value(op, r, i, n)).collect();
    match op {
        ReduceOp::Sum => vals.iter().sum(),
        ReduceOp::Prod => vals.iter().product(),
        ReduceOp::Min => vals.iter().cloned().fold(f64::INFINITY, f64::min),
        ReduceOp::Max => vals.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
        ReduceOp::Avg => {
            let s: f64 = vals.iter().sum();
            if dtype.is_float() {
                s / n as f64
            } else {
                (s as i64 / n as i64) as f64
            }
        }
        other => panic!("no reference for {other}: add it here"),
    }
}

fn close(got: f64, want: f64, dtype: Dtype) -> bool {
    let tol = match dtype {
        Dtype::F16 | Dtype::BF16 => 1e-2 * want.abs().max(1.0),
        Dtype::F32 => 1e-6 * want.abs().max(1.0),
        _ => 0.0,
    };
    (got - want).abs() <= tol
}

fn input<T: TestElem>(op: ReduceOp, rank: usize, n: usize, len: usize, offset: usize) -> Vec<T> {
    (0..len)
        .map(|i| T::from_f64(value(op, rank, i + offset, n)))
        .collect()
}

/// Sizes that hit every path: empty, tiny, around the world size, around the small-path threshold
/// and around the staging chunk boundary of the given config.
fn sizes(n: usize, esz: usize, cfg: &ShmConfig) -> Vec<usize> {
    // The slot as the backend sizes it (at least 4 KiB per peer).
    let cfg = &cfg.clone().normalized_for(n);
    let small = cfg.small_bytes / esz;
    let unit = (64 / esz).max(1);
    let chunk = if n > 1 {
        (cfg.slot_bytes / (n - 1) / esz) / unit * unit * n
    } else {
        cfg.slot_bytes / esz
    };
    let mut v = vec![
        0,
        1,
        7,
        n.saturating_sub(1),
        n + 1,
        small,
        small + 1,
        chunk - 1,
        chunk + 1,
        2 * chunk + 3,
    ];
    // Around the single-copy threshold, when a test lowers it to a size the other tests can
    // afford (per-rank bytes: the block of all_gather and reduce_scatter, the whole message of
    // broadcast and all_reduce).
    if cfg.cma_bytes > 0 && cfg.cma_bytes <= 8192 {
        let t = cfg.cma_bytes / esz;
        v.extend([t - 1, t, t + 1, 3 * t + 7]);
    }
    v.sort();
    v.dedup();
    v
}

/// Run every collective with every op on dtype T and check the results; returns failure messages.
fn check_dtype<T: TestElem>(
    comm: &mut Communicator,
    cfg: &ShmConfig,
    shared: bool,
) -> Result<Vec<String>, CommError> {
    let (me, n) = (comm.rank(), comm.world_size());
    let dt = T::DTYPE;
    let mut bad = Vec::new();
    let mut fail = |what: String| {
        if bad.len() < 5 {
            bad.push(what)
        }
    };
    let buf = |comm: &mut Communicator, data: Vec<T>| buffer(comm, shared, data);
    let root = n - 1;
    for len in sizes(n, dt.size(), cfg) {
        for op in ReduceOp::ALL {
            // all_reduce, out of place and in place.
            let send = buf(comm, input::<T>(op, me, n, len, 0))?;
            let mut recv = buf(comm, vec![T::default(); len])?;
            comm.all_reduce(send.slice(), recv.slice_mut(), op)?;
            if let Some(i) =
                (0..len).find(|&i| !close(recv.slice()[i].to_f64(), reference(op, i, n, dt), dt))
            {
                fail(format!(
                    "all_reduce {dt} {op} len {len} shared={shared}: [{i}] = {:?}, want {}",
                    recv.slice()[i],
                    reference(op, i, n, dt)
                ));
            }
            let mut inplace = buf(comm, input::<T>(op, me, n, len, 0))?;
            comm.all_reduce_in_place(inplace.slice_mut(), op)?;
            if inplace.slice() != recv.slice() {
                fail(format!("all_reduce_in_place {dt} {op} len {len} shared={shared} differs from out-of-place"));
            }
            // reduce to the last rank.
            let mut rrecv = buf(comm, vec![T::default(); if me == root { len } else { 0 }])?;
            comm.reduce(send.slice(), rrecv.slice_mut(), op, root)?;
            if me == root && rrecv.slice() != recv.slice() {
                fail(format!(
                    "reduce {dt} {op} len {len} shared={shared} differs from all_reduce"
                ));
            }
            // reduce_scatter: block r of the result.
            let rs_send = buf(comm, input::<T>(op, me, n, len * n, 0))?;
            let mut rs_recv = buf(comm, vec![T::default(); len])?;
            comm.reduce_scatter(rs_send.slice(), rs_recv.slice_mut(), op)?;
            if let Some(i) = (0..len).find(|&i| {
                !close(
                    rs_recv.slice()[i].to_f64(),
                    reference(op, me * len + i, n, dt),
                    dt,
                )
            }) {
                fail(format!(
                    "reduce_scatter {dt} {op} len {len} shared={shared}: [{i}] = {:?}, want {}",
                    rs_recv.slice()[i],
                    reference(op, me * len + i, n, dt)
                ));
            }
            let mut rs_in = buf(comm, input::<T>(op, me, n, len * n, 0))?;
            comm.reduce_scatter_in_place(rs_in.slice_mut(), op)?;
            if rs_in.slice()[me * len..(me + 1) * len] != *rs_recv.slice() {
                fail(format!(
                    "reduce_scatter_in_place {dt} {op} len {len} shared={shared} differs"
                ));
            }
        }
        // broadcast from the last rank.
        let mine = input::<T>(ReduceOp::Sum, me, n, len, 0);
        let want = input::<T>(ReduceOp::Sum, root, n, len, 0);
        let mut b = buf(comm, mine.clone())?;
        comm.broadcast_in_place(b.slice_mut(), root)?;
        if b.slice() != want.as_slice() {
            fail(format!("broadcast {dt} len {len} shared={shared} wrong"));
        }
        let src = buf(comm, mine.clone())?;
        let mut dst = buf(comm, vec![T::default(); len])?;
        comm.broadcast(src.slice(), dst.slice_mut(), root)?;
        if dst.slice() != want.as_slice() {
            fail(format!(
                "broadcast (out of place) {dt} len {len} shared={shared} wrong"
            ));
        }
        // all_gather and gather.
        let all: Vec<T> = (0..n)
            .flat_map(|r| input::<T>(ReduceOp::Sum, r, n, len, 0))
            .collect();
        let mut ag = buf(comm, vec![T::default(); len * n])?;
        comm.all_gather(src.slice(), ag.slice_mut())?;
        if ag.slice() != all.as_slice() {
            fail(format!("all_gather {dt} len {len} shared={shared} wrong"));
        }
        let mut agi = buf(comm, vec![T::default(); len * n])?;
        agi.slice_mut()[me * len..(me + 1) * len].copy_from_slice(&mine);
        comm.all_gather_in_place(agi.slice_mut())?;
        if agi.slice() != all.as_slice() {
            fail(format!(
                "all_gather_in_place {dt} len {len} shared={shared} wrong"
            ));
        }
        let mut g = buf(
            comm,
            vec![T::default(); if me == root { len * n } else { 0 }],
        )?;
        comm.gather(src.slice(), g.slice_mut(), root)?;
        if me == root && g.slice() != all.as_slice() {
            fail(format!("gather {dt} len {len} shared={shared} wrong"));
        }
    }
    comm.barrier()?;
    Ok(bad)
}

/// Vec and SharedBuffer behind one face.
trait BufLike<T: Element> {
    fn slice(&self) -> &[T];
    fn slice_mut(&mut self) -> &mut [T];
}
impl<T: Element> BufLike<T> for Vec<T> {
    fn slice(&self) -> &[T] {
        self
    }
    fn slice_mut(&mut self) -> &mut [T] {
        self
    }
}
impl<T: Element> BufLike<T> for lockstep::comm::SharedBuffer<T> {
    fn slice(&self) -> &[T] {
        self
    }
    fn slice_mut(&mut self) -> &mut [T] {
        self
    }
}

/// `data` as it is, or copied into a shared buffer of `comm`'s heap (`shared`).
fn buffer<T: Element>(
    comm: &mut Communicator,
    shared: bool,
    data: Vec<T>,
) -> Result<Box<dyn BufLike<T>>, CommError> {
    if shared {
        let mut b = comm.alloc_shared::<T>(data.len())?;
        b.copy_from_slice(&data);
        Ok(Box::new(b))
    } else {
        Ok(Box::new(data))
    }
}

fn small_cfg(n: usize) -> LaunchConfig {
    let mut cfg = small_slots(n, 64 << 20, Duration::from_secs(60));
    // Streaming stores from 2 KiB up, so the NT paths are exercised too.
    cfg.shm.nt_bytes = 2048;
    cfg
}

/// [`small_cfg`] for a job in which ranks fail or time out on purpose: no fail-fast (the others
/// must see it for themselves), and the rank timeout `timeout` where given.
fn failing_cfg(n: usize, timeout: Option<Duration>) -> LaunchConfig {
    let mut cfg = small_cfg(n);
    cfg.shm.timeout = timeout.unwrap_or(cfg.shm.timeout);
    cfg.fail_fast = false;
    cfg
}

/// [`all_collectives_cfg`] with ordinary buffers for each world size of `worlds`, in the launch
/// config that `cfg` makes for it.
fn all_collectives_with(
    worlds: &[usize],
    cfg: impl Fn(usize) -> LaunchConfig,
) -> Result<(), String> {
    for &n in worlds {
        all_collectives_cfg(cfg(n), false).map_err(|e| format!("world {n}: {e}"))?;
    }
    Ok(())
}

fn all_collectives_cfg(cfg: LaunchConfig, shared: bool) -> Result<(), String> {
    let shm = cfg.shm.clone();
    let out = launch(&cfg, |mut ctx: RankContext| -> RankResult<Vec<String>> {
        let c = &mut ctx.comm;
        let mut bad = Vec::new();
        bad.extend(check_dtype::<f32>(c, &shm, shared)?);
        bad.extend(check_dtype::<bf16>(c, &shm, shared)?);
        bad.extend(check_dtype::<i32>(c, &shm, shared)?);
        bad.extend(check_dtype::<u8>(c, &shm, shared)?);
        if !shared {
            bad.extend(check_dtype::<f64>(c, &shm, shared)?);
            bad.extend(check_dtype::<f16>(c, &shm, shared)?);
            bad.extend(check_dtype::<i64>(c, &shm, shared)?);
            bad.extend(check_dtype::<i8>(c, &shm, shared)?);
            bad.extend(check_dtype::<u32>(c, &shm, shared)?);
            bad.extend(check_dtype::<u64>(c, &shm, shared)?);
        }
        Ok(bad)
    })
    .map_err(|e| e.to_string())?;
    no_failures("", out)
}

// -------------------------------------------------------------------------------------------------
// Tests

/// The `collectives_world_*` tests: name, world size, and whether with ordinary buffers, shared
/// ones or both (each a launch of its own).
const WORLD_TESTS: [(&str, usize, &[bool]); 6] = [
    ("collectives_world_1", 1, &[false, true]),
    ("collectives_world_2", 2, &[false]),
    ("collectives_world_2_shared", 2, &[true]),
    ("collectives_world_3", 3, &[false, true]),
    ("collectives_world_4", 4, &[false, true]),
    ("collectives_world_8", 8, &[false, true]),
];

/// Both staging modes forced (the default, auto, switches between them as it measures).
fn t_collectives_stage_modes() -> Result<(), String> {
    for mode in [StageMode::Streaming, StageMode::Cached] {
        all_collectives_with(&[2, 3], |n| {
            let mut cfg = small_cfg(n);
            cfg.shm.stage = mode;
            cfg
        })
        .map_err(|e| format!("{mode:?}, {e}"))?;
    }
    Ok(())
}

/// 64 MiB all-reduce (default config), ordinary and shared buffers, checked element by element.
fn t_all_reduce_64mib() -> Result<(), String> {
    for n in [2usize, 4] {
        let cfg = LaunchConfig::new(n);
        let out = launch(&cfg, |mut ctx: RankContext| -> RankResult<usize> {
            let len = (64 << 20) / 4;
            let (me, n) = (ctx.rank, ctx.world_size);
            let x: Vec<f32> = input::<f32>(ReduceOp::Sum, me, n, len, 0);
            let mut y = vec![0f32; len];
            ctx.comm.all_reduce(&x, &mut y, ReduceOp::Sum)?;
            let mut s = ctx.comm.alloc_shared::<f32>(len)?;
            s.copy_from_slice(&x);
            ctx.comm.all_reduce_in_place(&mut s, ReduceOp::Sum)?;
            let mut wrong = 0;
            for i in 0..len {
                let want = reference(ReduceOp::Sum, i, n, Dtype::F32) as f32;
                wrong += (y[i] != want) as usize + (s[i] != want) as usize;
            }
            let mut b = vec![0f32; len];
            if me == 0 {
                b.copy_from_slice(&x);
            }
            ctx.comm.broadcast_in_place(&mut b, 0)?;
            wrong += (0..len)
                .filter(|&i| {
                    b[i] != x[i] && me == 0
                        || me != 0 && b[i] != input::<f32>(ReduceOp::Sum, 0, n, 1, i)[0]
                })
                .count();
            Ok(wrong)
        })
        .map_err(|e| e.to_string())?;
        if out.iter().any(|w| *w != 0) {
            return Err(format!("world {n}: wrong elements per rank {out:?}"));
        }
    }
    Ok(())
}

/// Element `i` of rank `r`'s input in the bit-exactness tests: values whose sum depends on the
/// order of addition, so that another order shows in the bits.
fn order_sensitive(r: usize, i: usize) -> f32 {
    ((i * 2654435761 + r * 97) % 1000) as f32 * 1.37e-3 + 1e4 * (r as f32 - 1.0)
}

/// FNV-style hash of `bits` on top of `h`: the same only for the same bits in the same order.
fn hash_bits(h: u64, bits: impl IntoIterator<Item = u64>) -> u64 {
    bits.into_iter()
        .fold(h, |h, b| h.wrapping_mul(1099511628211).wrapping_add(b))
}

/// [`hash_bits`] of an f32 output.
fn hash_f32(y: &[f32]) -> u64 {
    hash_bits(0, y.iter().map(|v| v.to_bits() as u64))
}

/// Float results are bit-identical on every rank and across runs.
fn t_deterministic() -> Result<(), String> {
    let run = || {
        launch(
            &small_cfg(3),
            |mut ctx: RankContext| -> RankResult<Vec<u64>> {
                let mut sums = Vec::new();
                for len in [5usize, 300, 5000, 100_000] {
                    let x: Vec<f32> = (0..len).map(|i| order_sensitive(ctx.rank, i)).collect();
                    let mut y = vec![0f32; len];
                    ctx.comm.all_reduce(&x, &mut y, ReduceOp::Sum)?;
                    let h = hash_f32(&y);
                    let xb: Vec<bf16> = x.iter().map(|v| bf16::from_f32(*v)).collect();
                    let mut yb = vec![bf16::ZERO; len];
                    ctx.comm.all_reduce(&xb, &mut yb, ReduceOp::Avg)?;
                    let hb = hash_bits(0, yb.iter().map(|v| v.to_bits() as u64));
                    sums.push(h ^ hb.rotate_left(17));
                }
                Ok(sums)
            },
        )
        .map_err(|e| e.to_string())
    };
    let a = run()?;
    let b = run()?;
    if a.iter().any(|r| *r != a[0]) {
        return Err(format!("ranks disagree: {a:?}"));
    }
    if a != b {
        return Err(format!("runs disagree: {a:?} vs {b:?}"));
    }
    Ok(())
}

/// Each kind of disagreement is reported on every rank, naming who passed what; the communicator
/// stays usable afterwards.
fn t_mismatch() -> Result<(), String> {
    let cases: &[Case] = &[
        (
            "count",
            &[&[
                "rank 0 called all_reduce(count=10",
                "rank 1 called all_reduce(count=11",
            ]],
        ),
        (
            "kind",
            &[&["rank 0 called all_reduce", "rank 1 called broadcast"]],
        ),
        (
            "dtype",
            &[&["dtype=f32", "rank 1 called all_reduce(count=10, dtype=i32"]],
        ),
        ("op", &[&["op=sum", "op=max"]]),
        ("root", &[&["root=0", "root=1"]]),
        ("large", &[&["count=1000000", "count=1000001"]]),
    ];
    // Still usable afterwards: a correct all-reduce of 1000 works.
    mismatch_cases(&small_cfg(2), cases, 1000, |case, me, c| {
        let mut x = [1f32; 11];
        mismatch_message(match (case, me) {
            ("count", 0) => c.all_reduce_in_place(&mut x[..10], ReduceOp::Sum),
            ("count", _) => c.all_reduce_in_place(&mut x[..11], ReduceOp::Sum),
            ("kind", 0) => c.all_reduce_in_place(&mut x[..10], ReduceOp::Sum),
            ("kind", _) => c.broadcast_in_place(&mut x[..10], 0),
            ("dtype", 0) => c.all_reduce_in_place(&mut x[..10], ReduceOp::Sum),
            ("dtype", _) => c.all_reduce_in_place(&mut [1i32; 10], ReduceOp::Sum),
            ("op", 0) => c.all_reduce_in_place(&mut x[..10], ReduceOp::Sum),
            ("op", _) => c.all_reduce_in_place(&mut x[..10], ReduceOp::Max),
            ("root", r) => c.broadcast_in_place(&mut x[..10], r),
            ("large", r) => c.all_reduce_in_place(&mut vec![0f32; 1_000_000 + r], ReduceOp::Sum),
            _ => unreachable!(),
        })
    })
}

/// A rank that dies mid-collective: every survivor errors out naming it, within 1 s.
fn t_dead_peer() -> Result<(), String> {
    for (n, dead) in [(2usize, 1usize), (4, 2)] {
        let res = launch(
            &failing_cfg(n, None),
            |mut ctx: RankContext| -> RankResult<String> {
                let mut x = vec![1f32; 1 << 20];
                ctx.comm.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
                if ctx.rank == dead {
                    std::thread::sleep(Duration::from_millis(50));
                    std::process::abort();
                }
                let (e, took) = failing_all_reduce(&mut ctx.comm, &mut x)?;
                survivor_verdict(e, dead, took)
            },
        );
        survivors_reported(res, Some(dead), (0..n).filter(|&r| r != dead))
            .map_err(|e| format!("world {n}: {e}"))?;
    }
    Ok(())
}

/// A rank that returns (drops its communicator) while a peer waits in a collective.
fn t_peer_left() -> Result<(), String> {
    let out = launch(
        &failing_cfg(3, None),
        |mut ctx: RankContext| -> RankResult<String> {
            ctx.comm.barrier()?;
            if ctx.rank == 2 {
                return Ok("left".into());
            }
            match ctx.comm.barrier() {
                Err(e) => Ok(e.to_string()),
                Ok(()) => Err("barrier passed without rank 2".into()),
            }
        },
    )
    .map_err(|e| e.to_string())?;
    for m in &out[..2] {
        if !(m.contains("rank 2") && (m.contains("left the communicator") || m.contains("died"))) {
            return Err(format!("unexpected error: {m}"));
        }
    }
    Ok(())
}

/// A rank that never arrives: the others time out, saying where it is; waiting does not burn CPU.
fn t_timeout_and_no_spin() -> Result<(), String> {
    let cfg = failing_cfg(2, Some(Duration::from_millis(800)));
    let out = launch(&cfg, |mut ctx: RankContext| -> RankResult<String> {
        ctx.comm.barrier()?;
        if ctx.rank == 1 {
            std::thread::sleep(Duration::from_millis(1500));
            return Ok(String::new());
        }
        let cpu0 = cpu_time();
        let (e, took) = failing_all_reduce(&mut ctx.comm, &mut [1f32; 4])?;
        let cpu = cpu_time() - cpu0;
        Ok(format!("{:.2} {:.3} {e}", took.as_secs_f64(), cpu))
    })
    .map_err(|e| e.to_string())?;
    let m = &out[0];
    let mut it = m.splitn(3, ' ');
    let wall: f64 = it.next().unwrap().parse().unwrap();
    let cpu: f64 = it.next().unwrap().parse().unwrap();
    let msg = it.next().unwrap();
    if !(msg.contains("timed out")
        && msg.contains("rank 1 is at collective #1")
        && msg.contains("at #2"))
    {
        return Err(format!("unexpected timeout message: {msg}"));
    }
    if !(0.7..1.5).contains(&wall) {
        return Err(format!("timeout after {wall} s, expected ~0.8 s"));
    }
    if cpu > 0.25 * wall {
        return Err(format!(
            "waiting rank used {cpu:.3} s of CPU in {wall:.2} s: it spins"
        ));
    }
    Ok(())
}

/// `set_timeout` replaces the configured timeout for the calls that follow, on this rank only;
/// the timeout error lists the ranks that had not arrived.
fn t_set_timeout() -> Result<(), String> {
    let out = launch(
        &failing_cfg(2, Some(Duration::from_secs(60))),
        |mut ctx: RankContext| -> RankResult<String> {
            if ctx.comm.timeout() != Some(Duration::from_secs(60)) {
                return Err(format!("timeout {:?}, configured 60 s", ctx.comm.timeout()).into());
            }
            ctx.comm.barrier()?;
            if ctx.rank == 1 {
                std::thread::sleep(Duration::from_millis(1500));
                return Ok(String::new());
            }
            ctx.comm.set_timeout(Duration::from_millis(300))?;
            let t = Instant::now();
            match ctx.comm.barrier() {
                Err(CommError::Timeout { missing, .. }) => Ok(format!(
                    "{:.2} {missing:?} {:?}",
                    t.elapsed().as_secs_f64(),
                    ctx.comm.timeout()
                )),
                r => Err(format!("expected a timeout, got {r:?}").into()),
            }
        },
    )
    .map_err(|e| e.to_string())?;
    let (wall, rest) = out[0].split_once(' ').ok_or("no output")?;
    let wall: f64 = wall.parse().map_err(|e| format!("{e}"))?;
    if !(0.25..1.2).contains(&wall) || rest != "[1] Some(300ms)" {
        return Err(format!(
            "timed out after {wall} s with {rest}, expected ~0.3 s, [1] Some(300ms)"
        ));
    }
    Ok(())
}

/// Ranks asleep on the futex are woken when the last rank arrives, not when their nap runs out:
/// the last rank to publish checks for sleepers after its own wait (`Channel::wait_published`).
/// The late rank sleeps 40 ms before each call, by which time the others wait on the futex with
/// naps of 10-20 ms; it passes the wall clock at its call in the data (max), and every other rank
/// measures how long after that it returned. A missed wake-up costs a nap, so the median over the
/// calls stays far below 5 ms only when the wake-ups come. On a loaded machine a woken rank also
/// waits to be scheduled: the late rank measures by how much its own 40 ms sleeps overrun (the
/// same scheduler's delay, with no wake-up involved), and the sleepers are allowed twice its
/// median overrun on top of the 5 ms. Fast entries (8 B), phases (64 KiB in 8 KiB slots) and a
/// broadcast from the late rank; 2 ranks, and 3 where a sleeper also waits on a rank that has
/// arrived.
fn t_sleepers_woken() -> Result<(), String> {
    for n in [2usize, 3] {
        let out = launch(
            &small_cfg(n),
            |mut ctx: RankContext| -> RankResult<String> {
                let late = ctx.rank == ctx.world_size - 1;
                let wall = || {
                    std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map(|d| d.as_nanos() as i64)
                        .unwrap_or(0)
                };
                let mut lags = Vec::new();
                let mut overruns = Vec::new();
                ctx.comm.barrier()?;
                for call in 0..9 {
                    if late {
                        let t = std::time::Instant::now();
                        std::thread::sleep(Duration::from_millis(40));
                        overruns.push(t.elapsed().as_nanos() as i64 - 40_000_000);
                    }
                    let v = if late { wall() } else { 0 };
                    let got = match call % 3 {
                        0 => {
                            let mut x = [v];
                            ctx.comm.all_reduce_in_place(&mut x, ReduceOp::Max)?;
                            x[0]
                        }
                        1 => {
                            let mut x = vec![v; 8192];
                            ctx.comm.all_reduce_in_place(&mut x, ReduceOp::Max)?;
                            x[8191]
                        }
                        _ => {
                            let mut x = [v];
                            ctx.comm.broadcast_in_place(&mut x, ctx.world_size - 1)?;
                            x[0]
                        }
                    };
                    lags.push(wall() - got);
                }
                lags.sort();
                overruns.sort();
                Ok(if late {
                    format!("{}", overruns[overruns.len() / 2])
                } else {
                    format!("{}", lags[lags.len() / 2])
                })
            },
        )
        .map_err(|e| e.to_string())?;
        let overrun: i64 = out[n - 1]
            .parse()
            .map_err(|e| format!("the late rank: {e}"))?;
        let bound = 5_000_000 + 2 * overrun.max(0);
        for (r, lag) in out.iter().enumerate().take(n - 1) {
            let ns: i64 = lag.parse().map_err(|e| format!("rank {r}: {e}"))?;
            if ns > bound {
                return Err(format!(
                    "{n} ranks: rank {r} returned a median {:.1} ms after the late rank's call (allowed {:.1} ms: 5 ms and twice the late rank's median sleep overrun): the sleepers are not woken",
                    ns as f64 / 1e6,
                    bound as f64 / 1e6
                ));
            }
        }
    }
    Ok(())
}

/// Ranks exec'd separately (here: forked without an inherited segment) find each other by job id,
/// and the named segment is gone afterwards.
fn t_named_segment_no_leak() -> Result<(), String> {
    let job = format!(
        "test-{}-{}",
        std::process::id(),
        Instant::now().elapsed().subsec_nanos()
    );
    let n = 3;
    let mut pids = Vec::new();
    for rank in 0..n {
        // SAFETY: single-threaded test process; the child only runs lockstep code and _exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let code = (|| -> Result<(), String> {
                let cfg = ShmConfig {
                    heap_bytes: 8 << 20,
                    ..ShmConfig::default()
                };
                let backend = ShmComm::join_named(&job, rank, n, cfg).map_err(|e| e.to_string())?;
                let mut c = Communicator::from_backend(Box::new(backend));
                let mut x = vec![rank as i64; 100_000];
                c.all_reduce_in_place(&mut x, ReduceOp::Sum)
                    .map_err(|e| e.to_string())?;
                if x.iter().any(|v| *v != 3) {
                    return Err("wrong sum".into());
                }
                c.barrier().map_err(|e| e.to_string())
            })();
            if let Err(e) = &code {
                eprintln!("rank {rank}: {e}");
            }
            // SAFETY: leave the forked child without running the parent's destructors.
            unsafe { libc::_exit(code.is_err() as i32) };
        }
        pids.push(pid);
    }
    let mut ok = true;
    for pid in pids {
        let mut st = 0;
        // SAFETY: valid out-parameter, our child.
        unsafe { libc::waitpid(pid, &mut st, 0) };
        ok &= libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0;
    }
    let path = format!("/dev/shm/lockstep-{job}");
    if std::path::Path::new(&path).exists() {
        lockstep::shm::unlink_named(&job);
        return Err(format!("{path} leaked"));
    }
    if !ok {
        return Err("a rank failed".into());
    }
    Ok(())
}

/// Bad local arguments are refused before any rank waits.
fn t_local_argument_errors() -> Result<(), String> {
    let out = launch(
        &small_cfg(2),
        |mut ctx: RankContext| -> RankResult<Vec<String>> {
            let c = &mut ctx.comm;
            let e = vec![
                c.all_reduce(&[1f32; 4], &mut [0f32; 5], ReduceOp::Sum)
                    .unwrap_err()
                    .to_string(),
                c.broadcast_in_place(&mut [0f32; 4], 2)
                    .unwrap_err()
                    .to_string(),
                c.all_gather(&[1f32; 4], &mut [0f32; 7])
                    .unwrap_err()
                    .to_string(),
                c.reduce_scatter(&[1f32; 7], &mut [0f32; 3], ReduceOp::Sum)
                    .unwrap_err()
                    .to_string(),
            ];
            c.barrier()?;
            Ok(e)
        },
    )
    .map_err(|e| e.to_string())?;
    let want = [
        "recv has 5",
        "root 2 is out of range",
        "recv has 7 elements but must have",
        "send has 7 elements but must have",
    ];
    for (got, w) in out[0].iter().zip(want) {
        if !got.contains(w) {
            return Err(format!("'{got}' lacks '{w}'"));
        }
    }
    Ok(())
}

/// Only one rank passes bad arguments: the others' matching call fails too, naming it, and the
/// next calls pair up correctly.
fn t_local_error_on_one_rank() -> Result<(), String> {
    let out = launch(
        &small_cfg(3),
        |mut ctx: RankContext| -> RankResult<String> {
            let c = &mut ctx.comm;
            let first = if ctx.rank == 1 {
                c.all_reduce(&[1f32; 4], &mut [0f32; 5], ReduceOp::Sum)
                    .unwrap_err()
                    .to_string()
            } else {
                c.all_reduce(&[1f32; 4], &mut [0f32; 4], ReduceOp::Sum)
                    .err()
                    .map(|e| e.to_string())
                    .unwrap_or_else(|| "no error".into())
            };
            let mut x = [ctx.rank as f32 + 1.0; 4];
            c.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
            if x != [6.0; 4] {
                return Err(format!("next call paired wrongly: {x:?}").into());
            }
            Ok(first)
        },
    )
    .map_err(|e| e.to_string())?;
    if !out[1].contains("recv has 5") {
        return Err(format!("rank 1: {}", out[1]));
    }
    for r in [0, 2] {
        if !out[r].contains("rank 1 refused its all_reduce call") {
            return Err(format!("rank {r}: {}", out[r]));
        }
    }
    Ok(())
}

/// Slots smaller than a 4 KiB piece per peer are enlarged, so many ranks with a tiny configured
/// slot still work (chunk arithmetic never reaches zero or overflows a slot).
fn t_tiny_slot_many_ranks() -> Result<(), String> {
    let mut cfg = LaunchConfig::new(20);
    cfg.shm.slot_bytes = 4096;
    cfg.shm.heap_bytes = 8 << 20;
    let out = launch(&cfg, |mut ctx: RankContext| -> RankResult<(i32, i32)> {
        let n = ctx.world_size;
        let x = vec![ctx.rank as i32; 3000 * n];
        let mut y = vec![0i32; 3000];
        ctx.comm.reduce_scatter(&x, &mut y, ReduceOp::Sum)?;
        let mut z = vec![1i32; 50_000];
        ctx.comm.all_reduce_in_place(&mut z, ReduceOp::Sum)?;
        Ok((y[2999], z[49_999]))
    })
    .map_err(|e| e.to_string())?;
    if out.iter().any(|v| *v != (190, 20)) {
        return Err(format!("wrong results {:?}", &out[..3]));
    }
    Ok(())
}

/// Oversubscribed: 8 ranks on this machine's cores complete a mixed workload.
fn t_oversubscribed_8() -> Result<(), String> {
    let cfg = LaunchConfig::new(8);
    let out = launch(&cfg, |mut ctx: RankContext| -> RankResult<f64> {
        let mut x = vec![ctx.rank as f64; 1 << 18];
        for _ in 0..20 {
            ctx.comm.all_reduce_in_place(&mut x[..1], ReduceOp::Max)?;
            ctx.comm.barrier()?;
        }
        ctx.comm.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
        Ok(x[12345])
    })
    .map_err(|e| e.to_string())?;
    // x[12345] is the sum of the ranks, 0 + 1 + … + 7.
    if out.iter().any(|v| *v != 28.0) {
        return Err(format!("wrong results {out:?}"));
    }
    Ok(())
}

/// 64 ranks (the largest world the backend is sized for here) agree on sums and a barrier.
fn t_world_64() -> Result<(), String> {
    let mut cfg = LaunchConfig::new(64);
    cfg.shm.heap_bytes = 16 << 20;
    cfg.shm.slot_bytes = 64 << 10;
    cfg.shm = cfg.shm.clone().normalized();
    let out = launch(&cfg, |mut ctx: RankContext| -> RankResult<(i64, i64)> {
        let mut x = vec![ctx.rank as i64; 10_000];
        ctx.comm.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
        let mut y = [ctx.rank as i64];
        ctx.comm.all_reduce_in_place(&mut y, ReduceOp::Max)?;
        ctx.comm.barrier()?;
        Ok((x[9_999], y[0]))
    })
    .map_err(|e| e.to_string())?;
    if out.iter().any(|v| *v != (63 * 64 / 2, 63)) {
        return Err(format!("wrong results {:?}", &out[..4]));
    }
    Ok(())
}

/// A message over 1 GiB (u8, odd length) goes through the bounded staging slots intact.
fn t_over_1gib() -> Result<(), String> {
    let out = launch(
        &LaunchConfig::new(2),
        |mut ctx: RankContext| -> RankResult<usize> {
            let len = (1usize << 30) + 3;
            let mut x = vec![0u8; len];
            for (i, v) in x.iter_mut().enumerate().step_by(4093) {
                *v = (i % 7) as u8 + ctx.rank as u8;
            }
            ctx.comm.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
            let wrong = (0..len)
                .step_by(4093)
                .filter(|&i| x[i] != 2 * (i % 7) as u8 + 1)
                .count()
                + (x[1] != 0) as usize
                + (x[len - 1] != if (len - 1).is_multiple_of(4093) { 1 } else { 0 }) as usize;
            Ok(wrong)
        },
    )
    .map_err(|e| e.to_string())?;
    if out.iter().any(|w| *w != 0) {
        return Err(format!("wrong elements {out:?}"));
    }
    Ok(())
}

// -------------------------------------------------------------------------------------------------
// The fast path (per-rank payloads up to `fast_bytes`, one phase)

/// Every collective of dtype T at counts around the fast-path threshold (per-rank payload just
/// below, at and above `fast`), and odd small ones; returns failure messages.
fn fast_ops<T: TestElem>(comm: &mut Communicator, fast: usize) -> Result<Vec<String>, CommError> {
    let (me, n) = (comm.rank(), comm.world_size());
    let dt = T::DTYPE;
    let esz = dt.size();
    let mut bad = Vec::new();
    let root = n - 1;
    // Counts whose per-rank payload (count × unit bytes) straddles the threshold.
    let counts = |unit: usize| {
        let t = fast / unit;
        let mut v = vec![0, 1, 3, 5, t.saturating_sub(1), t, t + 1];
        v.sort();
        v.dedup();
        v
    };
    let sum = ReduceOp::Sum;
    for len in counts(esz) {
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Prod] {
            let send = input::<T>(op, me, n, len, 0);
            let mut recv = vec![T::default(); len];
            comm.all_reduce(&send, &mut recv, op)?;
            if let Some(i) =
                (0..len).find(|&i| !close(recv[i].to_f64(), reference(op, i, n, dt), dt))
            {
                bad.push(format!(
                    "all_reduce {dt} {op} len {len}: [{i}] = {:?}",
                    recv[i]
                ));
            }
            let mut r = vec![T::default(); if me == root { len } else { 0 }];
            comm.reduce(&send, &mut r, op, root)?;
            if me == root && r != recv {
                bad.push(format!(
                    "reduce {dt} {op} len {len} differs from all_reduce"
                ));
            }
            // In place, this rank's own input is also the destination (the fast path reads it
            // from the caller's buffer, not from its entry).
            let mut ip = send.clone();
            comm.all_reduce_in_place(&mut ip, op)?;
            if ip != recv {
                bad.push(format!(
                    "all_reduce in place {dt} {op} len {len} differs from out of place"
                ));
            }
            let mut rip = send.clone();
            comm.reduce_in_place(&mut rip, op, root)?;
            if (me == root && rip != recv) || (me != root && rip != send) {
                bad.push(format!("reduce in place {dt} {op} len {len}"));
            }
        }
        let want = input::<T>(sum, root, n, len, 0);
        let mut b = if me == root {
            want.clone()
        } else {
            vec![T::default(); len]
        };
        comm.broadcast_in_place(&mut b, root)?;
        if b != want {
            bad.push(format!("broadcast {dt} len {len}"));
        }
        let bsend = if me == root {
            want.clone()
        } else {
            vec![T::default(); len]
        };
        let mut bo = vec![T::default(); len];
        comm.broadcast(&bsend, &mut bo, root)?;
        if bo != want {
            bad.push(format!("broadcast out of place {dt} len {len}"));
        }
        let mine = input::<T>(sum, me, n, len, 0);
        let all: Vec<T> = (0..n).flat_map(|r| input::<T>(sum, r, n, len, 0)).collect();
        let mut ag = vec![T::default(); len * n];
        comm.all_gather(&mine, &mut ag)?;
        if ag != all {
            bad.push(format!("all_gather {dt} len {len}"));
        }
        let mut agi = vec![T::default(); len * n];
        agi[me * len..(me + 1) * len].copy_from_slice(&mine);
        comm.all_gather_in_place(&mut agi)?;
        if agi != all {
            bad.push(format!("all_gather in place {dt} len {len}"));
        }
        let mut g = vec![T::default(); if me == root { len * n } else { 0 }];
        comm.gather(&mine, &mut g, root)?;
        if me == root && g != all {
            bad.push(format!("gather {dt} len {len}"));
        }
    }
    for len in counts(esz * n) {
        let send = input::<T>(sum, me, n, len * n, 0);
        let mut recv = vec![T::default(); len];
        comm.reduce_scatter(&send, &mut recv, sum)?;
        if let Some(i) =
            (0..len).find(|&i| !close(recv[i].to_f64(), reference(sum, me * len + i, n, dt), dt))
        {
            bad.push(format!(
                "reduce_scatter {dt} len {len}: [{i}] = {:?}",
                recv[i]
            ));
        }
        let mut rsi = send.clone();
        comm.reduce_scatter_in_place(&mut rsi, sum)?;
        if rsi[me * len..(me + 1) * len] != recv[..] {
            bad.push(format!(
                "reduce_scatter in place {dt} len {len} differs from out of place"
            ));
        }
        // Block j of rank r's input goes to rank j: rank `me` receives block `me` of every input.
        let mut a2a = vec![T::default(); len * n];
        comm.all_to_all(&send, &mut a2a)?;
        let want: Vec<T> = (0..n)
            .flat_map(|r| input::<T>(sum, r, n, len * n, 0)[me * len..(me + 1) * len].to_vec())
            .collect();
        if a2a != want {
            bad.push(format!("all_to_all {dt} len {len}"));
        }
        let ssend = if me == root {
            input::<T>(sum, root, n, len * n, 0)
        } else {
            Vec::new()
        };
        let mut srecv = vec![T::default(); len];
        comm.scatter(&ssend, &mut srecv, root)?;
        if srecv[..] != input::<T>(sum, root, n, len * n, 0)[me * len..(me + 1) * len] {
            bad.push(format!("scatter {dt} len {len}"));
        }
        comm.barrier()?;
    }
    Ok(bad)
}

/// Every collective, every dtype, world sizes 1 to 8, around the fast-path threshold (the default
/// 4 KiB and a small one, 64 bytes, where the payload shares the line with the arguments).
fn t_fast_path() -> Result<(), String> {
    for fast in [4096usize, 64] {
        for n in [1usize, 2, 3, 4, 8] {
            let mut cfg = small_cfg(n);
            cfg.shm.fast_bytes = fast;
            let out = launch(&cfg, |mut ctx: RankContext| -> RankResult<Vec<String>> {
                let c = &mut ctx.comm;
                let mut bad = Vec::new();
                bad.extend(fast_ops::<f32>(c, fast)?);
                bad.extend(fast_ops::<f64>(c, fast)?);
                bad.extend(fast_ops::<f16>(c, fast)?);
                bad.extend(fast_ops::<bf16>(c, fast)?);
                bad.extend(fast_ops::<i32>(c, fast)?);
                bad.extend(fast_ops::<i64>(c, fast)?);
                bad.extend(fast_ops::<u8>(c, fast)?);
                bad.extend(fast_ops::<i8>(c, fast)?);
                bad.extend(fast_ops::<u32>(c, fast)?);
                bad.extend(fast_ops::<u64>(c, fast)?);
                Ok(bad)
            })
            .map_err(|e| format!("fast_bytes {fast}, {n} ranks: {e}"))?;
            no_failures(&format!("fast_bytes {fast}, {n} ranks, "), out)?;
        }
    }
    Ok(())
}

/// Disagreements on the fast path are reported on every rank, also when one rank's arguments put
/// it on the phased path (above the threshold) and the others' on the fast one, and when one rank
/// refuses the call locally; the communicator stays usable.
fn t_fast_mismatch() -> Result<(), String> {
    let cases: &[Case] = &[
        (
            "across threshold",
            &[&[
                "rank 0 called all_reduce(count=1024",
                "rank 1 called all_reduce(count=1025",
            ]],
        ),
        (
            "all_to_all count",
            &[&[
                "rank 0 called all_to_all(count=2",
                "rank 2 called all_to_all(count=3",
            ]],
        ),
        ("scatter root", &[&["root=0", "root=1"]]),
        ("barrier vs all_gather", &[&["barrier", "all_gather"]]),
        ("gather dtype", &[&["dtype=f32", "dtype=f64"]]),
        ("refused", &[&["refused its all_reduce"]]),
    ];
    // Still usable afterwards: a correct all-reduce of 3 works.
    mismatch_cases(&small_cfg(3), cases, 3, |case, me, c| {
        let r = match (case, me) {
            ("across threshold", 0) => c.all_reduce_in_place(&mut [1f32; 1024], ReduceOp::Sum),
            ("across threshold", _) => c.all_reduce_in_place(&mut [1f32; 1025], ReduceOp::Sum),
            ("all_to_all count", 2) => c.all_to_all(&[1f32; 9], &mut [0f32; 9]),
            ("all_to_all count", _) => c.all_to_all(&[1f32; 6], &mut [0f32; 6]),
            ("scatter root", 1) => c.scatter(&[1f32; 6], &mut [0f32; 2], 1),
            ("scatter root", 0) => c.scatter(&[1f32; 6], &mut [0f32; 2], 0),
            ("scatter root", _) => c.scatter(&[0f32; 0], &mut [0f32; 2], 0),
            ("barrier vs all_gather", 1) => c.all_gather(&[1f32; 2], &mut [0f32; 6]),
            ("barrier vs all_gather", _) => c.barrier(),
            ("gather dtype", 1) => c.gather(&[1f64; 2], &mut [0f64; 0], 0),
            ("gather dtype", _) => {
                c.gather(&[1f32; 2], &mut vec![0f32; if me == 0 { 6 } else { 0 }], 0)
            }
            ("refused", 1) => c.all_reduce(&[1f32; 4], &mut [0f32; 5], ReduceOp::Sum),
            ("refused", _) => c.all_reduce(&[1f32; 4], &mut [0f32; 4], ReduceOp::Sum),
            _ => unreachable!(),
        };
        let msg = match r {
            // The refusing rank gets its own argument error.
            Err(e) if case == "refused" && me == 1 => {
                format!("rank 1 refused its all_reduce call: {e}")
            }
            r => mismatch_message(r)?,
        };
        Ok(msg.to_lowercase())
    })
}

// -------------------------------------------------------------------------------------------------
// Single-copy collectives (the CMA path: cross-memory reads and writes of the peers' ordinary
// buffers, `shm::path`, `shm::coll`)

/// small_cfg with the single-copy threshold lowered to 4 KiB, so that `sizes` covers it, and
/// streaming stores (above which the staged paths take over again) from 4 MiB only.
/// Staged all-gathers whose ranks differ in place / out of place from call to call (an
/// out-of-place rank of a one-chunk all-gather stages after the descriptors, in one pass with its
/// own block; an in-place rank stages before them), with ordinary stores (the one-pass AVX2 copy)
/// and with streaming stores, one chunk and several, between broadcasts and all-reduces that
/// stage in the same slots: every result right.
fn t_all_gather_mixed_in_place() -> Result<(), String> {
    for (n, nt_bytes) in [(2, 8 << 20), (3, 8 << 20), (2, 2048)] {
        let mut cfg = LaunchConfig::new(n);
        cfg.shm.slot_bytes = 64 << 10;
        cfg.shm.small_bytes = 1024;
        cfg.shm.cma_bytes = 0;
        cfg.shm.nt_bytes = nt_bytes;
        cfg.shm.timeout = Duration::from_secs(60);
        cfg.shm = cfg.shm.clone().normalized();
        let out = launch(&cfg, |mut ctx: RankContext| -> RankResult<Vec<String>> {
            let c = &mut ctx.comm;
            let (me, n) = (c.rank(), c.world_size());
            let mut bad = Vec::new();
            let val = |r: usize, it: usize, i: usize| ((r * 7919 + it * 131 + i) % 65_521) as f32;
            for it in 0..12 {
                for len in [1_500usize, 10_000, 16_384, 16_390, 40_000] {
                    let in_place = (me + it + len) % 3 == 0;
                    let mine: Vec<f32> = (0..len).map(|i| val(me, it, i)).collect();
                    let want: Vec<f32> = (0..n)
                        .flat_map(|r| (0..len).map(move |i| val(r, it, i)))
                        .collect();
                    let mut out = vec![-1f32; len * n];
                    if in_place {
                        out[me * len..(me + 1) * len].copy_from_slice(&mine);
                        c.all_gather_in_place(&mut out)?;
                    } else {
                        c.all_gather(&mine, &mut out)?;
                    }
                    if out != want {
                        let i = (0..out.len()).find(|&i| out[i] != want[i]).unwrap_or(0);
                        bad.push(format!(
                            "all_gather it {it} len {len} in_place {in_place}: [{i}] = {}, want {}",
                            out[i], want[i]
                        ));
                    }
                    // Other staged calls between, in the same slots.
                    let root = it % n;
                    let src: Vec<f32> = (0..len).map(|i| val(me, it + 1, i)).collect();
                    let mut dst = vec![0f32; len];
                    c.broadcast(&src, &mut dst, root)?;
                    if (0..len).any(|i| dst[i] != val(root, it + 1, i)) {
                        bad.push(format!("broadcast it {it} len {len} wrong"));
                    }
                    let mut sum = src.clone();
                    c.all_reduce_in_place(&mut sum, ReduceOp::Sum)?;
                    if (0..len).any(|i| sum[i] != (0..n).map(|r| val(r, it + 1, i)).sum::<f32>()) {
                        bad.push(format!("all_reduce it {it} len {len} wrong"));
                    }
                }
            }
            bad.truncate(5);
            Ok(bad)
        })
        .map_err(|e| format!("world {n}: {e}"))?;
        no_failures(&format!("world {n} "), out)?;
    }
    Ok(())
}

fn single_cfg(n: usize) -> LaunchConfig {
    let mut cfg = small_cfg(n);
    cfg.shm.cma_bytes = 4096;
    cfg.shm.nt_bytes = 4 << 20;
    // Taken wherever the sizes allow, not only where rank 0 timed it faster.
    cfg.shm.single_copy = SingleCopyMode::Always;
    cfg
}

/// Every collective, every dtype, every op, around the threshold and on odd counts, 2-4 ranks.
fn t_single_copy() -> Result<(), String> {
    all_collectives_with(&[2, 3, 4], single_cfg)
}

/// The kernel refuses (fault injection): the probe fails on every rank, the call is run again
/// staged, and so are all later calls; every result still right.
fn t_single_copy_refused() -> Result<(), String> {
    all_collectives_with(&[2, 3], |n| {
        let mut cfg = single_cfg(n);
        cfg.shm.fault_refuse_direct = true;
        cfg
    })
}

/// The default choice (`auto`): rank 0 alternates the two paths while it measures them, then
/// probes the slower one now and then, and the others follow its pick (a call whose ranks
/// offered differently runs again). Many calls of one class, 2 and 3 ranks, each output checked
/// whole, and the same bits on every rank and every call.
fn t_single_copy_auto() -> Result<(), String> {
    for n in [2usize, 3] {
        let mut cfg = single_cfg(n);
        cfg.shm.single_copy = SingleCopyMode::Auto;
        let out = launch(&cfg, move |mut ctx: RankContext| -> RankResult<u64> {
            let (me, c) = (ctx.rank, &mut ctx.comm);
            let val = order_sensitive;
            let len = 3001usize;
            let x: Vec<f32> = (0..len).map(|i| val(me, i)).collect();
            let all: Vec<f32> = (0..n)
                .flat_map(|r| (0..len).map(move |i| val(r, i)))
                .collect();
            let (mut first, mut h) = (None, 0u64);
            for call in 0..40 {
                let mut y = vec![0f32; len];
                c.all_reduce(&x, &mut y, ReduceOp::Sum)?;
                let bits: Vec<u32> = y.iter().map(|v| v.to_bits()).collect();
                if *first.get_or_insert_with(|| bits.clone()) != bits {
                    return Err(
                        format!("all_reduce call {call}: other bits than the first call").into(),
                    );
                }
                for (i, v) in y.iter().enumerate() {
                    let want: f32 = (0..n).map(|r| val(r, i)).sum();
                    if (v - want).abs() > 1e-2 {
                        return Err(
                            format!("all_reduce call {call}: [{i}] = {v}, want {want}").into()
                        );
                    }
                }
                let mut g = vec![0f32; len * n];
                c.all_gather(&x, &mut g)?;
                if g != all {
                    return Err(format!("all_gather call {call}: wrong output").into());
                }
                let root = call % n;
                let mut b = if me == root {
                    x.clone()
                } else {
                    vec![0f32; len]
                };
                c.broadcast_in_place(&mut b, root)?;
                if b.iter().enumerate().any(|(i, v)| *v != val(root, i)) {
                    return Err(format!("broadcast call {call} from {root}: wrong output").into());
                }
                let mut z = vec![0f32; len];
                c.reduce_scatter(&all, &mut z, ReduceOp::Max)?;
                if z.iter().enumerate().any(|(i, v)| *v != all[me * len + i]) {
                    return Err(format!("reduce_scatter call {call}: wrong output").into());
                }
                h = hash_bits(h, bits.iter().map(|&b| b as u64));
            }
            Ok(h)
        })
        .map_err(|e| format!("world {n}: {e}"))?;
        if out.iter().any(|h| *h != out[0]) {
            return Err(format!("world {n}: ranks disagree: {out:?}"));
        }
    }
    Ok(())
}

/// Hashes of all_reduce and reduce_scatter outputs on values whose sum depends on the order of
/// addition, with `cma_bytes` as given.
fn order_sensitive_hashes(n: usize, cma_bytes: usize) -> Result<Vec<Vec<u64>>, String> {
    single_copy_job(n, cma_bytes, |me, c| {
        let mut out = Vec::new();
        for len in [1023usize, 1024, 1025, 5000, 100_003] {
            let x: Vec<f32> = (0..len * n).map(|i| order_sensitive(me, i)).collect();
            let mut y = vec![0f32; len * n];
            c.all_reduce(&x, &mut y, ReduceOp::Sum)?;
            out.push(hash_f32(&y));
            let mut z = vec![0f32; len];
            c.reduce_scatter(&x, &mut z, ReduceOp::Sum)?;
            // Every rank's block, so that the ranks' hashes can be compared.
            let mut all = vec![0f32; len * n];
            c.all_gather(&z, &mut all)?;
            out.push(hash_f32(&all));
        }
        Ok(out)
    })
}

/// A job of `n` ranks on [`single_cfg`] with `cma_bytes` as given, each running `body(rank,
/// comm)`: their outputs' hashes.
fn single_copy_job(
    n: usize,
    cma_bytes: usize,
    body: impl FnOnce(usize, &mut Communicator) -> RankResult<Vec<u64>>,
) -> Result<Vec<Vec<u64>>, String> {
    let mut cfg = single_cfg(n);
    cfg.shm.cma_bytes = cma_bytes;
    launch(&cfg, |mut ctx: RankContext| body(ctx.rank, &mut ctx.comm)).map_err(|e| e.to_string())
}

/// The single-copy reductions give the staged path's bits, on every rank, run after run.
fn t_single_copy_bits() -> Result<(), String> {
    for n in [2, 3] {
        let direct = order_sensitive_hashes(n, 4096)?;
        let again = order_sensitive_hashes(n, 4096)?;
        let staged = order_sensitive_hashes(n, 0)?;
        if direct.iter().any(|r| *r != direct[0]) {
            return Err(format!("world {n}: ranks disagree: {direct:?}"));
        }
        if direct != again {
            return Err(format!("world {n}: runs disagree: {direct:?} vs {again:?}"));
        }
        if direct != staged {
            return Err(format!(
                "world {n}: single-copy {direct:?} differs from staged {staged:?}"
            ));
        }
    }
    Ok(())
}

/// Every output of the pushing single-copy paths (broadcast: the root pushes a share while the
/// others pull the rest; all_gather and gather: every rank pushes its block; all_reduce: every
/// reduced piece pushed into the peers' outputs), out of place and in place, roots 0 and last,
/// on sizes across the single-copy threshold and the push share's cache-line rounding, hashed
/// per rank, with `cma_bytes` as given. The values make any wrong order of addition visible.
fn push_path_hashes(n: usize, cma_bytes: usize) -> Result<Vec<Vec<u64>>, String> {
    single_copy_job(n, cma_bytes, |me, c| {
        let (hash, val) = (hash_f32, order_sensitive);
        let mut out = Vec::new();
        // Elements of f32: below, at and above the 4 KiB threshold (1024), shares of a few cache
        // lines and none, odd counts, and the benchmarks' 1 MiB.
        for len in [
            1000usize, 1023, 1024, 1025, 1031, 1040, 4099, 100_003, 262_144,
        ] {
            let x: Vec<f32> = (0..len).map(|i| val(me, i)).collect();
            let mut y = vec![0f32; len];
            c.all_reduce(&x, &mut y, ReduceOp::Sum)?;
            out.push(hash(&y));
            let mut z = x.clone();
            c.all_reduce_in_place(&mut z, ReduceOp::Sum)?;
            out.push(hash(&z));
            // The copies must also be right, not only equal to the staged path's.
            let all: Vec<f32> = (0..n)
                .flat_map(|r| (0..len).map(move |i| val(r, i)))
                .collect();
            for root in [0, n - 1] {
                let want: Vec<f32> = (0..len).map(|i| val(root, i)).collect();
                let mut b = vec![0f32; len];
                c.broadcast(&x, &mut b, root)?;
                out.push(hash(&b));
                let mut bi = x.clone();
                c.broadcast_in_place(&mut bi, root)?;
                out.push(hash(&bi));
                let mut g = vec![0f32; if me == root { len * n } else { 0 }];
                c.gather(&x, &mut g, root)?;
                out.push(hash(&g));
                if b != want || bi != want || (me == root && g != all) {
                    return Err(
                        format!("broadcast or gather of {len} from root {root} wrong").into(),
                    );
                }
            }
            let mut ag = vec![0f32; len * n];
            c.all_gather(&x, &mut ag)?;
            out.push(hash(&ag));
            let mut agi = vec![0f32; len * n];
            agi[me * len..(me + 1) * len].copy_from_slice(&x);
            c.all_gather_in_place(&mut agi)?;
            out.push(hash(&agi));
            if ag != all || agi != all {
                return Err(format!("all_gather of {len} wrong").into());
            }
        }
        Ok(out)
    })
}

/// The pushing single-copy paths give the staged path's bits, on every rank.
fn t_single_copy_push() -> Result<(), String> {
    for n in [2, 3] {
        let direct = push_path_hashes(n, 4096)?;
        let staged = push_path_hashes(n, 0)?;
        for (r, (d, s)) in direct.iter().zip(&staged).enumerate() {
            if let Some(i) = (0..d.len()).find(|&i| d[i] != s[i]) {
                return Err(format!(
                    "world {n}, rank {r}: output #{i} differs between single-copy and staged"
                ));
            }
        }
        // Every output but the gathers' (empty on non-roots) is the same on every rank: per size,
        // all_reduce (2), per root broadcast (2) and gather, all_gather (2).
        if direct.iter().any(|d| {
            (0..d.len())
                .filter(|i| !matches!(i % 10, 4 | 7))
                .any(|i| d[i] != direct[0][i])
        }) {
            return Err(format!("world {n}: the ranks' outputs differ"));
        }
    }
    Ok(())
}

/// Rank 0 passes shared buffers (no offer), rank 1 ordinary ones (an offer): every rank runs the
/// call again staged, and the results are right; then all ordinary, direct. And the same with
/// single-copy off (no offer anywhere): rank 0 then skips its staging, expecting zero-copy, and
/// every rank runs the call again, staged, once it sees rank 1's ordinary buffers.
fn t_single_copy_mixed() -> Result<(), String> {
    let mut no_direct = single_cfg(2);
    no_direct.shm.cma_bytes = 0;
    for (what, cfg) in [
        ("single-copy on", single_cfg(2)),
        ("single-copy off", no_direct),
    ] {
        mixed_buffers(&cfg).map_err(|e| format!("{what}: {e}"))?;
    }
    Ok(())
}

fn mixed_buffers(cfg: &LaunchConfig) -> Result<(), String> {
    let out = launch(cfg, |mut ctx: RankContext| -> RankResult<Vec<String>> {
        let (me, n, len) = (ctx.rank, 2usize, 3001usize);
        let c = &mut ctx.comm;
        let mut bad = Vec::new();
        for shared_on_0 in [true, false] {
            let shared = shared_on_0 && me == 0;
            let buf = |c: &mut Communicator, data: Vec<f32>| buffer(c, shared, data);
            let x = buf(c, input::<f32>(ReduceOp::Sum, me, n, len * n, 0))?;
            let mut y = buf(c, vec![0f32; len * n])?;
            c.all_reduce(x.slice(), y.slice_mut(), ReduceOp::Sum)?;
            if (0..len * n)
                .any(|i| y.slice()[i] as f64 != reference(ReduceOp::Sum, i, n, Dtype::F32))
            {
                bad.push(format!("all_reduce wrong (rank 0 shared: {shared_on_0})"));
            }
            let mut z = buf(c, vec![0f32; len])?;
            c.reduce_scatter(x.slice(), z.slice_mut(), ReduceOp::Sum)?;
            if (0..len).any(|i| {
                z.slice()[i] as f64 != reference(ReduceOp::Sum, me * len + i, n, Dtype::F32)
            }) {
                bad.push(format!(
                    "reduce_scatter wrong (rank 0 shared: {shared_on_0})"
                ));
            }
            let mine = buf(c, input::<f32>(ReduceOp::Sum, me, n, len, 0))?;
            let mut ag = buf(c, vec![0f32; len * n])?;
            c.all_gather(mine.slice(), ag.slice_mut())?;
            let all: Vec<f32> = (0..n)
                .flat_map(|r| input::<f32>(ReduceOp::Sum, r, n, len, 0))
                .collect();
            if ag.slice() != all.as_slice() {
                bad.push(format!("all_gather wrong (rank 0 shared: {shared_on_0})"));
            }
            let mut b = buf(c, vec![0f32; len])?;
            c.broadcast(mine.slice(), b.slice_mut(), 0)?;
            if b.slice() != input::<f32>(ReduceOp::Sum, 0, n, len, 0).as_slice() {
                bad.push(format!("broadcast wrong (rank 0 shared: {shared_on_0})"));
            }
            // In place from either root: the root writes a share of the other's output only when
            // both outputs lie in the segment, which here they never both do.
            for root in 0..n {
                let mut bi = buf(c, input::<f32>(ReduceOp::Sum, me, n, len, 0))?;
                c.broadcast_in_place(bi.slice_mut(), root)?;
                if bi.slice() != input::<f32>(ReduceOp::Sum, root, n, len, 0).as_slice() {
                    bad.push(format!(
                        "broadcast in place from {root} wrong (rank 0 shared: {shared_on_0})"
                    ));
                }
            }
        }
        Ok(bad)
    })
    .map_err(|e| e.to_string())?;
    no_failures("", out)
}

/// Arguments that disagree at single-copy sizes are a mismatch on every rank, before anyone reads
/// a peer's memory; the communicator stays usable.
fn t_single_copy_mismatch() -> Result<(), String> {
    let cases: &[Case] = &[
        ("all_gather", &[&["count=100000", "count=100001"]]),
        ("broadcast", &[&["count=100000", "count=100001"]]),
        ("all_reduce", &[&["count=100000", "count=100001"]]),
        ("reduce_scatter", &[&["count=100000", "count=100001"]]),
    ];
    mismatch_cases(&single_cfg(2), cases, 100_000, |case, me, c| {
        let len = 100_000 + me;
        let x = vec![1f32; 2 * len];
        let mut y = vec![0f32; 2 * len];
        mismatch_message(match case {
            "all_gather" => c.all_gather(&x[..len], &mut y[..2 * len]),
            "broadcast" => c.broadcast(&x[..len], &mut y[..len], 0),
            "all_reduce" => c.all_reduce(&x[..len], &mut y[..len], ReduceOp::Sum),
            _ => c.reduce_scatter(&x[..2 * len], &mut y[..len], ReduceOp::Sum),
        })
    })
}

/// A rank dies while its peer reads its buffers (large all_gathers and all_reduces in a loop, the
/// death timed from a thread): the survivor reports it, within 1 s, naming it.
fn t_single_copy_dead_peer() -> Result<(), String> {
    let mut cfg = LaunchConfig::new(2);
    cfg.shm.single_copy = SingleCopyMode::Always;
    cfg.fail_fast = false;
    cfg.shm.timeout = Duration::from_secs(60);
    let dead = 1;
    let res = launch(&cfg, |mut ctx: RankContext| -> RankResult<String> {
        // 4 MiB per rank: below nt_bytes (8 MiB), where the single-copy path stops.
        let len = 1 << 20;
        let x = vec![1f32; len];
        let mut y = vec![0f32; 2 * len];
        ctx.comm.all_gather(&x, &mut y)?;
        if ctx.rank == dead {
            std::thread::spawn(|| {
                std::thread::sleep(Duration::from_millis(30));
                std::process::abort();
            });
        }
        let mut last = Instant::now();
        loop {
            let r = ctx
                .comm
                .all_gather(&x, &mut y)
                .and_then(|_| ctx.comm.all_reduce(&x, &mut y[..len], ReduceOp::Sum));
            match r {
                Ok(()) => last = Instant::now(),
                Err(e) => return survivor_verdict(e, dead, last.elapsed()),
            }
        }
    });
    survivors_reported(res, Some(dead), [0])
}

/// The tests after the `collectives_world_*` ones ([`WORLD_TESTS`]), in the order they run.
const TESTS: &[runner::Test] = &[
    ("collectives_stage_modes", t_collectives_stage_modes),
    ("all_gather_mixed_in_place", t_all_gather_mixed_in_place),
    ("all_reduce_64mib", t_all_reduce_64mib),
    ("deterministic", t_deterministic),
    ("mismatch", t_mismatch),
    ("dead_peer", t_dead_peer),
    ("peer_left", t_peer_left),
    ("timeout_and_no_spin", t_timeout_and_no_spin),
    ("set_timeout", t_set_timeout),
    ("sleepers_woken", t_sleepers_woken),
    ("named_segment_no_leak", t_named_segment_no_leak),
    ("local_argument_errors", t_local_argument_errors),
    ("oversubscribed_8", t_oversubscribed_8),
    ("world_64", t_world_64),
    ("local_error_on_one_rank", t_local_error_on_one_rank),
    ("tiny_slot_many_ranks", t_tiny_slot_many_ranks),
    ("over_1gib", t_over_1gib),
    ("fast_path", t_fast_path),
    ("fast_mismatch", t_fast_mismatch),
    ("single_copy", t_single_copy),
    ("single_copy_refused", t_single_copy_refused),
    ("single_copy_bits", t_single_copy_bits),
    ("single_copy_auto", t_single_copy_auto),
    ("single_copy_push", t_single_copy_push),
    ("single_copy_mixed", t_single_copy_mixed),
    ("single_copy_mismatch", t_single_copy_mismatch),
    ("single_copy_dead_peer", t_single_copy_dead_peer),
];

fn main() -> std::process::ExitCode {
    let _ = CollKind::ALL;
    let mut r = runner::Runner::new();
    for (name, n, modes) in WORLD_TESTS {
        r.run(name, || {
            modes
                .iter()
                .try_for_each(|&shared| all_collectives_cfg(small_cfg(n), shared))
        });
    }
    for (name, f) in TESTS {
        r.run(name, f);
    }
    r.finish()
}
