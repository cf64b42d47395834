//! The JSON of `lockstep status --json` (serde_json, `json` feature): the CLI, the C ABI and
//! Python return the same text. Keys are the fields of the report types and stable; absent
//! values are `null`.

use super::report::{JobList, JobStatus};

impl JobStatus {
    /// `lockstep status JOB --json`: `{"job": {...}, "ranks": [...], "summary": [...],
    /// "aborted_by": null, "read_us": N, "nodes": [...]}` (`nodes`: empty for a job of one node).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a status report serialises")
    }
}

impl JobList {
    /// `lockstep status --json`: `{"jobs": [...], "unreadable": [{"segment", "holders",
    /// "error"}]}`.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a job list serialises")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_list_and_escapes() {
        assert_eq!(
            JobList::default().to_json(),
            "{\"jobs\":[],\"unreadable\":[]}"
        );
        let list = JobList {
            jobs: Vec::new(),
            unreadable: vec![crate::status::Unreadable {
                segment: "a\"b\n".into(),
                holders: vec![7],
                error: "é".into(),
            }],
        };
        let v: serde_json::Value = serde_json::from_str(&list.to_json()).unwrap();
        assert_eq!(v["unreadable"][0]["segment"], "a\"b\n");
        assert_eq!(v["unreadable"][0]["holders"][0], 7);
    }
}
