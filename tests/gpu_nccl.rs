//! NCCL on a real GPU at world size 1: every collective × op × dtype, in place and out of place,
//! send/recv in a group, host buffers refused, and the abort path (a peer that never joins turns
//! into a Timeout + ncclCommAbort instead of a hang). Prints `skipped: no CUDA driver` /
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

fn main() {
    gpu::driver_or_skip();
    if let Err(e) = lockstep::nccl::check_library() {
        gpu::skip("no NCCL library", &e.to_string());
    }
    let ctx = gpu::context_or_skip();
    let mut r = gpu::Runner::new();
    println!("  NCCL {}", lockstep::cuda::discovery::nccl_version_string(lockstep::nccl::version().unwrap()));

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
