//! Reduction kernels: `dst[i] = src[0][i] ⊕ src[1][i] ⊕ … ⊕ src[k-1][i]`, always in source order, so
//! the result is bit-identical however the work is split. f16/bf16 accumulate in f32 and round once.
//!
//! The loop works in blocks held in a small stack accumulator: sources are streamed once, the
//! accumulator stays in L1, and `dst` may alias any source (in-place collectives). Inner loops are
//! plain element-wise loops over slices with the operator chosen outside them, which LLVM
//! vectorises.
//!
//! The finite check (`ShmConfig::check_finite`) is a second instantiation of the same kernel
//! (`CHECK = true`), chosen once per kernel call, so the unchecked kernel is the code it always
//! was. The checked one folds the exponent field of every input element it reads into a running
//! maximum, in the same loop as the reduction (an all-ones exponent is a NaN or an infinity; two
//! sources into a separate destination fold the result's instead where the operator carries
//! every non-finite input into it, see `pair_checked_apart`); only a block whose maximum says so
//! is scanned again, element by element, to find the first non-finite value: the lowest element
//! index, and at that index the lowest source. Two sources in place check each small chunk before
//! it is overwritten (`pair_checked`). Integers have no non-finite values: their checked call is
//! the unchecked kernel.

use std::mem::MaybeUninit;

use half::{bf16, f16};

use crate::comm::{Dtype, NonFiniteKind, ReduceOp};

/// Elements per block of the stack accumulator (4 KiB of f32).
const BLOCK: usize = 1024;

