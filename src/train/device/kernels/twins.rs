//! CPU twins of every `kernels/*.cu` entry point (as llm.c keeps a CPU reference beside each kernel): the same name and argument
//! order, device pointers become slices (`&mut` where the kernel writes), scalars keep their C
//! types (`i32` for `int`, `i64` for `long long`). Each twin implements the math documented in its
//! `.cu` header and nothing else, so a kernel is checked against its twin on random inputs
//! (`tests/gpu_kernels.rs`) and the twin against the engine's CPU layers (`tests/twins.rs`, which
//! runs everywhere).
//!
//! Arithmetic: f32, with the kernel's conventions (activation gradients OVERWRITTEN, parameter
//! gradients ACCUMULATED). GEMM-shaped sums (conv, linear) accumulate in f32 like the kernels'
//! tiles; per-channel statistics (BatchNorm) and the loss accumulate in f64, a closer stand-in for
//! the kernels' tree reductions than one long sequential f32 sum.
//!
//! FMA contraction: NVRTC compiles with `-fmad=true` (its default, kept because it is faster and
//! more accurate), so the GPU evaluates `a * b + c` as one `fmaf`. Where a rounding difference
//! decides something discrete (BatchNorm's output feeds the fused ReLU's mask: a value that
//! rounds to +0 on one side and to a tiny positive number on the other flips the mask), the twin
//! uses [`f32::mul_add`] for the same expressions, so both sides round once. Elsewhere the
//! tolerances absorb the last-bit differences. `_bf16` and `_f16` twins take
//! `half::bf16` / `half::f16` operands, widen them exactly, and accumulate in f32 as the kernels do.
//! A `NULL`-able pointer (conv/linear bias, BatchNorm `out` when `relu = 0`, the SGD buffer when
//! `momentum = 0`) is an `Option` or may be an empty slice, as documented per function.
//!
//! Sizes are trusted like the kernels trust them: a slice shorter than its shape says panics
//! (index out of bounds), which in a test is the bug report.

use half::{bf16, f16};

use crate::train::layers::Conv2dParams;

/// Convolution shape from the kernels' scalar arguments.
fn conv_params(in_c: i32, out_c: i32, kh: i32, kw: i32, stride: i32, pad: i32) -> Conv2dParams {
    Conv2dParams {
        in_c: in_c as usize,
        out_c: out_c as usize,
        kh: kh as usize,
        kw: kw as usize,
        stride: stride as usize,
        pad: pad as usize,
    }
}

/// Exact widening of a kernel operand (f32, bf16 or f16) to f32.
trait Operand: Copy {
    fn f(self) -> f32;
}
impl Operand for f32 {
    #[inline(always)]
    fn f(self) -> f32 {
        self
    }
}
impl Operand for bf16 {
    #[inline(always)]
    fn f(self) -> f32 {
        self.to_f32()
    }
}
impl Operand for f16 {
    #[inline(always)]
    fn f(self) -> f32 {
        self.to_f32()
    }
}

// ------------------------------------------------------------------------------------------------
// elementwise.cu

/// `out[i] = value` for `i < n`.
pub fn fill_f32(out: &mut [f32], value: f32, n: i64) {
    out[..n as usize].iter_mut().for_each(|v| *v = value);
}
/// `x[i] *= alpha` for `i < n`.
pub fn scale_f32(x: &mut [f32], alpha: f32, n: i64) {
    x[..n as usize].iter_mut().for_each(|v| *v *= alpha);
}
/// `y[i] += alpha * x[i]` for `i < n`.
pub fn axpy_f32(y: &mut [f32], x: &[f32], alpha: f32, n: i64) {
    y[..n as usize]
        .iter_mut()
        .zip(x)
        .for_each(|(y, x)| *y += alpha * x);
}

/// `out[i] += partials[i] + partials[n + i] + ... + partials[(splits - 1) * n + i]`, the planes
/// summed in slice order from plane 0 and added to `out` once (the second half of a split-K
/// weight gradient; see [`conv2d_backward_weight_f32`]).
pub fn splitk_reduce_f32(out: &mut [f32], partials: &[f32], splits: i32, n: i64) {
    let n = n as usize;
    for (i, o) in out[..n].iter_mut().enumerate() {
        let mut s = partials[i];
        for z in 1..splits.max(1) as usize {
            s += partials[z * n + i];
        }
        *o += s;
    }
}

