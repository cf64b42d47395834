//! Conv2d (`kernels/conv2d.cu`): the CPU layer, its shape, the kernels' CPU twins (`twin.rs`) and
//! the Winograd path (`winograd.rs`).
//!
//! The layer (any stride and padding, no dilation or groups) runs as im2col + GEMM, one sample at a
//! time, or as Winograd F(4x4, 5x5) for the layers that fit it.
//!
//! im2col path, per sample, with `K = in_c*kh*kw` and `P = out_h*out_w`:
//! - forward:         `col = im2col(inp)`, `out[OC, P] = W[OC, K] · col + bias` (NCHW directly)
//! - backward weight: `dW^T[K, OC] += col · dY^T`, `dbias[oc] += Σ dout`
//! - backward input:  `dcol[K, P] = W^T · dY`, `dinp = col2im(dcol)`
//!
//! One sample per GEMM because this path now serves small-K layers (conv1: K = 25): the sample's
//! NCHW output and dout are the GEMM operands as they lie, with no gather or transpose
//! (measured on conv1 at batch 64: forward 2.05 -> 1.31 ms against 4-sample chunks with a
//! transposed output). The weight gradient is computed transposed (`[K, OC]` scratch, added into
//! `dW` at the end) because the `gemm` crate is faster with the short side as the destination's
//! column count (2.64 -> 2.51 ms). In training, forward keeps the columns of the whole batch
//! (5 MB for conv1 at batch 64) so backward does not unroll the input again. Backward can also
//! take each sample's output gradient from the fused BatchNorm group after it as it is made
//! (`DoutSource::Fill`), so conv1's 6.4 MB output gradient is never written out whole.
//!
//! 5x5 stride-1 "same" layers with 8+ input channels (conv2 of the FashionMNIST CNN) take the
//! Winograd F(4x4, 5x5) path of `winograd.rs` instead, in all three directions: it does
//! several times fewer multiplications than im2col + GEMM (`benches/train_step.rs` times conv2).

mod shape;
pub mod twin;
pub(crate) mod winograd;

pub use shape::{Conv2dParams, Conv2dShape};

use super::batchnorm::lane_sum;
use super::{Backward, Layer, LayerSpec, ParamSpec};
use crate::gemm::{matmul, Trans};
use crate::tensor::Tensor;
use winograd::Winograd;

/// 2-D convolution layer with its reusable column buffers.
#[derive(Clone, Debug)]
pub struct Conv2d {
    /// Shape parameters.
    pub params: Conv2dParams,
    col: Vec<f32>,    // sample after sample, each (K, P): the unrolled input
    saved: usize,     // samples whose columns `col` holds from a training forward (0: none)
    dcol: Vec<f32>,   // (K, P) column gradient of one sample
    dwt: Vec<f32>,    // (K, OC) weight gradient, transposed, summed over the samples
    padded: Vec<f32>, // one zero-padded input plane (im2col / col2im scratch)
    gbuf: Vec<f32>,   // (OC, P) one sample's output gradient, when backward is fed sample by sample
    wino: Winograd,   // Winograd scratch (when `winograd::applies`)
}

impl Conv2d {
    /// A convolution with the given shape.
    pub fn new(params: Conv2dParams) -> Conv2d {
        Conv2d {
            params,
            col: Vec::new(),
            saved: 0,
            dcol: Vec::new(),
            dwt: Vec::new(),
            padded: Vec::new(),
            gbuf: Vec::new(),
            wino: Winograd::default(),
        }
    }

    fn winograd(&self) -> bool {
        let cp = &self.params;
        winograd::applies(cp.in_c, cp.kh, cp.kw, cp.stride, cp.pad)
    }
}

/// Copy a short run (a row of a small feature map, e.g. 14 floats) with fixed-size moves:
/// `copy_from_slice` would call `memmove`, whose call overhead dominates at this length.
#[inline(always)]
#[allow(clippy::manual_memcpy)] // the point is to avoid the memmove call for 1-3 elements
fn copy_short(dst: &mut [f32], src: &[f32]) {
    let n = dst.len().min(src.len());
    let mut i = 0;
    while i + 8 <= n {
        let d: &mut [f32; 8] = (&mut dst[i..i + 8]).try_into().expect("8 elements");
        let s: &[f32; 8] = (&src[i..i + 8]).try_into().expect("8 elements");
        *d = *s;
        i += 8;
    }
    if i + 4 <= n {
        let d: &mut [f32; 4] = (&mut dst[i..i + 4]).try_into().expect("4 elements");
        let s: &[f32; 4] = (&src[i..i + 4]).try_into().expect("4 elements");
        *d = *s;
        i += 4;
    }
    for j in i..n {
        dst[j] = src[j];
    }
}

