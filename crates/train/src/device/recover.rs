//! The device engine's in-job recovery under `lockstep launch --max-restarts N --restart-policy
//! rank`: the protocol of [`trainer::recover`](crate::trainer::recover) on a device
//! communicator (NCCL, or ranks staged through a shared GPU). The survivors of a peer's death
//! grow the communicator back with the replacement (the device communicator's grow: its host
//! communicator agrees on the members, and a new NCCL communicator is made over them), the
//! lowest survivor sends everyone the training state, and the failed step is done again from its
//! start.
//!
//! The state lives on the device and travels there: parameters, Adam's moments and the
//! BatchNorm statistics are broadcast region by region from the sender; the position (epoch,
//! step, Adam's step count, the epoch's loss so far) and the seed go as a sum of host values in
//! which only the sender's are non-zero (a device communicator takes device buffers only, which
//! `Exec::all_reduce_sum_host` stages). Every value is an integer below 2^53 or an f64, so the
//! sum carries it exactly.
//!
//! A step is done again cleanly: the failure surfaces in the gradients' all-reduce, before Adam
//! runs, so parameters and moments are untouched; the BatchNorm statistics and the loss
//! accumulator the step's forward pass moved are put back from a copy taken before it (one read
//! per step, only when recovery is on).

use std::time::Instant;

use super::error::DeviceError;
use super::exec::Exec;
use super::plan::Tensors;
use crate::trainer::recover::Position;
use lockstep::comm::Communicator;

/// What a step's forward pass changes besides the gradients: the BatchNorm statistics and the
/// epoch's loss accumulator, as they were before the step.
pub(super) struct StepSnapshot {
    bn: Vec<f32>,
    loss_sum: Vec<f32>,
}

impl StepSnapshot {
    /// Copy them out of `t`'s regions (waits for the queued work).
    pub(super) fn take<E: Exec>(exec: &mut E, t: &Tensors) -> Result<StepSnapshot, DeviceError> {
        Ok(StepSnapshot {
            bn: exec.read_f32(t.bn_state)?,
            loss_sum: exec.read_f32(t.loss.loss_sum)?,
        })
    }

    /// Put them back, so the step done again moves them once.
    pub(super) fn restore<E: Exec>(&self, exec: &mut E, t: &Tensors) -> Result<(), DeviceError> {
        exec.write_f32(t.bn_state, &self.bn)?;
        exec.write_f32(t.loss.loss_sum, &self.loss_sum)
    }
}

/// The exchange of the module docs on `comm` (every rank of the grown communicator calls it),
/// over the state in `t`'s regions: the lowest survivor's state reaches every replacement, which
/// loads it and takes `pos` from it (Adam's step count too: `pos.step_no`). Survivors keep their
/// own. A replacement whose `seed` differs from the sender's is refused.
pub(super) fn exchange_state<E: Exec>(
    exec: &mut E,
    t: &Tensors,
    comm: &mut Communicator,
    replacement: bool,
    pos: &mut Position,
    seed: u64,
) -> Result<(), DeviceError> {
    let t0 = Instant::now();
    let (me, n) = (comm.rank(), comm.world_size());
    let mut offers = vec![0.0f64; n];
    if !replacement {
        offers[me] = 1.0;
    }
    exec.all_reduce_sum_host(comm, &mut offers)?;
    let root = offers.iter().position(|o| *o > 0.0).ok_or_else(|| {
        DeviceError::Config(
            "in-job recovery: every rank of the grown communicator is a replacement, so nobody holds the training state; rerun the job (or resume from a checkpoint)".into(),
        )
    })?;
    let sender = me == root;
    let mut head = [0.0f64; 6];
    if sender {
        head = [
            pos.epoch as f64,
            pos.step_in_epoch as f64,
            pos.step_no as f64,
            pos.loss_sum,
            (seed >> 32) as f64,
            (seed & 0xffff_ffff) as f64,
        ];
    }
    exec.all_reduce_sum_host(comm, &mut head)?;
    let their_seed = ((head[4] as u64) << 32) | head[5] as u64;
    for r in [t.params, t.m, t.v, t.bn_state] {
        exec.broadcast(comm, r, root)?;
    }
    if replacement {
        if their_seed != seed {
            return Err(DeviceError::Config(format!(
                "in-job recovery: rank {root} trains with seed {their_seed}, this replacement with seed {seed}; start every rank with the same --seed"
            )));
        }
        *pos = Position {
            epoch: head[0] as u64,
            step_in_epoch: head[1] as u64,
            step_no: head[2] as u64,
            loss_sum: head[3],
        };
    }
    tracing::info!(
        "rank {me}: recovery state {} rank {root} on the device in {:.1} ms; continuing at epoch {} step {}",
        if sender { "sent by this rank," } else { "received from" },
        t0.elapsed().as_secs_f64() * 1e3,
        head[0] as u64 + 1,
        head[1] as u64 + 1
    );
    Ok(())
}