/// Element types as seen by the reduction: the accumulator type and the operators on it.
trait Lane: Copy + 'static {
    type Acc: Copy + 'static;
    fn load(self) -> Self::Acc;
    fn store(a: Self::Acc) -> Self;
    fn add(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn mul(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn min(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn max(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn div(a: Self::Acc, n: usize) -> Self::Acc;
    /// The exponent field's bits (f64: in its high word), equal to [`EXP`](Self::EXP) exactly for
    /// a NaN or an infinity; 0 for integers.
    fn exp_bits(self) -> u32;
    /// The exponent field all ones; `u32::MAX`, which `exp_bits` never returns, for integers.
    const EXP: u32;
    /// The value widened (exactly, for the floats) to classify a non-finite one.
    fn wide(self) -> f64;
    /// [`exp_bits`](Self::exp_bits) of an accumulator value (f16 and bf16: of the f32).
    fn acc_exp(a: Self::Acc) -> u32;
    /// [`EXP`](Self::EXP) of the accumulator type.
    const ACC_EXP: u32;
}

macro_rules! float_lane {
    ($t:ty, $shift:expr, $exp:expr) => {
        impl Lane for $t {
            type Acc = $t;
            #[inline(always)]
            fn load(self) -> $t {
                self
            }
            #[inline(always)]
            fn store(a: $t) -> $t {
                a
            }
            #[inline(always)]
            fn add(a: $t, b: $t) -> $t {
                a + b
            }
            #[inline(always)]
            fn mul(a: $t, b: $t) -> $t {
                a * b
            }
            // NaN-propagating like NCCL's fminf/fmaxf-free device ops would be costlier; a plain
            // compare keeps the loop vectorisable and is deterministic.
            #[inline(always)]
            fn min(a: $t, b: $t) -> $t {
                if b < a {
                    b
                } else {
                    a
                }
            }
            #[inline(always)]
            fn max(a: $t, b: $t) -> $t {
                if b > a {
                    b
                } else {
                    a
                }
            }
            #[inline(always)]
            fn div(a: $t, n: usize) -> $t {
                a / n as $t
            }
            #[inline(always)]
            fn exp_bits(self) -> u32 {
                ((self.to_bits() >> $shift) as u32) & $exp
            }
            const EXP: u32 = $exp;
            #[inline(always)]
            fn wide(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn acc_exp(a: $t) -> u32 {
                a.exp_bits()
            }
            const ACC_EXP: u32 = $exp;
        }
    };
}
float_lane!(f32, 0, 0x7f80_0000);
float_lane!(f64, 32, 0x7ff0_0000);

macro_rules! int_lane {
    ($t:ty) => {
        impl Lane for $t {
            type Acc = $t;
            #[inline(always)]
            fn load(self) -> $t {
                self
            }
            #[inline(always)]
            fn store(a: $t) -> $t {
                a
            }
            #[inline(always)]
            fn add(a: $t, b: $t) -> $t {
                a.wrapping_add(b)
            }
            #[inline(always)]
            fn mul(a: $t, b: $t) -> $t {
                a.wrapping_mul(b)
            }
            #[inline(always)]
            fn min(a: $t, b: $t) -> $t {
                a.min(b)
            }
            #[inline(always)]
            fn max(a: $t, b: $t) -> $t {
                a.max(b)
            }
            #[inline(always)]
            fn div(a: $t, n: usize) -> $t {
                // The wrapping sum divided by the world size, truncating toward zero. A world
                // size the type cannot hold (256 ranks in u8, 128 in i8) divides in i128, where
                // it is exact, instead of by a truncated (zero or negative) divisor.
                match <$t>::try_from(n) {
                    Ok(d) => a.wrapping_div(d),
                    Err(_) => (a as i128 / n as i128) as $t,
                }
            }
            #[inline(always)]
            fn exp_bits(self) -> u32 {
                0
            }
            const EXP: u32 = u32::MAX;
            #[inline(always)]
            fn wide(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn acc_exp(_: $t) -> u32 {
                0
            }
            const ACC_EXP: u32 = u32::MAX;
        }
    };
}
int_lane!(i32);
int_lane!(i64);
int_lane!(u8);
int_lane!(i8);
int_lane!(u32);
int_lane!(u64);

macro_rules! half_lane {
    ($t:ty, $exp:expr) => {
        impl Lane for $t {
            type Acc = f32;
            #[inline(always)]
            fn load(self) -> f32 {
                self.to_f32()
            }
            #[inline(always)]
            fn store(a: f32) -> $t {
                <$t>::from_f32(a)
            }
            #[inline(always)]
            fn add(a: f32, b: f32) -> f32 {
                a + b
            }
            #[inline(always)]
            fn mul(a: f32, b: f32) -> f32 {
                a * b
            }
            #[inline(always)]
            fn min(a: f32, b: f32) -> f32 {
                if b < a {
                    b
                } else {
                    a
                }
            }
            #[inline(always)]
            fn max(a: f32, b: f32) -> f32 {
                if b > a {
                    b
                } else {
                    a
                }
            }
            #[inline(always)]
            fn div(a: f32, n: usize) -> f32 {
                a / n as f32
            }
            #[inline(always)]
            fn exp_bits(self) -> u32 {
                self.to_bits() as u32 & $exp
            }
            const EXP: u32 = $exp;
            #[inline(always)]
            fn wide(self) -> f64 {
                self.to_f64()
            }
            #[inline(always)]
            fn acc_exp(a: f32) -> u32 {
                a.exp_bits()
            }
            const ACC_EXP: u32 = <f32 as Lane>::EXP;
        }
    };
}
half_lane!(f16, 0x7c00);
half_lane!(bf16, 0x7f80);

/// Elements an in-place loop computes into registers before it stores them (see [`update`]).
const CHUNK: usize = 16;

/// `dst[i] = g(dst[i], src[i])` for every element, every store unconditional. Written as the plain
/// `*d = g(*d, s)`, min and max (which keep `*d` whenever it wins) let LLVM drop the stores that
/// would write back what was read, and the loop becomes masked stores (`vmaskmov`), several times
/// slower than a compare and a full store. Here a chunk is computed in registers, then
/// `black_box` is handed the chunk's address between the loads and the stores, so LLVM can no
/// longer tell that a store rewrites the value read, and the loop vectorises as the out-of-place
/// one does. Same operations, same order: same bits.
///
/// Only min and max need it (`select`): for the arithmetic operators the plain loop vectorises,
/// and the barrier would only cost them a little.
#[inline(always)]
fn update<D: Copy, S: Copy>(dst: &mut [D], src: &[S], select: bool, mut g: impl FnMut(D, S) -> D) {
    if !select {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = g(*d, *s);
        }
        return;
    }
    let n = dst.len().min(src.len());
    let (dc, dr) = dst[..n].as_chunks_mut::<CHUNK>();
    let (sc, sr) = src[..n].as_chunks::<CHUNK>();
    for (d, s) in dc.iter_mut().zip(sc) {
        let t: [D; CHUNK] = std::array::from_fn(|i| g(d[i], s[i]));
        // The chunk's memory "may have changed" since it was read (an empty asm that is handed
        // its address), so no store of `t` can be proven to write back what is there.
        std::hint::black_box(d.as_mut_ptr());
        *d = t;
    }
    for (d, s) in dr.iter_mut().zip(sr) {
        *d = g(*d, *s);
    }
}

/// `acc[i] = f(acc[i], src[i])` (`select`: `f` is min or max, see [`update`]); with `CHECK`,
/// returns the largest exponent field read (see [`Lane::exp_bits`]), else 0.
#[inline(always)]
fn combine<T: Lane, F: Fn(T::Acc, T::Acc) -> T::Acc, const CHECK: bool>(
    acc: &mut [T::Acc],
    src: &[T],
    f: F,
    select: bool,
) -> u32 {
    let mut m = 0u32;
    update(acc, src, select, |a, s: T| {
        if CHECK {
            m = m.max(s.exp_bits());
        }
        f(a, s.load())
    });
    m
}

/// The first pass of a block: writes every element of `acc` (`a` and `b` have its length). With
/// `CHECK`, returns the largest exponent field read, else 0. With `RESULT` too, the check folds
/// the results' fields instead, one per element, and returns [`Lane::EXP`] where one is all
/// ones, else 0: for the operators and the last source where a non-finite input always makes a
/// non-finite result (see [`pair_checked_apart`]).
#[inline(always)]
fn combine2<T: Lane, F: Fn(T::Acc, T::Acc) -> T::Acc, const CHECK: bool, const RESULT: bool>(
    acc: &mut [MaybeUninit<T::Acc>],
    a: &[T],
    b: &[T],
    f: F,
) -> u32 {
    let mut m = 0u32;
    for ((o, x), y) in acc.iter_mut().zip(a).zip(b) {
        let r = f(x.load(), y.load());
        if CHECK && RESULT {
            m = m.max(T::acc_exp(r));
        } else if CHECK {
            m = m.max(x.exp_bits()).max(y.exp_bits());
        }
        o.write(r);
    }
    if CHECK && RESULT {
        return if m == T::ACC_EXP { T::EXP } else { 0 };
    }
    m
}

/// The largest exponent field of `src` (see [`Lane::exp_bits`]).
#[inline(always)]
fn exp_max<T: Lane>(src: &[T]) -> u32 {
    src.iter().fold(0u32, |m, s| m.max(s.exp_bits()))
}

/// The first non-finite value a kernel read: element `elem` (from the start of the kernel's
/// range; callers shift it to the index in the contributor's input) of source `src`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Found {
    pub elem: usize,
    pub src: usize,
    pub kind: NonFiniteKind,
}

impl Found {
    /// The same finding `by` elements further on.
    pub(crate) fn shifted(self, by: usize) -> Found {
        Found {
            elem: self.elem + by,
            ..self
        }
    }

    /// The first of two findings: the lower element, then the lower source.
    pub(crate) fn first(a: Option<Found>, b: Option<Found>) -> Option<Found> {
        match (a, b) {
            (Some(x), Some(y)) => Some(if (y.elem, y.src) < (x.elem, x.src) {
                y
            } else {
                x
            }),
            (x, None) => x,
            (None, y) => y,
        }
    }
}

/// The first non-finite element of `len` elements from each source, lowest index first and at one
/// index the lowest source (the slow scan of a block whose exponent maximum showed one).
///
/// # Safety
/// Every source is valid for `len` elements of `T`.
unsafe fn locate<T: Lane>(srcs: &[*const T], len: usize) -> Option<Found> {
    for i in 0..len {
        for (k, s) in srcs.iter().enumerate() {
            // SAFETY: i < len (caller contract).
            let v = unsafe { *s.add(i) };
            if v.exp_bits() == T::EXP {
                let w = v.wide();
                let kind = if w.is_nan() {
                    NonFiniteKind::NaN
                } else if w > 0.0 {
                    NonFiniteKind::PosInf
                } else {
                    NonFiniteKind::NegInf
                };
                return Some(Found {
                    elem: i,
                    src: k,
                    kind,
                });
            }
        }
    }
    None
}

/// Where and how a reduction writes its result.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dst {
    /// Destination address (valid for the whole count).
    pub ptr: *mut u8,
    /// Use non-temporal (streaming) stores: for large outputs nobody reads soon, they skip the
    /// read-for-ownership and keep the caches for the staging slots.
    pub nt: bool,
}

/// `d[i] = f(a[i], b[i])` in one pass, `d` equal to `a`, to `b`, or disjoint from both (and `a`
/// distinct from `b`): the three cases keep the slices apart, so every loop vectorises.
///
/// # Safety
/// As for [`reduce_typed`], with `a != b`.
#[inline(always)]
unsafe fn pair<T: Lane, F: Fn(T::Acc, T::Acc) -> T::Acc>(
    a: *const T,
    b: *const T,
    d: *mut T,
    count: usize,
    f: F,
    select: bool,
) {
    // SAFETY: every pointer is valid for `count` elements (caller); a mutable slice is made only
    // of `d`, and only beside slices of the other, disjoint, source.
    unsafe {
        let out = std::slice::from_raw_parts_mut(d, count);
        if std::ptr::eq(d, a) {
            let b = std::slice::from_raw_parts(b, count);
            update(out, b, select, |o: T, y: T| T::store(f(o.load(), y.load())));
        } else if std::ptr::eq(d, b) {
            let a = std::slice::from_raw_parts(a, count);
            update(out, a, select, |o: T, x: T| T::store(f(x.load(), o.load())));
        } else {
            let (a, b) = (
                std::slice::from_raw_parts(a, count),
                std::slice::from_raw_parts(b, count),
            );
            for ((o, x), y) in out.iter_mut().zip(a).zip(b) {
                *o = T::store(f(x.load(), y.load()));
            }
        }
    }
}

/// Elements of each source [`pair_checked`] checks before it reduces them in place: few enough
/// that the reduction reads them again from L1 (smaller chunks tried cost more branches than
/// they saved, larger ones fell out of L1).
const CHECK_CHUNK: usize = 128;

/// [`pair`] with the finite check; returns the first non-finite value (lowest element, then
/// lowest source). Out of place see [`pair_checked_apart`]. In place the destination is one of
/// the sources: each chunk of both is checked before [`pair`] overwrites it, so a non-finite
/// value is located in sources still intact, without the copy of a stack block; the chunks
/// before it were finite, so its chunk holds the first one, and the rest of the call runs
/// unchecked.
///
/// # Safety
/// As for [`pair`].
#[inline(always)]
unsafe fn pair_checked<T: Lane, F: Fn(T::Acc, T::Acc) -> T::Acc>(
    a: *const T,
    b: *const T,
    d: *mut T,
    count: usize,
    f: F,
    select: bool,
) -> Option<Found> {
    if !std::ptr::eq(d, a) && !std::ptr::eq(d, b) {
        // SAFETY: forwarded caller contract; `d` is disjoint from both sources. Min and max are
        // the operators that select.
        return unsafe { pair_checked_apart(a, b, d, count, f, !select) };
    }
    if !select {
        // SAFETY: forwarded caller contract; `d` equals one source.
        return unsafe { pair_checked_over(a, b, d, count, f) };
    }
    let mut i = 0;
    while i + CHECK_CHUNK <= count {
        // SAFETY: i + CHECK_CHUNK <= count, within every range (caller contract); the chunk is
        // checked before `pair` writes it, so in place too it is read intact.
        unsafe {
            let x = std::slice::from_raw_parts(a.add(i), CHECK_CHUNK);
            let y = std::slice::from_raw_parts(b.add(i), CHECK_CHUNK);
            if exp_max(x).max(exp_max(y)) == T::EXP {
                let found = locate(&[a.add(i), b.add(i)], CHECK_CHUNK).map(|x| x.shifted(i));
                pair::<T, _>(a.add(i), b.add(i), d.add(i), count - i, f, select);
                return found;
            }
            pair::<T, _>(a.add(i), b.add(i), d.add(i), CHECK_CHUNK, &f, select);
        }
        i += CHECK_CHUNK;
    }
    // SAFETY: the tail's i..count lies within every range (caller contract); it is located
    // before it is reduced, so in place too it is read intact.
    unsafe {
        let found = locate(&[a.add(i), b.add(i)], count - i).map(|x| x.shifted(i));
        pair::<T, _>(a.add(i), b.add(i), d.add(i), count - i, f, select);
        found
    }
}

/// [`pair_checked`] in place for the operators that do not select (sum, product, average): only
/// the source that is also the destination is checked chunk by chunk before the loop overwrites
/// it; the other, read once, is folded in the reduction's own loop. A chunk where only the other
/// holds a non-finite value is located in it alone: the overwritten source was finite there.
///
/// # Safety
/// As for [`pair`], `d` equal to `a` or to `b`.
#[inline(always)]
unsafe fn pair_checked_over<T: Lane, F: Fn(T::Acc, T::Acc) -> T::Acc>(
    a: *const T,
    b: *const T,
    d: *mut T,
    count: usize,
    f: F,
) -> Option<Found> {
    // The source kept intact, and its index among the two.
    let (kept, k) = if std::ptr::eq(d, a) { (b, 1) } else { (a, 0) };
    let mut i = 0;
    while i < count {
        let len = CHECK_CHUNK.min(count - i);
        // SAFETY: i + len <= count, within every range (caller contract); `kept` is disjoint
        // from `d` (a != b) and only read; `d` is checked before it is written.
        unsafe {
            let out = std::slice::from_raw_parts_mut(d.add(i), len);
            if exp_max(out) == T::EXP {
                let found = locate(&[a.add(i), b.add(i)], len).map(|x| x.shifted(i));
                pair::<T, _>(a.add(i), b.add(i), d.add(i), count - i, f, false);
                return found;
            }
            let v = std::slice::from_raw_parts(kept.add(i), len);
            let mut m = 0u32;
            if k == 1 {
                for (o, y) in out.iter_mut().zip(v) {
                    m = m.max(y.exp_bits());
                    *o = T::store(f(o.load(), y.load()));
                }
            } else {
                for (o, x) in out.iter_mut().zip(v) {
                    m = m.max(x.exp_bits());
                    *o = T::store(f(x.load(), o.load()));
                }
            }
            if m == T::EXP {
                let found = locate(&[kept.add(i)], len).map(|x| Found {
                    src: k,
                    ..x.shifted(i)
                });
                let rest = i + len;
                pair::<T, _>(
                    a.add(rest),
                    b.add(rest),
                    d.add(rest),
                    count - rest,
                    f,
                    false,
                );
                return found;
            }
        }
        i += len;
    }
    None
}

/// [`pair_checked`] out of place, block by block: one loop reduces a block into `d` and folds
/// exponent fields, and a block that shows a non-finite value is located in the sources, which
/// the loop leaves intact. With `propagates` the loop folds the results' fields, one per
/// element, else both sources'. It is set for sum, product and average, where every non-finite
/// input makes the result non-finite (a NaN stays a NaN, an infinity stays one or becomes a NaN:
/// `inf - inf`, `inf * 0`); not for min and max, whose compare drops an infinity that loses. A
/// non-finite result of finite inputs (an overflow) is located in the sources, found finite, and
/// reported as nothing.
///
/// # Safety
/// As for [`pair`], `d` disjoint from both sources.
#[inline(always)]
unsafe fn pair_checked_apart<T: Lane, F: Fn(T::Acc, T::Acc) -> T::Acc>(
    a: *const T,
    b: *const T,
    d: *mut T,
    count: usize,
    f: F,
    propagates: bool,
) -> Option<Found> {
    let mut found = None;
    let mut start = 0;
    while start < count {
        let len = BLOCK.min(count - start);
        // SAFETY: start + len <= count, within every range (caller contract); `d` is disjoint
        // from both sources.
        unsafe {
            let (a, b, d) = (a.add(start), b.add(start), d.add(start));
            let (x, y, o) = (
                std::slice::from_raw_parts(a, len),
                std::slice::from_raw_parts(b, len),
                std::slice::from_raw_parts_mut(d, len),
            );
            let mut m = 0u32;
            if propagates {
                for ((o, x), y) in o.iter_mut().zip(x).zip(y) {
                    let r = T::store(f(x.load(), y.load()));
                    m = m.max(r.exp_bits());
                    *o = r;
                }
            } else {
                for ((o, x), y) in o.iter_mut().zip(x).zip(y) {
                    m = m.max(x.exp_bits()).max(y.exp_bits());
                    *o = T::store(f(x.load(), y.load()));
                }
            }
            if m == T::EXP && found.is_none() {
                found = locate(&[a, b], len).map(|x| x.shifted(start));
            }
        }
        start += len;
    }
    found
}

/// Reduce `srcs` into every destination; with `CHECK`, also return the first non-finite source
/// element (lowest index, then lowest source), else `None`.
///
/// # Safety
/// Every `srcs[k]` and every destination must be valid for `count` elements of `T`; a destination
/// may alias a source exactly (same address) but must not partially overlap one.
#[inline(always)]
unsafe fn reduce_typed<T: Lane, const CHECK: bool>(
    op: ReduceOp,
    n_ranks: usize,
    srcs: &[*const u8],
    dsts: &[Dst],
    count: usize,
) -> Option<Found> {
    // Two sources into one cached destination (every reduction of two ranks on ordinary buffers):
    // one pass straight into the destination, no accumulator to fill and copy out. The same
    // operations in the same order as below, so the same bits.
    if let ([a, b], [d]) = (srcs, dsts) {
        if !d.nt && a != b {
            let (a, b, d) = (*a as *const T, *b as *const T, d.ptr as *mut T);
            let avg = |x, y| T::div(T::add(x, y), n_ranks);
            if CHECK {
                // SAFETY: forwarded caller contract; a != b.
                return unsafe {
                    match op {
                        ReduceOp::Sum => pair_checked::<T, _>(a, b, d, count, T::add, false),
                        ReduceOp::Avg => pair_checked::<T, _>(a, b, d, count, avg, false),
                        ReduceOp::Prod => pair_checked::<T, _>(a, b, d, count, T::mul, false),
                        ReduceOp::Min => pair_checked::<T, _>(a, b, d, count, T::min, true),
                        ReduceOp::Max => pair_checked::<T, _>(a, b, d, count, T::max, true),
                    }
                };
            }
            // SAFETY: forwarded caller contract; a != b.
            unsafe {
                match op {
                    ReduceOp::Sum => pair::<T, _>(a, b, d, count, T::add, false),
                    ReduceOp::Avg => pair::<T, _>(a, b, d, count, avg, false),
                    ReduceOp::Prod => pair::<T, _>(a, b, d, count, T::mul, false),
                    ReduceOp::Min => pair::<T, _>(a, b, d, count, T::min, true),
                    ReduceOp::Max => pair::<T, _>(a, b, d, count, T::max, true),
                }
            }
            return None;
        }
    }
    let mut found = None;
    // Not zeroed: the first pass of each block writes every element it uses (zeroing 4 KiB took
    // a quarter of an 8-byte all-reduce on one rank, and runs on every call of three ranks or
    // more).
    let mut acc = [MaybeUninit::<T::Acc>::uninit(); BLOCK];
    let mut out = [MaybeUninit::<T>::uninit(); BLOCK];
    let mut start = 0;
    while start < count {
        let len = BLOCK.min(count - start);
        let first = &mut acc[..len];
        // SAFETY: caller guarantees every source is valid for count elements; start+len <= count.
        let src =
            |k: usize| unsafe { std::slice::from_raw_parts((srcs[k] as *const T).add(start), len) };
        let (rest, mut m) = if srcs.len() >= 2 {
            let (a, b) = (src(0), src(1));
            // Two sources: the results carry every non-finite input of a sum, a product and an
            // average; with more, the later sources are folded as they are read.
            let last = srcs.len() == 2;
            let m = match op {
                ReduceOp::Sum | ReduceOp::Avg if last => {
                    combine2::<T, _, CHECK, true>(first, a, b, T::add)
                }
                ReduceOp::Sum | ReduceOp::Avg => {
                    combine2::<T, _, CHECK, false>(first, a, b, T::add)
                }
                ReduceOp::Prod if last => combine2::<T, _, CHECK, true>(first, a, b, T::mul),
                ReduceOp::Prod => combine2::<T, _, CHECK, false>(first, a, b, T::mul),
                ReduceOp::Min => combine2::<T, _, CHECK, false>(first, a, b, T::min),
                ReduceOp::Max => combine2::<T, _, CHECK, false>(first, a, b, T::max),
            };
            (2, m)
        } else {
            let mut m = 0u32;
            for (a, s) in first.iter_mut().zip(src(0)) {
                if CHECK {
                    m = m.max(s.exp_bits());
                }
                a.write(s.load());
            }
            (1, m)
        };
        // SAFETY: the pass above wrote all `len` elements (every source holds `len` here), and
        // MaybeUninit<A> has A's layout.
        let acc = unsafe { &mut *(first as *mut [MaybeUninit<T::Acc>] as *mut [T::Acc]) };
        for k in rest..srcs.len() {
            let s = src(k);
            let mk = match op {
                ReduceOp::Sum | ReduceOp::Avg => combine::<T, _, CHECK>(acc, s, T::add, false),
                ReduceOp::Prod => combine::<T, _, CHECK>(acc, s, T::mul, false),
                ReduceOp::Min => combine::<T, _, CHECK>(acc, s, T::min, true),
                ReduceOp::Max => combine::<T, _, CHECK>(acc, s, T::max, true),
            };
            m = m.max(mk);
        }
        if op == ReduceOp::Avg {
            for a in acc.iter_mut() {
                *a = T::div(*a, n_ranks);
            }
        }
        for (o, a) in out[..len].iter_mut().zip(acc.iter()) {
            o.write(T::store(*a));
        }
        if CHECK && m == T::EXP && found.is_none() {
            // Before the block is stored: a destination may be one of the sources.
            let at: Vec<*const T> = (0..srcs.len()).map(|k| src(k).as_ptr()).collect();
            // SAFETY: every source holds `len` elements from `start`.
            found = unsafe { locate(&at, len) }.map(|x| x.shifted(start));
        }
        let bytes = len * std::mem::size_of::<T>();
        for d in dsts {
            // SAFETY: out[..len] is initialised; the destination is valid for count elements and
            // every aliasing source block was fully read above.
            unsafe {
                copy_block(
                    out.as_ptr() as *const u8,
                    d.ptr.add(start * std::mem::size_of::<T>()),
                    bytes,
                    d.nt,
                )
            };
        }
        start += len;
    }
    if dsts.iter().any(|d| d.nt) {
        store_fence();
    }
    found
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn reduce_avx2<T: Lane, const CHECK: bool>(
    op: ReduceOp,
    n_ranks: usize,
    srcs: &[*const u8],
    dsts: &[Dst],
    count: usize,
) -> Option<Found> {
    // SAFETY: forwarded caller contract; the body is the generic loop compiled with AVX2.
    unsafe { reduce_typed::<T, CHECK>(op, n_ranks, srcs, dsts, count) }
}

unsafe fn reduce_dispatch<T: Lane, const CHECK: bool>(
    op: ReduceOp,
    n_ranks: usize,
    srcs: &[*const u8],
    dsts: &[Dst],
    count: usize,
) -> Option<Found> {
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx2() {
            // SAFETY: the CPU supports AVX2 (checked at run time); caller contract forwarded.
            return unsafe { reduce_avx2::<T, CHECK>(op, n_ranks, srcs, dsts, count) };
        }
    }
    // SAFETY: forwarded caller contract.
    unsafe { reduce_typed::<T, CHECK>(op, n_ranks, srcs, dsts, count) }
}

#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    use std::sync::OnceLock;
    static AVX2: OnceLock<bool> = OnceLock::new();
    *AVX2.get_or_init(|| std::is_x86_feature_detected!("avx2"))
}

/// Order earlier streaming stores before later stores (the progress publish): NT stores are
/// weakly ordered, a release store alone does not cover them.
pub(crate) fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: sfence has no preconditions (SSE, part of x86_64).
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
    #[cfg(not(target_arch = "x86_64"))]
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}