/// The K range of each split-K slice, as `gemm_tile` (common.cuh) cuts it: `splits` slices of
/// `ceil(ceil(K / splits) / 32) * 32` (the last ones shorter, possibly empty).
pub fn split_k_ranges(k: usize, splits: usize) -> Vec<std::ops::Range<usize>> {
    let splits = splits.max(1);
    let chunk = k.div_ceil(splits).div_ceil(GEMM_BK) * GEMM_BK;
    (0..splits)
        .map(|z| (z * chunk).min(k)..((z + 1) * chunk).min(k))
        .collect()
}

/// K chunk of the GEMM core (`GEMM_BK` in common.cuh).
const GEMM_BK: usize = 32;

/// Store a weight gradient as the kernels do (`accumulate_out` in common.cuh): with `partials`
/// empty, `dweight[e] += sum(e, 0..K)`; otherwise `partials` holds `splits` planes of
/// `dweight.len()` values and plane `z` is overwritten with `sum(e, slice z)`.
fn store_weight_grad(
    dweight: &mut [f32],
    partials: &mut [f32],
    plane: usize,
    k: usize,
    sum: impl Fn(usize, std::ops::Range<usize>) -> f32,
) {
    if partials.is_empty() {
        for (e, d) in dweight[..plane].iter_mut().enumerate() {
            *d += sum(e, 0..k);
        }
        return;
    }
    let splits = partials.len() / plane.max(1);
    for (z, r) in split_k_ranges(k, splits).into_iter().enumerate() {
        for e in 0..plane {
            partials[z * plane + e] = sum(e, r.clone());
        }
    }
}

// ------------------------------------------------------------------------------------------------
// activation.cu

/// `out[i] = max(inp[i], 0)`.
pub fn relu_forward_f32(out: &mut [f32], inp: &[f32], n: i32) {
    for i in 0..n as usize {
        out[i] = inp[i].max(0.0);
    }
}

/// `dinp[i] = out[i] > 0 ? dout[i] : 0` (overwritten).
pub fn relu_backward_f32(dinp: &mut [f32], out: &[f32], dout: &[f32], n: i32) {
    for i in 0..n as usize {
        dinp[i] = if out[i] > 0.0 { dout[i] } else { 0.0 };
    }
}

// ------------------------------------------------------------------------------------------------
// batchnorm.cu

/// Training-mode BatchNorm2d: batch statistics (biased variance, two passes), saved mean and
/// 1/std, running estimates updated with the unbiased variance, optional fused ReLU.
#[allow(clippy::too_many_arguments)]
pub fn batchnorm2d_forward_train_f32(
    out: &mut [f32],
    save_mean: &mut [f32],
    save_invstd: &mut [f32],
    running_mean: &mut [f32],
    running_var: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    bias: &[f32],
    batch: i32,
    channels: i32,
    hw: i32,
    momentum: f32,
    eps: f32,
    relu: i32,
) {
    let (n, c, hw) = (batch as usize, channels as usize, hw as usize);
    let cnt = n * hw;
    for ch in 0..c {
        let plane = |b: usize| (b * c + ch) * hw..(b * c + ch + 1) * hw;
        let s: f64 = (0..n)
            .map(|b| inp[plane(b)].iter().map(|&x| x as f64).sum::<f64>())
            .sum();
        let mean = (s / cnt as f64) as f32;
        let q: f64 = (0..n)
            .map(|b| {
                inp[plane(b)]
                    .iter()
                    .map(|&x| ((x - mean) as f64).powi(2))
                    .sum::<f64>()
            })
            .sum();
        let var = (q / cnt as f64) as f32;
        let invstd = 1.0 / (var + eps).sqrt();
        save_mean[ch] = mean;
        save_invstd[ch] = invstd;
        let unbiased = if cnt > 1 {
            var * cnt as f32 / (cnt - 1) as f32
        } else {
            var
        };
        running_mean[ch] = (1.0 - momentum) * running_mean[ch] + momentum * mean;
        running_var[ch] = (1.0 - momentum) * running_var[ch] + momentum * unbiased;
        let scale = invstd * weight[ch];
        // FMA contraction as the kernel gets it (see the module docs): `bias - mean * scale` and
        // `x * scale + shift` are each one fused multiply-add on the GPU.
        let shift = (-mean).mul_add(scale, bias[ch]);
        for b in 0..n {
            for i in plane(b) {
                let y = inp[i].mul_add(scale, shift);
                out[i] = if relu != 0 { y.max(0.0) } else { y };
            }
        }
    }
}

