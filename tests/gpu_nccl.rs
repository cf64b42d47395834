//! NCCL on a real GPU at world size 1: every collective × op × dtype, in place and out of place,
//! send/recv in a group, host buffers refused, and the abort path (a peer that never joins turns
//! into a Timeout + ncclCommAbort instead of a hang). Prints `skipped: no CUDA driver` /
//! `skipped: no NCCL library` otherwise (fails under LOCKSTEP_REQUIRE_GPU=1).

#[path = "common/gpu.rs"]
mod gpu;

use std::time::Duration;

use lockstep::comm::{CollKind, Communicator, Element, ReduceOp};
use lockstep::cuda::{DeviceBuffer, Stream};
use lockstep::nccl::{NcclComm, NcclOptions};

fn solo_exchange() -> impl FnMut(usize, Option<&[u8; 128]>) -> Result<[u8; 128], String> {
    |_rank, id| id.copied().ok_or_else(|| "world size 1 has no peer to receive from".to_string())
}

/// At world size 1 every collective returns its input (Avg divides by 1).
fn check_all<T: Element>(comm: &mut Communicator, s: &Stream, gen: impl Fn(usize) -> T) -> Result<(), String> {
    let n = 257;
    let host: Vec<T> = (0..n).map(&gen).collect();
    let e = |e: lockstep::comm::CommError| e.to_string();
    let c = |e: lockstep::cuda::CudaError| e.to_string();
    for kind in CollKind::ALL {
        let ops: Vec<ReduceOp> = if kind.has_op() { ReduceOp::ALL.to_vec() } else { vec![ReduceOp::Sum] };
        for op in ops {
            let send = DeviceBuffer::from_host(s, &host).map_err(c)?;
            let mut recv = DeviceBuffer::<T>::zeros(s, n).map_err(c)?;
            let mut inplace = DeviceBuffer::from_host(s, &host).map_err(c)?;
            match kind {
                CollKind::AllReduce => {
                    comm.all_reduce(&send, &mut recv, op).map_err(e)?;
                    comm.all_reduce_in_place(&mut inplace, op).map_err(e)?;
                }
                CollKind::Broadcast => {
                    comm.broadcast(&send, &mut recv, 0).map_err(e)?;
                    comm.broadcast_in_place(&mut inplace, 0).map_err(e)?;
                }
                CollKind::Reduce => {
                    comm.reduce(&send, &mut recv, op, 0).map_err(e)?;
                    comm.reduce_in_place(&mut inplace, op, 0).map_err(e)?;
                }
                CollKind::AllGather => {
                    comm.all_gather(&send, &mut recv).map_err(e)?;
                    comm.all_gather_in_place(&mut inplace).map_err(e)?;
                }
                CollKind::Gather => {
                    comm.gather(&send, &mut recv, 0).map_err(e)?;
                    comm.gather(&send, &mut inplace, 0).map_err(e)?;
                }
                CollKind::ReduceScatter => {
                    comm.reduce_scatter(&send, &mut recv, op).map_err(e)?;
                    comm.reduce_scatter_in_place(&mut inplace, op).map_err(e)?;
                }
                CollKind::Barrier => {
                    comm.barrier().map_err(e)?;
                    recv.copy_from_device_async(s, &send).map_err(c)?;
                }
            }
            comm.synchronize().map_err(e)?;
            let (got, got_in) = (recv.to_vec(s).map_err(c)?, inplace.to_vec(s).map_err(c)?);
            if got != host || got_in != host {
                return Err(format!(
                    "{kind} {op} {}: result differs from input (first: {:?} / {:?} vs {:?})",
                    T::DTYPE,
                    got[0],
                    got_in[0],
                    host[0]
                ));
            }
        }
    }
    Ok(())
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
    r.run("collectives_ops_dtypes_world1", || {
        check_all::<f32>(&mut comm, &s, |i| i as f32 - 7.0)?;
        check_all::<f64>(&mut comm, &s, |i| i as f64 * 0.25)?;
        check_all::<half::f16>(&mut comm, &s, |i| half::f16::from_f32((i % 100) as f32))?;
        check_all::<half::bf16>(&mut comm, &s, |i| half::bf16::from_f32((i % 100) as f32))?;
        check_all::<i32>(&mut comm, &s, |i| i as i32 - 100)?;
        check_all::<i64>(&mut comm, &s, |i| i as i64 * 1_000_000_007)?;
        check_all::<u8>(&mut comm, &s, |i| (i % 251) as u8)?;
        check_all::<i8>(&mut comm, &s, |i| (i % 100) as i8 - 50)
    });
    r.finish();
}
