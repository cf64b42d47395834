//! Dense matrix multiply for the CPU engine (`gemm/`: this entry, `micro.rs`, and `twin.rs`, the CPU
//! twin of the kernels' shared tiled core `kernels/common.cuh`): one bounds-checked, safe wrapper around the `gemm`
//! crate, so every layer calls GEMM through the same door.
//!
//! `gemm` picks AVX2/AVX-512 micro-kernels at run time, which is why the release profile can stay
//! generic x86-64. Its entry point is an `unsafe fn` over raw pointers and strides, called here
//! after every extent has been checked against the slice lengths, so callers cannot cause
//! out-of-bounds access. Small products with `B`'s rows contiguous go to
//! `micro` (this module's own AVX-512 kernels) instead, when the CPU has AVX-512 (same checks first).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

mod micro;
pub(crate) mod twin;

/// Threads GEMM may use in this process (1 = run on the calling thread, no pool).
///
/// A process-wide knob, like `torch.set_num_threads`: one rank is one process, and threading the
/// setting through every layer call would add noise to each signature for a value set once.
static GEMM_THREADS: AtomicUsize = AtomicUsize::new(1);

/// Set how many threads GEMM calls in this process may use (`--threads`); 0 is treated as 1.
pub fn set_threads(n: usize) {
    GEMM_THREADS.store(n.max(1), Ordering::Relaxed);
}

/// The current GEMM thread count.
pub fn threads() -> usize {
    GEMM_THREADS.load(Ordering::Relaxed)
}

fn parallelism() -> ::gemm::Parallelism {
    match threads() {
        0 | 1 => ::gemm::Parallelism::None,
        n => ::gemm::Parallelism::Rayon(n),
    }
}

/// Whether small products may take `micro`'s kernels (on by
/// default; the benchmarks turn it off to compare with the `gemm` crate in one process).
static SMALL_KERNELS: AtomicBool = AtomicBool::new(true);

/// Let small products take lockstep's own AVX-512 kernels (`true`, the default) or send every
/// product to the `gemm` crate (`false`). Both give the same results up to rounding; the switch
/// exists so that a benchmark can measure both paths back to back.
pub fn set_small_kernels(on: bool) {
    SMALL_KERNELS.store(on, Ordering::Relaxed);
}

/// Whether small products may take lockstep's own kernels (see [`set_small_kernels`]).
pub fn small_kernels() -> bool {
    SMALL_KERNELS.load(Ordering::Relaxed)
}

/// How an operand is stored in its slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trans {
    /// Stored as written in the product: `A` as `[m, k]`, `B` as `[k, n]` (row-major).
    No,
    /// Stored transposed: `A` as `[k, m]`, `B` as `[n, k]` (row-major).
    Yes,
}

/// `dst[m, n] (+)= A · B` with row-major operands: `(m, n, k)` the product's shape, `a` and `b`
/// each `(elements, how they are stored)`.
///
/// `accumulate` adds the product to `dst` (parameter gradients accumulate); otherwise `dst` is
/// overwritten (activations). Panics if a slice is shorter than its shape says: that is a bug in
/// the caller's shape math, never user input.
pub fn matmul(
    (m, n, k): (usize, usize, usize),
    dst: &mut [f32],
    (a, ta): (&[f32], Trans),
    (b, tb): (&[f32], Trans),
    accumulate: bool,
) {
    let lda = if ta == Trans::No { k } else { m };
    let ldb = if tb == Trans::No { n } else { k };
    matmul_ld((m, n, k), (dst, n), (a, lda, ta), (b, ldb, tb), accumulate)
}

