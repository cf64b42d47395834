//! Multi-process tests of the exchanges (all_to_all, all_to_all_v, scatter, all_gather_v,
//! gather_v), point-to-point send/recv and groups, and the nonblocking forms, on the
//! shared-memory backend, through the fork launcher.
//!
//! `harness = false`: the process forks, so it stays single-threaded; the binary ends with
//! `N passed, M failed`.

#[path = "common/launched.rs"]
mod launched;
#[path = "common/runner.rs"]
mod runner;

use std::time::{Duration, Instant};

use half::{bf16, f16};
use launched::{
    mismatch_cases, mismatch_message, no_failures, small_slots, survivors_reported, Case, TestElem,
};
use lockstep::comm::{CommError, Communicator, Element, ReduceOp};
use lockstep::launch::{launch, LaunchConfig, LaunchError, RankContext, RankResult};
use lockstep::shm::ShmConfig;

/// Element `i` of what rank `src` sends to rank `dst`: small integers, exact in every dtype, and
/// different for every (src, dst) pair so a misrouted block shows.
fn val<T: TestElem>(src: usize, dst: usize, i: usize) -> T {
    T::from_f64(((src * 31 + dst * 7 + i * 3 + i / 11) % 97) as f64)
}

/// Marks elements that nothing may write.
fn sentinel<T: TestElem>() -> T {
    T::from_f64(99.0)
}

/// Small slots so the exchanges run many rounds and point-to-point messages overflow the
/// mailboxes (one slot at most) on small inputs.
fn cfg(n: usize) -> LaunchConfig {
    small_slots(n, 16 << 20, Duration::from_secs(20))
}

/// Block sizes in elements: empty, one, odd, and above a staging slot (and a mailbox).
fn sizes(n: usize, esz: usize) -> Vec<usize> {
    let slot = ShmConfig {
        slot_bytes: 8192,
        ..ShmConfig::default()
    }
    .normalized_for(n)
    .slot_bytes;
    vec![0, 1, 7, 3 * slot / esz + 5]
}

/// `counts[i][j]`: elements rank i sends to rank j in all_to_all_v (some zero, all different).
fn v_count(i: usize, j: usize, len: usize) -> usize {
    if (i + 2 * j) % 4 == 3 {
        0
    } else {
        len * ((i + j) % 3 + 1) / 2 + (i + j) % 2
    }
}

/// Displacements of blocks of `counts`, each followed by a one-element gap.
fn displs(counts: &[usize]) -> (Vec<usize>, usize) {
    let mut d = Vec::new();
    let mut at = 0;
    for &c in counts {
        d.push(at);
        at += c + 1;
    }
    (d, at)
}

/// Run every exchange on dtype T; returns failure messages.
/// A send buffer: an ordinary vector, or a copy in the rank's shared heap (the zero-copy path).
enum Src<T: Element> {
    Own(Vec<T>),
    Shared(lockstep::SharedBuffer<T>),
}

impl<T: Element> std::ops::Deref for Src<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            Src::Own(v) => v,
            Src::Shared(s) => s,
        }
    }
}

fn src<T: Element>(c: &mut Communicator, v: Vec<T>, shared: bool) -> Result<Src<T>, CommError> {
    if !shared || v.is_empty() {
        return Ok(Src::Own(v));
    }
    let mut s = c.alloc_shared::<T>(v.len())?;
    s.copy_from_slice(&v);
    Ok(Src::Shared(s))
}

fn check_exchanges<T: TestElem>(c: &mut Communicator) -> Result<Vec<String>, CommError> {
    let mut bad = check_exchanges_with::<T>(c, false)?;
    bad.extend(
        check_exchanges_with::<T>(c, true)?
            .into_iter()
            .map(|b| format!("{b} (shared send buffers)")),
    );
    Ok(bad)
}

