//! Reading a trace directory back (`lockstep trace DIR`): every rank's file of every
//! communicator, and what they say together: the first call where the ranks diverge, the ranks
//! that never arrived at a call others are stuck in, and which ranks arrive late.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Why a trace directory cannot be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReadError {
    /// The directory cannot be listed, or a file cannot be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The directory or file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// No trace file in the directory.
    #[error("{0} holds no trace files (rank*.jsonl): run the job with LOCKSTEP_TRACE_DIR={0} and send its ranks SIGUSR1, or wait for a failure")]
    Empty(PathBuf),
    /// A line that is not a header or record of this format.
    #[error("{path}:{line}: {detail}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// Its line, from 1.
        line: usize,
        /// What is wrong.
        detail: String,
    },
    /// Files of more than one job.
    #[error("{dir} mixes the traces of several jobs ({jobs}): give each job its own LOCKSTEP_TRACE_DIR, or move the old files away")]
    MixedJobs {
        /// The directory.
        dir: PathBuf,
        /// The job ids found, with a file of each.
        jobs: String,
    },
}

/// A trace file's first line.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct Header {
    /// Format version.
    pub lockstep_trace: u64,
    /// `LOCKSTEP_JOB_ID` of the job (empty when unset).
    pub job: String,
    /// The communicator: `world`, or a sub-communicator's name.
    pub comm: String,
    /// Rank in the communicator.
    pub rank: usize,
    /// Ranks in the communicator.
    pub world: usize,
    /// Global rank.
    pub global_rank: usize,
    /// Global ranks of a sub-communicator's members.
    pub global_ranks: Option<Vec<usize>>,
    /// Host name.
    pub host: String,
    /// Process id.
    pub pid: u32,
    /// Backend.
    pub backend: String,
    /// lockstep's version.
    pub version: String,
    /// Unix nanoseconds of the rank's clock zero.
    pub base_realtime_ns: u64,
    /// Why it was written: `failure`, `signal` or `request`.
    pub reason: String,
}

/// One record line.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct Line {
    /// Record number.
    pub id: u64,
    /// Collective number (0: point-to-point).
    pub seq: u64,
    /// Operation.
    pub op: String,
    /// Element type.
    pub dtype: String,
    /// Reduction.
    pub reduce: String,
    /// Count.
    pub count: u64,
    /// Root or peer.
    pub root: Option<u64>,
    /// Buffers.
    pub buffer: String,
    /// Path taken.
    pub path: String,
    /// Start (Unix ns); none where the recorder did not time the call.
    #[serde(default)]
    pub start_ns: Option<u64>,
    /// End (Unix ns), none while running.
    pub end_ns: Option<u64>,
    /// `ok`, `error` or `running`.
    pub state: String,
    /// The error's text.
    #[serde(default)]
    pub error: Option<String>,
}

impl Line {
    /// What every rank must agree on.
    fn signature(&self) -> String {
        let root = self.root.map_or(String::new(), |r| format!(" root {r}"));
        format!("{} {}×{}{root}", self.op, self.count, self.dtype)
    }
}

/// One rank's file.
#[derive(Clone, Debug)]
pub struct RankTrace {
    /// Where it was read from.
    pub path: PathBuf,
    /// Its header.
    pub header: Header,
    /// Its records, oldest first.
    pub lines: Vec<Line>,
}

/// Read every trace file in `dir`, grouped by communicator (`world` first), each group in rank
/// order.
pub fn read_dir(dir: &Path) -> Result<BTreeMap<String, Vec<RankTrace>>, ReadError> {
    let io = |path: &Path, source| ReadError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| !n.starts_with('.') && n.ends_with(".jsonl"))
        })
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(ReadError::Empty(dir.to_path_buf()));
    }
    let mut out: BTreeMap<String, Vec<RankTrace>> = BTreeMap::new();
    let mut jobs: BTreeMap<String, PathBuf> = BTreeMap::new();
    for path in files {
        let text = std::fs::read_to_string(&path).map_err(|e| io(&path, e))?;
        let bad = |line: usize, detail: String| ReadError::Malformed {
            path: path.clone(),
            line,
            detail,
        };
        let mut lines = text.lines().enumerate();
        let header: Header = match lines.next() {
            None => return Err(bad(1, "empty file: expected a header line".into())),
            Some((_, l)) => serde_json::from_str(l)
                .map_err(|e| bad(1, format!("not a lockstep trace header: {e}")))?,
        };
        let mut recs = Vec::new();
        for (i, l) in lines {
            if l.trim().is_empty() {
                continue;
            }
            recs.push(
                serde_json::from_str(l).map_err(|e| bad(i + 1, format!("not a record: {e}")))?,
            );
        }
        jobs.entry(header.job.clone())
            .or_insert_with(|| path.clone());
        out.entry(header.comm.clone()).or_default().push(RankTrace {
            path,
            header,
            lines: recs,
        });
    }
    if jobs.len() > 1 {
        return Err(ReadError::MixedJobs {
            dir: dir.to_path_buf(),
            jobs: jobs
                .iter()
                .map(|(j, p)| format!("{j:?} in {}", p.display()))
                .collect::<Vec<_>>()
                .join(", "),
        });
    }
    for g in out.values_mut() {
        g.sort_by_key(|t| t.header.rank);
    }
    Ok(out)
}

