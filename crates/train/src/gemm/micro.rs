//! A register-blocked AVX-512 kernel for the engine's small products, `C (+)= A · B` with `B`'s
//! rows contiguous and `n` a multiple of 16: the Winograd GEMMs of conv2 (thousands of 32 x 64 x
//! 32 products per step) and conv1's per-sample product (32 x 784 x 25).
//!
//! Why not the `gemm` crate for these: its micro-kernels are as fast, but each call packs both
//! operands and plans its blocking, which at these sizes costs about as much as the arithmetic
//! (the profile showed 5 % of a step in that setup beside 33 % in the micro-kernels). Here `B` is
//! read in place (a `k x 64` panel stays in L1 across the row blocks) and `A` is broadcast from
//! wherever it lies, so a product costs its FMAs and little else.
//!
//! Each register block is `R` rows of `C` by `NV` 16-float vectors (24 accumulators, `NV` vectors
//! of `B`'s row and one broadcast: 29 of the 32 registers at most). The `k` sum runs in order, one
//! FMA per term, so the result is the same on every run and rank; it differs from the `gemm`
//! crate's (which sums in another order) only by rounding.
//!
//! Used when the CPU has AVX-512F; [`gemm`] returns false otherwise, and the caller takes the
//! general path.

/// Largest `k` taken here: a `k x 64` panel of `B` (64 KB at 256) then stays in L1/L2 while every
/// row block of `A` passes over it; longer sums go to the `gemm` crate, which blocks `k`.
const MAX_K: usize = 256;

/// `dst[i * ldd + j] (+)= Σ_p a[i * a_rs + p * a_cs] · b[p * ldb + j]` for `i < m`, `j < n`,
/// `p < k` (`accumulate` adds to `dst`, else overwrites it). Returns false, touching nothing,
/// when this kernel does not apply (no AVX-512F, `n` not a multiple of 16, `k` over [`MAX_K`]).
///
/// Panics if a slice is shorter than its shape and strides say.
pub(crate) fn gemm(
    m: usize,
    n: usize,
    k: usize,
    (dst, ldd): (&mut [f32], usize),
    (a, a_rs, a_cs): (&[f32], usize, usize),
    (b, ldb): (&[f32], usize),
    accumulate: bool,
) -> bool {
    if !n.is_multiple_of(16) || k > MAX_K || !has_avx512() {
        return false;
    }
    if m == 0 || n == 0 {
        return true;
    }
    assert!(
        ldd >= n && ldb >= n,
        "microgemm: a row stride is shorter than its row"
    );
    assert!(
        dst.len() > (m - 1) * ldd + n - 1,
        "microgemm: dst too short"
    );
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                dst[i * ldd..i * ldd + n].fill(0.0);
            }
        }
        return true;
    }
    assert!(
        a.len() > (m - 1) * a_rs + (k - 1) * a_cs,
        "microgemm: A too short"
    );
    assert!(b.len() > (k - 1) * ldb + n - 1, "microgemm: B too short");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the CPU has AVX-512F (has_avx512 above). Every element the kernel touches is
    // dst[i * ldd + j], a[i * a_rs + p * a_cs] or b[p * ldb + j] for i < m, j < n, p < k, and the
    // largest of each was checked against its slice's length above; dst is a distinct &mut slice.
    unsafe {
        x86::run(
            m,
            n,
            k,
            x86::Operands {
                d: dst.as_mut_ptr(),
                ldd,
                a: a.as_ptr(),
                a_rs,
                a_cs,
                b: b.as_ptr(),
                ldb,
                acc: accumulate,
            },
        )
    };
    true
}

/// Largest `k` of [`gemm_nt`]: the `R + S` rows of a register block (10 x 4 KB at 1024) stay in
/// L1 over the sum; longer sums go to the `gemm` crate.
const MAX_K_NT: usize = 1024;

