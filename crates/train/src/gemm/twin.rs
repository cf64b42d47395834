//! What the GEMM-shaped twins (`ops/conv2d/twin.rs`, `ops/linear/twin.rs`) share with
//! `kernels/common.cuh`: the exact widening of a kernel operand, the split-K ranges of the tiled
//! core, how a weight gradient is stored (accumulated, or written as split-K planes), and
//! `twin_pair!`, which writes the f32, bf16 and f16 twins of one kernel (imported by path:
//! `use crate::gemm::twin::twin_pair`).

use half::{bf16, f16};

/// Exact widening of a kernel operand (f32, bf16 or f16) to f32.
pub(crate) trait Operand: Copy {
    fn f(self) -> f32;
}
impl Operand for f32 {
    #[inline(always)]
    fn f(self) -> f32 {
        self
    }
}
impl Operand for bf16 {
    #[inline(always)]
    fn f(self) -> f32 {
        self.to_f32()
    }
}
impl Operand for f16 {
    #[inline(always)]
    fn f(self) -> f32 {
        self.to_f32()
    }
}

/// `Σ_{i < n} term(i)` in f32, summed in order from 0: one output of a GEMM-shaped twin.
#[inline(always)]
pub(crate) fn dot(n: usize, term: impl Fn(usize) -> f32) -> f32 {
    (0..n).fold(0.0f32, |acc, i| acc + term(i))
}

/// The K range of each split-K slice, as `gemm_tile` (common.cuh) cuts it: `splits` slices of
/// `ceil(ceil(K / splits) / 32) * 32` (the last ones shorter, possibly empty).
pub fn split_k_ranges(k: usize, splits: usize) -> Vec<std::ops::Range<usize>> {
    let splits = splits.max(1);
    let chunk = k.div_ceil(splits).div_ceil(GEMM_BK) * GEMM_BK;
    (0..splits)
        .map(|z| (z * chunk).min(k)..((z + 1) * chunk).min(k))
        .collect()
}

/// K chunk of the GEMM core (`GEMM_BK` in common.cuh).
const GEMM_BK: usize = 32;

/// Store a weight gradient as the kernels do (`accumulate_out` in common.cuh): with `partials`
/// empty, `dweight[e] += sum(e, 0..K)`; otherwise `partials` holds `splits` planes of
/// `dweight.len()` values and plane `z` is overwritten with `sum(e, slice z)`.
pub(crate) fn store_weight_grad(
    dweight: &mut [f32],
    partials: &mut [f32],
    plane: usize,
    k: usize,
    sum: impl Fn(usize, std::ops::Range<usize>) -> f32,
) {
    if partials.is_empty() {
        for (e, d) in dweight[..plane].iter_mut().enumerate() {
            *d += sum(e, 0..k);
        }
        return;
    }
    let splits = partials.len() / plane.max(1);
    for (z, r) in split_k_ranges(k, splits).into_iter().enumerate() {
        for e in 0..plane {
            partials[z * plane + e] = sum(e, r.clone());
        }
    }
}

/// The f32, bf16 and f16 twins of one kernel: all call the generic body with the same
/// arguments; the arguments marked `op` are `&[f32]`, `&[bf16]` and `&[f16]` in turn, the others
/// keep the type given in parentheses (a kernel's scalar shape arguments arrive as one shape
/// struct, so no twin has more than seven arguments).
macro_rules! twin_pair {
    ($(#[doc = $d32:literal])* $f32:ident, $(#[doc = $d16:literal])* $bf16:ident, $(#[doc = $dh:literal])* $f16:ident,
     $imp:ident($($arg:ident: $kind:tt),* $(,)?)) => {
        $(#[doc = $d32])*
        pub fn $f32($($arg: $crate::gemm::twin::twin_arg!($kind, f32)),*) {
            $imp($($arg),*)
        }
        $(#[doc = $d16])*
        pub fn $bf16($($arg: $crate::gemm::twin::twin_arg!($kind, bf16)),*) {
            $imp($($arg),*)
        }
        $(#[doc = $dh])*
        pub fn $f16($($arg: $crate::gemm::twin::twin_arg!($kind, f16)),*) {
            $imp($($arg),*)
        }
    };
}

/// The type of one `twin_pair!` argument.
macro_rules! twin_arg {
    (op, $t:ty) => {
        &[$t]
    };
    (($fixed:ty), $t:ty) => {
        $fixed
    };
}

pub(crate) use {twin_arg, twin_pair};