/// What one rank did at a call.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct RankAt {
    /// The rank (in the communicator).
    pub rank: usize,
    /// Its global rank.
    pub global_rank: usize,
    /// `op count×dtype [root r]`, or `None`: it never started the call.
    pub call: Option<String>,
    /// `ok`, `error`, `running`, or `never started`.
    pub state: String,
}

/// The first call where the ranks disagree.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Divergence {
    /// The collective's number.
    pub seq: u64,
    /// Every rank's call there.
    pub ranks: Vec<RankAt>,
}

/// A call some ranks are stuck in (running, or failed waiting) that others never reached.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Stuck {
    /// The collective's number.
    pub seq: u64,
    /// What the stuck ranks called.
    pub call: String,
    /// Ranks in it, running or failed.
    pub stuck: Vec<usize>,
    /// Ranks that never started it (their last collective is earlier), or called something else.
    pub missing: Vec<usize>,
}

/// How late one rank arrives, over the calls every rank completed.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Lateness {
    /// The rank.
    pub rank: usize,
    /// Its global rank.
    pub global_rank: usize,
    /// Calls at which it was the last to start.
    pub last: usize,
    /// Median of its start minus the earliest rank's start, in microseconds.
    pub median_us: f64,
    /// Largest such lateness, in microseconds.
    pub max_us: f64,
}

/// What a communicator's traces say together.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct CommReport {
    /// The communicator.
    pub comm: String,
    /// Its size.
    pub world: usize,
    /// Ranks whose file is missing.
    pub missing_files: Vec<usize>,
    /// Collective numbers every file covers: `[first, last]` (earlier ones left the rings).
    pub range: Option<(u64, u64)>,
    /// The first divergence, if any.
    pub divergence: Option<Divergence>,
    /// The first call ranks are stuck in while others never came, if any.
    pub stuck: Option<Stuck>,
    /// Calls every rank completed with the same arguments, over which lateness is measured.
    pub compared_calls: usize,
    /// Per rank, latest first.
    pub lateness: Vec<Lateness>,
}

fn collectives(t: &RankTrace) -> BTreeMap<u64, &Line> {
    t.lines
        .iter()
        .filter(|l| l.seq > 0)
        .map(|l| (l.seq, l))
        .collect()
}