/// Unroll one sample `inp[C, H, W]` into the columns of `col`, a `[C*kh*kw, ld]` matrix whose
/// row `r` starts at `col[r * ld]` (zeros where padding). `ld >= OH*OW` lets several samples sit
/// side by side in one matrix: pass `&mut col[j * OH*OW..]` for sample `j`.
pub fn im2col(cp: &Conv2dParams, inp: &[f32], h: usize, w: usize, col: &mut [f32], ld: usize) {
    let (oh, ow) = (cp.out_h(h), cp.out_w(w));
    let p = oh * ow;
    let mut row = 0;
    for c in 0..cp.in_c {
        let plane = &inp[c * h * w..(c + 1) * h * w];
        for ki in 0..cp.kh {
            for kj in 0..cp.kw {
                let dst = &mut col[row * ld..row * ld + p];
                for oy in 0..oh {
                    let iy = (oy * cp.stride + ki) as isize - cp.pad as isize;
                    let drow = &mut dst[oy * ow..(oy + 1) * ow];
                    if iy < 0 || iy >= h as isize {
                        drow.fill(0.0);
                        continue;
                    }
                    let src = &plane[iy as usize * w..(iy as usize + 1) * w];
                    if cp.stride == 1 {
                        // Contiguous run: ix = ox + kj - pad; copy the in-range part, zero the rest.
                        let off = kj as isize - cp.pad as isize;
                        let lo = (-off).clamp(0, ow as isize) as usize;
                        let hi = ((w as isize - off).clamp(0, ow as isize)) as usize;
                        drow[..lo].fill(0.0);
                        if hi > lo {
                            let s0 = (lo as isize + off) as usize;
                            copy_short(&mut drow[lo..hi], &src[s0..s0 + (hi - lo)]);
                        }
                        drow[hi.max(lo)..].fill(0.0);
                    } else {
                        for (ox, d) in drow.iter_mut().enumerate() {
                            let ix = (ox * cp.stride + kj) as isize - cp.pad as isize;
                            *d = if ix < 0 || ix >= w as isize {
                                0.0
                            } else {
                                src[ix as usize]
                            };
                        }
                    }
                }
                row += 1;
            }
        }
    }
}

/// Fold the columns of `col` (a `[C*kh*kw, ld]` matrix, as in [`im2col`]) back into one sample
/// `dinp[C, H, W]` (overwrites; overlapping windows add up, padding positions are dropped).
pub fn col2im(cp: &Conv2dParams, col: &[f32], h: usize, w: usize, dinp: &mut [f32], ld: usize) {
    let (oh, ow) = (cp.out_h(h), cp.out_w(w));
    let p = oh * ow;
    dinp[..cp.in_c * h * w].fill(0.0);
    let mut row = 0;
    for c in 0..cp.in_c {
        let plane = &mut dinp[c * h * w..(c + 1) * h * w];
        for ki in 0..cp.kh {
            for kj in 0..cp.kw {
                let src = &col[row * ld..row * ld + p];
                for oy in 0..oh {
                    let iy = (oy * cp.stride + ki) as isize - cp.pad as isize;
                    if iy < 0 || iy >= h as isize {
                        continue;
                    }
                    let drow = &mut plane[iy as usize * w..(iy as usize + 1) * w];
                    let srow = &src[oy * ow..(oy + 1) * ow];
                    if cp.stride == 1 {
                        // Contiguous run, mirror of im2col's fast path.
                        let off = kj as isize - cp.pad as isize;
                        let lo = (-off).clamp(0, ow as isize) as usize;
                        let hi = ((w as isize - off).clamp(0, ow as isize)) as usize;
                        if hi > lo {
                            let d0 = (lo as isize + off) as usize;
                            for (d, &g) in drow[d0..d0 + (hi - lo)].iter_mut().zip(&srow[lo..hi]) {
                                *d += g;
                            }
                        }
                        continue;
                    }
                    for (ox, &g) in srow.iter().enumerate() {
                        let ix = (ox * cp.stride + kj) as isize - cp.pad as isize;
                        if ix >= 0 && ix < w as isize {
                            drow[ix as usize] += g;
                        }
                    }
                }
                row += 1;
            }
        }
    }
}