/// Copy `bytes` from `src` to `dst`, with streaming stores when `nt` (no fence: callers fence once
/// after a batch, see [`store_fence`]). Equal addresses are a no-op.
///
/// # Safety
/// Both ranges valid; equal or non-overlapping.
#[inline]
pub(crate) unsafe fn copy_block(src: *const u8, dst: *mut u8, bytes: usize, nt: bool) {
    if bytes == 0 || std::ptr::eq(src, dst as *const u8) {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if nt && bytes >= 256 {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        // Head: bring dst to 16-byte alignment with an ordinary copy.
        let head = dst.align_offset(16).min(bytes);
        // SAFETY: within both ranges.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
        // SAFETY: head <= bytes, so both offsets stay within their ranges.
        let (mut s, mut d, mut left) = (
            unsafe { src.add(head) },
            unsafe { dst.add(head) },
            bytes - head,
        );
        while left >= 64 {
            // SAFETY: 64 bytes remain in both ranges; d is 16-byte aligned; unaligned loads.
            unsafe {
                let a = _mm_loadu_si128(s as *const __m128i);
                let b = _mm_loadu_si128(s.add(16) as *const __m128i);
                let c = _mm_loadu_si128(s.add(32) as *const __m128i);
                let e = _mm_loadu_si128(s.add(48) as *const __m128i);
                _mm_stream_si128(d as *mut __m128i, a);
                _mm_stream_si128(d.add(16) as *mut __m128i, b);
                _mm_stream_si128(d.add(32) as *mut __m128i, c);
                _mm_stream_si128(d.add(48) as *mut __m128i, e);
                s = s.add(64);
                d = d.add(64);
            }
            left -= 64;
        }
        // SAFETY: the remaining tail lies within both ranges.
        unsafe { std::ptr::copy_nonoverlapping(s, d, left) };
        return;
    }
    let _ = nt;
    // SAFETY: forwarded contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, bytes) };
}

/// Copy `bytes` from `src` to `stage` and to `dst`, reading the source once. With ordinary
/// stores to both (and AVX2) in one pass: every 128 bytes are loaded into registers once and
/// stored twice. `stage_nt` or `nt` (streaming stores for that destination) go in 4 KiB pieces,
/// the second copy of each piece reading it from L1. `dst` equal to `src` is skipped.
///
/// Why one pass: the staged all-gather's own block and its staging copy are both made from the
/// input, and one pass reads the input once where two passes read it twice.
/// `benches/baselines/cma_floor.c` times the bare copies of an all-gather each way (one pass,
/// 4 KiB pieces, one after the other).
///
/// # Safety
/// All ranges valid for `bytes`; `stage` disjoint from both; `dst` equal to `src` or disjoint.
pub(crate) unsafe fn copy_block2(
    src: *const u8,
    stage: *mut u8,
    stage_nt: bool,
    dst: *mut u8,
    nt: bool,
    bytes: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if !stage_nt && !nt && !std::ptr::eq(src, dst as *const u8) && has_avx2() {
        // SAFETY: the CPU supports AVX2 (checked at run time); forwarded contract.
        return unsafe { copy2_avx2(src, stage, dst, bytes) };
    }
    const PIECE: usize = 4096;
    let mut at = 0;
    while at < bytes {
        let len = PIECE.min(bytes - at);
        // SAFETY: [at, at+len) lies within every range; forwarded contract.
        unsafe {
            copy_block(src.add(at), stage.add(at), len, stage_nt);
            copy_block(src.add(at), dst.add(at), len, nt);
        }
        at += len;
    }
}

/// [`copy_block2`] with ordinary stores to two disjoint destinations, 128 bytes a step.
///
/// # Safety
/// AVX2 present; all ranges valid for `bytes`, the destinations disjoint from each other and
/// from `src`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn copy2_avx2(src: *const u8, a: *mut u8, b: *mut u8, bytes: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_storeu_si256};
    let mut at = 0;
    while at + 128 <= bytes {
        // SAFETY: 128 bytes from `at` lie within every range; unaligned loads and stores.
        unsafe {
            let s = src.add(at) as *const __m256i;
            let (x0, x1, x2, x3) = (
                _mm256_loadu_si256(s),
                _mm256_loadu_si256(s.add(1)),
                _mm256_loadu_si256(s.add(2)),
                _mm256_loadu_si256(s.add(3)),
            );
            for d in [a.add(at) as *mut __m256i, b.add(at) as *mut __m256i] {
                _mm256_storeu_si256(d, x0);
                _mm256_storeu_si256(d.add(1), x1);
                _mm256_storeu_si256(d.add(2), x2);
                _mm256_storeu_si256(d.add(3), x3);
            }
        }
        at += 128;
    }
    // SAFETY: the tail [at, bytes) lies within every range.
    unsafe {
        std::ptr::copy_nonoverlapping(src.add(at), a.add(at), bytes - at);
        std::ptr::copy_nonoverlapping(src.add(at), b.add(at), bytes - at);
    }
}

