//! CPU twins of `kernels/conv2d.cu`: 2-D convolution forward, input, weight and bias gradients,
//! in f32, bf16 and f16 operands.
//!
//! The conventions every twin follows are in the module documentation (`ops/twins.rs`); the
//! kernels' nine shape arguments arrive as one [`Conv2dShape`].

use half::{bf16, f16};

use super::Conv2dShape;

use crate::gemm::twin::{store_weight_grad, twin_pair, Operand};

fn conv2d_forward_t<T: Operand>(
    out: &mut [f32],
    inp: &[T],
    weight: &[T],
    bias: Option<&[f32]>,
    shape: Conv2dShape,
) {
    let (cp, batch) = (shape.params, shape.batch);
    let (ih, iw) = (shape.in_h, shape.in_w);
    let (oh, ow) = (shape.out_h(), shape.out_w());
    for n in 0..batch {
        for oc in 0..cp.out_c {
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut acc = 0.0f32;
                    for ic in 0..cp.in_c {
                        for ky in 0..cp.kh {
                            let iy = (oy * cp.stride + ky) as isize - cp.pad as isize;
                            if iy < 0 || iy >= ih as isize {
                                continue;
                            }
                            for kx in 0..cp.kw {
                                let ix = (ox * cp.stride + kx) as isize - cp.pad as isize;
                                if ix < 0 || ix >= iw as isize {
                                    continue;
                                }
                                let x = inp
                                    [((n * cp.in_c + ic) * ih + iy as usize) * iw + ix as usize]
                                    .f();
                                let w = weight[((oc * cp.in_c + ic) * cp.kh + ky) * cp.kw + kx].f();
                                acc += w * x;
                            }
                        }
                    }
                    out[((n * cp.out_c + oc) * oh + oy) * ow + ox] =
                        acc + bias.map_or(0.0, |b| b[oc]);
                }
            }
        }
    }
}

fn conv2d_backward_input_t<T: Operand>(
    dinp: &mut [f32],
    dout: &[T],
    weight: &[T],
    shape: Conv2dShape,
) {
    let (cp, batch) = (shape.params, shape.batch);
    let (ih, iw) = (shape.in_h, shape.in_w);
    let (oh, ow) = (shape.out_h(), shape.out_w());
    let s = cp.stride as isize;
    for n in 0..batch {
        for ic in 0..cp.in_c {
            for iy in 0..ih {
                for ix in 0..iw {
                    let mut acc = 0.0f32;
                    for oc in 0..cp.out_c {
                        for ky in 0..cp.kh {
                            let ty = iy as isize + cp.pad as isize - ky as isize;
                            if ty < 0 || ty % s != 0 || (ty / s) as usize >= oh {
                                continue;
                            }
                            for kx in 0..cp.kw {
                                let tx = ix as isize + cp.pad as isize - kx as isize;
                                if tx < 0 || tx % s != 0 || (tx / s) as usize >= ow {
                                    continue;
                                }
                                let (oy, ox) = ((ty / s) as usize, (tx / s) as usize);
                                let w = weight[((oc * cp.in_c + ic) * cp.kh + ky) * cp.kw + kx].f();
                                acc += w * dout[((n * cp.out_c + oc) * oh + oy) * ow + ox].f();
                            }
                        }
                    }
                    dinp[((n * cp.in_c + ic) * ih + iy) * iw + ix] = acc;
                }
            }
        }
    }
}