/// `dst[i * ldd + j] (+)= Σ_p a[i * lda + p] · b[j * ldb + p]` (`A · Bᵀ` with both operands'
/// rows contiguous in `p`: conv1's weight gradient, `col · dYᵀ` with `k` = 784 pixels). Each
/// register block keeps 4 x 4 sums as 16-lane partial sums over `p` and adds their lanes at the
/// end (a fixed order, so the same bits on every run). Returns false, touching nothing, when it
/// does not apply (no AVX-512F, `k` over [`MAX_K_NT`]).
///
/// Panics if a slice is shorter than its shape and strides say.
pub(crate) fn gemm_nt(
    m: usize,
    n: usize,
    k: usize,
    (dst, ldd): (&mut [f32], usize),
    (a, lda): (&[f32], usize),
    (b, ldb): (&[f32], usize),
    accumulate: bool,
) -> bool {
    if k > MAX_K_NT || k == 0 || !has_avx512() {
        return false;
    }
    if m == 0 || n == 0 {
        return true;
    }
    assert!(
        ldd >= n && lda >= k && ldb >= k,
        "microgemm: a row stride is shorter than its row"
    );
    assert!(
        dst.len() > (m - 1) * ldd + n - 1,
        "microgemm: dst too short"
    );
    assert!(a.len() > (m - 1) * lda + k - 1, "microgemm: A too short");
    assert!(b.len() > (n - 1) * ldb + k - 1, "microgemm: B too short");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the CPU has AVX-512F (has_avx512 above). The kernel reads a[i * lda + p] and
    // b[j * ldb + p] for i < m, j < n, p < k (the last partial vector of a row through a masked
    // load, which touches no element past p = k - 1) and writes dst[i * ldd + j]; the largest of
    // each was checked against its slice's length above.
    unsafe {
        x86::run_nt(
            m,
            n,
            k,
            x86::Operands {
                d: dst.as_mut_ptr(),
                ldd,
                a: a.as_ptr(),
                a_rs: lda,
                a_cs: 1,
                b: b.as_ptr(),
                ldb,
                acc: accumulate,
            },
        )
    };
    true
}

fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Where a block of the product lies: `C` at `d` (rows `ldd` apart), `A` at `a` (rows `a_rs`
    /// and columns `a_cs` apart), `B` at `b` (rows `ldb` apart; for [`run_nt`], `Bᵀ` stored as
    /// rows `ldb` apart), and whether the product adds to `C`. Each step of the blocking moves
    /// the pointers to its sub-block and passes the rest on unchanged.
    #[derive(Clone, Copy)]
    pub(super) struct Operands {
        pub(super) d: *mut f32,
        pub(super) ldd: usize,
        pub(super) a: *const f32,
        pub(super) a_rs: usize,
        pub(super) a_cs: usize,
        pub(super) b: *const f32,
        pub(super) ldb: usize,
        pub(super) acc: bool,
    }

    impl Operands {
        /// The block from row `i` of `C` and `A` on.
        ///
        /// # Safety
        /// Row `i` is inside the caller's bounds (the pointer offsets stay in their slices).
        #[inline(always)]
        unsafe fn rows_from(self, i: usize) -> Operands {
            // SAFETY: the caller's contract.
            unsafe {
                Operands {
                    d: self.d.add(i * self.ldd),
                    a: self.a.add(i * self.a_rs),
                    ..self
                }
            }
        }
        /// The block from column `j` of `C` on, with `B` from its column `j`: `b_step` is 1 for
        /// `B` stored `k x n`, `ldb` for [`run_nt`]'s `Bᵀ` stored `n x k` (row `j`).
        ///
        /// # Safety
        /// Column `j` is inside the caller's bounds.
        #[inline(always)]
        unsafe fn cols_from(self, j: usize, b_step: usize) -> Operands {
            // SAFETY: the caller's contract.
            unsafe {
                Operands {
                    d: self.d.add(j),
                    b: self.b.add(j * b_step),
                    ..self
                }
            }
        }
    }

    /// All of `C`, in column panels of up to 64 floats (outer, so the panel of `B` is reused by
    /// every row block) and row blocks of `R` (inner).
    ///
    /// # Safety
    /// AVX-512F must be available, and every element named in [`super::gemm`]'s contract must be
    /// in bounds (with `n` a multiple of 16 and `m, k >= 1`).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn run(m: usize, n: usize, k: usize, o: Operands) {
        let mut j0 = 0;
        while j0 < n {
            let w = (n - j0).min(64);
            // SAFETY: columns j0..j0 + w of the caller's bounds (the panel's pointers are offset
            // by j0 only along rows that stay in bounds).
            unsafe {
                let p = o.cols_from(j0, 1);
                match w / 16 {
                    4 => rows::<4, 6>(m, k, p),
                    3 => rows::<3, 8>(m, k, p),
                    2 => rows::<2, 12>(m, k, p),
                    _ => rows::<1, 12>(m, k, p),
                }
            }
            j0 += w;
        }
    }

    /// Rows of one column panel `NV * 16` wide: blocks of `R`, then of 4, 2 and 1 for the rest.
    ///
    /// # Safety
    /// As [`run`], for this panel.
    #[target_feature(enable = "avx512f")]
    unsafe fn rows<const NV: usize, const R: usize>(m: usize, k: usize, o: Operands) {
        let mut i = 0;
        // SAFETY: each step's blocks are rows i..i + its height with the end <= m, inside the
        // caller's bounds.
        unsafe {
            row_blocks::<NV, R>(m, k, o, &mut i);
            row_blocks::<NV, 4>(m, k, o, &mut i);
            row_blocks::<NV, 2>(m, k, o, &mut i);
            row_blocks::<NV, 1>(m, k, o, &mut i);
        }
    }

    /// Blocks of `R` rows of the panel from row `*i` while `R` rows remain; `*i` moves past them.
    ///
    /// # Safety
    /// As [`run`], for this panel.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn row_blocks<const NV: usize, const R: usize>(
        m: usize,
        k: usize,
        o: Operands,
        i: &mut usize,
    ) {
        while *i + R <= m {
            // SAFETY: rows i..i + R with i + R <= m, inside the caller's bounds.
            unsafe { block::<NV, R>(k, o.rows_from(*i)) };
            *i += R;
        }
    }

    /// One `R x (16 NV)` block of `C`, held in registers over the whole `k` sum. (Loops over the
    /// const bounds rather than `array::from_fn`: a closure is not compiled with AVX-512, so each
    /// step would become a call.)
    ///
    /// # Safety
    /// AVX-512F; rows `0..R` of the block, columns `0..16 NV`, and `p < k` in bounds.
    #[target_feature(enable = "avx512f")]
    #[inline]
    #[allow(clippy::needless_range_loop)]
    unsafe fn block<const NV: usize, const R: usize>(k: usize, o: Operands) {
        let Operands {
            d,
            ldd,
            a,
            a_rs,
            a_cs,
            b,
            ldb,
            acc,
        } = o;
        let mut c = [[_mm512_setzero_ps(); NV]; R];
        if acc {
            for r in 0..R {
                for v in 0..NV {
                    // SAFETY: row r < R, columns 16 v .. 16 v + 16 <= 16 NV of the block.
                    c[r][v] = unsafe { _mm512_loadu_ps(d.add(r * ldd + 16 * v)) };
                }
            }
        }
        for p in 0..k {
            let mut bv = [_mm512_setzero_ps(); NV];
            for v in 0..NV {
                // SAFETY: row p < k of B, columns inside the panel.
                bv[v] = unsafe { _mm512_loadu_ps(b.add(p * ldb + 16 * v)) };
            }
            for r in 0..R {
                // SAFETY: A element (r, p) of the block.
                let av = _mm512_set1_ps(unsafe { *a.add(r * a_rs + p * a_cs) });
                for v in 0..NV {
                    c[r][v] = _mm512_fmadd_ps(av, bv[v], c[r][v]);
                }
            }
        }
        for r in 0..R {
            for v in 0..NV {
                // SAFETY: as for the loads of `dst` above.
                unsafe { _mm512_storeu_ps(d.add(r * ldd + 16 * v), c[r][v]) };
            }
        }
    }

    /// [`super::gemm_nt`]: row blocks of 4 (then 2, 1) of `A` (`a_rs` = its row stride, `a_cs`
    /// unused: rows are contiguous), each against column blocks of 4 (then 2, 1) rows of `B`.
    ///
    /// # Safety
    /// AVX-512F must be available, and every element named in [`super::gemm_nt`]'s contract must
    /// be in bounds (with `m, n, k >= 1`).
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn run_nt(m: usize, n: usize, k: usize, o: Operands) {
        let mut i = 0;
        // SAFETY: each step's blocks are rows i..i + its height with the end <= m, inside the
        // caller's bounds.
        unsafe {
            row_blocks_nt::<4>(m, n, k, o, &mut i);
            row_blocks_nt::<2>(m, n, k, o, &mut i);
            row_blocks_nt::<1>(m, n, k, o, &mut i);
        }
    }

    /// Blocks of `R` rows of `A` from row `*i` while `R` rows remain, each against all of `B`.
    ///
    /// # Safety
    /// As [`run_nt`].
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn row_blocks_nt<const R: usize>(
        m: usize,
        n: usize,
        k: usize,
        o: Operands,
        i: &mut usize,
    ) {
        while *i + R <= m {
            // SAFETY: rows i..i + R with i + R <= m, inside the caller's bounds.
            unsafe { cols_nt::<R>(n, k, o.rows_from(*i)) };
            *i += R;
        }
    }

    /// `R` rows of `A` against all of `B`, 4 rows of `B` at a time (then 2, 1).
    ///
    /// # Safety
    /// As [`run_nt`], for these rows.
    #[target_feature(enable = "avx512f")]
    unsafe fn cols_nt<const R: usize>(n: usize, k: usize, o: Operands) {
        let mut j = 0;
        // SAFETY: each step's blocks are rows j..j + its width of B with the end <= n, and those
        // columns of dst.
        unsafe {
            col_blocks_nt::<R, 4>(n, k, o, &mut j);
            col_blocks_nt::<R, 2>(n, k, o, &mut j);
            col_blocks_nt::<R, 1>(n, k, o, &mut j);
        }
    }

    /// Blocks of `S` rows of `B` from row `*j` while `S` rows remain; `*j` moves past them.
    ///
    /// # Safety
    /// As [`run_nt`], for these rows of `A`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn col_blocks_nt<const R: usize, const S: usize>(
        n: usize,
        k: usize,
        o: Operands,
        j: &mut usize,
    ) {
        while *j + S <= n {
            // SAFETY: rows j..j + S of B with j + S <= n, and columns j..j + S of dst.
            unsafe { block_nt::<R, S>(k, o.cols_from(*j, o.ldb)) };
            *j += S;
        }
    }

    /// `R x S` dot products of length `k`, as `R x S` vectors of 16-lane partial sums.
    ///
    /// # Safety
    /// AVX-512F; rows `0..R` of `A`, `0..S` of `B` (each `k` long) and the `R x S` block of `dst`
    /// in bounds.
    #[target_feature(enable = "avx512f")]
    #[inline]
    #[allow(clippy::needless_range_loop)]
    unsafe fn block_nt<const R: usize, const S: usize>(k: usize, o: Operands) {
        let Operands {
            d,
            ldd,
            a,
            a_rs: lda,
            b,
            ldb,
            acc,
            ..
        } = o;
        let mut c = [[_mm512_setzero_ps(); S]; R];
        let mut p = 0;
        while p < k {
            // The last vector of a row is partial when 16 does not divide k: masked loads read
            // only elements p..k (and fault on none past them), the rest of the lanes are zero.
            let mask: __mmask16 = if k - p >= 16 {
                0xffff
            } else {
                (1u16 << (k - p)) - 1
            };
            let mut bv = [_mm512_setzero_ps(); S];
            for s in 0..S {
                // SAFETY: row s of B, elements p..min(p + 16, k), by the mask.
                bv[s] = unsafe { _mm512_maskz_loadu_ps(mask, b.add(s * ldb + p)) };
            }
            for r in 0..R {
                // SAFETY: row r of A, elements p..min(p + 16, k), by the mask.
                let av = unsafe { _mm512_maskz_loadu_ps(mask, a.add(r * lda + p)) };
                for s in 0..S {
                    c[r][s] = _mm512_fmadd_ps(av, bv[s], c[r][s]);
                }
            }
            p += 16;
        }
        for r in 0..R {
            for s in 0..S {
                let sum = _mm512_reduce_add_ps(c[r][s]);
                // SAFETY: element (r, s) of the block.
                unsafe {
                    let o = d.add(r * ldd + s);
                    *o = if acc { *o + sum } else { sum };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `C (+)= A · B` in f64, with the kernel's strides (arguments as [`gemm`]'s, and `B`'s
    /// column stride: 1 for [`gemm`], `ldb` with the row stride 1 for [`gemm_nt`]'s `Bᵀ`).
    fn reference(
        (m, n, k): (usize, usize, usize),
        (d, ldd): (&mut [f32], usize),
        (a, a_rs, a_cs): (&[f32], usize, usize),
        (b, b_rs, b_cs): (&[f32], usize, usize),
        acc: bool,
    ) {
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k)
                    .map(|p| a[i * a_rs + p * a_cs] as f64 * b[p * b_rs + j * b_cs] as f64)
                    .sum();
                let o = &mut d[i * ldd + j];
                *o = if acc {
                    (*o as f64 + s) as f32
                } else {
                    s as f32
                };
            }
        }
    }

    /// `got` within 1e-5·√k (relative) of `want` on the `m x n` block, and every element past a
    /// row's `n` (up to the stride `ldd`) untouched from `start`.
    fn assert_close(
        (m, n, k): (usize, usize, usize),
        ldd: usize,
        (got, want, start): (&[f32], &[f32], &[f32]),
        what: &str,
    ) {
        for i in 0..m {
            for j in 0..ldd {
                let (g, w) = (got[i * ldd + j], want[i * ldd + j]);
                if j >= n {
                    assert_eq!(
                        g.to_bits(),
                        start[i * ldd + j].to_bits(),
                        "{what}: wrote past the row at ({i}, {j})"
                    );
                } else {
                    let tol = 1e-5 * (k as f32).sqrt() * (1.0 + w.abs());
                    assert!(
                        (g - w).abs() <= tol,
                        "m {m} n {n} k {k} {what}: ({i}, {j}) {g} vs {w}"
                    );
                }
            }
        }
    }

    fn fill(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i * 7919 + seed * 104729) % 2003) as f32 / 1001.0) - 1.0)
            .collect()
    }

    #[test]
    fn matches_reference_over_shapes_strides_and_layouts() {
        if !has_avx512() {
            println!(
                "skipped: this CPU has no AVX-512F (the kernel declines and the gemm crate runs)"
            );
            assert!(!gemm(
                1,
                16,
                1,
                (&mut [0.0; 16], 16),
                (&[0.0], 1, 1),
                (&[0.0; 16], 16),
                false
            ));
            return;
        }
        let mut checked = 0;
        for &m in &[1, 2, 3, 5, 6, 7, 11, 12, 13, 25, 32, 33] {
            for &n in &[16, 32, 48, 64, 80, 784] {
                for &k in &[1, 2, 25, 32, 64] {
                    for &(transposed, acc) in
                        &[(false, false), (true, false), (false, true), (true, true)]
                    {
                        // Padded strides, as the Winograd layout has; A stored [m, k] or [k, m].
                        let (ldd, ldb) = (n + 16, n + 3);
                        let (a_rs, a_cs, alen) = if transposed {
                            (1, m + 5, k * (m + 5))
                        } else {
                            (k + 7, 1, m * (k + 7))
                        };
                        let a = fill(alen, m + k);
                        let b = fill(k * ldb, n);
                        let start = fill(m * ldd, 3);
                        let (mut got, mut want) = (start.clone(), start.clone());
                        assert!(gemm(
                            m,
                            n,
                            k,
                            (&mut got, ldd),
                            (&a, a_rs, a_cs),
                            (&b, ldb),
                            acc
                        ));
                        reference(
                            (m, n, k),
                            (&mut want, ldd),
                            (&a, a_rs, a_cs),
                            (&b, ldb, 1),
                            acc,
                        );
                        assert_close(
                            (m, n, k),
                            ldd,
                            (&got, &want, &start),
                            &format!("t {transposed} acc {acc}"),
                        );
                        checked += 1;
                    }
                }
            }
        }
        assert_eq!(checked, 12 * 6 * 5 * 4);
    }

    #[test]
    fn declines_what_it_does_not_cover() {
        let mut d = [0.0f32; 64];
        assert!(
            !gemm(1, 8, 1, (&mut d, 8), (&[1.0], 1, 1), (&[1.0; 8], 8), false),
            "n not a multiple of 16"
        );
        let a = vec![0.0f32; MAX_K + 1];
        let b = vec![0.0f32; (MAX_K + 1) * 16];
        assert!(
            !gemm(1, 16, MAX_K + 1, (&mut d, 16), (&a, 1, 1), (&b, 16), false),
            "k over MAX_K"
        );
        assert_eq!(d, [0.0; 64], "a declined call touched dst");
    }

    #[test]
    fn same_bits_every_call() {
        if !has_avx512() {
            println!("skipped: this CPU has no AVX-512F");
            return;
        }
        let (m, n, k) = (32, 64, 32);
        let (a, b) = (fill(m * k, 1), fill(k * n, 2));
        let mut first = vec![0.0f32; m * n];
        assert!(gemm(m, n, k, (&mut first, n), (&a, k, 1), (&b, n), false));
        for _ in 0..3 {
            let mut again = vec![1.0f32; m * n];
            assert!(gemm(m, n, k, (&mut again, n), (&a, k, 1), (&b, n), false));
            assert!(first
                .iter()
                .zip(&again)
                .all(|(x, y)| x.to_bits() == y.to_bits()));
        }
    }
    #[test]
    fn nt_matches_reference_over_shapes() {
        if !has_avx512() {
            println!(
                "skipped: this CPU has no AVX-512F (the kernel declines and the gemm crate runs)"
            );
            assert!(!gemm_nt(
                1,
                1,
                1,
                (&mut [0.0], 1),
                (&[0.0], 1),
                (&[0.0], 1),
                false
            ));
            return;
        }
        let mut checked = 0;
        for &m in &[1, 2, 3, 6, 7, 25, 32] {
            for &n in &[1, 2, 3, 4, 5, 9, 32] {
                for &k in &[1, 15, 16, 17, 100, 784, MAX_K_NT] {
                    for acc in [false, true] {
                        let (ldd, lda, ldb) = (n + 3, k + 5, k + 1);
                        let a = fill(m * lda, k);
                        let b = fill(n * ldb, m + 1);
                        let start = fill(m * ldd, 5);
                        let (mut got, mut want) = (start.clone(), start.clone());
                        assert!(gemm_nt(m, n, k, (&mut got, ldd), (&a, lda), (&b, ldb), acc));
                        // A · Bᵀ is A · B with B stored transposed: rows 1 and columns ldb
                        // apart.
                        let bt = (&b[..], 1, ldb);
                        reference((m, n, k), (&mut want, ldd), (&a, lda, 1), bt, acc);
                        assert_close(
                            (m, n, k),
                            ldd,
                            (&got, &want, &start),
                            &format!("nt acc {acc}"),
                        );
                        checked += 1;
                    }
                }
            }
        }
        assert_eq!(checked, 7 * 7 * 7 * 2);
        assert!(!gemm_nt(
            1,
            1,
            MAX_K_NT + 1,
            (&mut [0.0], 1),
            (&vec![0.0; MAX_K_NT + 1], MAX_K_NT + 1),
            (&vec![0.0; MAX_K_NT + 1], MAX_K_NT + 1),
            false
        ));
    }
}
