//! Checkpoints in safetensors with PyTorch `state_dict` names, crash-consistent.
//!
//! A checkpoint saved at `PATH` (e.g. `model.safetensors`) is two files, so the model file loads
//! in PyTorch with `load_state_dict(strict=True)` untouched:
//! - `PATH`: parameters and BatchNorm buffers under their PyTorch names (`module1.0.weight`,
//!   `module1.1.running_var`, `module1.1.num_batches_tracked` as a 0-d i64, ...), metadata
//!   `format = pt`, `step` and `save_id`;
//! - `PATH` with extension `optim.safetensors` (e.g. `model.optim.safetensors`): Adam moments
//!   (`exp_avg.NAME`, `exp_avg_sq.NAME`) and, in the metadata, the step, the number of completed
//!   epochs, the seed and the same `save_id`. The data order of an epoch is a pure function of
//!   `seed + epoch`, so seed and epoch are the complete random-generator position. An fp16 run
//!   also stores its loss scaler there (`loss_scale`, `loss_scale_growth_tracker`,
//!   `loss_scale_skipped` and the scaler's settings, [`ScalerState`]); a file without those keys
//!   (fp32 and bf16 runs, and files written before they existed) loads with
//!   [`TrainState::loss_scaler`] `None`.
//!
//! Beside them, `model.prev.safetensors` and `model.prev.optim.safetensors` hold the previous
//! complete pair. Every save draws a fresh random `save_id` and writes it into both of its files:
//! a model file and an optimizer file belong together exactly when their ids agree, so a torn
//! pair can never be mistaken for a state.
//!
//! A save (rank 0, [`save`]) goes:
//! 1. remove temporaries that killed saves of this checkpoint left behind (their process is gone);
//! 2. write both files to fresh temporaries (`O_CREAT|O_EXCL|O_NOFOLLOW`, random names, created
//!    relative to the directory's descriptor) and fsync them;
//! 3. make the `prev` names point at the pair a resume would use now (hard links, renamed into
//!    place), so that pair survives the next two steps;
//! 4. rename the optimizer temporary over `model.optim.safetensors` and fsync the directory;
//! 5. rename the model temporary over `PATH`: **the commit point**, one atomic rename; then fsync
//!    the directory.
//!
//! At every instant at least one complete pair is on disk under the four names, and a kill
//! before step 5 leaves the previous save as the newest complete one. A resume ([`resume`])
//! tries the pairs newest first and says which it used. Every failure path removes the
//! temporaries it created; a killed process cannot, which step 1 of the next save covers.
//!
//! For tests, `LOCKSTEP_FAULT_SAVE=<step>` kills the saving process (SIGKILL) right after the
//! named step (`fault.rs`: a test hook, not part of the API).
//!
//! | file | holds |
//! |---|---|
//! | `format.rs` | the bytes of the two files: tensors and metadata in safetensors, [`TrainState`]; [`encode_state`] and [`decode_state`], the same bytes without files (in-job recovery) |
//! | `layout.rs` | the four names of a checkpoint and the order a resume tries their pairs |
//! | `commit.rs` | [`save`] and [`check_target`]: the crash-consistent save protocol above |
//! | `resume.rs` | [`resume`], [`load`], [`load_model`]: the newest complete pair, and which it was |
//! | `fault.rs` | the fault injection the crash tests drive (not part of the API) |
//! | `error.rs` | [`CheckpointError`] |
//!
//! The durable-write steps themselves (the temporary, `fsync`, `rename`, `fsync` of the
//! directory) are the crate's one implementation, `types::durable`, shared with
//! [`write_atomic`](lockstep::types::write_atomic).

mod commit;
mod error;
#[doc(hidden)]
pub mod fault;
mod format;
mod layout;
mod resume;
#[cfg(test)]
mod tests;

pub use super::precision::ScalerState;
pub use commit::{check_target, estimate_bytes, save};
pub use error::CheckpointError;
pub use format::{decode_state, encode_state, TrainState};
pub use layout::{optim_path, prev_path};
pub use resume::{load, load_model, resume, Resumed, Source};
