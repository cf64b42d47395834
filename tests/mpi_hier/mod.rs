//! The hierarchical communicator (`Communicator::from_env` under `mpiexec` with `LOCKSTEP_MPI=on`):
//! 4 ranks as 2 nodes × 2 (and as 4 nodes × 1), every collective it supports, every op and
//! dtype, reductions bit-identical to `lockstep::reference::reduce` in node-major order; and the
//! faults (a mismatch, a stuck rank, a killed rank) failing every rank with lockstep's messages.

use std::fmt::Debug;
use std::process::ExitCode;
use std::time::Duration;

use lockstep::comm::BackendKind;
use lockstep::half::{bf16, f16};
use lockstep::mpi::Mpi;
use lockstep::{reference, CommError, Communicator, Element, ReduceOp};

use super::{abi_mpiexec, common, mpiexec_4, CHILD};

/// Which fault the ranks stage (`LOCKSTEP_TEST_HIER_FAULT`).
const FAULT: &str = "LOCKSTEP_TEST_HIER_FAULT";

/// A test input: mixed magnitudes, so the order of additions shows in the result.
trait Gen: Element + Debug {
    fn make(rank: usize, i: usize) -> Self;
}

fn wave(rank: usize, i: usize) -> f64 {
    let mag = 10f64.powi(((i * 7 + rank * 3) % 9) as i32 - 4);
    ((i as f64) * 0.37 + rank as f64 * 1.3 + 0.1).sin() * mag
}

macro_rules! gen_float {
    ($($t:ty => $conv:expr),*) => {$(
        impl Gen for $t {
            fn make(rank: usize, i: usize) -> Self {
                $conv(wave(rank, i))
            }
        }
    )*};
}
gen_float!(f32 => |x: f64| x as f32, f64 => |x: f64| x, f16 => |x: f64| f16::from_f64(x), bf16 => |x: f64| bf16::from_f64(x));

macro_rules! gen_int {
    ($($t:ty),*) => {$(
        impl Gen for $t {
            fn make(rank: usize, i: usize) -> Self {
                ((i * 31 + rank * 17) % 23) as $t
            }
        }
    )*};
}
gen_int!(i8, u8, i32, u32, i64, u64);

fn input<T: Gen>(rank: usize, len: usize) -> Vec<T> {
    (0..len).map(|i| T::make(rank, i)).collect()
}

/// The global ranks in node-major order, as MPI's shared split (or `LOCKSTEP_MPI_NODE_SIZE`)
/// groups them: the order the hierarchical reduction documents.
fn node_major(world: usize) -> Result<Vec<usize>, String> {
    let mpi = Mpi::init().map_err(|e| e.to_string())?;
    let w = mpi.world().map_err(|e| e.to_string())?;
    let node = match std::env::var("LOCKSTEP_MPI_NODE_SIZE") {
        Ok(s) => {
            let s: usize = s
                .parse()
                .map_err(|_| "bad LOCKSTEP_MPI_NODE_SIZE".to_string())?;
            w.split(Some((w.rank() / s) as u32), w.rank() as i32)
                .map_err(|e| e.to_string())?
                .ok_or("no node communicator")?
        }
        Err(_) => w.split_shared().map_err(|e| e.to_string())?,
    };
    let mine = (w.rank() as u64).to_le_bytes();
    let members = node.all_gather_bytes(&mine).map_err(|e| e.to_string())?;
    let lowest = members
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .min()
        .unwrap_or(0);
    let all = w
        .all_gather_bytes(&lowest.to_le_bytes())
        .map_err(|e| e.to_string())?;
    let leader: Vec<u64> = all
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let mut order: Vec<usize> = (0..world).collect();
    order.sort_by_key(|&g| (leader[g], g));
    Ok(order)
}

fn same<T: Debug>(got: &[T], want: &[T], what: &str) -> Result<(), String> {
    if format!("{got:?}") != format!("{want:?}") {
        let i = got
            .iter()
            .zip(want)
            .position(|(a, b)| format!("{a:?}") != format!("{b:?}"))
            .unwrap_or(0);
        return Err(format!(
            "{what}: element {i} is {:?}, the reference says {:?} ({} elements)",
            got.get(i),
            want.get(i),
            want.len()
        ));
    }
    Ok(())
}

fn e(x: CommError) -> String {
    x.to_string()
}

