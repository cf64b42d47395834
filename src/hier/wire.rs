//! What the ranks of a hierarchical communicator tell each other besides data: each call's
//! header (checked across every rank of the job, so a mismatch is named on every rank) and a
//! status (a failure one rank saw, passed to the ranks of its node and, as a notice, to every
//! other node).

use crate::comm::{Call, CommError};
use crate::types::{CollKind, Dtype, ReduceOp};

/// Bytes of an encoded [`Header`].
pub(crate) const HEADER_BYTES: usize = 32;

/// Bytes of an encoded status: a failure's kind, ranks and text (the text is cut to fit).
pub(crate) const STATUS_BYTES: usize = 1024;

/// The header's flag of a call the rank refused locally ([`Backend::reject`](crate::comm::Backend::reject)).
const REFUSED: u8 = 1;

/// One rank's description of the call it is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    pub kind: u8,
    pub dtype: u8,
    pub op: u8,
    pub flags: u8,
    pub seq: u64,
    pub root: u64,
    pub count: u64,
}

impl Header {
    /// The header of `call`, this rank's collective number `seq`.
    pub fn of(call: &Call, seq: u64) -> Header {
        Header {
            kind: call.kind as u8,
            dtype: call.dtype as u8,
            op: call.op as u8,
            flags: 0,
            seq,
            root: call.root as u64,
            count: call.count as u64,
        }
    }

    /// The header of a `kind` call this rank refused locally.
    pub fn refused(kind: CollKind, dtype: Dtype) -> Header {
        Header {
            kind: kind as u8,
            dtype: dtype as u8,
            op: 0,
            flags: REFUSED,
            seq: 0,
            root: 0,
            count: 0,
        }
    }

    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[..4].copy_from_slice(&[self.kind, self.dtype, self.op, self.flags]);
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.root.to_le_bytes());
        b[24..32].copy_from_slice(&self.count.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Header {
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        Header {
            kind: b[0],
            dtype: b[1],
            op: b[2],
            flags: b[3],
            seq: word(8),
            root: word(16),
            count: word(24),
        }
    }

    /// What must agree between ranks: kind, dtype, and the op, root and count where the kind has
    /// them.
    fn key(&self) -> (u8, u8, u8, u64, u64) {
        CollKind::agreement_key(self.kind, self.dtype, self.op, self.root, self.count)
    }

    /// `all_reduce(count=4, dtype=f32, op=sum)`.
    fn describe(&self) -> String {
        let k = CollKind::from_u8(self.kind);
        let kind = k.map(|k| k.name()).unwrap_or("?");
        let dtype = Dtype::from_u8(self.dtype).map(|t| t.name()).unwrap_or("?");
        let mut s = format!("{kind}(count={}, dtype={dtype}", self.count);
        if k.is_some_and(|k| k.has_op()) {
            let op = ReduceOp::from_u8(self.op).map(|o| o.name()).unwrap_or("?");
            s += &format!(", op={op}");
        }
        if k.is_some_and(|k| k.has_root()) {
            s += &format!(", root={}", self.root);
        }
        s + ")"
    }
}

/// Compare every rank's header (index = global rank) with rank 0's: a refusal or a disagreement
/// is a [`CommError::Mismatch`] naming the ranks, the same text on every rank.
pub(crate) fn check_headers(headers: &[Header], seq: u64) -> Result<(), CommError> {
    let refused: Vec<String> = (0..headers.len())
        .filter(|&r| headers[r].flags & REFUSED != 0)
        .map(|r| format!("rank {r}"))
        .collect();
    if let Some(first) = headers.iter().find(|h| h.flags & REFUSED != 0) {
        let kind = CollKind::from_u8(first.kind)
            .map(|k| k.name())
            .unwrap_or("?");
        return Err(CommError::Mismatch {
            seq,
            detail: format!(
                "{} refused its {kind} call (invalid arguments: its own error says which)",
                refused.join(", ")
            ),
        });
    }
    let differ: Vec<usize> = (1..headers.len())
        .filter(|&r| headers[r].key() != headers[0].key() || headers[r].seq != headers[0].seq)
        .collect();
    if differ.is_empty() {
        return Ok(());
    }
    let mut parts = vec![format!("rank 0 called {}", headers[0].describe())];
    for &r in differ.iter().take(8) {
        let h = &headers[r];
        let at = if h.seq != headers[0].seq {
            format!(" as its collective #{}", h.seq)
        } else {
            String::new()
        };
        parts.push(format!("rank {r} called {}{at}", h.describe()));
    }
    if differ.len() > 8 {
        parts.push(format!("and {} more ranks differ", differ.len() - 8));
    }
    Err(CommError::Mismatch {
        seq,
        detail: parts.join(", "),
    })
}