/// Reduce `srcs` (in order) into every destination, `count` elements of `dtype`. `n_ranks` is the
/// divisor for `Avg` (the world size).
///
/// # Safety
/// Every source and destination must be valid and aligned for `count` elements of `dtype`; a
/// destination may equal a source but must not partially overlap one. `srcs` must not be empty.
pub(crate) unsafe fn reduce_into(
    dtype: Dtype,
    op: ReduceOp,
    n_ranks: usize,
    srcs: &[*const u8],
    dsts: &[Dst],
    count: usize,
) {
    // SAFETY: forwarded caller contract.
    unsafe { reduce_any::<false>(dtype, op, n_ranks, srcs, dsts, count) };
}

/// [`reduce_into`] with the finite check when `check` (chosen here, once per call): returns the
/// first non-finite source element, lowest index first and at one index the lowest source
/// (always `None` for integer dtypes, and when `check` is off). The reduction is complete either
/// way.
///
/// # Safety
/// As [`reduce_into`].
pub(crate) unsafe fn reduce_checked(
    check: bool,
    dtype: Dtype,
    op: ReduceOp,
    n_ranks: usize,
    srcs: &[*const u8],
    dsts: &[Dst],
    count: usize,
) -> Option<Found> {
    // SAFETY: forwarded caller contract.
    unsafe {
        if check && dtype.is_float() {
            reduce_any::<true>(dtype, op, n_ranks, srcs, dsts, count)
        } else {
            reduce_any::<false>(dtype, op, n_ranks, srcs, dsts, count)
        }
    }
}

