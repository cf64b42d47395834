//! Linear: `out[N, OUT] = inp[N, IN] · W^T + b`, with `W` in PyTorch's `[OUT, IN]` layout.
//!
//! Backward: `dW[OUT, IN] += dout^T · inp`, `db += Σ_n dout`, `dinp = dout · W`.

pub mod twin;

use super::{Backward, Layer, LayerSpec, ParamSpec};
use crate::gemm::{matmul, Trans};
use crate::tensor::Tensor;

/// Fully connected layer.
#[derive(Clone, Debug)]
pub struct Linear {
    /// Input features.
    pub in_f: usize,
    /// Output features.
    pub out_f: usize,
}

impl Linear {
    /// A `in_f -> out_f` layer.
    pub fn new(in_f: usize, out_f: usize) -> Linear {
        Linear { in_f, out_f }
    }
}

/// One linear launch: the batch and the layer's features, the scalar arguments of
/// `kernels/linear.cu` shared by its CPU twins, the GPU launcher and the plan (the forward's fused
/// ReLU flag follows them as its own argument).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearShape {
    /// Samples (rows of the input).
    pub batch: usize,
    /// Input features.
    pub in_f: usize,
    /// Output features.
    pub out_f: usize,
}

impl LinearShape {
    /// The shape from the kernels' scalar arguments, in `kernels/linear.cu`'s order:
    /// `[batch, in_f, out_f]` (C `int`, never negative).
    pub fn from_kernel_args(a: [i32; 3]) -> LinearShape {
        let [batch, in_f, out_f] = a.map(|v| v as usize);
        LinearShape { batch, in_f, out_f }
    }
    /// The kernels' scalar arguments, the inverse of [`LinearShape::from_kernel_args`].
    pub fn kernel_args(&self) -> [i32; 3] {
        [self.batch, self.in_f, self.out_f].map(|v| v as i32)
    }
}

impl Layer for Linear {
    fn spec(&self) -> LayerSpec {
        LayerSpec::Linear {
            in_f: self.in_f,
            out_f: self.out_f,
        }
    }
    fn out_dims(&self, inp: &[usize]) -> Result<Vec<usize>, String> {
        match *inp {
            [n, f] if f == self.in_f => Ok(vec![n, self.out_f]),
            _ => Err(format!("linear expects [N, {}], got {inp:?}", self.in_f)),
        }
    }
    fn param_specs(&self) -> Vec<ParamSpec> {
        ParamSpec::weight_and_bias(vec![self.out_f, self.in_f], self.in_f)
    }
    fn forward(&mut self, p: &[f32], inp: &Tensor, out: &mut Tensor, _train: bool) {
        let n = inp.dims()[0];
        out.resize(&[n, self.out_f]);
        let (w, b) = p.split_at(self.out_f * self.in_f);
        for row in out.data_mut().chunks_exact_mut(self.out_f) {
            row.copy_from_slice(b);
        }
        matmul(
            (n, self.out_f, self.in_f),
            out.data_mut(),
            (inp.data(), Trans::No),
            (w, Trans::Yes),
            true,
        );
    }
    fn backward(&mut self, args: Backward<'_>) {
        let n = args.inp.dims()[0];
        let (dw, db) = args.dp.split_at_mut(self.out_f * self.in_f);
        for row in args.dout.data().chunks_exact(self.out_f) {
            for (d, g) in db.iter_mut().zip(row) {
                *d += g;
            }
        }
        matmul(
            (self.out_f, self.in_f, n),
            dw,
            (args.dout.data(), Trans::Yes),
            (args.inp.data(), Trans::No),
            true,
        );
        if let Some(dinp) = args.dinp {
            dinp.resize(args.inp.dims());
            let w = &args.p[..self.out_f * self.in_f];
            matmul(
                (n, self.in_f, self.out_f),
                dinp.data_mut(),
                (args.dout.data(), Trans::No),
                (w, Trans::No),
                false,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn linear_gradcheck() {
        crate::ops::gradcheck::check(&mut super::Linear::new(5, 3), &[4, 5], true, 9);
    }
}