fn check_exchanges_with<T: TestElem>(
    c: &mut Communicator,
    shared: bool,
) -> Result<Vec<String>, CommError> {
    let (me, n) = (c.rank(), c.world_size());
    let dt = T::DTYPE;
    let mut bad = Vec::new();
    for len in sizes(n, dt.size()) {
        // all_to_all (and its async form on the last size).
        let send: Vec<T> = (0..n * len)
            .map(|k| val(me, k / len.max(1), k % len.max(1)))
            .collect();
        let send = src(c, send, shared)?;
        let mut recv = vec![sentinel::<T>(); n * len];
        if len > 7 {
            c.start(|x| x.all_to_all(&send[..], &mut recv)).wait()?;
        } else {
            c.all_to_all(&send[..], &mut recv)?;
        }
        if let Some(k) = (0..n * len).find(|&k| recv[k] != val(k / len, me, k % len)) {
            bad.push(format!("all_to_all {dt} len {len}: [{k}] = {:?}", recv[k]));
        }
        // all_to_all_v with gaps between blocks, which must stay untouched.
        let sc: Vec<usize> = (0..n).map(|j| v_count(me, j, len)).collect();
        let rc: Vec<usize> = (0..n).map(|i| v_count(i, me, len)).collect();
        let ((sd, slen), (rd, rlen)) = (displs(&sc), displs(&rc));
        let mut send = vec![sentinel::<T>(); slen];
        for j in 0..n {
            for i in 0..sc[j] {
                send[sd[j] + i] = val(me, j, i);
            }
        }
        let send = src(c, send, shared)?;
        let mut recv = vec![sentinel::<T>(); rlen];
        c.all_to_all_v(&send[..], &sc, &sd, &mut recv, &rc, &rd)?;
        let want: Vec<T> = (0..n)
            .flat_map(|i| (0..rc[i]).map(move |k| val(i, me, k)).chain([sentinel()]))
            .collect();
        if let Some(k) = (0..rlen).find(|&k| recv[k] != want[k]) {
            bad.push(format!(
                "all_to_all_v {dt} len {len}: [{k}] = {:?}",
                recv[k]
            ));
        }
        // scatter from the last rank; other ranks pass an empty send.
        let root = n - 1;
        let send: Vec<T> = if me == root {
            (0..n * len)
                .map(|k| val(root, k / len.max(1), k % len.max(1)))
                .collect()
        } else {
            vec![]
        };
        let send = src(c, send, shared)?;
        let mut recv = vec![sentinel::<T>(); len];
        c.scatter(&send[..], &mut recv, root)?;
        if let Some(k) = (0..len).find(|&k| recv[k] != val(root, me, k)) {
            bad.push(format!("scatter {dt} len {len}: [{k}] = {:?}", recv[k]));
        }
        // all_gather_v and gather_v with per-rank lengths.
        let counts: Vec<usize> = (0..n).map(|r| v_count(r, r + 1, len)).collect();
        let send: Vec<T> = (0..counts[me]).map(|k| val(me, 0, k)).collect();
        let send = src(c, send, shared)?;
        let total: usize = counts.iter().sum();
        let want: Vec<T> = (0..n)
            .flat_map(|r| (0..counts[r]).map(move |k| val(r, 0, k)))
            .collect();
        let mut recv = vec![sentinel::<T>(); total];
        c.all_gather_v(&send[..], &mut recv, &counts)?;
        if let Some(k) = (0..total).find(|&k| recv[k] != want[k]) {
            bad.push(format!(
                "all_gather_v {dt} len {len}: [{k}] = {:?}",
                recv[k]
            ));
        }
        let root = n / 2;
        let mut recv = if me == root {
            vec![sentinel::<T>(); total]
        } else {
            vec![]
        };
        let rcounts: &[usize] = if me == root { &counts } else { &[] };
        c.gather_v(&send[..], &mut recv, rcounts, root)?;
        if me == root {
            if let Some(k) = (0..total).find(|&k| recv[k] != want[k]) {
                bad.push(format!("gather_v {dt} len {len}: [{k}] = {:?}", recv[k]));
            }
        }
    }
    Ok(bad)
}

/// Plain send/recv from every rank to every other (ordered so nothing waits in a cycle), then the
/// group patterns; returns failure messages.
fn check_p2p<T: TestElem>(c: &mut Communicator) -> Result<Vec<String>, CommError> {
    let (me, n) = (c.rank(), c.world_size());
    let dt = T::DTYPE;
    let mut bad = Vec::new();
    let mut check = |what: &str, got: &[T], src: usize, salt: usize| {
        if let Some(k) = (0..got.len()).find(|&k| got[k] != val(src, me + salt, k)) {
            bad.push(format!(
                "{what} {dt} len {} from {src}: [{k}] = {:?}",
                got.len(),
                got[k]
            ));
        }
    };
    for len in sizes(n, dt.size()) {
        // Plain: for each pair (a < b), a sends then receives, b receives then sends.
        for peer in (0..n).filter(|&p| p != me) {
            let out: Vec<T> = (0..len).map(|k| val(me, peer, k)).collect();
            let mut inb = vec![sentinel::<T>(); len];
            if me < peer {
                c.send(&out, peer)?;
                c.start(|x| x.recv(&mut inb, peer)).wait()?;
            } else {
                c.recv(&mut inb, peer)?;
                c.start(|x| x.send(&out, peer)).wait()?;
            }
            check("send/recv", &inb, peer, 0);
        }
        // Ring: everyone sends right and receives from the left, in one group.
        let (right, left) = ((me + 1) % n, (me + n - 1) % n);
        let out: Vec<T> = (0..len).map(|k| val(me, right, k)).collect();
        let mut inb = vec![sentinel::<T>(); len];
        c.group(|g| {
            g.send(&out, right)?;
            g.recv(&mut inb, left)
        })?;
        check("ring", &inb, left, 0);
        // All pairs, oneself included, in one group: every send posted before every recv.
        let outs: Vec<Vec<T>> = (0..n)
            .map(|p| (0..len).map(|k| val(me, p, k)).collect())
            .collect();
        let mut ins: Vec<Vec<T>> = vec![vec![sentinel::<T>(); len]; n];
        c.group(|g| {
            for (p, o) in outs.iter().enumerate() {
                g.send(o, p)?;
            }
            for (p, i) in ins.iter_mut().enumerate() {
                g.recv(i, p)?;
            }
            Ok(())
        })?;
        for (p, i) in ins.iter().enumerate() {
            check("all-pairs", i, p, 0);
        }
    }
    // Pipeline: three messages of different sizes (above a mailbox) down the line 0 → 1 → …,
    // each rank receiving from the previous and sending to the next in one group: in order per pair.
    let big = sizes(n, dt.size())[3];
    let lens = [big, 3, big / 2];
    let outs: Vec<Vec<T>> = lens
        .iter()
        .enumerate()
        .map(|(m, &l)| (0..l).map(|k| val(me, me + 1 + m, k)).collect())
        .collect();
    let mut ins: Vec<Vec<T>> = lens.iter().map(|&l| vec![sentinel::<T>(); l]).collect();
    c.group(|g| {
        if me + 1 < n {
            for o in &outs {
                g.send(o, me + 1)?;
            }
        }
        if me > 0 {
            for i in ins.iter_mut() {
                g.recv(i, me - 1)?;
            }
        }
        Ok(())
    })?;
    if me > 0 {
        for (m, i) in ins.iter().enumerate() {
            check("pipeline", i, me - 1, m);
        }
    }
    Ok(bad)
}