/// [`im2col`] for stride 1 through a zero-padded copy of each input plane: every column row is
/// then `oh` plain copies of `ow` floats, with no bounds tests or zero fills per row (the general
/// version spends most of its time on those for the 14-wide maps of the big layer).
/// `padded` is scratch, resized here. Other strides fall back to [`im2col`].
pub fn im2col_fast(
    cp: &Conv2dParams,
    inp: &[f32],
    h: usize,
    w: usize,
    col: &mut [f32],
    ld: usize,
    padded: &mut Vec<f32>,
) {
    if cp.stride != 1 {
        return im2col(cp, inp, h, w, col, ld);
    }
    let (oh, ow) = (cp.out_h(h), cp.out_w(w));
    let (hp, wp) = (h + 2 * cp.pad, w + 2 * cp.pad);
    padded.clear();
    padded.resize(hp * wp, 0.0); // borders stay zero; the interior is overwritten per channel
    let mut row = 0;
    for c in 0..cp.in_c {
        let plane = &inp[c * h * w..(c + 1) * h * w];
        for (y, src) in plane.chunks_exact(w).enumerate() {
            let o = (y + cp.pad) * wp + cp.pad;
            copy_short(&mut padded[o..o + w], src);
        }
        for ki in 0..cp.kh {
            for kj in 0..cp.kw {
                let dst = &mut col[row * ld..row * ld + oh * ow];
                for (oy, drow) in dst.chunks_exact_mut(ow).enumerate() {
                    let s0 = (oy + ki) * wp + kj;
                    copy_short(drow, &padded[s0..s0 + ow]);
                }
                row += 1;
            }
        }
    }
}

/// [`col2im`] for stride 1 through a zero-padded accumulator plane (mirror of [`im2col_fast`]):
/// every column row adds `oh` runs of `ow` floats, with no bounds tests; the interior is copied
/// out at the end. Other strides fall back to [`col2im`].
pub fn col2im_fast(
    cp: &Conv2dParams,
    col: &[f32],
    h: usize,
    w: usize,
    dinp: &mut [f32],
    ld: usize,
    padded: &mut Vec<f32>,
) {
    if cp.stride != 1 {
        return col2im(cp, col, h, w, dinp, ld);
    }
    let (oh, ow) = (cp.out_h(h), cp.out_w(w));
    let (hp, wp) = (h + 2 * cp.pad, w + 2 * cp.pad);
    padded.resize(hp * wp, 0.0);
    let mut row = 0;
    for c in 0..cp.in_c {
        padded.fill(0.0);
        for ki in 0..cp.kh {
            for kj in 0..cp.kw {
                let src = &col[row * ld..row * ld + oh * ow];
                for (oy, srow) in src.chunks_exact(ow).enumerate() {
                    let d0 = (oy + ki) * wp + kj;
                    for (d, &g) in padded[d0..d0 + ow].iter_mut().zip(srow) {
                        *d += g;
                    }
                }
                row += 1;
            }
        }
        let plane = &mut dinp[c * h * w..(c + 1) * h * w];
        for (y, drow) in plane.chunks_exact_mut(w).enumerate() {
            let o = (y + cp.pad) * wp + cp.pad;
            copy_short(drow, &padded[o..o + w]);
        }
    }
}

/// Naive CPU reference of the forward pass (direct loops, f64 sums), for tests.
pub fn conv2d_forward_cpu(
    shape: &Conv2dShape,
    out: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    bias: &[f32],
) {
    let (cp, n, h, w) = (&shape.params, shape.batch, shape.in_h, shape.in_w);
    let (oh, ow) = (shape.out_h(), shape.out_w());
    for b in 0..n {
        for oc in 0..cp.out_c {
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut s = bias[oc] as f64;
                    for c in 0..cp.in_c {
                        for ki in 0..cp.kh {
                            for kj in 0..cp.kw {
                                let iy = (oy * cp.stride + ki) as isize - cp.pad as isize;
                                let ix = (ox * cp.stride + kj) as isize - cp.pad as isize;
                                if iy >= 0 && ix >= 0 && (iy as usize) < h && (ix as usize) < w {
                                    let x = inp
                                        [((b * cp.in_c + c) * h + iy as usize) * w + ix as usize];
                                    let wt = weight[((oc * cp.in_c + c) * cp.kh + ki) * cp.kw + kj];
                                    s += x as f64 * wt as f64;
                                }
                            }
                        }
                    }
                    out[((b * cp.out_c + oc) * oh + oy) * ow + ox] = s as f32;
                }
            }
        }
    }
}

