//! Flatten: `[N, C, H, W] -> [N, C*H*W]`. The NCHW storage is already in PyTorch's flatten order,
//! so forward and backward are copies.

use super::{Backward, Layer, LayerSpec};
use crate::tensor::Tensor;

/// Collapse all but the batch dimension.
#[derive(Clone, Debug, Default)]
pub struct Flatten;

impl Layer for Flatten {
    fn spec(&self) -> LayerSpec {
        LayerSpec::Flatten
    }
    fn out_dims(&self, inp: &[usize]) -> Result<Vec<usize>, String> {
        match inp.split_first() {
            Some((n, rest)) => Ok(vec![*n, rest.iter().product()]),
            None => Err("flatten needs at least one dimension".into()),
        }
    }
    fn forward(&mut self, _p: &[f32], inp: &Tensor, out: &mut Tensor, _train: bool) {
        let n = inp.dims()[0];
        out.resize(&[n, inp.numel() / n.max(1)]);
        out.data_mut().copy_from_slice(inp.data());
    }
    fn backward(&mut self, args: Backward<'_>) {
        if let Some(dinp) = args.dinp {
            dinp.resize(args.inp.dims());
            dinp.data_mut().copy_from_slice(args.dout.data());
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn flatten_gradcheck() {
        crate::ops::gradcheck::check(&mut super::Flatten, &[2, 3, 2, 2], true, 4);
    }
}
