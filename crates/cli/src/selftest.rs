//! `lockstep selftest`: join the job from the environment, run verified all-reduces and a
//! barrier.

use std::time::Instant;

use clap::Args;

#[derive(Args, Debug)]
pub(crate) struct SelftestArgs {
    /// All-reduce this many times (each one verified).
    #[arg(long, default_value_t = 1)]
    pub(crate) iters: u64,
    /// Elements per all-reduce.
    #[arg(long, default_value_t = 1024)]
    pub(crate) count: usize,
}

/// Run the self-test; rank 0 prints the summary line.
pub(crate) fn run(a: SelftestArgs) -> Result<i32, String> {
    let t0 = Instant::now();
    let mut comm = lockstep::Communicator::from_env().map_err(|e| e.to_string())?;
    let joined = t0.elapsed();
    let (rank, n) = (comm.rank(), comm.world_size());
    let expect = (n * (n + 1) / 2) as f32;
    let mut buf = vec![0f32; a.count];
    // A device communicator (LOCKSTEP_BACKEND=nccl) reduces device memory.
    let device = match comm.device_context() {
        Some(ctx) => Some(ctx.stream().map_err(|e| e.to_string())?),
        None => None,
    };
    for it in 0..a.iters.max(1) {
        buf.iter_mut().for_each(|x| *x = (rank + 1) as f32);
        match &device {
            Some(stream) => {
                let mut d = lockstep::cuda::DeviceBuffer::from_host(stream, &buf)
                    .map_err(|e| e.to_string())?;
                stream.synchronize().map_err(|e| e.to_string())?;
                comm.all_reduce_in_place(&mut d, lockstep::ReduceOp::Sum)
                    .map_err(|e| e.to_string())?;
                comm.synchronize().map_err(|e| e.to_string())?;
                buf = d.to_vec(stream).map_err(|e| e.to_string())?;
            }
            None => comm
                .all_reduce_in_place(&mut buf[..], lockstep::ReduceOp::Sum)
                .map_err(|e| e.to_string())?,
        }
        if let Some(i) = buf.iter().position(|x| *x != expect) {
            return Err(format!(
                "selftest: rank {rank}, all-reduce #{}: element {i} is {} but should be {expect}",
                it + 1,
                buf[i]
            ));
        }
    }
    comm.barrier().map_err(|e| e.to_string())?;
    if rank == 0 {
        println!(
            "lockstep selftest ok: {n} ranks, backend {}, {} verified all-reduce(s) of {} f32, joined in {:.1} ms, total {:.1} ms",
            comm.backend_kind(),
            a.iters.max(1),
            a.count,
            joined.as_secs_f64() * 1e3,
            t0.elapsed().as_secs_f64() * 1e3
        );
    }
    Ok(0)
}