/// Evaluation-mode BatchNorm2d with the running statistics (optional fused ReLU).
#[allow(clippy::too_many_arguments)]
pub fn batchnorm2d_forward_eval_f32(
    out: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    bias: &[f32],
    running_mean: &[f32],
    running_var: &[f32],
    batch: i32,
    channels: i32,
    hw: i32,
    eps: f32,
    relu: i32,
) {
    let (c, hw) = (channels as usize, hw as usize);
    for i in 0..batch as usize * c * hw {
        let ch = (i / hw) % c;
        let invstd = 1.0 / (running_var[ch] + eps).sqrt();
        let y = ((inp[i] - running_mean[ch]) * invstd).mul_add(weight[ch], bias[ch]);
        out[i] = if relu != 0 { y.max(0.0) } else { y };
    }
}

/// BatchNorm2d backward: `dbias`, `dweight` accumulated, `dinp` overwritten; with `relu != 0`
/// the incoming gradient is masked by `out > 0` (`out` is unused, and may be empty, when `relu = 0`).
#[allow(clippy::too_many_arguments)]
pub fn batchnorm2d_backward_f32(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dbias: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    out: &[f32],
    weight: &[f32],
    save_mean: &[f32],
    save_invstd: &[f32],
    batch: i32,
    channels: i32,
    hw: i32,
    relu: i32,
) {
    let (n, c, hw) = (batch as usize, channels as usize, hw as usize);
    let cnt = (n * hw) as f32;
    // `!(out > 0)`, not `out <= 0`: a NaN output masks its gradient, as in the kernel.
    #[allow(clippy::neg_cmp_op_on_partial_ord)]
    let g = |i: usize| {
        if relu != 0 && !(out[i] > 0.0) {
            0.0
        } else {
            dout[i]
        }
    };
    for ch in 0..c {
        let (mean, invstd) = (save_mean[ch], save_invstd[ch]);
        let plane = |b: usize| (b * c + ch) * hw..(b * c + ch + 1) * hw;
        let (mut sg, mut sgx) = (0.0f64, 0.0f64);
        for b in 0..n {
            for i in plane(b) {
                sg += g(i) as f64;
                sgx += (g(i) * (inp[i] - mean) * invstd) as f64;
            }
        }
        let (sg, sgx) = (sg as f32, sgx as f32);
        dbias[ch] += sg;
        dweight[ch] += sgx;
        let k = weight[ch] * invstd;
        let (mg, mgx) = (sg / cnt, sgx / cnt);
        for b in 0..n {
            for i in plane(b) {
                let xhat = (inp[i] - mean) * invstd;
                dinp[i] = k * (-xhat).mul_add(mgx, g(i) - mg);
            }
        }
    }
}

