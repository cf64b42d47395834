//! Who waits for whom, from the ranks' control blocks ([`analyze`]), and the summary lines NCCL's
//! RAS would print ([`summarize`]).

use super::report::RankStatus;
use crate::shm::RankView;

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
pub(crate) fn analyze(
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
pub(crate) fn summarize(ranks: &[RankStatus]) -> Vec<String> {
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
