//! BatchNorm2d with PyTorch semantics: batch statistics in training (biased variance for the
//! normalisation, unbiased variance for the running estimate), running statistics in evaluation,
//! momentum 0.1, eps 1e-5, and a `num_batches_tracked` counter.
//!
//! Forward saves only the per-channel mean and 1/std; backward recomputes `xhat` from the input
//! the model kept, so no extra activation-sized buffer is needed.
//!
//! Backward (per channel, `M = N*H*W`, `xhat = (x - mean) * invstd`):
//! `dbeta += Σ dout`, `dgamma += Σ dout·xhat`,
//! `dinp = gamma·invstd/M · (M·dout − Σ dout − xhat·Σ dout·xhat)`.

pub mod twin;

use super::{Backward, BufferMut, Init, Layer, LayerSpec, ParamSpec, SumFn};
use crate::multiversion::dispatch;
use crate::tensor::Tensor;

/// One BatchNorm2d launch: the batch, the planes and the layer's settings, the scalar arguments
/// of `kernels/batchnorm.cu` shared by its CPU twins, the GPU launcher and the plan. Each kernel
/// takes the ones it needs, in this order: `batch, channels, hw, [momentum,] [eps,] relu` (the
/// training forward all, evaluation without `momentum`, backward without both).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bn2dShape {
    /// Samples.
    pub batch: usize,
    /// Channels.
    pub channels: usize,
    /// Pixels per plane, `H * W`.
    pub hw: usize,
    /// Weight of the batch statistic in the running estimate.
    pub momentum: f32,
    /// Added to the variance before the square root.
    pub eps: f32,
    /// The ReLU fused after the normalisation (and its mask in backward).
    pub relu: bool,
}

impl Bn2dShape {
    /// `(batch, channels, hw)` as `usize`.
    pub(crate) fn dims(&self) -> (usize, usize, usize) {
        (self.batch, self.channels, self.hw)
    }
    /// `y`, or `max(y, 0)` with the fused ReLU.
    pub(crate) fn act(&self, y: f32) -> f32 {
        if self.relu {
            y.max(0.0)
        } else {
            y
        }
    }
}

/// Batch normalisation over `[N, C, H, W]`, per channel.
#[derive(Clone, Debug)]
pub struct BatchNorm2d {
    /// Channels.
    pub channels: usize,
    /// Weight of the new batch statistic in the running estimate (PyTorch: 0.1).
    pub momentum: f32,
    /// Added to the variance before the square root (PyTorch: 1e-5).
    pub eps: f32,
    /// Running mean, `(C)`.
    pub running_mean: Vec<f32>,
    /// Running (unbiased) variance, `(C)`.
    pub running_var: Vec<f32>,
    /// Training batches seen.
    pub num_batches_tracked: i64,
    mean: Vec<f32>,   // (C) saved for backward
    invstd: Vec<f32>, // (C) saved for backward
    /// Synchronise batch statistics over ranks in training (`--sync-bn`); the trainer then calls
    /// [`BatchNorm2d::forward_synced`] / [`BatchNorm2d::backward_synced`].
    pub sync: bool,
    count: f64, // values per channel behind the saved statistics (all ranks' with sync)
    scratch: Vec<f64>, // (2C+1) batch statistics / partial sums, reused so a step does not allocate
    sums: Vec<f32>, // (2C) Σ dout and Σ dout·xhat in backward, reused
    /// The fused backward's dense `M·dout` for one plane, reused.
    sel: Vec<f32>,
    /// The streamed fused forward's per-plane (mean, M2), `[N, C]`.
    moments: Vec<(f64, f64)>,
    /// The streamed fused forward's input value at each window's maximum, `[N, C, H/2, W/2]`
    /// (valid for the backward that follows when `raw_valid`).
    raw: Vec<f32>,
    raw_valid: bool,
    /// The streamed forward's pooling scratch: window corners, column maxima and their rows.
    corner: Vec<u32>,
    vmax: Vec<f32>,
    bottom: Vec<u32>,
}

impl BatchNorm2d {
    /// A BatchNorm over `channels` with PyTorch defaults.
    pub fn new(channels: usize) -> BatchNorm2d {
        BatchNorm2d {
            channels,
            momentum: 0.1,
            eps: 1e-5,
            running_mean: vec![0.0; channels],
            running_var: vec![1.0; channels],
            num_batches_tracked: 0,
            mean: vec![0.0; channels],
            invstd: vec![0.0; channels],
            sync: false,
            count: 0.0,
            scratch: vec![0.0; 2 * channels + 1],
            sums: vec![0.0; 2 * channels],
            sel: Vec::new(),
            moments: Vec::new(),
            raw: Vec::new(),
            raw_valid: false,
            corner: Vec::new(),
            vmax: Vec::new(),
            bottom: Vec::new(),
        }
    }

    /// Per-channel batch mean and biased variance of `inp` written into `mean` and `var`;
    /// returns the number of values per channel.
    pub fn batch_stats(&self, inp: &Tensor, mean: &mut [f64], var: &mut [f64]) -> usize {
        let (c, hw) = (self.channels, inp.dims()[2] * inp.dims()[3]);
        let m = inp.dims()[0] * hw;
        plane_moments(inp.data(), hw, &mut mean[..c], &mut var[..c]);
        m
    }
}

dispatch!(plane_moments, plane_moments_impl, (x: &[f32], hw: usize, mean: &mut [f64], var: &mut [f64]));

