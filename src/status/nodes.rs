//! The other nodes of a multi-node job, asked through the job's rendezvous store. `lockstep
//! launch` keeps that store for the job's lifetime (node 0's launcher hosts it), and every node's
//! launcher answers for its own node's ranks.
//!
//! * **Where the store is** ([`reach`]): from the environment of one of this node's ranks
//!   (`/proc/<pid>/environ`, which `/proc` shows only to the processes' owner): `MASTER_ADDR`,
//!   `LOCKSTEP_STORE_PORT`, `LOCKSTEP_TOKEN`, `LOCKSTEP_NNODES`. The token never appears on a
//!   command line.
//! * **Asking** (`ask`, from [`job_status`](super::job_status) on any node of the job): take
//!   number `n` from the counter [`ASKED`], set `ask/<n>`, then read each node's answer until it
//!   is for `n` or a later ask, at most [`ANSWER_WAIT`].
//! * **Answering** ([`answer_asks`], a thread of each launcher): wait for the next ask, read the
//!   node's segment (NCCL ranks across nodes show their calls in a shared-memory communicator of
//!   their node, see `rendezvous::select`), and overwrite the node's answer with `<n>\n<json>`,
//!   its ranks numbered as in the job. An ask whose asker died before setting its key holds the
//!   answerer up for at most one [`IDLE_LOOK`]: it then skips to the newest number taken.
//! * **Merging** (`merge`): the ranks of every answer by global rank; then who waits for whom
//!   across nodes (a rank that arrived at collective `s` waits for every rank still before `s`,
//!   or at `s` and not arrived) and the summary again.
//!
//! The store keeps one key of a few bytes per ask; answers overwrite each other. Without the
//! `json` feature nothing is asked and the status says so.

use std::time::Duration;

use super::report::JobStatus;

/// The counter asks take their numbers from.
pub(crate) const ASKED: &str = "lockstep/status/asked";

/// How long a reader waits for the nodes' answers; a node that has not answered by then is
/// reported as such.
pub(crate) const ANSWER_WAIT: Duration = Duration::from_secs(1);

/// How long an answerer waits for the next ask before it looks at the counter (see the module
/// docs: an asker that died between taking a number and setting its key).
pub(crate) const IDLE_LOOK: Duration = Duration::from_secs(1);

/// Where a job's other nodes can be asked, as one of its ranks' environment says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Reach {
    /// Every rank of the job is in the segment that was read.
    OneNode,
    /// `lockstep launch` across nodes: its store.
    Store {
        addr: String,
        port: u16,
        token: String,
        nnodes: usize,
    },
    /// Several nodes, but no store that outlives the rendezvous (torchrun, mpirun, srun).
    NoStore { launcher: &'static str },
}

/// Where to ask about the job whose segment holds `local` ranks with processes `pids` (the
/// first that still runs tells).
pub(crate) fn reach(pids: &[i32], local: usize) -> Reach {
    const KEYS: [&str; 6] = [
        "MASTER_ADDR",
        "LOCKSTEP_STORE_PORT",
        "LOCKSTEP_TOKEN",
        "LOCKSTEP_NNODES",
        "WORLD_SIZE",
        "TORCHELASTIC_RUN_ID",
    ];
    let Some(env) = pids
        .iter()
        .filter(|&&p| p > 0)
        .map(|&p| super::discover::environ(p, &KEYS))
        .find(|e| e.iter().any(Option::is_some))
    else {
        return Reach::OneNode;
    };
    let num = |k: usize| {
        env[k]
            .as_deref()
            .and_then(|v| v.trim().parse::<usize>().ok())
    };
    let nnodes = num(3);
    let world = num(4);
    if nnodes.unwrap_or(1) <= 1 && world.is_none_or(|w| w <= local) {
        return Reach::OneNode;
    }
    match (&env[0], num(1), &env[2], nnodes) {
        (Some(addr), Some(port), Some(token), Some(nnodes)) if port <= u16::MAX as usize => {
            Reach::Store {
                addr: addr.clone(),
                port: port as u16,
                token: token.clone(),
                nnodes,
            }
        }
        _ => Reach::NoStore {
            launcher: if env[5].is_some() {
                "torchrun"
            } else {
                "its launcher"
            },
        },
    }
}