/// The kinds of failure a status carries.
const OK: u8 = 0;
const MISMATCH: u8 = 1;
const LOST: u8 = 2;
const TIMEOUT: u8 = 3;
const ABORTED: u8 = 4;

/// The `how` of a rank whose MPI messages failed.
pub(crate) const UNREACHABLE: &str = "stopped answering (MPI reported an error on its messages)";

/// The `how` of [`CommError::PeerLost`], by index.
const HOWS: [&str; 3] = ["died", "left the communicator", UNREACHABLE];

/// How many ranks a status names at most.
const MAX_RANKS: usize = 32;

/// A failure, in a form every rank can rebuild as its own [`CommError`].
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Failure {
    code: u8,
    /// The rank that saw it first.
    by: usize,
    /// The lost rank, or the ranks a timeout waited for.
    ranks: Vec<usize>,
    pid: i32,
    how: u8,
    secs: f64,
    text: String,
}

impl Failure {
    /// `e`, as rank `me` saw it.
    pub fn from_error(e: &CommError, me: usize) -> Failure {
        let mut f = Failure {
            code: ABORTED,
            by: me,
            ranks: Vec::new(),
            pid: 0,
            how: 0,
            secs: 0.0,
            text: e.to_string(),
        };
        match e {
            CommError::Mismatch { detail, .. } => {
                f.code = MISMATCH;
                f.text = detail.clone();
            }
            CommError::PeerLost {
                lost_rank,
                pid,
                how,
                ..
            } => {
                f.code = LOST;
                f.ranks = vec![*lost_rank];
                f.pid = *pid;
                f.how = HOWS.iter().position(|h| h == how).unwrap_or(0) as u8;
            }
            CommError::Timeout {
                secs,
                detail,
                missing,
                ..
            } => {
                f.code = TIMEOUT;
                f.secs = *secs;
                f.text = detail.clone();
                f.ranks = missing.clone();
            }
            CommError::Aborted { by, reason } => {
                f.by = *by;
                f.text = reason.clone();
            }
            _ => {}
        }
        f
    }

    /// The error rank `me` reports for it, in its call `op` #`seq`.
    pub fn to_error(&self, me: usize, op: CollKind, seq: u64) -> CommError {
        match self.code {
            MISMATCH => CommError::Mismatch {
                seq,
                detail: self.text.clone(),
            },
            LOST => CommError::PeerLost {
                rank: me,
                lost_rank: self.ranks.first().copied().unwrap_or(self.by),
                pid: self.pid,
                how: HOWS[usize::from(self.how).min(HOWS.len() - 1)],
                op,
                seq,
                group: String::new(),
            },
            TIMEOUT => CommError::Timeout {
                rank: me,
                op,
                seq,
                secs: self.secs,
                // A report passed on keeps naming the rank that saw it first.
                detail: if me == self.by || self.text.contains(" reports: ") {
                    self.text.clone()
                } else {
                    format!("rank {} reports: {}", self.by, self.text)
                },
                missing: self.ranks.clone(),
            },
            _ => CommError::Aborted {
                by: self.by,
                reason: self.text.clone(),
            },
        }
    }

