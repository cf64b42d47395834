//! Winograd F(2x2, 5x5) convolution for stride-1, padding-2 ("same") 5x5 layers: the big layer
//! of the recipe (conv2, 32 -> 64 channels on 14x14) spends 36 multiplies per 2x2 output tile
//! and channel pair instead of 100, 2.8x fewer FLOPs than im2col + GEMM.
//!
//! With `d` a 6x6 input tile, `g` a 5x5 kernel and `Y` the 2x2 output tile:
//! `Y = A^T [ (G g G^T) ⊙ (B^T d B) ] A`. Per transformed position `ξ` (36 of them) the channel
//! sum is one GEMM over all tiles of a chunk: `M_ξ[T, OC] = V_ξ[T, C] · U_ξ[C, OC]`. `V` and `M`
//! are stored tile-major (`[T, 36, C]`): a tile's transform writes or reads one contiguous block
//! instead of 36 rows 25 KB apart, and each GEMM takes every 36th row block by its row stride.
//! - forward:         `V = B^T d B` per tile, `U = G g G^T`, GEMMs, `Y = A^T M A + bias`
//! - backward input:  the forward of `dout` with the kernels flipped and in/out swapped
//! - backward weight: `dM = A dY A^T` per tile, `dU_ξ[C, OC] += V_ξ^T · dM_ξ`, `dW += G^T dU G`
//!   (`V` is recomputed chunk by chunk rather than kept from forward: keeping the 14 MB of a
//!   64-image batch measured 4 % slower per step with two ranks sharing the memory bus)
//!
//! The matrices come from Toom-Cook with points 0, ±1, ±2, ∞ (`A^T`, `G` in closed form, `B^T`
//! solved from the defining identity in f64), so no constant is typed by hand; the tests check the
//! identity and compare against direct convolution (fp32 error ~1e-6 relative to the output
//! scale: the largest transform entries are small for these points).
//!
//! The transforms are short multiply-add loops over the channel dimension (kept innermost so they
//! vectorise). The release build targets generic x86-64, so they are compiled a second time with
//! AVX-512 / AVX2 enabled and picked at run time; the portable version stays as the fallback.

use crate::train::kernels::{matmul_ld, Trans};

/// Transformed tile edge (`m + r - 1` for `m = 2` outputs and `r = 5` taps).
const TT: usize = 6;
/// Transformed positions per tile.
const NN: usize = TT * TT;
/// Kernel edge.
const KS: usize = 5;
/// Output tile edge.
const MO: usize = 2;
/// Samples per batch of GEMMs: 4 x 49 tiles keep `V` (0.9 MB) and `M` (1.8 MB) of a chunk
/// in L2/L3 while each of the 36 GEMMs still has 196 rows (measured on conv2 at batch 64,
/// forward + backward: 1 sample 26.0 ms, 2: 25.0, 4: 24.4, 8: 25.2, 16: 28.3).
const CHUNK: usize = 4;

#[cfg(test)]
/// The three transform matrices of F(2x2, 5x5).
#[derive(Clone, Debug)]
pub struct Transforms {
    /// Input transform `B^T` (6x6).
    pub bt: [[f32; TT]; TT],
    /// Kernel transform `G` (6x5).
    pub g: [[f32; KS]; TT],
    /// Output transform `A^T` (2x6).
    pub at: [[f32; TT]; MO],
}

#[cfg(test)]
/// The matrices, built once.
pub fn transforms() -> &'static Transforms {
    static T: std::sync::OnceLock<Transforms> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        let (at, g, bt) = toom_cook();
        Transforms { bt: bt.map(|r| r.map(|x| x as f32)), g: g.map(|r| r.map(|x| x as f32)), at: at.map(|r| r.map(|x| x as f32)) }
    })
}

#[cfg(test)]
type Mats = ([[f64; TT]; MO], [[f64; KS]; TT], [[f64; TT]; TT]);

#[cfg(test)]
/// `A^T`, `G`, `B^T` in f64 for points 0, 1, -1, 2, -2 and ∞.
///
/// `A^T[i][j] = a_j^i`, `G[j][k] = a_j^k / Π_{l≠j}(a_j - a_l)` (∞: the last row/column picks
/// the leading coefficient), and `B^T` solves `Σ_j A^T[i][j] G[j][k] B^T[j][l] = [l == i + k]`
/// (1-D correlation `y_i = Σ_k g_k d_{i+k}`), column by column by least squares (10 equations,
/// 6 unknowns, consistent; the tests check the residual).
#[allow(clippy::needless_range_loop)] // index arithmetic reads clearer as in the formulas
pub fn toom_cook() -> Mats {
    let pts = [0.0f64, 1.0, -1.0, 2.0, -2.0];
    let mut at = [[0.0; TT]; MO];
    let mut g = [[0.0; KS]; TT];
    for (i, row) in at.iter_mut().enumerate() {
        for j in 0..5 {
            row[j] = pts[j].powi(i as i32);
        }
        row[5] = if i == MO - 1 { 1.0 } else { 0.0 };
    }
    for j in 0..5 {
        let f: f64 = (0..5).filter(|&l| l != j).map(|l| pts[j] - pts[l]).product();
        for k in 0..KS {
            g[j][k] = pts[j].powi(k as i32) / f;
        }
    }
    g[5][KS - 1] = 1.0;
    let mut bt = [[0.0; TT]; TT];
    for l in 0..TT {
        let (mut ata, mut atb) = ([[0.0f64; TT]; TT], [0.0f64; TT]);
        for i in 0..MO {
            for k in 0..KS {
                let row: [f64; TT] = std::array::from_fn(|j| at[i][j] * g[j][k]);
                let rhs = if i + k == l { 1.0 } else { 0.0 };
                for p in 0..TT {
                    atb[p] += row[p] * rhs;
                    for q in 0..TT {
                        ata[p][q] += row[p] * row[q];
                    }
                }
            }
        }
        let x = solve(ata, atb);
        for j in 0..TT {
            bt[j][l] = x[j];
        }
    }
    (at, g, bt)
}

