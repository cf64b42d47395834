//! NCCL on a real GPU at world size 1: every collective × op × dtype, in place and out of place,
//! send/recv in a group, host buffers refused, and the abort path (a peer that never joins turns
//! into a Timeout + ncclCommAbort instead of a hang). Also two ranks through `lockstep::launch`
//! (unique id exchanged over the shm communicator), checking reduced values and that a peer leaving
//! mid-job becomes an error on the other rank: one GPU per rank with two or more GPUs, else both
//! ranks on GPU 0 through NCCL's multi-rank mode (`NCCL_MULTI_RANK_GPU_ENABLE=1`, NCCL ≥ 2.30).
//! With fewer GPUs and an older NCCL that check cannot run: it prints
//! `test two_ranks_and_peer_loss ... skipped: <why>` and is not counted as passed
//! (`LOCKSTEP_REQUIRE_NCCL_TWO_RANKS=1` makes it a failure instead; benches/gpu_verify.sh sets it
//! where the machine can run it and reports the skip as NOT CHECKED otherwise).
//! Prints `skipped: no CUDA driver` / `skipped: no NCCL library` otherwise (fails under
//! LOCKSTEP_REQUIRE_GPU=1).
//!
//! Every NCCL wait here is bounded: `LOCKSTEP_TIMEOUT_S` when set, else 60 s (NCCL's own default
//! of 300 s would let one hang use up a GPU machine lent for minutes).

#[path = "common/collectives.rs"]
mod collectives;
#[path = "common/gpu.rs"]
mod gpu;
#[path = "common/runner.rs"]
mod runner;

use std::time::Duration;

use lockstep::comm::ReduceOp;
use lockstep::cuda::DeviceBuffer;
use lockstep::nccl::{NcclComm, NcclOptions};

fn solo_exchange() -> impl FnMut(usize, Option<&[u8; 128]>) -> Result<[u8; 128], String> {
    |_rank, id| {
        id.copied()
            .ok_or_else(|| "world size 1 has no peer to receive from".to_string())
    }
}

/// The name of the two-rank check (the skip line and gpu_verify.sh's report use it).
const TWO_RANKS: &str = "two_ranks_and_peer_loss";
/// Set on the child process; its value says whether NCCL's multi-rank mode may be used.
const CHILD_VAR: &str = "LOCKSTEP_GPU_NCCL_TWO_RANKS";
/// Makes a skipped two-rank check a failure (for machines that can run it).
const REQUIRE_VAR: &str = "LOCKSTEP_REQUIRE_NCCL_TWO_RANKS";
/// Child exit code: fewer than two GPUs and no multi-rank mode, so nothing was checked.
const CHILD_CANNOT: i32 = 3;

/// NCCL's multi-rank mode (several ranks of one communicator on one GPU) needs NCCL 2.30.
fn multi_rank_capable(nccl_code: i32) -> bool {
    nccl_code >= 23000
}

/// `LOCKSTEP_TIMEOUT_S` when set, else 60 s for every NCCL wait of this binary and of the ranks it
/// launches (which read the variable): a hang must end as an error well inside a short GPU lease.
fn default_short_timeout() {
    if std::env::var_os("LOCKSTEP_TIMEOUT_S").is_none() {
        std::env::set_var("LOCKSTEP_TIMEOUT_S", "60");
    }
}

fn nccl_opts() -> NcclOptions {
    NcclOptions::from_env().expect("LOCKSTEP_TIMEOUT_S")
}

