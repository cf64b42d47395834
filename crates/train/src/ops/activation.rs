//! ReLU (`kernels/activation.cu`): `out = max(inp, 0)`; backward passes `dout` where the output
//! is positive. One implementation serves the CPU layer ([`Relu`]) and the kernels' CPU twins
//! ([`relu_forward_f32`], [`relu_backward_f32`]): the math is element-wise, so there is no
//! summation order to reproduce.

use super::{Backward, Layer, LayerSpec};
use crate::tensor::Tensor;

/// Element-wise rectifier (no saved state: backward reads the output the model kept).
#[derive(Clone, Debug, Default)]
pub struct Relu;

/// CPU reference: `out[i] = max(inp[i], 0)`.
pub fn relu_forward(out: &mut [f32], inp: &[f32]) {
    for (o, &x) in out.iter_mut().zip(inp) {
        *o = x.max(0.0);
    }
}

/// CPU reference: `dinp[i] = dout[i]` where `out[i] > 0`, else 0 (overwrites).
pub fn relu_backward(dinp: &mut [f32], out: &[f32], dout: &[f32]) {
    for ((d, &o), &g) in dinp.iter_mut().zip(out).zip(dout) {
        *d = if o > 0.0 { g } else { 0.0 };
    }
}

/// CPU twin of `relu_forward_f32` (`kernels/activation.cu`): `out[i] = max(inp[i], 0)` over the
/// first `n` elements.
pub fn relu_forward_f32(out: &mut [f32], inp: &[f32], n: i32) {
    let n = n as usize;
    relu_forward(&mut out[..n], &inp[..n]);
}

/// CPU twin of `relu_backward_f32`: `dinp[i] = out[i] > 0 ? dout[i] : 0` (overwritten) over the
/// first `n` elements.
pub fn relu_backward_f32(dinp: &mut [f32], out: &[f32], dout: &[f32], n: i32) {
    let n = n as usize;
    relu_backward(&mut dinp[..n], &out[..n], &dout[..n]);
}

impl Layer for Relu {
    fn spec(&self) -> LayerSpec {
        LayerSpec::Relu
    }
    fn out_dims(&self, inp: &[usize]) -> Result<Vec<usize>, String> {
        Ok(inp.to_vec())
    }
    fn forward(&mut self, _p: &[f32], inp: &Tensor, out: &mut Tensor, _train: bool) {
        out.resize(inp.dims());
        relu_forward(out.data_mut(), inp.data());
    }
    fn backward(&mut self, args: Backward<'_>) {
        if let Some(dinp) = args.dinp {
            dinp.resize(args.inp.dims());
            relu_backward(dinp.data_mut(), args.out.data(), args.dout.data());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn relu_gradcheck() {
        // Inputs near 0 make the kink visible to finite differences; the checker draws from
        // [-1, 1] with a 1e-2 step, and a collision is unlikely with this seed.
        crate::ops::gradcheck::check_with_step(&mut Relu, &[2, 3, 4], true, 3, 1e-3);
    }
}
