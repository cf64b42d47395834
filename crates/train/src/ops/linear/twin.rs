//! CPU twins of `kernels/linear.cu`: the fully connected layer forward, input, weight and bias
//! gradients, in f32, bf16 and f16 operands.
//!
//! The conventions every twin follows are in the module documentation (`ops/twins.rs`); the
//! kernels' `batch, in_f, out_f` arrive as one [`LinearShape`].

use half::{bf16, f16};

use super::LinearShape;
use crate::gemm::twin::{dot, store_weight_grad, twin_pair, Operand};

fn linear_forward_t<T: Operand>(
    out: &mut [f32],
    inp: &[T],
    weight: &[T],
    bias: Option<&[f32]>,
    shape: LinearShape,
    relu: i32,
) {
    let LinearShape { batch, in_f, out_f } = shape;
    for b in 0..batch {
        for o in 0..out_f {
            let acc = dot(in_f, |i| inp[b * in_f + i].f() * weight[o * in_f + i].f());
            let y = acc + bias.map_or(0.0, |bi| bi[o]);
            out[b * out_f + o] = if relu != 0 { y.max(0.0) } else { y };
        }
    }
}

fn linear_backward_input_t<T: Operand>(
    dinp: &mut [f32],
    dout: &[T],
    weight: &[T],
    shape: LinearShape,
) {
    let LinearShape { batch, in_f, out_f } = shape;
    for b in 0..batch {
        for i in 0..in_f {
            dinp[b * in_f + i] = dot(out_f, |o| {
                dout[b * out_f + o].f() * weight[o * in_f + i].f()
            });
        }
    }
}

fn linear_backward_weight_t<T: Operand>(
    dweight: &mut [f32],
    partials: &mut [f32],
    dout: &[T],
    inp: &[T],
    shape: LinearShape,
) {
    let LinearShape { batch, in_f, out_f } = shape;
    // Element e = (o, i) of dweight, summed over the batch rows in `bs` (the GEMM's K).
    let sum = |e: usize, bs: std::ops::Range<usize>| {
        let (o, i) = (e / in_f, e % in_f);
        bs.fold(0.0f32, |acc, b| {
            acc + dout[b * out_f + o].f() * inp[b * in_f + i].f()
        })
    };
    store_weight_grad(dweight, partials, out_f * in_f, batch, sum);
}

fn linear_backward_bias_t<T: Operand>(dbias: &mut [f32], dout: &[T], batch: i32, out_f: i32) {
    let outf = out_f as usize;
    for o in 0..outf {
        let mut acc = 0.0f32;
        for b in 0..batch as usize {
            acc += dout[b * outf + o].f();
        }
        dbias[o] += acc;
    }
}

twin_pair!(
    /// `out = inp · weightᵀ + bias`, then ReLU when `relu != 0`; `bias: None` is the kernel's NULL.
    linear_forward_f32,
    /// bf16 operands: see [`linear_forward_f32`].
    linear_forward_bf16,
    /// fp16 operands: see [`linear_forward_f32`].
    linear_forward_f16,
    linear_forward_t(out: (&mut [f32]), inp: op, weight: op, bias: (Option<&[f32]>), shape: (LinearShape), relu: (i32))
);
twin_pair!(
    /// `dinp = dout · weight` (overwritten).
    linear_backward_input_f32,
    /// bf16 operands: see [`linear_backward_input_f32`].
    linear_backward_input_bf16,
    /// fp16 operands: see [`linear_backward_input_f32`].
    linear_backward_input_f16,
    linear_backward_input_t(dinp: (&mut [f32]), dout: op, weight: op, shape: (LinearShape))
);
twin_pair!(
    /// `dweight += doutᵀ · inp` (accumulated) when `partials` is empty; split-K (K = batch) into
    /// the planes of `partials` otherwise, as
    /// [`conv2d_backward_weight_f32`](crate::ops::twins::conv2d_backward_weight_f32).
    linear_backward_weight_f32,
    /// bf16 operands: see [`linear_backward_weight_f32`].
    linear_backward_weight_bf16,
    /// fp16 operands: see [`linear_backward_weight_f32`].
    linear_backward_weight_f16,
    linear_backward_weight_t(
        dweight: (&mut [f32]),
        partials: (&mut [f32]),
        dout: op,
        inp: op,
        shape: (LinearShape)
    )
);
twin_pair!(
    /// `dbias += Σ_b dout` (accumulated).
    linear_backward_bias_f32,
    /// bf16 `dout`: see [`linear_backward_bias_f32`].
    linear_backward_bias_bf16,
    /// fp16 `dout`: see [`linear_backward_bias_f32`].
    linear_backward_bias_f16,
    linear_backward_bias_t(dbias: (&mut [f32]), dout: op, batch: (i32), out_f: (i32))
);
