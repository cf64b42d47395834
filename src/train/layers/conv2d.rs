//! Conv2d (any stride and padding, no dilation or groups) as im2col + GEMM, one sample at a time.
//!
//! Per sample `n`, with `K = in_c*kh*kw` and `P = out_h*out_w`:
//! - forward:         `col[K, P] = im2col(inp_n)`, `out_n[OC, P] = W[OC, K] · col + bias`
//! - backward weight: `dW[OC, K] += dout_n[OC, P] · col^T`, `dbias[oc] += sum_p dout_n`
//! - backward input:  `dcol[K, P] = W^T · dout_n`, `dinp_n = col2im(dcol)`
//!
//! Why per sample rather than one GEMM for the whole batch: the per-sample column buffer of the
//! big layer (800 x 196 floats, 627 KB) stays in L2, the GEMM is already large (64 x 196 x 800),
//! the output lands directly in NCHW order (no transpose pass), and memory stays flat instead of
//! a 40 MB batch column matrix. The column buffers are allocated once and reused.

use super::{Init, Layer, ParamSpec};
use crate::train::kernels::{matmul, Trans};
use crate::train::tensor::Tensor;

/// Shape math of a 2-D convolution, shared by the layer, the reference and the tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dParams {
    /// Input channels.
    pub in_c: usize,
    /// Output channels.
    pub out_c: usize,
    /// Kernel height.
    pub kh: usize,
    /// Kernel width.
    pub kw: usize,
    /// Stride (both directions).
    pub stride: usize,
    /// Zero padding (both directions).
    pub pad: usize,
}

impl Conv2dParams {
    /// Output height for input height `h`.
    pub fn out_h(&self, h: usize) -> usize {
        (h + 2 * self.pad).saturating_sub(self.kh) / self.stride + 1
    }
    /// Output width for input width `w`.
    pub fn out_w(&self, w: usize) -> usize {
        (w + 2 * self.pad).saturating_sub(self.kw) / self.stride + 1
    }
    /// Output dimensions for `[N, C, H, W]`.
    pub fn out_dims(&self, inp: &[usize]) -> Result<Vec<usize>, String> {
        let &[n, c, h, w] = inp else {
            return Err(format!("conv2d expects [N, C, H, W] input, got {inp:?}"));
        };
        if c != self.in_c {
            return Err(format!("conv2d expects {} input channels, got {c}", self.in_c));
        }
        if h + 2 * self.pad < self.kh || w + 2 * self.pad < self.kw || self.stride == 0 {
            return Err(format!("conv2d kernel {}x{} does not fit input {h}x{w} with padding {}", self.kh, self.kw, self.pad));
        }
        Ok(vec![n, self.out_c, self.out_h(h), self.out_w(w)])
    }
    /// Columns of the unrolled kernel, `in_c * kh * kw` (the weight's fan-in).
    pub fn k(&self) -> usize {
        self.in_c * self.kh * self.kw
    }
}

/// 2-D convolution layer with its reusable column buffers.
#[derive(Clone, Debug)]
pub struct Conv2d {
    /// Shape parameters.
    pub params: Conv2dParams,
    col: Vec<f32>,  // (K, P) for the current sample
    dcol: Vec<f32>, // (K, P)
}

impl Conv2d {
    /// A convolution with the given shape.
    pub fn new(params: Conv2dParams) -> Conv2d {
        Conv2d { params, col: Vec::new(), dcol: Vec::new() }
    }
}

/// Unroll one sample `inp[C, H, W]` into `col[C*kh*kw, OH*OW]` (zeros where padding).
pub fn im2col(cp: &Conv2dParams, inp: &[f32], h: usize, w: usize, col: &mut [f32]) {
    let (oh, ow) = (cp.out_h(h), cp.out_w(w));
    let p = oh * ow;
    let mut row = 0;
    for c in 0..cp.in_c {
        let plane = &inp[c * h * w..(c + 1) * h * w];
        for ki in 0..cp.kh {
            for kj in 0..cp.kw {
                let dst = &mut col[row * p..(row + 1) * p];
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
                            drow[lo..hi].copy_from_slice(&src[s0..s0 + (hi - lo)]);
                        }
                        drow[hi.max(lo)..].fill(0.0);
                    } else {
                        for (ox, d) in drow.iter_mut().enumerate() {
                            let ix = (ox * cp.stride + kj) as isize - cp.pad as isize;
                            *d = if ix < 0 || ix >= w as isize { 0.0 } else { src[ix as usize] };
                        }
                    }
                }
                row += 1;
            }
        }
    }
}

