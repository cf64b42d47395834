//! One collective check shared by the NCCL tests on a real GPU (`gpu_nccl`) and on the simulated
//! driver + NCCL (`cuda_fake_driver`): at world size 1 every collective returns its input.

use lockstep::comm::{CollKind, Communicator, Element, ReduceOp};
use lockstep::cuda::{DeviceBuffer, Stream};

/// Every collective × op (in place and out of place) on `T`, at world size 1.
pub fn check_all_world1<T: Element>(
    comm: &mut Communicator,
    s: &Stream,
    gen: impl Fn(usize) -> T,
) -> Result<(), String> {
    let n = 257;
    let host: Vec<T> = (0..n).map(&gen).collect();
    let e = |e: lockstep::comm::CommError| e.to_string();
    let c = |e: lockstep::cuda::CudaError| e.to_string();
    for kind in CollKind::ALL {
        let ops: Vec<ReduceOp> = if kind.has_op() {
            ReduceOp::ALL.to_vec()
        } else {
            vec![ReduceOp::Sum]
        };
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
                CollKind::AllToAll
                | CollKind::AllToAllV
                | CollKind::Scatter
                | CollKind::AllGatherV
                | CollKind::GatherV
                | CollKind::Send
                | CollKind::Recv => {
                    // At world size 1 each of these hands the input back: through a device copy
                    // (the exchanges' own block) or a send to this rank itself in a group. The
                    // nonblocking form is checked too: its Work waits for the device.
                    match kind {
                        CollKind::AllToAll => comm.all_to_all(&send, &mut recv).map_err(e)?,
                        CollKind::AllToAllV => comm
                            .all_to_all_v(&send, &[n], &[0], &mut recv, &[n], &[0])
                            .map_err(e)?,
                        CollKind::Scatter => comm.scatter(&send, &mut recv, 0).map_err(e)?,
                        CollKind::AllGatherV => {
                            comm.all_gather_v(&send, &mut recv, &[n]).map_err(e)?
                        }
                        CollKind::GatherV => comm.gather_v(&send, &mut recv, &[n], 0).map_err(e)?,
                        _ => comm
                            .group(|g| {
                                g.send(&send, 0)?;
                                g.recv(&mut recv, 0)
                            })
                            .map_err(e)?,
                    }
                    let w = comm.start(|x| x.all_to_all(&send, &mut inplace));
                    w.wait().map_err(e)?;
                }
                other => {
                    return Err(format!(
                        "{other}: not covered by this check yet; add it here"
                    ))
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

/// [`check_all_world1`] for every dtype.
pub fn check_all_dtypes_world1(comm: &mut Communicator, s: &Stream) -> Result<(), String> {
    check_all_world1::<f32>(comm, s, |i| i as f32 - 7.0)?;
    check_all_world1::<f64>(comm, s, |i| i as f64 * 0.25)?;
    check_all_world1::<half::f16>(comm, s, |i| half::f16::from_f32((i % 100) as f32))?;
    check_all_world1::<half::bf16>(comm, s, |i| half::bf16::from_f32((i % 100) as f32))?;
    check_all_world1::<i32>(comm, s, |i| i as i32 - 100)?;
    check_all_world1::<i64>(comm, s, |i| i as i64 * 1_000_000_007)?;
    check_all_world1::<u8>(comm, s, |i| (i % 251) as u8)?;
    check_all_world1::<i8>(comm, s, |i| (i % 100) as i8 - 50)?;
    check_all_world1::<u32>(comm, s, |i| i as u32 * 3_000_017)?;
    check_all_world1::<u64>(comm, s, |i| i as u64 * 10_000_000_019)
}
