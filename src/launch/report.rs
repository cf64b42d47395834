//! How a launch ended, for people: per-rank failures and the summary printed between divider
//! lines (rank, pid, exit status, time, last lines of stderr), root cause first.

use std::time::Duration;

/// How one rank ended, when it did not succeed.
#[derive(Debug, Clone)]
pub struct RankFailure {
    /// The rank.
    pub rank: usize,
    /// Its process id.
    pub pid: i32,
    /// Exit code (`128 + signal` for a signal), as a shell reports it.
    pub exit_code: i32,
    /// What happened, in words: the rank's error, panic message, or how the process ended.
    pub message: String,
    /// Whether the launcher terminated this rank after another failed (or on a signal).
    pub terminated_by_launcher: bool,
    /// Time from the start of the launch to the rank's exit.
    pub elapsed: Duration,
    /// The last lines the rank wrote to stderr (when its output was captured).
    pub stderr_tail: Vec<String>,
}

/// A launch whose ranks did not all succeed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LaunchError {
    /// Setting up the job failed before any rank ran.
    #[error("launch failed before starting ranks: {0}")]
    Setup(String),
    /// Some ranks failed; the first entry is the root cause.
    #[error("{}", summary(.0))]
    RanksFailed(Vec<RankFailure>),
}

impl LaunchError {
    /// The failures, root cause first (empty for setup errors).
    pub fn failures(&self) -> &[RankFailure] {
        match self {
            LaunchError::RanksFailed(f) => f,
            LaunchError::Setup(_) => &[],
        }
    }

    /// The exit code a CLI should return: the root-cause rank's (1 when there is none).
    pub fn exit_code(&self) -> i32 {
        self.failures()
            .first()
            .map(|f| f.exit_code)
            .filter(|c| *c != 0)
            .unwrap_or(1)
    }
}

const DIVIDER: &str = "========================================================================";
const TAIL_SHOWN: usize = 10;

/// The failure summary, between divider lines; `failures[0]` is the root cause.
pub fn summary(failures: &[RankFailure]) -> String {
    summary_with_notes(failures, &[])
}

/// [`summary`] with more lines (each ending in a newline) before the closing divider: the
/// launcher's restarts.
pub(crate) fn summary_with_notes(failures: &[RankFailure], notes: &[String]) -> String {
    let mut s = String::new();
    s += DIVIDER;
    s += "\n";
    let Some(root) = failures.first() else {
        s += "no rank failed\n";
        s += DIVIDER;
        return s;
    };
    let others = failures
        .iter()
        .filter(|f| !f.terminated_by_launcher)
        .count()
        .saturating_sub(1);
    s += &format!(
        "lockstep: rank {} (pid {}) failed first: {} (exit {}) after {:.2} s{}\n",
        root.rank,
        root.pid,
        root.message,
        root.exit_code,
        root.elapsed.as_secs_f64(),
        if others > 0 {
            format!("; {others} other rank(s) failed on their own")
        } else {
            String::new()
        }
    );
    if !root.stderr_tail.is_empty() {
        let skip = root.stderr_tail.len().saturating_sub(TAIL_SHOWN);
        s += &format!("last lines of rank {}'s stderr:\n", root.rank);
        for l in &root.stderr_tail[skip..] {
            s += &format!("  | {l}\n");
        }
    }
    for f in &failures[1..] {
        s += &format!(
            "rank {} (pid {}): {} (exit {}) after {:.2} s{}\n",
            f.rank,
            f.pid,
            f.message,
            f.exit_code,
            f.elapsed.as_secs_f64(),
            if f.terminated_by_launcher {
                ", terminated by the launcher"
            } else {
                ""
            }
        );
        if !f.terminated_by_launcher {
            if let Some(l) = f.stderr_tail.last() {
                s += &format!("  | {l}\n");
            }
        }
    }
    for n in notes {
        s += n;
    }
    s += DIVIDER;
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_names_root_cause_and_tail() {
        let f = |rank, code, term| RankFailure {
            rank,
            pid: 100 + rank as i32,
            exit_code: code,
            message: format!("exited with code {code}"),
            terminated_by_launcher: term,
            elapsed: Duration::from_millis(1500),
            stderr_tail: vec!["boom".into()],
        };
        let e = LaunchError::RanksFailed(vec![f(1, 3, false), f(0, 143, true)]);
        let s = e.to_string();
        assert!(s.starts_with(DIVIDER) && s.ends_with(DIVIDER), "{s}");
        assert!(
            s.contains("rank 1 (pid 101) failed first: exited with code 3 (exit 3) after 1.50 s"),
            "{s}"
        );
        assert!(s.contains("  | boom"), "{s}");
        assert!(s.contains("terminated by the launcher"), "{s}");
        assert_eq!(e.exit_code(), 3);
    }
}
