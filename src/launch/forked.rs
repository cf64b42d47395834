//! The library launcher's rank: forked under its guard (`guard/`), it joins the job's segment,
//! runs the rank function once, sends its outcome through the result pipe and ends with `_exit`.

use std::io::Write;
use std::mem::ManuallyDrop;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::child::pipe;
use super::guard::{self, Guarded, RankSetup};
use super::rank::{RankContext, RankResult};
use super::wire::encode_outcome;
use crate::shm::ShmJob;

/// Fork (under its guard, `guard/`) one rank that joins `job` as `rank` and runs `f`; with
/// `capture`, its stdout and stderr go through pipes to the parent. `close` lists the parent's
/// descriptors the rank must not keep (the other ranks' pipes and log files). The child takes
/// `f` out of its copy of `*f` and calls it once; the parent's `f` is untouched (the caller drops
/// it after its last fork). Returns the guarded rank and the read end of its result pipe.
pub(crate) fn spawn<R, F>(
    rank: usize,
    world: usize,
    job: &ShmJob,
    f: &mut ManuallyDrop<F>,
    capture: bool,
    close: &[RawFd],
) -> std::io::Result<(Guarded, OwnedFd)>
where
    R: Serialize + DeserializeOwned,
    F: FnOnce(RankContext) -> RankResult<R>,
{
    let (rd, wr) = pipe()?;
    let mut close_list = close.to_vec();
    close_list.push(rd.as_raw_fd());
    let setup = RankSetup {
        pgid: None,
        pgid_from_launcher: false,
        hold_leader: false,
        capture,
        stdin_null: false,
        close: &close_list,
        exec: None,
        unlink_on_launcher_death: None,
    };
    let wr_fd = wr.as_raw_fd();
    let g = guard::spawn(&setup, || {
        // SAFETY: this runs in the rank, a copy of the parent's memory: nothing else in this
        // process reads `*f` after this point (the rank ends in `_exit` inside `run_child`), so
        // taking the value out of the ManuallyDrop moves the closure to its single call.
        let f = unsafe { ManuallyDrop::take(f) };
        // SAFETY: `wr_fd` is this rank's copy of the result pipe's write end; nothing else in
        // the rank owns it.
        let wr = unsafe { OwnedFd::from_raw_fd(wr_fd) };
        run_child(rank, world, job, f, wr);
    })?;
    drop(wr);
    Ok((g, rd))
}

fn run_child<R, F>(rank: usize, world: usize, job: &ShmJob, f: F, wr: OwnedFd) -> !
where
    R: Serialize + DeserializeOwned,
    F: FnOnce(RankContext) -> RankResult<R>,
{
    let outcome =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<R, String> {
            let comm = job.communicator(rank).map_err(|e| e.to_string())?;
            f(RankContext {
                rank,
                local_rank: rank,
                world_size: world,
                comm,
            })
            .map_err(|e| e.to_string())
        }));
    let (outcome, code) = match outcome {
        Ok(Ok(v)) => (Ok(v), 0),
        Ok(Err(m)) => (Err(m), 1),
        Err(p) => {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "panicked".into());
            (Err(format!("panicked: {msg}")), 101)
        }
    };
    let bytes = encode_outcome(&outcome);
    let mut file = std::fs::File::from(wr);
    let _ = file.write_all(&bytes);
    drop(file);
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: _exit skips the parent's atexit handlers and destructors, which must not run twice.
    unsafe { libc::_exit(code) }
}