/// Per-channel mean and biased variance of `x` (`[N, C, hw]`, `C = mean.len()`), reading `x`
/// from memory once: each plane's sum, then its squared deviations from its own mean while it
/// is still in L1 (f32 lanes within a plane, which vectorises), and the planes combined per
/// channel in f64 (Chan et al.: `M2 = Σ M2_p + Σ n_p (mean_p − mean)²`). Two passes over the
/// whole tensor, as a global-mean variance needs, cost a second trip to memory for a tensor
/// (conv1's output, 6.4 MB) that does not fit in L2; the per-plane deviations keep the
/// two-pass accuracy (no `Σx² − (Σx)²` cancellation).
#[inline(always)]
fn plane_moments_impl(x: &[f32], hw: usize, mean: &mut [f64], var: &mut [f64]) {
    // A plain loop: an iterator adapter's `fold` is a call the AVX version does not inline.
    let mut pm = vec![(0.0, 0.0); x.len() / hw.max(1)];
    for (xs, m) in x.chunks_exact(hw).zip(pm.iter_mut()) {
        *m = one_plane_moments(xs);
    }
    combine_moments(&pm, hw, mean, var);
}

dispatch!(plane_moments_into, plane_moments_into_impl, (xs: &[f32], out: &mut (f64, f64)));

/// [`one_plane_moments`] into `out` (the form `dispatch!` takes).
#[inline(always)]
fn plane_moments_into_impl(xs: &[f32], out: &mut (f64, f64)) {
    *out = one_plane_moments(xs);
}

/// One plane's mean and sum of squared deviations from it (f32 lanes, read twice from L1).
/// The same arithmetic as [`lane_sum`], written without closures: a closure is not compiled
/// with the AVX features of the `dispatch!` version that inlines this.
#[inline(always)]
fn one_plane_moments(xs: &[f32]) -> (f64, f64) {
    let (chunks, rest) = (xs.chunks_exact(8), xs.chunks_exact(8).remainder());
    let mut acc = [0.0f32; 8];
    for ch in chunks.clone() {
        for i in 0..8 {
            acc[i] += ch[i];
        }
    }
    let s = acc.iter().sum::<f32>() + rest.iter().sum::<f32>();
    let mp = s / xs.len().max(1) as f32;
    let mut acc = [0.0f32; 8];
    for ch in chunks {
        for i in 0..8 {
            acc[i] += (ch[i] - mp) * (ch[i] - mp);
        }
    }
    let mut r = 0.0f32;
    for &v in rest {
        r += (v - mp) * (v - mp);
    }
    (mp as f64, (acc.iter().sum::<f32>() + r) as f64)
}

/// Per-channel mean and biased variance from the planes' `(mean_p, M2_p)` (`[N, C]`, `C =
/// mean.len()`, `hw` values each), by Chan et al.'s `M2 = Σ M2_p + Σ n_p (mean_p − mean)²`.
fn combine_moments(pm: &[(f64, f64)], hw: usize, mean: &mut [f64], var: &mut [f64]) {
    let c = mean.len();
    let n = (pm.len() / c.max(1)) as f64;
    mean.fill(0.0);
    for (i, &(mp, _)) in pm.iter().enumerate() {
        mean[i % c] += mp;
    }
    for mu in mean.iter_mut() {
        *mu /= n;
    }
    var.fill(0.0);
    for (i, &(mp, m2)) in pm.iter().enumerate() {
        let d = mp - mean[i % c];
        var[i % c] += m2 + hw as f64 * d * d;
    }
    for v in var.iter_mut() {
        *v /= n * hw as f64;
    }
}

dispatch!(pool_raw_plane, pool_plane, (x: &[f32], w: usize, map: Signed, corner: &[u32], scratch: (&mut [f32], &mut [u32]), raw: &mut [f32], argmax: &mut [u32]));
dispatch!(relu_pool_plane, pool_plane, (xs: &[f32], w: usize, map: ReluAffine, corner: &[u32], scratch: (&mut [f32], &mut [u32]), y: &mut [f32], argmax: &mut [u32]));

/// What [`pool_plane`] does to each input before the comparisons and to each window's winner
/// after.
trait PoolMap {
    /// The value compared.
    fn pre(&self, x: f32) -> f32;
    /// The value stored for a window whose winner compared as `v`.
    fn post(&self, v: f32) -> f32;
}

/// `s·x` compared, `s·v` stored (`s = ±1`): the raw maximum (`s = 1`) or minimum (`s = -1`;
/// negation is exact, so the minimum is the maximum of `-x` with the same order).
#[derive(Clone, Copy)]
struct Signed(f32);

impl PoolMap for Signed {
    #[inline(always)]
    fn pre(&self, x: f32) -> f32 {
        self.0 * x
    }
    #[inline(always)]
    fn post(&self, v: f32) -> f32 {
        self.0 * v
    }
}

/// `v = max(x * scale + shift, 0)` compared and stored: the fused forward's BatchNorm + ReLU.
#[derive(Clone, Copy)]
struct ReluAffine {
    scale: f32,
    shift: f32,
}

impl PoolMap for ReluAffine {
    #[inline(always)]
    fn pre(&self, x: f32) -> f32 {
        (x * self.scale + self.shift).max(0.0)
    }
    #[inline(always)]
    fn post(&self, v: f32) -> f32 {
        v
    }
}

