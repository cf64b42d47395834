//! The canonical reduction, as a plain loop: what the shared-memory backend's `all_reduce`,
//! `reduce` and `reduce_scatter` produce, bit for bit, whatever path, chunking or buffer kind a
//! call takes (`docs/determinism.md`; `tests/canonical.rs` checks it on every path).
//!
//! The order, for `n` inputs `x₀ … xₙ₋₁` (one per rank, in rank order) and every index `i` on its
//! own:
//!
//! ```text
//! acc = widen(x₀[i])
//! acc = acc ⊕ widen(xₖ[i])      for k = 1, 2, …, n-1, in that order
//! acc = acc / n                  Avg only
//! out[i] = narrow(acc)
//! ```
//!
//! * f32, f64: `widen` and `narrow` are the identity, so every `⊕` (and Avg's division) rounds
//!   once, in the element type, to nearest even (IEEE 754).
//! * f16, bf16: `widen` converts to f32 exactly; every `⊕` rounds in f32, and `narrow` rounds the
//!   final f32 (after Avg's division) to the element type once, to nearest even. Nothing is
//!   rounded to 16 bits between inputs.
//! * Integers: `+` and `*` wrap; Avg is the wrapping sum divided by the world size `n`, exactly
//!   (truncating toward zero), also where `n` exceeds the type (256 u8 ranks average to 0).
//! * Min and max on floats keep the running value unless the next input is strictly less
//!   (greater): `min(acc, x) = if x < acc { x } else { acc }`. Hence among equal values (+0 and
//!   -0 compare equal) the lowest rank's wins, a NaN in input 0 stays (every comparison with it is
//!   false) and a NaN in a later input is skipped unless the running value is already NaN.
//! * Sum, prod and avg propagate NaN as IEEE 754 does: a NaN input or an invalid operation
//!   (∞ − ∞, 0 × ∞) gives NaN. Which NaN (sign and payload) is not specified: with NaNs from
//!   several inputs the CPU returns one by operand position, which the compiler may swap, and the
//!   backend's vectorised kernel does not always pick this loop's. Only "is NaN" is guaranteed.
//!
//! This is the order of one `n`-input reduction. Reducing some inputs first and combining partial
//! results would round differently (and f16/bf16 would round to 16 bits in between): the
//! backend never does, on any path.

use std::any::Any;
use std::convert::identity;

use half::{bf16, f16};

use crate::types::{Dtype, Element, ReduceOp};

/// One element type's arithmetic in the canonical order: the accumulator type and its operators.
/// The hierarchical backend (`hier`) folds with these same operators, so its results are this
/// module's bit for bit.
pub(crate) trait Arith: Copy + 'static {
    /// What an element accumulates in: itself, or f32 for f16 and bf16.
    type Acc: Copy + Element;
    /// An input as an accumulator (exact).
    fn widen(self) -> Self::Acc;
    /// The final accumulator as an element (one rounding for f16 and bf16).
    fn narrow(a: Self::Acc) -> Self;
    /// One step of the reduction: `a ⊕ b`.
    fn combine(op: ReduceOp, a: Self::Acc, b: Self::Acc) -> Self::Acc;
    /// Avg's final division by the number of inputs.
    fn divide(a: Self::Acc, n: usize) -> Self::Acc;
}

/// Min and max on floats: keep `a` unless `b` is strictly smaller (larger).
macro_rules! float_ops {
    ($acc:ty) => {
        fn combine(op: ReduceOp, a: $acc, b: $acc) -> $acc {
            match op {
                ReduceOp::Sum | ReduceOp::Avg => a + b,
                ReduceOp::Prod => a * b,
                ReduceOp::Min => {
                    if b < a {
                        b
                    } else {
                        a
                    }
                }
                ReduceOp::Max => {
                    if b > a {
                        b
                    } else {
                        a
                    }
                }
            }
        }
        fn divide(a: $acc, n: usize) -> $acc {
            a / n as $acc
        }
    };
}