/// `st`, the status of this node's ranks, widened to the whole job where it spans nodes: the
/// other nodes asked through the store, or a note of why they cannot be.
pub(crate) fn widen(st: JobStatus, reach: Reach) -> JobStatus {
    match reach {
        Reach::OneNode => st,
        Reach::NoStore { launcher } => {
            let mut st = st;
            st.summary.push(format!(
                "this job spans nodes, but only this node's ranks are shown: {launcher} keeps no store for the job's lifetime through which the other nodes could answer (start it with `lockstep launch --nnodes`, or run `lockstep status` on each node)"
            ));
            st
        }
        #[cfg(feature = "json")]
        Reach::Store {
            addr,
            port,
            token,
            nnodes,
        } => match json::ask(&addr, port, &token, nnodes) {
            Ok(answers) => json::merge(st, answers),
            Err(e) => {
                let mut st = st;
                st.summary.push(format!(
                    "this job spans {nnodes} nodes, but only this node's ranks are shown: asking the others through the store at {addr}:{port} failed: {e}"
                ));
                st
            }
        },
        #[cfg(not(feature = "json"))]
        Reach::Store { nnodes, .. } => {
            let mut st = st;
            st.summary.push(format!(
                "this job spans {nnodes} nodes, but only this node's ranks are shown: this build of lockstep has no `json` feature, which asking the other nodes needs"
            ));
            st
        }
    }
}

#[cfg(feature = "json")]
pub(crate) use json::answer_asks;

#[cfg(feature = "json")]
mod json {
    use std::time::{Duration, Instant};

    use crate::shm::coarse_now_ns;
    use crate::status::analyze::{analyze, summarize};
    use crate::status::discover::proc_state;
    use crate::status::nodes::{ANSWER_WAIT, ASKED, IDLE_LOOK};
    use crate::status::report::{JobStatus, NodeReport, RankStatus};
    use crate::status::segments::read_all;
    use crate::store::{Store, StoreError, TcpStore};

    fn ask_key(n: i64) -> String {
        format!("lockstep/status/ask/{n}")
    }

    fn answer_key(node: usize) -> String {
        format!("lockstep/status/answer/{node}")
    }

    /// One node's answer: its ranks, numbered as in the job.
    #[derive(Debug, serde::Serialize, serde::Deserialize)]
    pub(crate) struct Answer {
        pub node: usize,
        pub host: String,
        pub ranks: Vec<RankStatus>,
        pub aborted_by: Option<usize>,
        /// Why the node has nothing to show (its ranks have not joined yet...).
        pub error: Option<String>,
    }