/// One plane of a 2x2 stride-2 max-pool over `map`ped inputs: each window's maximum (mapped
/// back) into `out` and its plane index into `argmax`, the first maximum winning in the order
/// top-left (A), top-right (B), bottom-left (C), bottom-right (D), as the unfused pool. With
/// [`ReluAffine`] this is the fused forward; with [`Signed`] the pooling of the raw input that
/// the streamed forward normalises afterwards.
///
/// In two passes that vectorise (a window at a time, the comparisons are branches the predictor
/// loses on rectified data, and rows of 14 or 7 windows are too short for vector loops):
/// 1. per row pair, the larger of each column's two values into `vmax` (the top one on a tie)
///    and whether it came from the bottom row into `bottom`;
/// 2. over all windows of the plane at once (a row pair of `vmax` is one row of windows), the
///    larger of the even and odd column. The odd one (B or D) wins when strictly larger, and on
///    a tie only when it is B against C, which is the only tie where it comes first.
#[inline(always)]
fn pool_plane<M: PoolMap>(
    xs: &[f32],
    w: usize,
    map: M,
    corner: &[u32],
    scratch: (&mut [f32], &mut [u32]),
    out: &mut [f32],
    argmax: &mut [u32],
) {
    let (vmax, bottom) = scratch;
    for ((pair, vm), bt) in xs
        .chunks_exact(2 * w)
        .zip(vmax.chunks_exact_mut(w))
        .zip(bottom.chunks_exact_mut(w))
    {
        let (top, bot) = pair.split_at(w);
        for (((&t, &b), v), f) in top.iter().zip(bot).zip(vm.iter_mut()).zip(bt.iter_mut()) {
            let (t, b) = (map.pre(t), map.pre(b));
            let low = b > t;
            *v = if low { b } else { t };
            *f = low as u32;
        }
    }
    let w32 = w as u32;
    for ((((v2, f2), &c), o), ao) in vmax
        .chunks_exact(2)
        .zip(bottom.chunks_exact(2))
        .zip(corner)
        .zip(out.iter_mut())
        .zip(argmax.iter_mut())
    {
        let odd = v2[1] > v2[0] || (v2[1] == v2[0] && f2[0] == 1 && f2[1] == 0);
        *o = map.post(if odd { v2[1] } else { v2[0] });
        let f = if odd { f2[1] } else { f2[0] };
        *ao = c + odd as u32 + f * w32;
    }
}

/// `if t { a } else { b }` on the bits, so it compiles to a blend and never to a branch.
#[inline(always)]
fn pick(t: bool, a: f32, b: f32) -> f32 {
    let m = (t as u32).wrapping_neg();
    f32::from_bits((a.to_bits() & m) | (b.to_bits() & !m))
}

dispatch!(pooled_sums, pooled_sums_impl, (x: &[f32], g: &[f32], py: &[f32], argmax: &[u32], sizes: (usize, usize), stats: (&[f32], &[f32]), sg: &mut [f64], sgx: &mut [f64]));

/// The fused backward's per-channel sums, `Σ dout` and `Σ dout·xhat` over the values the ReLU
/// and the pool passed: one per window (at its `argmax`, when the pooled value `py` is positive).
/// Planes in memory order (each channel adds its planes in batch order, and the input is read
/// as a stream); each plane's windows by [`window_sums`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn pooled_sums_impl(
    x: &[f32],
    g: &[f32],
    py: &[f32],
    argmax: &[u32],
    sizes: (usize, usize),
    stats: (&[f32], &[f32]),
    sg: &mut [f64],
    sgx: &mut [f64],
) {
    let (hw, ohw) = sizes;
    let planes = x.chunks_exact(hw).zip(argmax.chunks_exact(ohw));
    for (plane, ((xp, ap), (gp, pp))) in planes
        .zip(g.chunks_exact(ohw).zip(py.chunks_exact(ohw)))
        .enumerate()
    {
        // The clamps keep a corrupt index inside the plane and let the compiler drop the checks.
        let (last, lasta) = (xp.len() - 1, ap.len() - 1);
        let at = |o: usize| xp[(ap[o.min(lasta)] as usize).min(last)];
        add_window_sums(plane, gp, pp, at, stats, sg, sgx);
    }
}

dispatch!(pooled_sums_raw, pooled_sums_raw_impl, (raw: &[f32], g: &[f32], py: &[f32], ohw: usize, stats: (&[f32], &[f32]), sg: &mut [f64], sgx: &mut [f64]));

/// [`pooled_sums_impl`] with each window's input value given contiguously in `raw` (kept by
/// the streamed forward), instead of gathered from the input through `argmax`. The same sums in
/// the same order, so the same bits.
#[inline(always)]
fn pooled_sums_raw_impl(
    raw: &[f32],
    g: &[f32],
    py: &[f32],
    ohw: usize,
    stats: (&[f32], &[f32]),
    sg: &mut [f64],
    sgx: &mut [f64],
) {
    for (plane, (xp, (gp, pp))) in raw
        .chunks_exact(ohw)
        .zip(g.chunks_exact(ohw).zip(py.chunks_exact(ohw)))
        .enumerate()
    {
        let last = xp.len() - 1;
        add_window_sums(plane, gp, pp, |o| xp[o.min(last)], stats, sg, sgx);
    }
}

