//! What the launcher and a guard exchange: the records on the report pipe (guard to launcher),
//! the bytes on the control pipe (launcher to guard), and the flag on the exec error pipe (rank to
//! guard).
//!
//! Its own file because both sides of the fork must agree on it, and neither side's code is the
//! other's.

/// Report records, each `[tag, value]` as two native-endian `i32` (one atomic pipe write).
/// FORKED comes first, as soon as the rank process exists (its process group too, when it leads
/// one), so the launcher can start the next ranks without waiting for this one to run. (An exec'd
/// rank exists for the guard once its `execve` has begun: see [`spawn_exec_rank`].)
pub(super) const FORKED: i32 = 4;
pub(super) const START: i32 = 1;
pub(super) const SPAWN_FAILED: i32 = 2;
pub(super) const EXIT: i32 = 3;
/// The rank could not join the process group it was given (value: errno); it did not start.
pub(super) const GROUP_FAILED: i32 = 5;
pub(super) const RECORD: usize = 8;

/// Set in the four bytes an exec'd rank writes to the exec error pipe when the failure was its
/// `setpgid`, not its `execve` (errno values are far below it).
pub(super) const GROUP_ERR_FLAG: i32 = 1 << 30;

/// The control byte that releases a held group leader (see [`RankSetup::hold_leader`](super::setup::RankSetup::hold_leader)). Every
/// other byte is a signal number for the rank, and signal 0 is never one to forward.
pub(super) const RELEASE: u8 = 0;