/// Every reduction of one dtype, every op, several sizes (the leaders' path and the rails'),
/// against the reference in node-major order.
fn reductions<T: Gen>(c: &mut Communicator, order: &[usize], lens: &[usize]) -> Result<(), String> {
    let (rank, n) = (c.rank(), c.world_size());
    let name = format!("{:?}", T::DTYPE);
    for &len in lens {
        let inputs: Vec<Vec<T>> = (0..n).map(|r| input::<T>(r, len)).collect();
        let ordered: Vec<&[T]> = order.iter().map(|&g| &inputs[g][..]).collect();
        for op in ReduceOp::ALL {
            let want = reference::reduce(&ordered, op);
            let mut out = vec![T::default(); len];
            c.all_reduce(&inputs[rank][..], &mut out[..], op)
                .map_err(e)?;
            same(&out, &want, &format!("all_reduce {name} {op} of {len}"))?;
            let mut buf = inputs[rank].clone();
            c.all_reduce_in_place(&mut buf[..], op).map_err(e)?;
            same(
                &buf,
                &want,
                &format!("in-place all_reduce {name} {op} of {len}"),
            )?;
            let root = len % n;
            let mut red = vec![T::default(); if rank == root { len } else { 0 }];
            c.reduce(&inputs[rank][..], &mut red[..], op, root)
                .map_err(e)?;
            if rank == root {
                same(&red, &want, &format!("reduce {name} {op} of {len}"))?;
            }
            if len % n == 0 {
                let b = len / n;
                let mut blk = vec![T::default(); b];
                c.reduce_scatter(&inputs[rank][..], &mut blk[..], op)
                    .map_err(e)?;
                same(
                    &blk,
                    &want[rank * b..(rank + 1) * b],
                    &format!("reduce_scatter {name} {op} of {len}"),
                )?;
            }
        }
    }
    Ok(())
}

fn moves<T: Gen>(c: &mut Communicator, len: usize) -> Result<(), String> {
    let (rank, n) = (c.rank(), c.world_size());
    let name = format!("{:?}", T::DTYPE);
    let inputs: Vec<Vec<T>> = (0..n).map(|r| input::<T>(r, len)).collect();
    for (root, data) in inputs.iter().enumerate() {
        let mut b = if rank == root {
            data.clone()
        } else {
            vec![T::default(); len]
        };
        c.broadcast_in_place(&mut b[..], root).map_err(e)?;
        same(&b, data, &format!("broadcast {name} of {len} from {root}"))?;
    }
    let mut all = vec![T::default(); len * n];
    c.all_gather(&inputs[rank][..], &mut all[..]).map_err(e)?;
    let want: Vec<T> = inputs.concat();
    same(&all, &want, &format!("all_gather {name} of {len}"))?;
    // A ring of sends and receives, across nodes and inside them.
    let (to, from) = ((rank + 1) % n, (rank + n - 1) % n);
    let mut got = vec![T::default(); len];
    c.group(|g| {
        g.send(&inputs[rank][..], to)?;
        g.recv(&mut got[..], from)
    })
    .map_err(e)?;
    same(&got, &inputs[from], &format!("send/recv {name} of {len}"))?;
    // Pairs: 0 <-> 1 and 2 <-> 3, blocking calls.
    let peer = rank ^ 1;
    let mut got = vec![T::default(); len];
    if rank % 2 == 0 {
        c.send(&inputs[rank][..], peer).map_err(e)?;
        c.recv(&mut got[..], peer).map_err(e)?;
    } else {
        c.recv(&mut got[..], peer).map_err(e)?;
        c.send(&inputs[rank][..], peer).map_err(e)?;
    }
    same(
        &got,
        &inputs[peer],
        &format!("send then recv {name} of {len}"),
    )
}

