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
//! `nccl::membership`), so GPU jobs read the same. Single node: a multi-node job shows the
//! communicator of this node's ranks (the hierarchical backend's node segment).
//!
//! Collective numbers count the collectives of one communicator; point-to-point calls are not
//! numbered, so a rank blocked in a send or receive shows at its last collective.

mod discover;
#[cfg(feature = "json")]
mod json;
mod nodes;

#[cfg(feature = "json")]
pub(crate) use nodes::answer_asks;

use std::time::Instant;

use crate::shm::{coarse_now_ns, read_segment, RankView, SegmentError, SegmentView};
use discover::{host_name, my_uid, owner, proc_state, scan};

/// Why a status could not be given.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    /// `/proc` could not be listed.
    #[error("cannot list /proc ({0}): lockstep status needs a Linux /proc")]
    Proc(std::io::Error),
    /// No job of the caller matches.
    #[error("no running lockstep job of yours matches {sel:?}{}", if .available.is_empty() { " (none is running on this machine)".to_string() } else { format!("; running: {}", .available.join(", ")) })]
    NotFound {
        /// What was asked for.
        sel: String,
        /// The ids of the caller's jobs.
        available: Vec<String>,
    },
    /// The process asked for belongs to another user.
    #[error("process {pid} belongs to another user (uid {uid}): lockstep status reads only your own jobs; run it as that user")]
    OtherUser {
        /// The process.
        pid: i32,
        /// Its owner.
        uid: u32,
    },
    /// The segment cannot be trusted.
    #[error("{0}")]
    Segment(#[from] SegmentError),
}

/// One communicator segment found on this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "json", derive(serde::Serialize))]
pub struct JobInfo {
    /// What `lockstep status JOB` takes: the job id of an exec'd job (`LOCKSTEP_JOB_ID`, or the
    /// tag of a sub-communicator, `<id>.s<k>c<color>`), or the pid of the process that forked
    /// the ranks.
    pub id: String,
    /// The segment, as `/proc` names it.
    pub segment: String,
    /// Ranks forked from one process (an anonymous segment), not exec'd with a job id.
    pub forked: bool,
    /// A sub-communicator's segment (`Communicator::split`).
    pub sub: bool,
    /// The process that created the segment.
    pub creator_pid: i32,
    /// Number of ranks.
    pub world: usize,
    /// Ranks that have joined.
    pub joined: usize,
    /// The processes that hold the segment (ranks, and the parent of forked ranks).
    pub holders: Vec<i32>,
    /// The rank pids (0: not joined).
    pub rank_pids: Vec<i32>,
}

/// A segment that was found but could not be read (stale, another version, not lockstep's).
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "json", derive(serde::Serialize))]
pub struct Unreadable {
    /// The segment, as `/proc` names it.
    pub segment: String,
    /// The processes that hold it.
    pub holders: Vec<i32>,
    /// Why.
    pub error: String,
}

/// The caller's jobs on this machine.
#[derive(Debug, Clone, Default)]
#[cfg_attr(feature = "json", derive(serde::Serialize))]
pub struct JobList {
    /// Readable segments, world communicators first.
    pub jobs: Vec<JobInfo>,
    /// Segments that failed the checks.
    pub unreadable: Vec<Unreadable>,
}

