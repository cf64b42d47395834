//! Winograd F(4x4, 5x5) convolution for stride-1, padding-2 ("same") 5x5 layers: the big layer
//! of the FashionMNIST CNN (conv2, 32 -> 64 channels on 14x14) spends 64 multiplies per 4x4 output tile
//! and channel pair instead of 400 (6.25x fewer than direct; 14x14 outputs take 4x4 tiles of
//! 4x4, 16x16 covered: 1024 multiplies per channel pair against 1764 for F(2x2, 5x5)).
//!
//! With `d` an 8x8 input tile, `g` a 5x5 kernel and `Y` the 4x4 output tile:
//! `Y = A^T [ (G g G^T) ⊙ (B^T d B) ] A`. Per transformed position `ξ` (64 of them) the channel
//! sum is one GEMM over all tiles of a chunk: `M_ξ[T, OC] = V_ξ[T, C] · U_ξ[C, OC]`. `V` and `M`
//! are stored tile-major (`[T, 64, C]`): a tile's transform writes or reads one contiguous block
//! instead of 64 rows far apart, and each GEMM takes every 64th row block by its row stride.
//! - forward:         `V = B^T d B` per tile, `U = G g G^T`, GEMMs, `Y = A^T M A + bias`
//! - backward input:  the forward of `dout` with the kernels flipped and in/out swapped
//! - backward weight: `dM = A dY A^T` per tile, `dU_ξ[C, OC] += V_ξ^T · dM_ξ`, `dW += G^T dU G`
//!   (`V` is recomputed chunk by chunk rather than kept from forward)
//!
//! The two backward directions run in one pass over the chunks, sharing each `dout` sample's
//! transpose and the chunk buffers.
//!
//! Partial tiles (14 is not a multiple of 4): the input is read from a zero-bordered copy as
//! large as the tiles cover, the output transform writes the whole tile into a staging buffer
//! that is cropped on the way back to NCHW, and `dY` is zero past the edge, so the outputs beyond
//! the map contribute nothing to either gradient.
//!
//! The matrices come from Toom-Cook with points 0, ±1, ±2, ±1/2, ∞ (`A^T`, `G` in closed form,
//! `B^T` solved from the defining identity in f64), so no matrix is typed by hand: the kernel
//! transforms use `G` as derived, and the hand-folded input / output transforms of the hot loops
//! (`bt8`, `at8`, `a8`) are checked against the derived matrices by the tests. The transform entries
//! are larger than F(2x2)'s (up to 8 in `A^T`, 21/4 in `B^T`), but fewer terms are summed per
//! output: the fp32 error against direct convolution, relative to the output scale, measured
//! 3-6e-6 against F(2x2)'s 1-13e-6 (forward and input gradient ~1.5x F(2x2)'s, weight gradient
//! below it); the tests bound it.
//!
//! The transforms are short multiply-add loops over the channel dimension (kept innermost so they
//! vectorise). The release build targets generic x86-64, so they are compiled a second time with
//! AVX-512 / AVX2 enabled and picked at run time; the portable version stays as the fallback.
//! (No FMA contraction happens in Rust without an explicit call, so the three versions give
//! bit-identical results.)

use super::Conv2dShape;
use crate::gemm::{matmul_ld, Trans};
use crate::multiversion::dispatch;

/// Output tile edge.
const MO: usize = 4;
/// Kernel edge.
const KS: usize = 5;
/// Transformed tile edge (`m + r - 1` for `m = 4` outputs and `r = 5` taps).
const TT: usize = MO + KS - 1;
/// Transformed positions per tile.
const NN: usize = TT * TT;
/// The finite Toom-Cook points (the last, `∞`, is implicit): small magnitudes and their
/// reciprocals keep the transform entries, hence the fp32 error, small.
const POINTS: [f64; TT - 1] = [0.0, 1.0, -1.0, 2.0, -2.0, 0.5, -0.5];
/// Samples per batch of GEMMs (16 tiles each on 14x14): each of the 64 GEMMs then has 32 rows,
/// and a chunk's `V` and `M` (0.26 + 0.53 MB at conv2's 32 -> 64 channels; backward uses the same
/// two) stay in the 2 MB L2 with the transformed kernels (conv2 forward + backward at batch
/// 64, CPU ms, best of 25 rounds in one process, two runs: 1 sample 11.7, 2: 11.4-11.9, 3: 12.0,
/// 4: 12.9, 8: 14.2).
const CHUNK: usize = 2;

/// `A^T` (4x8), `G` (8x5), `B^T` (8x8) in f64.
type Mats = ([[f64; TT]; MO], [[f64; KS]; TT], [[f64; TT]; TT]);

