//! The CPU executor: runs a device plan by calling each kernel's CPU twin
//! (`kernels::twins`) on host arenas laid out exactly like the device ones. It makes the
//! device engine's whole step (plan, argument order, buffer plumbing, step sequencing) testable
//! on machines without a GPU; it is a reference, not a fast path (the twins are naive loops).

use half::{bf16, f16};

use super::error::DeviceError;
use super::exec::Exec;
use super::plan::{Arena, Arg, Op, Region};
use crate::ops::optim::AdamHyper;
use crate::ops::{twins, Bn2dShape, Conv2dShape, LinearShape, Pool2dShape};
use lockstep::comm::{Communicator, ReduceOp};

/// Host arenas, one per dtype, plus the dataset.
#[derive(Debug, Default)]
pub struct CpuExec {
    f32: Vec<f32>,
    i32: Vec<i32>,
    bf16: Vec<bf16>,
    f16: Vec<f16>,
    images: Vec<u8>,
    labels: Vec<u8>,
    index_list: Vec<i32>,
    readback: Vec<f32>,
}

/// One argument materialised for a twin call.
enum Val {
    F(Vec<f32>),
    I(Vec<i32>),
    B(Vec<bf16>),
    H(Vec<f16>),
    U(Vec<u8>),
    SI(i32),
    SF(f32),
    SL(i64),
    Taken,
}

struct Vals(Vec<Val>);

/// `Vals` accessors, one per `Val` variant: a buffer is moved out (its slot left `Taken`), a
/// scalar copied; the wrong variant is a bug in the dispatch below, so it panics naming the
/// argument.
macro_rules! accessors {
    ($(buffer $name:ident: $var:ident, $t:ty;)* $(scalar $sname:ident: $svar:ident, $st:ty, $what:literal;)*) => {
        impl Vals {
            $(
                fn $name(&mut self, k: usize) -> Vec<$t> {
                    match std::mem::replace(&mut self.0[k], Val::Taken) {
                        Val::$var(v) => v,
                        _ => panic!("argument {k} is not a {} buffer", stringify!($t)),
                    }
                }
            )*
            $(
                fn $sname(&self, k: usize) -> $st {
                    match self.0[k] {
                        Val::$svar(v) => v,
                        _ => panic!("argument {k} is not {}", $what),
                    }
                }
            )*
        }
    };
}

accessors! {
    buffer f: F, f32;
    buffer i: I, i32;
    buffer b: B, bf16;
    buffer h: H, f16;
    buffer u: U, u8;
    scalar si: SI, i32, "an int";
    scalar sf: SF, f32, "a float";
    scalar sl: SL, i64, "a long long";
}

impl Vals {
    /// The `N` int arguments from `k` on: a kernel's scalar shape, for its shape struct's
    /// `from_kernel_args`.
    fn ints<const N: usize>(&self, k: usize) -> [i32; N] {
        std::array::from_fn(|j| self.si(k + j))
    }
}

impl CpuExec {
    /// Host arenas of the given sizes (zeroed).
    pub fn new(arena_len: (usize, usize, usize, usize)) -> CpuExec {
        CpuExec {
            f32: vec![0.0; arena_len.0],
            i32: vec![0; arena_len.1],
            bf16: vec![bf16::ZERO; arena_len.2],
            f16: vec![f16::ZERO; arena_len.3],
            ..Default::default()
        }
    }

    /// Replace the f16 arena (length must match the layout's).
    pub fn load_f16(&mut self, h: &[f16]) {
        self.f16 = h.to_vec();
    }

    /// A copy of the f16 arena.
    pub fn dump_f16(&self) -> Vec<f16> {
        self.f16.clone()
    }

    /// Replace the f32, i32 and bf16 arenas (tests fill them with random values).
    pub fn load_arenas(&mut self, f: &[f32], i: &[i32], b: &[bf16]) {
        (self.f32, self.i32, self.bf16) = (f.to_vec(), i.to_vec(), b.to_vec());
    }

    /// Copies of the f32, i32 and bf16 arenas.
    pub fn dump_arenas(&self) -> (Vec<f32>, Vec<i32>, Vec<bf16>) {
        (self.f32.clone(), self.i32.clone(), self.bf16.clone())
    }

    /// The dataset's range for a region: dataset arenas run from the offset to the end (the
    /// kernel indexes them by sample id).
    fn span(&self, r: &Region) -> std::ops::Range<usize> {
        match r.arena {
            Arena::Images => r.off..self.images.len(),
            Arena::Labels => r.off..self.labels.len(),
            _ => r.range(),
        }
    }