/// Child process: two ranks, on two GPUs or in NCCL's multi-rank mode on one (run before this
/// process initialises CUDA, since the launcher refuses to fork afterwards). Exit 0: passed;
/// [`CHILD_CANNOT`]: fewer than two GPUs and multi-rank mode not available.
fn two_ranks_child() {
    let multi_ok = std::env::var(CHILD_VAR).as_deref() == Ok("multi-rank");
    let res = lockstep::launch::launch(&lockstep::launch::LaunchConfig::new(2), |mut rc| {
        let gpus = lockstep::cuda::device_count()?;
        let ordinal = if gpus >= 2 {
            rc.local_rank as i32
        } else if multi_ok && gpus == 1 {
            0
        } else {
            return Ok(2u64);
        };
        let ctx = lockstep::cuda::Context::new(ordinal)?;
        if rc.rank == 0 {
            let mode = if gpus >= 2 {
                "one GPU per rank"
            } else {
                "both on GPU 0, NCCL multi-rank mode"
            };
            println!("  two ranks: {mode}");
        }
        let opts = NcclOptions {
            timeout: Duration::from_secs(10),
            ..nccl_opts()
        };
        let nc = NcclComm::new(&ctx, rc.rank, rc.world_size, &mut rc.comm, opts)?;
        let s = ctx.stream()?;
        let mut comm = nc.into_communicator();
        let r = rc.rank as f32;
        let bad = |what: &str, got: Vec<f32>| -> Box<dyn std::error::Error + Send + Sync> {
            format!("rank {}: {what} gave {got:?}", rc.rank).into()
        };
        let mut x = DeviceBuffer::from_host(&s, &[r + 1.0; 8])?;
        comm.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
        comm.synchronize()?;
        let v = x.to_vec(&s)?;
        if v != [3.0; 8] {
            return Err(bad("all_reduce sum", v));
        }
        let mut x = DeviceBuffer::from_host(&s, &[r + 1.0; 8])?;
        comm.all_reduce_in_place(&mut x, ReduceOp::Avg)?;
        comm.synchronize()?;
        let v = x.to_vec(&s)?;
        if v != [1.5; 8] {
            return Err(bad("all_reduce avg", v));
        }
        let mine = DeviceBuffer::from_host(&s, &[r; 4])?;
        let mut g = DeviceBuffer::<f32>::zeros(&s, 8)?;
        comm.all_gather(&mine, &mut g)?;
        let mut keep = DeviceBuffer::from_host(&s, &[-1.0f32; 8])?;
        comm.gather(&mine, &mut keep, 1)?;
        let big = DeviceBuffer::from_host(&s, &[r + 1.0; 8])?;
        let mut rs = DeviceBuffer::<f32>::zeros(&s, 4)?;
        comm.reduce_scatter(&big, &mut rs, ReduceOp::Max)?;
        comm.synchronize()?;
        let want_g = vec![0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0];
        let (gv, kv, rv) = (g.to_vec(&s)?, keep.to_vec(&s)?, rs.to_vec(&s)?);
        if gv != want_g
            || kv
                != if rc.rank == 1 {
                    want_g.clone()
                } else {
                    vec![-1.0; 8]
                }
            || rv != [2.0; 4]
        {
            return Err(bad(
                "all_gather/gather/reduce_scatter",
                [gv, kv, rv].concat(),
            ));
        }
        // Rank 1 leaves without a word; rank 0's next collective must fail, not hang.
        if rc.rank == 1 {
            std::mem::forget(comm);
            return Ok(1);
        }
        comm.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
        match comm.synchronize() {
            Err(e) if e.to_string().contains("aborted") => Ok(1),
            other => {
                Err(format!("rank 0 after rank 1 left: expected an abort, got {other:?}").into())
            }
        }
    });
    match res {
        Ok(v) if v.iter().all(|c| *c == 1) => std::process::exit(0),
        Ok(v) if v.contains(&2) => std::process::exit(CHILD_CANNOT),
        other => {
            eprintln!("two ranks: {other:?}");
            std::process::exit(1)
        }
    }
}

/// What became of the two-rank check.
enum TwoRanks {
    /// It ran: passed, or failed with this message.
    Ran(Result<(), String>),
    /// It could not run on this machine, for this reason.
    Cannot(String),
}