#[cfg(test)]
/// Gaussian elimination with partial pivoting for the 6x6 normal equations.
#[allow(clippy::needless_range_loop)] // index arithmetic reads clearer as in the formulas
fn solve(mut a: [[f64; TT]; TT], mut b: [f64; TT]) -> [f64; TT] {
    for col in 0..TT {
        let piv = (col..TT).max_by(|&x, &y| a[x][col].abs().total_cmp(&a[y][col].abs())).unwrap_or(col);
        a.swap(col, piv);
        b.swap(col, piv);
        for r in col + 1..TT {
            let f = a[r][col] / a[col][col];
            for c in col..TT {
                a[r][c] -= f * a[col][c];
            }
            b[r] -= f * b[col];
        }
    }
    let mut x = [0.0; TT];
    for r in (0..TT).rev() {
        let s: f64 = (r + 1..TT).map(|c| a[r][c] * x[c]).sum();
        x[r] = (b[r] - s) / a[r][r];
    }
    x
}

/// Whether a convolution can take the Winograd path: 5x5, stride 1, padding 2 (output = input
/// size), and enough input channels for the per-position GEMMs to pay (the 1-channel first layer
/// stays on im2col).
pub fn applies(in_c: usize, kh: usize, kw: usize, stride: usize, pad: usize) -> bool {
    kh == KS && kw == KS && stride == 1 && pad == 2 && in_c >= 8
}

/// Scratch and kept state of one Winograd convolution direction.
#[derive(Clone, Debug, Default)]
pub struct Winograd {
    u: Vec<f32>,     // (36, C, OC) transformed kernels
    xp: Vec<f32>,    // (Hp, Wp, C) zero-padded input sample, channels innermost
    v: Vec<f32>,     // (T, 36, C) transformed input tiles of one chunk
    m: Vec<f32>,     // (T, 36, OC) GEMM output (forward) / transformed dout (weight gradient)
    stage: Vec<f32>, // (2th, 2tw, OC) one sample's output / dout, channels innermost
    cols: Vec<f32>,  // (Wp, 6, 16) column transforms of one tile row (input transform scratch)
    du: Vec<f32>,    // (36, C, OC) weight-gradient accumulator
}

/// Tiles per sample (`th`, `tw`) for an `h x w` output.
fn tiles(h: usize, w: usize) -> (usize, usize) {
    (h.div_ceil(MO), w.div_ceil(MO))
}