/// One plane's windows into its channel's sums (`plane % sg.len()`): `Σ dout` and, from
/// `at(window)` (the input at the window's maximum), `Σ dout·xhat`, over the windows whose pooled
/// value `pp` is positive. In 8 f32 lanes with a select rather than a branch: whether a window's
/// maximum was positive is a coin toss the branch predictor loses half the time.
#[inline(always)]
fn add_window_sums(
    plane: usize,
    gp: &[f32],
    pp: &[f32],
    at: impl Fn(usize) -> f32,
    stats: (&[f32], &[f32]),
    sg: &mut [f64],
    sgx: &mut [f64],
) {
    let ch = plane % sg.len();
    let (mu, is) = (stats.0[ch], stats.1[ch]);
    let (mut a, mut b) = ([0.0f32; 8], [0.0f32; 8]);
    let (gc, pc) = (gp.chunks_exact(8), pp.chunks_exact(8));
    let full = gp.len() - gc.remainder().len();
    for (k, (gs, ps)) in gc.zip(pc).enumerate() {
        for l in 0..8 {
            let on = ps[l] > 0.0;
            a[l] += pick(on, gs[l], 0.0);
            b[l] += pick(on, gs[l] * (at(8 * k + l) - mu), 0.0);
        }
    }
    let (mut a1, mut b1) = (a.iter().sum::<f32>(), b.iter().sum::<f32>());
    for o in full..gp.len().min(pp.len()) {
        if pp[o] > 0.0 {
            a1 += gp[o];
            b1 += gp[o] * (at(o) - mu);
        }
    }
    sg[ch] += a1 as f64;
    sgx[ch] += (b1 * is) as f64;
}

dispatch!(pooled_input_grad, pooled_input_grad_impl, (d: &mut [f32], xp: &[f32], gp: &[f32], pp: &[f32], ap: &[u32], sel: &mut [f32], k: [f32; 6]));

/// One plane of the fused backward's input gradient: `k (M·dout − Σ dout − xhat·Σ dout·xhat)`
/// with `dout` zero except at each window's maximum `ap` where the pooled value `pp` is positive
/// (`k` = `[mean, invstd, γ·invstd/M, M, Σ dout, Σ dout·xhat]`). `M·dout` is first scattered
/// into the dense `sel` (`M·0` everywhere else, the unfused chain's arithmetic) with a select
/// and an unconditional store, not a branch (see [`pooled_sums_impl`]); one dense pass then
/// writes the plane, and `sel` is reset for the next.
#[inline(always)]
fn pooled_input_grad_impl(
    d: &mut [f32],
    xp: &[f32],
    gp: &[f32],
    pp: &[f32],
    ap: &[u32],
    sel: &mut [f32],
    k: [f32; 6],
) {
    let [mu, is, k, m, sg, sgx] = k;
    let zero = m * 0.0;
    // The clamp keeps a corrupt index inside the plane and lets the compiler drop the check.
    let last = sel.len().saturating_sub(1);
    for ((&gv, &pv), &i) in gp.iter().zip(pp).zip(ap) {
        sel[(i as usize).min(last)] = pick(pv > 0.0, m * gv, zero);
    }
    for ((o, &xv), &s) in d.iter_mut().zip(xp).zip(sel.iter()) {
        *o = k * (s - sg - (xv - mu) * is * sgx);
    }
    for &i in ap {
        sel[(i as usize).min(last)] = zero;
    }
}

/// Sum of `f(v)` over `xs` in 8 independent f32 lanes, so the compiler can vectorise it.
#[inline]
pub(super) fn lane_sum(xs: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    for ch in chunks {
        for i in 0..8 {
            acc[i] += f(ch[i]);
        }
    }
    acc.iter().sum::<f32>() + rest.iter().map(|&v| f(v)).sum::<f32>()
}

impl Layer for BatchNorm2d {
    fn spec(&self) -> LayerSpec {
        LayerSpec::BatchNorm2d {
            channels: self.channels,
            momentum: self.momentum,
            eps: self.eps,
            sync: self.sync,
        }
    }
    fn f32_buffers(&self) -> Vec<(&'static str, &[f32])> {
        vec![
            ("running_mean", &self.running_mean),
            ("running_var", &self.running_var),
        ]
    }
    fn out_dims(&self, inp: &[usize]) -> Result<Vec<usize>, String> {
        match inp {
            [_, c, _, _] if *c == self.channels => Ok(inp.to_vec()),
            _ => Err(format!(
                "batchnorm2d expects [N, {}, H, W], got {inp:?}",
                self.channels
            )),
        }
    }
    fn param_specs(&self) -> Vec<ParamSpec> {
        vec![
            ParamSpec {
                name: "weight",
                dims: vec![self.channels],
                init: Init::Const(1.0),
            },
            ParamSpec {
                name: "bias",
                dims: vec![self.channels],
                init: Init::Const(0.0),
            },
        ]
    }
    fn buffers_mut(&mut self) -> Vec<BufferMut<'_>> {
        vec![
            BufferMut::F32("running_mean", &mut self.running_mean),
            BufferMut::F32("running_var", &mut self.running_var),
            BufferMut::I64("num_batches_tracked", &mut self.num_batches_tracked),
        ]
    }
    fn forward(&mut self, p: &[f32], inp: &Tensor, out: &mut Tensor, train: bool) {
        self.set_stats(inp, train);
        self.apply(p, inp, out);
    }
    fn backward(&mut self, args: Backward<'_>) {
        let (n, hw) = (args.inp.dims()[0], args.inp.dims()[2] * args.inp.dims()[3]);
        self.local_sums(args.dp, args.inp, args.dout);
        if let Some(dinp) = args.dinp {
            self.input_grad(args.p, args.inp, args.dout, dinp, (n * hw) as f32);
        }
    }
}

