//! Helpers shared by the CPU-engine training tests: loading a truncated pair of splits, the
//! configs of a save-then-resume pair of runs, a run on forked ranks and a parameter checksum.
#![allow(dead_code)]

use std::path::Path;

use lockstep::launch::{launch, LaunchConfig, RankContext};
use lockstep_train::data::{self, Dataset};
use lockstep_train::trainer::{self, Silent, TrainConfig, TrainOutcome};

/// The first `n_train` training and `n_test` test samples of the IDX files in `dir`.
pub fn load_splits(dir: &Path, n_train: usize, n_test: usize) -> (Dataset, Dataset) {
    let mut tr = data::load_split(dir, true).expect("train split");
    let mut te = data::load_split(dir, false).expect("test split");
    tr.truncate(n_train);
    te.truncate(n_test);
    (tr, te)
}

/// The two halves of `base` split at a checkpoint `ck`: one epoch that saves it, then the run
/// that resumes from it (and so ends where `base` itself would).
pub fn save_then_resume(base: &TrainConfig, ck: &Path) -> (TrainConfig, TrainConfig) {
    let first = TrainConfig {
        epochs: 1,
        save: Some(ck.to_path_buf()),
        ..base.clone()
    };
    let resume = TrainConfig {
        resume: Some(ck.to_path_buf()),
        ..base.clone()
    };
    (first, resume)
}

/// Train `cfg` on `ranks` forked ranks without an observer; `each` maps every rank's outcome
/// to what the test compares (rank order).
pub fn train_ranks<R>(
    ranks: usize,
    cfg: &TrainConfig,
    (tr, te): (&Dataset, &Dataset),
    each: impl FnOnce(TrainOutcome) -> R,
) -> Result<Vec<R>, String>
where
    R: serde::Serialize + serde::de::DeserializeOwned,
{
    launch(&LaunchConfig::new(ranks), |mut ctx: RankContext| {
        Ok(each(trainer::train(
            cfg,
            tr,
            te,
            &mut ctx.comm,
            &mut Silent,
        )?))
    })
    .map_err(|e| e.to_string())
}

/// A checksum of `params` that also sees a permutation (each weighted by its index mod 7).
pub fn checksum(params: &[f32]) -> f64 {
    params
        .iter()
        .enumerate()
        .map(|(i, &p)| p as f64 * (1.0 + (i % 7) as f64))
        .sum()
}