impl Winograd {
    /// `out[N, OC, H, W] = conv(inp[N, C, H, W], weight[OC, C, 5, 5]) (+ bias)`, padding 2.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &mut self,
        weight: &[f32],
        bias: Option<&[f32]>,
        inp: &[f32],
        n: usize,
        c: usize,
        oc: usize,
        h: usize,
        w: usize,
        out: &mut [f32],
    ) {
        kernel_transform(weight, c, oc, &mut self.u);
        let (th, tw) = tiles(h, w);
        let tps = th * tw;
        let (hp, wp) = (MO * th + KS - 1, MO * tw + KS - 1);
        self.v.resize(NN * CHUNK.min(n) * tps * c, 0.0);
        self.m.resize(NN * CHUNK.min(n) * tps * oc, 0.0);
        self.stage.resize(MO * th * MO * tw * oc, 0.0);
        self.xp.clear();
        self.xp.resize(hp * wp * c, 0.0);
        self.cols.resize(wp * TT * LANES, 0.0);
        let (in_sz, out_sz) = (c * h * w, oc * h * w);
        for start in (0..n).step_by(CHUNK) {
            let s = CHUNK.min(n - start);
            let t = s * tps;
            let v = &mut self.v[..NN * t * c];
            for j in 0..s {
                let x = &inp[(start + j) * in_sz..(start + j + 1) * in_sz];
                pad_hwc(x, c, h, w, wp, &mut self.xp);
                input_transform(&self.xp, c, th, tw, wp, v, j * tps, &mut self.cols);
            }
            for xi in 0..NN {
                // M_ξ[T, OC] = V_ξ[T, C] · U_ξ[C, OC]; V_ξ and M_ξ are every 36th row block.
                let (mx, vx, ux) = (&mut self.m[xi * oc..NN * t * oc], &v[xi * c..], &self.u[xi * c * oc..(xi + 1) * c * oc]);
                matmul_ld(t, oc, c, (mx, NN * oc), (vx, NN * c), Trans::No, (ux, oc), Trans::No, false);
            }
            for j in 0..s {
                let o = &mut out[(start + j) * out_sz..(start + j + 1) * out_sz];
                output_transform(&self.m[..NN * t * oc], oc, th, tw, j * tps, &mut self.stage);
                hwc_to_nchw(&self.stage, oc, h, w, MO * tw, bias, o);
            }
        }
    }

    /// `dweight[OC, C, 5, 5] += ∂/∂W` from `inp[N, C, H, W]` and `dout[N, OC, H, W]` (the input
    /// transform is redone chunk by chunk).
    #[allow(clippy::too_many_arguments)]
    pub fn weight_grad(&mut self, inp: &[f32], dout: &[f32], n: usize, c: usize, oc: usize, h: usize, w: usize, dweight: &mut [f32]) {
        let (th, tw) = tiles(h, w);
        let tps = th * tw;
        let (hp, wp) = (MO * th + KS - 1, MO * tw + KS - 1);
        self.v.resize(NN * CHUNK.min(n) * tps * c, 0.0);
        self.xp.clear();
        self.xp.resize(hp * wp * c, 0.0);
        self.cols.resize(wp * TT * LANES, 0.0);
        let in_sz = c * h * w;
        self.du.clear();
        self.du.resize(NN * c * oc, 0.0);
        self.m.resize(NN * CHUNK.min(n) * tps * oc, 0.0);
        self.stage.resize(MO * th * MO * tw * oc, 0.0);
        let out_sz = oc * h * w;
        for start in (0..n).step_by(CHUNK) {
            let s = CHUNK.min(n - start);
            let t = s * tps;
            for j in 0..s {
                pad_hwc(&inp[(start + j) * in_sz..(start + j + 1) * in_sz], c, h, w, wp, &mut self.xp);
                input_transform(&self.xp, c, th, tw, wp, &mut self.v[..NN * t * c], j * tps, &mut self.cols);
            }
            let v = &self.v[..NN * t * c];
            for j in 0..s {
                let g = &dout[(start + j) * out_sz..(start + j + 1) * out_sz];
                nchw_to_hwc(g, oc, h, w, MO * th, MO * tw, &mut self.stage);
                dout_transform(&self.stage, oc, th, tw, &mut self.m[..NN * t * oc], j * tps);
            }
            for xi in 0..NN {
                // dU_ξ[C, OC] += V_ξ^T[C, T] · dM_ξ[T, OC]
                let (dux, vx, mx) = (&mut self.du[xi * c * oc..(xi + 1) * c * oc], &v[xi * c..], &self.m[xi * oc..NN * t * oc]);
                matmul_ld(c, oc, t, (dux, oc), (vx, NN * c), Trans::Yes, (mx, NN * oc), Trans::No, true);
            }
        }
        kernel_grad_transform(&self.du, c, oc, dweight);
    }
}

/// Copy one sample `x[C, H, W]` into the interior of the zero-bordered `xp[Hp, Wp, C]`.
fn pad_hwc(x: &[f32], c: usize, h: usize, w: usize, wp: usize, xp: &mut [f32]) {
    for y in 0..h {
        // Row y of every channel -> positions (y + 2, 2..2+w), channels innermost.
        let dst = &mut xp[((y + 2) * wp + 2) * c..((y + 2) * wp + 2 + w) * c];
        transpose(x, (h * w, y * w), c, w, dst, (c, 0));
    }
}

/// `dst[doff + j * dstride + i] = src[off + i * stride + j]` for `i < rows`, `j < cols`
/// (`sp` = (stride, off), `dp` = (dstride, doff)): the NCHW <-> channels-innermost copies around
/// the transforms. Scalar, these were ~7 % of a training step (one strided access per element);
/// with AVX they go in 8x8 register blocks, and a ragged edge (14-wide maps) is covered by one
/// more block overlapping the previous one (a pure copy may write an element twice).
fn transpose(src: &[f32], sp: (usize, usize), rows: usize, cols: usize, dst: &mut [f32], dp: (usize, usize)) {
    let (stride, off) = sp;
    let (dstride, doff) = dp;
    if rows == 0 || cols == 0 {
        return;
    }
    // Every element touched below lies within these bounds (checked once, for the SIMD path).
    assert!(off + (rows - 1) * stride + cols <= src.len(), "transpose: source too short");
    assert!(doff + (cols - 1) * dstride + rows <= dst.len(), "transpose: destination too short");
    #[cfg(target_arch = "x86_64")]
    if rows >= 8 && cols >= 8 && is_x86_feature_detected!("avx") {
        let starts = |n: usize| (0..n - 7).step_by(8).chain((!n.is_multiple_of(8)).then(|| n - 8));
        for i0 in starts(rows) {
            for j0 in starts(cols) {
                // SAFETY: the CPU has AVX (checked above); the block reads src[off + (i0+i)*stride
                // + j0 .. +8] and writes dst[doff + (j0+j)*dstride + i0 .. +8] for i, j < 8, with
                // i0 + 8 <= rows and j0 + 8 <= cols, inside the extents asserted above.
                unsafe {
                    transpose8x8(src.as_ptr().add(off + i0 * stride + j0), stride, dst.as_mut_ptr().add(doff + j0 * dstride + i0), dstride)
                };
            }
        }
        return;
    }
    for i in 0..rows {
        for j in 0..cols {
            dst[doff + j * dstride + i] = src[off + i * stride + j];
        }
    }
}