/// `A^T`, `G`, `B^T` in f64 for [`POINTS`] and ∞.
///
/// `A^T[i][j] = a_j^i`, `G[j][k] = a_j^k / Π_{l≠j}(a_j - a_l)` (∞: the last row/column picks
/// the leading coefficient), and `B^T` solves `Σ_j A^T[i][j] G[j][k] B^T[j][l] = [l == i + k]`
/// (1-D correlation `y_i = Σ_k g_k d_{i+k}`), column by column by least squares (20 equations,
/// 8 unknowns, consistent; the tests check the residual).
#[allow(clippy::needless_range_loop)] // index arithmetic reads clearer as in the formulas
pub fn toom_cook() -> Mats {
    let pts = POINTS;
    let np = pts.len();
    let mut at = [[0.0; TT]; MO];
    let mut g = [[0.0; KS]; TT];
    for (i, row) in at.iter_mut().enumerate() {
        for j in 0..np {
            row[j] = pts[j].powi(i as i32);
        }
        row[np] = if i == MO - 1 { 1.0 } else { 0.0 };
    }
    for j in 0..np {
        let f: f64 = (0..np)
            .filter(|&l| l != j)
            .map(|l| pts[j] - pts[l])
            .product();
        for k in 0..KS {
            g[j][k] = pts[j].powi(k as i32) / f;
        }
    }
    g[np][KS - 1] = 1.0;
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

/// Gaussian elimination with partial pivoting for the 8x8 normal equations.
#[allow(clippy::needless_range_loop)] // index arithmetic reads clearer as in the formulas
fn solve(mut a: [[f64; TT]; TT], mut b: [f64; TT]) -> [f64; TT] {
    for col in 0..TT {
        let piv = (col..TT)
            .max_by(|&x, &y| a[x][col].abs().total_cmp(&a[y][col].abs()))
            .unwrap_or(col);
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

/// `G` in f32, derived once: the kernel transforms run on it as is (they are not in the hot
/// loop: 2048 kernels per layer and step).
fn kernel_matrix() -> &'static [[f32; KS]; TT] {
    static G: std::sync::OnceLock<[[f32; KS]; TT]> = std::sync::OnceLock::new();
    G.get_or_init(|| toom_cook().1.map(|r| r.map(|x| x as f32)))
}

/// Whether a convolution can take the Winograd path: 5x5, stride 1, padding 2 (output = input
/// size), and enough input channels for the per-position GEMMs to pay (the 1-channel first layer
/// stays on im2col).
pub fn applies(in_c: usize, kh: usize, kw: usize, stride: usize, pad: usize) -> bool {
    kh == KS && kw == KS && stride == 1 && pad == 2 && in_c >= 8
}

/// Scratch of the Winograd convolution of one layer (forward and backward).
#[derive(Clone, Debug, Default)]
pub struct Winograd {
    u: Vec<f32>,     // (64, C, OC) transformed kernels
    uf: Vec<f32>,    // (64, OC, C) transformed flipped kernels (input gradient)
    xp: Vec<f32>,    // (Hp, Wp, C) zero-padded input sample, channels innermost
    xpd: Vec<f32>,   // (chunk, Hp, Wp, OC) zero-padded dout samples, channels innermost
    v: Vec<f32>,     // (T, 64, C) transformed input tiles of one chunk; input-gradient GEMM output
    m: Vec<f32>,     // (T, 64, OC) GEMM output (forward) / dout tiles under A (weight gradient)
    stage: Vec<f32>, // (4th, 4tw, OC) one sample's output, channels innermost
    cols: Vec<f32>,  // (Wp, 8, 16) column transforms of one tile row (input transform scratch)
    du: Vec<f32>,    // (64, C, OC) weight-gradient accumulator
}

/// Floats from one tile's block of `V` or `M` (`[64, ch]`) to the next: one cache line more than
/// the block. Each GEMM reads every tile's row `ξ`; at exactly `64 * ch` floats (8 or 16 KB) those
/// rows would all fall in the same L1 set and evict one another (measured: backward 5-10 % slower).
#[inline(always)]
fn tile_stride(ch: usize) -> usize {
    NN * ch + LINE
}

/// The tile grid of one `h x w` map: `th x tw` tiles of `MO x MO` outputs, whose `TT x TT`
/// inputs are read from a zero-bordered `hp x wp` copy of the map.
#[derive(Clone, Copy, Debug)]
struct Tiles {
    th: usize,
    tw: usize,
}

impl Tiles {
    fn new(h: usize, w: usize) -> Tiles {
        Tiles {
            th: h.div_ceil(MO),
            tw: w.div_ceil(MO),
        }
    }
    /// Tiles per sample.
    fn count(self) -> usize {
        self.th * self.tw
    }
    /// Rows of the padded copy.
    fn hp(self) -> usize {
        MO * self.th + KS - 1
    }
    /// Columns of the padded copy.
    fn wp(self) -> usize {
        MO * self.tw + KS - 1
    }
}

/// `(n, c, oc, h, w)` of a convolution the Winograd path takes.
fn dims(s: &Conv2dShape) -> (usize, usize, usize, usize, usize) {
    (s.batch, s.params.in_c, s.params.out_c, s.in_h, s.in_w)
}

impl Winograd {
    /// `out[N, OC, H, W] = conv(inp[N, C, H, W], weight[OC, C, 5, 5]) (+ bias)`, padding 2.
    pub fn forward(
        &mut self,
        weight: &[f32],
        bias: Option<&[f32]>,
        inp: &[f32],
        shape: &Conv2dShape,
        out: &mut [f32],
    ) {
        let (n, c, oc, h, w) = dims(shape);
        let g = Tiles::new(h, w);
        let ch = CHUNK.min(n);
        let u = kernel_transform(weight, c, oc, false, &mut self.u);
        let v = aligned(&mut self.v, ch * g.count() * tile_stride(c), false);
        let m = aligned(&mut self.m, ch * g.count() * tile_stride(oc), false);
        let stage = aligned(&mut self.stage, MO * g.th * MO * g.tw * oc, false);
        let xp = aligned(&mut self.xp, g.hp() * g.wp() * c, true);
        let cols = aligned(&mut self.cols, g.wp() * TT * LANES, false);
        for start in (0..n).step_by(ch) {
            let samples = start..start + ch.min(n - start);
            let t = samples.len() * g.count();
            transform_samples(inp, samples.clone(), (c, h, w), g, (xp, cols), v);
            // M_ξ[T, OC] = V_ξ[T, C] · U_ξ[C, OC]
            tile_gemms(t, (m, oc), (v, c), u);
            untransform_samples(m, samples, (oc, h, w), g, stage, bias, out);
        }
    }

    /// Backward of [`Winograd::forward`] (without the bias): `dweight[OC, C, 5, 5] += ∂/∂W` from
    /// `inp[N, C, H, W]` and `dout[N, OC, H, W]`, and when `dinp` is given, `dinp[N, C, H, W] =
    /// ∂/∂X` (overwritten).
    ///
    /// Both gradients in one pass over the chunks: each `dout` sample is transposed and padded
    /// once, and feeds both its transforms (`A dY A^T` for the weight, `B^T dY B` for the input,
    /// the forward of `dout` with the kernels flipped and in/out swapped). The input-gradient
    /// half reuses the weight-gradient half's two chunk buffers once consumed, so the chunk's
    /// footprint stays that of either half (a third buffer measured 10 % slower than the two
    /// directions run apart; as it is, the two are level). The input transform of `inp` is
    /// redone rather than kept from forward.
    pub fn backward(
        &mut self,
        weight: &[f32],
        inp: &[f32],
        dout: &[f32],
        shape: &Conv2dShape,
        dweight: &mut [f32],
        mut dinp: Option<&mut [f32]>,
    ) {
        let (n, c, oc, h, w) = dims(shape);
        let g = Tiles::new(h, w);
        let (tps, wp) = (g.count(), g.wp());
        let ch = CHUNK.min(n);
        let want_dx = dinp.is_some();
        let uf = if want_dx {
            kernel_transform(weight, c, oc, true, &mut self.uf)
        } else {
            &[]
        };
        let stage = aligned(
            &mut self.stage,
            if want_dx {
                MO * g.th * MO * g.tw * c
            } else {
                0
            },
            false,
        );
        let v = aligned(&mut self.v, ch * tps * tile_stride(c), false);
        let m = aligned(&mut self.m, ch * tps * tile_stride(oc), false);
        let xp = aligned(&mut self.xp, g.hp() * wp * c, true);
        // The chunk's padded dout samples, kept for the input-gradient transform.
        let xpd = aligned(&mut self.xpd, ch * g.hp() * wp * oc, true);
        let cols = aligned(&mut self.cols, wp * TT * LANES, false);
        let du = aligned(&mut self.du, NN * c * oc, true);
        let (out_sz, pd) = (oc * h * w, g.hp() * wp * oc);
        for start in (0..n).step_by(ch) {
            let samples = start..start + ch.min(n - start);
            let t = samples.len() * tps;
            for (j, b) in samples.clone().enumerate() {
                let xj = &mut xpd[j * pd..(j + 1) * pd];
                pad_hwc(&dout[b * out_sz..(b + 1) * out_sz], oc, h, w, wp, xj);
                dout_transform(xj, oc, g, &mut m[j * tps * tile_stride(oc)..]);
            }
            transform_samples(inp, samples.clone(), (c, h, w), g, (xp, cols), v);
            for xi in 0..NN {
                // dU_ξ[C, OC] += V_ξ^T[C, T] · dM_ξ[T, OC]
                let (dux, vx, mx) = (
                    &mut du[xi * c * oc..(xi + 1) * c * oc],
                    &v[xi * c..t * tile_stride(c)],
                    &m[xi * oc..t * tile_stride(oc)],
                );
                matmul_ld(
                    (c, oc, t),
                    (dux, oc),
                    (vx, tile_stride(c), Trans::Yes),
                    (mx, tile_stride(oc), Trans::No),
                    true,
                );
            }
            let Some(dx) = dinp.as_deref_mut() else {
                continue;
            };
            // B^T dY B into M (consumed above), then the GEMMs into V (consumed too): the input
            // gradient reuses the two buffers instead of adding a third.
            for j in 0..samples.len() {
                let mj = &mut m[j * tps * tile_stride(oc)..];
                input_transform(&xpd[j * pd..(j + 1) * pd], oc, g, mj, cols);
            }
            // dX_ξ[T, C] = Vd_ξ[T, OC] · Uf_ξ[OC, C]
            tile_gemms(t, (v, c), (m, oc), uf);
            untransform_samples(v, samples, (c, h, w), g, stage, None, dx);
        }
        kernel_grad_transform(du, c, oc, dweight);
    }
}

/// The transformed tiles `V = B^T d B` of samples `samples` of `x[N, C, H, W]` into the chunk's
/// `v` (the chunk's `j`-th sample from tile `j * tiles` on): each sample is padded into `xp`
/// first; `cols` is the input transform's scratch.
fn transform_samples(
    x: &[f32],
    samples: std::ops::Range<usize>,
    (c, h, w): (usize, usize, usize),
    g: Tiles,
    (xp, cols): (&mut [f32], &mut [f32]),
    v: &mut [f32],
) {
    let sz = c * h * w;
    for (j, b) in samples.enumerate() {
        pad_hwc(&x[b * sz..(b + 1) * sz], c, h, w, g.wp(), xp);
        input_transform(xp, c, g, &mut v[j * g.count() * tile_stride(c)..], cols);
    }
}

/// The chunk's 64 per-position GEMMs `dst_ξ[T, N] = src_ξ[T, K] · kern_ξ[K, N]` over its `t`
/// tiles (`dst` and `src` tile-major with `N` and `K` channels, `kern` as `[64, K, N]`),
/// overwriting `dst`.
fn tile_gemms(t: usize, (dst, nd): (&mut [f32], usize), (src, ks): (&[f32], usize), kern: &[f32]) {
    for xi in 0..NN {
        let (dx, sx, kx) = (
            &mut dst[xi * nd..t * tile_stride(nd)],
            &src[xi * ks..t * tile_stride(ks)],
            &kern[xi * ks * nd..(xi + 1) * ks * nd],
        );
        matmul_ld(
            (t, nd, ks),
            (dx, tile_stride(nd)),
            (sx, tile_stride(ks), Trans::No),
            (kx, nd, Trans::No),
            false,
        );
    }
}

/// `Y = A^T M A` of samples `samples` from the chunk's `m` (as [`transform_samples`] lays it
/// out, `c` channels), cropped into their planes of `y[N, C, H, W]` (plus `bias`); `stage` is the
/// output transform's scratch.
fn untransform_samples(
    m: &[f32],
    samples: std::ops::Range<usize>,
    (c, h, w): (usize, usize, usize),
    g: Tiles,
    stage: &mut [f32],
    bias: Option<&[f32]>,
    y: &mut [f32],
) {
    let sz = c * h * w;
    for (j, b) in samples.enumerate() {
        output_transform(&m[j * g.count() * tile_stride(c)..], c, g, stage);
        let yb = &mut y[b * sz..(b + 1) * sz];
        hwc_to_nchw(stage, c, (h, w), MO * g.tw, bias, yb);
    }
}

/// Floats per 64-byte cache line.
const LINE: usize = 16;

/// `len` floats of `buf` starting on a 64-byte boundary (zeroed if `zero`), growing `buf` as
/// needed. A `Vec<f32>` is only 16-byte aligned, and with every row of the transforms and GEMMs
/// a multiple of 16 floats, an unaligned base makes each 64-byte load and store straddle two
/// cache lines.
fn aligned(buf: &mut Vec<f32>, len: usize, zero: bool) -> &mut [f32] {
    if buf.len() < len + LINE - 1 {
        buf.resize(len + LINE - 1, 0.0);
    }
    // Floats to skip to the next line boundary (an f32 pointer is 4-byte aligned).
    let off = (buf.as_ptr() as usize).wrapping_neg() % 64 / 4;
    let s = &mut buf[off..off + len];
    if zero {
        s.fill(0.0);
    }
    s
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
fn transpose(
    src: &[f32],
    sp: (usize, usize),
    rows: usize,
    cols: usize,
    dst: &mut [f32],
    dp: (usize, usize),
) {
    let (stride, off) = sp;
    let (dstride, doff) = dp;
    if rows == 0 || cols == 0 {
        return;
    }
    // Every element touched below lies within these bounds (checked once, for the SIMD path).
    assert!(
        off + (rows - 1) * stride + cols <= src.len(),
        "transpose: source too short"
    );
    assert!(
        doff + (cols - 1) * dstride + rows <= dst.len(),
        "transpose: destination too short"
    );
    #[cfg(target_arch = "x86_64")]
    if rows >= 8 && cols >= 8 && is_x86_feature_detected!("avx") {
        let starts = |n: usize| {
            (0..n - 7)
                .step_by(8)
                .chain((!n.is_multiple_of(8)).then(|| n - 8))
        };
        for i0 in starts(rows) {
            for j0 in starts(cols) {
                // SAFETY: the CPU has AVX (checked above); the block reads src[off + (i0+i)*stride
                // + j0 .. +8] and writes dst[doff + (j0+j)*dstride + i0 .. +8] for i, j < 8, with
                // i0 + 8 <= rows and j0 + 8 <= cols, inside the extents asserted above.
                unsafe {
                    transpose8x8(
                        src.as_ptr().add(off + i0 * stride + j0),
                        stride,
                        dst.as_mut_ptr().add(doff + j0 * dstride + i0),
                        dstride,
                    )
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

dispatch!(kernel_transform_inner, kernel_transform_impl, (p: KernelPass<'_>, wt: &[f32], u: &mut [f32]));
dispatch!(kernel_grad_inner, kernel_grad_impl, (p: KernelPass<'_>, du: &[f32], dwt: &mut [f32]));

/// What the two passes of a kernel transform (or of its transpose, the weight gradient) share
/// for input channel `ch` of `U[ξ, C, OC]`: `G`, the channel counts, and the `[8, 5, OC]`
/// scratch between the passes.
struct KernelPass<'a> {
    g: &'a [[f32; KS]; TT],
    c: usize,
    oc: usize,
    ch: usize,
    tmp: &'a mut [f32],
}

impl<'a> KernelPass<'a> {
    /// The pass for channel `ch` of `(c, oc)`, its scratch `tmp` zeroed (the first pass
    /// accumulates into it).
    fn new(g: &'a [[f32; KS]; TT], (c, oc): (usize, usize), ch: usize, tmp: &'a mut [f32]) -> Self {
        tmp.fill(0.0);
        KernelPass { g, c, oc, ch, tmp }
    }
}

/// `U[ξ, C, OC] = G g G^T` for every kernel `g = weight[oc, c]`, vectorised over `oc`: the
/// kernels of one input channel are first gathered as `wt[k, l, oc]`. With `flip`, the kernels of
/// the input gradient instead: `U[ξ, OC, C]` from `g'[c, oc][k][l] = weight[oc, c][4-k][4-l]` (the
/// input gradient of a same-padded stride-1 convolution is the convolution of `dout` with these).
fn kernel_transform<'a>(
    weight: &[f32],
    c: usize,
    oc: usize,
    flip: bool,
    buf: &'a mut Vec<f32>,
) -> &'a [f32] {
    let g = kernel_matrix();
    // Input and output channels of the transformed kernels.
    let (ci, co) = if flip { (oc, c) } else { (c, oc) };
    let u = aligned(buf, NN * ci * co, true);
    let mut wt = vec![0.0f32; KS * KS * co];
    let mut tmp = vec![0.0f32; TT * KS * co];
    for ch in 0..ci {
        for o in 0..co {
            if flip {
                let src = &weight[(ch * c + o) * KS * KS..(ch * c + o + 1) * KS * KS];
                for (kl, &x) in src.iter().rev().enumerate() {
                    wt[kl * co + o] = x;
                }
            } else {
                let src = &weight[(o * c + ch) * KS * KS..(o * c + ch + 1) * KS * KS];
                for (kl, &x) in src.iter().enumerate() {
                    wt[kl * co + o] = x;
                }
            }
        }
        kernel_transform_inner(KernelPass::new(g, (ci, co), ch, &mut tmp), &wt, u);
    }
    u
}

#[inline(always)]
fn kernel_transform_impl(p: KernelPass<'_>, wt: &[f32], u: &mut [f32]) {
    let oc = p.oc;
    // tmp[a, l, :] = Σ_k G[a][k] wt[k, l, :]
    for a in 0..TT {
        for k in 0..KS {
            for l in 0..KS {
                axpy(
                    p.g[a][k],
                    row(wt, k * KS + l, oc),
                    row_mut(p.tmp, a * KS + l, oc),
                );
            }
        }
    }
    // U[a, b, ch, :] = Σ_l tmp[a, l, :] G[b][l]
    for a in 0..TT {
        for b in 0..TT {
            let d = row_mut(u, (a * TT + b) * p.c + p.ch, oc);
            for l in 0..KS {
                axpy(p.g[b][l], row(p.tmp, a * KS + l, oc), d);
            }
        }
    }
}

/// `dweight[oc, c] += G^T dU G` (the transpose of [`kernel_transform`]), vectorised over `oc`.
fn kernel_grad_transform(du: &[f32], c: usize, oc: usize, dweight: &mut [f32]) {
    let g = kernel_matrix();
    let mut dwt = vec![0.0f32; KS * KS * oc];
    let mut tmp = vec![0.0f32; TT * KS * oc];
    for ch in 0..c {
        kernel_grad_inner(KernelPass::new(g, (c, oc), ch, &mut tmp), du, &mut dwt);
        for o in 0..oc {
            for kl in 0..KS * KS {
                dweight[(o * c + ch) * KS * KS + kl] += dwt[kl * oc + o];
            }
        }
    }
}

#[inline(always)]
fn kernel_grad_impl(p: KernelPass<'_>, du: &[f32], dwt: &mut [f32]) {
    let oc = p.oc;
    // tmp[a, l, :] = Σ_b dU[a, b, ch, :] G[b][l]
    for a in 0..TT {
        for b in 0..TT {
            let s = row(du, (a * TT + b) * p.c + p.ch, oc);
            for l in 0..KS {
                axpy(p.g[b][l], s, row_mut(p.tmp, a * KS + l, oc));
            }
        }
    }
    // dwt[k, l, :] = Σ_a G[a][k] tmp[a, l, :]
    dwt.fill(0.0);
    for k in 0..KS {
        for a in 0..TT {
            for l in 0..KS {
                axpy(
                    p.g[a][k],
                    row(p.tmp, a * KS + l, oc),
                    row_mut(dwt, k * KS + l, oc),
                );
            }
        }
    }
}

/// Row `i` of `n` floats of `buf`.
#[inline(always)]
fn row(buf: &[f32], i: usize, n: usize) -> &[f32] {
    &buf[i * n..(i + 1) * n]
}

/// Row `i` of `n` floats of `buf`, writable.
#[inline(always)]
fn row_mut(buf: &mut [f32], i: usize, n: usize) -> &mut [f32] {
    &mut buf[i * n..(i + 1) * n]
}

/// `d += g * s` element-wise, nothing when `g` is 0 (`G`'s rows for the points 0 and ∞ have one
/// non-zero entry each).
#[inline(always)]
fn axpy(g: f32, s: &[f32], d: &mut [f32]) {
    if g == 0.0 {
        return;
    }
    for (x, &y) in d.iter_mut().zip(s) {
        *x += g * y;
    }
}

dispatch!(input_transform, input_transform_impl, (xp: &[f32], c: usize, g: Tiles, v: &mut [f32], cols: &mut [f32]));
dispatch!(output_transform, output_transform_impl, (m: &[f32], oc: usize, g: Tiles, stage: &mut [f32]));
dispatch!(dout_transform, dout_transform_impl, (xpd: &[f32], oc: usize, g: Tiles, m: &mut [f32]));

/// Channels handled together: one AVX-512 register (the transforms keep a tile's values of
/// a block in registers); a remainder block of width 1 covers channel counts not divisible by 16.
const LANES: usize = 16;

// Lane-wise arithmetic on `L` channels, as values: the transforms below are expression trees of
// these, with no zero-initialised arrays filled in place, so each value stays in a register
// (filled arrays were kept on the stack and cleared with `memset` at every tile).
#[inline(always)]
fn add<const L: usize>(mut a: [f32; L], b: [f32; L]) -> [f32; L] {
    for l in 0..L {
        a[l] += b[l];
    }
    a
}

#[inline(always)]
fn sub<const L: usize>(mut a: [f32; L], b: [f32; L]) -> [f32; L] {
    for l in 0..L {
        a[l] -= b[l];
    }
    a
}

#[inline(always)]
fn mul<const L: usize>(mut a: [f32; L], s: f32) -> [f32; L] {
    for x in a.iter_mut() {
        *x *= s;
    }
    a
}

/// `[e + q, e - q]`, the butterfly of a point pair `±p` (whose powers differ only in the sign of
/// the odd ones): in [`bt8`] and [`a8`] the pair's two outputs from their shared even (`e`) and
/// odd (`q`) partial sums, in [`at8`] the sum and difference of the pair's two inputs.
#[inline(always)]
fn pm<const L: usize>(e: [f32; L], q: [f32; L]) -> [[f32; L]; 2] {
    [add(e, q), sub(e, q)]
}

/// `out[a] = Σ_i B^T[a][i] d[i]` lane by lane, with the zeros and ±1 of `B^T` folded. The rows
/// of a point pair `±p` differ only in the sign of the odd columns, so each pair shares its even
/// and odd partial sums (`e ± q`).
#[inline(always)]
fn bt8<const L: usize>(d: [[f32; L]; TT]) -> [[f32; L]; TT] {
    let [d0, d1, d2, d3, d4, d5, d6, d7] = d;
    let [r1, r2] = pm(
        sub(add(d2, d6), mul(d4, 4.25)),
        sub(add(d1, d5), mul(d3, 4.25)),
    );
    let [r3, r4] = pm(
        sub(add(mul(d2, 0.25), d6), mul(d4, 1.25)),
        sub(add(mul(d1, 0.5), mul(d5, 2.0)), mul(d3, 2.5)),
    );
    let [r5, r6] = pm(
        sub(add(mul(d2, 4.0), d6), mul(d4, 5.0)),
        sub(add(mul(d1, 2.0), mul(d5, 0.5)), mul(d3, 2.5)),
    );
    let r0 = add(sub(d6, d0), mul(sub(d2, d4), 5.25));
    [
        r0,
        r1,
        r2,
        r3,
        r4,
        r5,
        r6,
        add(sub(d7, d1), mul(sub(d3, d5), 5.25)),
    ]
}

/// `out[i] = Σ_a A^T[i][a] m[a]` lane by lane (sums and differences of each point pair shared).
#[inline(always)]
fn at8<const L: usize>(m: [[f32; L]; TT]) -> [[f32; L]; MO] {
    let [m0, m1, m2, m3, m4, m5, m6, m7] = m;
    let ([s1, d1], [s2, d2], [s3, d3]) = (pm(m1, m2), pm(m3, m4), pm(m5, m6));
    [
        add(add(add(m0, s1), s2), s3),
        add(add(d1, mul(d2, 2.0)), mul(d3, 0.5)),
        add(add(s1, mul(s2, 4.0)), mul(s3, 0.25)),
        add(add(add(d1, mul(d2, 8.0)), mul(d3, 0.125)), m7),
    ]
}

/// `out[a] = Σ_i A^T[i][a] y[i]` lane by lane (the transpose of [`at8`]).
#[inline(always)]
fn a8<const L: usize>(y: [[f32; L]; MO]) -> [[f32; L]; TT] {
    let [y0, y1, y2, y3] = y;
    let [r1, r2] = pm(add(y0, y2), add(y1, y3));
    let [r3, r4] = pm(add(y0, mul(y2, 4.0)), add(mul(y1, 2.0), mul(y3, 8.0)));
    let [r5, r6] = pm(add(y0, mul(y2, 0.25)), add(mul(y1, 0.5), mul(y3, 0.125)));
    [y0, r1, r2, r3, r4, r5, r6, y3]
}

#[inline(always)]
fn load<const L: usize>(src: &[f32]) -> [f32; L] {
    let mut x = [0.0f32; L];
    x.copy_from_slice(&src[..L]);
    x
}

/// `N` lane blocks of `src` at `base, base + stride, ...`.
#[inline(always)]
fn gather<const L: usize, const N: usize>(
    src: &[f32],
    base: usize,
    stride: usize,
) -> [[f32; L]; N] {
    // A loop, not `array::from_fn`: a closure is not compiled with the caller's target features.
    let mut out = [[0.0f32; L]; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = load::<L>(&src[base + i * stride..]);
    }
    out
}

/// `V[tile, ξ, :] = B^T d B` for every tile of one padded sample (`v` from the sample's first
/// tile on).
///
/// Neighbouring tiles of a tile row overlap by 4 of their 8 columns, so the column pass
/// (`B^T d[:, x]`) is done once per input column of the row (into `cols`, `wp * 8 * 16` floats)
/// and shared: 20 column transforms per row of 4 tiles instead of 32.
#[inline(always)]
fn input_transform_impl(xp: &[f32], c: usize, g: Tiles, v: &mut [f32], cols: &mut [f32]) {
    let full = c - c % LANES;
    for ty in 0..g.th {
        for c0 in (0..full).step_by(LANES) {
            input_row::<LANES>(xp, (c, c0), ty, g, v, cols);
        }
        for c0 in full..c {
            input_row::<1>(xp, (c, c0), ty, g, v, cols);
        }
    }
}

/// Tile row `ty` of [`input_transform_impl`], channels `c0..c0 + L` of `c`.
#[inline(always)]
fn input_row<const L: usize>(
    xp: &[f32],
    (c, c0): (usize, usize),
    ty: usize,
    g: Tiles,
    v: &mut [f32],
    cols: &mut [f32],
) {
    let (tw, wp) = (g.tw, g.wp());
    // cols[x][a] = Σ_i B^T[a][i] d[4ty + i][x]
    for x in 0..wp {
        let col = bt8(gather::<L, TT>(xp, (MO * ty * wp + x) * c + c0, wp * c));
        for (a, r) in col.iter().enumerate() {
            cols[(x * TT + a) * L..(x * TT + a + 1) * L].copy_from_slice(r);
        }
    }
    // V[a][b] = Σ_j B^T[b][j] cols[4tx + j][a]
    let ts = tile_stride(c);
    for tx in 0..tw {
        let tile = ty * tw + tx;
        for a in 0..TT {
            let row = bt8(gather::<L, TT>(cols, (MO * tx * TT + a) * L, TT * L));
            for (b, x) in row.iter().enumerate() {
                v[tile * ts + (a * TT + b) * c + c0..][..L].copy_from_slice(x);
            }
        }
    }
}

/// One sample's tiles for a [`TileTransform`]: read from `src`, written to `dst`, `ch` channels
/// on the tile grid `g`.
struct TileIo<'a> {
    src: &'a [f32],
    dst: &'a mut [f32],
    ch: usize,
    g: Tiles,
}

/// A transform done tile by tile, `L` channels at a time (register blocks of [`LANES`], then
/// the remainder one by one): [`each_tile`] runs it over a sample.
trait TileTransform {
    /// Tile `(ty, tx)`, channels `c0..c0 + L` of `io.ch`.
    fn tile<const L: usize>(io: &mut TileIo<'_>, c0: usize, t: (usize, usize));
}

/// `T` on every tile of one sample: from `src` to `dst`, `ch` channels on the grid `g`.
#[inline(always)]
fn each_tile<T: TileTransform>(src: &[f32], ch: usize, g: Tiles, dst: &mut [f32]) {
    let mut io = TileIo { src, dst, ch, g };
    let full = ch - ch % LANES;
    for ty in 0..g.th {
        for tx in 0..g.tw {
            for c0 in (0..full).step_by(LANES) {
                T::tile::<LANES>(&mut io, c0, (ty, tx));
            }
            for c0 in full..ch {
                T::tile::<1>(&mut io, c0, (ty, tx));
            }
        }
    }
}

/// The tiles of [`output_transform_impl`].
enum OutputTile {}

impl TileTransform for OutputTile {
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // the loop index picks a column across the rows
    fn tile<const L: usize>(io: &mut TileIo<'_>, o0: usize, (ty, tx): (usize, usize)) {
        let (m, oc, tw) = (io.src, io.ch, io.g.tw);
        // r[a][j] = Σ_b M[a][b] A^T[j][b] (rows first), then Y[i][j] = Σ_a A^T[i][a] r[a][j].
        let base = (ty * tw + tx) * tile_stride(oc) + o0;
        let mut r = [[[0.0f32; L]; MO]; TT];
        for (a, ra) in r.iter_mut().enumerate() {
            *ra = at8(gather::<L, TT>(m, base + a * TT * oc, oc));
        }
        let w2 = MO * tw;
        for j in 0..MO {
            let y = at8([
                r[0][j], r[1][j], r[2][j], r[3][j], r[4][j], r[5][j], r[6][j], r[7][j],
            ]);
            for (i, yi) in y.iter().enumerate() {
                io.dst[((MO * ty + i) * w2 + MO * tx + j) * oc + o0..][..L].copy_from_slice(yi);
            }
        }
    }
}

/// `stage[4ty+i, 4tx+j, :] = (A^T M A)[i][j]` for every tile of one sample (`m` from the
/// sample's first tile on; `stage` is `[4th, 4tw, OC]`, channels innermost, cropped and
/// transposed to NCHW by the caller).
#[inline(always)]
fn output_transform_impl(m: &[f32], oc: usize, g: Tiles, stage: &mut [f32]) {
    each_tile::<OutputTile>(m, oc, g, stage);
}

/// The tiles of [`dout_transform_impl`].
enum DoutTile {}

impl TileTransform for DoutTile {
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // the loop index picks a column across the rows
    fn tile<const L: usize>(io: &mut TileIo<'_>, o0: usize, (ty, tx): (usize, usize)) {
        const P: usize = KS / 2;
        let (xpd, oc, g) = (io.src, io.ch, io.g);
        let (wp, tile) = (g.wp(), ty * g.tw + tx);
        // g[i][b] = Σ_j dY[i][j] A^T[j][b] (rows first), then dM[a][b] = Σ_i A^T[i][a] g[i][b].
        let base = ((MO * ty + P) * wp + MO * tx + P) * oc + o0;
        let mut g = [[[0.0f32; L]; TT]; MO];
        for (i, gi) in g.iter_mut().enumerate() {
            *gi = a8(gather::<L, MO>(xpd, base + i * wp * oc, oc));
        }
        let at = tile * tile_stride(oc) + o0;
        for b in 0..TT {
            let col = a8([g[0][b], g[1][b], g[2][b], g[3][b]]);
            for (a, x) in col.iter().enumerate() {
                io.dst[at + (a * TT + b) * oc..][..L].copy_from_slice(x);
            }
        }
    }
}

/// `dM[tile, ξ, :] = A dY A^T` for every tile of one sample (`m` from its first tile on), `xpd`
/// holding its `dout` as
/// `[Hp, Wp, OC]` with the map at offset (2, 2) and zeros around it (the padded copy the input
/// gradient transforms too): the transpose of the output transform.
#[inline(always)]
fn dout_transform_impl(xpd: &[f32], oc: usize, g: Tiles, m: &mut [f32]) {
    each_tile::<DoutTile>(xpd, oc, g, m);
}

/// `dst[:, y, x] = stage[y, x, :] (+ bias)` for one sample, cropping `stage` (`[H2, W2, C]`).
fn hwc_to_nchw(
    stage: &[f32],
    c: usize,
    (h, w): (usize, usize),
    w2: usize,
    bias: Option<&[f32]>,
    dst: &mut [f32],
) {
    for y in 0..h {
        transpose(stage, (c, y * w2 * c), w, c, dst, (h * w, y * w));
    }
    if let Some(bias) = bias {
        for (plane, &b) in dst.chunks_exact_mut(h * w).zip(bias) {
            plane.iter_mut().for_each(|v| *v += b);
        }
    }
}

#[cfg(test)]
#[allow(clippy::needless_range_loop)] // reference loops index several arrays at once
mod tests {
    use super::*;
    use crate::ops::Conv2dParams;
    use crate::rng::Rng;

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

    /// The folded formulas of `bt8` / `at8` / `a8` are the derived matrices (every entry is a
    /// small dyadic fraction, exact in f32, so the comparison is exact up to the f64 solve).
    #[test]
    fn folded_transforms_match_matrices() {
        let (at, _, bt) = toom_cook();
        for k in 0..TT {
            let unit: [[f32; 1]; TT] = std::array::from_fn(|i| [(i == k) as u8 as f32]);
            let col = bt8(unit);
            for a in 0..TT {
                assert!(
                    (col[a][0] as f64 - bt[a][k]).abs() < 1e-9,
                    "B^T[{a}][{k}] {} vs {}",
                    col[a][0],
                    bt[a][k]
                );
            }
            let col = at8(unit);
            for i in 0..MO {
                assert!((col[i][0] as f64 - at[i][k]).abs() < 1e-12, "A^T[{i}][{k}]");
            }
        }
        for i in 0..MO {
            let unit: [[f32; 1]; MO] = std::array::from_fn(|k| [(k == i) as u8 as f32]);
            let col = a8(unit);
            for a in 0..TT {
                assert!((col[a][0] as f64 - at[i][a]).abs() < 1e-12, "A[{a}][{i}]");
            }
        }
    }

    /// Direct same-padded 5x5 convolution and its two gradients in f64: `out`, `dW` from `dout`,
    /// `dX` from `dout` (the references the fp32 Winograd error is measured against).
    #[allow(clippy::type_complexity)]
    fn direct(
        x: &[f32],
        wt: &[f32],
        g: &[f32],
        (n, c, oc, h, w): (usize, usize, usize, usize, usize),
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let mut out = vec![0.0f64; n * oc * h * w];
        let mut dw = vec![0.0f64; oc * c * 25];
        let mut dx = vec![0.0f64; n * c * h * w];
        for b in 0..n {
            for o in 0..oc {
                for y in 0..h {
                    for xx in 0..w {
                        let oi = ((b * oc + o) * h + y) * w + xx;
                        let gv = g[oi] as f64;
                        for ch in 0..c {
                            for k in 0..5 {
                                for l in 0..5 {
                                    let (iy, ix) =
                                        (y as isize + k as isize - 2, xx as isize + l as isize - 2);
                                    if iy >= 0 && ix >= 0 && (iy as usize) < h && (ix as usize) < w
                                    {
                                        let xi = ((b * c + ch) * h + iy as usize) * w + ix as usize;
                                        let wi = ((o * c + ch) * 5 + k) * 5 + l;
                                        out[oi] += x[xi] as f64 * wt[wi] as f64;
                                        dw[wi] += gv * x[xi] as f64;
                                        dx[xi] += gv * wt[wi] as f64;
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        (out, dw, dx)
    }

    /// `max |got - want| / max |want|`: the error relative to the output scale.
    fn rel_err(got: &[f32], want: &[f64]) -> f64 {
        assert_eq!(got.len(), want.len());
        let scale = want.iter().fold(0.0f64, |m, &r| m.max(r.abs()));
        got.iter()
            .zip(want)
            .fold(0.0f64, |m, (&a, &r)| m.max((a as f64 - r).abs()))
            / scale
    }

    /// Bound on [`rel_err`] for the fp32 transforms and GEMMs. Measured on these tests' data
    /// (layer-init weight scale, up to 64 channels): F(4x4, 5x5) forward 2.8e-6 .. 4.4e-6, weight
    /// gradient 3.4e-6 .. 5.2e-6, input gradient 2.7e-6 .. 5.8e-6; F(2x2, 5x5) on the same data
    /// 1.7e-6 .. 3.2e-6, 4.1e-6 .. 1.3e-5 and 1.3e-6 .. 2.2e-6 (its weight gradient sums 3x more
    /// tiles per GEMM). The bound leaves 5x over the largest F(4x4) figure; a wrong transform
    /// entry or a dropped edge tile is off by O(1) of the output scale.
    const TOL: f64 = 3e-5;

    /// Forward and both gradients against the f64 direct sums on random data: odd sizes (partial
    /// tiles, 14 not a multiple of 4), more samples than a chunk, channel counts not divisible by
    /// the 16 lanes, and conv2's own shape. Weights at the layer's init scale (`1/sqrt(25 C)`), so
    /// outputs are O(1) as in training.
    #[test]
    fn forward_and_gradients_match_direct_conv() {
        let mut rng = Rng::new(21, 1);
        for (n, c, oc, h, w) in [
            (CHUNK + 3, 12, 6, 7, 9),
            (2, 8, 16, 14, 14),
            (3, 33, 20, 5, 6),
            (CHUNK + 1, 8, 5, 6, 7),
            (2, 32, 64, 14, 14),
        ] {
            let bound = 1.0 / ((25 * c) as f32).sqrt();
            let x: Vec<f32> = (0..n * c * h * w).map(|_| rng.uniform(-1.0, 1.0)).collect();
            let wt: Vec<f32> = (0..oc * c * 25)
                .map(|_| rng.uniform(-bound, bound))
                .collect();
            let b: Vec<f32> = (0..oc).map(|_| rng.uniform(-bound, bound)).collect();
            let g: Vec<f32> = (0..n * oc * h * w)
                .map(|_| rng.uniform(-1.0, 1.0))
                .collect();
            let (mut want, dw_ref, dx_ref) = direct(&x, &wt, &g, (n, c, oc, h, w));
            for (i, r) in want.iter_mut().enumerate() {
                *r += b[(i / (h * w)) % oc] as f64;
            }
            let mut wg = Winograd::default();
            let mut out = vec![0.0; n * oc * h * w];
            let shape = Conv2dParams::new(c, oc, 5, 1, 2).for_input(n, h, w);
            wg.forward(&wt, Some(&b), &x, &shape, &mut out);
            let e = rel_err(&out, &want);
            assert!(e < TOL, "{n}x{c}->{oc} {h}x{w}: forward error {e:e}");
            // The weight gradient accumulates: start from a non-zero value.
            let mut dw = vec![0.5; oc * c * 25];
            let mut dx = vec![f32::NAN; n * c * h * w];
            wg.backward(&wt, &x, &g, &shape, &mut dw, Some(&mut dx));
            dw.iter_mut().for_each(|v| *v -= 0.5);
            let e = rel_err(&dw, &dw_ref);
            assert!(
                e < TOL,
                "{n}x{c}->{oc} {h}x{w}: weight gradient error {e:e}"
            );
            // Without the input gradient, the same weight gradient.
            let mut dw2 = vec![0.5; oc * c * 25];
            wg.backward(&wt, &x, &g, &shape, &mut dw2, None);
            dw2.iter_mut().for_each(|v| *v -= 0.5);
            assert_eq!(dw, dw2);
            let e = rel_err(&dx, &dx_ref);
            assert!(e < TOL, "{n}x{c}->{oc} {h}x{w}: input gradient error {e:e}");
        }
    }
}