impl BatchNorm2d {
    /// The statistics a forward pass normalises `inp` with: in training the batch's (saved, and
    /// folded into the running estimates), in evaluation the running ones.
    fn set_stats(&mut self, inp: &Tensor, train: bool) {
        let c = self.channels;
        if train {
            let mut scratch = std::mem::take(&mut self.scratch);
            scratch.resize(2 * c, 0.0);
            let (mean, var) = scratch.split_at_mut(c);
            let m = self.batch_stats(inp, mean, var);
            self.update_stats(mean, var, m as f64);
            self.scratch = scratch;
        } else {
            for ch in 0..c {
                self.mean[ch] = self.running_mean[ch];
                self.invstd[ch] = 1.0 / (self.running_var[ch] + self.eps).sqrt();
            }
        }
    }

    /// Save mean and 1/std for this batch and update the running estimates (unbiased variance).
    fn update_stats(&mut self, mean: &[f64], var: &[f64], m: f64) {
        let unbias = if m > 1.0 { m / (m - 1.0) } else { 1.0 };
        let mo = self.momentum as f64;
        for ch in 0..self.channels {
            self.mean[ch] = mean[ch] as f32;
            self.invstd[ch] = (1.0 / (var[ch] + self.eps as f64).sqrt()) as f32;
            self.running_mean[ch] =
                ((1.0 - mo) * self.running_mean[ch] as f64 + mo * mean[ch]) as f32;
            self.running_var[ch] =
                ((1.0 - mo) * self.running_var[ch] as f64 + mo * var[ch] * unbias) as f32;
        }
        self.num_batches_tracked += 1;
        self.count = m;
    }

    /// `out = gamma * (x - mean) * invstd + beta` with the saved statistics.
    fn apply(&self, p: &[f32], inp: &Tensor, out: &mut Tensor) {
        let (n, c, hw) = (inp.dims()[0], self.channels, inp.dims()[2] * inp.dims()[3]);
        out.resize(inp.dims());
        let (gamma, beta) = p.split_at(c);
        let (x, y) = (inp.data(), out.data_mut());
        for b in 0..n {
            for ch in 0..c {
                // y = x * scale + shift, folded per channel so the inner loop is one FMA.
                let scale = gamma[ch] * self.invstd[ch];
                let shift = beta[ch] - self.mean[ch] * scale;
                let r = (b * c + ch) * hw..(b * c + ch + 1) * hw;
                for (o, &v) in y[r.clone()].iter_mut().zip(&x[r]) {
                    *o = v * scale + shift;
                }
            }
        }
    }

    /// This rank's `Σ dout` and `Σ dout·xhat` per channel into `self.sums`, accumulated into
    /// `dbeta` and `dgamma` (parameter gradients stay local; the gradient all-reduce averages them).
    fn local_sums(&mut self, dp: &mut [f32], inp: &Tensor, dout: &Tensor) {
        let (n, c, hw) = (inp.dims()[0], self.channels, inp.dims()[2] * inp.dims()[3]);
        let (dgamma, dbeta) = dp.split_at_mut(c);
        let (x, g) = (inp.data(), dout.data());
        self.sums.resize(2 * c, 0.0);
        let (sum_g, sum_gx) = self.sums.split_at_mut(c);
        for ch in 0..c {
            let (mu, is) = (self.mean[ch], self.invstd[ch]);
            let (mut sg, mut sgx) = (0.0f64, 0.0f64);
            for b in 0..n {
                let r = (b * c + ch) * hw..(b * c + ch + 1) * hw;
                let (gs, xs) = (&g[r.clone()], &x[r]);
                let (mut a, mut bb) = ([0.0f32; 8], [0.0f32; 8]);
                let mut i = 0;
                while i + 8 <= gs.len() {
                    for l in 0..8 {
                        a[l] += gs[i + l];
                        bb[l] += gs[i + l] * (xs[i + l] - mu);
                    }
                    i += 8;
                }
                let (mut a1, mut b1) = (a.iter().sum::<f32>(), bb.iter().sum::<f32>());
                for j in i..gs.len() {
                    a1 += gs[j];
                    b1 += gs[j] * (xs[j] - mu);
                }
                sg += a1 as f64;
                sgx += (b1 * is) as f64;
            }
            sum_g[ch] = sg as f32;
            sum_gx[ch] = sgx as f32;
            dbeta[ch] += sum_g[ch];
            dgamma[ch] += sum_gx[ch];
        }
    }

    /// `dinp = gamma·invstd/M · (M·dout − Σ dout − xhat·Σ dout·xhat)` from the sums in
    /// `self.sums` over `m` values per channel (this rank's, or all ranks' with SyncBN).
    fn input_grad(&self, p: &[f32], inp: &Tensor, dout: &Tensor, dinp: &mut Tensor, m: f32) {
        let (n, c, hw) = (inp.dims()[0], self.channels, inp.dims()[2] * inp.dims()[3]);
        let gamma = &p[..c];
        let (x, g) = (inp.data(), dout.data());
        let (sum_g, sum_gx) = self.sums.split_at(c);
        dinp.resize(inp.dims());
        let d = dinp.data_mut();
        for b in 0..n {
            for ch in 0..c {
                let (mu, is) = (self.mean[ch], self.invstd[ch]);
                let k = gamma[ch] * is / m;
                let (sg, sgx) = (sum_g[ch], sum_gx[ch]);
                let r = (b * c + ch) * hw..(b * c + ch + 1) * hw;
                for ((o, &gv), &xv) in d[r.clone()].iter_mut().zip(&g[r.clone()]).zip(&x[r]) {
                    *o = k * (m * gv - sg - (xv - mu) * is * sgx);
                }
            }
        }
    }