/// # Safety
/// As [`reduce_into`].
unsafe fn reduce_any<const CHECK: bool>(
    dtype: Dtype,
    op: ReduceOp,
    n_ranks: usize,
    srcs: &[*const u8],
    dsts: &[Dst],
    count: usize,
) -> Option<Found> {
    debug_assert!(!srcs.is_empty());
    // SAFETY: forwarded caller contract.
    unsafe {
        match dtype {
            Dtype::F32 => reduce_dispatch::<f32, CHECK>(op, n_ranks, srcs, dsts, count),
            Dtype::F64 => reduce_dispatch::<f64, CHECK>(op, n_ranks, srcs, dsts, count),
            Dtype::F16 => reduce_dispatch::<f16, CHECK>(op, n_ranks, srcs, dsts, count),
            Dtype::BF16 => reduce_dispatch::<bf16, CHECK>(op, n_ranks, srcs, dsts, count),
            Dtype::I32 => reduce_dispatch::<i32, false>(op, n_ranks, srcs, dsts, count),
            Dtype::I64 => reduce_dispatch::<i64, false>(op, n_ranks, srcs, dsts, count),
            Dtype::U8 => reduce_dispatch::<u8, false>(op, n_ranks, srcs, dsts, count),
            Dtype::I8 => reduce_dispatch::<i8, false>(op, n_ranks, srcs, dsts, count),
            Dtype::U32 => reduce_dispatch::<u32, false>(op, n_ranks, srcs, dsts, count),
            Dtype::U64 => reduce_dispatch::<u64, false>(op, n_ranks, srcs, dsts, count),
        }
    }
}