    /// The fixed-size encoding ([`STATUS_BYTES`]).
    pub fn encode(f: Option<&Failure>) -> Vec<u8> {
        let mut b = vec![0u8; STATUS_BYTES];
        let Some(f) = f else { return b };
        b[0] = f.code;
        b[1] = f.how;
        let ranks = &f.ranks[..f.ranks.len().min(MAX_RANKS)];
        b[2] = ranks.len() as u8;
        b[4..8].copy_from_slice(&f.pid.to_le_bytes());
        b[8..16].copy_from_slice(&(f.by as u64).to_le_bytes());
        b[16..24].copy_from_slice(&f.secs.to_le_bytes());
        let mut at = 24;
        for r in ranks {
            b[at..at + 8].copy_from_slice(&(*r as u64).to_le_bytes());
            at += 8;
        }
        let room = STATUS_BYTES - at - 4;
        let mut end = f.text.len().min(room);
        while !f.text.is_char_boundary(end) {
            end -= 1;
        }
        b[at..at + 4].copy_from_slice(&(end as u32).to_le_bytes());
        b[at + 4..at + 4 + end].copy_from_slice(&f.text.as_bytes()[..end]);
        b
    }

    /// The failure in an encoded status, `None` for success.
    pub fn decode(b: &[u8]) -> Option<Failure> {
        if b.len() < STATUS_BYTES || b[0] == OK {
            return None;
        }
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            w
        };
        let n = usize::from(b[2]).min(MAX_RANKS);
        let mut at = 24;
        let mut ranks = Vec::with_capacity(n);
        for _ in 0..n {
            ranks.push(u64::from_le_bytes(word(at)) as usize);
            at += 8;
        }
        let len = (u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]) as usize)
            .min(STATUS_BYTES - at - 4);
        Some(Failure {
            code: b[0],
            by: u64::from_le_bytes(word(8)) as usize,
            ranks,
            pid: i32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            how: b[1],
            secs: f64::from_le_bytes(word(16)),
            text: String::from_utf8_lossy(&b[at + 4..at + 4 + len]).into_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_round_trip() {
        let e = CommError::Timeout {
            rank: 1,
            op: CollKind::AllReduce,
            seq: 3,
            secs: 2.5,
            detail: "rank 3 is stuck".into(),
            missing: vec![3],
        };
        let f = Failure::from_error(&e, 1);
        let back = Failure::decode(&Failure::encode(Some(&f))).unwrap();
        assert_eq!(back, f);
        let e2 = back.to_error(0, CollKind::AllReduce, 3).to_string();
        assert!(
            e2.contains("rank 1 reports: rank 3 is stuck") && e2.contains("on rank 0"),
            "{e2}"
        );
        assert_eq!(Failure::decode(&Failure::encode(None)), None);
        let lost = CommError::PeerLost {
            rank: 0,
            lost_rank: 3,
            pid: 42,
            how: "died",
            op: CollKind::Barrier,
            seq: 1,
            group: String::new(),
        };
        let f = Failure::decode(&Failure::encode(Some(&Failure::from_error(&lost, 0)))).unwrap();
        assert!(f
            .to_error(2, CollKind::Barrier, 1)
            .to_string()
            .starts_with("rank 3 (pid 42) died while rank 2 was in barrier #1"));
    }

    #[test]
    fn headers_disagree() {
        let h = |kind: CollKind, count: u64| Header {
            kind: kind as u8,
            dtype: Dtype::F32 as u8,
            op: ReduceOp::Sum as u8,
            flags: 0,
            seq: 1,
            root: 0,
            count,
        };
        let hs = [
            h(CollKind::AllReduce, 4),
            h(CollKind::AllReduce, 4),
            h(CollKind::AllReduce, 5),
        ];
        assert_eq!(Header::decode(&hs[2].encode()), hs[2]);
        let e = check_headers(&hs, 1).unwrap_err().to_string();
        assert!(
            e.contains("rank 0 called all_reduce(count=4, dtype=f32, op=sum), rank 2 called all_reduce(count=5"),
            "{e}"
        );
        assert!(check_headers(&hs[..2], 1).is_ok());
    }
}