/// The floating-point types: `$t` accumulates in `$acc`, widened by `$widen` and narrowed back by
/// `$narrow` (the identity for f32 and f64; f16 and bf16 accumulate in f32).
macro_rules! float_arith {
    ($($t:ty => $acc:ty, $widen:expr, $narrow:expr;)*) => {$(
        impl Arith for $t {
            type Acc = $acc;
            fn widen(self) -> $acc {
                $widen(self)
            }
            fn narrow(a: $acc) -> $t {
                $narrow(a)
            }
            float_ops!($acc);
        }
    )*};
}
float_arith! {
    f32 => f32, identity, identity;
    f64 => f64, identity, identity;
    f16 => f32, f16::to_f32, f16::from_f32;
    bf16 => f32, bf16::to_f32, bf16::from_f32;
}

macro_rules! int_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            type Acc = $t;
            fn widen(self) -> $t {
                self
            }
            fn narrow(a: $t) -> $t {
                a
            }
            fn combine(op: ReduceOp, a: $t, b: $t) -> $t {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                    ReduceOp::Prod => a.wrapping_mul(b),
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                }
            }
            fn divide(a: $t, n: usize) -> $t {
                // Exact in i128 for every world size, including those the type cannot hold.
                (a as i128 / n as i128) as $t
            }
        }
    )*};
}
int_arith!(i8, u8, i32, u32, i64, u64);

/// `a` as `B`, which the caller knows is `A` itself (dispatch on [`Element::DTYPE`]); compiled
/// away.
fn same<A: Copy + 'static, B: Copy + 'static>(a: A) -> B {
    *(&a as &dyn Any)
        .downcast_ref::<B>()
        .expect("Element::DTYPE names the element type")
}

fn run<T: Element, L: Arith>(inputs: &[&[T]], op: ReduceOp) -> Vec<T> {
    let n = inputs.len();
    (0..inputs[0].len())
        .map(|i| {
            let mut acc = same::<T, L>(inputs[0][i]).widen();
            for x in &inputs[1..] {
                acc = L::combine(op, acc, same::<T, L>(x[i]).widen());
            }
            if op == ReduceOp::Avg {
                acc = L::divide(acc, n);
            }
            same::<L, T>(L::narrow(acc))
        })
        .collect()
}

/// The canonical reduction of `inputs` (rank 0's first, one per rank, all the same length) under
/// `op`: element-wise, in input order, rounded as the [module documentation](self) says. This is
/// what every rank receives from the shared-memory backend's `all_reduce` of the same inputs (and
/// the root from `reduce`), bit for bit. Avg divides by `inputs.len()`, the world size.
///
/// A plain loop, meant for checking results, not for speed.
///
/// # Panics
/// When `inputs` is empty or the lengths differ.
///
/// # Example
/// ```
/// use lockstep::half::bf16;
/// use lockstep::{reference, ReduceOp};
///
/// // bf16 holds 8 significant bits: 256 + 1 rounds back to 256. The sum of the three inputs
/// // accumulates in f32 (256 + 1 + 1 = 258) and rounds to bf16 once, so the two 1s are kept.
/// let a = [bf16::from_f32(256.0)];
/// let b = [bf16::from_f32(1.0)];
/// let sum = reference::reduce(&[&a[..], &b, &b], ReduceOp::Sum);
/// assert_eq!(sum[0].to_f32(), 258.0);
///
/// // f32 rounds after every addition, in rank order: (1e8 + 1) - 1e8 is 0, not 1.
/// let x = reference::reduce(&[&[1e8f32][..], &[1.0], &[-1e8]], ReduceOp::Sum);
/// assert_eq!(x[0], 0.0);
/// ```
pub fn reduce<T: Element>(inputs: &[&[T]], op: ReduceOp) -> Vec<T> {
    assert!(!inputs.is_empty(), "reference::reduce: no inputs");
    let len = inputs[0].len();
    assert!(
        inputs.iter().all(|x| x.len() == len),
        "reference::reduce: inputs of different lengths"
    );
    match T::DTYPE {
        Dtype::F32 => run::<T, f32>(inputs, op),
        Dtype::F64 => run::<T, f64>(inputs, op),
        Dtype::F16 => run::<T, f16>(inputs, op),
        Dtype::BF16 => run::<T, bf16>(inputs, op),
        Dtype::I32 => run::<T, i32>(inputs, op),
        Dtype::I64 => run::<T, i64>(inputs, op),
        Dtype::U8 => run::<T, u8>(inputs, op),
        Dtype::I8 => run::<T, i8>(inputs, op),
        Dtype::U32 => run::<T, u32>(inputs, op),
        Dtype::U64 => run::<T, u64>(inputs, op),
    }
}