/// The first non-finite element of `count` elements of `dtype` from each source, lowest index
/// first and at one index the lowest source, without reducing: for the ranks that take no part
/// in a reduction's arithmetic but must report the same error (a reduce's non-roots on the paths
/// where the root reduces alone, the blocks of a reduce-scatter that other ranks reduce). `None`
/// for integer dtypes.
///
/// # Safety
/// Every source must be valid and aligned for `count` elements of `dtype`.
pub(crate) unsafe fn scan_finite(dtype: Dtype, srcs: &[*const u8], count: usize) -> Option<Found> {
    /// # Safety
    /// As above, for `T`.
    unsafe fn scan<T: Lane>(srcs: &[*const u8], count: usize) -> Option<Found> {
        let mut start = 0;
        while start < count {
            let len = BLOCK.min(count - start);
            // SAFETY: start + len <= count, within every source.
            let at: Vec<*const T> = srcs
                .iter()
                .map(|s| unsafe { (*s as *const T).add(start) })
                .collect();
            let m = at
                .iter()
                // SAFETY: as above.
                .map(|p| exp_max(unsafe { std::slice::from_raw_parts(*p, len) }))
                .max()
                .unwrap_or(0);
            if m == T::EXP {
                // SAFETY: as above.
                return unsafe { locate(&at, len) }.map(|x| x.shifted(start));
            }
            start += len;
        }
        None
    }
    // SAFETY: forwarded caller contract.
    unsafe {
        match dtype {
            Dtype::F32 => scan::<f32>(srcs, count),
            Dtype::F64 => scan::<f64>(srcs, count),
            Dtype::F16 => scan::<f16>(srcs, count),
            Dtype::BF16 => scan::<bf16>(srcs, count),
            _ => None,
        }
    }
}

/// Reduce `srcs` (in order) into `dst` with ordinary stores.
///
/// # Safety
/// As [`reduce_into`].
pub(crate) unsafe fn reduce_raw(
    dtype: Dtype,
    op: ReduceOp,
    n_ranks: usize,
    srcs: &[*const u8],
    dst: *mut u8,
    count: usize,
) {
    // SAFETY: forwarded caller contract.
    unsafe {
        reduce_into(
            dtype,
            op,
            n_ranks,
            srcs,
            &[Dst {
                ptr: dst,
                nt: false,
            }],
            count,
        )
    }
}