/// [`matmul`] with explicit row strides (leading dimensions), `dst` given as `(slice, row
/// stride)` and each operand as `(slice, row stride, how it is stored)`: row `r` of a stored
/// matrix starts at `r * ld`, so a matrix can be every 64th block of a larger array (the Winograd
/// layout keeps a tile's 64 positions together).
pub fn matmul_ld(
    (m, n, k): (usize, usize, usize),
    (dst, ldd): (&mut [f32], usize),
    (a, lda, ta): (&[f32], usize, Trans),
    (b, ldb, tb): (&[f32], usize, Trans),
    accumulate: bool,
) {
    // Stored shapes (rows x cols) of the three matrices.
    let (ar, ac) = if ta == Trans::No { (m, k) } else { (k, m) };
    let (br, bc) = if tb == Trans::No { (k, n) } else { (n, k) };
    let extent = |rows: usize, cols: usize, ld: usize| {
        if rows == 0 || cols == 0 {
            0
        } else {
            (rows - 1) * ld + cols
        }
    };
    assert!(
        ldd >= n && lda >= ac && ldb >= bc,
        "matmul: a row stride is shorter than its row"
    );
    assert!(
        dst.len() >= extent(m, n, ldd),
        "matmul: dst has {} elements, needs {m}x{n} (stride {ldd})",
        dst.len()
    );
    assert!(
        a.len() >= extent(ar, ac, lda),
        "matmul: A has {} elements, needs {ar}x{ac} (stride {lda})",
        a.len()
    );
    assert!(
        b.len() >= extent(br, bc, ldb),
        "matmul: B has {} elements, needs {br}x{bc} (stride {ldb})",
        b.len()
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                dst[r * ldd..r * ldd + n].fill(0.0);
            }
        }
        return;
    }
    // The engine's small products (Winograd, conv1) skip the gemm crate's packing and planning.
    let small = small_kernels() && (threads() == 1 || m * n * k <= 1 << 18);
    if small && tb == Trans::No {
        let (rs, cs) = if ta == Trans::No { (lda, 1) } else { (1, lda) };
        if micro::gemm(m, n, k, (&mut *dst, ldd), (a, rs, cs), (b, ldb), accumulate) {
            return;
        }
    }
    if small
        && ta == Trans::No
        && tb == Trans::Yes
        && micro::gemm_nt(m, n, k, (&mut *dst, ldd), (a, lda), (b, ldb), accumulate)
    {
        return;
    }
    let (a_rs, a_cs) = match ta {
        Trans::No => (lda as isize, 1),
        Trans::Yes => (1, lda as isize),
    };
    let (b_rs, b_cs) = match tb {
        Trans::No => (ldb as isize, 1),
        Trans::Yes => (1, ldb as isize),
    };
    // SAFETY: dst element (i, j) is at i*ldd + j <= (m-1)*ldd + n-1 < extent(m, n, ldd); A element
    // (i, p) is at i*lda + p (stored [m, k]) or p*lda + i (stored [k, m]), below its extent in
    // both orders; B likewise. All extents were checked above, the slices do not alias (one is
    // &mut), and `gemm` only reads/writes those elements.
    unsafe {
        ::gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            ldd as isize,
            accumulate,
            a.as_ptr(),
            a_cs,
            a_rs,
            b.as_ptr(),
            b_cs,
            b_rs,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism(),
        )
    }
}

/// Naive reference for [`matmul`] (same arguments), used by tests to check the fast path.
pub fn matmul_cpu(
    (m, n, k): (usize, usize, usize),
    dst: &mut [f32],
    (a, ta): (&[f32], Trans),
    (b, tb): (&[f32], Trans),
    accumulate: bool,
) {
    for i in 0..m {
        for j in 0..n {
            let mut s = 0.0f64;
            for p in 0..k {
                let av = if ta == Trans::No {
                    a[i * k + p]
                } else {
                    a[p * m + i]
                };
                let bv = if tb == Trans::No {
                    b[p * n + j]
                } else {
                    b[j * k + p]
                };
                s += av as f64 * bv as f64;
            }
            let d = &mut dst[i * n + j];
            *d = if accumulate { *d + s as f32 } else { s as f32 };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both paths (lockstep's small-product kernels and the `gemm` crate) in every storage order,
    /// on shapes each kernel takes (`n` a multiple of 16 for `micro::gemm`, any for
    /// `gemm_nt`) and one neither takes fully (`n` = 7 without B transposed).
    #[test]
    fn matmul_matches_reference_in_all_storage_orders() {
        for small in [true, false] {
            // A process-wide switch: a test running beside this one may take either path, and
            // both are correct.
            set_small_kernels(small);
            for (m, n, k) in [(5, 7, 3), (7, 32, 19), (33, 48, 40)] {
                check_orders(m, n, k);
            }
        }
        set_small_kernels(true);
    }

    fn check_orders(m: usize, n: usize, k: usize) {
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
        let tol = 1e-5 * (k as f32).sqrt();
        for ta in [Trans::No, Trans::Yes] {
            for tb in [Trans::No, Trans::Yes] {
                for acc in [false, true] {
                    let mut d1 = vec![0.5f32; m * n];
                    let mut d2 = d1.clone();
                    matmul((m, n, k), &mut d1, (&a, ta), (&b, tb), acc);
                    matmul_cpu((m, n, k), &mut d2, (&a, ta), (&b, tb), acc);
                    for (x, y) in d1.iter().zip(&d2) {
                        assert!(
                            (x - y).abs() < tol,
                            "{m}x{n}x{k} {ta:?} {tb:?} {acc}: {x} vs {y}"
                        );
                    }
                    // Strided: every operand row padded by 2 elements (padding left untouched).
                    let pad = |v: &[f32], cols: usize| -> Vec<f32> {
                        v.chunks(cols)
                            .flat_map(|r| r.iter().copied().chain([7.0, 7.0]))
                            .collect()
                    };
                    let (ac, bc) = (
                        if ta == Trans::No { k } else { m },
                        if tb == Trans::No { n } else { k },
                    );
                    let (ap, bp) = (pad(&a, ac), pad(&b, bc));
                    let mut d3 = pad(&vec![0.5f32; m * n], n);
                    matmul_ld(
                        (m, n, k),
                        (&mut d3, n + 2),
                        (&ap, ac + 2, ta),
                        (&bp, bc + 2, tb),
                        acc,
                    );
                    for (i, y) in d2.iter().enumerate() {
                        let x = d3[(i / n) * (n + 2) + i % n];
                        assert!(
                            (x - y).abs() < tol,
                            "strided {m}x{n}x{k} {ta:?} {tb:?} {acc}: {x} vs {y}"
                        );
                    }
                    assert!(d3.chunks(n + 2).all(|r| r[n] == 7.0 && r[n + 1] == 7.0));
                }
            }
        }
    }
}