/// One 8x8 block: `d[j * ds + i] = s[i * ss + j]` (the classic unpack / shuffle / permute
/// sequence).
///
/// # Safety
/// AVX must be available; `s[i * ss .. i * ss + 8]` must be readable and `d[j * ds .. j * ds + 8]`
/// writable for every `i, j < 8`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn transpose8x8(s: *const f32, ss: usize, d: *mut f32, ds: usize) {
    use std::arch::x86_64::*;
    // SAFETY: the caller guarantees the eight 8-float rows are in bounds.
    // (Plain loads, not `array::from_fn`: a closure is not compiled with AVX enabled, so each
    // load would become a call.)
    let r = unsafe {
        [
            _mm256_loadu_ps(s),
            _mm256_loadu_ps(s.add(ss)),
            _mm256_loadu_ps(s.add(2 * ss)),
            _mm256_loadu_ps(s.add(3 * ss)),
            _mm256_loadu_ps(s.add(4 * ss)),
            _mm256_loadu_ps(s.add(5 * ss)),
            _mm256_loadu_ps(s.add(6 * ss)),
            _mm256_loadu_ps(s.add(7 * ss)),
        ]
    };
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
    let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    let o = [
        _mm256_permute2f128_ps::<0x20>(u0, u4),
        _mm256_permute2f128_ps::<0x20>(u1, u5),
        _mm256_permute2f128_ps::<0x20>(u2, u6),
        _mm256_permute2f128_ps::<0x20>(u3, u7),
        _mm256_permute2f128_ps::<0x31>(u0, u4),
        _mm256_permute2f128_ps::<0x31>(u1, u5),
        _mm256_permute2f128_ps::<0x31>(u2, u6),
        _mm256_permute2f128_ps::<0x31>(u3, u7),
    ];
    for (j, v) in o.into_iter().enumerate() {
        // SAFETY: the caller guarantees the eight 8-float destination rows are in bounds.
        unsafe { _mm256_storeu_ps(d.add(j * ds), v) };
    }
}

/// Run the body compiled for AVX-512 or AVX2+FMA when the CPU has them, else portable.
macro_rules! dispatch {
    ($name:ident, $imp:ident, ($($arg:ident: $ty:ty),*)) => {
        #[allow(clippy::too_many_arguments)]
        fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                fn v4($($arg: $ty),*) {
                    $imp($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                fn v3($($arg: $ty),*) {
                    $imp($($arg),*)
                }
                if is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU supports every feature `v4` is compiled for (checked above).
                    return unsafe { v4($($arg),*) };
                }
                if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                    // SAFETY: the CPU supports every feature `v3` is compiled for (checked above).
                    return unsafe { v3($($arg),*) };
                }
            }
            $imp($($arg),*)
        }
    };
}

/// `G` as constants (checked against `toom_cook` by the tests), so the kernel transforms
/// compile to straight multiply-adds over the output channels.
const GC: [[f32; KS]; TT] = [
    [0.25, 0.0, 0.0, 0.0, 0.0],
    [-1.0 / 6.0, -1.0 / 6.0, -1.0 / 6.0, -1.0 / 6.0, -1.0 / 6.0],
    [-1.0 / 6.0, 1.0 / 6.0, -1.0 / 6.0, 1.0 / 6.0, -1.0 / 6.0],
    [1.0 / 24.0, 1.0 / 12.0, 1.0 / 6.0, 1.0 / 3.0, 2.0 / 3.0],
    [1.0 / 24.0, -1.0 / 12.0, 1.0 / 6.0, -1.0 / 3.0, 2.0 / 3.0],
    [0.0, 0.0, 0.0, 0.0, 1.0],
];

dispatch!(kernel_transform_inner, kernel_transform_impl, (wt: &[f32], c: usize, oc: usize, ch: usize, tmp: &mut [f32], u: &mut [f32]));
dispatch!(kernel_grad_inner, kernel_grad_impl, (du: &[f32], c: usize, oc: usize, ch: usize, tmp: &mut [f32], dwt: &mut [f32]));

/// `U[ξ, C, OC] = G g G^T` for every kernel `g = weight[oc, c]`, vectorised over `oc`: the
/// kernels of one input channel are first gathered as `wt[k, l, oc]`.
fn kernel_transform(weight: &[f32], c: usize, oc: usize, u: &mut Vec<f32>) {
    u.clear();
    u.resize(NN * c * oc, 0.0);
    let mut wt = vec![0.0f32; KS * KS * oc];
    let mut tmp = vec![0.0f32; TT * KS * oc];
    for ch in 0..c {
        for o in 0..oc {
            for kl in 0..KS * KS {
                wt[kl * oc + o] = weight[(o * c + ch) * KS * KS + kl];
            }
        }
        kernel_transform_inner(&wt, c, oc, ch, &mut tmp, u);
    }
}