/// Fold `col[C*kh*kw, OH*OW]` back into one sample `dinp[C, H, W]` (overwrites; overlapping
/// windows add up, padding positions are dropped).
pub fn col2im(cp: &Conv2dParams, col: &[f32], h: usize, w: usize, dinp: &mut [f32]) {
    let (oh, ow) = (cp.out_h(h), cp.out_w(w));
    let p = oh * ow;
    dinp[..cp.in_c * h * w].fill(0.0);
    let mut row = 0;
    for c in 0..cp.in_c {
        let plane = &mut dinp[c * h * w..(c + 1) * h * w];
        for ki in 0..cp.kh {
            for kj in 0..cp.kw {
                let src = &col[row * p..(row + 1) * p];
                for oy in 0..oh {
                    let iy = (oy * cp.stride + ki) as isize - cp.pad as isize;
                    if iy < 0 || iy >= h as isize {
                        continue;
                    }
                    let drow = &mut plane[iy as usize * w..(iy as usize + 1) * w];
                    let srow = &src[oy * ow..(oy + 1) * ow];
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

/// Naive CPU reference of the forward pass (direct loops), for tests.
pub fn conv2d_forward_cpu(cp: &Conv2dParams, out: &mut [f32], inp: &[f32], weight: &[f32], bias: &[f32], n: usize, h: usize, w: usize) {
    let (oh, ow) = (cp.out_h(h), cp.out_w(w));
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
                                    let x = inp[((b * cp.in_c + c) * h + iy as usize) * w + ix as usize];
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
    fn kind(&self) -> &'static str {
        "conv2d"
    }
    fn out_dims(&self, inp: &[usize]) -> Result<Vec<usize>, String> {
        self.params.out_dims(inp)
    }
    fn param_specs(&self) -> Vec<ParamSpec> {
        let cp = &self.params;
        let bound = 1.0 / (cp.k() as f32).sqrt();
        vec![
            ParamSpec { name: "weight", dims: vec![cp.out_c, cp.in_c, cp.kh, cp.kw], init: Init::Uniform(bound) },
            ParamSpec { name: "bias", dims: vec![cp.out_c], init: Init::Uniform(bound) },
        ]
    }
    fn forward(&mut self, p: &[f32], inp: &Tensor, out: &mut Tensor, _train: bool) {
        let cp = self.params;
        let (n, h, w) = (inp.dims()[0], inp.dims()[2], inp.dims()[3]);
        let (oh, ow) = (cp.out_h(h), cp.out_w(w));
        let (k, pp) = (cp.k(), oh * ow);
        out.resize(&[n, cp.out_c, oh, ow]);
        self.col.resize(k * pp, 0.0);
        let (weight, bias) = p.split_at(cp.out_c * k);
        let in_sz = cp.in_c * h * w;
        let out_sz = cp.out_c * pp;
        for b in 0..n {
            im2col(&cp, &inp.data()[b * in_sz..(b + 1) * in_sz], h, w, &mut self.col);
            let o = &mut out.data_mut()[b * out_sz..(b + 1) * out_sz];
            // Pre-fill with the bias and let GEMM accumulate onto it: saves a pass over the output.
            for (oc, row) in o.chunks_exact_mut(pp).enumerate() {
                row.fill(bias[oc]);
            }
            matmul(cp.out_c, pp, k, o, weight, Trans::No, &self.col, Trans::No, true);
        }
    }
    fn backward(&mut self, p: &[f32], dp: &mut [f32], inp: &Tensor, _out: &Tensor, dout: &Tensor, mut dinp: Option<&mut Tensor>) {
        let cp = self.params;
        let (n, h, w) = (inp.dims()[0], inp.dims()[2], inp.dims()[3]);
        let (oh, ow) = (cp.out_h(h), cp.out_w(w));
        let (k, pp) = (cp.k(), oh * ow);
        self.col.resize(k * pp, 0.0);
        let weight = &p[..cp.out_c * k];
        let (dweight, dbias) = dp.split_at_mut(cp.out_c * k);
        if let Some(d) = dinp.as_deref_mut() {
            d.resize(inp.dims());
            self.dcol.resize(k * pp, 0.0);
        }
        let in_sz = cp.in_c * h * w;
        let out_sz = cp.out_c * pp;
        for b in 0..n {
            let g = &dout.data()[b * out_sz..(b + 1) * out_sz];
            for (oc, row) in g.chunks_exact(pp).enumerate() {
                dbias[oc] += row.iter().sum::<f32>();
            }
            // The column buffer is recomputed rather than kept from forward: cheap next to the
            // GEMMs, and it keeps memory per layer at one sample's worth.
            im2col(&cp, &inp.data()[b * in_sz..(b + 1) * in_sz], h, w, &mut self.col);
            matmul(cp.out_c, k, pp, dweight, g, Trans::No, &self.col, Trans::Yes, true);
            if let Some(d) = dinp.as_deref_mut() {
                matmul(k, pp, cp.out_c, &mut self.dcol, weight, Trans::Yes, g, Trans::No, false);
                col2im(&cp, &self.dcol, h, w, &mut d.data_mut()[b * in_sz..(b + 1) * in_sz]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::rng::Rng;

    #[test]
    fn conv2d_forward_matches_direct_loops() {
        for (stride, pad) in [(1, 0), (1, 2), (2, 1), (3, 0)] {
            let cp = Conv2dParams { in_c: 3, out_c: 4, kh: 3, kw: 2, stride, pad };
            let mut layer = Conv2d::new(cp);
            let mut rng = Rng::new(5, 5);
            let np: usize = layer.param_specs().iter().map(|s| s.numel()).sum();
            let p: Vec<f32> = (0..np).map(|_| rng.uniform(-1.0, 1.0)).collect();
            let dims = [2, 3, 7, 6];
            let inp = Tensor::from_vec(&dims, (0..2 * 3 * 42).map(|_| rng.uniform(-1.0, 1.0)).collect()).unwrap();
            let mut out = Tensor::default();
            layer.forward(&p, &inp, &mut out, true);
            let mut reference = vec![0.0; out.numel()];
            let (w, b) = p.split_at(4 * cp.k());
            conv2d_forward_cpu(&cp, &mut reference, inp.data(), w, b, 2, 7, 6);
            for (i, (x, y)) in out.data().iter().zip(&reference).enumerate() {
                assert!((x - y).abs() < 1e-4, "stride {stride} pad {pad}: out[{i}] {x} vs {y}");
            }
        }
    }

    #[test]
    fn conv2d_gradcheck() {
        for (stride, pad) in [(1, 2), (2, 1)] {
            let cp = Conv2dParams { in_c: 2, out_c: 3, kh: 3, kw: 3, stride, pad };
            crate::train::layers::gradcheck::check(&mut Conv2d::new(cp), &[2, 2, 5, 5], true, 11);
        }
    }
}
