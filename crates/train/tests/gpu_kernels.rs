//! Every kernel against its CPU twin on random inputs, odd shapes included (batch 1, 3, 65;
//! channel counts off the 64-wide tiles), through the device engine's own executors: the same
//! [`Op`] runs on `GpuExec` (the kernel) and `CpuExec` (the twin) from identical arenas, and every
//! region it writes is compared with `assert_close`.
//!
//! Without a driver (and without LOCKSTEP_REQUIRE_GPU=1, which makes that a failure) the same
//! checks run on the simulated GPU: the real kernel sources compiled as host C++ under the SIMT
//! shim (`tests/simt`, built by `tests/common/simt.rs`), once with TF32 off, once on and once
//! without tensor cores. Kernels are built with `-DLOCKSTEP_NO_TF32` unless
//! `LOCKSTEP_NVRTC_OPTIONS` is already set.
//!
//! Tolerances (|got - want| <= atol + rtol * |want|):
//! - f32 GEMMs (conv, linear) without TF32: 1e-4 / 1e-4; with TF32: 2e-3*sqrt(K) / 1e-2;
//! - bf16 and fp16 GEMMs (same 16-bit operands on both sides, f32 accumulation): 1e-3 / 1e-3;
//! - BatchNorm (f32 tree reductions vs f64): 1e-4 / 1e-4; loss: 1e-5 / 1e-5;
//! - Adam/SGD: 1e-6 / 1e-5; elementwise: 1e-6 / 1e-6 (FMA contraction); pooling, gather, casts,
//!   bucket copies, gradient-norm clipping (fixed-order f64 reductions): exact.

#[path = "../../../tests/common/close.rs"]
mod close;
#[path = "../../../tests/common/gpu.rs"]
mod gpu;
#[path = "../../../tests/common/runner.rs"]
mod runner;
#[path = "common/simt.rs"]
mod simt;

use close::{assert_close, Tol};
use half::{bf16, f16};
use lockstep::cuda::{DeviceBuffer, KernelGrid};
use lockstep_train::device::kernels::{twins, BucketEntry, KernelId};
use lockstep_train::device::plan::{
    splitk_workspace_len, AdamHyper, Arena, Arg, BnTensors, Builder, ClipTensors, LossTensors, Op,
    Region, CLIP_PARTIALS,
};
use lockstep_train::device::{CpuExec, Exec, GpuExec, Precision};
use lockstep_train::ops::{Bn2dShape, Conv2dParams, LinearShape, Pool2dShape};
use lockstep_train::rng::Rng;

const EXACT: Tol = Tol::new(0.0, 0.0);

/// Bump allocator for one case's arenas.
#[derive(Default)]
struct Lay {
    len: [usize; 4],
}

impl Lay {
    fn f(&mut self, n: usize) -> Region {
        self.take(0, Arena::F32, n)
    }
    fn i(&mut self, n: usize) -> Region {
        self.take(1, Arena::I32, n)
    }
    fn b(&mut self, n: usize) -> Region {
        self.take(2, Arena::Bf16, n)
    }
    fn h(&mut self, n: usize) -> Region {
        self.take(3, Arena::F16, n)
    }
    /// A GEMM operand in `prec`'s arena (accumulators and biases stay f32 whatever `prec` is).
    fn operand(&mut self, prec: Precision, n: usize) -> Region {
        match prec {
            Precision::Fp32 => self.f(n),
            Precision::Bf16 => self.b(n),
            Precision::Fp16 => self.h(n),
        }
    }
    fn take(&mut self, k: usize, arena: Arena, n: usize) -> Region {
        let off = self.len[k];
        self.len[k] += n + 3; // a gap, so an overrun shows up as a mismatch in the next region
        Region { arena, off, len: n }
    }
}