/// Run the two-rank check in a child process (this one must not initialise CUDA first).
fn two_ranks(nccl_code: i32) -> TwoRanks {
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    // NCCL reads its own variable at init; it is set only where the library has the mode.
    if multi_rank_capable(nccl_code) {
        cmd.env(CHILD_VAR, "multi-rank")
            .env("NCCL_MULTI_RANK_GPU_ENABLE", "1");
    } else {
        cmd.env(CHILD_VAR, "one-gpu-each")
            .env_remove("NCCL_MULTI_RANK_GPU_ENABLE");
    }
    match cmd.status() {
        Err(e) => TwoRanks::Ran(Err(e.to_string())),
        Ok(st) if st.success() => TwoRanks::Ran(Ok(())),
        Ok(st) if st.code() == Some(CHILD_CANNOT) => TwoRanks::Cannot(format!(
            "fewer than two GPUs and NCCL {} (older than 2.30): two ranks of one NCCL communicator need two GPUs or NCCL's multi-rank mode (NCCL_MULTI_RANK_GPU_ENABLE=1, NCCL 2.30 or newer)",
            lockstep::cuda::nccl_version_string(nccl_code)
        )),
        Ok(st) => TwoRanks::Ran(Err(format!("child status {st}"))),
    }
}

fn main() {
    default_short_timeout();
    if std::env::var_os(CHILD_VAR).is_some() {
        two_ranks_child();
    }
    gpu::driver_or_skip();
    if let Err(e) = lockstep::nccl::check_library() {
        gpu::skip("no NCCL library", &e.to_string());
    }
    let nccl_code = lockstep::nccl::version().expect("NCCL loaded above");
    let mut r = gpu::Runner::new();
    // A check that cannot run here is counted as skipped, never as passed.
    if r.selected(TWO_RANKS) {
        match two_ranks(nccl_code) {
            TwoRanks::Ran(result) => r.run(TWO_RANKS, || result),
            TwoRanks::Cannot(why) => r.run(TWO_RANKS, || runner::skip(REQUIRE_VAR, &why)),
        }
    }
    let ctx = gpu::context_or_skip();
    println!("  NCCL {}", lockstep::cuda::nccl_version_string(nccl_code));

    r.run("abort_when_a_peer_never_joins", || {
        let opts = NcclOptions {
            timeout: Duration::from_secs(3),
            ..nccl_opts()
        };
        match NcclComm::new(&ctx, 0, 2, &mut solo_exchange(), opts) {
            Err(e) if e.to_string().contains("aborted") => Ok(()),
            Err(e) => Err(format!("unexpected error: {e}")),
            Ok(_) => Err("init with a missing peer succeeded".into()),
        }
    });

    let mut nc = NcclComm::new(&ctx, 0, 1, &mut solo_exchange(), nccl_opts())
        .expect("NCCL init at world size 1");
    let s = ctx.stream().unwrap();

    r.run("send_recv_self_in_group", || {
        let a = DeviceBuffer::from_host(&s, &[1i32, 2, 3]).map_err(|e| e.to_string())?;
        let mut b = DeviceBuffer::<i32>::zeros(&s, 3).map_err(|e| e.to_string())?;
        nc.group(|c| {
            c.send(&a, 0)?;
            c.recv(&mut b, 0)
        })
        .map_err(|e| e.to_string())?;
        nc.wait("send/recv").map_err(|e| e.to_string())?;
        let got = b.to_vec(&s).map_err(|e| e.to_string())?;
        if got == [1, 2, 3] {
            Ok(())
        } else {
            Err(format!("got {got:?}"))
        }
    });

    let mut comm = nc.into_communicator();
    r.run("host_buffers_refused", || {
        let (a, mut b) = (vec![1f32; 4], vec![0f32; 4]);
        match comm.all_reduce(&a, &mut b, ReduceOp::Sum) {
            Err(lockstep::comm::CommError::Unsupported(m)) if m.contains("device memory only") => {
                Ok(())
            }
            other => Err(format!("expected Unsupported, got {other:?}")),
        }
    });
    r.run("collectives_ops_dtypes_world1", || {
        collectives::check_all_dtypes_world1(&mut comm, &s)
    });
    gpu::finish(r);
}
