//! What `lockstep status` reports, and how it reads as text: the types the CLI, the C ABI and
//! Python show ([`JobList`], [`JobStatus`] and their parts), and their `text`.

use crate::shm::SegmentError;

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

/// One rank, as [`job_status`](super::job_status) sees it.
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

impl NodeReport {
    /// Its line in [`JobStatus::text`].
    fn line(&self) -> String {
        match &self.error {
            None => format!(
                "node {} ({}): rank{} {}",
                self.node,
                self.host.as_deref().unwrap_or("?"),
                if self.ranks.len() == 1 { "" } else { "s" },
                crate::types::ranges_text(&self.ranks, ", ")
            ),
            Some(e) => format!("node {}: {e}", self.node),
        }
    }
}