macro_rules! every_dtype {
    ($f:ident, $c:expr) => {{
        let mut bad = Vec::new();
        bad.extend($f::<f32>($c)?);
        bad.extend($f::<f64>($c)?);
        bad.extend($f::<f16>($c)?);
        bad.extend($f::<bf16>($c)?);
        bad.extend($f::<i32>($c)?);
        bad.extend($f::<i64>($c)?);
        bad.extend($f::<u8>($c)?);
        bad.extend($f::<i8>($c)?);
        bad.extend($f::<u32>($c)?);
        bad.extend($f::<u64>($c)?);
        bad
    }};
}

/// A job whose ranks return their failures as a list: none may have any.
fn report(out: Result<Vec<Vec<String>>, LaunchError>) -> Result<(), String> {
    no_failures("", out.map_err(|e| e.to_string())?)
}

fn t_exchanges() -> Result<(), String> {
    // Default paths (staged, direct copies for large blocks, zero-copy from shared buffers), and
    // with every direct copy refused (the ranks agree on it and stage instead).
    for refuse in [false, true] {
        exchanges(refuse).map_err(|e| {
            if refuse {
                format!("direct copies refused: {e}")
            } else {
                e
            }
        })?;
    }
    Ok(())
}

fn exchanges(refuse: bool) -> Result<(), String> {
    for n in 1..=5 {
        let t = Instant::now();
        let mut cfg = cfg(n);
        if refuse {
            cfg.shm.cma_bytes = 1;
            cfg.shm.fault_refuse_direct = true;
        }
        report(launch(
            &cfg,
            |mut ctx: RankContext| -> RankResult<Vec<String>> {
                Ok(every_dtype!(check_exchanges, &mut ctx.comm))
            },
        ))
        .map_err(|e| format!("world {n}: {e}"))?;
        if t.elapsed() > Duration::from_secs(10) {
            return Err(format!("world {n} took {:?}", t.elapsed()));
        }
    }
    Ok(())
}

