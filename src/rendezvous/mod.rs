//! Joining a job and choosing its backend: the one place that knows every backend.
//!
//! * `env`: [`Communicator::from_env`](crate::comm::Communicator::from_env) reads the launcher's variables, joins the node's
//!   shared-memory segment or meets the other nodes through the TCP store.
//! * `select`: [`device_communicator`], the single policy that picks NCCL, NCCL's multi-rank
//!   mode or staging for device buffers; `lockstep`, `train-cnn` and the benchmarks all call it.

mod env;
mod select;

pub use env::{host_id, EnvInfo, JOB_ID_KEY};
pub use select::device_communicator;
