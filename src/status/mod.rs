//! `lockstep status`: a live look at this user's running jobs on this machine, from another
//! process, without stopping or slowing them.
//!
//! * [`list_jobs`]: every communicator segment some process of the caller holds ([`JobInfo`]).
//! * [`job_status`]: one job's ranks ([`JobStatus`]): pid, host, process state, the collective
//!   each is in (its number, op, count, dtype, reduction, root) and how long it has waited there,
//!   which ranks each
//!   waits for, and which ranks are behind, grouped by collective number as NCCL's RAS does.
//! * [`JobStatus::to_json`], [`JobList::to_json`], [`JobStatus::text`] and [`JobList::text`]: what the CLI, the C ABI and
//!   Python print.
//!
//! What it reads is what the ranks already publish for their peers' checks and timeout reports
//! (the control blocks: published phase, collective number and kind, call descriptors; the
//! inline entries), plus a coarse timestamp of when a rank began waiting in its collective,
//! written only by waits that outlast their first polls (`shm::sync::Ctrl::wait_start`). The
//! segments are found through `/proc` (`discover`) and read with `pread`, never mapped or written
//! (`shm::status`). Jobs of other users are never read. A device communicator of one node keeps
//! the host communicator it was made over and shows there each call NCCL carries (see
//! `nccl::membership`), so GPU jobs read the same.
//!
//! A job across nodes under `lockstep launch` is read whole from any node: this node's segment,
//! then every node's launcher asked through the job's store (`nodes`), the answers merged by
//! global rank. Under other launchers no store outlives the rendezvous: a job across nodes shows
//! this node's ranks (NCCL's node communicator, or the hierarchical backend's node segment), and
//! a summary line says so.
//!
//! Collective numbers count the collectives of one communicator; point-to-point calls are not
//! numbered, so a rank blocked in a send or receive shows at its last collective.
//!
//! | file | what |
//! |---|---|
//! | `report.rs` | the reports ([`JobList`], [`JobStatus`]...) and their text |
//! | `discover.rs` | finding this user's segments and processes in `/proc` |
//! | `segments.rs` | reading them, each named by a [`JobInfo`] |
//! | `analyze.rs` | who waits for whom, and the summary lines |
//! | `nodes.rs` | a job across nodes: asking every node's launcher through the store, and answering |
//! | `json.rs` | `--json` |

mod analyze;
mod discover;
#[cfg(feature = "json")]
mod json;
mod nodes;
mod report;
mod segments;

#[cfg(feature = "json")]
pub(crate) use nodes::answer_asks;
pub use report::{JobInfo, JobList, JobStatus, NodeReport, RankStatus, StatusError, Unreadable};

use std::time::Instant;

use crate::shm::coarse_now_ns;
use analyze::{analyze, summarize};
use discover::{host_name, my_uid, owner, proc_state};
use segments::read_all;

/// This user's lockstep jobs running on this machine (empty when none runs).
pub fn list_jobs() -> Result<JobList, StatusError> {
    let mut list = JobList::default();
    for (info, v) in read_all()? {
        match v {
            Ok(_) => list.jobs.push(info),
            Err(e) => list.unreadable.push(Unreadable {
                segment: info.segment,
                holders: info.holders,
                error: e.to_string(),
            }),
        }
    }
    Ok(list)
}

/// The status of one of this user's jobs: `sel` is a job id (as [`list_jobs`] gives it), or the
/// pid of any process of the job (a rank, or the parent that forked them; a pid that holds both
/// a world communicator and sub-communicators selects the world one). An error names the jobs
/// that run when none matches.
pub fn job_status(sel: &str) -> Result<JobStatus, StatusError> {
    let t = Instant::now();
    let all = read_all()?;
    let sel_pid = sel.parse::<i32>().ok().filter(|&p| p > 0);
    let matches = |i: &JobInfo| {
        i.id == sel
            || sel_pid.is_some_and(|p| {
                i.creator_pid == p || i.holders.contains(&p) || i.rank_pids.contains(&p)
            })
    };
    // An exact id first; then a pid, world communicators before sub-communicators (`read_all`'s
    // order).
    // A job across nodes has one segment per node, `<id>.h<k>` (`rendezvous::NodeOf`): its id
    // selects the one of this node.
    let node_of_job = |i: &JobInfo| {
        i.id.strip_prefix(sel)
            .and_then(|t| t.strip_prefix(".h"))
            .is_some_and(|k| !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()))
    };
    let pick = all
        .iter()
        .position(|(i, _)| i.id == sel)
        .or_else(|| all.iter().position(|(i, _)| node_of_job(i)))
        .or_else(|| all.iter().position(|(i, _)| !i.id.is_empty() && matches(i)));
    let Some(k) = pick else {
        if let Some(p) = sel_pid {
            if let Some(uid) = owner(p).filter(|&u| u != my_uid()) {
                return Err(StatusError::OtherUser { pid: p, uid });
            }
        }
        return Err(StatusError::NotFound {
            sel: sel.to_string(),
            available: all
                .iter()
                .filter(|(i, v)| v.is_ok() && !i.id.is_empty())
                .map(|(i, _)| i.id.clone())
                .collect(),
        });
    };
    let (info, view) = all.into_iter().nth(k).expect("index from position");
    let view = view?;
    let now = coarse_now_ns();
    let host = host_name();
    let ranks = analyze(&view.ranks, now, &host, proc_state);
    let summary = summarize(&ranks);
    let reach = if info.forked || info.sub {
        nodes::Reach::OneNode
    } else {
        nodes::reach(&info.rank_pids, info.world)
    };
    let local = JobStatus {
        job: info,
        ranks,
        summary,
        aborted_by: view.aborted_by.checked_sub(1).map(|r| r as usize),
        read_us: 0,
        nodes: Vec::new(),
    };
    let mut st = nodes::widen(local, reach);
    st.read_us = t.elapsed().as_micros() as u64;
    Ok(st)
}