#[inline(always)]
fn kernel_transform_impl(wt: &[f32], c: usize, oc: usize, ch: usize, tmp: &mut [f32], u: &mut [f32]) {
    // tmp[a, l, :] = Σ_k G[a][k] wt[k, l, :]
    tmp.fill(0.0);
    for a in 0..TT {
        for k in 0..KS {
            let g = GC[a][k];
            if g == 0.0 {
                continue;
            }
            for l in 0..KS {
                let (d, s) = (&mut tmp[(a * KS + l) * oc..(a * KS + l + 1) * oc], &wt[(k * KS + l) * oc..(k * KS + l + 1) * oc]);
                for (x, &y) in d.iter_mut().zip(s) {
                    *x += g * y;
                }
            }
        }
    }
    // U[a, b, ch, :] = Σ_l tmp[a, l, :] G[b][l]
    for a in 0..TT {
        for b in 0..TT {
            let d = &mut u[((a * TT + b) * c + ch) * oc..((a * TT + b) * c + ch + 1) * oc];
            for l in 0..KS {
                let g = GC[b][l];
                if g == 0.0 {
                    continue;
                }
                for (x, &y) in d.iter_mut().zip(&tmp[(a * KS + l) * oc..(a * KS + l + 1) * oc]) {
                    *x += g * y;
                }
            }
        }
    }
}

/// `dweight[oc, c] += G^T dU G` (the transpose of [`kernel_transform`]), vectorised over `oc`.
fn kernel_grad_transform(du: &[f32], c: usize, oc: usize, dweight: &mut [f32]) {
    let mut dwt = vec![0.0f32; KS * KS * oc];
    let mut tmp = vec![0.0f32; TT * KS * oc];
    for ch in 0..c {
        kernel_grad_inner(du, c, oc, ch, &mut tmp, &mut dwt);
        for o in 0..oc {
            for kl in 0..KS * KS {
                dweight[(o * c + ch) * KS * KS + kl] += dwt[kl * oc + o];
            }
        }
    }
}

#[inline(always)]
fn kernel_grad_impl(du: &[f32], c: usize, oc: usize, ch: usize, tmp: &mut [f32], dwt: &mut [f32]) {
    // tmp[a, l, :] = Σ_b dU[a, b, ch, :] G[b][l]
    tmp.fill(0.0);
    for a in 0..TT {
        for b in 0..TT {
            let s = &du[((a * TT + b) * c + ch) * oc..((a * TT + b) * c + ch + 1) * oc];
            for l in 0..KS {
                let g = GC[b][l];
                if g == 0.0 {
                    continue;
                }
                for (x, &y) in tmp[(a * KS + l) * oc..(a * KS + l + 1) * oc].iter_mut().zip(s) {
                    *x += g * y;
                }
            }
        }
    }
    // dwt[k, l, :] = Σ_a G[a][k] tmp[a, l, :]
    dwt.fill(0.0);
    for k in 0..KS {
        for a in 0..TT {
            let g = GC[a][k];
            if g == 0.0 {
                continue;
            }
            for l in 0..KS {
                let (d, s) = (&mut dwt[(k * KS + l) * oc..(k * KS + l + 1) * oc], &tmp[(a * KS + l) * oc..(a * KS + l + 1) * oc]);
                for (x, &y) in d.iter_mut().zip(s) {
                    *x += g * y;
                }
            }
        }
    }
}

dispatch!(input_transform, input_transform_impl, (xp: &[f32], c: usize, th: usize, tw: usize, wp: usize, v: &mut [f32], t0: usize, cols: &mut [f32]));
dispatch!(output_transform, output_transform_impl, (m: &[f32], oc: usize, th: usize, tw: usize, t0: usize, stage: &mut [f32]));
dispatch!(dout_transform, dout_transform_impl, (stage: &[f32], oc: usize, th: usize, tw: usize, m: &mut [f32], t0: usize));

/// Channels handled together: one AVX-512 register (the transforms keep a tile's 36 values of
/// a block in registers); a remainder block of width 1 covers channel counts not divisible by 16.
const LANES: usize = 16;

/// `out[a] = Σ_i B^T[a][i] d[i]` lane by lane, with the zeros and ±1 of `B^T` folded.
#[inline(always)]
fn bt6<const L: usize>(d: [[f32; L]; TT]) -> [[f32; L]; TT] {
    let mut o = [[0.0f32; L]; TT];
    for l in 0..L {
        let [d0, d1, d2, d3, d4, d5] = [d[0][l], d[1][l], d[2][l], d[3][l], d[4][l], d[5][l]];
        o[0][l] = 4.0 * d0 - 5.0 * d2 + d4;
        o[1][l] = -4.0 * (d1 + d2) + d3 + d4;
        o[2][l] = 4.0 * (d1 - d2) - d3 + d4;
        o[3][l] = 2.0 * (d3 - d1) - d2 + d4;
        o[4][l] = 2.0 * (d1 - d3) - d2 + d4;
        o[5][l] = 4.0 * d1 - 5.0 * d3 + d5;
    }
    o
}

/// `out[i] = Σ_a A^T[i][a] m[a]` lane by lane.
#[inline(always)]
fn at6<const L: usize>(m: [[f32; L]; TT]) -> [[f32; L]; MO] {
    let mut o = [[0.0f32; L]; MO];
    for l in 0..L {
        let [m0, m1, m2, m3, m4, m5] = [m[0][l], m[1][l], m[2][l], m[3][l], m[4][l], m[5][l]];
        o[0][l] = m0 + m1 + m2 + m3 + m4;
        o[1][l] = m1 - m2 + 2.0 * (m3 - m4) + m5;
    }
    o
}