/// One rank, as [`job_status`] sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "json", derive(serde::Serialize, serde::Deserialize))]
pub struct RankStatus {
    /// Rank in the communicator.
    pub rank: usize,
    /// Its process (0: not joined yet).
    pub pid: i32,
    /// The machine.
    pub host: String,
    /// `joined`, `left` (dropped its communicator), `not joined`, or `exited`.
    pub member: String,
    /// Process state from `/proc`: `R` running, `S` sleeping, `T` stopped, `Z` zombie... (`None`:
    /// gone).
    pub proc_state: Option<char>,
    /// Number of the collective it is in, or last was in (0: none yet).
    pub seq: u64,
    /// That collective's kind (`all_reduce`...).
    pub op: Option<String>,
    /// The arguments it published for it, once it has arrived at its first exchange.
    pub count: Option<u64>,
    /// Element type.
    pub dtype: Option<String>,
    /// Reduction, for reducing collectives.
    pub reduce: Option<String>,
    /// Root, for rooted collectives.
    pub root: Option<u64>,
    /// It published its arguments for collective `seq` (it arrived; otherwise it is still
    /// before the first exchange of that call).
    pub arrived: bool,
    /// It refused the call (invalid arguments).
    pub invalid: bool,
    /// Milliseconds it has waited for its peers in collective `seq` (to the coarse clock's tick,
    /// 1 to 4 ms); `None` when it is not waiting there (it has not reached the call's exchange,
    /// or its waits ended within their first polls).
    pub waited_ms: Option<u64>,
    /// Its phase or collective number moved while it was read: it makes progress.
    pub moving: bool,
    /// The ranks it waits for.
    pub waiting_for: Vec<usize>,
    /// Some rank waits for it.
    pub behind: bool,
}

/// One node of a job that spans nodes, as its launcher answered through the store.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "json", derive(serde::Serialize))]
pub struct NodeReport {
    /// The node (`lockstep launch --node-rank`).
    pub node: usize,
    /// Its host, as its launcher names it (`None`: it did not answer).
    pub host: Option<String>,
    /// The ranks it answered for.
    pub ranks: Vec<usize>,
    /// Why it shows no ranks: it did not answer in time, or its ranks have not joined yet.
    pub error: Option<String>,
}

/// One job's ranks.
#[derive(Debug, Clone)]
#[cfg_attr(feature = "json", derive(serde::Serialize))]
pub struct JobStatus {
    /// The job.
    pub job: JobInfo,
    /// Every rank, in order.
    pub ranks: Vec<RankStatus>,
    /// NCCL-RAS-style lines: how many ranks entered which collective, who waits for whom.
    pub summary: Vec<String>,
    /// The rank that aborted the communicator, if one did.
    pub aborted_by: Option<usize>,
    /// Microseconds the reader took (discovery, reads, and asking the other nodes).
    pub read_us: u64,
    /// A job that spans nodes under `lockstep launch`: what each node's launcher answered
    /// through the store (empty for a job of one node). `ranks` then holds every node's ranks,
    /// numbered as in the job.
    pub nodes: Vec<NodeReport>,
}

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
type Read = (JobInfo, Result<SegmentView, SegmentError>);

/// Every segment of this user's, read; world communicators first, then by id.
fn read_all() -> Result<Vec<Read>, StatusError> {
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

/// Who waits for whom. A rank that arrived at collective `s` (published its arguments) waits for
/// every rank at an earlier collective, and for those at `s` that have not arrived yet or have
/// published fewer phases (a rank cannot publish phase `p + 1` before every rank has reached
/// `p`). A rank that has not arrived waits for nobody yet: it is still on its own way to the
/// exchange (computing, or stopped there). Ranks that left or exited are waited for too.
fn waiting_for(ranks: &[RankView]) -> Vec<Vec<usize>> {
    let arrived = |r: &RankView| r.call.is_some();
    ranks
        .iter()
        .enumerate()
        .map(|(i, r)| {
            if !r.joined || !arrived(r) {
                return Vec::new();
            }
            (0..ranks.len())
                .filter(|&q| q != i)
                .filter(|&q| {
                    let o = &ranks[q];
                    o.seq < r.seq
                        || (o.seq == r.seq
                            && (!arrived(o)
                                || (!r.call.as_ref().is_some_and(|c| c.inline)
                                    && o.progress < r.progress)))
                })
                .collect()
        })
        .collect()
}

/// Each rank's status from its control block (`now`: the coarse clock; `state`: a process's
/// state letter).
fn analyze(
    ranks: &[RankView],
    now: u64,
    host: &str,
    state: impl Fn(i32) -> Option<char>,
) -> Vec<RankStatus> {
    let waits = waiting_for(ranks);
    ranks
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let st = if r.pid > 0 { state(r.pid) } else { None };
            let member = if r.left {
                "left"
            } else if !r.joined {
                "not joined"
            } else if st.is_none() || st == Some('Z') || st == Some('X') {
                "exited"
            } else {
                "joined"
            };
            let call = r.call.as_ref();
            let kind = call.and_then(|c| c.kind).or(r.kind);
            RankStatus {
                rank: i,
                pid: r.pid,
                host: host.to_string(),
                member: member.to_string(),
                proc_state: st,
                seq: r.seq,
                op: r.kind.or(kind).map(|k| k.name().to_string()),
                count: call.map(|c| c.count),
                dtype: call.and_then(|c| c.dtype).map(|d| d.name().to_string()),
                reduce: call
                    .filter(|_| kind.is_some_and(|k| k.has_op()))
                    .and_then(|c| c.op)
                    .map(|o| o.name().to_string()),
                root: call
                    .filter(|_| kind.is_some_and(|k| k.has_root()))
                    .map(|c| c.root),
                arrived: call.is_some(),
                invalid: call.is_some_and(|c| c.invalid),
                waited_ms: (r.wait_ns > 0 && r.seq > 0 && now >= r.wait_ns)
                    .then(|| (now - r.wait_ns) / 1_000_000),
                moving: r.moving,
                waiting_for: waits[i].clone(),
                behind: waits.iter().any(|w| w.contains(&i)),
            }
        })
        .collect()
}