/// Analyse one communicator's traces (as [`read_dir`] groups them).
pub fn analyse(comm: &str, traces: &[RankTrace]) -> CommReport {
    let world = traces.iter().map(|t| t.header.world).max().unwrap_or(0);
    let present: Vec<usize> = traces.iter().map(|t| t.header.rank).collect();
    let missing_files = (0..world).filter(|r| !present.contains(r)).collect();
    let maps: Vec<BTreeMap<u64, &Line>> = traces.iter().map(collectives).collect();
    // Calls before `lo` left some rank's ring: nothing can be said of them.
    let lo = maps
        .iter()
        .map(|m| m.keys().next().copied().unwrap_or(1))
        .max();
    let hi = maps
        .iter()
        .filter_map(|m| m.keys().next_back().copied())
        .max();
    let range = lo.zip(hi).filter(|(l, h)| l <= h);
    let mut report = CommReport {
        comm: comm.to_string(),
        world,
        missing_files,
        range,
        divergence: None,
        stuck: None,
        compared_calls: 0,
        lateness: Vec::new(),
    };
    let Some((lo, hi)) = range else {
        return report;
    };
    let mut late: Vec<Vec<u64>> = vec![Vec::new(); traces.len()];
    let mut last = vec![0usize; traces.len()];
    for seq in lo..=hi {
        let at: Vec<Option<&Line>> = maps.iter().map(|m| m.get(&seq).copied()).collect();
        let sigs: Vec<Option<String>> = at.iter().map(|l| l.map(Line::signature)).collect();
        let agree = sigs.iter().all(|s| s.is_some() && *s == sigs[0]);
        if !agree && report.divergence.is_none() {
            report.divergence = Some(Divergence {
                seq,
                ranks: traces
                    .iter()
                    .zip(&at)
                    .map(|(t, l)| RankAt {
                        rank: t.header.rank,
                        global_rank: t.header.global_rank,
                        call: l.map(|l| l.signature()),
                        state: l.map_or("never started".into(), |l| l.state.clone()),
                    })
                    .collect(),
            });
        }
        if report.stuck.is_none() {
            // Ranks in a call that did not complete, grouped by what they called.
            if let Some(l) = at.iter().flatten().find(|l| l.state != "ok") {
                let call = l.signature();
                let (stuck, missing): (Vec<usize>, Vec<usize>) = traces
                    .iter()
                    .zip(&at)
                    .map(|(t, l)| (t.header.rank, l))
                    .filter(|(_, l)| l.is_none_or(|l| l.state != "ok" || l.signature() != call))
                    .fold((vec![], vec![]), |(mut s, mut m), (r, l)| {
                        match l {
                            Some(l) if l.signature() == call => s.push(r),
                            _ => m.push(r),
                        }
                        (s, m)
                    });
                if !missing.is_empty() {
                    report.stuck = Some(Stuck {
                        seq,
                        call,
                        stuck,
                        missing,
                    });
                }
            }
        }
        // Lateness over the calls every rank completed and timed (the recorder times the same
        // calls on every rank: `trace::record::timed`).
        let starts: Option<Vec<u64>> = at
            .iter()
            .map(|l| l.filter(|l| l.state == "ok").and_then(|l| l.start_ns))
            .collect();
        if let (true, Some(starts)) = (agree, starts) {
            let first = starts.iter().copied().min().unwrap_or(0);
            let latest = starts.iter().copied().max().unwrap_or(0);
            for (i, s) in starts.iter().enumerate() {
                late[i].push(s - first);
                if *s == latest && latest > first {
                    last[i] += 1;
                }
            }
            report.compared_calls += 1;
        }
    }
    let us = |ns: u64| ns as f64 / 1000.0;
    report.lateness = traces
        .iter()
        .zip(late.iter_mut())
        .zip(&last)
        .map(|((t, l), &n)| {
            l.sort_unstable();
            Lateness {
                rank: t.header.rank,
                global_rank: t.header.global_rank,
                last: n,
                median_us: l.get(l.len() / 2).map_or(0.0, |&x| us(x)),
                max_us: l.last().map_or(0.0, |&x| us(x)),
            }
        })
        .collect();
    report.lateness.sort_by(|a, b| {
        b.last
            .cmp(&a.last)
            .then(b.median_us.total_cmp(&a.median_us))
    });
    report
}

/// Read `dir` and analyse every communicator in it.
pub fn report(dir: &Path) -> Result<Vec<CommReport>, ReadError> {
    Ok(read_dir(dir)?
        .iter()
        .map(|(comm, traces)| analyse(comm, traces))
        .collect())
}