/// `out[a] = Σ_i A^T[i][a] y[i]` lane by lane (the transpose of [`at6`]).
#[inline(always)]
fn a6<const L: usize>(y: [[f32; L]; MO]) -> [[f32; L]; TT] {
    let mut o = [[0.0f32; L]; TT];
    for l in 0..L {
        let (y0, y1) = (y[0][l], y[1][l]);
        o[0][l] = y0;
        o[1][l] = y0 + y1;
        o[2][l] = y0 - y1;
        o[3][l] = y0 + 2.0 * y1;
        o[4][l] = y0 - 2.0 * y1;
        o[5][l] = y1;
    }
    o
}

#[inline(always)]
fn load<const L: usize>(src: &[f32]) -> [f32; L] {
    let mut x = [0.0f32; L];
    x.copy_from_slice(&src[..L]);
    x
}

/// `V[t0 + tile, ξ, :] = B^T d B` for every tile of one padded sample.
///
/// Neighbouring tiles of a tile row overlap by 4 of their 6 columns, so the column pass
/// (`B^T d[:, x]`) is done once per input column of the row (into `cols`, `wp * 6 * 16` floats)
/// and shared: 18 column transforms per row of 7 tiles instead of 42.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn input_transform_impl(xp: &[f32], c: usize, th: usize, tw: usize, wp: usize, v: &mut [f32], t0: usize, cols: &mut [f32]) {
    let full = c - c % LANES;
    for ty in 0..th {
        for c0 in (0..full).step_by(LANES) {
            input_row::<LANES>(xp, c, c0, ty, tw, wp, v, t0, cols);
        }
        for c0 in full..c {
            input_row::<1>(xp, c, c0, ty, tw, wp, v, t0, cols);
        }
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn input_row<const L: usize>(xp: &[f32], c: usize, c0: usize, ty: usize, tw: usize, wp: usize, v: &mut [f32], t0: usize, cols: &mut [f32]) {
    // cols[x][a] = Σ_i B^T[a][i] d[2ty + i][x]
    for x in 0..wp {
        let mut col = [[0.0f32; L]; TT];
        for (i, ci) in col.iter_mut().enumerate() {
            *ci = load::<L>(&xp[((MO * ty + i) * wp + x) * c + c0..]);
        }
        for (a, r) in bt6(col).iter().enumerate() {
            cols[(x * TT + a) * L..(x * TT + a + 1) * L].copy_from_slice(r);
        }
    }
    // V[a][b] = Σ_j B^T[b][j] cols[2tx + j][a]
    for tx in 0..tw {
        let tile = t0 + ty * tw + tx;
        for a in 0..TT {
            let mut row = [[0.0f32; L]; TT];
            for (j, rj) in row.iter_mut().enumerate() {
                *rj = load::<L>(&cols[((MO * tx + j) * TT + a) * L..]);
            }
            for (b, x) in bt6(row).iter().enumerate() {
                v[((tile * NN + a * TT + b) * c + c0)..][..L].copy_from_slice(x);
            }
        }
    }
}

/// `stage[2ty+i, 2tx+j, :] = (A^T M A)[i][j]` for every tile of one sample (`stage` is
/// `[2th, 2tw, OC]`, channels innermost, cropped and transposed to NCHW by the caller).
#[inline(always)]
fn output_transform_impl(m: &[f32], oc: usize, th: usize, tw: usize, t0: usize, stage: &mut [f32]) {
    let full = oc - oc % LANES;
    for ty in 0..th {
        for tx in 0..tw {
            let tile = t0 + ty * tw + tx;
            for o0 in (0..full).step_by(LANES) {
                output_tile::<LANES>(m, oc, o0, ty, tx, tw, tile, stage);
            }
            for o0 in full..oc {
                output_tile::<1>(m, oc, o0, ty, tx, tw, tile, stage);
            }
        }
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn output_tile<const L: usize>(m: &[f32], oc: usize, o0: usize, ty: usize, tx: usize, tw: usize, tile: usize, stage: &mut [f32]) {
    let mut f = [[[0.0f32; L]; TT]; MO]; // f[i][b] = Σ_a A^T[i][a] M[a][b]
    for b in 0..TT {
        let mut col = [[0.0f32; L]; TT];
        for (a, ca) in col.iter_mut().enumerate() {
            *ca = load::<L>(&m[(tile * NN + a * TT + b) * oc + o0..]);
        }
        let r = at6(col);
        f[0][b] = r[0];
        f[1][b] = r[1];
    }
    let w2 = MO * tw;
    for (i, fi) in f.iter().enumerate() {
        let y = at6(*fi);
        for (j, yj) in y.iter().enumerate() {
            stage[((MO * ty + i) * w2 + MO * tx + j) * oc + o0..][..L].copy_from_slice(yj);
        }
    }
}

/// `dM[t0 + tile, ξ, :] = A dY A^T` for every tile of one sample, `stage` holding its
/// `dout` as `[2th, 2tw, OC]` (zero past the edges): the transpose of the output transform.
#[inline(always)]
fn dout_transform_impl(stage: &[f32], oc: usize, th: usize, tw: usize, m: &mut [f32], t0: usize) {
    let full = oc - oc % LANES;
    for ty in 0..th {
        for tx in 0..tw {
            let tile = t0 + ty * tw + tx;
            for o0 in (0..full).step_by(LANES) {
                dout_tile::<LANES>(stage, oc, o0, ty, tx, tw, m, tile);
            }
            for o0 in full..oc {
                dout_tile::<1>(stage, oc, o0, ty, tx, tw, m, tile);
            }
        }
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn dout_tile<const L: usize>(stage: &[f32], oc: usize, o0: usize, ty: usize, tx: usize, tw: usize, m: &mut [f32], tile: usize) {
    let w2 = MO * tw;
    let mut dy = [[[0.0f32; L]; MO]; MO];
    for (i, di) in dy.iter_mut().enumerate() {
        for (j, dij) in di.iter_mut().enumerate() {
            *dij = load::<L>(&stage[((MO * ty + i) * w2 + MO * tx + j) * oc + o0..]);
        }
    }
    // f[j][a] = Σ_i A^T[i][a] dY[i][j], then dM[a][b] = Σ_j f[j][a] A^T[j][b].
    let f = [a6([dy[0][0], dy[1][0]]), a6([dy[0][1], dy[1][1]])];
    for a in 0..TT {
        let r = a6([f[0][a], f[1][a]]);
        for (b, x) in r.iter().enumerate() {
            m[(tile * NN + a * TT + b) * oc + o0..][..L].copy_from_slice(x);
        }
    }
}

/// `stage[y, x, :] = src[:, y, x]` for one sample (`stage` is `[H2, W2, C]` with `H2 >= h`,
/// `W2 >= w`; positions past the edge are zeroed).
fn nchw_to_hwc(src: &[f32], c: usize, h: usize, w: usize, h2: usize, w2: usize, stage: &mut [f32]) {
    if h2 != h || w2 != w {
        stage[..h2 * w2 * c].fill(0.0);
    }
    for y in 0..h {
        transpose(src, (h * w, y * w), c, w, stage, (c, y * w2 * c));
    }
}

/// `dst[:, y, x] = stage[y, x, :] (+ bias)` for one sample, cropping `stage` (`[H2, W2, C]`).
#[allow(clippy::too_many_arguments)]
fn hwc_to_nchw(stage: &[f32], c: usize, h: usize, w: usize, w2: usize, bias: Option<&[f32]>, dst: &mut [f32]) {
    for y in 0..h {
        transpose(stage, (c, y * w2 * c), w, c, dst, (h * w, y * w));
    }
    if let Some(bias) = bias {
        for (plane, &b) in dst.chunks_exact_mut(h * w).zip(bias) {
            plane.iter_mut().for_each(|v| *v += b);
        }
    }
}

/// Kernels for the input gradient: `out[c, oc, k, l] = weight[oc, c, 4-k, 4-l]` (the input
/// gradient of a same-padded stride-1 convolution is the convolution of `dout` with these).
pub fn flip_kernels(weight: &[f32], c: usize, oc: usize, out: &mut Vec<f32>) {
    out.clear();
    out.resize(c * oc * KS * KS, 0.0);
    for o in 0..oc {
        for ch in 0..c {
            let src = &weight[(o * c + ch) * KS * KS..(o * c + ch + 1) * KS * KS];
            let dst = &mut out[(ch * oc + o) * KS * KS..(ch * oc + o + 1) * KS * KS];
            for (i, &x) in src.iter().enumerate() {
                dst[KS * KS - 1 - i] = x;
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::needless_range_loop)] // reference loops index several arrays at once
mod tests {
    use super::*;
    use crate::train::layers::conv2d::{conv2d_forward_cpu, Conv2dParams};
    use crate::train::rng::Rng;

    #[test]
    fn transpose_matches_scalar() {
        for (rows, cols) in [(8, 8), (19, 14), (3, 5), (64, 14), (14, 32), (9, 17)] {
            let (stride, off, dstride, doff) = (cols + 3, 2, rows + 1, 5);
            let src: Vec<f32> = (0..off + rows * stride).map(|i| i as f32).collect();
            let mut dst = vec![-1.0; doff + cols * dstride];
            transpose(&src, (stride, off), rows, cols, &mut dst, (dstride, doff));
            for i in 0..rows {
                for j in 0..cols {
                    assert_eq!(dst[doff + j * dstride + i], src[off + i * stride + j]);
                }
            }
        }
    }

    #[test]
    fn toom_cook_identity_holds() {
        let (at, g, bt) = toom_cook();
        for i in 0..MO {
            for k in 0..KS {
                for l in 0..TT {
                    let s: f64 = (0..TT).map(|j| at[i][j] * g[j][k] * bt[j][l]).sum();
                    let want = if l == i + k { 1.0 } else { 0.0 };
                    assert!((s - want).abs() < 1e-12, "i {i} k {k} l {l}: {s}");
                }
            }
        }
    }

    /// The folded formulas of `bt6` / `at6` / `a6` are the derived matrices.
    #[test]
    fn folded_transforms_match_matrices() {
        let tf = transforms();
        for (a, row) in GC.iter().enumerate() {
            for (k, &x) in row.iter().enumerate() {
                assert!((x - tf.g[a][k]).abs() < 1e-7, "G[{a}][{k}] {x} vs {}", tf.g[a][k]);
            }
        }
        for k in 0..TT {
            let unit: [[f32; 1]; TT] = std::array::from_fn(|i| [(i == k) as u8 as f32]);
            let col = bt6(unit);
            for a in 0..TT {
                assert!((col[a][0] - tf.bt[a][k]).abs() < 1e-5, "B^T[{a}][{k}]");
            }
            let col = at6(unit);
            for i in 0..MO {
                assert!((col[i][0] - tf.at[i][k]).abs() < 1e-6, "A^T[{i}][{k}]");
            }
        }
        for i in 0..MO {
            let unit: [[f32; 1]; MO] = std::array::from_fn(|k| [(k == i) as u8 as f32]);
            let col = a6(unit);
            for a in 0..TT {
                assert!((col[a][0] - tf.at[i][a]).abs() < 1e-6, "A[{a}][{i}]");
            }
        }
    }

    /// Forward against direct loops on random data, with odd sizes (partial tiles) and more
    /// samples than a chunk; tolerance 1e-4 absolute for outputs of magnitude ~5 (K = 12*25 terms).
    #[test]
    fn forward_matches_direct_conv() {
        let mut rng = Rng::new(21, 1);
        for (n, c, oc, h, w) in [(CHUNK + 3, 12, 6, 7, 9), (2, 8, 16, 14, 14), (3, 32, 20, 5, 6)] {
            let cp = Conv2dParams { in_c: c, out_c: oc, kh: 5, kw: 5, stride: 1, pad: 2 };
            let x: Vec<f32> = (0..n * c * h * w).map(|_| rng.uniform(-1.0, 1.0)).collect();
            let wt: Vec<f32> = (0..oc * c * 25).map(|_| rng.uniform(-1.0, 1.0)).collect();
            let b: Vec<f32> = (0..oc).map(|_| rng.uniform(-1.0, 1.0)).collect();
            let mut want = vec![0.0; n * oc * h * w];
            conv2d_forward_cpu(&cp, &mut want, &x, &wt, &b, n, h, w);
            let mut got = vec![0.0; n * oc * h * w];
            Winograd::default().forward(&wt, Some(&b), &x, n, c, oc, h, w, &mut got);
            for (i, (a, r)) in got.iter().zip(&want).enumerate() {
                assert!((a - r).abs() < 1e-4, "out[{i}] {a} vs {r}");
            }
        }
    }

    /// Weight gradient against the direct sum `dW[o,c,k,l] = Σ dout[o,y,x] · xpad[c,y+k,x+l]`,
    /// and input gradient (forward with flipped kernels) against the direct scatter.
    #[test]
    fn gradients_match_direct_sums() {
        let mut rng = Rng::new(22, 1);
        let (n, c, oc, h, w) = (CHUNK + 1, 8, 5, 6, 7);
        let x: Vec<f32> = (0..n * c * h * w).map(|_| rng.uniform(-1.0, 1.0)).collect();
        let wt: Vec<f32> = (0..oc * c * 25).map(|_| rng.uniform(-1.0, 1.0)).collect();
        let g: Vec<f32> = (0..n * oc * h * w).map(|_| rng.uniform(-1.0, 1.0)).collect();
        let mut wg = Winograd::default();
        let mut out = vec![0.0; n * oc * h * w];
        wg.forward(&wt, None, &x, n, c, oc, h, w, &mut out);
        let mut dw = vec![0.0; oc * c * 25];
        wg.weight_grad(&x, &g, n, c, oc, h, w, &mut dw);
        let mut dw_ref = vec![0.0f64; oc * c * 25];
        let mut dx_ref = vec![0.0f64; n * c * h * w];
        for b in 0..n {
            for o in 0..oc {
                for y in 0..h {
                    for xx in 0..w {
                        let gv = g[((b * oc + o) * h + y) * w + xx] as f64;
                        for ch in 0..c {
                            for k in 0..5 {
                                for l in 0..5 {
                                    let (iy, ix) = (y as isize + k as isize - 2, xx as isize + l as isize - 2);
                                    if iy >= 0 && ix >= 0 && (iy as usize) < h && (ix as usize) < w {
                                        let xi = ((b * c + ch) * h + iy as usize) * w + ix as usize;
                                        dw_ref[((o * c + ch) * 5 + k) * 5 + l] += gv * x[xi] as f64;
                                        dx_ref[xi] += gv * wt[((o * c + ch) * 5 + k) * 5 + l] as f64;
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        for (i, (a, r)) in dw.iter().zip(&dw_ref).enumerate() {
            assert!((*a as f64 - r).abs() < 1e-3, "dw[{i}] {a} vs {r}");
        }
        let mut flipped = Vec::new();
        flip_kernels(&wt, c, oc, &mut flipped);
        let mut dx = vec![0.0; n * c * h * w];
        Winograd::default().forward(&flipped, None, &g, n, oc, c, h, w, &mut dx);
        for (i, (a, r)) in dx.iter().zip(&dx_ref).enumerate() {
            assert!((*a as f64 - r).abs() < 1e-4, "dx[{i}] {a} vs {r}");
        }
    }
}
