//! One communicator across the nodes of a CPU job started by `mpiexec` or `srun`: shared memory
//! among the ranks of each node, MPI point-to-point messages between nodes (see `docs/mpi.md`).
//!
//! * `join`: [`join`] builds it under MPI: nodes from MPI's shared-memory split (or
//!   `LOCKSTEP_MPI_NODE_SIZE`), one shared-memory segment per node, and [`Layout`]'s node-major
//!   order.
//! * `backend`: the collectives. Each call starts with a header phase (every rank's call
//!   checked against rank 0's, so a mismatch is named on every rank; it doubles as the
//!   barrier), then moves data in shared memory and between nodes.
//! * `fold`: the reduction steps, the canonical order of [`crate::reference`] split across
//!   nodes; `wire`: the headers and failure statuses the ranks exchange; `layout`: nodes and
//!   the order.
//!
//! Determinism: every reduction (all-reduce, reduce, reduce-scatter) gives, bit for bit,
//! [`reference::reduce`](crate::reference::reduce) of the inputs in node-major order, on every
//! rank and every run, whatever the message size: MPI only moves bytes, and the running value of
//! each element passes from node to node in that order without rounding in between (f16 and bf16
//! travel as f32).
//!
//! Faults: a rank that fails (a peer lost, a timeout) tells its node through the status of the
//! next shared-memory step and every other node through a notice message that ends their MPI
//! waits, so every rank fails with the same cause. Waits that depend on another node's waits get
//! a margin more time, so that the rank nearest a stuck rank reports it first.

mod backend;
mod fold;
mod join;
mod layout;
mod wire;

pub(crate) use join::{join, mpi_mode, MpiMode};