    /// BatchNorm, then ReLU, then a 2x2 stride-2 max-pool, in one pass over the normalised values
    /// (the model's `module1.1..3` and `module2.1..3`): `out[N, C, H/2, W/2]` and the pool's
    /// `argmax` are written; neither the BatchNorm nor the ReLU output is stored, which saves two
    /// activation-sized writes and reads per block. Each value is computed exactly as the separate
    /// layers do (`x * scale + shift`, `max(·, 0)`, first maximum wins), so `out` and `argmax` are
    /// bit-identical to the unfused chain. `H` and `W` must be even (the model checks).
    pub(crate) fn forward_relu_pool(
        &mut self,
        p: &[f32],
        inp: &Tensor,
        out: &mut Tensor,
        argmax: &mut Vec<u32>,
        train: bool,
    ) {
        let c = self.channels;
        self.set_stats(inp, train);
        let (n, h, w) = (inp.dims()[0], inp.dims()[2], inp.dims()[3]);
        let (oh, ow) = (h / 2, w / 2);
        out.resize(&[n, c, oh, ow]);
        argmax.resize(n * c * oh * ow, 0);
        self.raw_valid = false;
        let (gamma, beta) = p.split_at(c);
        let (x, y) = (inp.data(), out.data_mut());
        let (hw, ohw) = (h * w, oh * ow);
        // Every plane's window `j` has its top-left input at `2j + (j / ow) w` (`w = 2 ow`).
        let corner: Vec<u32> = (0..ohw).map(|j| (2 * j + j / ow * w) as u32).collect();
        let mut vmax = vec![0.0f32; oh * w];
        let mut bottom = vec![0u32; oh * w];
        for (plane, ((xs, yo), ao)) in x
            .chunks_exact(hw)
            .zip(y.chunks_exact_mut(ohw))
            .zip(argmax.chunks_exact_mut(ohw))
            .enumerate()
        {
            let ch = plane % c;
            let scale = gamma[ch] * self.invstd[ch];
            let shift = beta[ch] - self.mean[ch] * scale;
            relu_pool_plane(
                xs,
                w,
                ReluAffine { scale, shift },
                &corner,
                (&mut vmax, &mut bottom),
                yo,
                ao,
            );
        }
    }

    /// The fused forward fed sample by sample by the convolution before it, while each sample's
    /// output is still in cache: sample `b`'s planes `xs` (`[C, H, W]`) get their moments (in
    /// training) and are pooled *before* normalising, into the window values of `self.raw` and
    /// the sample's part of `argmax` (`[C, H/2, W/2]`). [`BatchNorm2d::stream_finish`] then
    /// normalises the pooled values only, so the batch's input is read from memory by no pass.
    ///
    /// This is exact because `v = max(x * scale + shift, 0)` is monotonic in `x` (non-decreasing
    /// for `γ ≥ 0`, non-increasing for `γ < 0`, `scale = γ·invstd`): a window's largest `v` is
    /// `v` of its largest `x` (smallest, for `γ < 0`), so the pooled output is bit-identical to
    /// the unfused chain. Only the argmax can differ, where rounding or the ReLU makes several
    /// `v` equal that were different `x`: it then names the window's largest input rather than
    /// the first of the tied outputs (no gradient flows through a window whose maximum is 0).
    #[allow(clippy::too_many_arguments)] // the sample, its place in the batch and the pool's argmax
    pub(crate) fn stream_sample(
        &mut self,
        p: &[f32],
        n: usize,
        b: usize,
        xs: &[f32],
        hw: (usize, usize),
        argmax: &mut Vec<u32>,
        train: bool,
    ) {
        let (c, (h, w)) = (self.channels, hw);
        let (plane, ohw) = (h * w, (h / 2) * (w / 2));
        if b == 0 {
            self.moments.resize(n * c, (0.0, 0.0));
            self.raw.resize(n * c * ohw, 0.0);
            argmax.resize(n * c * ohw, 0);
            self.raw_valid = false;
        }
        let gamma = &p[..c];
        let wins = b * c * ohw..(b + 1) * c * ohw;
        let (raw, am) = (&mut self.raw[wins.clone()], &mut argmax[wins]);
        if self.corner.len() != ohw {
            // Window `j`'s top-left input is at `2j + (j / ow) w` (`w = 2 ow`).
            self.corner = (0..ohw).map(|j| (2 * j + j / (w / 2) * w) as u32).collect();
        }
        self.vmax.resize((h / 2) * w, 0.0);
        self.bottom.resize((h / 2) * w, 0);
        for (ch, ((x, r), a)) in xs
            .chunks_exact(plane)
            .zip(raw.chunks_exact_mut(ohw))
            .zip(am.chunks_exact_mut(ohw))
            .enumerate()
        {
            if train {
                plane_moments_into(x, &mut self.moments[b * c + ch]);
            }
            pool_raw_plane(
                x,
                w,
                Signed(if gamma[ch] < 0.0 { -1.0 } else { 1.0 }),
                &self.corner,
                (&mut self.vmax, &mut self.bottom),
                r,
                a,
            );
        }
    }