fn run() -> Result<String, String> {
    let mut c = Communicator::from_env().map_err(e)?;
    let (rank, n) = (c.rank(), c.world_size());
    if c.backend_kind() != BackendKind::Hier || n != 4 {
        return Err(format!("got {:?} with {n} ranks", c.backend_kind()));
    }
    let order = node_major(n)?;
    match std::env::var(FAULT).as_deref() {
        Ok("mismatch") => {
            let x = vec![1f32; if rank == 3 { 5 } else { 4 }];
            let mut y = vec![0f32; x.len()];
            let Err(mismatch) = c.all_reduce(&x[..], &mut y[..], ReduceOp::Sum) else {
                return Ok("no mismatch reported".into());
            };
            // Every rank found it at the same call, before any data moved: the ranks are still
            // in step and the communicator works on.
            let mut z = [0f32; 1];
            c.all_reduce(&[rank as f32][..], &mut z[..], ReduceOp::Sum)
                .map_err(|after| format!("{mismatch}; then all_reduce failed: {after}"))?;
            return Err(format!("{mismatch}; afterwards all_reduce gave {}", z[0]));
        }
        Ok("timeout") => {
            c.barrier().map_err(e)?;
            if rank == 3 {
                std::thread::sleep(Duration::from_secs(6));
            }
            let x = [1f32; 4];
            let mut y = [0f32; 4];
            c.all_reduce(&x[..], &mut y[..], ReduceOp::Sum).map_err(e)?;
            return Ok("no timeout reported".into());
        }
        Ok("kill") => {
            c.barrier().map_err(e)?;
            if rank == 3 {
                common::signal(std::process::id() as i32, libc::SIGKILL);
            }
            let x = [1f32; 4];
            let mut y = [0f32; 4];
            c.all_reduce(&x[..], &mut y[..], ReduceOp::Sum).map_err(e)?;
            return Ok("no loss reported".into());
        }
        _ => {}
    }
    c.barrier().map_err(e)?;
    // 5000 f32 (20 KB) and more take the rails; 300 000 f64 take two chunks per rail.
    reductions::<f32>(&mut c, &order, &[1, 3, 8, 5000, 40_000])?;
    reductions::<f64>(&mut c, &order, &[4, 300_000])?;
    reductions::<f16>(&mut c, &order, &[12, 12_000])?;
    reductions::<bf16>(&mut c, &order, &[12, 12_000])?;
    reductions::<i32>(&mut c, &order, &[4, 8000])?;
    reductions::<i64>(&mut c, &order, &[4])?;
    reductions::<u8>(&mut c, &order, &[8, 40_000])?;
    reductions::<i8>(&mut c, &order, &[8])?;
    reductions::<u32>(&mut c, &order, &[8])?;
    reductions::<u64>(&mut c, &order, &[8])?;
    moves::<f32>(&mut c, 3)?;
    moves::<f64>(&mut c, 50_000)?;
    moves::<bf16>(&mut c, 7)?;
    moves::<u8>(&mut c, 0)?;
    // What the backend refuses, it refuses on every rank alike.
    let x = [0f32; 8];
    let mut y = [0f32; 8];
    match c.all_to_all(&x[..], &mut y[..]) {
        Err(CommError::Unsupported(m)) if m.contains("hierarchical") => {}
        other => return Err(format!("all_to_all gave {other:?}")),
    }
    c.barrier().map_err(e)?;
    Ok(format!("hier ok, order {order:?}"))
}

/// Child mode `hier`: one `rank R: ...` line.
pub fn child() -> ExitCode {
    let rank = std::env::var("PMI_RANK").unwrap_or_default();
    match run() {
        Ok(line) => {
            println!("rank {rank}: {line}");
            ExitCode::SUCCESS
        }
        Err(err) => {
            println!("rank {rank}: error: {err}");
            ExitCode::from(3)
        }
    }
}