/// `rank 1 (pid 1234)` for each rank, joined.
fn name_ranks(ranks: &[&RankStatus]) -> String {
    ranks
        .iter()
        .map(|r| format!("rank {} (pid {})", r.rank, r.pid))
        .collect::<Vec<_>>()
        .join(", ")
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        "rank"
    } else {
        "ranks"
    }
}

/// The summary lines: ranks grouped by collective number (highest first), as NCCL's RAS
/// reports ("2 ranks have launched up to operation 6650, 1 rank ... 6649"), then who waits for
/// whom.
fn summarize(ranks: &[RankStatus]) -> Vec<String> {
    let mut out = Vec::new();
    let mut seqs: Vec<u64> = ranks.iter().map(|r| r.seq).collect();
    seqs.sort_unstable_by(|a, b| b.cmp(a));
    seqs.dedup();
    for (k, &s) in seqs.iter().enumerate() {
        let at: Vec<&RankStatus> = ranks.iter().filter(|r| r.seq == s).collect();
        let op = at
            .iter()
            .find_map(|r| r.op.as_deref())
            .map(|o| format!(" ({o})"))
            .unwrap_or_default();
        let who = if k == 0 && seqs.len() > 1 {
            String::new()
        } else {
            format!(" ({})", name_ranks(&at))
        };
        out.push(if k == 0 {
            format!(
                "{} {}{who} {} entered up to collective #{s}{op}",
                at.len(),
                plural(at.len()),
                if at.len() == 1 { "has" } else { "have" }
            )
        } else {
            format!(
                "{} {}{who} only up to #{s}{op}: behind",
                at.len(),
                plural(at.len())
            )
        });
    }
    if ranks.iter().any(|r| r.moving) {
        out.push(
            "the job makes progress (collective numbers moved while it was read): a snapshot"
                .into(),
        );
    }
    let behind: Vec<&RankStatus> = ranks.iter().filter(|r| r.behind).collect();
    if !behind.is_empty() {
        let waiters: Vec<&RankStatus> =
            ranks.iter().filter(|r| !r.waiting_for.is_empty()).collect();
        let how = |r: &RankStatus| match (r.member.as_str(), r.proc_state) {
            ("joined", Some('T' | 't')) => " (stopped)".to_string(),
            ("joined", Some('R')) => " (running)".to_string(),
            ("joined", _) if r.moving => " (running)".to_string(),
            ("joined", _) => String::new(),
            (m, _) => format!(" ({m})"),
        };
        out.push(format!(
            "{} {} for {}",
            name_ranks(&waiters),
            if waiters.len() == 1 { "waits" } else { "wait" },
            behind
                .iter()
                .map(|r| format!("rank {} (pid {}){}", r.rank, r.pid, how(r)))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    } else if ranks.iter().all(|r| r.member == "joined") && seqs.len() == 1 {
        out.push("nobody waits: every rank is at the same collective".into());
    }
    out
}

impl JobStatus {
    /// The human-readable report `lockstep status JOB` prints.
    pub fn text(&self) -> String {
        let j = &self.job;
        let nodes = if self.nodes.is_empty() {
            String::new()
        } else {
            format!(" on {} nodes", self.nodes.len())
        };
        let mut s = format!(
            "job {}: {} ranks{nodes} ({} joined), {}{}, {}segment {}\n",
            j.id,
            j.world,
            j.joined,
            if j.forked {
                format!("forked by pid {}", j.creator_pid)
            } else {
                format!("created by pid {}", j.creator_pid)
            },
            if j.sub { ", a sub-communicator" } else { "" },
            if self.nodes.is_empty() {
                ""
            } else {
                "this node's "
            },
            j.segment
        );
        if let Some(a) = self.aborted_by {
            s += &format!("aborted by rank {a}\n");
        }
        s += &format!(
            "{:>4}  {:>8}  {:<12}  {:<10}  {:>8}  {:<14}  {:>10}  {:<5}  {:<6}  {:>7}  {}\n",
            "rank",
            "pid",
            "host",
            "state",
            "coll",
            "op",
            "count",
            "dtype",
            "op/root",
            "waited",
            "waiting for"
        );
        for r in &self.ranks {
            let state = match (r.member.as_str(), r.proc_state) {
                ("joined", Some(c)) => match c {
                    'T' | 't' => "stopped".to_string(),
                    'R' => "running".to_string(),
                    'D' => "disk wait".to_string(),
                    _ if r.moving => "running".to_string(),
                    _ => "sleeping".to_string(),
                },
                (m, _) => m.to_string(),
            };
            let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
            let extra = match (r.reduce.as_deref(), r.root) {
                (Some(o), Some(root)) => format!("{o}/{root}"),
                (Some(o), None) => o.to_string(),
                (None, Some(root)) => format!("root {root}"),
                (None, None) => "-".into(),
            };
            s += &format!(
                "{:>4}  {:>8}  {:<12}  {:<10}  {:>8}  {:<14}  {:>10}  {:<5}  {:<6}  {:>7}  {}\n",
                r.rank,
                r.pid,
                r.host,
                state,
                format!("#{}", r.seq),
                format!(
                    "{}{}",
                    r.op.as_deref().unwrap_or("-"),
                    if r.seq > 0 && !r.arrived { "*" } else { "" }
                ),
                opt(r.count.map(|c| c.to_string())),
                r.dtype.as_deref().unwrap_or("-"),
                extra,
                opt(r.waited_ms.map(|ms| format!("{:.1}s", ms as f64 / 1e3))),
                if r.waiting_for.is_empty() {
                    "-".to_string()
                } else {
                    r.waiting_for
                        .iter()
                        .map(|q| q.to_string())
                        .collect::<Vec<_>>()
                        .join(",")
                }
            );
        }
        if self.ranks.iter().any(|r| r.seq > 0 && !r.arrived) {
            s += "* entered, not yet at its first exchange (arguments not published yet)\n";
        }
        for line in &self.summary {
            s += line;
            s.push('\n');
        }
        for n in &self.nodes {
            s += &n.line();
            s.push('\n');
        }
        s
    }
}

impl JobList {
    /// The human-readable list `lockstep status` prints.
    pub fn text(&self) -> String {
        let mut s = String::new();
        if self.jobs.is_empty() {
            s += "no lockstep job of yours is running on this machine\n";
        } else {
            s += &format!(
                "{:<24}  {:>5}  {:>6}  {:<8}  {}\n",
                "job", "ranks", "joined", "kind", "pids"
            );
            for j in &self.jobs {
                s += &format!(
                    "{:<24}  {:>5}  {:>6}  {:<8}  {}\n",
                    j.id,
                    j.world,
                    j.joined,
                    if j.sub {
                        "sub"
                    } else if j.forked {
                        "forked"
                    } else {
                        "exec'd"
                    },
                    j.rank_pids
                        .iter()
                        .map(|p| p.to_string())
                        .collect::<Vec<_>>()
                        .join(",")
                );
            }
            s += "`lockstep status JOB` (a job id or any of its pids) shows its ranks\n";
        }
        for u in &self.unreadable {
            s += &format!(
                "unreadable segment {} (held by pids {:?}): {}\n",
                u.segment, u.holders, u.error
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::CollKind;
    use crate::shm::CallView;

    fn rank(pid: i32, seq: u64, progress: u64, arrived: bool) -> RankView {
        RankView {
            pid,
            joined: true,
            left: false,
            progress,
            seq,
            kind: Some(CollKind::AllReduce),
            wait_ns: 1_000_000_000,
            call: arrived.then_some(CallView {
                kind: Some(CollKind::AllReduce),
                dtype: Some(crate::Dtype::F32),
                op: Some(crate::ReduceOp::Sum),
                root: 0,
                count: 1024,
                invalid: false,
                inline: false,
            }),
            moving: false,
        }
    }

    fn run(v: &[RankView]) -> Vec<RankStatus> {
        analyze(v, 3_500_000_000, "h", |p| {
            Some(if p == 11 { 'T' } else { 'S' })
        })
    }

    /// A rank stopped one collective behind: the others wait for it, it waits for nobody, and
    /// the summary groups them by collective number.
    #[test]
    fn stopped_rank_behind() {
        let v = [
            rank(10, 6650, 13300, true),
            rank(11, 6649, 13298, true),
            rank(12, 6650, 13300, true),
        ];
        let s = run(&v);
        assert_eq!(s[0].waiting_for, vec![1]);
        assert_eq!(s[2].waiting_for, vec![1]);
        assert!(s[1].waiting_for.is_empty());
        assert!(s[1].behind && !s[0].behind && !s[2].behind);
        assert_eq!(s[1].waited_ms, Some(2500));
        let sum = summarize(&s);
        assert_eq!(
            sum[0],
            "2 ranks have entered up to collective #6650 (all_reduce)"
        );
        assert_eq!(
            sum[1],
            "1 rank (rank 1 (pid 11)) only up to #6649 (all_reduce): behind"
        );
        assert_eq!(
            sum[2],
            "rank 0 (pid 10), rank 2 (pid 12) wait for rank 1 (pid 11) (stopped)"
        );
    }

    /// Same collective: a later phase waits for an earlier one, a rank that arrived waits for one
    /// that has not, and one that has not arrived waits for nobody.
    #[test]
    fn same_collective_phases_and_arrival() {
        let v = [
            rank(10, 7, 20, true),
            rank(11, 7, 19, true),
            rank(12, 7, 20, false),
        ];
        let s = run(&v);
        assert_eq!(s[0].waiting_for, vec![1, 2]);
        assert_eq!(s[1].waiting_for, vec![2]);
        assert!(s[2].waiting_for.is_empty() && s[2].behind && !s[2].arrived);
        // Inline calls publish no phase: equal arrival means nobody waits.
        let mut v = [rank(10, 7, 5, true), rank(11, 7, 4, true)];
        for r in &mut v {
            r.call.as_mut().unwrap().inline = true;
        }
        let s = run(&v);
        assert!(s.iter().all(|r| r.waiting_for.is_empty() && !r.behind));
        assert_eq!(
            summarize(&s).last().unwrap(),
            "nobody waits: every rank is at the same collective"
        );
    }

    /// A rank that left is waited for and named as left; one not joined yet shows as such.
    #[test]
    fn left_and_unjoined_ranks() {
        let mut v = [
            rank(10, 3, 6, true),
            rank(11, 2, 4, true),
            rank(0, 0, 0, false),
        ];
        v[1].left = true;
        v[1].joined = false;
        v[2].joined = false;
        let s = run(&v);
        assert_eq!(s[0].waiting_for, vec![1, 2]);
        assert_eq!(
            (s[1].member.as_str(), s[2].member.as_str()),
            ("left", "not joined")
        );
        assert!(summarize(&s)
            .last()
            .unwrap()
            .contains("rank 1 (pid 11) (left)"));
    }
}
