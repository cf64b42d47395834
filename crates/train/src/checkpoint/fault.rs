//! Fault injection for the crash tests (`tests/checkpoint_faults.rs`): `LOCKSTEP_FAULT_SAVE=<step>`
//! ([`FAULT_ENV`], [`SaveStep`]) kills the saving process (SIGKILL) right after the named step of
//! a save, so the tests can check that every instant of the protocol leaves a complete pair.
//!
//! Not part of the API (hidden from the documentation, free to change): a test hook, kept apart
//! from the protocol so the protocol reads without it. `train-cnn` reads the variable too, to
//! refuse a misspelt step before any training.

use std::path::Path;
use std::str::FromStr;

use super::error::CheckpointError;

/// Environment variable that kills the saving process after a named step of a save (tests).
pub const FAULT_ENV: &str = "LOCKSTEP_FAULT_SAVE";

/// A step of [`save`](super::save) after which [`FAULT_ENV`] can kill the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SaveStep {
    /// The optimizer temporary is written (not yet synced).
    OptimWritten,
    /// The model temporary is written (not yet synced).
    ModelWritten,
    /// Both temporaries are fsynced.
    Synced,
    /// The previous model file is kept under its `prev` name.
    PrevModelKept,
    /// The previous optimizer file is kept under its `prev` name.
    PrevOptimKept,
    /// The optimizer temporary is renamed into place, the directory not yet fsynced.
    OptimRenamed,
    /// The directory is fsynced; the commit rename is next.
    OptimDurable,
    /// The model temporary is renamed into place (committed), the directory not yet fsynced.
    Committed,
    /// The save is complete and durable.
    Done,
}

impl SaveStep {
    /// Every step, in the order a save passes them.
    pub const ALL: [SaveStep; 9] = [
        SaveStep::OptimWritten,
        SaveStep::ModelWritten,
        SaveStep::Synced,
        SaveStep::PrevModelKept,
        SaveStep::PrevOptimKept,
        SaveStep::OptimRenamed,
        SaveStep::OptimDurable,
        SaveStep::Committed,
        SaveStep::Done,
    ];

    /// The name [`FAULT_ENV`] uses.
    pub fn name(self) -> &'static str {
        match self {
            SaveStep::OptimWritten => "optim-written",
            SaveStep::ModelWritten => "model-written",
            SaveStep::Synced => "synced",
            SaveStep::PrevModelKept => "prev-model-kept",
            SaveStep::PrevOptimKept => "prev-optim-kept",
            SaveStep::OptimRenamed => "optim-renamed",
            SaveStep::OptimDurable => "optim-durable",
            SaveStep::Committed => "committed",
            SaveStep::Done => "done",
        }
    }

    /// Whether a save killed right after this step has already committed the new pair.
    pub fn is_committed(self) -> bool {
        matches!(self, SaveStep::Committed | SaveStep::Done)
    }
}

impl std::fmt::Display for SaveStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for SaveStep {
    type Err = CheckpointError;
    fn from_str(s: &str) -> Result<SaveStep, CheckpointError> {
        SaveStep::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| CheckpointError::FaultSpec {
                value: s.to_string(),
                valid: SaveStep::ALL.map(SaveStep::name).join(", "),
            })
    }
}

/// The save step [`FAULT_ENV`] names, if it is set (an empty value counts as unset).
pub fn fault_from_env() -> Result<Option<SaveStep>, CheckpointError> {
    match std::env::var_os(FAULT_ENV) {
        None => Ok(None),
        Some(v) if v.is_empty() => Ok(None),
        Some(v) => match v.to_str() {
            Some(s) => s.parse().map(Some),
            None => Err(CheckpointError::FaultSpec {
                value: v.to_string_lossy().into_owned(),
                valid: SaveStep::ALL.map(SaveStep::name).join(", "),
            }),
        },
    }
}

/// Kill this process if `fault` names `step` (fault injection: no destructor, no cleanup runs,
/// exactly as when the machine or an operator kills a trainer).
pub(super) fn reached(fault: Option<SaveStep>, step: SaveStep, path: &Path) {
    if fault == Some(step) {
        tracing::warn!(
            "{FAULT_ENV}={step}: killing this process during the save of {}",
            path.display()
        );
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
        std::process::abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_step_names_parse_strictly() {
        for s in SaveStep::ALL {
            assert_eq!(s.name().parse::<SaveStep>().unwrap(), s);
        }
        let e = "bogus".parse::<SaveStep>().unwrap_err().to_string();
        assert!(e.contains("\"bogus\"") && e.contains(FAULT_ENV), "{e}");
        for s in SaveStep::ALL {
            assert!(e.contains(s.name()), "{e} must list {s}");
        }
        assert!("Committed".parse::<SaveStep>().is_err(), "names are exact");
    }
}