/// Run `ops` on both executors from the same random arenas (i32 values in `0..i32_bound`) and
/// compare every written region.
fn compare(
    what: &str,
    ctx: &std::sync::Arc<lockstep::cuda::Context>,
    lay: &Lay,
    ops: &[Op],
    i32_bound: u32,
    tol: Tol,
    seed: u64,
) -> Result<(), String> {
    let mut rng = Rng::new(seed, 17);
    let f: Vec<f32> = (0..lay.len[0]).map(|_| rng.uniform(-1.0, 1.0)).collect();
    let i: Vec<i32> = (0..lay.len[1])
        .map(|_| rng.below(i32_bound.max(1)) as i32)
        .collect();
    let b: Vec<bf16> = (0..lay.len[2])
        .map(|_| bf16::from_f32(rng.uniform(-1.0, 1.0)))
        .collect();
    let h: Vec<f16> = (0..lay.len[3])
        .map(|_| f16::from_f32(rng.uniform(-1.0, 1.0)))
        .collect();
    let lens = (lay.len[0], lay.len[1], lay.len[2], lay.len[3]);
    let images: Vec<u8> = (0..40 * 784).map(|_| rng.below(256) as u8).collect();
    let labels: Vec<u8> = (0..40).map(|_| rng.below(10) as u8).collect();
    let e = |e: lockstep_train::device::DeviceError| format!("{what}: {e}");
    let mut c = CpuExec::new(lens);
    c.load_arenas(&f, &i, &b);
    c.load_f16(&h);
    c.upload_dataset(&images, &labels).map_err(e)?;
    let mut g = GpuExec::new(ctx, lens, false).map_err(|x| x.to_string())?;
    g.load_arenas(&f, &i, &b).map_err(|x| x.to_string())?;
    g.load_f16(&h).map_err(|x| x.to_string())?;
    g.upload_dataset(&images, &labels).map_err(e)?;
    for op in ops {
        c.run(op).map_err(e)?;
        g.run(op).map_err(e)?;
    }
    let (cf, ci, cb) = c.dump_arenas();
    let (gf, gi, gb) = g.dump_arenas().map_err(|x| x.to_string())?;
    let (ch, gh) = (c.dump_f16(), g.dump_f16().map_err(|x| x.to_string())?);
    let h64 = |v: &[f16]| v.iter().map(|x| x.to_f64()).collect::<Vec<f64>>();
    for op in ops {
        for (k, a) in op.args.iter().enumerate() {
            let Arg::Out(r) = a else { continue };
            let name = format!("{what}: {} arg {k}", op.name);
            match r.arena {
                Arena::F32 => assert_close(&name, &gf[r.range()], &cf[r.range()], tol)?,
                Arena::I32 => assert_close(&name, &gi[r.range()], &ci[r.range()], EXACT)?,
                Arena::Bf16 => assert_close(
                    &name,
                    &close::bf16_f64(&gb[r.range()]),
                    &close::bf16_f64(&cb[r.range()]),
                    EXACT,
                )?,
                Arena::F16 => {
                    assert_close(&name, &h64(&gh[r.range()]), &h64(&ch[r.range()]), EXACT)?
                }
                _ => return Err(format!("{name}: writes a dataset arena")),
            }
        }
    }
    Ok(())
}

fn op(kernel: KernelId, name: &'static str, args: Vec<Arg>, n: usize) -> Op {
    Op {
        kernel,
        name,
        args,
        cfg: KernelGrid::for_elements(n),
    }
}

