//! MaxPool2d (kernel k, stride s, no padding): forward saves the argmax of every window so
//! backward is a scatter of `dout` to those positions.

pub mod twin;

use super::{Backward, Layer, LayerSpec};
use crate::tensor::Tensor;

/// Max pooling over `[N, C, H, W]` with floor output size, as PyTorch's default.
#[derive(Clone, Debug)]
pub struct MaxPool2d {
    /// Window size.
    pub kernel: usize,
    /// Step between windows.
    pub stride: usize,
    /// `(N, C, OH, OW)` index into the input plane of every window's maximum; written by the
    /// fused BatchNorm + ReLU + pool forward too (`BatchNorm2d::forward_relu_pool`).
    pub(crate) argmax: Vec<u32>,
}

impl MaxPool2d {
    /// A pool with window `kernel` and stride `stride`.
    pub fn new(kernel: usize, stride: usize) -> MaxPool2d {
        MaxPool2d {
            kernel,
            stride,
            argmax: Vec::new(),
        }
    }
}

/// One max pooling launch: the batch, the input planes and the window, the scalar arguments of
/// `kernels/pool.cu` shared by its CPU twins, the GPU launcher and the plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pool2dShape {
    /// Samples.
    pub batch: usize,
    /// Channels (planes per sample).
    pub channels: usize,
    /// Input height.
    pub in_h: usize,
    /// Input width.
    pub in_w: usize,
    /// Window size.
    pub kernel: usize,
    /// Step between windows.
    pub stride: usize,
}

impl Pool2dShape {
    /// The shape from the kernels' scalar arguments, in `kernels/pool.cu`'s order:
    /// `[batch, channels, in_h, in_w, kernel, stride]` (C `int`, never negative).
    pub fn from_kernel_args(a: [i32; 6]) -> Pool2dShape {
        let [batch, channels, in_h, in_w, kernel, stride] = a.map(|v| v as usize);
        Pool2dShape {
            batch,
            channels,
            in_h,
            in_w,
            kernel,
            stride,
        }
    }
    /// The kernels' scalar arguments, the inverse of [`Pool2dShape::from_kernel_args`].
    pub fn kernel_args(&self) -> [i32; 6] {
        [
            self.batch,
            self.channels,
            self.in_h,
            self.in_w,
            self.kernel,
            self.stride,
        ]
        .map(|v| v as i32)
    }
    /// Planes of the batch, `batch * channels`.
    pub fn planes(&self) -> usize {
        self.batch * self.channels
    }
    /// Output height (floor, no padding).
    pub fn out_h(&self) -> usize {
        (self.in_h - self.kernel) / self.stride + 1
    }
    /// Output width (floor, no padding).
    pub fn out_w(&self) -> usize {
        (self.in_w - self.kernel) / self.stride + 1
    }
}

