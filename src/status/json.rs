//! The JSON of `lockstep status --json`, written by hand (the runtime has no JSON dependency):
//! the CLI, the C ABI and Python return the same text. Keys are stable; absent values are `null`.

use super::{JobInfo, JobList, JobStatus, RankStatus};

/// A JSON string literal.
fn string(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o += "\\\"",
            '\\' => o += "\\\\",
            '\n' => o += "\\n",
            '\r' => o += "\\r",
            '\t' => o += "\\t",
            c if (c as u32) < 0x20 => o += &format!("\\u{:04x}", c as u32),
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map(|v| v.to_string()).unwrap_or_else(|| "null".into())
}

fn opt_str(v: Option<&str>) -> String {
    v.map(string).unwrap_or_else(|| "null".into())
}

fn list<T>(v: &[T], f: impl Fn(&T) -> String) -> String {
    format!("[{}]", v.iter().map(f).collect::<Vec<_>>().join(","))
}

fn object(fields: &[(&str, String)]) -> String {
    format!(
        "{{{}}}",
        fields
            .iter()
            .map(|(k, v)| format!("{}:{v}", string(k)))
            .collect::<Vec<_>>()
            .join(",")
    )
}

fn job(j: &JobInfo) -> String {
    object(&[
        ("id", string(&j.id)),
        ("segment", string(&j.segment)),
        ("forked", j.forked.to_string()),
        ("sub", j.sub.to_string()),
        ("creator_pid", j.creator_pid.to_string()),
        ("world", j.world.to_string()),
        ("joined", j.joined.to_string()),
        ("holders", list(&j.holders, |p| p.to_string())),
        ("rank_pids", list(&j.rank_pids, |p| p.to_string())),
    ])
}

fn rank(r: &RankStatus) -> String {
    object(&[
        ("rank", r.rank.to_string()),
        ("pid", r.pid.to_string()),
        ("host", string(&r.host)),
        ("member", string(r.member)),
        (
            "proc_state",
            opt_str(r.proc_state.map(|c| c.to_string()).as_deref()),
        ),
        ("seq", r.seq.to_string()),
        ("op", opt_str(r.op)),
        ("count", opt(r.count)),
        ("dtype", opt_str(r.dtype)),
        ("reduce", opt_str(r.reduce)),
        ("root", opt(r.root)),
        ("arrived", r.arrived.to_string()),
        ("invalid", r.invalid.to_string()),
        ("waited_ms", opt(r.waited_ms)),
        ("moving", r.moving.to_string()),
        ("waiting_for", list(&r.waiting_for, |q| q.to_string())),
        ("behind", r.behind.to_string()),
    ])
}

impl JobStatus {
    /// `lockstep status JOB --json`: `{"job": {...}, "ranks": [...], "summary": [...],
    /// "aborted_by": null, "read_us": N}`.
    pub fn to_json(&self) -> String {
        object(&[
            ("job", job(&self.job)),
            ("ranks", list(&self.ranks, rank)),
            ("summary", list(&self.summary, |s| string(s))),
            ("aborted_by", opt(self.aborted_by)),
            ("read_us", self.read_us.to_string()),
        ])
    }
}

impl JobList {
    /// `lockstep status --json`: `{"jobs": [...], "unreadable": [{"segment", "holders",
    /// "error"}]}`.
    pub fn to_json(&self) -> String {
        let l = self;
        object(&[
            ("jobs", list(&l.jobs, job)),
            (
                "unreadable",
                list(&l.unreadable, |u| {
                    object(&[
                        ("segment", string(&u.segment)),
                        ("holders", list(&u.holders, |p| p.to_string())),
                        ("error", string(&u.error)),
                    ])
                }),
            ),
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_escape() {
        assert_eq!(string("a\"b\\c\n\u{1}é"), "\"a\\\"b\\\\c\\n\\u0001é\"");
        assert_eq!(
            JobList::default().to_json(),
            "{\"jobs\":[],\"unreadable\":[]}"
        );
    }
}