    fn load(&self, r: &Region) -> Val {
        let s = self.span(r);
        match r.arena {
            Arena::F32 => Val::F(self.f32[s].to_vec()),
            Arena::I32 => Val::I(self.i32[s].to_vec()),
            Arena::Bf16 => Val::B(self.bf16[s].to_vec()),
            Arena::F16 => Val::H(self.f16[s].to_vec()),
            Arena::Images => Val::U(self.images[s].to_vec()),
            Arena::Labels => Val::U(self.labels[s].to_vec()),
        }
    }

    fn store(&mut self, r: &Region, v: Val) {
        let s = self.span(r);
        match (r.arena, v) {
            (Arena::F32, Val::F(x)) => self.f32[s].copy_from_slice(&x),
            (Arena::I32, Val::I(x)) => self.i32[s].copy_from_slice(&x),
            (Arena::Bf16, Val::B(x)) => self.bf16[s].copy_from_slice(&x),
            (Arena::F16, Val::H(x)) => self.f16[s].copy_from_slice(&x),
            (a, _) => panic!("cannot store into {a:?}"),
        }
    }

    /// Call the twin of `op` on copies of its arguments, then write back what it wrote.
    fn call(&mut self, op: &Op) -> Result<(), DeviceError> {
        let mut v = Vals(
            op.args
                .iter()
                .map(|a| match a {
                    Arg::In(r) | Arg::Out(r) => self.load(r),
                    Arg::I32(x) => Val::SI(*x),
                    Arg::F32(x) => Val::SF(*x),
                    Arg::I64(x) => Val::SL(*x),
                })
                .collect(),
        );
        // Written arguments come back here, by position.
        let mut out: Vec<(usize, Val)> = Vec::new();
        let conv = |v: &Vals, k| Conv2dShape::from_kernel_args(v.ints(k));
        let linear = |v: &Vals, k| LinearShape::from_kernel_args(v.ints(k));
        // BatchNorm: `batch, channels, hw` from `dims_at` (after the kernel's buffers), the float
        // settings the kernel takes (0 for those it does not), `relu` at `relu_at`.
        let bn = |v: &Vals, dims_at: usize, (momentum, eps): (f32, f32), relu_at: usize| {
            let [batch, channels, hw] = v.ints::<3>(dims_at).map(|x| x as usize);
            let relu = v.si(relu_at) != 0;
            Bn2dShape {
                batch,
                channels,
                hw,
                momentum,
                eps,
                relu,
            }
        };
        // The GEMM-shaped kernels: (out, a, b, [bias,] shape...) and the weight gradients'
        // (dweight, partials, dout, inp, shape...), whose two f32 buffers are both written.
        macro_rules! conv_fwd {
            ($f:path, $t:ident) => {{
                let (mut o, a, b, bias) = (v.f(0), v.$t(1), v.$t(2), v.f(3));
                $f(&mut o, &a, &b, Some(&bias), conv(&v, 4));
                out.push((0, Val::F(o)));
            }};
        }
        macro_rules! gemm_in {
            ($f:path, $t:ident, $shape:ident) => {{
                let (mut o, a, b) = (v.f(0), v.$t(1), v.$t(2));
                $f(&mut o, &a, &b, $shape(&v, 3));
                out.push((0, Val::F(o)));
            }};
        }
        macro_rules! gemm_dw {
            ($f:path, $t:ident, $shape:ident) => {{
                let (mut o, mut part, a, b) = (v.f(0), v.f(1), v.$t(2), v.$t(3));
                $f(&mut o, &mut part, &a, &b, $shape(&v, 4));
                out.extend([(0, Val::F(o)), (1, Val::F(part))]);
            }};
        }
        macro_rules! lin_fwd {
            ($f:path, $t:ident) => {{
                let (mut o, x, w, b) = (v.f(0), v.$t(1), v.$t(2), v.f(3));
                $f(&mut o, &x, &w, Some(&b), linear(&v, 4), v.si(7));
                out.push((0, Val::F(o)));
            }};
        }
        // `f(out, inp, n)`: the output read by accessor `$o` and returned as `Val::$ov`, the input
        // read by `$i`.
        macro_rules! unary {
            ($f:path, $o:ident => $ov:ident, $i:ident) => {{
                let (mut o, x) = (v.$o(0), v.$i(1));
                $f(&mut o, &x, v.si(2));
                out.push((0, Val::$ov(o)));
            }};
        }
        // `f(dbias, dout, sizes...)`: a bias gradient, `dout` read by accessor `$t`, the sizes
        // from scalar arguments `$k`.
        macro_rules! bias {
            ($f:path, $t:ident, $($k:literal),*) => {{
                let mut o = v.f(0);
                $f(&mut o, &v.$t(1), $(v.si($k)),*);
                out.push((0, Val::F(o)));
            }};
        }
        match op.name {
            "fill_f32" => {
                let mut o = v.f(0);
                twins::fill_f32(&mut o, v.sf(1), v.sl(2));
                out.push((0, Val::F(o)));
            }
            "scale_f32" => {
                let mut o = v.f(0);
                twins::scale_f32(&mut o, v.sf(1), v.sl(2));
                out.push((0, Val::F(o)));
            }
            "axpy_f32" => {
                let (mut y, x) = (v.f(0), v.f(1));
                twins::axpy_f32(&mut y, &x, v.sf(2), v.sl(3));
                out.push((0, Val::F(y)));
            }
            "splitk_reduce_f32" => {
                let (mut o, p) = (v.f(0), v.f(1));
                twins::splitk_reduce_f32(&mut o, &p, v.si(2), v.sl(3));
                out.push((0, Val::F(o)));
            }
            "relu_forward_f32" => unary!(twins::relu_forward_f32, f => F, f),
            "relu_backward_f32" => {
                let (mut d, o, g) = (v.f(0), v.f(1), v.f(2));
                twins::relu_backward_f32(&mut d, &o, &g, v.si(3));
                out.push((0, Val::F(d)));
            }
            "batchnorm2d_forward_train_f32" => {
                let (mut o, mut sm, mut si, mut rm, mut rv) = (v.f(0), v.f(1), v.f(2), v.f(3), v.f(4));
                let (x, w, b) = (v.f(5), v.f(6), v.f(7));
                let shape = bn(&v, 8, (v.sf(11), v.sf(12)), 13);
                let stats = twins::BnStats { save_mean: &mut sm, save_invstd: &mut si, running_mean: &mut rm, running_var: &mut rv };
                twins::batchnorm2d_forward_train_f32(&mut o, stats, &x, &w, &b, shape);
                out.extend([(0, Val::F(o)), (1, Val::F(sm)), (2, Val::F(si)), (3, Val::F(rm)), (4, Val::F(rv))]);
            }
            "batchnorm2d_forward_eval_f32" => {
                let (mut o, x, w, b, rm, rv) = (v.f(0), v.f(1), v.f(2), v.f(3), v.f(4), v.f(5));
                let shape = bn(&v, 6, (0.0, v.sf(9)), 10);
                twins::batchnorm2d_forward_eval_f32(&mut o, &x, &w, &b, &rm, &rv, shape);
                out.push((0, Val::F(o)));
            }
            "batchnorm2d_backward_f32" => {
                let (mut dx, mut dw, mut db) = (v.f(0), v.f(1), v.f(2));
                let (g, x, y, w, m, s) = (v.f(3), v.f(4), v.f(5), v.f(6), v.f(7), v.f(8));
                let shape = bn(&v, 9, (0.0, 0.0), 12);
                twins::batchnorm2d_backward_f32(&mut dx, (&mut dw, &mut db), &g, (&x, &y), &w, (&m, &s), shape);
                out.extend([(0, Val::F(dx)), (1, Val::F(dw)), (2, Val::F(db))]);
            }
            "conv2d_forward_f32" => conv_fwd!(twins::conv2d_forward_f32, f),
            "conv2d_forward_bf16" => conv_fwd!(twins::conv2d_forward_bf16, b),
            "conv2d_forward_f16" => conv_fwd!(twins::conv2d_forward_f16, h),
            "conv2d_backward_input_f32" => gemm_in!(twins::conv2d_backward_input_f32, f, conv),
            "conv2d_backward_input_bf16" => gemm_in!(twins::conv2d_backward_input_bf16, b, conv),
            "conv2d_backward_input_f16" => gemm_in!(twins::conv2d_backward_input_f16, h, conv),
            "conv2d_backward_weight_f32" => gemm_dw!(twins::conv2d_backward_weight_f32, f, conv),
            "conv2d_backward_weight_bf16" => gemm_dw!(twins::conv2d_backward_weight_bf16, b, conv),
            "conv2d_backward_weight_f16" => gemm_dw!(twins::conv2d_backward_weight_f16, h, conv),
            "conv2d_backward_bias_f32" => bias!(twins::conv2d_backward_bias_f32, f, 2, 3, 4, 5),
            "conv2d_backward_bias_bf16" => bias!(twins::conv2d_backward_bias_bf16, b, 2, 3, 4, 5),
            "conv2d_backward_bias_f16" => bias!(twins::conv2d_backward_bias_f16, h, 2, 3, 4, 5),
            "linear_forward_f32" => lin_fwd!(twins::linear_forward_f32, f),
            "linear_forward_bf16" => lin_fwd!(twins::linear_forward_bf16, b),
            "linear_forward_f16" => lin_fwd!(twins::linear_forward_f16, h),
            "linear_backward_input_f32" => gemm_in!(twins::linear_backward_input_f32, f, linear),
            "linear_backward_input_bf16" => gemm_in!(twins::linear_backward_input_bf16, b, linear),
            "linear_backward_input_f16" => gemm_in!(twins::linear_backward_input_f16, h, linear),
            "linear_backward_weight_f32" => gemm_dw!(twins::linear_backward_weight_f32, f, linear),
            "linear_backward_weight_bf16" => gemm_dw!(twins::linear_backward_weight_bf16, b, linear),
            "linear_backward_weight_f16" => gemm_dw!(twins::linear_backward_weight_f16, h, linear),
            "linear_backward_bias_f32" => bias!(twins::linear_backward_bias_f32, f, 2, 3),
            "linear_backward_bias_bf16" => bias!(twins::linear_backward_bias_bf16, b, 2, 3),
            "linear_backward_bias_f16" => bias!(twins::linear_backward_bias_f16, h, 2, 3),
            "softmax_xent_forward_f32" => {
                let (mut l, mut p, mut m, mut c) = (v.f(0), v.f(1), v.f(2), v.i(3));
                let (z, t) = (v.f(4), v.i(5));
                twins::softmax_xent_forward_f32(&mut l, &mut p, &mut m, &mut c, &z, &t, v.si(6), v.si(7));
                out.extend([(0, Val::F(l)), (1, Val::F(p)), (2, Val::F(m)), (3, Val::I(c))]);
            }
            "softmax_xent_backward_f32" => {
                let (mut d, p, t) = (v.f(0), v.f(1), v.i(2));
                twins::softmax_xent_backward_f32(&mut d, &p, &t, v.si(3), v.si(4));
                out.push((0, Val::F(d)));
            }
            "softmax_xent_backward_scaled_f32" => {
                let (mut d, p, t, sc) = (v.f(0), v.f(1), v.i(2), v.f(5));
                twins::softmax_xent_backward_scaled_f32(&mut d, &p, &t, v.si(3), v.si(4), &sc);
                out.push((0, Val::F(d)));
            }
            "amp_unscale_f32" => {
                let (mut g, mut flag, sc) = (v.f(0), v.f(1), v.f(2));
                twins::amp_unscale_f32(&mut g, &mut flag, &sc, v.si(3));
                out.extend([(0, Val::F(g)), (1, Val::F(flag))]);
            }
            "grad_norm_partials_f32" => {
                let (mut p, g) = (v.f(0), v.f(1));
                twins::grad_norm_partials_f32(&mut p, &g, v.si(2), v.si(3));
                out.push((0, Val::F(p)));
            }
            "grad_norm_coef_f32" => {
                let (mut c, mut nm, mut bad, p) = (v.f(0), v.f(1), v.i(2), v.f(3));
                twins::grad_norm_coef_f32(&mut c, &mut nm, &mut bad, &p, v.si(4), v.sf(5), v.si(6));
                out.extend([(0, Val::F(c)), (1, Val::F(nm)), (2, Val::I(bad))]);
            }
            "clip_grad_scale_f32" => {
                let (mut g, c) = (v.f(0), v.f(1));
                twins::clip_grad_scale_f32(&mut g, &c, v.si(2));
                out.push((0, Val::F(g)));
            }
            "adam_step_f32" => {
                let (mut p, g, mut m, mut s) = (v.f(0), v.f(1), v.f(2), v.f(3));
                let h = AdamHyper { beta1: v.sf(6), beta2: v.sf(7), eps: v.sf(8), weight_decay: v.sf(9) };
                twins::adam_step_f32(&mut p, &g, (&mut m, &mut s), v.si(4), v.sf(5), &h, v.si(10));
                out.extend([(0, Val::F(p)), (2, Val::F(m)), (3, Val::F(s))]);
            }
            "sgd_step_f32" => {
                let (mut p, g, mut b) = (v.f(0), v.f(1), v.f(2));
                twins::sgd_step_f32(&mut p, &g, &mut b, v.si(3), v.sf(4), v.sf(5), v.sf(6), v.sf(7), v.si(8), v.si(9));
                out.extend([(0, Val::F(p)), (2, Val::F(b))]);
            }
            "maxpool2d_forward_f32" => {
                let (mut o, mut ix, x) = (v.f(0), v.i(1), v.f(2));
                let shape = Pool2dShape::from_kernel_args(v.ints(3));
                twins::maxpool2d_forward_f32(&mut o, &mut ix, &x, shape);
                out.extend([(0, Val::F(o)), (1, Val::I(ix))]);
            }
            "maxpool2d_backward_f32" => {
                let (mut d, g, ix) = (v.f(0), v.f(1), v.i(2));
                let shape = Pool2dShape::from_kernel_args(v.ints(3));
                twins::maxpool2d_backward_f32(&mut d, &g, &ix, shape);
                out.push((0, Val::F(d)));
            }
            "gather_batch_f32" => {
                let (mut im, mut lb, di, dl, ix) = (v.f(0), v.i(1), v.u(2), v.u(3), v.i(4));
                twins::gather_batch_f32(&mut im, &mut lb, &di, &dl, &ix, v.si(5), v.si(6));
                out.extend([(0, Val::F(im)), (1, Val::I(lb))]);
            }
            "cast_f32_bf16" => unary!(twins::cast_f32_bf16, b => B, f),
            "cast_bf16_f32" => unary!(twins::cast_bf16_f32, f => F, b),
            "cast_f32_f16" => unary!(twins::cast_f32_f16, h => H, f),
            "cast_f16_f32" => unary!(twins::cast_f16_f32, f => F, h),
            other => {
                return Err(DeviceError::Unsupported(format!(
                    "the CPU executor has no twin dispatch for {other} (bucket kernels take device addresses)"
                )))
            }
        }
        for (k, val) in out {
            let Arg::Out(r) = op.args[k] else {
                return Err(DeviceError::Unsupported(format!(
                    "{}: argument {k} is written by the twin but passed as input",
                    op.name
                )));
            };
            self.store(&r, val);
        }
        Ok(())
    }
}