/// The canonical `reduce_scatter`: block `r` of the result is what rank `r` receives, each input
/// holding `inputs.len()` blocks of `len / inputs.len()` elements. The same order as
/// [`reduce`], which it is, cut into blocks.
///
/// # Panics
/// As [`reduce`], and when the length is not a multiple of the number of inputs.
pub fn reduce_scatter<T: Element>(inputs: &[&[T]], op: ReduceOp) -> Vec<Vec<T>> {
    let n = inputs.len();
    let all = reduce(inputs, op);
    assert!(
        all.len().is_multiple_of(n),
        "reference::reduce_scatter: {} elements are not {n} equal blocks",
        all.len()
    );
    let c = all.len() / n;
    (0..n).map(|r| all[r * c..(r + 1) * c].to_vec()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_and_rounding() {
        // Rank order: (1e8 + 1) - 1e8 = 0 in f32, while 1e8 - 1e8 + 1 would be 1.
        let r = reduce(&[&[1e8f32][..], &[1.0], &[-1e8]], ReduceOp::Sum);
        assert_eq!(r, [0.0]);
        // f16 accumulates in f32: 2048 + 1 + 1 = 2050, which f16 holds (2048 + 1 rounds to 2048).
        let (a, b) = ([f16::from_f32(2048.0)], [f16::ONE]);
        assert_eq!(reduce(&[&a[..], &b, &b], ReduceOp::Sum)[0].to_f32(), 2050.0);
        // Avg divides before the one rounding to bf16.
        let (a, b) = ([bf16::from_f32(3.0)], [bf16::from_f32(4.0)]);
        assert_eq!(reduce(&[&a[..], &b], ReduceOp::Avg)[0].to_f32(), 3.5);
        // Integers wrap; avg truncates toward zero.
        assert_eq!(reduce(&[&[200u8][..], &[100]], ReduceOp::Sum), [44]);
        assert_eq!(reduce(&[&[-7i32][..], &[0]], ReduceOp::Avg), [-3]);
    }

    #[test]
    fn min_max_zeros_and_nan() {
        let (p, m) = ([0.0f32], [-0.0f32]);
        assert!(reduce(&[&p[..], &m], ReduceOp::Min)[0].is_sign_positive());
        assert!(reduce(&[&m[..], &p], ReduceOp::Max)[0].is_sign_negative());
        let nan = [f32::NAN];
        assert!(reduce(&[&nan[..], &[1.0]], ReduceOp::Min)[0].is_nan());
        assert_eq!(reduce(&[&[1.0f32][..], &nan], ReduceOp::Min), [1.0]);
        assert!(reduce(&[&[1.0f32][..], &nan], ReduceOp::Sum)[0].is_nan());
    }

    /// The backend's kernel (`shm::reduce_slices`) agrees on a mixed input, every op and dtype
    /// family; `tests/canonical.rs` checks the collectives themselves.
    #[test]
    fn kernel_agrees() {
        let a: Vec<f32> = (0..3000).map(|i| (i as f32).sin() * 1e3).collect();
        let b: Vec<f32> = (0..3000).map(|i| (i as f32 * 0.7).cos() * 1e-3).collect();
        let c: Vec<f32> = (0..3000).map(|i| -(i as f32).sin() * 1e3).collect();
        for op in ReduceOp::ALL {
            let want = reduce(&[&a[..], &b, &c], op);
            let mut got = vec![0.0f32; a.len()];
            crate::shm::reduce_slices(op, &[&a[..], &b, &c], &mut got);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{op}");
        }
    }
}