fn main() {
    simt::run_on_sim_without_gpu(&[
        ("TF32 off", "-DLOCKSTEP_NO_TF32"),
        ("TF32 on", ""),
        ("no tensor cores", "-DLOCKSTEP_NO_TENSOR_CORES"),
    ]);
    gpu::driver_or_skip();
    let tf32 = gpu::tf32_unless_disabled();
    let ctx = gpu::context_or_skip();
    println!(
        "  device: {:?}; TF32 {}",
        ctx.info().map(|i| i.name).unwrap_or_default(),
        if tf32 { "on" } else { "off" }
    );
    let sm = ctx.info().map(|i| i.sm_count as usize).unwrap_or(1);
    // A GEMM over `k` products in `prec`: 16-bit operands (same on both sides, f32 accumulation)
    // get one fixed bound; f32 depends on whether TF32 rounds the operands.
    let gemm_tol = |prec: Precision, k: usize| match prec {
        Precision::Fp32 if tf32 => Tol::new(2e-3 * (k as f64).sqrt(), 1e-2),
        Precision::Fp32 => Tol::new(1e-4, 1e-4),
        Precision::Bf16 | Precision::Fp16 => Tol::new(1e-3, 1e-3),
    };
    let mut r = gpu::Runner::new();

    r.run("elementwise_and_casts", || {
        for n in [1usize, 3, 65, 1000, 70_001] {
            let mut l = Lay::default();
            let (x, y, o, h, parts, hh, xh) =
                (l.f(n), l.f(n), l.f(n), l.b(n), l.f(3 * n), l.h(n), l.f(n));
            let ops = vec![
                op(
                    KernelId::Elementwise,
                    "splitk_reduce_f32",
                    vec![Arg::Out(y), Arg::In(parts), Arg::I32(3), Arg::I64(n as i64)],
                    n,
                ),
                op(
                    KernelId::Elementwise,
                    "axpy_f32",
                    vec![Arg::Out(y), Arg::In(x), Arg::F32(0.75), Arg::I64(n as i64)],
                    n,
                ),
                op(
                    KernelId::Elementwise,
                    "scale_f32",
                    vec![Arg::Out(y), Arg::F32(-1.5), Arg::I64(n as i64)],
                    n,
                ),
                op(
                    KernelId::Activation,
                    "relu_forward_f32",
                    vec![Arg::Out(o), Arg::In(y), Arg::I32(n as i32)],
                    n,
                ),
                op(
                    KernelId::Data,
                    "cast_f32_bf16",
                    vec![Arg::Out(h), Arg::In(o), Arg::I32(n as i32)],
                    n,
                ),
                op(
                    KernelId::Data,
                    "cast_bf16_f32",
                    vec![Arg::Out(x), Arg::In(h), Arg::I32(n as i32)],
                    n,
                ),
                // Scaled up so fp16's rounding, subnormals and overflow to infinity all occur.
                op(
                    KernelId::Elementwise,
                    "scale_f32",
                    vec![Arg::Out(parts), Arg::F32(7e4), Arg::I64(n as i64)],
                    n,
                ),
                op(
                    KernelId::Data,
                    "cast_f32_f16",
                    vec![Arg::Out(hh), Arg::In(parts.sub(0, n)), Arg::I32(n as i32)],
                    n,
                ),
                op(
                    KernelId::Data,
                    "cast_f16_f32",
                    vec![Arg::Out(xh), Arg::In(hh), Arg::I32(n as i32)],
                    n,
                ),
                op(
                    KernelId::Activation,
                    "relu_backward_f32",
                    vec![Arg::Out(y), Arg::In(o), Arg::In(x), Arg::I32(n as i32)],
                    n,
                ),
                op(
                    KernelId::Elementwise,
                    "fill_f32",
                    vec![Arg::Out(o), Arg::F32(2.5), Arg::I64(n as i64)],
                    n,
                ),
            ];
            // axpy may contract to an FMA on the GPU: last-bit differences are allowed.
            compare(
                &format!("elementwise n={n}"),
                &ctx,
                &l,
                &ops,
                1,
                Tol::new(1e-6, 1e-6),
                n as u64,
            )?;
        }
        Ok(())
    });

    r.run("gather_batch", || {
        for b in [1usize, 3, 33] {
            let mut l = Lay::default();
            let (img, lab, idx) = (l.f(b * 784), l.i(b), l.i(b));
            let mut ops = Builder::new(sm);
            ops.gather(img, lab, idx, b, 784);
            compare(
                &format!("gather b={b}"),
                &ctx,
                &l,
                &ops.ops,
                40,
                EXACT,
                b as u64,
            )?;
        }
        Ok(())
    });

    for prec in [Precision::Fp32, Precision::Bf16, Precision::Fp16] {
        let name = ["conv2d_f32", "conv2d_bf16", "conv2d_f16"][prec as usize];
        r.run(name, || {
            for &(n, ic, h, w, oc, k, s, p) in &[
                (
                    1usize, 1usize, 28usize, 28usize, 32usize, 5usize, 1usize, 2usize,
                ),
                (3, 3, 7, 6, 5, 3, 2, 1),
                (65, 2, 5, 5, 3, 3, 1, 1),
                (3, 33, 9, 9, 65, 5, 1, 2),
                (2, 32, 14, 14, 64, 5, 1, 2),
            ] {
                let cp = Conv2dParams::new(ic, oc, k, s, p);
                let (oh, ow) = (cp.out_h(h), cp.out_w(w));
                let mut l = Lay::default();
                let (x, wt, dy) = (
                    l.operand(prec, n * ic * h * w),
                    l.operand(prec, oc * cp.k()),
                    l.operand(prec, n * oc * oh * ow),
                );
                let (bias, y, dx, dw, db) = (
                    l.f(oc),
                    l.f(n * oc * oh * ow),
                    l.f(n * ic * h * w),
                    l.f(oc * cp.k()),
                    l.f(oc),
                );
                let s = cp.for_input(n, h, w);
                // Split-K weight gradient: the partial planes are compared too (the twin cuts K
                // the same way), then the reduction.
                let ws = l.f(splitk_workspace_len(oc, cp.k(), n * oh * ow));
                let mut ops = Builder::with_splitk(sm, ws);
                ops.conv_forward(prec, y, x, (wt, bias), s);
                ops.conv_backward_input(prec, dx, dy, wt, s);
                ops.conv_backward_weight(prec, dw, dy, x, s);
                ops.conv_backward_bias(prec, db, dy, s);
                compare(
                    &format!(
                        "{name} n={n} ic={ic} {h}x{w} oc={oc} k={k} s={} p={p}",
                        s.params.stride
                    ),
                    &ctx,
                    &l,
                    &ops.ops,
                    1,
                    gemm_tol(prec, ic * k * k).max_of(gemm_tol(prec, n * oh * ow)),
                    (n * 1000 + oc) as u64,
                )?;
            }
            Ok(())
        });
        let name = ["linear_f32", "linear_bf16", "linear_f16"][prec as usize];
        r.run(name, || {
            for &(n, inf, outf) in &[
                (1usize, 5usize, 3usize),
                (3, 3136, 64),
                (65, 17, 10),
                (64, 64, 10),
                (2, 70, 65),
            ] {
                let mut l = Lay::default();
                let (x, wt, dy) = (
                    l.operand(prec, n * inf),
                    l.operand(prec, outf * inf),
                    l.operand(prec, n * outf),
                );
                let (bias, y, yr, dx, dw, db) = (
                    l.f(outf),
                    l.f(n * outf),
                    l.f(n * outf),
                    l.f(n * inf),
                    l.f(outf * inf),
                    l.f(outf),
                );
                let ws = l.f(splitk_workspace_len(outf, inf, n));
                let mut ops = Builder::with_splitk(sm, ws);
                let s = LinearShape {
                    batch: n,
                    in_f: inf,
                    out_f: outf,
                };
                ops.linear_forward(prec, y, x, (wt, bias), s, false);
                ops.linear_forward(prec, yr, x, (wt, bias), s, true);
                ops.linear_backward_input(prec, dx, dy, wt, s);
                ops.linear_backward_weight(prec, dw, dy, x, s);
                ops.linear_backward_bias(prec, db, dy, n, outf);
                compare(
                    &format!("{name} n={n} in={inf} out={outf}"),
                    &ctx,
                    &l,
                    &ops.ops,
                    1,
                    gemm_tol(prec, inf.max(outf).max(n)),
                    (n * 7 + inf) as u64,
                )?;
            }
            Ok(())
        });
    }

    r.run("batchnorm", || {
        for &(n, c, hw) in &[
            (1usize, 3usize, 25usize),
            (3, 32, 49),
            (65, 5, 9),
            (2, 4, 1),
            (64, 64, 196),
        ] {
            for relu in [false, true] {
                let mut l = Lay::default();
                let (x, gamma, beta, y, ye, dy, dx, dg, dbt) = (
                    l.f(n * c * hw),
                    l.f(c),
                    l.f(c),
                    l.f(n * c * hw),
                    l.f(n * c * hw),
                    l.f(n * c * hw),
                    l.f(n * c * hw),
                    l.f(c),
                    l.f(c),
                );
                let bn = BnTensors {
                    mean: l.f(c),
                    invstd: l.f(c),
                    running_mean: l.f(c),
                    running_var: l.f(c),
                };
                let mut ops = Builder::new(sm);
                // running_var must be positive: take |x| + 0.5 through the kernels themselves.
                ops.ops.push(op(
                    KernelId::Elementwise,
                    "fill_f32",
                    vec![Arg::Out(bn.running_var), Arg::F32(0.7), Arg::I64(c as i64)],
                    c,
                ));
                let s = Bn2dShape {
                    batch: n,
                    channels: c,
                    hw,
                    momentum: 0.1,
                    eps: 1e-5,
                    relu,
                };
                ops.bn_forward_train(y, &bn, x, (gamma, beta), s);
                ops.bn_forward_eval(ye, &bn, x, (gamma, beta), s);
                ops.bn_backward((dx, dg, dbt), dy, (x, y), gamma, &bn, s);
                compare(
                    &format!("batchnorm n={n} c={c} hw={hw} relu={relu}"),
                    &ctx,
                    &l,
                    &ops.ops,
                    1,
                    Tol::new(1e-4, 1e-4),
                    (n + c + hw) as u64,
                )?;
            }
        }
        Ok(())
    });

    r.run("maxpool", || {
        for &(n, c, h, w, k) in &[
            (1usize, 1usize, 4usize, 5usize, 2usize),
            (3, 3, 7, 5, 3),
            (65, 2, 28, 28, 2),
            (2, 64, 14, 14, 2),
        ] {
            let (oh, ow) = ((h - k) / k + 1, (w - k) / k + 1);
            let mut l = Lay::default();
            let (x, y, idx, dy, dx) = (
                l.f(n * c * h * w),
                l.f(n * c * oh * ow),
                l.i(n * c * oh * ow),
                l.f(n * c * oh * ow),
                l.f(n * c * h * w),
            );
            let mut ops = Builder::new(sm);
            let s = Pool2dShape {
                batch: n,
                channels: c,
                in_h: h,
                in_w: w,
                kernel: k,
                stride: k,
            };
            ops.maxpool_forward(y, idx, x, s);
            ops.maxpool_backward(dx, dy, idx, s);
            compare(
                &format!("maxpool n={n} c={c} {h}x{w} k={k}"),
                &ctx,
                &l,
                &ops.ops,
                1,
                EXACT,
                (n * c) as u64,
            )?;
        }
        Ok(())
    });

    r.run("softmax_xent", || {
        for &(n, classes) in &[(1usize, 10usize), (3, 7), (65, 10), (300, 10), (2, 40)] {
            let mut l = Lay::default();
            let t = LossTensors {
                losses: l.f(n),
                probs: l.f(n * classes),
                mean_loss: l.f(1),
                loss_sum: l.f(1),
                correct: l.i(1),
            };
            let (z, labels, dz) = (l.f(n * classes), l.i(n), l.f(n * classes));
            let mut ops = Builder::new(sm);
            ops.xent_forward(&t, z, labels, n, classes);
            ops.xent_backward(dz, t.probs, labels, (n, classes), None);
            compare(
                &format!("softmax_xent n={n} classes={classes}"),
                &ctx,
                &l,
                &ops.ops,
                classes as u32,
                Tol::new(1e-5, 1e-5),
                n as u64,
            )?;
        }
        Ok(())
    });

    r.run("optimizers", || {
        for n in [1usize, 3, 65, 100_003] {
            let mut l = Lay::default();
            let (p, g, m, v, buf) = (l.f(n), l.f(n), l.f(n), l.f(n), l.f(n));
            let mut ops = Builder::new(sm);
            // m and v start random; v must be non-negative: square it via axpy-free trick (fill).
            ops.ops.push(op(
                KernelId::Elementwise,
                "fill_f32",
                vec![Arg::Out(v), Arg::F32(0.01), Arg::I64(n as i64)],
                n,
            ));
            for step in 1..=3 {
                ops.adam(
                    p,
                    g,
                    (m, v),
                    &AdamHyper {
                        weight_decay: 0.01,
                        ..Default::default()
                    },
                    1e-3,
                    step,
                );
            }
            for (first, nesterov) in [(1, 0), (0, 1), (0, 0)] {
                let a = vec![
                    Arg::Out(p),
                    Arg::In(g),
                    Arg::Out(buf),
                    Arg::I32(n as i32),
                    Arg::F32(0.1),
                    Arg::F32(0.9),
                    Arg::F32(0.1),
                    Arg::F32(0.01),
                    Arg::I32(nesterov),
                    Arg::I32(first),
                ];
                ops.ops.push(op(KernelId::Optim, "sgd_step_f32", a, n));
            }
            compare(
                &format!("optimizers n={n}"),
                &ctx,
                &l,
                &ops.ops,
                1,
                Tol::new(1e-6, 1e-5),
                n as u64,
            )?;
        }
        Ok(())
    });

    r.run("clip_grad_norm", || {
        // Bit-identical to the twins: the reductions have one fixed order (any grid). With and
        // without clipping at work, a grid other than the builder's, and an inf gradient.
        for n in [1usize, 3, 65, 1000, 70_001, 300_007] {
            for (max_norm, grid) in [
                (0.5f32, None),
                (1e9, None),
                (0.5, Some(7u32)),
                (1.0, Some(1)),
            ] {
                let mut l = Lay::default();
                let g = l.f(n);
                let c = ClipTensors {
                    partials: l.f(CLIP_PARTIALS),
                    coef: l.f(1),
                    norm: l.f(1),
                    nonfinite_step: l.i(1),
                };
                let mut ops = Builder::new(sm);
                if grid == Some(1) {
                    ops.ops.push(op(
                        KernelId::Elementwise,
                        "fill_f32",
                        vec![
                            Arg::Out(g.sub(n / 2, 1)),
                            Arg::F32(f32::INFINITY),
                            Arg::I64(1),
                        ],
                        1,
                    ));
                }
                ops.clip_grad_norm(g, &c, max_norm, 5);
                if let Some(blocks) = grid {
                    let k = ops.ops.len() - 3;
                    ops.ops[k].cfg.grid = (blocks, 1, 1);
                }
                let what = format!("clip_grad_norm n={n} max_norm={max_norm} grid={grid:?}");
                compare(&what, &ctx, &l, &ops.ops, 1, EXACT, n as u64)?;
            }
        }
        Ok(())
    });

    r.run("splitk_reduce_exact", || {
        // The engine's one cross-plane sum: planes added in slice order, no atomics, no
        // multiply to contract, so bit-identical to its twin (docs/determinism.md).
        for n in [1usize, 3, 65, 1000, 70_001] {
            for splits in [1usize, 2, 3, 5] {
                let mut l = Lay::default();
                let (out, parts) = (l.f(n), l.f(splits * n));
                let ops = vec![op(
                    KernelId::Elementwise,
                    "splitk_reduce_f32",
                    vec![
                        Arg::Out(out),
                        Arg::In(parts),
                        Arg::I32(splits as i32),
                        Arg::I64(n as i64),
                    ],
                    n,
                )];
                let what = format!("splitk_reduce n={n} splits={splits}");
                compare(&what, &ctx, &l, &ops, 1, EXACT, n as u64)?;
            }
        }
        Ok(())
    });

    r.run("bucket_flatten_unflatten", || {
        let stream = ctx.stream().map_err(|e| e.to_string())?;
        let c = |e: lockstep::cuda::CudaError| e.to_string();
        let mut rng = Rng::new(9, 9);
        let lens = [1usize, 300, 65, 7];
        let host: Vec<Vec<f32>> = lens
            .iter()
            .map(|&n| (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect())
            .collect();
        let mut dev: Vec<DeviceBuffer<f32>> = host
            .iter()
            .map(|h| DeviceBuffer::from_host(&stream, h))
            .collect::<Result<_, _>>()
            .map_err(c)?;
        let total: usize = lens.iter().sum();
        let mut offs = Vec::new();
        let mut o = 0;
        for n in lens {
            offs.push(o);
            o += n;
        }
        let words: Vec<i64> = dev
            .iter()
            .zip(&offs)
            .zip(lens)
            .flat_map(|((d, &off), n)| {
                BucketEntry {
                    ptr: d.device_ptr(),
                    offset: off as i64,
                    len: n as i64,
                }
                .to_words()
            })
            .collect();
        let table = DeviceBuffer::from_host(&stream, &words).map_err(c)?;
        let mut bucket = DeviceBuffer::<f32>::zeros(&stream, total).map_err(c)?;
        // grid (ceil(largest/256), entries), block 256
        let cfg = KernelGrid {
            grid: (300usize.div_ceil(256) as u32, lens.len() as u32, 1),
            block: (256, 1, 1),
            shared_mem: 0,
        };
        ctx.function(KernelId::Data.source(), "bucket_flatten_f32")
            .map_err(c)?
            .launch(cfg)
            .arg_mut(&mut bucket)
            .arg(&table)
            .scalar(lens.len() as i32)
            .run(&stream)
            .map_err(c)?;
        let mut want = vec![0.0f32; total];
        let src: Vec<twins::BucketSrc> = host
            .iter()
            .zip(&offs)
            .map(|(h, &off)| twins::BucketSrc {
                tensor: h,
                offset: off as i64,
                len: h.len() as i64,
            })
            .collect();
        twins::bucket_flatten_f32(&mut want, &src, lens.len() as i32);
        assert_close("bucket", &bucket.to_vec(&stream).map_err(c)?, &want, EXACT)?;
        ctx.function(KernelId::Data.source(), "bucket_unflatten_f32")
            .map_err(c)?
            .launch(cfg)
            .arg(&table)
            .arg(&bucket)
            .scalar(lens.len() as i32)
            .scalar(0.25f32)
            .run(&stream)
            .map_err(c)?;
        let mut back: Vec<Vec<f32>> = lens.iter().map(|&n| vec![0.0; n]).collect();
        let mut dst: Vec<twins::BucketDst> = back
            .iter_mut()
            .zip(&offs)
            .map(|(h, &off)| twins::BucketDst {
                offset: off as i64,
                len: h.len() as i64,
                tensor: h,
            })
            .collect();
        twins::bucket_unflatten_f32(&mut dst, &want, lens.len() as i32, 0.25);
        for (k, d) in dev.iter_mut().enumerate() {
            assert_close(
                &format!("unflattened tensor {k}"),
                &d.to_vec(&stream).map_err(c)?,
                &back[k],
                EXACT,
            )?;
        }
        Ok(())
    });
    gpu::finish(r);
}

trait MaxOf {
    fn max_of(self, o: Tol) -> Tol;
}
impl MaxOf for Tol {
    fn max_of(self, o: Tol) -> Tol {
        Tol::new(self.atol.max(o.atol), self.rtol.max(o.rtol))
    }
}