impl fmt::Display for CommReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "communicator {} ({} ranks)", self.comm, self.world)?;
        if !self.missing_files.is_empty() {
            writeln!(f, "  no trace from ranks {:?}", self.missing_files)?;
        }
        let Some((lo, hi)) = self.range else {
            return writeln!(f, "  no collectives recorded");
        };
        writeln!(f, "  collectives #{lo}..#{hi} in every rank's record")?;
        match &self.divergence {
            None => writeln!(f, "  the ranks agree on every call")?,
            Some(d) => {
                writeln!(f, "  first divergence: collective #{}", d.seq)?;
                for r in &d.ranks {
                    let g = if r.global_rank != r.rank {
                        format!(" (global {})", r.global_rank)
                    } else {
                        String::new()
                    };
                    match &r.call {
                        Some(c) => writeln!(f, "    rank {}{g}: {c} ({})", r.rank, r.state)?,
                        None => writeln!(f, "    rank {}{g}: never started it", r.rank)?,
                    }
                }
            }
        }
        if let Some(s) = &self.stuck {
            writeln!(
                f,
                "  stuck: ranks {:?} in #{} {} ; ranks {:?} never arrived at it",
                s.stuck, s.seq, s.call, s.missing
            )?;
        }
        writeln!(
            f,
            "  lateness over {} calls every rank completed (start against the earliest rank):",
            self.compared_calls
        )?;
        for l in &self.lateness {
            writeln!(
                f,
                "    rank {:>4}: last {:>6} times, median {:>10.1} µs, max {:>10.1} µs",
                l.rank, l.last, l.median_us, l.max_us
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(rank: usize, world: usize, job: &str) -> String {
        serde_json::json!({"lockstep_trace":1,"job":job,"comm":"world","rank":rank,"world":world,
            "global_rank":rank,"global_ranks":null,"host":"h","pid":1,"backend":"shm","version":"0",
            "clock":"realtime_ns","base_realtime_ns":0,"written_ns":0,"reason":"failure",
            "capacity":10,"records":0})
        .to_string()
    }

    fn rec(seq: u64, op: &str, start: u64, state: &str) -> String {
        serde_json::json!({"id":seq,"seq":seq,"op":op,"dtype":"f32","reduce":"sum","count":4,
            "root":null,"buffer":"host","path":"inline","start_ns":start,
            "end_ns": if state == "running" { None } else { Some(start + 5) },"state":state})
        .to_string()
    }

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("lockstep-trace-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn write(d: &Path, rank: usize, lines: &[String]) {
        std::fs::write(
            d.join(format!("rank{rank:05}.jsonl")),
            lines.join("\n") + "\n",
        )
        .unwrap();
    }

    #[test]
    fn names_the_rank_that_skipped_a_call_and_the_late_rank() {
        let d = scratch("skip");
        // Ranks 0 and 1 ran #1..#3 and are stuck in #4; rank 2 arrived 1 µs late at each call
        // and stopped after #3.
        for r in 0..2 {
            let mut l = vec![header(r, 3, "j")];
            l.extend((1..=3).map(|s| rec(s, "all_reduce", s * 1000, "ok")));
            l.push(rec(4, "all_reduce", 4000, "error"));
            write(&d, r, &l);
        }
        let mut l = vec![header(2, 3, "j")];
        l.extend((1..=3).map(|s| rec(s, "all_reduce", s * 1000 + 1000, "ok")));
        write(&d, 2, &l);
        let rep = report(&d).unwrap();
        assert_eq!(rep.len(), 1);
        let r = &rep[0];
        assert_eq!(r.range, Some((1, 4)));
        let div = r.divergence.as_ref().unwrap();
        assert_eq!(div.seq, 4);
        assert_eq!(div.ranks[2].call, None);
        let s = r.stuck.as_ref().unwrap();
        assert_eq!(
            (s.seq, s.stuck.clone(), s.missing.clone()),
            (4, vec![0, 1], vec![2])
        );
        assert_eq!(r.compared_calls, 3);
        assert_eq!((r.lateness[0].rank, r.lateness[0].last), (2, 3));
        assert_eq!(r.lateness[0].median_us, 1.0);
        assert!(r.to_string().contains("never arrived"), "{r}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// Two ranks that agree on #1 and call `ops[r]` as #2, ending in `state`.
    fn second_call(d: &Path, ops: [&str; 2], state: &str) -> CommReport {
        for (r, op) in ops.iter().enumerate() {
            let l = [
                header(r, 2, "j"),
                rec(1, "all_reduce", 0, "ok"),
                rec(2, op, 9, state),
            ];
            write(d, r, &l);
        }
        report(d).unwrap().remove(0)
    }

    #[test]
    fn a_different_call_is_a_divergence_and_agreement_is_none() {
        let d = scratch("differ");
        let r = second_call(&d, ["barrier", "all_gather"], "error");
        let div = r.divergence.as_ref().unwrap();
        assert_eq!(div.seq, 2);
        assert_eq!(div.ranks[1].call.as_deref(), Some("all_gather 4×f32"));
        let r = second_call(&d, ["barrier", "barrier"], "ok");
        assert_eq!((r.divergence.clone(), r.stuck.clone()), (None, None));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn empty_malformed_and_mixed_directories_are_clear_errors() {
        let d = scratch("errors");
        assert!(matches!(report(&d), Err(ReadError::Empty(_))));
        write(&d, 0, &[header(0, 2, "a"), "{not json".into()]);
        let e = report(&d).unwrap_err().to_string();
        assert!(e.contains("rank00000.jsonl:2:"), "{e}");
        write(&d, 0, &[header(0, 2, "a")]);
        write(&d, 1, &[header(1, 2, "b")]);
        let e = report(&d).unwrap_err();
        assert!(matches!(e, ReadError::MixedJobs { .. }), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