    /// Finish the streamed fused forward of [`BatchNorm2d::stream_sample`]: the batch
    /// statistics from the planes' moments (training) or the running ones, then
    /// `out[N, C, H/2, W/2] = max(raw * scale + shift, 0)`.
    pub(crate) fn stream_finish(
        &mut self,
        p: &[f32],
        dims: &[usize],
        out: &mut Tensor,
        train: bool,
    ) {
        let (c, n, h, w) = (self.channels, dims[0], dims[2], dims[3]);
        let ohw = (h / 2) * (w / 2);
        if train {
            let mut scratch = std::mem::take(&mut self.scratch);
            scratch.resize(2 * c, 0.0);
            let (mean, var) = scratch.split_at_mut(c);
            combine_moments(&self.moments[..n * c], h * w, mean, var);
            self.update_stats(mean, var, (n * h * w) as f64);
            self.scratch = scratch;
        } else {
            for ch in 0..c {
                self.mean[ch] = self.running_mean[ch];
                self.invstd[ch] = 1.0 / (self.running_var[ch] + self.eps).sqrt();
            }
        }
        out.resize(&[n, c, h / 2, w / 2]);
        let (gamma, beta) = p.split_at(c);
        for (plane, (y, r)) in out
            .data_mut()
            .chunks_exact_mut(ohw)
            .zip(self.raw.chunks_exact(ohw))
            .enumerate()
        {
            let ch = plane % c;
            let scale = gamma[ch] * self.invstd[ch];
            let shift = beta[ch] - self.mean[ch] * scale;
            for (o, &v) in y.iter_mut().zip(r) {
                *o = (v * scale + shift).max(0.0);
            }
        }
        self.raw_valid = train;
    }

    /// Backward of [`BatchNorm2d::forward_relu_pool`] from the pooled output `pooled`, its
    /// gradient `dpool` and the pool's `argmax`: the gradient reaching the BatchNorm output is
    /// `dpool` at each window's maximum when that maximum is positive (the ReLU passed it), else 0,
    /// so the per-channel sums visit one value per window instead of four, and the input gradient
    /// is written in one pass with no intermediate tensor. Accumulates `dgamma`, `dbeta` into `dp`
    /// and overwrites `dinp` when given. Equal to the unfused chain up to rounding (the sums skip
    /// the zeros and add in lanes, so in another order).
    #[allow(clippy::too_many_arguments)] // the three fused layers' tensors and state
    pub(crate) fn backward_relu_pool(
        &mut self,
        p: &[f32],
        dp: &mut [f32],
        inp: &Tensor,
        pooled: &Tensor,
        dpool: &Tensor,
        argmax: &[u32],
        dinp: Option<&mut Tensor>,
    ) {
        self.pooled_grad_sums(dp, inp, pooled, dpool, argmax);
        let Some(dinp) = dinp else { return };
        dinp.resize(inp.dims());
        let per = inp.numel() / inp.dims()[0].max(1);
        for (b, d) in dinp.data_mut().chunks_exact_mut(per).enumerate() {
            self.pooled_input_grad_sample(p, inp, pooled, dpool, argmax, b, d);
        }
    }

    /// The first half of [`BatchNorm2d::backward_relu_pool`]: the per-channel sums over the
    /// batch (kept for the second half) and their accumulation into `dgamma`, `dbeta`.
    pub(crate) fn pooled_grad_sums(
        &mut self,
        dp: &mut [f32],
        inp: &Tensor,
        pooled: &Tensor,
        dpool: &Tensor,
        argmax: &[u32],
    ) {
        let (c, h, w) = (self.channels, inp.dims()[2], inp.dims()[3]);
        let (hw, ohw) = (h * w, (h / 2) * (w / 2));
        let (x, g, py) = (inp.data(), dpool.data(), pooled.data());
        let (dgamma, dbeta) = dp.split_at_mut(c);
        self.sums.resize(2 * c, 0.0);
        let mut acc = std::mem::take(&mut self.scratch);
        acc.clear();
        acc.resize(2 * c, 0.0);
        let (sg, sgx) = acc.split_at_mut(c);
        if self.raw_valid && self.raw.len() == py.len() {
            // The streamed forward kept each window's input value: no gather from the input.
            pooled_sums_raw(&self.raw, g, py, ohw, (&self.mean, &self.invstd), sg, sgx);
        } else {
            pooled_sums(
                x,
                g,
                py,
                argmax,
                (hw, ohw),
                (&self.mean, &self.invstd),
                sg,
                sgx,
            );
        }
        let (sum_g, sum_gx) = self.sums.split_at_mut(c);
        for ch in 0..c {
            sum_g[ch] = sg[ch] as f32;
            sum_gx[ch] = sgx[ch] as f32;
            dbeta[ch] += sum_g[ch];
            dgamma[ch] += sum_gx[ch];
        }
        self.scratch = acc;
    }

    /// The second half of [`BatchNorm2d::backward_relu_pool`] for sample `b` only: its input
    /// gradient (`[C, H, W]`) into `d`, from the sums of [`BatchNorm2d::pooled_grad_sums`]. A
    /// convolution before the group takes it sample by sample
    /// ([`DoutSource::Fill`](super::conv2d::DoutSource)), so the batch's gradient is never
    /// stored whole.
    #[allow(clippy::too_many_arguments)] // the three fused layers' tensors and the sample
    pub(crate) fn pooled_input_grad_sample(
        &mut self,
        p: &[f32],
        inp: &Tensor,
        pooled: &Tensor,
        dpool: &Tensor,
        argmax: &[u32],
        b: usize,
        d: &mut [f32],
    ) {
        let (c, h, w) = (self.channels, inp.dims()[2], inp.dims()[3]);
        let (hw, ohw) = (h * w, (h / 2) * (w / 2));
        let m = (inp.dims()[0] * hw) as f32;
        let gamma = &p[..c];
        let (sum_g, sum_gx) = self.sums.split_at(c);
        let (xs, wins) = (b * c * hw..(b + 1) * c * hw, b * c * ohw..(b + 1) * c * ohw);
        let (x, g, py, am) = (
            &inp.data()[xs],
            &dpool.data()[wins.clone()],
            &pooled.data()[wins.clone()],
            &argmax[wins],
        );
        let mut sel = std::mem::take(&mut self.sel);
        sel.clear();
        sel.resize(hw, m * 0.0);
        for (ch, ((dp_, xp), ((gp, pp), ap))) in d
            .chunks_exact_mut(hw)
            .zip(x.chunks_exact(hw))
            .zip(
                g.chunks_exact(ohw)
                    .zip(py.chunks_exact(ohw))
                    .zip(am.chunks_exact(ohw)),
            )
            .enumerate()
        {
            let (mu, is) = (self.mean[ch], self.invstd[ch]);
            let k = gamma[ch] * is / m;
            pooled_input_grad(
                dp_,
                xp,
                gp,
                pp,
                ap,
                &mut sel,
                [mu, is, k, m, sum_g[ch], sum_gx[ch]],
            );
        }
        self.sel = sel;
    }