/// Every path a message can take, as `(name, cma_bytes, refuse)`: the fast box (small), the
/// mailbox stream, and the direct copy from the sender's memory (large; default threshold); then
/// with direct copies off; and with every direct copy refused by the receiver (fallback to the
/// stream mid-message).
fn paths() -> [(&'static str, usize, bool); 3] {
    [
        ("default", ShmConfig::default().cma_bytes, false),
        ("mailbox only", 0, false),
        ("direct copies refused", 1, true),
    ]
}

/// [`cfg`] of `n` ranks on the path of [`paths`] with `cma_bytes` and `refuse`.
fn path_cfg(n: usize, cma_bytes: usize, refuse: bool) -> LaunchConfig {
    let mut c = cfg(n);
    c.shm.cma_bytes = cma_bytes;
    c.shm.fault_refuse_direct = refuse;
    c
}

fn t_p2p_and_groups() -> Result<(), String> {
    for (path, cma_bytes, refuse) in paths() {
        for n in 1..=5 {
            p2p_and_groups(n, path_cfg(n, cma_bytes, refuse))
                .map_err(|e| format!("{path}: {e}"))?;
        }
    }
    Ok(())
}

fn p2p_and_groups(n: usize, cfg: LaunchConfig) -> Result<(), String> {
    {
        let t = Instant::now();
        report(launch(
            &cfg,
            |mut ctx: RankContext| -> RankResult<Vec<String>> {
                let mut bad = every_dtype!(check_p2p, &mut ctx.comm);
                // Point-to-point traffic left the collectives in step.
                let mut x = vec![1u32; 100];
                ctx.comm
                    .start(|c| c.all_reduce_in_place(&mut x, ReduceOp::Sum))
                    .wait()?;
                if x.iter().any(|&v| v as usize != ctx.world_size) {
                    bad.push("all_reduce after point-to-point is wrong".into());
                }
                Ok(bad)
            },
        ))
        .map_err(|e| format!("world {n}: {e}"))?;
        if t.elapsed() > Duration::from_secs(10) {
            return Err(format!("world {n} took {:?}: a group waited", t.elapsed()));
        }
    }
    Ok(())
}

/// The nonblocking collectives give the same results as the blocking ones.
fn t_async_forms() -> Result<(), String> {
    report(launch(
        &cfg(3),
        |mut ctx: RankContext| -> RankResult<Vec<String>> {
            let c = &mut ctx.comm;
            let (me, n) = (c.rank(), c.world_size());
            let mut bad = Vec::new();
            let send: Vec<f32> = (0..3000).map(|i| (i % 7 + me) as f32).collect();
            let mut a = vec![0f32; 3000];
            let w = c.start(|x| x.all_reduce(&send, &mut a, ReduceOp::Sum));
            if !w.is_completed() {
                bad.push("host work not completed".into());
            }
            w.wait()?;
            if (0..3000).any(|i| a[i] != (3 * (i % 7) + 3) as f32) {
                bad.push("all_reduce_async".into());
            }
            let mut b = vec![0f32; 3000];
            c.start(|x| x.broadcast(&send, &mut b, 1)).wait()?;
            if (0..3000).any(|i| b[i] != (i % 7 + 1) as f32) {
                bad.push("broadcast_async".into());
            }
            let mut g = vec![0f32; 3000 * n];
            c.start(|x| x.all_gather(&send, &mut g)).wait()?;
            if (0..3000 * n).any(|i| g[i] != (i % 3000 % 7 + i / 3000) as f32) {
                bad.push("all_gather_async".into());
            }
            let mut r = vec![0f32; 1000];
            c.start(|x| x.reduce_scatter(&send, &mut r, ReduceOp::Max))
                .wait()?;
            if (0..1000).any(|i| r[i] != ((me * 1000 + i) % 7 + 2) as f32) {
                bad.push("reduce_scatter_async".into());
            }
            // An error comes back through the handle.
            match c.start(|x| x.all_to_all(&send[..10], &mut a[..10])).wait() {
                Err(CommError::InvalidArgument { .. }) => {}
                other => bad.push(format!(
                    "all_to_all_async of 10 on 3 ranks should be refused: {other:?}"
                )),
            }
            Ok(bad)
        },
    ))
}

/// Disagreements are a Mismatch on every rank involved, naming who passed what; the collectives
/// stay usable afterwards.
fn t_mismatch() -> Result<(), String> {
    let cases: &[Case] = &[
        (
            "p2p_count",
            &[&["send(count=10, dtype=f32)", "recv(count=11, dtype=f32)"]],
        ),
        (
            "p2p_dtype",
            &[&["send(count=10, dtype=f32)", "recv(count=10, dtype=i32)"]],
        ),
        (
            "p2p_group",
            &[&["send(count=10, dtype=f32)", "recv(count=11, dtype=f32)"]],
        ),
        (
            "a2av",
            &[&["rank 0 sends 3 elements to rank 1 but rank 1 expects 4 from rank 0"]],
        ),
        ("a2a", &[&["all_to_all(count=5", "all_to_all(count=6"]]),
        (
            "scatter",
            &[&["scatter(count=5, dtype=f32, root=0)", "root=1"]],
        ),
        (
            "agv",
            &[&[
                "all_gather_v counts disagree",
                "rank 1 sends 2 elements to rank 0 but rank 0 expects 3 from rank 1",
            ]],
        ),
        (
            "gv",
            &[&[
                "gather_v counts disagree",
                "rank 1 sends 2 elements to rank 0 but rank 0 expects 3 from rank 1",
            ]],
        ),
    ];
    // Collectives still work afterwards: an all-reduce of 1000.
    mismatch_cases(&cfg(2), cases, 1000, |case, me, c| {
        let x = vec![1f32; 12];
        let mut y = vec![0f32; 12];
        let r = match (case, me) {
            ("p2p_count", 0) => c.send(&x[..10], 1),
            ("p2p_count", _) => c.recv(&mut y[..11], 0),
            ("p2p_dtype", 0) => c.send(&x[..10], 1),
            ("p2p_dtype", _) => c.recv(&mut [0i32; 10], 0),
            ("p2p_group", 0) => c.group(|g| {
                g.send(&x[..10], 1)?;
                g.recv(&mut y[..1], 1)
            }),
            ("p2p_group", _) => c.group(|g| {
                g.send(&x[..1], 0)?;
                g.recv(&mut y[..11], 0)
            }),
            ("a2av", _) => {
                let (sc, rc): ([usize; 2], [usize; 2]) = if me == 0 {
                    ([1, 3], [1, 2])
                } else {
                    ([2, 2], [4, 2])
                };
                c.all_to_all_v(&x, &sc, &[0, 4], &mut y, &rc, &[0, 6])
            }
            ("a2a", _) => c.all_to_all(&x[..10 + 2 * me], &mut y[..10 + 2 * me]),
            ("scatter", _) => c.scatter(&x[..10], &mut y[..5], me),
            ("agv", _) => {
                let counts: [usize; 2] = if me == 0 { [1, 3] } else { [1, 2] };
                c.all_gather_v(&x[..counts[me]], &mut y[..4 - me], &counts)
            }
            ("gv", _) => {
                let counts: [usize; 2] = [1, 3];
                let s = if me == 0 { 1 } else { 2 };
                c.gather_v(&x[..s], &mut y[..4], &counts, 0)
            }
            _ => unreachable!(),
        };
        Ok(mismatch_message(r)?.to_lowercase())
    })
}

/// A rank that dies while its peer waits for it in each new operation: the peer gets PeerLost
/// naming it, within a second.
fn t_dead_peer() -> Result<(), String> {
    let ops = [
        "recv",
        "send_big",
        "group",
        "all_to_all",
        "all_to_all_v",
        "scatter",
        "all_gather_v",
        "gather_v",
    ];
    for op in ops {
        let mut cfg = cfg(2);
        cfg.fail_fast = false;
        let res = launch(&cfg, |mut ctx: RankContext| -> RankResult<String> {
            let c = &mut ctx.comm;
            if ctx.rank == 1 {
                std::thread::sleep(Duration::from_millis(50));
                std::process::abort();
            }
            let big = vec![1f32; 100_000];
            let mut out = vec![0f32; 100_000];
            let t = Instant::now();
            let r = match op {
                "recv" => c.recv(&mut out, 1),
                "send_big" => c.send(&big, 1),
                "group" => c.group(|g| {
                    g.send(&big, 1)?;
                    g.recv(&mut out, 1)
                }),
                "all_to_all" => c.all_to_all(&big, &mut out),
                "all_to_all_v" => {
                    c.all_to_all_v(&big, &[10, 10], &[0, 10], &mut out, &[10, 10], &[0, 10])
                }
                "scatter" => c.scatter(&big, &mut out[..50_000], 0),
                "all_gather_v" => c.all_gather_v(&big[..10], &mut out[..20], &[10, 10]),
                _ => c.gather_v(&big[..10], &mut out[..20], &[10, 10], 0),
            };
            let e = r.err().ok_or("no error")?;
            let took = t.elapsed();
            if took > Duration::from_secs(1) {
                return Err(format!("{op}: detection took {took:?}").into());
            }
            if !matches!(e, CommError::PeerLost { lost_rank: 1, .. })
                || !e.to_string().contains("died")
            {
                return Err(format!("{op}: error is not PeerLost naming rank 1: {e}").into());
            }
            // A poisoned communicator refuses further work.
            if c.send(&big[..1], 1).is_ok() {
                return Err(format!("{op}: send after a lost peer succeeded").into());
            }
            Err(format!("OK-SURVIVOR {e}").into())
        });
        survivors_reported(res, None, [0]).map_err(|e| format!("{op}: {e}"))?;
    }
    Ok(())
}

/// A job of `n` ranks with a 500 ms timeout in which only rank 0 makes a call, `wait`, while the
/// others sleep past the timeout: `wait` must give rank 0 a timeout error that holds `needle`.
fn rank0_times_out(
    n: usize,
    needle: &str,
    wait: impl FnOnce(&mut Communicator) -> RankResult<String>,
) -> Result<(), String> {
    let mut c = cfg(n);
    c.shm.timeout = Duration::from_millis(500);
    let out = launch(&c, |mut ctx: RankContext| -> RankResult<String> {
        if ctx.rank != 0 {
            std::thread::sleep(Duration::from_millis(1200));
            return Ok(String::new());
        }
        wait(&mut ctx.comm)
    })
    .map_err(|e| e.to_string())?;
    if !out[0].contains(needle) {
        return Err(format!(
            "rank 0's timeout does not say '{needle}': {}",
            out[0]
        ));
    }
    Ok(())
}

/// The message of the timeout error that `r` must be; any other outcome is this rank's failure.
fn timeout_message<T: std::fmt::Debug>(r: Result<T, CommError>) -> RankResult<String> {
    match r {
        Err(e @ CommError::Timeout { .. }) => Ok(e.to_string()),
        other => Err(format!("expected a timeout, got {other:?}").into()),
    }
}

/// A recv whose sender never sends times out naming that peer; invalid arguments are refused
/// locally (and, for collectives, on the peers as a mismatch).
fn t_timeout_and_local_errors() -> Result<(), String> {
    rank0_times_out(2, "recv from rank 1: rank 1 has not sent", |c| {
        timeout_message(c.recv(&mut [0u64; 4], 1))
    })?;
    let out = launch(&cfg(2), |mut ctx: RankContext| -> RankResult<Vec<String>> {
        let c = &mut ctx.comm;
        let me = ctx.rank;
        let mut bad = Vec::new();
        let x = [1f32; 8];
        let mut y = [0f32; 8];
        for (what, r) in [
            ("send to self", c.send(&x, me)),
            ("peer out of range", c.recv(&mut y, 2)),
            ("unpaired self send in a group", c.group(|g| g.send(&x, me))),
        ] {
            if !matches!(r, Err(CommError::InvalidArgument { .. })) {
                bad.push(format!("{what}: {r:?}"));
            }
        }
        // Rank 0's displacement runs past its buffer: refused there, a mismatch on rank 1.
        let d = if me == 0 { [0, 7] } else { [0, 4] };
        let r = c.all_to_all_v(&x, &[4, 4], &d, &mut y, &[4, 4], &[0, 4]);
        match (me, &r) {
            (0, Err(CommError::InvalidArgument { .. })) | (1, Err(CommError::Mismatch { .. })) => {}
            _ => bad.push(format!("all_to_all_v with a bad displacement: {r:?}")),
        }
        let r = c.all_gather_v(&x[..2], &mut y[..5], &[2, 2]);
        if !matches!(r, Err(CommError::InvalidArgument { .. })) {
            bad.push(format!("all_gather_v with a short recv: {r:?}"));
        }
        // Still in step.
        let mut z = [1u64; 3];
        c.all_reduce_in_place(&mut z, ReduceOp::Sum)?;
        if z != [2; 3] {
            bad.push("all_reduce after refused calls".into());
        }
        Ok(bad)
    });
    report(out)
}

/// Element `k` of message `m` from rank `src` in the any-source tests: names the sender, the
/// message and the element, so a payload shows where it came from.
fn tagged(src: usize, m: usize, k: usize) -> u32 {
    ((src as u32) << 24) | ((m as u32) << 16) | (k as u32 & 0xffff)
}

/// Receives from any source: every other rank sends `per` messages to rank 0, which takes them
/// all with `recv_any`; each payload must come from the rank reported, and each rank's messages
/// in the order sent. Sizes cover the fast box, the mailbox stream (above a mailbox) and the
/// direct copy; then the same in groups mixed with ordinary sends and receives.
fn t_any_source() -> Result<(), String> {
    for (path, cma_bytes, refuse) in paths() {
        for n in [2, 3, 5] {
            let c = path_cfg(n, cma_bytes, refuse);
            let t = Instant::now();
            report(launch(
                &c,
                |mut ctx: RankContext| -> RankResult<Vec<String>> {
                    any_source_checks(&mut ctx.comm).map_err(Into::into)
                },
            ))
            .map_err(|e| format!("{path}, world {n}: {e}"))?;
            if t.elapsed() > Duration::from_secs(10) {
                return Err(format!("{path}, world {n} took {:?}", t.elapsed()));
            }
        }
    }
    Ok(())
}

fn any_source_checks(c: &mut Communicator) -> Result<Vec<String>, CommError> {
    let (me, n) = (c.rank(), c.world_size());
    let mut bad = Vec::new();
    let big = sizes(n, 4)[3];
    let per = 3;
    for len in [1, 7, big, 40_000] {
        if me != 0 {
            for m in 0..per {
                let out: Vec<u32> = (0..len).map(|k| tagged(me, m, k)).collect();
                c.send(&out, 0)?;
            }
        } else {
            // next[r]: the message expected next from rank r.
            let mut next = vec![0; n];
            for _ in 0..(n - 1) * per {
                let mut inb = vec![u32::MAX; len];
                let from = c.recv_any(&mut inb)?;
                if from == 0 || from >= n {
                    bad.push(format!("len {len}: recv_any reported rank {from}"));
                    continue;
                }
                let m = next[from];
                next[from] += 1;
                if let Some(k) = (0..len).find(|&k| inb[k] != tagged(from, m, k)) {
                    bad.push(format!(
                        "len {len}: message #{m} reported from rank {from}: [{k}] = {:#x}, expected {:#x}",
                        inb[k],
                        tagged(from, m, k)
                    ));
                }
            }
            if next[1..].iter().any(|&k| k != per) {
                bad.push(format!("len {len}: messages per sender {next:?}"));
            }
        }
        // The next size's messages must not meet this size's receives from any source.
        c.barrier()?;
    }
    // In a group where every rank sends first: rank 0 sends to each other rank and takes their
    // messages from any source; rank 1 sends two, and rank 0's receive from rank 1, posted
    // before the receives from any source, takes the first of them.
    for len in [5, big] {
        let out: Vec<u32> = (0..len).map(|k| tagged(me, 0, k)).collect();
        let out2: Vec<u32> = (0..len).map(|k| tagged(me, 1, k)).collect();
        let mut back = vec![u32::MAX; len];
        if me == 0 {
            let mut first = vec![u32::MAX; len];
            let mut ins = vec![vec![u32::MAX; len]; n - 1];
            let mut from = vec![usize::MAX; n - 1];
            c.group(|g| {
                for p in 1..n {
                    g.send(&out, p)?;
                }
                g.recv(&mut first, 1)?;
                for (i, f) in ins.iter_mut().zip(from.iter_mut()) {
                    g.recv_any(i, f)?;
                }
                Ok(())
            })?;
            if (0..len).any(|k| first[k] != tagged(1, 0, k)) {
                bad.push(format!(
                    "group len {len}: the recv from rank 1 did not take its first message"
                ));
            }
            let mut seen = from.clone();
            seen.sort();
            if seen != (1..n).collect::<Vec<_>>() {
                bad.push(format!("group len {len}: senders {from:?}"));
            }
            for (i, &f) in ins.iter().zip(&from) {
                let m = usize::from(f == 1);
                if f < n && (0..len).any(|k| i[k] != tagged(f, m, k)) {
                    bad.push(format!(
                        "group len {len}: payload reported from rank {f} is not its message #{m}"
                    ));
                }
            }
        } else {
            c.group(|g| {
                g.send(&out, 0)?;
                if me == 1 {
                    g.send(&out2, 0)?;
                }
                g.recv(&mut back, 0)
            })?;
            if (0..len).any(|k| back[k] != tagged(0, 0, k)) {
                bad.push(format!(
                    "group len {len}: rank {me} got a wrong message from rank 0"
                ));
            }
        }
        c.barrier()?;
    }
    // A receive from any source posted before one from rank 1: the earlier one takes rank 1's
    // first message (the later one waits until it has matched), the later one the second.
    if n == 3 {
        if me == 1 {
            c.send(&[tagged(1, 0, 0)], 0)?;
            c.send(&[tagged(1, 1, 0)], 0)?;
        } else if me == 0 {
            let (mut a, mut b, mut from) = ([0u32], [0u32], usize::MAX);
            c.group(|g| {
                g.recv_any(&mut a, &mut from)?;
                g.recv(&mut b, 1)
            })?;
            if (from, a[0], b[0]) != (1, tagged(1, 0, 0), tagged(1, 1, 0)) {
                bad.push(format!(
                    "any source before a named source: from {from}, {:#x}, {:#x}",
                    a[0], b[0]
                ));
            }
        }
    }
    // Point-to-point traffic left the collectives in step.
    let mut x = [1u32; 10];
    c.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
    if x.iter().any(|&v| v as usize != n) {
        bad.push("all_reduce after receives from any source is wrong".into());
    }
    Ok(bad)
}

/// A receive from any source whose message disagrees in count or dtype: a Mismatch on both
/// ranks, naming both calls; the pair is unusable afterwards, so later receives from any source
/// take the other ranks' messages; the collectives stay usable.
fn t_any_source_mismatch() -> Result<(), String> {
    let cases: [Case; 2] = [
        (
            "count",
            &[
                &["send(count=10, dtype=f32)", "recv(count=11, dtype=f32)"],
                &["send(count=10, dtype=f32)", "recv(count=11, dtype=f32)"],
                &["ok"],
            ],
        ),
        (
            "dtype",
            &[
                &["send(count=10, dtype=f32)", "recv(count=10, dtype=i32)"],
                &["send(count=10, dtype=f32)", "recv(count=10, dtype=i32)"],
                &["ok"],
            ],
        ),
    ];
    // Collectives still work afterwards: an all-reduce of 1000.
    mismatch_cases(&cfg(3), &cases, 1000, |case, me, c| {
        let x = [1f32; 12];
        let mut msg = "ok".to_string();
        match me {
            0 => {
                let r = if case == "count" {
                    c.recv_any(&mut vec![0f32; 11])
                } else {
                    c.recv_any(&mut [0i32; 10])
                };
                msg = mismatch_message(r.map(drop))?.to_lowercase();
            }
            1 => {
                msg = mismatch_message(c.send(&x[..10], 0))?.to_lowercase();
            }
            _ => {}
        }
        // Rank 2 sends once rank 1's mismatch is over: rank 0 takes it, not the broken
        // pair's leftovers.
        c.barrier()?;
        if me == 2 {
            c.send(&[7u64], 0)?;
        } else if me == 0 {
            let mut y = [0u64];
            let from = c.recv_any(&mut y)?;
            if (from, y[0]) != (2, 7) {
                return Err(format!("after the mismatch: from {from}, {}", y[0]).into());
            }
        }
        Ok(msg)
    })
}

fn sigkill_self() -> ! {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::this(), nix::sys::signal::Signal::SIGKILL);
    std::process::abort()
}

