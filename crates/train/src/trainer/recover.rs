//! In-job recovery of the CPU engine under `lockstep launch --max-restarts N --restart-policy
//! rank`: when a peer dies during an optimizer step, the survivors grow the communicator back to
//! the full world with the replacement the launcher started
//! ([`Communicator::grow`](lockstep::comm::Communicator::grow)), the lowest surviving rank
//! sends everyone the training state, and the failed step is done again from its start, so the
//! run follows the path an undisturbed run takes.
//!
//! The state is what a checkpoint holds (parameters, BatchNorm statistics, Adam's moments and
//! step, the seed and epoch, which fix every random draw: the data order of an epoch is a pure
//! function of seed and epoch), in a checkpoint's own bytes
//! ([`encode_state`](crate::checkpoint::encode_state)), plus the position in the epoch (the
//! step to do next) and the epoch's loss so far; no file is read or written. The replacement
//! learns that it is one from `LOCKSTEP_REPLACEMENT=1`, receives the state instead of
//! initialising, and starts at the same epoch and step.
//!
//! Exchange, on the grown communicator (every rank takes part): an all-reduce (min) of each
//! rank's offer (its rank on a survivor, `u64::MAX` on a replacement) names the sender, the
//! lowest survivor; then broadcasts of the position and of the two byte strings from it.

use std::time::Instant;

use super::config::TrainError;
use crate::checkpoint::{decode_state, encode_state, TrainState};
use crate::model::Model;
use crate::ops::optim::Adam;
use lockstep::comm::{CommError, Communicator, ReduceOp};

/// Whether this run recovers from a peer's death in the job, and how many more times it may.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Recovery {
    /// Restarts the launcher allows in all (`LOCKSTEP_MAX_RESTARTS`).
    max: u64,
    /// Restarts used as far as this rank knows: its own start's count, plus the ranks replaced
    /// since (each grow counts the ranks it took back in).
    used: u64,
    /// This process is a replacement (`LOCKSTEP_REPLACEMENT=1`).
    pub replacement: bool,
}

/// The position in the run at which a replacement continues.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Position {
    /// The epoch (0-based) in progress.
    pub epoch: u64,
    /// The optimizer step of the epoch to do next (0-based).
    pub step_in_epoch: u64,
    /// Optimizer steps taken in all.
    pub step_no: u64,
    /// The sender's training loss summed over its samples so far this epoch (the replacement
    /// takes it for its own: only the epoch's reported loss depends on it).
    pub loss_sum: f64,
}

impl Recovery {
    /// From the launcher's variables: `Some` under `--restart-policy rank` with restarts left
    /// (or in a replacement, which must receive its state whatever remains). They are parsed as
    /// strictly as every `LOCKSTEP_*` variable: a malformed one is an error naming it, never a
    /// silent "no recovery".
    pub(crate) fn from_env() -> Result<Option<Recovery>, TrainError> {
        use lockstep::types::env;
        let bad = |e: env::EnvError| TrainError::Config(e.to_string());
        if env::choice("LOCKSTEP_RESTART_POLICY", &["job", "rank"]).map_err(bad)? != Some("rank") {
            return Ok(None);
        }
        let r = Recovery {
            max: env::count("LOCKSTEP_MAX_RESTARTS", 0, u64::MAX)
                .map_err(bad)?
                .unwrap_or(0),
            used: env::RESTART_COUNT.count().map_err(bad)?.unwrap_or(0),
            replacement: env::REPLACEMENT.choice().map_err(bad)? == Some("1"),
        };
        Ok((r.replacement || r.used < r.max).then_some(r))
    }

    /// Whether a failure `e` of a collective can be recovered from here: a peer died (or the
    /// communicator was aborted for it) and the launcher has a restart left to replace it.
    pub(crate) fn can_recover(&self, e: &TrainError) -> bool {
        matches!(e, TrainError::Comm(c) if self.can_recover_comm(c))
    }

    /// [`can_recover`](Self::can_recover) for a collective's own error.
    pub(crate) fn can_recover_comm(&self, e: &CommError) -> bool {
        self.used < self.max && matches!(e, CommError::PeerLost { .. } | CommError::Aborted { .. })
    }

    /// Grow `comm` back to the full world after `cause`, replacing it in place; returns the
    /// seconds the grow took.
    pub(crate) fn grow(
        &mut self,
        comm: &mut Communicator,
        cause: &dyn std::fmt::Display,
    ) -> Result<f64, TrainError> {
        let t = Instant::now();
        tracing::warn!(
            "rank {}: {cause}; waiting for the launcher's replacement to grow the communicator back to {} ranks",
            comm.rank(),
            comm.world_size()
        );
        let new = comm.grow()?;
        *comm = new;
        // One restart per grow: the training step fails on the first death it meets.
        self.used += 1;
        Ok(t.elapsed().as_secs_f64())
    }
}

/// The exchange of the module docs on `comm`: the lowest survivor's state (`model`, `opt`,
/// `pos`, `seed`) reaches every replacement, which loads it. Survivors keep their own.
pub(crate) fn exchange_state(
    comm: &mut Communicator,
    replacement: bool,
    model: &mut Model,
    opt: &mut Adam,
    pos: &mut Position,
    seed: u64,
) -> Result<(), TrainError> {
    let t = Instant::now();
    let mut offer = [if replacement {
        u64::MAX
    } else {
        comm.rank() as u64
    }];
    comm.all_reduce_in_place(&mut offer[..], ReduceOp::Min)?;
    let root = offer[0];
    if root == u64::MAX {
        return Err(TrainError::Config(
            "in-job recovery: every rank of the grown communicator is a replacement, so nobody holds the training state; rerun the job (or resume from a checkpoint)".into(),
        ));
    }
    let root = root as usize;
    let sender = comm.rank() == root;
    let (mut model_bytes, mut optim_bytes) = if sender {
        let st = TrainState {
            epoch: pos.epoch,
            step: opt.step,
            seed,
            world_size: comm.world_size() as u64,
            loss_scaler: None,
        };
        encode_state(model, opt, &st)?
    } else {
        (Vec::new(), Vec::new())
    };
    let mut head = [
        pos.epoch,
        pos.step_in_epoch,
        pos.step_no,
        pos.loss_sum.to_bits(),
        model_bytes.len() as u64,
        optim_bytes.len() as u64,
    ];
    comm.broadcast_in_place(&mut head[..], root)?;
    model_bytes.resize(head[4] as usize, 0);
    optim_bytes.resize(head[5] as usize, 0);
    comm.broadcast_in_place(&mut model_bytes[..], root)?;
    comm.broadcast_in_place(&mut optim_bytes[..], root)?;
    if replacement {
        let st = decode_state(&model_bytes, &optim_bytes, model, opt)?;
        if st.seed != seed {
            return Err(TrainError::Config(format!(
                "in-job recovery: rank {root} trains with seed {}, this replacement with seed {seed}; start every rank with the same --seed",
                st.seed
            )));
        }
        *pos = Position {
            epoch: head[0],
            step_in_epoch: head[1],
            step_no: head[2],
            loss_sum: f64::from_bits(head[3]),
        };
    }
    tracing::info!(
        "rank {}: recovery state {} rank {root}: {} bytes in {:.1} ms; continuing at epoch {} step {}",
        comm.rank(),
        if sender { "sent by this rank," } else { "received from" },
        head[4] + head[5],
        t.elapsed().as_secs_f64() * 1e3,
        head[0] + 1,
        head[1] + 1
    );
    Ok(())
}