    /// Training forward with batch statistics over all ranks (SyncBatchNorm): this rank's
    /// per-channel `Σx`, `Σx²` and count are summed through `sum` (an all-reduce), then every
    /// rank normalises with the global mean and variance.
    pub fn forward_synced<E>(
        &mut self,
        p: &[f32],
        inp: &Tensor,
        out: &mut Tensor,
        sum: &mut SumFn<'_, E>,
    ) -> Result<(), E> {
        let (n, c, hw) = (inp.dims()[0], self.channels, inp.dims()[2] * inp.dims()[3]);
        let mut buf = std::mem::take(&mut self.scratch);
        buf.clear();
        buf.resize(2 * c + 1, 0.0);
        let x = inp.data();
        for ch in 0..c {
            let (mut s, mut q) = (0.0f64, 0.0f64);
            for b in 0..n {
                let plane = &x[(b * c + ch) * hw..(b * c + ch + 1) * hw];
                s += lane_sum(plane, |v| v) as f64;
                q += lane_sum(plane, |v| v * v) as f64;
            }
            buf[ch] = s;
            buf[c + ch] = q;
        }
        buf[2 * c] = (n * hw) as f64;
        let r = sum(&mut buf);
        if r.is_ok() {
            let m = buf[2 * c].max(1.0);
            for ch in 0..c {
                let mean = buf[ch] / m;
                buf[ch] = mean;
                buf[c + ch] = (buf[c + ch] / m - mean * mean).max(0.0);
            }
            let (mean, rest) = buf.split_at(c);
            self.update_stats(mean, &rest[..c], m);
            self.apply(p, inp, out);
        }
        self.scratch = buf;
        r
    }

    /// Backward of [`BatchNorm2d::forward_synced`]: parameter gradients from this rank's sums,
    /// the input gradient from the sums over all ranks (summed through `sum`).
    #[allow(clippy::too_many_arguments)]
    pub fn backward_synced<E>(
        &mut self,
        p: &[f32],
        dp: &mut [f32],
        inp: &Tensor,
        dout: &Tensor,
        dinp: Option<&mut Tensor>,
        sum: &mut SumFn<'_, E>,
    ) -> Result<(), E> {
        let c = self.channels;
        self.local_sums(dp, inp, dout);
        let mut buf = std::mem::take(&mut self.scratch);
        buf.clear();
        buf.extend(self.sums.iter().map(|&v| v as f64));
        let r = sum(&mut buf);
        if r.is_ok() {
            for (s, &v) in self.sums.iter_mut().zip(&buf[..2 * c]) {
                *s = v as f32;
            }
            if let Some(dinp) = dinp {
                self.input_grad(p, inp, dout, dinp, self.count as f32);
            }
        }
        self.scratch = buf;
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batchnorm_gradcheck() {
        crate::ops::gradcheck::check(&mut BatchNorm2d::new(3), &[4, 3, 2, 3], true, 7);
    }

    /// Hand-computed PyTorch semantics on one channel with values 1, 2, 3, 4 (N=2, 1x2 images):
    /// mean 2.5, biased var 1.25, unbiased var 5/3; running_mean = 0.9*0 + 0.1*2.5 = 0.25,
    /// running_var = 0.9*1 + 0.1*5/3 = 1.0666667; y = (x-2.5)/sqrt(1.25+1e-5).
    #[test]
    fn batchnorm_matches_pytorch_by_hand() {
        let mut bn = BatchNorm2d::new(1);
        let inp = Tensor::from_vec(&[2, 1, 1, 2], vec![1.0, 2.0, 3.0, 4.0]).unwrap();
        let mut out = Tensor::default();
        bn.forward(&[1.0, 0.0], &inp, &mut out, true);
        let s = (1.25f32 + 1e-5).sqrt();
        for (o, x) in out.data().iter().zip([1.0f32, 2.0, 3.0, 4.0]) {
            assert!((o - (x - 2.5) / s).abs() < 1e-6);
        }
        assert!((bn.running_mean[0] - 0.25).abs() < 1e-7);
        assert!((bn.running_var[0] - 1.0666667).abs() < 1e-6);
        assert_eq!(bn.num_batches_tracked, 1);
        // Eval mode uses the running statistics: y = (x - 0.25)/sqrt(1.0666667 + 1e-5) * 2 + 1.
        bn.forward(&[2.0, 1.0], &inp, &mut out, false);
        let s = (1.0666667f32 + 1e-5).sqrt();
        assert!((out.data()[0] - ((1.0 - 0.25) / s * 2.0 + 1.0)).abs() < 1e-5);
        assert_eq!(bn.num_batches_tracked, 1);
    }
}