impl Layer for Conv2d {
    fn spec(&self) -> LayerSpec {
        LayerSpec::Conv2d(self.params)
    }
    fn out_dims(&self, inp: &[usize]) -> Result<Vec<usize>, String> {
        self.params.out_dims(inp)
    }
    fn param_specs(&self) -> Vec<ParamSpec> {
        let cp = &self.params;
        ParamSpec::weight_and_bias(vec![cp.out_c, cp.in_c, cp.kh, cp.kw], cp.k())
    }
    fn forward(&mut self, p: &[f32], inp: &Tensor, out: &mut Tensor, train: bool) {
        let cp = self.params;
        let (n, h, w) = (inp.dims()[0], inp.dims()[2], inp.dims()[3]);
        let (oh, ow) = (cp.out_h(h), cp.out_w(w));
        let (k, oc) = (cp.k(), cp.out_c);
        out.resize(&[n, oc, oh, ow]);
        if self.winograd() {
            let (weight, bias) = p.split_at(oc * k);
            let shape = cp.for_input(n, h, w);
            let out = out.data_mut();
            self.wino
                .forward(weight, Some(bias), inp.data(), &shape, out);
            return;
        }
        self.forward_samples(p, inp, out, train, None);
    }
    fn backward(&mut self, args: Backward<'_>) {
        let cp = self.params;
        let (n, h, w) = (args.inp.dims()[0], args.inp.dims()[2], args.inp.dims()[3]);
        let (oh, ow) = (cp.out_h(h), cp.out_w(w));
        let (k, pp, oc) = (cp.k(), oh * ow, cp.out_c);
        if self.winograd() {
            let weight = &args.p[..oc * k];
            let (dweight, dbias) = args.dp.split_at_mut(oc * k);
            for (i, plane) in args.dout.data().chunks_exact(pp).enumerate() {
                dbias[i % oc] += lane_sum(plane, |v| v);
            }
            let dx = args.dinp.map(|d| {
                d.resize(args.inp.dims());
                d.data_mut()
            });
            let shape = cp.for_input(n, h, w);
            let (x, dy) = (args.inp.data(), args.dout.data());
            self.wino.backward(weight, x, dy, &shape, dweight, dx);
            return;
        }
        self.backward_samples(
            args.p,
            args.dp,
            args.inp,
            DoutSource::Tensor(args.dout.data()),
            args.dinp,
        );
    }
}

/// What [`Conv2d::forward_samples`] calls with each sample's index and output.
pub(crate) type SampleSink<'a> = &'a mut dyn FnMut(usize, &[f32]);

