//! The launch builder: one method per kernel entry point, emitting an [`Op`] with the right
//! entry point, argument order and launch geometry. The geometry sits next to each launch
//! (as llm.c keeps launch geometry beside each launcher), copied from the `.cu` headers; the arguments are checked against the
//! generated signature table by [`Op::check_signature`] and, on a GPU, by the launch builder.
//!
//! Conventions of the kernels carry over: activation gradients are overwritten, parameter
//! gradients accumulate.

use super::ir::{
    AdamHyper, Arena, Arg, BnTensors, ClipTensors, LossTensors, Op, Precision, Region,
};
use crate::device::kernels::KernelId;
use crate::ops::{Bn2dShape, Conv2dShape, LinearShape, Pool2dShape};
use lockstep::cuda::KernelGrid;

/// Threads per block of the tiled GEMM core (`GEMM_THREADS` in common.cuh).
const GEMM_THREADS: u32 = 128;
/// Output tile of the GEMM core (`GEMM_BM` = `GEMM_BN` = 64).
const GEMM_TILE: usize = 64;
/// K chunk of the GEMM core (`GEMM_BK`).
const GEMM_BK: usize = 32;

fn cfg(grid: (usize, usize, usize), block: u32) -> KernelGrid {
    let c = |v: usize| v.clamp(1, 65535) as u32;
    KernelGrid {
        grid: (c(grid.0), c(grid.1), c(grid.2)),
        block: (block, 1, 1),
        shared_mem: 0,
    }
}

/// GEMM grid for C[M, N] with `splits` K slices: (ceil(N/64), ceil(M/64), splits), block 128.
fn gemm_cfg(m: usize, n: usize, splits: usize) -> KernelGrid {
    cfg(
        (n.div_ceil(GEMM_TILE), m.div_ceil(GEMM_TILE), splits.max(1)),
        GEMM_THREADS,
    )
}

/// Split-K factor for an accumulating GEMM: about two blocks per SM, at most one 32-wide K
/// chunk per slice (conv2d.cu header).
fn split_k(m: usize, n: usize, k: usize, sm_count: usize) -> usize {
    let tiles = n.div_ceil(GEMM_TILE) * m.div_ceil(GEMM_TILE);
    (2 * sm_count / tiles.max(1)).clamp(1, k.div_ceil(GEMM_BK).max(1))
}

/// Partial norms of the gradient-norm clipping (`grad_norm_partials_f32`'s `num_partials`): a
/// constant, not the device's SM count, so the summation order, and with it the norm, is the same
/// on every GPU.
pub const CLIP_PARTIALS: usize = 256;

/// Threads per block of the clipping reductions (`CLIP_THREADS` in optim.cu).
const CLIP_THREADS: u32 = 256;

/// SM count the split-K workspace is sized for ([`splitk_workspace_len`]): above every current
/// GPU's. A device with more SMs still runs correctly, with fewer slices than it could use.
pub const SPLIT_K_MAX_SMS: usize = 256;

/// Floats of split-K workspace a weight gradient C[M, N] over K needs on any device of up to
/// [`SPLIT_K_MAX_SMS`] SMs (the layout reserves the largest over the model's GEMMs).
pub fn splitk_workspace_len(m: usize, n: usize, k: usize) -> usize {
    let splits = split_k(m, n, k, SPLIT_K_MAX_SMS);
    if splits > 1 {
        splits * m * n
    } else {
        0
    }
}

/// Slices actually launched for `splits` wanted: `gemm_tile` cuts K into chunks of
/// `ceil(ceil(K / splits) / 32) * 32`, so the last wanted slices may be empty; launching only the
/// non-empty ones keeps every plane of the workspace meaningful and saves their blocks.
fn nonempty_splits(k: usize, splits: usize) -> usize {
    let chunk = k.div_ceil(splits.max(1)).div_ceil(GEMM_BK) * GEMM_BK;
    k.div_ceil(chunk.max(1)).max(1)
}

fn i(v: usize) -> Arg {
    Arg::I32(v as i32)
}

/// The kernel arguments of a shape's scalars (C `int`s, in the kernel's order).
fn shape_args<const N: usize>(a: [i32; N]) -> [Arg; N] {
    a.map(Arg::I32)
}

