//! The guard: a small process between the launcher and each rank, so that nothing a rank started
//! outlives the launcher, however the launcher dies (`kill -9` included).
//!
//! ```text
//! launcher ──fork──▶ guard (child subreaper) ──▶ rank: an exec'd program (clone + execve, as
//!    │                    │                         posix_spawn does), or the rank function (fork)
//!    │  control pipe ──▶ │   signals to forward; end of file = the launcher is gone
//!    │ ◀── report pipe   │   FORKED(rank pid), then START(rank pid) | SPAWN_FAILED(errno)
//!    │                    │   | GROUP_FAILED(errno), then EXIT(wait status)
//! ```
//!
//! * The guard is forked (not exec'd) from the launcher and, like code between fork and exec,
//!   runs only async-signal-safe system calls: no allocation, no locks (the launcher may have
//!   other threads). Everything it needs (argv, envp, paths) is prepared before the fork.
//! * It is a child subreaper (`PR_SET_CHILD_SUBREAPER`): whatever the rank starts and abandons
//!   (double forks, daemons, `setsid`) is re-parented to the guard, not to init, so every
//!   descendant of the rank stays a descendant of the guard.
//! * The rank dies with its guard (`PR_SET_PDEATHSIG`), and the guard notices the launcher's
//!   death through the control pipe: the launcher holds its only write end, so its death, by any
//!   signal, closes it. The guard then SIGKILLs its whole subtree (its direct children, again and
//!   again as orphans are re-parented to it, until it has none) and removes the job's named
//!   shared-memory segment.
//! * When the rank exits, the guard reports its wait status and SIGKILLs whatever the rank left
//!   behind, then exits. A SIGKILL request from the launcher (the end of a grace period) kills
//!   the whole subtree the same way; other signals go to the rank only (the launcher also signals
//!   the ranks' process group, which reaches descendants that stayed in it).
//! * The ranks of `lockstep launch` share one process group, led by rank 0, so one signal to
//!   the group reaches everything they started. A group lives while it has a member, a zombie
//!   included: rank 0's guard keeps its rank unreaped until the launcher says every rank has
//!   joined, so a rank 0 that ends at once cannot take the group with it. A rank that cannot
//!   join is reported (GROUP_FAILED) and does not run.
//! * The guard stays in the launcher's process group and ignores the job-control and
//!   termination signals a terminal or `kill` of the group sends (INT, QUIT, TERM, HUP, TSTP,
//!   TTIN, TTOU): the launcher decides what the ranks get. Its stdio is /dev/null, so it never
//!   keeps the launcher's output pipes open.
//!
//! What escapes: a process handed to someone else (a request to a daemon such as `systemd-run`,
//! `at`, `ssh`, a container runtime), a process that changes its user id so the guard may no
//! longer signal it, a process in uninterruptible sleep (it dies when it wakes up), and the
//! subtree of a guard that is itself SIGKILLed by hand (the rank dies with it; the rank's children
//! are re-parented to init). A descendant that calls `setsid` stays in the subtree: sessions and
//! process groups do not change who its parent is.
//!
//! | file | holds | runs in |
//! |---|---|---|
//! | `setup.rs` | [`RankSetup`] and [`ExecImage`]: everything prepared before the fork | the launcher |
//! | `parent.rs` | [`start`], [`spawn`], [`Guard`], [`Guarded`]: forking a guard, its reports, its control pipe | the launcher |
//! | `protocol.rs` | the report records and control bytes the two sides exchange | both |
//! | `process.rs` | the guard process: signals, starting the rank, forwarding, the final kill | the guard (async-signal-safe) |
//! | `spawn.rs` | the rank's first moments, forked or exec'd (`clone(CLONE_VM|CLONE_VFORK)` + `execve`) | the rank (async-signal-safe) |
//! | `tree.rs` | finding and killing the guard's descendants through `/proc` | the guard (async-signal-safe) |
//! | `signal_safe.rs` | the descriptors, saved signal state and system-call helpers the post-fork code shares | the guard and the rank |
//!
//! The split follows the fork: nothing in `process.rs`, `spawn.rs`, `tree.rs` or `signal_safe.rs`
//! may allocate, take a lock or run a destructor (the launcher may have other threads).

mod parent;
mod process;
mod protocol;
mod setup;
mod signal_safe;
mod spawn;
mod tree;

pub(crate) use parent::{parse_reports, spawn, start, Guard, Guarded};
pub(crate) use setup::{ExecImage, RankSetup};