impl Layer for MaxPool2d {
    fn spec(&self) -> LayerSpec {
        LayerSpec::MaxPool2d {
            kernel: self.kernel,
            stride: self.stride,
        }
    }
    fn out_dims(&self, inp: &[usize]) -> Result<Vec<usize>, String> {
        match *inp {
            [n, c, h, w] if h >= self.kernel && w >= self.kernel && self.stride > 0 => Ok(vec![
                n,
                c,
                (h - self.kernel) / self.stride + 1,
                (w - self.kernel) / self.stride + 1,
            ]),
            _ => Err(format!(
                "maxpool2d({}) expects [N, C, H, W] with H, W >= {}, got {inp:?}",
                self.kernel, self.kernel
            )),
        }
    }
    fn forward(&mut self, _p: &[f32], inp: &Tensor, out: &mut Tensor, _train: bool) {
        let d = inp.dims();
        let (h, w) = (d[2], d[3]);
        let od = self.out_dims(d).unwrap_or_else(|_| vec![d[0], d[1], 0, 0]);
        let (oh, ow) = (od[2], od[3]);
        out.resize(&od);
        self.argmax.resize(out.numel(), 0);
        let x = inp.data();
        let y = out.data_mut();
        if self.kernel == 2 && self.stride == 2 {
            // The common case, unrolled: two input rows per output row, four candidates per window,
            // first maximum wins (`>`), as PyTorch.
            for plane in 0..d[0] * d[1] {
                let xp = &x[plane * h * w..(plane + 1) * h * w];
                let base = plane * oh * ow;
                for oy in 0..oh {
                    let r0 = 2 * oy * w;
                    let (row0, row1) = (&xp[r0..r0 + w], &xp[r0 + w..r0 + 2 * w]);
                    let yo = &mut y[base + oy * ow..base + (oy + 1) * ow];
                    let ao = &mut self.argmax[base + oy * ow..base + (oy + 1) * ow];
                    for ox in 0..ow {
                        let c = 2 * ox;
                        let (mut best, mut bi) = (row0[c], r0 + c);
                        if row0[c + 1] > best {
                            best = row0[c + 1];
                            bi = r0 + c + 1;
                        }
                        if row1[c] > best {
                            best = row1[c];
                            bi = r0 + w + c;
                        }
                        if row1[c + 1] > best {
                            best = row1[c + 1];
                            bi = r0 + w + c + 1;
                        }
                        yo[ox] = best;
                        ao[ox] = bi as u32;
                    }
                }
            }
            return;
        }
        for plane in 0..d[0] * d[1] {
            let xp = &x[plane * h * w..(plane + 1) * h * w];
            for oy in 0..oh {
                for ox in 0..ow {
                    let (mut best, mut bi) = (f32::NEG_INFINITY, 0usize);
                    for ky in 0..self.kernel {
                        let row = (oy * self.stride + ky) * w + ox * self.stride;
                        for kx in 0..self.kernel {
                            let v = xp[row + kx];
                            // `>` keeps the first maximum, as PyTorch does; NaN propagates.
                            if v > best || v.is_nan() {
                                best = v;
                                bi = row + kx;
                            }
                        }
                    }
                    let o = plane * oh * ow + oy * ow + ox;
                    y[o] = best;
                    self.argmax[o] = bi as u32;
                }
            }
        }
    }
    fn backward(&mut self, args: Backward<'_>) {
        let Some(dinp) = args.dinp else { return };
        let d = args.inp.dims();
        let hw = d[2] * d[3];
        let ohw = args.out.dims()[2] * args.out.dims()[3];
        dinp.resize(d);
        let dx = dinp.data_mut();
        dx.fill(0.0);
        let g = args.dout.data();
        for plane in 0..d[0] * d[1] {
            for o in plane * ohw..(plane + 1) * ohw {
                dx[plane * hw + self.argmax[o] as usize] += g[o];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    /// The gradient check of a `kernel`-wide, `stride` pool on `dims` (seed `seed`), with a
    /// small step so no perturbation moves a window's maximum to another element.
    fn gradcheck(kernel: usize, stride: usize, dims: &[usize], seed: u64) {
        let mut mp = MaxPool2d::new(kernel, stride);
        crate::ops::gradcheck::check_with_step(&mut mp, dims, true, seed, 1e-3);
    }
    #[test]
    fn maxpool_gradcheck() {
        gradcheck(2, 2, &[2, 2, 4, 5], 5);
    }
    #[test]
    fn maxpool_general_path_gradcheck() {
        gradcheck(3, 2, &[2, 2, 7, 5], 6);
    }
    #[test]
    fn maxpool_values() {
        let mut mp = MaxPool2d::new(2, 2);
        let inp =
            Tensor::from_vec(&[1, 1, 2, 4], vec![1.0, 5.0, 2.0, 0.0, 3.0, 4.0, 7.0, 8.0]).unwrap();
        let mut out = Tensor::default();
        mp.forward(&[], &inp, &mut out, true);
        assert_eq!(out.data(), &[5.0, 8.0]);
    }
}
