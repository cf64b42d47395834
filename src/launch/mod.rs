//! The launchers.
//!
//! * [`launch`] (the `notebook_launcher` analog) forks `nprocs` ranks that each run a function
//!   with a ready [`Communicator`](crate::comm::Communicator), and returns every rank's result. The parent creates the shared
//!   segment, forks, and supervises. The host process can call it again afterwards.
//! * [`run_job`] backs `lockstep launch`: it execs `nproc_per_node` copies of a program with the
//!   rendezvous environment (`RANK`, `WORLD_SIZE`, `LOCKSTEP_JOB_ID`, ...) that
//!   [`Communicator::from_env`](crate::comm::Communicator::from_env) reads, hosting the rendezvous store on node 0 of multi-node jobs.
//!
//! Both share the supervisor (`supervise.rs`): the first rank that fails (error, panic, non-zero
//! exit or signal) gets the others terminated (SIGTERM, then SIGKILL after a grace period) unless
//! fail-fast is off. Every rank runs under a guard process (`guard/`): a child subreaper that
//! kills the rank and everything it started when the launcher dies, however it dies. Each rank's stdout/stderr comes back through pipes and is printed line by line with a
//! `[rank N]` prefix (`output.rs`), optionally also to per-rank log files; failures are reported
//! with the tail of the rank's stderr between divider lines (`report.rs`).
//!
//! | file | what lives there |
//! |---|---|
//! | `guard/` | the guard between the launcher and each rank: fork, exec, subtree kill on the launcher's death |
//! | `child.rs` | pipes, the library launcher's forked ranks, reading, reaping, killing |
//! | `signals.rs` | the CLI's SIGINT/SIGTERM/SIGHUP handlers (counters plus a self-pipe) |
//! | `supervise.rs` | the poll loop: output, results, exits, fail-fast, signal forwarding |
//! | `output.rs` | line splitting, `[rank N]` prefixes, log files, rank filter, stderr tails |
//! | `report.rs` | [`RankFailure`], [`LaunchError`], the failure summary |
//! | `exec.rs` | [`JobSpec`] and [`run_job`] (the CLI launcher) |
//! | `wire.rs` | encoding of rank results |
//!
//! Fork safety: the child runs only the user's function and lockstep code that takes no lock the
//! parent's other threads could hold. Call `launch` from a single-threaded host (a `harness = false`
//! test, a CLI, a notebook kernel) to be safe.

mod child;
mod exec;
mod fork;
mod forked;
mod guard;
mod output;
mod rank;
mod report;
mod signals;
mod supervise;
mod wire;

pub use child::monotonic_ns;
pub use exec::{run_job, JobSpec, RestartPolicy};
pub use fork::{launch, LaunchConfig};
pub use rank::{RankContext, RankResult, SaveError};
pub use report::{summary, LaunchError, RankFailure};