/// The f32, bf16 and f16 twins of one kernel: all call the generic body with the same
/// arguments; the arguments marked `op` are `&[f32]`, `&[bf16]` and `&[f16]` in turn, the others
/// keep the type given in parentheses.
macro_rules! twin_pair {
    ($(#[doc = $d32:literal])* $f32:ident, $(#[doc = $d16:literal])* $bf16:ident, $(#[doc = $dh:literal])* $f16:ident,
     $imp:ident($($arg:ident: $kind:tt),* $(,)?)) => {
        $(#[doc = $d32])*
        #[allow(clippy::too_many_arguments)]
        pub fn $f32($($arg: twin_arg!($kind, f32)),*) {
            $imp($($arg),*)
        }
        $(#[doc = $d16])*
        #[allow(clippy::too_many_arguments)]
        pub fn $bf16($($arg: twin_arg!($kind, bf16)),*) {
            $imp($($arg),*)
        }
        $(#[doc = $dh])*
        #[allow(clippy::too_many_arguments)]
        pub fn $f16($($arg: twin_arg!($kind, f16)),*) {
            $imp($($arg),*)
        }
    };
}

/// The type of one `twin_pair!` argument.
macro_rules! twin_arg {
    (op, $t:ty) => {
        &[$t]
    };
    (($fixed:ty), $t:ty) => {
        $fixed
    };
}

// ------------------------------------------------------------------------------------------------
// conv2d.cu

#[allow(clippy::too_many_arguments)]
fn conv2d_forward_t<T: Operand>(
    out: &mut [f32],
    inp: &[T],
    weight: &[T],
    bias: Option<&[f32]>,
    batch: i32,
    in_c: i32,
    in_h: i32,
    in_w: i32,
    out_c: i32,
    kh: i32,
    kw: i32,
    stride: i32,
    pad: i32,
) {
    let cp = conv_params(in_c, out_c, kh, kw, stride, pad);
    let (ih, iw) = (in_h as usize, in_w as usize);
    let (oh, ow) = (cp.out_h(ih), cp.out_w(iw));
    for n in 0..batch as usize {
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

#[allow(clippy::too_many_arguments)]
fn conv2d_backward_input_t<T: Operand>(
    dinp: &mut [f32],
    dout: &[T],
    weight: &[T],
    batch: i32,
    in_c: i32,
    in_h: i32,
    in_w: i32,
    out_c: i32,
    kh: i32,
    kw: i32,
    stride: i32,
    pad: i32,
) {
    let cp = conv_params(in_c, out_c, kh, kw, stride, pad);
    let (ih, iw) = (in_h as usize, in_w as usize);
    let (oh, ow) = (cp.out_h(ih), cp.out_w(iw));
    let s = cp.stride as isize;
    for n in 0..batch as usize {
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

#[allow(clippy::too_many_arguments)]
fn conv2d_backward_weight_t<T: Operand>(
    dweight: &mut [f32],
    partials: &mut [f32],
    dout: &[T],
    inp: &[T],
    batch: i32,
    in_c: i32,
    in_h: i32,
    in_w: i32,
    out_c: i32,
    kh: i32,
    kw: i32,
    stride: i32,
    pad: i32,
) {
    let cp = conv_params(in_c, out_c, kh, kw, stride, pad);
    let (ih, iw) = (in_h as usize, in_w as usize);
    let (oh, ow) = (cp.out_h(ih), cp.out_w(iw));
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
    store_weight_grad(
        dweight,
        partials,
        cp.out_c * k,
        batch as usize * oh * ow,
        sum,
    );
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
        batch: (i32),
        in_c: (i32),
        in_h: (i32),
        in_w: (i32),
        out_c: (i32),
        kh: (i32),
        kw: (i32),
        stride: (i32),
        pad: (i32)
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
        batch: (i32),
        in_c: (i32),
        in_h: (i32),
        in_w: (i32),
        out_c: (i32),
        kh: (i32),
        kw: (i32),
        stride: (i32),
        pad: (i32)
    )
);
twin_pair!(
    /// `dweight += Σ dout * im2col(inp)` (accumulated) when `partials` is empty (one K slice).
    /// Split-K: `partials` holds `splits` planes of `dweight.len()` values; plane `z` is
    /// overwritten with slice `z`'s sum (K = batch*out_h*out_w cut by [`split_k_ranges`]) and
    /// `dweight` is untouched until [`splitk_reduce_f32`] adds the planes.
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
        batch: (i32),
        in_c: (i32),
        in_h: (i32),
        in_w: (i32),
        out_c: (i32),
        kh: (i32),
        kw: (i32),
        stride: (i32),
        pad: (i32)
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

// ------------------------------------------------------------------------------------------------
// linear.cu

#[allow(clippy::too_many_arguments)]
fn linear_forward_t<T: Operand>(
    out: &mut [f32],
    inp: &[T],
    weight: &[T],
    bias: Option<&[f32]>,
    batch: i32,
    in_f: i32,
    out_f: i32,
    relu: i32,
) {
    let (inf, outf) = (in_f as usize, out_f as usize);
    for b in 0..batch as usize {
        for o in 0..outf {
            let mut acc = 0.0f32;
            for i in 0..inf {
                acc += inp[b * inf + i].f() * weight[o * inf + i].f();
            }
            let y = acc + bias.map_or(0.0, |bi| bi[o]);
            out[b * outf + o] = if relu != 0 { y.max(0.0) } else { y };
        }
    }
}

fn linear_backward_input_t<T: Operand>(
    dinp: &mut [f32],
    dout: &[T],
    weight: &[T],
    batch: i32,
    in_f: i32,
    out_f: i32,
) {
    let (inf, outf) = (in_f as usize, out_f as usize);
    for b in 0..batch as usize {
        for i in 0..inf {
            let mut acc = 0.0f32;
            for o in 0..outf {
                acc += dout[b * outf + o].f() * weight[o * inf + i].f();
            }
            dinp[b * inf + i] = acc;
        }
    }
}

fn linear_backward_weight_t<T: Operand>(
    dweight: &mut [f32],
    partials: &mut [f32],
    dout: &[T],
    inp: &[T],
    batch: i32,
    in_f: i32,
    out_f: i32,
) {
    let (inf, outf) = (in_f as usize, out_f as usize);
    // Element e = (o, i) of dweight, summed over the batch rows in `bs` (the GEMM's K).
    let sum = |e: usize, bs: std::ops::Range<usize>| {
        let (o, i) = (e / inf, e % inf);
        let mut acc = 0.0f32;
        for b in bs {
            acc += dout[b * outf + o].f() * inp[b * inf + i].f();
        }
        acc
    };
    store_weight_grad(dweight, partials, outf * inf, batch as usize, sum);
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
    linear_forward_t(out: (&mut [f32]), inp: op, weight: op, bias: (Option<&[f32]>), batch: (i32), in_f: (i32), out_f: (i32), relu: (i32))
);
twin_pair!(
    /// `dinp = dout · weight` (overwritten).
    linear_backward_input_f32,
    /// bf16 operands: see [`linear_backward_input_f32`].
    linear_backward_input_bf16,
    /// fp16 operands: see [`linear_backward_input_f32`].
    linear_backward_input_f16,
    linear_backward_input_t(dinp: (&mut [f32]), dout: op, weight: op, batch: (i32), in_f: (i32), out_f: (i32))
);
twin_pair!(
    /// `dweight += doutᵀ · inp` (accumulated) when `partials` is empty; split-K (K = batch) into
    /// the planes of `partials` otherwise, as [`conv2d_backward_weight_f32`].
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
        batch: (i32),
        in_f: (i32),
        out_f: (i32)
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

// ------------------------------------------------------------------------------------------------
// loss.cu

/// Softmax + cross-entropy per row, the mean loss in `mean_loss[0]` and the number of rows whose
/// first maximum is the target in `correct[0]` (both overwritten).
#[allow(clippy::too_many_arguments)]
pub fn softmax_xent_forward_f32(
    losses: &mut [f32],
    probs: &mut [f32],
    mean_loss: &mut [f32],
    correct: &mut [i32],
    logits: &[f32],
    targets: &[i32],
    batch: i32,
    classes: i32,
) {
    let c = classes as usize;
    let (mut total, mut nc) = (0.0f64, 0i32);
    for b in 0..batch as usize {
        let z = &logits[b * c..(b + 1) * c];
        let (mut mx, mut am) = (f32::NEG_INFINITY, c);
        for (j, &v) in z.iter().enumerate() {
            if v > mx {
                mx = v;
                am = j;
            }
        }
        let s: f32 = z.iter().map(|&v| (v - mx).exp()).sum();
        let inv = 1.0 / s;
        for j in 0..c {
            probs[b * c + j] = (z[j] - mx).exp() * inv;
        }
        let t = targets[b] as usize;
        let l = s.ln() - (z[t] - mx);
        losses[b] = l;
        total += l as f64;
        nc += (am == t) as i32;
    }
    mean_loss[0] = if batch > 0 {
        (total / batch as f64) as f32
    } else {
        0.0
    };
    correct[0] = nc;
}

/// `dlogits = (probs - onehot(targets)) * (scale[0] / batch)` (overwritten): the loss-scaled
/// gradient of fp16 training.
pub fn softmax_xent_backward_scaled_f32(
    dlogits: &mut [f32],
    probs: &[f32],
    targets: &[i32],
    batch: i32,
    classes: i32,
    scale: &[f32],
) {
    let c = classes as usize;
    let k = scale[0] / batch as f32;
    for i in 0..batch as usize * c {
        let (b, j) = (i / c, i % c);
        dlogits[i] = (probs[i] - if j as i32 == targets[b] { 1.0 } else { 0.0 }) * k;
    }
}

/// `dlogits = (probs - onehot(targets)) / batch` (overwritten).
pub fn softmax_xent_backward_f32(
    dlogits: &mut [f32],
    probs: &[f32],
    targets: &[i32],
    batch: i32,
    classes: i32,
) {
    let c = classes as usize;
    let inv_b = 1.0 / batch as f32;
    for i in 0..batch as usize * c {
        let (b, j) = (i / c, i % c);
        dlogits[i] = (probs[i] - if j as i32 == targets[b] { 1.0 } else { 0.0 }) * inv_b;
    }
}

// ------------------------------------------------------------------------------------------------
// optim.cu

/// One Adam step (L2 weight decay added to the gradient; `step` is 1-based and includes this one).
#[allow(clippy::too_many_arguments)]
pub fn adam_step_f32(
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    n: i32,
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    step: i32,
) {
    let bc1 = 1.0 - (beta1 as f64).powf(step as f64);
    let bc2 = 1.0 - (beta2 as f64).powf(step as f64);
    let step_size = (lr as f64 / bc1) as f32;
    let bc2_sqrt = bc2.sqrt() as f32;
    for i in 0..n as usize {
        let p = params[i];
        let mut g = grads[i];
        if weight_decay != 0.0 {
            g += weight_decay * p;
        }
        let mi = crate::train::optim::flush(beta1 * m[i] + (1.0 - beta1) * g);
        let vi = crate::train::optim::flush(beta2 * v[i] + (1.0 - beta2) * g * g);
        m[i] = mi;
        v[i] = vi;
        let denom = vi.sqrt() / bc2_sqrt + eps;
        params[i] = p - step_size * mi / denom;
    }
}

/// `grads *= 1 / scale[0]`; `found_inf[0] = 1` when any unscaled gradient is inf or NaN (left
/// as it was otherwise: the step zeroes it first).
pub fn amp_unscale_f32(grads: &mut [f32], found_inf: &mut [f32], scale: &[f32], n: i32) {
    let inv = 1.0 / scale[0];
    let mut bad = false;
    for g in &mut grads[..n as usize] {
        *g *= inv;
        bad |= !g.is_finite();
    }
    if bad {
        found_inf[0] = 1.0;
    }
}

/// Threads per block of the clipping reductions (`CLIP_THREADS` in optim.cu): the width of their
/// fixed summation tree.
pub const CLIP_THREADS: usize = 256;

/// The kernels' pairwise tree over one block's thread sums (`clip_tree_sum` in optim.cu):
/// `s[t] += s[t + stride]` for stride 128, 64, ..., 1.
fn clip_tree_sum(mut s: [f64; CLIP_THREADS]) -> f64 {
    let mut stride = CLIP_THREADS / 2;
    while stride > 0 {
        for t in 0..stride {
            s[t] += s[t + stride];
        }
        stride /= 2;
    }
    s[0]
}

/// Partial gradient norms, in the kernel's exact order (so bit-identical to it): partial `k` is
/// `sqrt` of the tree sum over threads `t` of the f64 sums of `g²` over elements
/// `k*256 + t + j*num_partials*256`.
pub fn grad_norm_partials_f32(partials: &mut [f32], grads: &[f32], n: i32, num_partials: i32) {
    let (n, np) = (n.max(0) as usize, num_partials.max(0) as usize);
    for (k, out) in partials[..np].iter_mut().enumerate() {
        let mut s = [0.0f64; CLIP_THREADS];
        for (t, acc) in s.iter_mut().enumerate() {
            for &g in grads[..n]
                .iter()
                .skip(k * CLIP_THREADS + t)
                .step_by(np * CLIP_THREADS)
            {
                *acc += g as f64 * g as f64;
            }
        }
        *out = clip_tree_sum(s).sqrt() as f32;
    }
}

/// The clipping coefficient from the partial norms: `total = sqrt(Σ partials²)` (thread `t` sums
/// partials `t, t + 256, ...` in f64, then the tree); `coef[0] = max_norm / (total + 1e-6)` when
/// `total` is finite and that is below 1, else 1; `norm[0] = total`; a non-finite total records
/// `step` in `nonfinite_step[0]` unless it already holds an earlier one (non-zero).
pub fn grad_norm_coef_f32(
    coef: &mut [f32],
    norm: &mut [f32],
    nonfinite_step: &mut [i32],
    partials: &[f32],
    num_partials: i32,
    max_norm: f32,
    step: i32,
) {
    let mut s = [0.0f64; CLIP_THREADS];
    for (t, acc) in s.iter_mut().enumerate() {
        for &p in partials[..num_partials.max(0) as usize]
            .iter()
            .skip(t)
            .step_by(CLIP_THREADS)
        {
            *acc += p as f64 * p as f64;
        }
    }
    let total = clip_tree_sum(s).sqrt();
    let c = max_norm as f64 / (total + 1e-6);
    coef[0] = if total.is_finite() && c < 1.0 {
        c as f32
    } else {
        1.0
    };
    norm[0] = total as f32;
    if !total.is_finite() && nonfinite_step[0] == 0 {
        nonfinite_step[0] = step;
    }
}

/// `grads[i] *= coef[0]` (the clipping coefficient, 1 when no clipping is needed).
pub fn clip_grad_scale_f32(grads: &mut [f32], coef: &[f32], n: i32) {
    let c = coef[0];
    for g in &mut grads[..n.max(0) as usize] {
        *g *= c;
    }
}

/// One SGD step (momentum, dampening, Nesterov, L2 weight decay); `first != 0` seeds the buffer
/// with the gradient. `buf` may be empty when `momentum == 0`.
#[allow(clippy::too_many_arguments)]
pub fn sgd_step_f32(
    params: &mut [f32],
    grads: &[f32],
    buf: &mut [f32],
    n: i32,
    lr: f32,
    momentum: f32,
    dampening: f32,
    weight_decay: f32,
    nesterov: i32,
    first: i32,
) {
    for i in 0..n as usize {
        let p = params[i];
        let mut g = grads[i] + weight_decay * p;
        if momentum != 0.0 {
            let b = if first != 0 {
                g
            } else {
                momentum * buf[i] + (1.0 - dampening) * g
            };
            buf[i] = b;
            g = if nesterov != 0 { g + momentum * b } else { b };
        }
        params[i] = p - lr * g;
    }
}

// ------------------------------------------------------------------------------------------------
// pool.cu

/// Max pooling with saved argmax offsets (`iy*in_w + ix` inside the plane); first maximum wins
/// ties, NaN propagates.
#[allow(clippy::too_many_arguments)]
pub fn maxpool2d_forward_f32(
    out: &mut [f32],
    indices: &mut [i32],
    inp: &[f32],
    batch: i32,
    channels: i32,
    in_h: i32,
    in_w: i32,
    kernel: i32,
    stride: i32,
) {
    let (ih, iw, k, s) = (
        in_h as usize,
        in_w as usize,
        kernel as usize,
        stride as usize,
    );
    let (oh, ow) = ((ih - k) / s + 1, (iw - k) / s + 1);
    for plane in 0..(batch * channels) as usize {
        let src = &inp[plane * ih * iw..(plane + 1) * ih * iw];
        for oy in 0..oh {
            for ox in 0..ow {
                let (y0, x0) = (oy * s, ox * s);
                let (mut best, mut arg) = (f32::NEG_INFINITY, y0 * iw + x0);
                for ky in 0..k {
                    for kx in 0..k {
                        let idx = (y0 + ky) * iw + x0 + kx;
                        let v = src[idx];
                        if v > best || (v.is_nan() && !best.is_nan()) {
                            best = v;
                            arg = idx;
                        }
                    }
                }
                let o = (plane * oh + oy) * ow + ox;
                out[o] = best;
                indices[o] = arg as i32;
            }
        }
    }
}

/// `dinp` (overwritten) = Σ of `dout` over the windows whose saved argmax is that input pixel.
#[allow(clippy::too_many_arguments)]
pub fn maxpool2d_backward_f32(
    dinp: &mut [f32],
    dout: &[f32],
    indices: &[i32],
    batch: i32,
    channels: i32,
    in_h: i32,
    in_w: i32,
    kernel: i32,
    stride: i32,
) {
    let (ih, iw, k, s) = (
        in_h as usize,
        in_w as usize,
        kernel as usize,
        stride as usize,
    );
    let (oh, ow) = ((ih - k) / s + 1, (iw - k) / s + 1);
    for plane in 0..(batch * channels) as usize {
        let d = &mut dinp[plane * ih * iw..(plane + 1) * ih * iw];
        d.fill(0.0);
        for o in plane * oh * ow..(plane + 1) * oh * ow {
            d[indices[o] as usize] += dout[o];
        }
    }
}

// ------------------------------------------------------------------------------------------------
// data.cu

/// `images[b, j] = dataset_images[indices[b], j] / 255`, `labels[b] = dataset_labels[indices[b]]`.
#[allow(clippy::too_many_arguments)]
pub fn gather_batch_f32(
    images: &mut [f32],
    labels: &mut [i32],
    dataset_images: &[u8],
    dataset_labels: &[u8],
    indices: &[i32],
    batch: i32,
    image_size: i32,
) {
    let sz = image_size as usize;
    for b in 0..batch as usize {
        let src = indices[b] as usize * sz;
        for j in 0..sz {
            images[b * sz + j] = dataset_images[src + j] as f32 / 255.0;
        }
        labels[b] = dataset_labels[indices[b] as usize] as i32;
    }
}

/// Host stand-in for one `BucketEntry` of `bucket_flatten_f32`: the tensor itself instead of its
/// device address, and its offset in the bucket (both in f32 elements).
#[derive(Debug)]
pub struct BucketSrc<'a> {
    /// The tensor (the kernel's `ptr`).
    pub tensor: &'a [f32],
    /// Offset in the bucket.
    pub offset: i64,
    /// Elements.
    pub len: i64,
}

/// Host stand-in for one `BucketEntry` of `bucket_unflatten_f32` (the tensor is written).
#[derive(Debug)]
pub struct BucketDst<'a> {
    /// The tensor (the kernel's `ptr`).
    pub tensor: &'a mut [f32],
    /// Offset in the bucket.
    pub offset: i64,
    /// Elements.
    pub len: i64,
}

/// `bucket[offset + i] = tensor[i]` for every entry.
pub fn bucket_flatten_f32(bucket: &mut [f32], table: &[BucketSrc<'_>], num_entries: i32) {
    for e in &table[..num_entries as usize] {
        let (o, l) = (e.offset as usize, e.len as usize);
        bucket[o..o + l].copy_from_slice(&e.tensor[..l]);
    }
}

/// `tensor[i] = bucket[offset + i] * scale` for every entry.
pub fn bucket_unflatten_f32(
    table: &mut [BucketDst<'_>],
    bucket: &[f32],
    num_entries: i32,
    scale: f32,
) {
    for e in &mut table[..num_entries as usize] {
        let (o, l) = (e.offset as usize, e.len as usize);
        for (d, &s) in e.tensor[..l].iter_mut().zip(&bucket[o..o + l]) {
            *d = s * scale;
        }
    }
}

/// `out[i] = bf16(inp[i])`, round to nearest even (NaN stays NaN).
pub fn cast_f32_bf16(out: &mut [bf16], inp: &[f32], n: i32) {
    for i in 0..n as usize {
        out[i] = bf16::from_f32(inp[i]);
    }
}

/// `out[i] = f32(inp[i])` (exact).
pub fn cast_bf16_f32(out: &mut [f32], inp: &[bf16], n: i32) {
    for i in 0..n as usize {
        out[i] = inp[i].to_f32();
    }
}

/// `out[i] = f16(inp[i])`, round to nearest even (beyond ±65504 to ±infinity, NaN stays NaN).
pub fn cast_f32_f16(out: &mut [f16], inp: &[f32], n: i32) {
    for i in 0..n as usize {
        out[i] = f16::from_f32(inp[i]);
    }
}

/// `out[i] = f32(inp[i])` (exact).
pub fn cast_f16_f32(out: &mut [f32], inp: &[f16], n: i32) {
    for i in 0..n as usize {
        out[i] = inp[i].to_f32();
    }
}

/// Every entry point that has a twin here, by kernel file (checked against the registry by a unit
/// test, so a new kernel without a twin fails CI).
pub const TWINS: &[&str] = &[
    "fill_f32",
    "scale_f32",
    "axpy_f32",
    "splitk_reduce_f32",
    "relu_forward_f32",
    "relu_backward_f32",
    "batchnorm2d_forward_train_f32",
    "batchnorm2d_forward_eval_f32",
    "batchnorm2d_backward_f32",
    "conv2d_forward_f32",
    "conv2d_forward_bf16",
    "conv2d_forward_f16",
    "conv2d_backward_input_f32",
    "conv2d_backward_input_bf16",
    "conv2d_backward_input_f16",
    "conv2d_backward_weight_f32",
    "conv2d_backward_weight_bf16",
    "conv2d_backward_weight_f16",
    "conv2d_backward_bias_f32",
    "conv2d_backward_bias_bf16",
    "conv2d_backward_bias_f16",
    "linear_forward_f32",
    "linear_forward_bf16",
    "linear_forward_f16",
    "linear_backward_input_f32",
    "linear_backward_input_bf16",
    "linear_backward_input_f16",
    "linear_backward_weight_f32",
    "linear_backward_weight_bf16",
    "linear_backward_weight_f16",
    "linear_backward_bias_f32",
    "linear_backward_bias_bf16",
    "linear_backward_bias_f16",
    "softmax_xent_forward_f32",
    "softmax_xent_backward_f32",
    "softmax_xent_backward_scaled_f32",
    "adam_step_f32",
    "sgd_step_f32",
    "amp_unscale_f32",
    "grad_norm_partials_f32",
    "grad_norm_coef_f32",
    "clip_grad_scale_f32",
    "maxpool2d_forward_f32",
    "maxpool2d_backward_f32",
    "gather_batch_f32",
    "bucket_flatten_f32",
    "bucket_unflatten_f32",
    "cast_f32_bf16",
    "cast_bf16_f32",
    "cast_f32_f16",
    "cast_f16_f32",
];