impl Exec for CpuExec {
    fn sm_count(&self) -> usize {
        1
    }
    fn upload_dataset(&mut self, images: &[u8], labels: &[u8]) -> Result<(), DeviceError> {
        self.images = images.to_vec();
        self.labels = labels.to_vec();
        Ok(())
    }
    fn write_f32(&mut self, r: Region, data: &[f32]) -> Result<(), DeviceError> {
        self.f32[r.range()].copy_from_slice(data);
        Ok(())
    }
    fn read_f32(&mut self, r: Region) -> Result<Vec<f32>, DeviceError> {
        Ok(self.f32[r.range()].to_vec())
    }
    fn read_i32(&mut self, r: Region) -> Result<Vec<i32>, DeviceError> {
        Ok(self.i32[r.range()].to_vec())
    }
    fn load_index_list(&mut self, idx: &[i32]) -> Result<(), DeviceError> {
        self.index_list = idx.to_vec();
        Ok(())
    }
    fn select_indices(&mut self, dst: Region, start: usize) -> Result<(), DeviceError> {
        let src = self.index_list.get(start..start + dst.len).ok_or_else(|| {
            DeviceError::Config(format!("index list too short for {start}+{}", dst.len))
        })?;
        self.i32[dst.range()].copy_from_slice(src);
        Ok(())
    }
    fn run(&mut self, op: &Op) -> Result<(), DeviceError> {
        self.call(op)
    }
    fn all_reduce_mean(&mut self, comm: &mut Communicator, r: Region) -> Result<(), DeviceError> {
        comm.all_reduce_in_place(&mut self.f32[r.range()], ReduceOp::Avg)?;
        Ok(())
    }
    fn broadcast(
        &mut self,
        comm: &mut Communicator,
        r: Region,
        root: usize,
    ) -> Result<(), DeviceError> {
        comm.broadcast_in_place(&mut self.f32[r.range()], root)?;
        Ok(())
    }
    fn stash(&mut self, v: Vec<f32>) {
        self.readback = v;
    }
    fn take_stash(&mut self) -> Vec<f32> {
        std::mem::take(&mut self.readback)
    }
}
