//! Dense matrix multiply for the CPU engine: one bounds-checked, safe wrapper around the `gemm`
//! crate, so every layer calls GEMM through the same door.
//!
//! `gemm` picks AVX2/AVX-512 micro-kernels at run time, which is why the release profile can stay
//! generic x86-64. Its entry point is an `unsafe fn` over raw pointers and strides; the single
//! `unsafe` block of the training engine lives here, after every extent has been checked against
//! the slice lengths, so callers cannot cause out-of-bounds access.

use std::sync::atomic::{AtomicUsize, Ordering};

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

fn parallelism() -> gemm::Parallelism {
    match threads() {
        0 | 1 => gemm::Parallelism::None,
        n => gemm::Parallelism::Rayon(n),
    }
}

/// How an operand is stored in its slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trans {
    /// Stored as written in the product: `A` as `[m, k]`, `B` as `[k, n]` (row-major).
    No,
    /// Stored transposed: `A` as `[k, m]`, `B` as `[n, k]` (row-major).
    Yes,
}

/// `dst[m, n] (+)= A · B` with row-major operands.
///
/// `accumulate` adds the product to `dst` (parameter gradients accumulate); otherwise `dst` is
/// overwritten (activations). Panics if a slice is shorter than its shape says: that is a bug in
/// the caller's shape math, never user input.
#[allow(clippy::too_many_arguments)]
pub fn matmul(m: usize, n: usize, k: usize, dst: &mut [f32], a: &[f32], ta: Trans, b: &[f32], tb: Trans, accumulate: bool) {
    assert!(dst.len() >= m * n, "matmul: dst has {} elements, needs {m}x{n}", dst.len());
    assert!(a.len() >= m * k, "matmul: A has {} elements, needs {m}x{k}", a.len());
    assert!(b.len() >= k * n, "matmul: B has {} elements, needs {k}x{n}", b.len());
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst[..m * n].fill(0.0);
        }
        return;
    }
    let (a_rs, a_cs) = match ta {
        Trans::No => (k as isize, 1),
        Trans::Yes => (1, m as isize),
    };
    let (b_rs, b_cs) = match tb {
        Trans::No => (n as isize, 1),
        Trans::Yes => (1, k as isize),
    };
    // SAFETY: dst covers m*n row-major elements (dst_rs = n, dst_cs = 1); A covers m*k elements
    // addressed as i*a_rs + p*a_cs < m*k for i < m, p < k in both storage orders; B likewise covers
    // k*n. All three were checked above, the slices do not alias (one is &mut), and `gemm` only
    // reads/writes inside those extents.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
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

/// Naive reference for [`matmul`], used by tests to check the fast path.
#[allow(clippy::too_many_arguments)]
pub fn matmul_cpu(m: usize, n: usize, k: usize, dst: &mut [f32], a: &[f32], ta: Trans, b: &[f32], tb: Trans, accumulate: bool) {
    for i in 0..m {
        for j in 0..n {
            let mut s = 0.0f64;
            for p in 0..k {
                let av = if ta == Trans::No { a[i * k + p] } else { a[p * m + i] };
                let bv = if tb == Trans::No { b[p * n + j] } else { b[j * k + p] };
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

    #[test]
    fn matmul_matches_reference_in_all_storage_orders() {
        let (m, n, k) = (5, 7, 3);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
        for ta in [Trans::No, Trans::Yes] {
            for tb in [Trans::No, Trans::Yes] {
                for acc in [false, true] {
                    let mut d1 = vec![0.5f32; m * n];
                    let mut d2 = d1.clone();
                    matmul(m, n, k, &mut d1, &a, ta, &b, tb, acc);
                    matmul_cpu(m, n, k, &mut d2, &a, ta, &b, tb, acc);
                    for (x, y) in d1.iter().zip(&d2) {
                        assert!((x - y).abs() < 1e-5, "{ta:?} {tb:?} {acc}: {x} vs {y}");
                    }
                }
            }
        }
    }
}
