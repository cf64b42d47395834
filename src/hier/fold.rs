//! The reduction kernels of the hierarchical backend: the canonical order of
//! [`crate::reference`], split into steps that can run on different nodes. `start` takes the first
//! input, `add` one more, `finish` divides (Avg) and narrows: the same operations, in the same
//! order, as `reference::reduce` performs on the concatenated inputs, so the result is the same
//! bit for bit. Between steps the running value stays in the accumulator type (f32 for f16 and
//! bf16): nothing is rounded to 16 bits before the end.

use crate::reference::Arith;
use crate::types::ReduceOp;

/// The running value after the first input, into `acc` (as long as `x`).
pub(crate) fn start<T: Arith>(x: &[T], acc: &mut [T::Acc]) {
    for (a, v) in acc.iter_mut().zip(x) {
        *a = v.widen();
    }
}

/// Fold one more input into the running value.
pub(crate) fn add<T: Arith>(op: ReduceOp, acc: &mut [T::Acc], x: &[T]) {
    // One loop per operator, so each compiles to a tight (vectorisable) loop.
    macro_rules! each {
        ($op:expr) => {
            for (a, v) in acc.iter_mut().zip(x) {
                *a = T::combine($op, *a, v.widen());
            }
        };
    }
    match op {
        ReduceOp::Sum | ReduceOp::Avg => each!(ReduceOp::Sum),
        ReduceOp::Prod => each!(ReduceOp::Prod),
        ReduceOp::Min => each!(ReduceOp::Min),
        ReduceOp::Max => each!(ReduceOp::Max),
    }
}

/// The result from the running value after all `n` inputs, into `out` (as long as `acc`).
pub(crate) fn finish<T: Arith>(op: ReduceOp, acc: &[T::Acc], n: usize, out: &mut [T]) {
    if op == ReduceOp::Avg {
        for (o, a) in out.iter_mut().zip(acc) {
            *o = T::narrow(T::divide(*a, n));
        }
    } else {
        for (o, a) in out.iter_mut().zip(acc) {
            *o = T::narrow(*a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    /// Split over two "nodes", the steps give `reference::reduce` of the concatenation, and so does
    /// the shared-memory kernel that the leaders' path folds with.
    #[test]
    fn steps_are_the_reference() {
        let xs: Vec<Vec<bf16>> = (0..4)
            .map(|r| {
                (0..257)
                    .map(|i| bf16::from_f32(((i * 7 + r * 13) as f32).sin() * 10f32.powi(r - 1)))
                    .collect()
            })
            .collect();
        for op in ReduceOp::ALL {
            let refs: Vec<&[bf16]> = xs.iter().map(|v| &v[..]).collect();
            let want = crate::reference::reduce(&refs, op);
            let mut acc = vec![0f32; 257];
            start(&xs[0], &mut acc);
            for x in &xs[1..] {
                add(op, &mut acc, x);
            }
            let mut got = vec![bf16::ZERO; 257];
            finish(op, &acc, 4, &mut got);
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{op}"
            );
            // The leaders' path folds with the shared-memory kernel: the same bits.
            let mut kernel = vec![bf16::ZERO; 257];
            crate::shm::reduce_slices(op, &refs, &mut kernel);
            assert_eq!(kernel, got, "{op}: the shared-memory kernel");
        }
    }
}
