//! [`set_seed`] (Accelerate's `set_seed`): it needs the training engine's generators, so it is
//! defined here, beside them; a rank calls it with its communicator
//! (`lockstep_train::set_seed(&mut ctx.comm, seed)`).

use lockstep::comm::{CommError, Communicator, ReduceOp};

/// Seed every generator the training engine uses from `seed`: parameter initialisation and
/// the data order of every epoch (through [`rng::set_global_seed`](super::rng::set_global_seed),
/// which the default [`TrainConfig`](super::trainer::TrainConfig) reads). Collective: it also
/// checks that every rank passed the same seed, since ranks with different data orders would
/// train on overlapping shards and skip others; a disagreement is an error on every rank
/// (naming the smallest and largest seed) and seeds nothing.
pub fn set_seed(comm: &mut Communicator, seed: u64) -> Result<(), CommError> {
    // max(seed) and max(!seed) = !min(seed) in one all-reduce.
    let mut v = [seed, !seed];
    comm.all_reduce_in_place(&mut v[..], ReduceOp::Max)?;
    let (hi, lo) = (v[0], !v[1]);
    if hi != lo {
        return Err(CommError::Mismatch {
            seq: comm.seq(),
            detail: format!(
                "set_seed: the ranks passed different seeds (from {lo} to {hi}; this rank {seed}); pass the same seed on every rank so they agree on the data order"
            ),
        });
    }
    super::rng::set_global_seed(seed);
    Ok(())
}