/// Run the ranks with `fault` and these extra variables; stdout's rank lines, sorted, and all
/// output.
fn ranks(
    fault: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> Result<(bool, Vec<String>, String), String> {
    let (l, mpiexec) = abi_mpiexec()?;
    let mark = common::new_mark(&format!("hier-{fault}"));
    let mut vars = vec![
        ("LOCKSTEP_TEST_MARK", mark.as_str()),
        (CHILD, "hier"),
        (FAULT, fault),
        ("LOCKSTEP_MPI", "on"),
        ("LOCKSTEP_MPI_LIBRARY", l.path.as_str()),
        ("LOCKSTEP_PEER_CHECK_MS", "100"),
    ];
    vars.extend_from_slice(env);
    let (status, out) = mpiexec_4(&mpiexec, args, &vars)?;
    // No rank outlives mpiexec.
    if !common::wait_until(Duration::from_secs(10), || common::marked(&mark).is_empty()) {
        let left = common::marked(&mark);
        for p in &left {
            common::signal(*p, libc::SIGKILL);
        }
        return Err(format!(
            "processes left behind after mpiexec ended: {left:?}"
        ));
    }
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let both = format!(
        "{stdout}\n--- stderr ---\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut lines: Vec<String> = stdout
        .lines()
        .filter(|l| l.starts_with("rank "))
        .map(String::from)
        .collect();
    lines.sort();
    for l in &lines {
        println!("  {}", l.chars().take(300).collect::<String>());
    }
    Ok((status.success(), lines, both))
}

fn all_ok(env: &[(&str, &str)]) -> Result<(), String> {
    let (ok, lines, both) = ranks("none", &[], env)?;
    if lines.is_empty() && ok {
        return Ok(()); // skipped
    }
    common::check(
        ok && lines.len() == 4 && lines.iter().all(|l| l.contains("hier ok")),
        "every rank's collectives equal the reference in node-major order",
        &both,
    )
}

pub fn collectives_round_robin() -> Result<(), String> {
    all_ok(&[("MPIR_CVAR_NUM_CLIQUES", "2"), ("LOCKSTEP_TIMEOUT_S", "60")])
}

pub fn collectives_blocks() -> Result<(), String> {
    all_ok(&[
        ("LOCKSTEP_MPI_NODE_SIZE", "2"),
        ("LOCKSTEP_TIMEOUT_S", "60"),
    ])
}

/// 4 nodes of one rank each: every reduction through the leaders (one rail), each leader's
/// input read from its own buffer and sent to three others.
pub fn collectives_single_rank_nodes() -> Result<(), String> {
    all_ok(&[
        ("LOCKSTEP_MPI_NODE_SIZE", "1"),
        ("LOCKSTEP_TIMEOUT_S", "60"),
    ])
}

/// Every rank's line, when each is an error containing all of `words`.
fn all_fail(lines: &[String], both: &str, words: &[&str], what: &str) -> Result<(), String> {
    common::check(
        lines.len() == 4
            && lines
                .iter()
                .all(|l| l.contains("error:") && words.iter().all(|w| l.contains(w))),
        what,
        both,
    )
}

pub fn mismatch() -> Result<(), String> {
    let (ok, lines, both) = ranks(
        "mismatch",
        &[],
        &[("MPIR_CVAR_NUM_CLIQUES", "2"), ("LOCKSTEP_TIMEOUT_S", "30")],
    )?;
    if lines.is_empty() && ok {
        return Ok(());
    }
    all_fail(
        &lines,
        &both,
        &[
            "mismatch across ranks",
            "rank 3 called all_reduce(count=5",
            "afterwards all_reduce gave 6",
        ],
        "a count mismatch on another node is named on every rank, and the next call works",
    )
}

pub fn timeout() -> Result<(), String> {
    // Without -disable-auto-cleanup, mpiexec ends the other ranks as soon as the first one
    // exits with its error.
    let (ok, lines, both) = ranks(
        "timeout",
        &["-disable-auto-cleanup"],
        &[("MPIR_CVAR_NUM_CLIQUES", "2"), ("LOCKSTEP_TIMEOUT_S", "2")],
    )?;
    if lines.is_empty() && ok {
        return Ok(());
    }
    let others: Vec<&String> = lines.iter().filter(|l| !l.starts_with("rank 3:")).collect();
    common::check(
        others.len() == 3
            && others.iter().all(|l| {
                l.contains("error:") && l.contains("timed out") && l.contains("rank 3 (node ")
            }),
        "ranks 0-2 time out naming rank 3",
        &both,
    )?;
    common::check(
        lines.iter().any(|l| l.starts_with("rank 3: error:")),
        "the stuck rank fails too when it arrives",
        &both,
    )
}

/// MPICH's mpiexec ends the job when a rank is killed: the others are ended at once (with
/// `-disable-auto-cleanup` it signals them with SIGUSR1, which ends them too), and it reports
/// the killed rank. What the test checks: the job fails promptly, names the signal, and leaves no
/// process behind; a rank that still reports names rank 3.
pub fn killed() -> Result<(), String> {
    let t = std::time::Instant::now();
    let (ok, lines, both) = ranks(
        "kill",
        &[],
        &[("MPIR_CVAR_NUM_CLIQUES", "2"), ("LOCKSTEP_TIMEOUT_S", "20")],
    )?;
    if lines.is_empty() && ok {
        return Ok(());
    }
    common::check(
        !ok && both.contains("signal 9") && t.elapsed() < Duration::from_secs(15),
        "mpiexec fails promptly and reports the killed rank",
        &both,
    )?;
    common::check(
        lines
            .iter()
            .all(|l| l.contains("error:") && l.contains("rank 3 (pid")),
        "a rank that reports names rank 3",
        &both,
    )
}
