//! The rotating mix of checked collectives that the fault tests of the shared-memory backend
//! run (`shm_shrink`, `shm_grow`): every call's result is compared with what it must be, so a
//! communicator that a failure, shrink or grow left wrong shows as a wrong result.

use std::time::{Duration, Instant};

use lockstep::comm::{CommError, Communicator, ReduceOp};

/// Element counts, rotating through the paths: inline, one-phase, slots (several chunks).
pub const COUNTS: [usize; 4] = [3, 300, 5000, 40_000];

/// Collective `j` of the rotating mix (all_reduce, broadcast, reduce_scatter, all_gather,
/// reduce, barrier) on `comm`, its result checked against what it must be.
pub fn op(comm: &mut Communicator, j: usize) -> Result<(), CommError> {
    let (n, me) = (comm.world_size(), comm.rank());
    let count = COUNTS[(j / 6) % COUNTS.len()];
    let bad = |what: &str, i: usize, got: f32, want: f32| {
        panic_free_err(format!(
            "{what} #{j} on rank {me} of {n}: element {i} is {got}, expected {want}"
        ))
    };
    let tri = (n * (n + 1) / 2) as f32;
    match j % 6 {
        0 => {
            let mut b: Vec<f32> = (0..count)
                .map(|i| ((me + 1) * (1 + i % 7) + j % 5) as f32)
                .collect();
            comm.all_reduce_in_place(&mut b[..], ReduceOp::Sum)?;
            for (i, &v) in b.iter().enumerate() {
                let want = tri * (1 + i % 7) as f32 + (n * (j % 5)) as f32;
                if v != want {
                    return Err(bad("all_reduce", i, v, want));
                }
            }
        }
        1 => {
            let root = j % n;
            let mut b: Vec<f32> = (0..count)
                .map(|i| if me == root { (i + j) as f32 } else { -1.0 })
                .collect();
            comm.broadcast_in_place(&mut b[..], root)?;
            for (i, &v) in b.iter().enumerate() {
                if v != (i + j) as f32 {
                    return Err(bad("broadcast", i, v, (i + j) as f32));
                }
            }
        }
        2 => {
            let send: Vec<f32> = (0..count * n).map(|i| (me + i % 1000) as f32).collect();
            let mut recv = vec![0f32; count];
            comm.reduce_scatter(&send[..], &mut recv[..], ReduceOp::Sum)?;
            for (i, &v) in recv.iter().enumerate() {
                let want = (n * (n - 1) / 2 + n * ((me * count + i) % 1000)) as f32;
                if v != want {
                    return Err(bad("reduce_scatter", i, v, want));
                }
            }
        }
        3 => {
            let send: Vec<f32> = (0..count).map(|i| (me * 1000 + i % 1000) as f32).collect();
            let mut recv = vec![0f32; count * n];
            comm.all_gather(&send[..], &mut recv[..])?;
            for (i, &v) in recv.iter().enumerate() {
                let want = ((i / count) * 1000 + (i % count) % 1000) as f32;
                if v != want {
                    return Err(bad("all_gather", i, v, want));
                }
            }
        }
        4 => {
            let root = (j / 6) % n;
            let send: Vec<f32> = (0..count)
                .map(|i| ((me + 1) * (1 + i % 3)) as f32)
                .collect();
            let mut recv = vec![0f32; count];
            comm.reduce(&send[..], &mut recv[..], ReduceOp::Sum, root)?;
            if me == root {
                for (i, &v) in recv.iter().enumerate() {
                    let want = tri * (1 + i % 3) as f32;
                    if v != want {
                        return Err(bad("reduce", i, v, want));
                    }
                }
            }
        }
        _ => comm.barrier()?,
    }
    Ok(())
}

/// A wrong result, as an error the rank reports (Unsupported carries the text as it is).
pub fn panic_free_err(msg: String) -> CommError {
    CommError::Unsupported(format!("WRONG RESULT: {msg}"))
}

/// Run the mix on `comm` until a call fails (a peer died or was stopped), at most `limit`;
/// returns the error and when it came.
pub fn until_failure(
    comm: &mut Communicator,
    limit: Duration,
) -> Result<(CommError, Instant), String> {
    let start = Instant::now();
    let mut j = 0;
    loop {
        if let Err(e) = op(comm, j) {
            let at = Instant::now();
            if e.to_string().contains("WRONG RESULT") {
                return Err(e.to_string());
            }
            return Ok((e, at));
        }
        j += 1;
        if start.elapsed() > limit {
            return Err(format!("no failure within {limit:?} ({j} collectives)"));
        }
    }
}

/// `k` collectives of the mix on `comm`, from `j0`, every result checked.
pub fn run_mix(comm: &mut Communicator, j0: usize, k: usize) -> Result<(), String> {
    for j in j0..j0 + k {
        op(comm, j).map_err(|e| format!("collective {j}: {e}"))?;
    }
    Ok(())
}
