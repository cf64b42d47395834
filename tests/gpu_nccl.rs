//! NCCL on a real GPU at world size 1: every collective × op × dtype, in place and out of place,
//! send/recv in a group, host buffers refused, and the abort path (a peer that never joins turns
//! into a Timeout + ncclCommAbort instead of a hang). With two or more GPUs, also two ranks through
//! `lockstep::launch` (unique id exchanged over the shm communicator), checking reduced values and
//! that a peer leaving mid-job becomes an error on the other rank. Prints `skipped: no CUDA driver` /
//! `skipped: no NCCL library` otherwise (fails under LOCKSTEP_REQUIRE_GPU=1).

#[path = "common/collectives.rs"]
mod collectives;
#[path = "common/gpu.rs"]
mod gpu;

use std::time::Duration;

use lockstep::comm::ReduceOp;
use lockstep::cuda::DeviceBuffer;
use lockstep::nccl::{NcclComm, NcclOptions};

fn solo_exchange() -> impl FnMut(usize, Option<&[u8; 128]>) -> Result<[u8; 128], String> {
    |_rank, id| id.copied().ok_or_else(|| "world size 1 has no peer to receive from".to_string())
}

/// Child process: two ranks on two GPUs (run before this process initialises CUDA, since the
/// launcher refuses to fork afterwards). Exit 0: passed; 3: fewer than two GPUs.
fn two_ranks_child() {
    let res = lockstep::launch::launch(&lockstep::launch::LaunchConfig::new(2), |mut rc| {
        if lockstep::cuda::device_count()? < 2 {
            return Ok(2u64);
        }
        let ctx = lockstep::cuda::Context::new(rc.local_rank as i32)?;
        let opts = NcclOptions { timeout: Duration::from_secs(10), ..NcclOptions::default() };
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
        if gv != want_g || kv != if rc.rank == 1 { want_g.clone() } else { vec![-1.0; 8] } || rv != [2.0; 4] {
            return Err(bad("all_gather/gather/reduce_scatter", [gv, kv, rv].concat()));
        }
        // Rank 1 leaves without a word; rank 0's next collective must fail, not hang.
        if rc.rank == 1 {
            std::mem::forget(comm);
            return Ok(1);
        }
        comm.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
        match comm.synchronize() {
            Err(e) if e.to_string().contains("aborted") => Ok(1),
            other => Err(format!("rank 0 after rank 1 left: expected an abort, got {other:?}").into()),
        }
    });
    match res {
        Ok(v) if v.iter().all(|c| *c == 1) => std::process::exit(0),
        Ok(v) if v.contains(&2) => std::process::exit(3),
        other => {
            eprintln!("two ranks: {other:?}");
            std::process::exit(1)
        }
    }
}

fn main() {
    if std::env::var_os("LOCKSTEP_GPU_NCCL_TWO_RANKS").is_some() {
        two_ranks_child();
    }
    gpu::driver_or_skip();
    if let Err(e) = lockstep::nccl::check_library() {
        gpu::skip("no NCCL library", &e.to_string());
    }
    let mut r = gpu::Runner::new();
    r.run("two_ranks_two_gpus_and_peer_loss", || {
        let st = std::process::Command::new(std::env::current_exe().unwrap())
            .env("LOCKSTEP_GPU_NCCL_TWO_RANKS", "1")
            .status()
            .map_err(|e| e.to_string())?;
        match st.code() {
            Some(0) => Ok(()),
            Some(3) => {
                println!("  (fewer than two GPUs: two-rank NCCL not checked)");
                Ok(())
            }
            _ => Err(format!("child status {st}")),
        }
    });
    let ctx = gpu::context_or_skip();
    println!("  NCCL {}", lockstep::cuda::nccl_version_string(lockstep::nccl::version().unwrap()));

    r.run("abort_when_a_peer_never_joins", || {
        let opts = NcclOptions { timeout: Duration::from_secs(3), ..NcclOptions::default() };
        match NcclComm::new(&ctx, 0, 2, &mut solo_exchange(), opts) {
            Err(e) if e.to_string().contains("aborted") => Ok(()),
            Err(e) => Err(format!("unexpected error: {e}")),
            Ok(_) => Err("init with a missing peer succeeded".into()),
        }
    });

    let mut nc = NcclComm::new(&ctx, 0, 1, &mut solo_exchange(), NcclOptions::default()).expect("NCCL init at world size 1");
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
            Err(lockstep::comm::CommError::Unsupported(m)) if m.contains("device memory only") => Ok(()),
            other => Err(format!("expected Unsupported, got {other:?}")),
        }
    });
    r.run("collectives_ops_dtypes_world1", || collectives::check_all_dtypes_world1(&mut comm, &s));
    r.finish();
}
