//! The cross-rank argument check of every collective's first phase: every rank compares every
//! rank's descriptor with rank 0's, and on disagreement every rank reports the same
//! [`CommError::Mismatch`], naming each rank that differs and the call it made.

use super::sync::{Desc, FINITE, INVALID};
use crate::comm::{CollKind, CommError, Dtype, ReduceOp};

fn desc_call(d: &Desc) -> String {
    let kind = CollKind::from_u8(d.kind).map(|k| k.name()).unwrap_or("?");
    let dtype = Dtype::from_u8(d.dtype).map(|t| t.name()).unwrap_or("?");
    let mut s = format!("{kind}(count={}, dtype={dtype}", d.count);
    if let Some(k) = CollKind::from_u8(d.kind) {
        if k.has_op() {
            s += &format!(
                ", op={}",
                ReduceOp::from_u8(d.op).map(|o| o.name()).unwrap_or("?")
            );
        }
        if k.has_root() {
            s += &format!(", root={}", d.root);
        }
    }
    s + ")"
}

/// Whether two descriptors describe the same call: kind, dtype, and the op, root and count where
/// the kind has them.
pub(crate) fn same_call(a: &Desc, b: &Desc) -> bool {
    let key = |d: &Desc| CollKind::agreement_key(d.kind, d.dtype, d.op, d.root, d.count);
    key(a) == key(b)
}

/// Compare every rank's descriptor with rank 0's; on disagreement, name every rank that differs
/// (`who` names a rank).
pub(crate) fn check_descs(
    descs: &[Desc],
    seq: u64,
    who: &dyn Fn(usize) -> String,
) -> Result<(), CommError> {
    let invalid: Vec<usize> = (0..descs.len())
        .filter(|&r| descs[r].flags & INVALID != 0)
        .collect();
    if let Some(&first) = invalid.first() {
        let kind = CollKind::from_u8(descs[first].kind)
            .map(|k| k.name())
            .unwrap_or("?");
        let names: Vec<String> = invalid.iter().map(|&r| who(r)).collect();
        return Err(CommError::Mismatch {
            seq,
            detail: format!(
                "{} refused its {kind} call (invalid arguments, or no room left for its staging slots: its own error says which)",
                names.join(", ")
            ),
        });
    }
    let finite = |d: &Desc| d.flags & FINITE != 0;
    let other: Vec<String> = (1..descs.len())
        .filter(|&r| finite(&descs[r]) != finite(&descs[0]))
        .map(who)
        .collect();
    if !other.is_empty() {
        let on = |b: bool| if b { "on" } else { "off" };
        return Err(CommError::Mismatch {
            seq,
            detail: format!(
                "the finite check (LOCKSTEP_CHECK_FINITE, Communicator::set_check_finite) is {} on {} but {} on {}; set it alike on every rank before the same call",
                on(finite(&descs[0])),
                who(0),
                on(!finite(&descs[0])),
                other.join(", ")
            ),
        });
    }
    let differ: Vec<usize> = (1..descs.len())
        .filter(|&r| !same_call(&descs[0], &descs[r]))
        .collect();
    if differ.is_empty() {
        return Ok(());
    }
    let mut parts = vec![format!("{} called {}", who(0), desc_call(&descs[0]))];
    for r in differ.iter().take(8) {
        parts.push(format!("{} called {}", who(*r), desc_call(&descs[*r])));
    }
    if differ.len() > 8 {
        parts.push(format!("and {} more ranks differ", differ.len() - 8));
    }
    Err(CommError::Mismatch {
        seq,
        detail: parts.join(", "),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::rank_name;

    #[test]
    fn mismatch_names_ranks() {
        let mut a = Desc {
            kind: CollKind::AllReduce as u8,
            dtype: Dtype::F32 as u8,
            op: ReduceOp::Sum as u8,
            count: 100,
            ..Default::default()
        };
        let b = Desc { count: 101, ..a };
        let world = |r: usize| rank_name(None, r);
        // In a sub-communicator, ranks are named by their global rank first.
        let global = [5usize, 1, 3];
        let sub = |r: usize| rank_name(Some(&global), r);
        let refused = Desc {
            flags: INVALID,
            ..a
        };
        let checking = Desc { flags: FINITE, ..a };
        // Every rank's descriptor, the call's number, how ranks are named, what the error says.
        type Case<'a> = (&'a [Desc], u64, &'a dyn Fn(usize) -> String, &'a [&'a str]);
        let cases: [Case; 4] = [
            (
                &[a, a, b],
                5,
                &world,
                &[
                    "rank 2 called all_reduce(count=101, dtype=f32, op=sum)",
                    "rank 0 called all_reduce(count=100",
                ],
            ),
            (
                &[a, a, b],
                5,
                &sub,
                &[
                    "rank 3 (rank 2 of this sub-communicator) called all_reduce(count=101",
                    "rank 5 (rank 0 of this sub-communicator) called all_reduce(count=100",
                ],
            ),
            (
                &[a, refused, refused],
                6,
                &sub,
                &["rank 1 (rank 1 of this sub-communicator), rank 3 (rank 2 of this sub-communicator) refused its all_reduce"],
            ),
            (
                &[a, checking, a],
                7,
                &world,
                &["the finite check (LOCKSTEP_CHECK_FINITE, Communicator::set_check_finite) is off on rank 0 but on on rank 1"],
            ),
        ];
        for (descs, seq, who, wants) in cases {
            let e = check_descs(descs, seq, who).unwrap_err().to_string();
            for want in wants {
                assert!(e.contains(want), "{want:?} not in: {e}");
            }
        }
        a.root = 3; // root does not matter for all_reduce
        assert!(check_descs(&[a, Desc { root: 0, ..a }], 1, &world).is_ok());
    }
}
