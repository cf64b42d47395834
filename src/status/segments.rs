//! This user's segments on this machine, found (`discover`) and read (`shm::status`), each with
//! the [`JobInfo`] that names it.

use super::discover::{self, my_uid, scan};
use super::report::{JobInfo, StatusError};
use crate::shm::{read_segment, SegmentError, SegmentView};

fn job_info(found: &discover::Found, v: &SegmentView) -> JobInfo {
    let path = found.link.strip_suffix(" (deleted)").unwrap_or(&found.link);
    let forked = path.starts_with("/memfd:");
    let name = path.rsplit('/').next().unwrap_or(path);
    let tag = name.strip_prefix("lockstep-").unwrap_or(name);
    let mut holders = found.holders.clone();
    holders.sort_unstable();
    JobInfo {
        id: if forked {
            v.creator_pid.to_string()
        } else {
            tag.to_string()
        },
        segment: found.link.clone(),
        forked,
        sub: !forked && tag.contains(".s"),
        creator_pid: v.creator_pid,
        world: v.world,
        joined: v.joined as usize,
        holders,
        rank_pids: v.ranks.iter().map(|r| r.pid).collect(),
    }
}

/// A segment found, and what reading it gave.
pub(crate) type Read = (JobInfo, Result<SegmentView, SegmentError>);

/// Every segment of this user's, read; world communicators first, then by id.
pub(crate) fn read_all() -> Result<Vec<Read>, StatusError> {
    let mut out: Vec<_> = scan(my_uid())
        .map_err(StatusError::Proc)?
        .into_iter()
        .map(|f| {
            let v = read_segment(&f.file, &f.link);
            let info = match &v {
                Ok(v) => job_info(&f, v),
                Err(_) => JobInfo {
                    id: String::new(),
                    segment: f.link.clone(),
                    forked: false,
                    sub: false,
                    creator_pid: 0,
                    world: 0,
                    joined: 0,
                    holders: f.holders.clone(),
                    rank_pids: Vec::new(),
                },
            };
            (info, v)
        })
        .collect();
    out.sort_by(|a, b| (a.0.sub, &a.0.id, &a.0.rank_pids).cmp(&(b.0.sub, &b.0.id, &b.0.rank_pids)));
    // One process may fork several jobs at once: their ids (its pid) get a suffix in rank-pid
    // order, `<pid>.1`, `<pid>.2`; any of their pids still selects each.
    let mut k = 0;
    while k < out.len() {
        let same = out[k..]
            .iter()
            .take_while(|(i, _)| i.forked && !i.id.is_empty() && i.id == out[k].0.id)
            .count();
        if same > 1 {
            for (n, (i, _)) in out[k..k + same].iter_mut().enumerate() {
                i.id = format!("{}.{}", i.id, n + 1);
            }
        }
        k += same.max(1);
    }
    Ok(out)
}
