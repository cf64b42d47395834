//! Joining a job and choosing its backend: the one place that knows every backend.
//!
//! * `vars`: [`EnvInfo`], the launcher's variables, and [`host_id`].
//! * `join`: [`Communicator::from_env`](crate::comm::Communicator::from_env) joins the node's
//!   shared-memory segment, or meets the other nodes through the TCP store; [`join_mpi`] joins
//!   through MPI for callers that choose the path themselves (the torch backend).
//! * `select`: [`device_communicator`], the single policy that picks NCCL, NCCL's multi-rank
//!   mode or staging for device buffers; `lockstep`, `train-cnn` and the benchmarks all call it.

mod join;
mod select;
mod vars;

pub use join::{join_mpi, mpi_mode};
pub use select::device_communicator;
pub use vars::{host_id, launched, EnvInfo, Launcher, JOB_ID_KEY};
pub(crate) use vars::{host_key, node_of};