    /// Ask every node of the job; one entry per node, in node order: its answer, or why there is
    /// none.
    pub(crate) fn ask(
        addr: &str,
        port: u16,
        token: &str,
        nnodes: usize,
    ) -> Result<Vec<Result<Answer, String>>, StoreError> {
        let t = Instant::now();
        let mut store = TcpStore::connect(addr, port, token, ANSWER_WAIT)?;
        let n = store.add(ASKED, 1)?;
        store.set(&ask_key(n), b"1")?;
        let mut got: Vec<Option<Result<Answer, String>>> = (0..nnodes).map(|_| None).collect();
        loop {
            for (k, slot) in got.iter_mut().enumerate().filter(|(_, s)| s.is_none()) {
                let Some(v) = store.get(&answer_key(k))? else {
                    continue;
                };
                let text = String::from_utf8_lossy(&v);
                let (m, body) = text.split_once('\n').unwrap_or((&text, ""));
                if m.parse::<i64>().is_ok_and(|m| m >= n) {
                    *slot = Some(serde_json::from_str::<Answer>(body).map_err(|e| {
                        format!("its answer does not parse ({e}): does every node run the same lockstep version?")
                    }));
                }
            }
            if got.iter().all(Option::is_some) || t.elapsed() >= ANSWER_WAIT {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(got
            .into_iter()
            .map(|g| {
                g.unwrap_or_else(|| {
                    Err(format!(
                        "no answer within {:.1} s (is its launcher still running?)",
                        ANSWER_WAIT.as_secs_f64()
                    ))
                })
            })
            .collect())
    }

    /// The job's status from every node's answer (`local`: this node's, read here, kept for the
    /// job's description and for ranks no answer covers).
    pub(crate) fn merge(local: JobStatus, answers: Vec<Result<Answer, String>>) -> JobStatus {
        let mut ranks: Vec<RankStatus> = Vec::new();
        let mut nodes = Vec::new();
        let mut aborted_by = local.aborted_by;
        for (node, a) in answers.into_iter().enumerate() {
            match a {
                Ok(a) if a.error.is_none() => {
                    let mut mine: Vec<usize> = a.ranks.iter().map(|r| r.rank).collect();
                    mine.sort_unstable();
                    for r in a.ranks {
                        if !ranks.iter().any(|x| x.rank == r.rank) {
                            ranks.push(r);
                        }
                    }
                    aborted_by = aborted_by.or(a.aborted_by);
                    nodes.push(NodeReport {
                        node: a.node,
                        host: Some(a.host),
                        ranks: mine,
                        error: None,
                    });
                }
                Ok(a) => nodes.push(NodeReport {
                    node: a.node,
                    host: Some(a.host),
                    ranks: Vec::new(),
                    error: a.error,
                }),
                Err(e) => nodes.push(NodeReport {
                    node,
                    host: None,
                    ranks: Vec::new(),
                    error: Some(e),
                }),
            }
        }
        if ranks.is_empty() {
            // No node answered with ranks: this node's view is all there is.
            let mut st = local;
            st.nodes = nodes;
            return st;
        }
        ranks.sort_by_key(|r| r.rank);
        wait_across(&mut ranks);
        let summary = summarize(&ranks);
        let mut job = local.job;
        job.id = job.id.split(".h").next().unwrap_or(&job.id).to_string();
        job.world = job
            .world
            .max(ranks.iter().map(|r| r.rank + 1).max().unwrap_or(0));
        job.joined = ranks.iter().filter(|r| r.member == "joined").count();
        job.rank_pids = (0..job.world)
            .map(|g| ranks.iter().find(|r| r.rank == g).map_or(0, |r| r.pid))
            .collect();
        JobStatus {
            job,
            ranks,
            summary,
            aborted_by,
            read_us: local.read_us,
            nodes,
        }
    }

    /// Who waits for whom across nodes, added to what each node found among its own ranks: a
    /// rank that arrived at collective `s` waits for every rank before `s`, and for those at `s`
    /// that have not arrived; `behind` again from all of it.
    fn wait_across(ranks: &mut [RankStatus]) {
        let at: Vec<(usize, u64, bool)> =
            ranks.iter().map(|r| (r.rank, r.seq, r.arrived)).collect();
        for r in ranks.iter_mut() {
            if r.member != "joined" || !r.arrived {
                continue;
            }
            for &(q, seq, arrived) in &at {
                if q != r.rank
                    && (seq < r.seq || (seq == r.seq && !arrived))
                    && !r.waiting_for.contains(&q)
                {
                    r.waiting_for.push(q);
                }
            }
            r.waiting_for.sort_unstable();
        }
        let waited: Vec<usize> = ranks.iter().flat_map(|r| r.waiting_for.clone()).collect();
        for r in ranks.iter_mut() {
            r.behind = waited.contains(&r.rank);
        }
    }

    /// What this node's launcher answers: the ranks in segment `tag`, whose rank `i` is global
    /// rank `members[i]`, on host `host`.
    fn node_answer(node: usize, host: &str, tag: &str, members: &[usize]) -> Answer {
        let mut a = Answer {
            node,
            host: host.to_string(),
            ranks: Vec::new(),
            aborted_by: None,
            error: None,
        };
        let all = match read_all() {
            Ok(all) => all,
            Err(e) => {
                a.error = Some(e.to_string());
                return a;
            }
        };
        let Some((_, view)) = all.into_iter().find(|(i, v)| i.id == tag && v.is_ok()) else {
            a.error = Some(format!(
                "its segment {tag} is not there: its ranks have not joined yet, or have all left"
            ));
            return a;
        };
        let view = view.expect("filtered on is_ok");
        if view.world != members.len() {
            a.error = Some(format!(
                "its segment {tag} has {} ranks where the job places {} on its host",
                view.world,
                members.len()
            ));
            return a;
        }
        a.ranks = analyze(&view.ranks, coarse_now_ns(), host, proc_state)
            .into_iter()
            .map(|mut r| {
                r.rank = members[r.rank];
                r.waiting_for = r.waiting_for.iter().map(|&q| members[q]).collect();
                r
            })
            .collect();
        a.aborted_by = view
            .aborted_by
            .checked_sub(1)
            .and_then(|r| members.get(r as usize).copied());
        a
    }

    /// Answer the asks of `lockstep status` for node `node` (on host `host`) through `store`
    /// until the store goes away (the job ended). `locate` names the node's segment and its
    /// ranks' global ranks once the ranks have published their hosts; until then an ask is
    /// answered with why there is nothing to show.
    pub(crate) fn answer_asks(
        store: &mut TcpStore,
        node: usize,
        host: &str,
        mut locate: impl FnMut(&mut TcpStore) -> Result<(String, Vec<usize>), String>,
    ) {
        let mut next: i64 = 1;
        let mut located: Option<(String, Vec<usize>)> = None;
        loop {
            match store.wait(&[&ask_key(next)], IDLE_LOOK) {
                Ok(()) => {}
                Err(StoreError::Timeout { .. }) => {
                    match store.add(ASKED, 0) {
                        // Asks were numbered past this one while it waited: its asker is gone,
                        // or a later one also waits; answering the newest serves both.
                        Ok(newest) if newest > next => next = newest,
                        Ok(_) => {}
                        Err(_) => return,
                    }
                    continue;
                }
                Err(_) => return,
            }
            if located.is_none() {
                match locate(store) {
                    Ok(l) => located = Some(l),
                    Err(e) => {
                        let a = Answer {
                            node,
                            host: host.to_string(),
                            ranks: Vec::new(),
                            aborted_by: None,
                            error: Some(e),
                        };
                        if reply(store, next, node, &a).is_err() {
                            return;
                        }
                        next += 1;
                        continue;
                    }
                }
            }
            let (tag, members) = located.as_ref().expect("located above");
            let a = node_answer(node, host, tag, members);
            if reply(store, next, node, &a).is_err() {
                return;
            }
            next += 1;
        }
    }

    fn reply(store: &mut TcpStore, n: i64, node: usize, a: &Answer) -> Result<(), StoreError> {
        let body = serde_json::to_string(a).expect("an answer serialises");
        store.set(&answer_key(node), format!("{n}\n{body}").as_bytes())
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        fn rank(g: usize, seq: u64, arrived: bool) -> RankStatus {
            RankStatus {
                rank: g,
                pid: 100 + g as i32,
                host: format!("host-{}", g / 2),
                member: "joined".into(),
                proc_state: Some('S'),
                seq,
                op: Some("all_reduce".into()),
                count: Some(256),
                dtype: Some("f32".into()),
                reduce: Some("sum".into()),
                root: None,
                arrived,
                invalid: false,
                waited_ms: None,
                moving: false,
                waiting_for: Vec::new(),
                behind: false,
            }
        }

        /// Rank 3 on the second node is one collective behind: every rank of both nodes waits
        /// for it, and the summary names it, whatever order the answers came in.
        #[test]
        fn waits_across_nodes() {
            let mut v = vec![
                rank(2, 41, true),
                rank(0, 41, true),
                rank(3, 40, true),
                rank(1, 41, false),
            ];
            v.sort_by_key(|r| r.rank);
            wait_across(&mut v);
            assert_eq!(v[0].waiting_for, vec![1, 3]);
            assert_eq!(v[2].waiting_for, vec![1, 3]);
            assert!(v[1].waiting_for.is_empty() && v[3].waiting_for.is_empty());
            assert!(v[3].behind && v[1].behind && !v[0].behind && !v[2].behind);
            let s = summarize(&v);
            assert!(
                s[1].contains("rank 3 (pid 103)") && s[1].ends_with("behind"),
                "{s:?}"
            );
        }

        /// An asker that took a number and died before setting its key holds the answerer up
        /// for at most one idle look: the next ask is answered, and an answer that cannot find
        /// the node's ranks says why.
        #[test]
        fn abandoned_ask_is_skipped() {
            let token = "status-nodes-test-token-3f9a";
            let server = crate::store::StoreServer::start("127.0.0.1", 0, token).unwrap();
            let port = server.local_addr().port();
            let connect =
                || TcpStore::connect("127.0.0.1", port, token, Duration::from_secs(5)).unwrap();
            let mut answerer = connect();
            std::thread::spawn(move || {
                answer_asks(&mut answerer, 3, "h", |_| Err("not yet".into()));
            });
            let mut c = connect();
            assert_eq!(c.add(ASKED, 1).unwrap(), 1);
            let n = c.add(ASKED, 1).unwrap();
            c.set(&ask_key(n), b"1").unwrap();
            let t = Instant::now();
            let got = loop {
                if let Some(v) = c.get(&answer_key(3)).unwrap() {
                    break String::from_utf8(v).unwrap();
                }
                assert!(t.elapsed() < IDLE_LOOK * 5, "ask {n} was never answered");
                std::thread::sleep(Duration::from_millis(5));
            };
            let (m, body) = got.split_once('\n').unwrap();
            assert_eq!(m, "2");
            let a: Answer = serde_json::from_str(body).unwrap();
            assert_eq!((a.node, a.error.as_deref()), (3, Some("not yet")));
            assert!(a.ranks.is_empty());
        }

        /// Answers travel as JSON and come back equal.
        #[test]
        fn answers_round_trip() {
            let a = Answer {
                node: 1,
                host: "h".into(),
                ranks: vec![rank(2, 7, true)],
                aborted_by: Some(2),
                error: None,
            };
            let back: Answer = serde_json::from_str(&serde_json::to_string(&a).unwrap()).unwrap();
            assert_eq!(back.ranks, a.ranks);
            assert_eq!((back.node, back.aborted_by), (1, Some(2)));
        }
    }
}