/// Safe reference reduction over typed slices, used by tests and by the bench's verification.
pub fn reduce_slices<T: crate::comm::Element>(op: ReduceOp, srcs: &[&[T]], dst: &mut [T]) {
    assert!(
        !srcs.is_empty() && srcs.iter().all(|s| s.len() == dst.len()),
        "reduce_slices: length mismatch"
    );
    let ptrs: Vec<*const u8> = srcs.iter().map(|s| s.as_ptr() as *const u8).collect();
    // SAFETY: lengths checked above; slices are valid and aligned; dst does not overlap a shared
    // borrow (the borrow checker forbids it).
    unsafe {
        reduce_raw(
            T::DTYPE,
            op,
            srcs.len(),
            &ptrs,
            dst.as_mut_ptr() as *mut u8,
            dst.len(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both destinations of `copy_block2` hold the source exactly, for every mode, length and
    /// misalignment, and nothing around them is touched.
    #[test]
    fn copy_block2_every_mode() {
        let src: Vec<u8> = (0..70_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        for len in [0, 1, 31, 127, 128, 129, 4095, 4097, 65_537] {
            for shift in [0, 1, 33] {
                for (snt, nt) in [(false, false), (true, false), (false, true), (true, true)] {
                    let mut a = vec![0xAAu8; len + 200];
                    let mut b = vec![0x55u8; len + 200];
                    // SAFETY: src holds shift + len bytes; a and b hold 100 + len + 100, disjoint.
                    unsafe {
                        copy_block2(
                            src.as_ptr().add(shift),
                            a.as_mut_ptr().add(100),
                            snt,
                            b.as_mut_ptr().add(100),
                            nt,
                            len,
                        )
                    };
                    store_fence();
                    let want = &src[shift..shift + len];
                    assert_eq!(
                        &a[100..100 + len],
                        want,
                        "stage, len {len} shift {shift} nt {snt}/{nt}"
                    );
                    assert_eq!(
                        &b[100..100 + len],
                        want,
                        "dst, len {len} shift {shift} nt {snt}/{nt}"
                    );
                    assert!(
                        a[..100].iter().chain(&a[100 + len..]).all(|&x| x == 0xAA),
                        "stage overrun, len {len}"
                    );
                    assert!(
                        b[..100].iter().chain(&b[100 + len..]).all(|&x| x == 0x55),
                        "dst overrun, len {len}"
                    );
                }
            }
        }
    }

    #[test]
    fn sum_in_order_across_blocks() {
        let a: Vec<f32> = (0..3000).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..3000).map(|i| (i * 2) as f32).collect();
        let mut d = vec![0f32; 3000];
        reduce_slices(ReduceOp::Sum, &[&a, &b], &mut d);
        assert!(d.iter().enumerate().all(|(i, v)| *v == (3 * i) as f32));
    }

    #[test]
    fn half_accumulates_in_f32() {
        // 2048 + 1 + 1 in f16 rounds to 2048 twice; in f32 it is 2050, which f16 represents.
        let a = vec![f16::from_f32(2048.0); 5];
        let b = vec![f16::from_f32(1.0); 5];
        let mut d = vec![f16::ZERO; 5];
        reduce_slices(ReduceOp::Sum, &[&a, &b, &b], &mut d);
        assert!(d.iter().all(|v| v.to_f32() == 2050.0));
    }

    /// The one-pass path of two sources (one cached destination) gives the accumulator path's
    /// bits (forced here by a second destination), for every op, in and out of place.
    fn pair_matches_accumulator<T: crate::comm::Element>(gen: impl Fn(usize, usize) -> T) {
        let n = 3001;
        let a: Vec<T> = (0..n).map(|i| gen(i, 0)).collect();
        let b: Vec<T> = (0..n).map(|i| gen(i, 1)).collect();
        for op in [
            ReduceOp::Sum,
            ReduceOp::Avg,
            ReduceOp::Prod,
            ReduceOp::Min,
            ReduceOp::Max,
        ] {
            let mut want = vec![T::default(); n];
            let mut spare = vec![T::default(); n];
            let (pa, pb) = (a.as_ptr() as *const u8, b.as_ptr() as *const u8);
            let two = [
                Dst {
                    ptr: want.as_mut_ptr() as *mut u8,
                    nt: false,
                },
                Dst {
                    ptr: spare.as_mut_ptr() as *mut u8,
                    nt: false,
                },
            ];
            // SAFETY: every buffer holds n elements; the destinations are disjoint from the sources.
            unsafe { reduce_into(T::DTYPE, op, 2, &[pa, pb], &two, n) };
            let mut out = vec![T::default(); n];
            // SAFETY: as above, one destination.
            unsafe { reduce_raw(T::DTYPE, op, 2, &[pa, pb], out.as_mut_ptr() as *mut u8, n) };
            assert_eq!(out, want, "{op} out of place");
            for first in [true, false] {
                let (mut x, mut y) = (a.clone(), b.clone());
                let (px, py) = (x.as_mut_ptr(), y.as_mut_ptr());
                let d = if first { px } else { py };
                // SAFETY: the destination is exactly one of the sources.
                unsafe {
                    reduce_raw(
                        T::DTYPE,
                        op,
                        2,
                        &[px as *const u8, py as *const u8],
                        d as *mut u8,
                        n,
                    )
                };
                assert_eq!(
                    if first { x } else { y },
                    want,
                    "{op} in place on source {}",
                    if first { 0 } else { 1 }
                );
            }
        }
    }

    #[test]
    fn two_sources_in_one_pass() {
        pair_matches_accumulator::<f32>(|i, k| {
            ((i * 2654435761 + k * 97) % 1000) as f32 * 1.37e-3 + 1e4 * k as f32
        });
        pair_matches_accumulator::<f16>(|i, k| {
            f16::from_f32(((i * 31 + k * 7) % 200) as f32 * 0.37 - 30.0)
        });
        pair_matches_accumulator::<bf16>(|i, k| {
            bf16::from_f32(((i * 31 + k * 7) % 200) as f32 * 0.37 - 30.0)
        });
        pair_matches_accumulator::<i32>(|i, k| ((i * 7919 + k * 13) % 2001) as i32 - 1000);
        pair_matches_accumulator::<u8>(|i, k| ((i * 7 + k * 101) % 256) as u8);
    }

    /// The checked kernel reports the first non-finite element (lowest index, then lowest
    /// source) on every branch of the kernel (one source, the pair loop in and out of place, the
    /// accumulator), and reduces to the unchecked kernel's bits.
    fn checked_finds<T: crate::comm::Element + Lane>(from: impl Fn(f64) -> T) {
        let specials = [
            (f64::NAN, NonFiniteKind::NaN),
            (f64::INFINITY, NonFiniteKind::PosInf),
            (f64::NEG_INFINITY, NonFiniteKind::NegInf),
        ];
        let bytes = |v: &[T]| -> Vec<u8> {
            // SAFETY: plain data, len elements.
            unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
                .to_vec()
        };
        for n in [1usize, 2, 3, 5] {
            for count in [1usize, 7, 1024, 3001] {
                for hits in [
                    // One bad value.
                    vec![(count - 1, n - 1, 0)],
                    // Two: the lower element wins, whatever the source.
                    vec![(count / 2, 0, 1), (count / 3, n - 1, 2)],
                    // At one element, the lower source wins.
                    vec![(count / 2, n - 1, 0), (count / 2, n / 2, 2)],
                ] {
                    let want = hits.iter().map(|h| (h.0, h.1)).min().unwrap();
                    for op in ReduceOp::ALL {
                        for mode in 0..4 {
                            let mut ins: Vec<Vec<T>> = (0..n)
                                .map(|k| {
                                    (0..count)
                                        .map(|i| from(((i * 7 + k * 3) % 11) as f64 * 0.5 + 1.0))
                                        .collect()
                                })
                                .collect();
                            for &(e, k, s) in &hits {
                                ins[k][e] = from(specials[s].0);
                            }
                            // The last write to that element (small counts make hits coincide).
                            let first = hits
                                .iter()
                                .rev()
                                .find(|h| (h.0, h.1) == want)
                                .map(|h| specials[h.2].1);
                            let orig = ins.clone();
                            let srcs: Vec<*const u8> =
                                ins.iter().map(|v| v.as_ptr() as *const u8).collect();
                            let mut want_out = vec![T::default(); count];
                            // SAFETY: every buffer holds count elements, disjoint.
                            unsafe {
                                reduce_raw(
                                    T::DTYPE,
                                    op,
                                    n,
                                    &srcs,
                                    want_out.as_mut_ptr() as *mut u8,
                                    count,
                                )
                            };
                            let mut out = vec![T::default(); count];
                            let mut spare = vec![T::default(); count];
                            // 0: one cached destination; 1: two (the accumulator); 2: in place on
                            // the last source; 3: in place on the first.
                            let mut dsts = vec![Dst {
                                ptr: out.as_mut_ptr() as *mut u8,
                                nt: false,
                            }];
                            match mode {
                                1 => dsts.push(Dst {
                                    ptr: spare.as_mut_ptr() as *mut u8,
                                    nt: false,
                                }),
                                2 => dsts[0].ptr = ins[n - 1].as_mut_ptr() as *mut u8,
                                3 => dsts[0].ptr = ins[0].as_mut_ptr() as *mut u8,
                                _ => {}
                            }
                            // SAFETY: as above; an in-place destination equals a source.
                            let got = unsafe {
                                reduce_checked(true, T::DTYPE, op, n, &srcs, &dsts, count)
                            };
                            let what = format!(
                                "{} n {n} count {count} {op} mode {mode} hits {hits:?}",
                                T::DTYPE
                            );
                            assert_eq!(
                                got,
                                Some(Found {
                                    elem: want.0,
                                    src: want.1,
                                    kind: first.unwrap()
                                }),
                                "{what}"
                            );
                            let res = match mode {
                                2 => &ins[n - 1],
                                3 => &ins[0],
                                _ => &out,
                            };
                            assert_eq!(bytes(res), bytes(&want_out), "result bits, {what}");
                            // SAFETY: every source holds count elements.
                            let scanned = unsafe { scan_finite(T::DTYPE, &srcs, count) };
                            if mode < 2 {
                                assert_eq!(scanned, got, "scan, {what}");
                            }
                            // Off: no report.
                            let clean: Vec<Vec<T>> = orig
                                .iter()
                                .map(|v| v.iter().map(|_| from(1.0)).collect())
                                .collect();
                            let cs: Vec<*const u8> =
                                clean.iter().map(|v| v.as_ptr() as *const u8).collect();
                            // SAFETY: as above.
                            let none = unsafe {
                                reduce_checked(true, T::DTYPE, op, n, &cs, &dsts[..1], count)
                            };
                            assert_eq!(none, None, "clean, {what}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn checked_kernel_finds_the_first_non_finite() {
        checked_finds::<f32>(|v| v as f32);
        checked_finds::<f64>(|v| v);
        checked_finds::<f16>(f16::from_f64);
        checked_finds::<bf16>(bf16::from_f64);
        // Integers: no report, the plain kernel.
        let a = [1i32; 10];
        let mut d = vec![0i32; 10];
        let srcs = [a.as_ptr() as *const u8, a.as_ptr() as *const u8];
        let dst = [Dst {
            ptr: d.as_mut_ptr() as *mut u8,
            nt: false,
        }];
        // SAFETY: every buffer holds 10 elements.
        let f = unsafe { reduce_checked(true, Dtype::I32, ReduceOp::Sum, 2, &srcs, &dst, 10) };
        assert_eq!((f, d), (None, vec![2; 10]));
    }

    /// A sum that overflows to infinity from finite inputs is no finding (two sources out of
    /// place fold their results' fields, see `pair_checked_apart` and `combine2`), in the block
    /// of a real NaN or before it: the NaN is still the one reported, and without one nothing is.
    #[test]
    fn checked_overflow_is_no_finding() {
        let count = 3000;
        for (op, big) in [
            (ReduceOp::Sum, f32::MAX),
            (ReduceOp::Prod, 1e30),
            (ReduceOp::Avg, f32::MAX),
        ] {
            for (over, nan) in [(3, Some(500)), (3, Some(2000)), (1500, None), (2999, None)] {
                let mut a = vec![1f32; count];
                let mut b = vec![1f32; count];
                a[over] = big;
                b[over] = big;
                if let Some(e) = nan {
                    b[e] = f32::NAN;
                }
                let mut out = vec![0f32; count];
                let mut spare = vec![0f32; count];
                let srcs = [a.as_ptr() as *const u8, b.as_ptr() as *const u8];
                let dst = [out.as_mut_ptr(), spare.as_mut_ptr()].map(|p| Dst {
                    ptr: p as *mut u8,
                    nt: false,
                });
                // One destination (the one-pass kernel) and two (the accumulator).
                for dsts in [&dst[..1], &dst[..]] {
                    // SAFETY: every buffer holds `count` elements, disjoint.
                    let f = unsafe { reduce_checked(true, Dtype::F32, op, 2, &srcs, dsts, count) };
                    let want = nan.map(|e| Found {
                        elem: e,
                        src: 1,
                        kind: NonFiniteKind::NaN,
                    });
                    let what = format!(
                        "{op} overflow at {over}, NaN at {nan:?}, {} dsts",
                        dsts.len()
                    );
                    assert_eq!(f, want, "{what}");
                    assert!(
                        out[over].is_infinite(),
                        "{what}: the overflow is the result"
                    );
                }
            }
        }
    }

    /// The finite check's cost in the kernel alone, checked against unchecked, alternating, the
    /// best of many runs (`cargo test --release --lib -- --ignored checked_kernel_cost
    /// --nocapture`): 2 sources out of place (one loop), in place (checked chunk by chunk),
    /// and 3 sources (the accumulator), 128 Ki f32 (512 KiB, half of a 1 MiB all-reduce's
    /// elements: one rank's part).
    #[test]
    #[ignore]
    fn checked_kernel_cost() {
        let n = 128 << 10;
        let src: Vec<Vec<f32>> = (0..3)
            .map(|k| (0..n).map(|i| (i + k) as f32 * 0.25).collect())
            .collect();
        let mut out = vec![0f32; n];
        for (name, k, in_place, op) in [
            ("sum, 2 out of place", 2, false, ReduceOp::Sum),
            ("sum, 2 in place", 2, true, ReduceOp::Sum),
            ("sum, 3", 3, false, ReduceOp::Sum),
            ("max, 2 out of place", 2, false, ReduceOp::Max),
            ("max, 2 in place", 2, true, ReduceOp::Max),
            ("max, 3", 3, false, ReduceOp::Max),
        ] {
            let mut best = [f64::MAX; 2];
            let mut ins = src.clone();
            for rep in 0..400 {
                let check = rep % 2 == 1;
                let srcs: Vec<*const u8> =
                    ins[..k].iter().map(|v| v.as_ptr() as *const u8).collect();
                let ptr = if in_place {
                    ins[0].as_mut_ptr() as *mut u8
                } else {
                    out.as_mut_ptr() as *mut u8
                };
                let t = std::time::Instant::now();
                // SAFETY: every buffer holds n elements; in place the destination is source 0.
                let f = unsafe {
                    reduce_checked(
                        check,
                        Dtype::F32,
                        op,
                        k,
                        &srcs,
                        &[Dst { ptr, nt: false }],
                        n,
                    )
                };
                let e = t.elapsed().as_secs_f64();
                assert!(f.is_none());
                best[check as usize] = best[check as usize].min(e);
            }
            println!(
                "{name}: off {:.1} us, on {:.1} us, on/off {:.3}",
                best[0] * 1e6,
                best[1] * 1e6,
                best[1] / best[0]
            );
        }
    }

    /// The registered path's kernel calls (`cargo test --release --lib -- --ignored
    /// registered_kernel_cost --nocapture`): 2 sources into 2 destinations, 32 KiB rounds over
    /// 128 Ki f32 (one rank's part of a 1 MiB all-reduce), in place (the destinations are the
    /// sources) and apart.
    #[test]
    #[ignore]
    fn registered_kernel_cost() {
        let n = 128 << 10;
        let sub = 8192;
        for (name, in_place, nt) in [
            ("in place", true, false),
            ("apart", false, false),
            ("in place nt", true, true),
            ("apart nt", false, true),
        ] {
            let mut bufs: Vec<Vec<f32>> = (0..4).map(|_| vec![0f32; n]).collect();
            let mut best = [f64::MAX; 2];
            for rep in 0..400 {
                let check = rep % 2 == 1;
                let t = std::time::Instant::now();
                let mut at = 0;
                while at < n {
                    let p: Vec<*mut f32> = bufs
                        .iter_mut()
                        // SAFETY: at < n, within every buffer of n elements.
                        .map(|b| unsafe { b.as_mut_ptr().add(at) })
                        .collect();
                    let srcs = [p[0] as *const u8, p[1] as *const u8];
                    let (d0, d1) = if in_place { (p[0], p[1]) } else { (p[2], p[3]) };
                    let dsts = [
                        Dst {
                            ptr: d0 as *mut u8,
                            nt,
                        },
                        Dst {
                            ptr: d1 as *mut u8,
                            nt,
                        },
                    ];
                    // SAFETY: every buffer holds n elements from at.
                    let f = unsafe {
                        reduce_checked(check, Dtype::F32, ReduceOp::Sum, 2, &srcs, &dsts, sub)
                    };
                    assert!(f.is_none());
                    at += sub;
                }
                let e = t.elapsed().as_secs_f64();
                best[check as usize] = best[check as usize].min(e);
            }
            println!(
                "registered {name}: off {:.1} us, on {:.1} us, on/off {:.3}",
                best[0] * 1e6,
                best[1] * 1e6,
                best[1] / best[0]
            );
        }
    }

    #[test]
    fn int_ops() {
        let a = vec![7i32, -3, 100];
        let b = vec![2i32, 5, -100];
        let mut d = vec![0; 3];
        reduce_slices(ReduceOp::Min, &[&a, &b], &mut d);
        assert_eq!(d, vec![2, -3, -100]);
        reduce_slices(ReduceOp::Max, &[&a, &b], &mut d);
        assert_eq!(d, vec![7, 5, 100]);
        reduce_slices(ReduceOp::Prod, &[&a, &b], &mut d);
        assert_eq!(d, vec![14, -15, -10000]);
        reduce_slices(ReduceOp::Avg, &[&a, &b], &mut d);
        assert_eq!(d, vec![4, 1, 0]);
        let x = vec![200u8];
        let mut y = vec![0u8];
        reduce_slices(ReduceOp::Sum, &[&x, &x], &mut y);
        assert_eq!(y, vec![144]);
    }

    #[test]
    fn int_avg_over_more_ranks_than_the_type_holds() {
        // 256 u8 ranks: the wrapping sums (1 + 255 * 2 = 511 -> 255, and 256 * 255 -> 0) over 256
        // are 0, not a division by `256 as u8` = 0 (a panic).
        let one = vec![1u8, 255];
        let two = [2u8, 255];
        let mut ins: Vec<&[u8]> = vec![&one];
        ins.extend(std::iter::repeat_n(&two[..], 255));
        let mut d = vec![9u8; 2];
        reduce_slices(ReduceOp::Avg, &ins, &mut d);
        assert_eq!(d, vec![0, 0]);
        // 130 i8 ranks of -1: the sum -130 wraps to 126; divided by 130 (not by `130 as i8` =
        // -126) it is 0.
        let m = [-1i8; 3];
        let ins: Vec<&[i8]> = vec![&m[..]; 130];
        let mut d = vec![9i8; 3];
        reduce_slices(ReduceOp::Avg, &ins, &mut d);
        assert_eq!(d, vec![0; 3]);
        // 100 i8 ranks of 1: a world size the type holds divides as before.
        let p = [1i8; 2];
        let ins: Vec<&[i8]> = vec![&p[..]; 100];
        let mut d = vec![9i8; 2];
        reduce_slices(ReduceOp::Avg, &ins, &mut d);
        assert_eq!(d, vec![1; 2]);
        for (dt, n) in [(1u64, 300usize), (7, 1000)] {
            let v = [dt; 4];
            let ins: Vec<&[u64]> = vec![&v[..]; n];
            let mut d = vec![0u64; 4];
            reduce_slices(ReduceOp::Avg, &ins, &mut d);
            assert_eq!(d, vec![dt; 4], "u64 avg over {n} ranks");
        }
        // The canonical reference agrees.
        let ins: Vec<&[u8]> = std::iter::once(&one[..])
            .chain(std::iter::repeat_n(&two[..], 255))
            .collect();
        assert_eq!(crate::reference::reduce(&ins, ReduceOp::Avg), vec![0u8, 0]);
    }
}
