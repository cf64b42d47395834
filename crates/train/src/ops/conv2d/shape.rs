//! The shape of a 2-D convolution: hyperparameters and output-size math, shared by the layer,
//! the twins, the device plan and the tests.

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
    /// A square `k`×`k` kernel, in `torch.nn.Conv2d`'s argument order (in channels, out
    /// channels, kernel size, stride, padding).
    pub const fn new(in_c: usize, out_c: usize, k: usize, stride: usize, pad: usize) -> Self {
        Conv2dParams {
            in_c,
            out_c,
            kh: k,
            kw: k,
            stride,
            pad,
        }
    }
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
            return Err(format!(
                "conv2d expects {} input channels, got {c}",
                self.in_c
            ));
        }
        if h + 2 * self.pad < self.kh || w + 2 * self.pad < self.kw || self.stride == 0 {
            return Err(format!(
                "conv2d kernel {}x{} does not fit input {h}x{w} with padding {}",
                self.kh, self.kw, self.pad
            ));
        }
        Ok(vec![n, self.out_c, self.out_h(h), self.out_w(w)])
    }
    /// This layer over `batch` inputs of `in_h x in_w`.
    pub fn for_input(self, batch: usize, in_h: usize, in_w: usize) -> Conv2dShape {
        Conv2dShape {
            params: self,
            batch,
            in_h,
            in_w,
        }
    }
    /// Columns of the unrolled kernel, `in_c * kh * kw` (the weight's fan-in).
    pub fn k(&self) -> usize {
        self.in_c * self.kh * self.kw
    }
}

/// A convolution over a batch: the layer's [`Conv2dParams`] and the input's batch size and plane
/// (`Conv2dShape { n, c_in, h, w, c_out, k, stride, pad }` in the kernels' words).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dShape {
    /// The layer's channels, kernel, stride and padding.
    pub params: Conv2dParams,
    /// Samples.
    pub batch: usize,
    /// Input height.
    pub in_h: usize,
    /// Input width.
    pub in_w: usize,
}

impl Conv2dShape {
    /// The shape from the kernels' scalar arguments, in `kernels/conv2d.cu`'s order:
    /// `[batch, in_c, in_h, in_w, out_c, kh, kw, stride, pad]` (C `int`, never negative).
    pub fn from_kernel_args(a: [i32; 9]) -> Conv2dShape {
        let [batch, in_c, in_h, in_w, out_c, kh, kw, stride, pad] = a.map(|v| v as usize);
        Conv2dShape {
            params: Conv2dParams {
                in_c,
                out_c,
                kh,
                kw,
                stride,
                pad,
            },
            batch,
            in_h,
            in_w,
        }
    }
    /// The kernels' scalar arguments, the inverse of [`Conv2dShape::from_kernel_args`].
    pub fn kernel_args(&self) -> [i32; 9] {
        let p = &self.params;
        [
            self.batch, p.in_c, self.in_h, self.in_w, p.out_c, p.kh, p.kw, p.stride, p.pad,
        ]
        .map(|v| v as i32)
    }
    /// Output height.
    pub fn out_h(&self) -> usize {
        self.params.out_h(self.in_h)
    }
    /// Output width.
    pub fn out_w(&self) -> usize {
        self.params.out_w(self.in_w)
    }
}