fn conv2d_backward_weight_t<T: Operand>(
    dweight: &mut [f32],
    partials: &mut [f32],
    dout: &[T],
    inp: &[T],
    shape: Conv2dShape,
) {
    let (cp, batch) = (shape.params, shape.batch);
    let (ih, iw) = (shape.in_h, shape.in_w);
    let (oh, ow) = (shape.out_h(), shape.out_w());
    let k = cp.k();
    // Element e = (oc, ic, ky, kx) of dweight, summed over GEMM K indices q = (n, oy, ox) in `qs`.
    let sum = |e: usize, qs: std::ops::Range<usize>| {
        let (oc, kk) = (e / k, e % k);
        let (ic, r) = (kk / (cp.kh * cp.kw), kk % (cp.kh * cp.kw));
        let (ky, kx) = (r / cp.kw, r % cp.kw);
        let mut acc = 0.0f32;
        let ohw = oh * ow;
        if qs.is_empty() || ohw == 0 {
            return acc;
        }
        // In q order (as the GEMM's K), row by row: n, then oy, then ox within the slice.
        for n in qs.start / ohw..=(qs.end - 1) / ohw {
            let (lo, hi) = (
                qs.start.max(n * ohw) - n * ohw,
                qs.end.min((n + 1) * ohw) - n * ohw,
            );
            for oy in lo / ow..=(hi - 1) / ow {
                let iy = (oy * cp.stride + ky) as isize - cp.pad as isize;
                if iy < 0 || iy >= ih as isize {
                    continue;
                }
                let ox_lo = if oy == lo / ow { lo % ow } else { 0 };
                let ox_hi = if oy == (hi - 1) / ow {
                    (hi - 1) % ow + 1
                } else {
                    ow
                };
                let (grow, xrow) = (
                    ((n * cp.out_c + oc) * oh + oy) * ow,
                    ((n * cp.in_c + ic) * ih + iy as usize) * iw,
                );
                for ox in ox_lo..ox_hi {
                    let ix = (ox * cp.stride + kx) as isize - cp.pad as isize;
                    if ix < 0 || ix >= iw as isize {
                        continue;
                    }
                    acc += dout[grow + ox].f() * inp[xrow + ix as usize].f();
                }
            }
        }
        acc
    };
    store_weight_grad(dweight, partials, cp.out_c * k, batch * oh * ow, sum);
}

fn conv2d_backward_bias_t<T: Operand>(
    dbias: &mut [f32],
    dout: &[T],
    batch: i32,
    out_c: i32,
    out_h: i32,
    out_w: i32,
) {
    let (oc_n, ohw) = (out_c as usize, (out_h * out_w) as usize);
    for oc in 0..oc_n {
        let mut acc = 0.0f32;
        for n in 0..batch as usize {
            acc += dout[(n * oc_n + oc) * ohw..(n * oc_n + oc + 1) * ohw]
                .iter()
                .map(|v| v.f())
                .sum::<f32>();
        }
        dbias[oc] += acc;
    }
}

twin_pair!(
    /// `out = bias + conv(inp, weight)` (NCHW, groups 1, dilation 1); `bias: None` is the kernel's NULL.
    conv2d_forward_f32,
    /// bf16 operands, f32 accumulation and output: see [`conv2d_forward_f32`].
    conv2d_forward_bf16,
    /// fp16 operands, f32 accumulation and output: see [`conv2d_forward_f32`].
    conv2d_forward_f16,
    conv2d_forward_t(
        out: (&mut [f32]),
        inp: op,
        weight: op,
        bias: (Option<&[f32]>),
        shape: (Conv2dShape)
    )
);
twin_pair!(
    /// `dinp` (overwritten) from `dout` and `weight`.
    conv2d_backward_input_f32,
    /// bf16 operands: see [`conv2d_backward_input_f32`].
    conv2d_backward_input_bf16,
    /// fp16 operands: see [`conv2d_backward_input_f32`].
    conv2d_backward_input_f16,
    conv2d_backward_input_t(
        dinp: (&mut [f32]),
        dout: op,
        weight: op,
        shape: (Conv2dShape)
    )
);
twin_pair!(
    /// `dweight += Σ dout * im2col(inp)` (accumulated) when `partials` is empty (one K slice).
    /// Split-K: `partials` holds `splits` planes of `dweight.len()` values; plane `z` is
    /// overwritten with slice `z`'s sum (K = batch*out_h*out_w cut by [`split_k_ranges`](crate::ops::twins::split_k_ranges)) and
    /// `dweight` is untouched until [`splitk_reduce_f32`](crate::ops::twins::splitk_reduce_f32) adds the planes.
    conv2d_backward_weight_f32,
    /// bf16 operands: see [`conv2d_backward_weight_f32`].
    conv2d_backward_weight_bf16,
    /// fp16 operands: see [`conv2d_backward_weight_f32`].
    conv2d_backward_weight_f16,
    conv2d_backward_weight_t(
        dweight: (&mut [f32]),
        partials: (&mut [f32]),
        dout: op,
        inp: op,
        shape: (Conv2dShape)
    )
);
twin_pair!(
    /// `dbias[oc] += Σ_{n,oy,ox} dout` (accumulated).
    conv2d_backward_bias_f32,
    /// bf16 `dout`: see [`conv2d_backward_bias_f32`].
    conv2d_backward_bias_bf16,
    /// fp16 `dout`: see [`conv2d_backward_bias_f32`].
    conv2d_backward_bias_f16,
    conv2d_backward_bias_t(dbias: (&mut [f32]), dout: op, batch: (i32), out_c: (i32), out_h: (i32), out_w: (i32))
);
