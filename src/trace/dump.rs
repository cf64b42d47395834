//! The trace file: JSON lines, a header and then one record per line, oldest first, written
//! atomically (a reader never sees half a file; a second dump replaces the first).

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use super::meta::{world_file_name, DumpError, Meta, Reason};
use super::record::{Outcome, Record, Recorder};
use crate::types::durable::{write_atomic, WriteError};

/// The format's version, in every header (`lockstep_trace`).
pub(crate) const FORMAT: u64 = 1;

/// The file name of a communicator's records: `rank<global>.jsonl` for a world communicator,
/// `<comm>.rank<global>.jsonl` for a sub-communicator.
fn file_name(m: &Meta) -> String {
    let g = m.global_rank();
    match m.global {
        None => world_file_name(g),
        Some(_) => format!("{}.rank{g:05}.jsonl", m.comm),
    }
}

fn host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "?".into())
}

/// The header line of the file of `rec`, the recorder of the communicator `m`.
fn header(m: &Meta, rec: &Recorder, reason: Reason, records: usize) -> Value {
    let job = std::env::var(crate::types::env::JOB_ID.name).unwrap_or_default();
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    json!({
        "lockstep_trace": FORMAT,
        "job": job,
        "comm": m.comm,
        "rank": m.rank,
        "world": m.world,
        "global_rank": m.global_rank(),
        "global_ranks": m.global,
        "host": host(),
        "pid": std::process::id(),
        "backend": m.backend,
        "version": env!("CARGO_PKG_VERSION"),
        "clock": "realtime_ns",
        "base_realtime_ns": rec.base_realtime_ns(),
        "written_ns": now,
        "reason": reason.name(),
        "capacity": rec.capacity(),
        "records": records,
    })
}

impl Record {
    /// The record as one JSON object, as the trace files hold it (feature `trace`).
    pub fn to_json(&self) -> String {
        record_json(self).to_string()
    }
}

/// One record as a JSON object.
pub(crate) fn record_json(r: &Record) -> Value {
    let (state, error) = match &r.outcome {
        Outcome::Ok => ("ok", None),
        Outcome::Error(e) => ("error", Some(e.as_str())),
        Outcome::Running => ("running", None),
    };
    let mut v = json!({
        "id": r.id,
        "seq": r.seq,
        "op": r.call.kind.name(),
        "dtype": r.call.dtype.name(),
        "reduce": r.call.op.name(),
        "count": r.call.count,
        "root": r.call.root,
        "buffer": r.call.buffer.name(),
        "path": r.path.name(),
        "start_ns": r.start_ns,
        "end_ns": r.end_ns,
        "state": state,
    });
    if r.call.ops > 0 {
        v["ops"] = json!(r.call.ops);
    }
    if let Some(e) = error {
        v["error"] = json!(e);
    }
    v
}

/// Write the records of `rec`, the recorder of the communicator `m`, into `dir` as
/// `file_name(m)`, creating `dir` (and its parents) when it is missing: the dump on a failure
/// happens once, so a directory named before the job but not made (a fresh scratch path, every
/// rank racing to make it) must not lose it.
pub(crate) fn write(
    m: &Meta,
    rec: &Recorder,
    dir: &Path,
    reason: Reason,
) -> Result<PathBuf, DumpError> {
    let records = rec.records();
    let mut out = header(m, rec, reason, records.len()).to_string();
    out.push('\n');
    for r in &records {
        out += &record_json(r).to_string();
        out.push('\n');
    }
    let path = dir.join(file_name(m));
    std::fs::create_dir_all(dir).map_err(|source| WriteError {
        path: path.clone(),
        what: "create the directory",
        source,
    })?;
    write_atomic(&path, out.as_bytes(), 0o644)?;
    Ok(path)
}