/// Emits [`Op`]s with the right entry point, argument order and geometry.
#[derive(Debug)]
pub struct Builder {
    /// The ops so far.
    pub ops: Vec<Op>,
    /// SMs of the device (split-K sizing; any positive value is correct).
    pub sm_count: usize,
    /// Split-K workspace (f32): weight gradients split K into slices whose partial sums land in
    /// planes of this region, then `splitk_reduce_f32` adds them in slice order (deterministic).
    /// Empty: no split-K (one slice, the kernel adds into the gradient directly).
    pub splitk: Region,
}

/// The three entry points of a GEMM kernel, `[f32, bf16, f16]` operands, from its base name.
macro_rules! by_precision {
    ($base:literal) => {
        [
            concat!($base, "_f32"),
            concat!($base, "_bf16"),
            concat!($base, "_f16"),
        ]
    };
}

/// The entry point of a GEMM kernel for the operand precision: `[f32, bf16, f16]` names.
fn pick(p: Precision, names: [&'static str; 3]) -> &'static str {
    match p {
        Precision::Fp32 => names[0],
        Precision::Bf16 => names[1],
        Precision::Fp16 => names[2],
    }
}

impl Builder {
    /// An empty op list, without split-K workspace (weight gradients in one K slice).
    pub fn new(sm_count: usize) -> Builder {
        Builder::with_splitk(
            sm_count,
            Region {
                arena: Arena::F32,
                off: 0,
                len: 0,
            },
        )
    }

    /// An empty op list whose weight gradients may split K over the f32 workspace `splitk`
    /// (as many slices as fit in it, up to the split chosen from the SM count).
    pub fn with_splitk(sm_count: usize, splitk: Region) -> Builder {
        Builder {
            ops: Vec::new(),
            sm_count: sm_count.max(1),
            splitk,
        }
    }

    /// The slices for a weight gradient C[M, N] over K, and the partials region they write (empty
    /// for one slice): the SM-based choice, cut to what the workspace holds and to non-empty slices.
    fn weight_split(&self, m: usize, n: usize, k: usize) -> (usize, Region) {
        let plane = m * n;
        let fits = if plane == 0 || self.splitk.arena != Arena::F32 {
            1
        } else {
            self.splitk.len / plane
        };
        let splits = nonempty_splits(k, split_k(m, n, k, self.sm_count).min(fits.max(1)));
        if splits > 1 {
            (splits, self.splitk.prefix(splits * plane))
        } else {
            (1, self.splitk.prefix(0))
        }
    }

    /// `splitk_reduce_f32` after a split-K weight gradient (nothing for one slice): 1-D over the
    /// gradient, block 256.
    fn reduce_splits(&mut self, dweight: Region, partials: Region, splits: usize) {
        if splits > 1 {
            self.push(
                KernelId::Elementwise,
                "splitk_reduce_f32",
                vec![
                    Arg::Out(dweight),
                    Arg::In(partials),
                    i(splits),
                    Arg::I64(dweight.len as i64),
                ],
                KernelGrid::for_elements(dweight.len),
            );
        }
    }

    fn push(&mut self, kernel: KernelId, name: &'static str, args: Vec<Arg>, cfg: KernelGrid) {
        self.ops.push(Op {
            kernel,
            name,
            args,
            cfg,
        });
    }

    /// `fill_f32`: 1-D, block 256, grid ceil(n/256) capped (grid-stride).
    pub fn fill(&mut self, out: Region, value: f32) {
        self.push(
            KernelId::Elementwise,
            "fill_f32",
            vec![Arg::Out(out), Arg::F32(value), Arg::I64(out.len as i64)],
            KernelGrid::for_elements(out.len),
        );
    }

    /// `axpy_f32`: y += alpha * x; 1-D, block 256.
    pub fn axpy(&mut self, y: Region, x: Region, alpha: f32) {
        self.push(
            KernelId::Elementwise,
            "axpy_f32",
            vec![
                Arg::Out(y),
                Arg::In(x),
                Arg::F32(alpha),
                Arg::I64(y.len as i64),
            ],
            KernelGrid::for_elements(y.len),
        );
    }

    /// `cast_f32_bf16` or `cast_f32_f16`, by the arena of `out`: 1-D, block 256.
    pub fn cast_to_half(&mut self, out: Region, inp: Region) {
        let name = if out.arena == Arena::F16 {
            "cast_f32_f16"
        } else {
            "cast_f32_bf16"
        };
        self.push(
            KernelId::Data,
            name,
            vec![Arg::Out(out), Arg::In(inp), i(inp.len)],
            KernelGrid::for_elements(inp.len),
        );
    }

    /// `amp_unscale_f32` over the flat gradients after the all-reduce: 1-D, block 256.
    pub fn amp_unscale(&mut self, grads: Region, found_inf: Region, scale: Region) {
        let a = vec![
            Arg::Out(grads),
            Arg::Out(found_inf),
            Arg::In(scale),
            i(grads.len),
        ];
        self.push(
            KernelId::Optim,
            "amp_unscale_f32",
            a,
            KernelGrid::for_elements(grads.len),
        );
    }

    /// `--clip-grad-norm` on the flat gradients (`clip_grad_norm_`): `grad_norm_partials_f32`
    /// (block 256, one block per partial), `grad_norm_coef_f32` (one block of 256), then
    /// `clip_grad_scale_f32` (1-D, block 256). `step` is the optimizer step being taken (1-based),
    /// recorded on the device if the norm is not finite.
    pub fn clip_grad_norm(&mut self, grads: Region, c: &ClipTensors, max_norm: f32, step: u64) {
        let np = c.partials.len;
        self.push(
            KernelId::Optim,
            "grad_norm_partials_f32",
            vec![Arg::Out(c.partials), Arg::In(grads), i(grads.len), i(np)],
            cfg((np, 1, 1), CLIP_THREADS),
        );
        self.push(
            KernelId::Optim,
            "grad_norm_coef_f32",
            vec![
                Arg::Out(c.coef),
                Arg::Out(c.norm),
                Arg::Out(c.nonfinite_step),
                Arg::In(c.partials),
                i(np),
                Arg::F32(max_norm),
                Arg::I32(step.min(i32::MAX as u64) as i32),
            ],
            cfg((1, 1, 1), CLIP_THREADS),
        );
        self.push(
            KernelId::Optim,
            "clip_grad_scale_f32",
            vec![Arg::Out(grads), Arg::In(c.coef), i(grads.len)],
            KernelGrid::for_elements(grads.len),
        );
    }

    /// `gather_batch_f32`: block 256, grid (ceil(image_size/256), batch).
    pub fn gather(
        &mut self,
        images: Region,
        labels: Region,
        indices: Region,
        batch: usize,
        image_size: usize,
    ) {
        let ds_i = Region {
            arena: Arena::Images,
            off: 0,
            len: 0,
        };
        let ds_l = Region {
            arena: Arena::Labels,
            off: 0,
            len: 0,
        };
        self.push(
            KernelId::Data,
            "gather_batch_f32",
            vec![
                Arg::Out(images),
                Arg::Out(labels),
                Arg::In(ds_i),
                Arg::In(ds_l),
                Arg::In(indices),
                i(batch),
                i(image_size),
            ],
            cfg((image_size.div_ceil(256), batch, 1), 256),
        );
    }

    /// `conv2d_forward_*`: GEMM M = out_c, N = batch*out_h*out_w, splits 1 (it overwrites).
    pub fn conv_forward(
        &mut self,
        p: Precision,
        out: Region,
        inp: Region,
        (weight, bias): (Region, Region),
        s: Conv2dShape,
    ) {
        let mut a = vec![Arg::Out(out), Arg::In(inp), Arg::In(weight), Arg::In(bias)];
        a.extend(shape_args(s.kernel_args()));
        let name = pick(p, by_precision!("conv2d_forward"));
        let n = s.batch * s.out_h() * s.out_w();
        self.push(KernelId::Conv2d, name, a, gemm_cfg(s.params.out_c, n, 1));
    }

    /// `conv2d_backward_input_*`: GEMM M = in_c, N = batch*in_h*in_w, splits 1 (it overwrites).
    pub fn conv_backward_input(
        &mut self,
        p: Precision,
        dinp: Region,
        dout: Region,
        weight: Region,
        s: Conv2dShape,
    ) {
        let mut a = vec![Arg::Out(dinp), Arg::In(dout), Arg::In(weight)];
        a.extend(shape_args(s.kernel_args()));
        let name = pick(p, by_precision!("conv2d_backward_input"));
        let n = s.batch * s.in_h * s.in_w;
        self.push(KernelId::Conv2d, name, a, gemm_cfg(s.params.in_c, n, 1));
    }

    /// `conv2d_backward_weight_*`: GEMM M = out_c, N = in_c*kh*kw, K = batch*out_h*out_w,
    /// split-K into the workspace then `splitk_reduce_f32` into the accumulated dweight.
    pub fn conv_backward_weight(
        &mut self,
        p: Precision,
        dweight: Region,
        dout: Region,
        inp: Region,
        s: Conv2dShape,
    ) {
        let k = s.batch * s.out_h() * s.out_w();
        let name = pick(p, by_precision!("conv2d_backward_weight"));
        let (m, n) = (s.params.out_c, s.params.k());
        self.weight_grad(
            KernelId::Conv2d,
            name,
            (dweight, dout, inp),
            (m, n, k),
            &s.kernel_args(),
        );
    }

    /// `conv2d_backward_bias_*`: grid (out_c), block 256.
    pub fn conv_backward_bias(
        &mut self,
        p: Precision,
        dbias: Region,
        dout: Region,
        s: Conv2dShape,
    ) {
        let name = pick(p, by_precision!("conv2d_backward_bias"));
        let sizes = [s.batch, s.params.out_c, s.out_h(), s.out_w()].map(i);
        let mut a = vec![Arg::Out(dbias), Arg::In(dout)];
        a.extend(sizes);
        self.push(KernelId::Conv2d, name, a, cfg((s.params.out_c, 1, 1), 256));
    }

    /// A weight gradient, `dweight[m, n] += doutᵀ · inp` over K = `k`: split-K into the workspace
    /// when the product is tall in K, then `splitk_reduce_f32` into the accumulated `dweight`.
    /// The kernel takes `(dweight, partials, dout, inp, shape...)`.
    fn weight_grad(
        &mut self,
        kernel: KernelId,
        name: &'static str,
        (dweight, dout, inp): (Region, Region, Region),
        (m, n, k): (usize, usize, usize),
        shape: &[i32],
    ) {
        let (splits, partials) = self.weight_split(m, n, k);
        let mut a = vec![
            Arg::Out(dweight),
            Arg::Out(partials),
            Arg::In(dout),
            Arg::In(inp),
        ];
        a.extend(shape.iter().copied().map(Arg::I32));
        self.push(kernel, name, a, gemm_cfg(m, n, splits));
        self.reduce_splits(dweight, partials, splits);
    }

    /// `linear_forward_*`: GEMM M = batch, N = out_f, K = in_f, splits 1 (fused ReLU allowed).
    pub fn linear_forward(
        &mut self,
        p: Precision,
        out: Region,
        inp: Region,
        (weight, bias): (Region, Region),
        s: LinearShape,
        relu: bool,
    ) {
        let mut a = vec![Arg::Out(out), Arg::In(inp), Arg::In(weight), Arg::In(bias)];
        a.extend(shape_args(s.kernel_args()));
        a.push(i(relu as usize));
        let name = pick(p, by_precision!("linear_forward"));
        self.push(KernelId::Linear, name, a, gemm_cfg(s.batch, s.out_f, 1));
    }

    /// `linear_backward_input_*`: GEMM M = batch, N = in_f, splits 1.
    pub fn linear_backward_input(
        &mut self,
        p: Precision,
        dinp: Region,
        dout: Region,
        weight: Region,
        s: LinearShape,
    ) {
        let mut a = vec![Arg::Out(dinp), Arg::In(dout), Arg::In(weight)];
        a.extend(shape_args(s.kernel_args()));
        let name = pick(p, by_precision!("linear_backward_input"));
        self.push(KernelId::Linear, name, a, gemm_cfg(s.batch, s.in_f, 1));
    }

    /// `linear_backward_weight_*`: GEMM M = out_f, N = in_f, K = batch, split-K into the
    /// workspace then `splitk_reduce_f32` (as [`Builder::conv_backward_weight`]).
    pub fn linear_backward_weight(
        &mut self,
        p: Precision,
        dweight: Region,
        dout: Region,
        inp: Region,
        s: LinearShape,
    ) {
        let name = pick(p, by_precision!("linear_backward_weight"));
        let mnk = (s.out_f, s.in_f, s.batch);
        self.weight_grad(
            KernelId::Linear,
            name,
            (dweight, dout, inp),
            mnk,
            &s.kernel_args(),
        );
    }

    /// `linear_backward_bias_*`: grid ceil(out_f/256), block 256.
    pub fn linear_backward_bias(
        &mut self,
        p: Precision,
        dbias: Region,
        dout: Region,
        batch: usize,
        out_f: usize,
    ) {
        let name = pick(p, by_precision!("linear_backward_bias"));
        self.push(
            KernelId::Linear,
            name,
            vec![Arg::Out(dbias), Arg::In(dout), i(batch), i(out_f)],
            cfg((out_f.div_ceil(256), 1, 1), 256),
        );
    }

    /// `relu_forward_f32`: 1-D, block 256.
    pub fn relu_forward(&mut self, out: Region, inp: Region) {
        self.push(
            KernelId::Activation,
            "relu_forward_f32",
            vec![Arg::Out(out), Arg::In(inp), i(out.len)],
            KernelGrid::for_elements(out.len),
        );
    }

    /// `relu_backward_f32`: 1-D, block 256.
    pub fn relu_backward(&mut self, dinp: Region, out: Region, dout: Region) {
        self.push(
            KernelId::Activation,
            "relu_backward_f32",
            vec![Arg::Out(dinp), Arg::In(out), Arg::In(dout), i(dinp.len)],
            KernelGrid::for_elements(dinp.len),
        );
    }

    /// `batchnorm2d_forward_train_f32`: grid (channels), block 256 (one block per channel).
    /// `momentum` and `eps` as in PyTorch (the CPU layer's fields).
    pub fn bn_forward_train(
        &mut self,
        out: Region,
        bn: &BnTensors,
        inp: Region,
        (weight, bias): (Region, Region),
        s: Bn2dShape,
    ) {
        let a = vec![
            Arg::Out(out),
            Arg::Out(bn.mean),
            Arg::Out(bn.invstd),
            Arg::Out(bn.running_mean),
            Arg::Out(bn.running_var),
            Arg::In(inp),
            Arg::In(weight),
            Arg::In(bias),
            i(s.batch),
            i(s.channels),
            i(s.hw),
            Arg::F32(s.momentum),
            Arg::F32(s.eps),
            i(s.relu as usize),
        ];
        let grid = cfg((s.channels, 1, 1), 256);
        self.push(
            KernelId::Batchnorm,
            "batchnorm2d_forward_train_f32",
            a,
            grid,
        );
    }

    /// `batchnorm2d_forward_eval_f32`: 1-D over batch*channels*hw, block 256.
    pub fn bn_forward_eval(
        &mut self,
        out: Region,
        bn: &BnTensors,
        inp: Region,
        (weight, bias): (Region, Region),
        s: Bn2dShape,
    ) {
        let a = vec![
            Arg::Out(out),
            Arg::In(inp),
            Arg::In(weight),
            Arg::In(bias),
            Arg::In(bn.running_mean),
            Arg::In(bn.running_var),
            i(s.batch),
            i(s.channels),
            i(s.hw),
            Arg::F32(s.eps),
            i(s.relu as usize),
        ];
        let grid = KernelGrid::for_elements(s.batch * s.channels * s.hw);
        self.push(KernelId::Batchnorm, "batchnorm2d_forward_eval_f32", a, grid);
    }

    /// `batchnorm2d_backward_f32`: grid (channels), block 256; the gradients `(dinp, dweight,
    /// dbias)` from `dout` and the forward's `(inp, out)`.
    pub fn bn_backward(
        &mut self,
        (dinp, dweight, dbias): (Region, Region, Region),
        dout: Region,
        (inp, out): (Region, Region),
        weight: Region,
        bn: &BnTensors,
        s: Bn2dShape,
    ) {
        let a = vec![
            Arg::Out(dinp),
            Arg::Out(dweight),
            Arg::Out(dbias),
            Arg::In(dout),
            Arg::In(inp),
            Arg::In(out),
            Arg::In(weight),
            Arg::In(bn.mean),
            Arg::In(bn.invstd),
            i(s.batch),
            i(s.channels),
            i(s.hw),
            i(s.relu as usize),
        ];
        let grid = cfg((s.channels, 1, 1), 256);
        self.push(KernelId::Batchnorm, "batchnorm2d_backward_f32", a, grid);
    }

    /// `maxpool2d_forward_f32`: 1-D over the outputs, block 256.
    pub fn maxpool_forward(&mut self, out: Region, indices: Region, inp: Region, s: Pool2dShape) {
        let mut a = vec![Arg::Out(out), Arg::Out(indices), Arg::In(inp)];
        a.extend(shape_args(s.kernel_args()));
        let grid = KernelGrid::for_elements(out.len);
        self.push(KernelId::Pool, "maxpool2d_forward_f32", a, grid);
    }

    /// `maxpool2d_backward_f32` (as [`Builder::maxpool_forward`]): 1-D over the inputs, block 256.
    pub fn maxpool_backward(
        &mut self,
        dinp: Region,
        dout: Region,
        indices: Region,
        s: Pool2dShape,
    ) {
        let mut a = vec![Arg::Out(dinp), Arg::In(dout), Arg::In(indices)];
        a.extend(shape_args(s.kernel_args()));
        let grid = KernelGrid::for_elements(dinp.len);
        self.push(KernelId::Pool, "maxpool2d_backward_f32", a, grid);
    }

    /// `softmax_xent_forward_f32`: grid 1, block 256 (one warp per row).
    pub fn xent_forward(
        &mut self,
        t: &LossTensors,
        logits: Region,
        labels: Region,
        batch: usize,
        classes: usize,
    ) {
        let a = vec![
            Arg::Out(t.losses.prefix(batch)),
            Arg::Out(t.probs.prefix(batch * classes)),
            Arg::Out(t.mean_loss),
            Arg::Out(t.correct),
            Arg::In(logits),
            Arg::In(labels),
            i(batch),
            i(classes),
        ];
        self.push(
            KernelId::Loss,
            "softmax_xent_forward_f32",
            a,
            cfg((1, 1, 1), 256),
        );
    }

    /// `softmax_xent_backward_f32`, or with a loss scale (read from `scale` on the device)
    /// `softmax_xent_backward_scaled_f32`, which takes it last: 1-D over batch*classes, block 256.
    pub fn xent_backward(
        &mut self,
        dlogits: Region,
        probs: Region,
        labels: Region,
        (batch, classes): (usize, usize),
        scale: Option<Region>,
    ) {
        let mut a = vec![
            Arg::Out(dlogits),
            Arg::In(probs),
            Arg::In(labels),
            i(batch),
            i(classes),
        ];
        let name = match scale {
            Some(scale) => {
                a.push(Arg::In(scale));
                "softmax_xent_backward_scaled_f32"
            }
            None => "softmax_xent_backward_f32",
        };
        let grid = KernelGrid::for_elements(batch * classes);
        self.push(KernelId::Loss, name, a, grid);
    }

    /// `adam_step_f32` over the flat buffers (`(m, v)` the moments): 1-D, block 256.
    pub fn adam(
        &mut self,
        params: Region,
        grads: Region,
        (m, v): (Region, Region),
        h: &AdamHyper,
        lr: f32,
        step: u64,
    ) {
        let a = vec![
            Arg::Out(params),
            Arg::In(grads),
            Arg::Out(m),
            Arg::Out(v),
            i(params.len),
            Arg::F32(lr),
            Arg::F32(h.beta1),
            Arg::F32(h.beta2),
            Arg::F32(h.eps),
            Arg::F32(h.weight_decay),
            Arg::I32(step as i32),
        ];
        self.push(
            KernelId::Optim,
            "adam_step_f32",
            a,
            KernelGrid::for_elements(params.len),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ws(len: usize) -> Region {
        Region {
            arena: Arena::F32,
            off: 1000,
            len,
        }
    }

    /// Every split-K launch writes whole planes inside the workspace with no empty slice, and is
    /// followed by the reduction over exactly those planes into the gradient.
    #[test]
    fn split_k_uses_the_workspace_and_reduces_in_order() {
        let dw = Region {
            arena: Arena::F32,
            off: 0,
            len: 32 * 25,
        };
        let (x, dy) = (
            Region {
                arena: Arena::F32,
                off: 100_000,
                len: 64 * 784,
            },
            Region {
                arena: Arena::F32,
                off: 200_000,
                len: 64 * 32 * 784,
            },
        );
        let s = crate::ops::Conv2dParams::new(1, 32, 5, 1, 2).for_input(64, 28, 28);
        for (sm, room) in [
            (132usize, usize::MAX),
            (132, 7 * 800),
            (1, usize::MAX),
            (8, 0),
        ] {
            let room = room.min(splitk_workspace_len(32, 25, 64 * 784));
            let mut b = Builder::with_splitk(sm, ws(room));
            b.conv_backward_weight(Precision::Fp32, dw, dy, x, s);
            let splits = b.ops[0].cfg.grid.2 as usize;
            let Arg::Out(part) = b.ops[0].args[1] else {
                panic!("partials is not written")
            };
            if splits == 1 {
                assert_eq!(
                    (b.ops.len(), part.len),
                    (1, 0),
                    "sm {sm} room {room}: one slice, no reduction"
                );
                continue;
            }
            assert!(
                part.off >= 1000 && part.off + part.len <= 1000 + room,
                "sm {sm}: {part:?} outside the workspace of {room}"
            );
            assert_eq!(part.len, splits * dw.len);
            let k = 64 * 784;
            let ranges = crate::device::kernels::twins::split_k_ranges(k, splits);
            assert!(
                ranges.iter().all(|r| !r.is_empty()) && ranges.last().unwrap().end == k,
                "sm {sm}: {ranges:?}"
            );
            assert_eq!(b.ops[1].name, "splitk_reduce_f32");
            assert_eq!(
                b.ops[1].args,
                vec![
                    Arg::Out(dw),
                    Arg::In(part),
                    Arg::I32(splits as i32),
                    Arg::I64(dw.len as i64)
                ]
            );
            b.ops.iter().for_each(|o| o.check_signature().unwrap());
        }
        // 132 SMs: conv1's single tile takes 264 slices, the workspace sized for 256 SMs holds them.
        let mut b = Builder::with_splitk(132, ws(splitk_workspace_len(32, 25, 64 * 784)));
        b.conv_backward_weight(Precision::Bf16, dw, dy, x, s);
        assert_eq!(b.ops[0].cfg.grid.2 as usize, nonempty_splits(64 * 784, 264));
        assert!(b.ops[0].cfg.grid.2 > 256, "{:?}", b.ops[0].cfg);
        // A workspace with room for 7 planes caps the slices at 7.
        let mut b = Builder::with_splitk(132, ws(7 * 800));
        b.conv_backward_weight(Precision::Fp32, dw, dy, x, s);
        assert_eq!(b.ops[0].cfg.grid.2, 7);
    }

    #[test]
    fn nonempty_splits_cover_k_without_empty_slices() {
        for k in [1usize, 31, 32, 33, 100, 1056, 50_176] {
            for want in [1usize, 2, 3, 7, 32, 264, 5000] {
                let got = nonempty_splits(k, want.min(k.div_ceil(GEMM_BK)));
                let r = crate::device::kernels::twins::split_k_ranges(k, got);
                assert!(r.iter().all(|r| !r.is_empty()), "k {k} want {want}: {r:?}");
                assert_eq!((r[0].start, r.last().unwrap().end), (0, k));
                assert!(r.windows(2).all(|w| w[0].end == w[1].start));
            }
        }
    }
}