/// Lost senders: once every other rank is gone, a receive from any source fails with PeerLost
/// within a second, naming the one that died; while one is there it waits for it (and takes its
/// message); a message a rank completed before dying is still received; with no sender, it
/// times out naming the ranks it waited on; with one rank, it is refused.
fn t_any_source_lost() -> Result<(), String> {
    // All senders killed.
    let mut c3 = cfg(3);
    c3.fail_fast = false;
    let res = launch(&c3, |mut ctx: RankContext| -> RankResult<String> {
        if ctx.rank != 0 {
            std::thread::sleep(Duration::from_millis(50));
            sigkill_self();
        }
        let mut out = [0f32; 4];
        let t = Instant::now();
        let e = ctx.comm.recv_any(&mut out).err().ok_or("no error")?;
        let took = t.elapsed();
        if took > Duration::from_secs(1) {
            return Err(format!("detection took {took:?}").into());
        }
        let m = e.to_string();
        if !matches!(e, CommError::PeerLost { .. })
            || !m.contains("died")
            || !m.contains("from any source")
        {
            return Err(format!("error is not PeerLost naming the dead ranks: {m}").into());
        }
        Err(format!("OK-SURVIVOR {m}").into())
    });
    survivor(res, "all senders killed")?;
    // One killed, the other sends late: taken; then, with both gone, PeerLost at once.
    let res = launch(&c3, |mut ctx: RankContext| -> RankResult<String> {
        match ctx.rank {
            1 => {
                std::thread::sleep(Duration::from_millis(50));
                sigkill_self();
            }
            2 => {
                std::thread::sleep(Duration::from_millis(400));
                ctx.comm.send(&[2.5f32; 4], 0)?;
                return Ok(String::new());
            }
            _ => {}
        }
        let mut out = [0f32; 4];
        let from = ctx.comm.recv_any(&mut out)?;
        if from != 2 || out != [2.5; 4] {
            return Err(format!("expected rank 2's message, got {out:?} from {from}").into());
        }
        let t = Instant::now();
        let e = ctx.comm.recv_any(&mut out).err().ok_or("no error")?;
        let took = t.elapsed();
        let m = e.to_string();
        if took > Duration::from_secs(1) {
            return Err(format!("detection took {took:?}: {m}").into());
        }
        if !matches!(e, CommError::PeerLost { lost_rank: 1, .. }) || !m.contains("rank 2") {
            return Err(format!("error is not PeerLost naming rank 1 (and rank 2): {m}").into());
        }
        Err(format!("OK-SURVIVOR {m}").into())
    });
    survivor(res, "one sender killed")?;
    // A message sent before the sender died (it waits in the mailbox) is received.
    let mut c2 = cfg(2);
    c2.fail_fast = false;
    let res = launch(&c2, |mut ctx: RankContext| -> RankResult<String> {
        if ctx.rank == 1 {
            std::thread::spawn(|| {
                std::thread::sleep(Duration::from_millis(100));
                sigkill_self();
            });
            ctx.comm.send(&[9u32; 3], 0)?;
            std::thread::sleep(Duration::from_secs(5));
            return Err("not killed".into());
        }
        std::thread::sleep(Duration::from_millis(400));
        let mut out = [0u32; 3];
        let from = ctx.comm.recv_any(&mut out)?;
        if from != 1 || out != [9; 3] {
            return Err(
                format!("expected the dead rank's message, got {out:?} from {from}").into(),
            );
        }
        let e = ctx.comm.recv_any(&mut out).err().ok_or("no error")?;
        if !matches!(e, CommError::PeerLost { lost_rank: 1, .. }) {
            return Err(format!("error is not PeerLost naming rank 1: {e}").into());
        }
        Err(format!("OK-SURVIVOR {e}").into())
    });
    survivor(res, "message before death")?;
    // No sender: a timeout naming the ranks waited on.
    rank0_times_out(
        3,
        "no message arrived from any of ranks [1, 2]",
        |c| match c.recv_any(&mut [0u64; 4]) {
            Err(CommError::Timeout { missing, .. }) if missing != [1, 2] => {
                Err(format!("the timeout lists {missing:?} as missing, not [1, 2]").into())
            }
            r => timeout_message(r),
        },
    )?;
    // One rank: refused, alone and in a group.
    let out = launch(&cfg(1), |mut ctx: RankContext| -> RankResult<Vec<String>> {
        let mut bad = Vec::new();
        let mut b = [0u8; 2];
        let mut from = 0;
        for (what, r) in [
            ("recv_any", ctx.comm.recv_any(&mut b).map(|_| ())),
            ("group", ctx.comm.group(|g| g.recv_any(&mut b, &mut from))),
        ] {
            if !matches!(&r, Err(CommError::InvalidArgument { detail, .. }) if detail.contains("one rank only"))
            {
                bad.push(format!("{what} on one rank: {r:?}"));
            }
        }
        Ok(bad)
    });
    report(out)
}

/// The launch of a test whose rank 0 must end with an `OK-SURVIVOR` error.
fn survivor(res: Result<Vec<String>, LaunchError>, what: &str) -> Result<(), String> {
    survivors_reported(res, None, [0]).map_err(|e| format!("{what}: {e}"))
}

fn main() -> std::process::ExitCode {
    runner::run(&[
        ("exchanges", t_exchanges),
        ("p2p_and_groups", t_p2p_and_groups),
        ("async_forms", t_async_forms),
        ("mismatch", t_mismatch),
        ("dead_peer", t_dead_peer),
        ("timeout_and_local_errors", t_timeout_and_local_errors),
        ("any_source", t_any_source),
        ("any_source_mismatch", t_any_source_mismatch),
        ("any_source_lost", t_any_source_lost),
    ])
}