/// Where [`Conv2d::backward_samples`] finds each sample's output gradient.
pub(crate) enum DoutSource<'a> {
    /// In a `[N, OC, OH, OW]` tensor.
    Tensor(&'a [f32]),
    /// Written on request, sample by sample, into the `[OC, OH, OW]` buffer it is given (a fused
    /// layer after the convolution produces it there, so the batch's gradient never has to be
    /// stored whole).
    Fill(&'a mut dyn FnMut(usize, &mut [f32])),
}

impl Conv2d {
    /// Whether forward and backward run sample by sample (im2col + GEMM), so forward can hand
    /// each sample's output to a sink and backward take its output gradient from
    /// [`DoutSource::Fill`].
    pub(crate) fn streams_samples(&self) -> bool {
        !self.winograd()
    }

    /// The im2col forward, one sample at a time (`out` is resized to `[N, OC, OH, OW]`): after
    /// each sample's output is written, `sink(b, output)` sees it while it is still in cache
    /// (the fused BatchNorm group after conv1 takes its statistics and pools there). Panics on
    /// the Winograd path (see [`Conv2d::streams_samples`]).
    pub(crate) fn forward_samples(
        &mut self,
        p: &[f32],
        inp: &Tensor,
        out: &mut Tensor,
        train: bool,
        mut sink: Option<SampleSink<'_>>,
    ) {
        assert!(
            self.streams_samples(),
            "the Winograd path does not run sample by sample"
        );
        let cp = self.params;
        let (n, h, w) = (inp.dims()[0], inp.dims()[2], inp.dims()[3]);
        let (oh, ow) = (cp.out_h(h), cp.out_w(w));
        let (k, pp, oc) = (cp.k(), oh * ow, cp.out_c);
        out.resize(&[n, oc, oh, ow]);
        // Training keeps every sample's columns for backward; evaluation reuses one sample's room.
        let kept = if train { n } else { 1.min(n) };
        self.col.resize(k * kept * pp, 0.0);
        self.saved = 0;
        let (weight, bias) = p.split_at(oc * k);
        let (in_sz, out_sz) = (cp.in_c * h * w, oc * pp);
        for b in 0..n {
            let col = if train {
                &mut self.col[k * b * pp..k * (b + 1) * pp]
            } else {
                &mut self.col[..k * pp]
            };
            im2col_fast(
                &cp,
                &inp.data()[b * in_sz..(b + 1) * in_sz],
                h,
                w,
                col,
                pp,
                &mut self.padded,
            );
            // out[OC, P] = W[OC, K] · col[K, P], straight into the sample's NCHW planes.
            let o = &mut out.data_mut()[b * out_sz..(b + 1) * out_sz];
            matmul((oc, pp, k), o, (weight, Trans::No), (col, Trans::No), false);
            for (plane, &bv) in o.chunks_exact_mut(pp).zip(bias) {
                plane.iter_mut().for_each(|v| *v += bv);
            }
            if let Some(f) = sink.as_deref_mut() {
                f(b, o);
            }
        }
        if train {
            self.saved = n;
        }
    }

    /// The im2col backward, one sample at a time, taking each sample's output gradient from
    /// `src` (`inp` is `[N, C, H, W]`): accumulates the weight and bias gradients into `dp` and
    /// overwrites `dinp` when given. Panics on the Winograd path (see [`Conv2d::streams_samples`]).
    pub(crate) fn backward_samples(
        &mut self,
        p: &[f32],
        dp: &mut [f32],
        inp: &Tensor,
        mut src: DoutSource<'_>,
        mut dinp: Option<&mut Tensor>,
    ) {
        assert!(
            self.streams_samples(),
            "the Winograd path does not run sample by sample"
        );
        let cp = self.params;
        let (n, h, w) = (inp.dims()[0], inp.dims()[2], inp.dims()[3]);
        let (oh, ow) = (cp.out_h(h), cp.out_w(w));
        let (k, pp, oc) = (cp.k(), oh * ow, cp.out_c);
        let mut gbuf = std::mem::take(&mut self.gbuf);
        if let DoutSource::Fill(_) = src {
            gbuf.resize(oc * pp, 0.0);
        }
        // Columns kept by the training forward of this batch, else recomputed sample by sample.
        let have = self.saved == n;
        if !have {
            self.col.resize(k * pp, 0.0);
        }
        let weight = &p[..oc * k];
        let (dweight, dbias) = dp.split_at_mut(oc * k);
        self.dwt.clear();
        self.dwt.resize(k * oc, 0.0);
        if let Some(d) = dinp.as_deref_mut() {
            d.resize(inp.dims());
            self.dcol.resize(k * pp, 0.0);
        }
        let (in_sz, out_sz) = (cp.in_c * h * w, oc * pp);
        for b in 0..n {
            // The sample's dout is the [OC, P] GEMM operand as it lies.
            let g: &[f32] = match &mut src {
                DoutSource::Tensor(d) => &d[b * out_sz..(b + 1) * out_sz],
                DoutSource::Fill(f) => {
                    f(b, &mut gbuf);
                    &gbuf
                }
            };
            for (plane, db) in g.chunks_exact(pp).zip(dbias.iter_mut()) {
                *db += lane_sum(plane, |v| v);
            }
            let col = if have {
                &self.col[k * b * pp..k * (b + 1) * pp]
            } else {
                im2col_fast(
                    &cp,
                    &inp.data()[b * in_sz..(b + 1) * in_sz],
                    h,
                    w,
                    &mut self.col,
                    pp,
                    &mut self.padded,
                );
                &self.col[..k * pp]
            };
            // dW^T[K, OC] += col[K, P] · dY^T[P, OC]
            matmul(
                (k, oc, pp),
                &mut self.dwt,
                (col, Trans::No),
                (g, Trans::Yes),
                true,
            );
            if let Some(d) = dinp.as_deref_mut() {
                // dcol[K, P] = W^T · dY, folded back into the sample.
                matmul(
                    (k, pp, oc),
                    &mut self.dcol,
                    (weight, Trans::Yes),
                    (g, Trans::No),
                    false,
                );
                col2im_fast(
                    &cp,
                    &self.dcol,
                    h,
                    w,
                    &mut d.data_mut()[b * in_sz..(b + 1) * in_sz],
                    pp,
                    &mut self.padded,
                );
            }
        }
        for (c, drow) in dweight.chunks_exact_mut(k).enumerate() {
            for (q, d) in drow.iter_mut().enumerate() {
                *d += self.dwt[q * oc + c];
            }
        }
        self.gbuf = gbuf;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn conv2d_forward_matches_direct_loops() {
        for (stride, pad) in [(1, 0), (1, 2), (2, 1), (3, 0)] {
            let cp = Conv2dParams {
                in_c: 3,
                out_c: 4,
                kh: 3,
                kw: 2,
                stride,
                pad,
            };
            let mut layer = Conv2d::new(cp);
            let mut rng = Rng::new(5, 5);
            let np: usize = layer.param_specs().iter().map(|s| s.numel()).sum();
            let p: Vec<f32> = (0..np).map(|_| rng.uniform(-1.0, 1.0)).collect();
            // 11 samples: more than one chunk, with a partial last chunk.
            let dims = [11, 3, 7, 6];
            let inp = Tensor::from_vec(
                &dims,
                (0..11 * 3 * 42).map(|_| rng.uniform(-1.0, 1.0)).collect(),
            )
            .unwrap();
            let mut out = Tensor::default();
            layer.forward(&p, &inp, &mut out, true);
            let mut reference = vec![0.0; out.numel()];
            let (w, b) = p.split_at(4 * cp.k());
            let shape = cp.for_input(11, 7, 6);
            conv2d_forward_cpu(&shape, &mut reference, inp.data(), w, b);
            for (i, (x, y)) in out.data().iter().zip(&reference).enumerate() {
                assert!(
                    (x - y).abs() < 1e-4,
                    "stride {stride} pad {pad}: out[{i}] {x} vs {y}"
                );
            }
        }
    }

    /// The padded fast paths must match the general im2col / col2im exactly (same additions in the
    /// same order per element is not guaranteed for col2im, hence a 1e-6 tolerance there).
    #[test]
    fn fast_im2col_col2im_match_general() {
        let mut rng = Rng::new(3, 3);
        for (h, w, pad, kh, kw) in [(7, 6, 2, 5, 5), (5, 5, 0, 3, 2), (4, 9, 1, 3, 3)] {
            let cp = Conv2dParams {
                in_c: 3,
                out_c: 2,
                kh,
                kw,
                stride: 1,
                pad,
            };
            let (p, ld) = (cp.out_h(h) * cp.out_w(w), cp.out_h(h) * cp.out_w(w) + 3);
            let inp: Vec<f32> = (0..3 * h * w).map(|_| rng.uniform(-1.0, 1.0)).collect();
            let (mut a, mut b) = (vec![9.0; cp.k() * ld], vec![9.0; cp.k() * ld]);
            im2col(&cp, &inp, h, w, &mut a, ld);
            im2col_fast(&cp, &inp, h, w, &mut b, ld, &mut Vec::new());
            for r in 0..cp.k() {
                assert_eq!(
                    a[r * ld..r * ld + p],
                    b[r * ld..r * ld + p],
                    "im2col row {r}"
                );
            }
            let col: Vec<f32> = (0..cp.k() * ld).map(|_| rng.uniform(-1.0, 1.0)).collect();
            let (mut x, mut y) = (vec![5.0; 3 * h * w], vec![5.0; 3 * h * w]);
            col2im(&cp, &col, h, w, &mut x, ld);
            col2im_fast(&cp, &col, h, w, &mut y, ld, &mut Vec::new());
            for (i, (u, v)) in x.iter().zip(&y).enumerate() {
                assert!((u - v).abs() < 1e-6, "col2im[{i}] {u} vs {v}");
            }
        }
    }

    /// Random parameters for `layer` and a random input of `dims`, uniform in [-1, 1).
    fn random_inputs(layer: &Conv2d, rng: &mut Rng, dims: &[usize]) -> (Vec<f32>, Tensor) {
        let np: usize = layer.param_specs().iter().map(|s| s.numel()).sum();
        let p = (0..np).map(|_| rng.uniform(-1.0, 1.0)).collect();
        let n: usize = dims.iter().product();
        let inp = Tensor::from_vec(dims, (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect());
        (p, inp.unwrap())
    }

    /// After the training forward that left `out`: backward gives the same gradients as after an
    /// evaluation forward of the same input (which keeps no columns).
    fn assert_backward_stateless(
        layer: &mut Conv2d,
        p: &[f32],
        inp: &Tensor,
        out: &mut Tensor,
        rng: &mut Rng,
    ) {
        let dout: Vec<f32> = (0..out.numel()).map(|_| rng.uniform(-1.0, 1.0)).collect();
        let dout = Tensor::from_vec(out.dims(), dout).unwrap();
        let grads = |layer: &mut Conv2d, out: &Tensor| {
            let (mut dp, mut d) = (vec![0.0; p.len()], Tensor::default());
            layer.backward(Backward {
                p,
                dp: &mut dp,
                inp,
                out,
                dout: &dout,
                dinp: Some(&mut d),
            });
            (dp, d)
        };
        let (dp1, d1) = grads(layer, out);
        layer.forward(p, inp, out, false);
        let (dp2, d2) = grads(layer, out);
        assert_eq!(dp1, dp2);
        assert_eq!(d1.data(), d2.data());
    }

    /// Backward gives the same gradients whether it reuses the training forward's columns or
    /// recomputes them (after an evaluation forward on the same input).
    #[test]
    fn backward_with_and_without_kept_columns() {
        let cp = Conv2dParams::new(3, 4, 5, 1, 2);
        let mut layer = Conv2d::new(cp);
        let mut rng = Rng::new(8, 8);
        let (p, inp) = random_inputs(&layer, &mut rng, &[7, 3, 6, 5]);
        let mut out = Tensor::default();
        layer.forward(&p, &inp, &mut out, true);
        assert_backward_stateless(&mut layer, &p, &inp, &mut out, &mut rng);
    }

    /// The Winograd path (8 input channels, 5x5, padding 2) against direct loops, and its
    /// backward independent of which forward (training or evaluation) ran last.
    #[test]
    fn winograd_path_forward_and_stateless_backward() {
        let cp = Conv2dParams::new(8, 3, 5, 1, 2);
        let mut layer = Conv2d::new(cp);
        assert!(layer.winograd());
        let mut rng = Rng::new(9, 9);
        let (p, inp) = random_inputs(&layer, &mut rng, &[3, 8, 6, 5]);
        let mut out = Tensor::default();
        layer.forward(&p, &inp, &mut out, true);
        let mut reference = vec![0.0; out.numel()];
        let (w, b) = p.split_at(3 * cp.k());
        let shape = cp.for_input(3, 6, 5);
        conv2d_forward_cpu(&shape, &mut reference, inp.data(), w, b);
        for (x, y) in out.data().iter().zip(&reference) {
            assert!((x - y).abs() < 1e-4, "{x} vs {y}");
        }
        assert_backward_stateless(&mut layer, &p, &inp, &mut out, &mut rng);
    }

    #[test]
    fn conv2d_gradcheck() {
        // The Winograd path.
        {
            let cp = Conv2dParams::new(8, 2, 5, 1, 2);
            crate::ops::gradcheck::check(&mut Conv2d::new(cp), &[2, 8, 4, 3], true, 13);
        }
        for (stride, pad) in [(1, 2), (2, 1)] {
            let cp = Conv2dParams::new(2, 3, 3, stride, pad);
            crate::ops::gradcheck::check(&mut Conv2d::new(cp), &[2, 2, 5, 5], true, 11);
        }
        // Several samples, so the per-sample bookkeeping of the kept columns is checked too.
        {
            let cp = Conv2dParams::new(1, 2, 3, 1, 1);
            crate::ops::gradcheck::check(&mut Conv2d::new(cp), &[6, 1, 3, 3], true, 12);
        }
    }
}
