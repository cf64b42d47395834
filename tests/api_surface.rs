//! The public surface a framework meets first, exercised through the crate root only: a user's
//! own tensor type passed to collectives through `AsRef<[T]>`/`AsMut<[T]>` (no `unsafe impl`), a
//! rank function that is `FnOnce` (moves its captures), and a rank result of the user's own
//! serde type. harness = false: `launch` forks.

#[path = "common/runner.rs"]
mod runner;

use lockstep::{launch, CommError, LaunchConfig, RankContext, RankResult, ReduceOp};
use serde::{Deserialize, Serialize};

/// A framework's tensor: the collective sees only its contiguous storage.
struct Tensor {
    shape: Vec<usize>,
    data: Vec<f32>,
}

impl AsRef<[f32]> for Tensor {
    fn as_ref(&self) -> &[f32] {
        &self.data
    }
}

impl AsMut<[f32]> for Tensor {
    fn as_mut(&mut self) -> &mut [f32] {
        &mut self.data
    }
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Summary {
    rank: usize,
    shape: Vec<usize>,
    sum: f64,
    note: Option<String>,
}

fn main() -> std::process::ExitCode {
    runner::run(&[(
        "user_tensor_fnonce_serde_result",
        user_tensor_fnonce_serde_result,
    )])
}

/// A user's own tensor type through the collectives, an `FnOnce` rank closure that consumes what it
/// captured, and a serde result back from every rank.
fn user_tensor_fnonce_serde_result() -> Result<(), String> {
    let world = 3;
    // Moved into the closure and consumed there: only an FnOnce can do this.
    let notes: Vec<String> = (0..world).map(|r| format!("rank {r} was here")).collect();
    let res = launch(
        &LaunchConfig::new(world),
        move |mut ctx: RankContext| -> RankResult<Summary> {
            let mut t = Tensor {
                shape: vec![2, 5],
                data: vec![ctx.rank as f32 + 1.0; 10],
            };
            ctx.comm.all_reduce_in_place(&mut t, ReduceOp::Sum)?;
            let mut gathered = Tensor {
                shape: vec![world, 2, 5],
                data: vec![0.0; 10 * world],
            };
            ctx.comm.all_gather(&t, &mut gathered)?;
            // A locally refused call is an error value, not a panic.
            let mut short = Tensor {
                shape: vec![3],
                data: vec![0.0; 3],
            };
            match ctx.comm.all_reduce(&t, &mut short, ReduceOp::Sum) {
                Err(CommError::InvalidArgument { .. }) => {}
                other => {
                    return Err(
                        format!("a length mismatch must be refused locally, got {other:?}").into(),
                    )
                }
            }
            let mut notes = notes;
            let note = notes.drain(..).nth(ctx.rank);
            Ok(Summary {
                rank: ctx.rank,
                shape: gathered.shape,
                sum: gathered.data.iter().map(|&x| x as f64).sum(),
                note,
            })
        },
    );
    let want_sum = (1..=world).sum::<usize>() as f64 * 10.0 * world as f64;
    match res {
        Ok(v)
            if v.len() == world
                && v.iter().enumerate().all(|(r, s)| {
                    s.rank == r
                        && s.shape == vec![world, 2, 5]
                        && s.sum == want_sum
                        && s.note.as_deref() == Some(format!("rank {r} was here").as_str())
                }) =>
        {
            Ok(())
        }
        other => Err(format!("{other:?}")),
    }
}
