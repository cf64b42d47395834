//! The trainer's options beyond the defaults, on the CPU engine (harness = false: ranks are forked):
//! gradient accumulation equals one step on the concatenated batch, with the all-reduce only
//! after the last micro-batch; gradient clipping bounds the update and keeps replicas identical;
//! SGD with momentum and weight decay matches PyTorch's update and learns.

#[path = "../../../tests/common/mod.rs"]
mod common;
#[path = "common/train.rs"]
mod train;

use std::path::{Path, PathBuf};

use lockstep::launch::{launch, LaunchConfig, RankContext};
use lockstep_train::data::{self, Dataset};
use lockstep_train::model::Model;
use lockstep_train::ops::{Conv2d, Conv2dParams, Flatten, Layer, Linear, MaxPool2d, Relu};
use lockstep_train::sampler::DistributedSampler;
use lockstep_train::trainer::{
    self, buckets, clip_grad_norm, step_gradients, OptimizerKind, Silent, TrainConfig,
};

fn data_dir() -> PathBuf {
    let real = Path::new(data::DEFAULT_DATA_DIR);
    if real.join("train-images-idx3-ubyte.gz").exists() {
        return real.to_path_buf();
    }
    let d = std::env::temp_dir().join(format!("lockstep-train-options-{}", std::process::id()));
    if !d.join("train-images-idx3-ubyte").exists() {
        std::fs::create_dir_all(&d).expect("temp dir");
        data::write_synthetic(&d, 2000, 500, 4).expect("synthetic data");
    }
    d
}

fn load(n_train: usize, n_test: usize) -> (Dataset, Dataset) {
    train::load_splits(&data_dir(), n_train, n_test)
}

/// A small CNN without BatchNorm: with batch statistics, a micro-batch is normalised on its own
/// and accumulation cannot equal the large batch (in PyTorch neither).
fn no_bn_model(batch: usize) -> Model {
    let layers: Vec<(&str, Box<dyn Layer>)> = vec![
        (
            "conv",
            Box::new(Conv2d::new(Conv2dParams::new(1, 4, 5, 1, 2))),
        ),
        ("relu", Box::new(Relu)),
        ("pool", Box::new(MaxPool2d::new(2, 2))),
        ("flatten", Box::new(Flatten)),
        ("fc", Box::new(Linear::new(4 * 14 * 14, 10))),
    ];
    let mut m = Model::new(
        layers
            .into_iter()
            .map(|(n, l)| (n.to_string(), l))
            .collect(),
        &[batch, 1, 28, 28],
    )
    .expect("model");
    m.init(11);
    m
}

/// First index where `a` and `b` differ by more than `rel` of the largest |a|.
fn far(a: &[f32], b: &[f32], rel: f32) -> Option<(usize, f32, f32)> {
    let scale = a.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    (0..a.len())
        .find(|&i| (a[i] - b[i]).abs() > rel * scale + 1e-7)
        .map(|i| (i, a[i], b[i]))
}

/// N micro-batches of B (and a ragged last one) give the gradient of the one batch of all of
/// them, on one rank and averaged over 3; the all-reduce runs once per step, not per micro-batch.
fn grad_accum_equals_one_large_batch() -> Result<(), String> {
    let (tr, _) = load(72, 1);
    for (sizes, world) in [
        (vec![8usize, 8, 8], 1usize),
        (vec![8, 8, 5], 1),
        (vec![8, 8, 8], 3),
        (vec![6, 6, 4], 3),
    ] {
        let res = launch(&LaunchConfig::new(world), |mut ctx: RankContext| {
            // This rank's samples: the next sum(sizes) ids after the other ranks' blocks.
            let total: usize = sizes.iter().sum();
            let ids: Vec<usize> = (ctx.rank * total..(ctx.rank + 1) * total).collect();
            let mut micro = Vec::new();
            let mut at = 0;
            for &s in &sizes {
                micro.push(&ids[at..at + s]);
                at += s;
            }
            let mut small = no_bn_model(sizes[0]);
            let b = buckets(&small, 4096);
            let mut g_acc = vec![0.0f32; small.num_params()];
            let mut labels = Vec::new();
            let seq0 = ctx.comm.seq();
            let (l_acc, n_acc) = step_gradients(
                &mut small,
                &tr,
                &micro,
                &mut g_acc,
                &mut labels,
                &mut ctx.comm,
                &b,
                false,
            )?;
            let collectives = ctx.comm.seq() - seq0;
            let mut big = no_bn_model(total);
            let mut g_one = vec![0.0f32; big.num_params()];
            let (l_one, n_one) = step_gradients(
                &mut big,
                &tr,
                &[&ids[..]],
                &mut g_one,
                &mut labels,
                &mut ctx.comm,
                &b,
                false,
            )?;
            Ok((
                g_acc,
                g_one,
                l_acc / n_acc as f64,
                l_one / n_one as f64,
                collectives,
                b.len(),
            ))
        })
        .map_err(|e| e.to_string())?;
        for (rank, (g_acc, g_one, l_acc, l_one, collectives, nb)) in res.iter().enumerate() {
            let what = format!("micro-batches {sizes:?} on {world} rank(s), rank {rank}");
            if let Some((i, a, b)) = far(g_one, g_acc, 1e-4) {
                return Err(format!(
                    "{what}: grad[{i}] one batch {a} vs accumulated {b}"
                ));
            }
            if (l_acc - l_one).abs() > 1e-5 * l_one.abs() {
                return Err(format!(
                    "{what}: mean loss accumulated {l_acc} vs one batch {l_one}"
                ));
            }
            let want = if world > 1 { *nb as u64 } else { 0 };
            if *collectives != want {
                return Err(format!("{what}: {collectives} collectives for one accumulated step; want {want} (one all-reduce per bucket, after the last micro-batch)"));
            }
            if g_one.iter().all(|&g| g == 0.0) {
                return Err(format!("{what}: all gradients are zero"));
            }
        }
    }
    Ok(())
}

/// The trainer with --grad-accum: the epoch reports ceil(micro-batches / N) steps, the loss falls
/// and the replicas stay identical.
fn trainer_with_grad_accum() -> Result<(), String> {
    let (tr, te) = load(1200, 300);
    let cfg = TrainConfig {
        epochs: 1,
        batch_size: 16,
        grad_accum: 3,
        ..TrainConfig::default()
    };
    let res = train::train_ranks(2, &cfg, (&tr, &te), |out| {
        let r = &out.reports[0];
        (
            r.steps,
            r.train_loss,
            r.test_acc,
            out.params.iter().map(|&p| p as f64).sum::<f64>(),
        )
    })?;
    // 600 samples per rank in micro-batches of 16: 38 micro-batches, 13 steps.
    if res[0].0 != 13 {
        return Err(format!("{} steps reported; want 13", res[0].0));
    }
    if res[0].3 != res[1].3 || res[0].2 != res[1].2 {
        return Err(format!("replicas differ: {res:?}"));
    }
    if !(res[0].1.is_finite() && res[0].1 < 2.0 && res[0].2 > 30.0) {
        return Err(format!(
            "did not learn: loss {}, accuracy {} %",
            res[0].1, res[0].2
        ));
    }
    Ok(())
}

fn clip_grad_norm_unit() -> Result<(), String> {
    let mut g = [3.0f32, 4.0];
    let n = clip_grad_norm(&mut g, 1.0);
    if (n - 5.0).abs() > 1e-12 || (g[0] - 0.6).abs() > 1e-6 || (g[1] - 0.8).abs() > 1e-6 {
        return Err(format!("norm {n}, clipped {g:?}; want 5 and [0.6, 0.8]"));
    }
    let mut g = [3.0f32, 4.0];
    clip_grad_norm(&mut g, 10.0);
    if g != [3.0, 4.0] {
        return Err(format!(
            "a norm below the threshold must not change the gradients: {g:?}"
        ));
    }
    let mut g = [f32::INFINITY, 1.0];
    if clip_grad_norm(&mut g, 1.0).is_finite() || g[1] != 1.0 {
        return Err(format!(
            "a non-finite norm is reported and changes nothing: {g:?}"
        ));
    }
    Ok(())
}

/// Plain SGD with the norm clipped to `c`: each step moves the parameters by at most `lr * c`,
/// so after `s` steps they are within `s * lr * c` of the start; the replicas stay identical.
fn clipping_bounds_the_update_on_three_ranks() -> Result<(), String> {
    let (tr, te) = load(960, 90);
    let (lr, c) = (0.1f32, 0.01f32);
    let cfg = TrainConfig {
        epochs: 1,
        batch_size: 32,
        lr,
        optimizer: OptimizerKind::Sgd { momentum: 0.0 },
        clip_grad_norm: Some(c),
        seed: 5,
        ..TrainConfig::default()
    };
    let res = train::train_ranks(3, &cfg, (&tr, &te), |out| {
        (out.reports[0].steps, out.params)
    })?;
    let mut init = Model::fashion_cnn(1).map_err(|e| e.to_string())?;
    init.init(5);
    let (steps, p) = &res[0];
    let moved = p
        .iter()
        .zip(&init.params)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    let bound = *steps as f64 * lr as f64 * c as f64;
    if !(moved > 0.0 && moved <= bound * 1.001) {
        return Err(format!("parameters moved {moved} in {steps} steps; clipping to {c} with lr {lr} bounds it by {bound}"));
    }
    if res.iter().any(|r| r.1 != *p) {
        return Err("the replicas differ after clipped steps".into());
    }
    Ok(())
}

/// One SGD step of the trainer (momentum, weight decay) equals PyTorch's update computed by hand
/// from the same gradient: p - lr * (g + wd * p) (the first step seeds the momentum buffer).
fn sgd_step_matches_pytorch() -> Result<(), String> {
    let (tr, te) = load(64, 10);
    let (lr, wd) = (0.05f32, 0.01f32);
    let cfg = TrainConfig {
        epochs: 1,
        batch_size: 64,
        lr,
        optimizer: OptimizerKind::Sgd { momentum: 0.9 },
        weight_decay: wd,
        seed: 9,
        ..TrainConfig::default()
    };
    let res = launch(&LaunchConfig::new(1), |mut ctx: RankContext| {
        let out = trainer::train(&cfg, &tr, &te, &mut ctx.comm, &mut Silent)?;
        // The same step by hand: the epoch's order, the model's gradient, the update.
        let mut s = DistributedSampler::new(tr.len(), 1, 0, true, 9);
        let mut idx = Vec::new();
        s.indices(0, &mut idx);
        let mut m = Model::fashion_cnn(64)?;
        m.init(9);
        let b = buckets(&m, 25 << 20);
        let mut g = vec![0.0f32; m.num_params()];
        let mut labels = Vec::new();
        step_gradients(
            &mut m,
            &tr,
            &[&idx[..]],
            &mut g,
            &mut labels,
            &mut ctx.comm,
            &b,
            false,
        )?;
        let want: Vec<f32> = m
            .params
            .iter()
            .zip(&g)
            .map(|(&p, &g)| p - lr * (g + wd * p))
            .collect();
        Ok((out.reports[0].steps, out.params, want))
    })
    .map_err(|e| e.to_string())?;
    let (steps, got, want) = &res[0];
    if *steps != 1 {
        return Err(format!("{steps} steps; want 1"));
    }
    if let Some((i, a, b)) = far(want, got, 1e-6) {
        return Err(format!("param[{i}]: by hand {a}, trainer {b}"));
    }
    Ok(())
}

/// SGD with momentum learns on 2 ranks, replicas identical.
fn sgd_learns() -> Result<(), String> {
    let (tr, te) = load(2000, 500);
    let cfg = TrainConfig {
        epochs: 1,
        lr: 0.05,
        optimizer: OptimizerKind::Sgd { momentum: 0.9 },
        ..TrainConfig::default()
    };
    let res = train::train_ranks(2, &cfg, (&tr, &te), |out| {
        (
            out.reports[0].test_acc,
            out.params.iter().map(|&p| p as f64).sum::<f64>(),
        )
    })?;
    if res[0] != res[1] {
        return Err(format!("replicas differ: {res:?}"));
    }
    if res[0].0 < 50.0 {
        return Err(format!("SGD reached only {:.2} % test accuracy", res[0].0));
    }
    println!(
        "    sgd, 2 ranks, 2000 images, 1 epoch: test accuracy {:.2} %",
        res[0].0
    );
    Ok(())
}

/// Settings that cannot work are refused before any training, each naming itself.
fn config_refusals() -> Result<(), String> {
    let (tr, te) = load(64, 10);
    let cases: Vec<(TrainConfig, &str)> = vec![
        (
            TrainConfig {
                epochs: 0,
                ..TrainConfig::default()
            },
            "epochs is 0",
        ),
        (
            TrainConfig {
                grad_accum: 0,
                ..TrainConfig::default()
            },
            "gradient accumulation of 0",
        ),
        (
            TrainConfig {
                clip_grad_norm: Some(-1.0),
                ..TrainConfig::default()
            },
            "clipping threshold -1",
        ),
        (
            TrainConfig {
                optimizer: OptimizerKind::Sgd { momentum: 1.5 },
                ..TrainConfig::default()
            },
            "momentum 1.5",
        ),
        (
            TrainConfig {
                optimizer: OptimizerKind::Sgd { momentum: 0.9 },
                save: Some("x.safetensors".into()),
                ..TrainConfig::default()
            },
            "need --optimizer adam",
        ),
    ];
    for (cfg, want) in cases {
        let r = launch(&LaunchConfig::new(1), |mut ctx: RankContext| {
            Ok(trainer::train(&cfg, &tr, &te, &mut ctx.comm, &mut Silent)
                .err()
                .map(|e| e.to_string()))
        })
        .map_err(|e| e.to_string())?;
        match &r[0] {
            Some(m) if m.contains(want) => {}
            other => return Err(format!("want an error containing {want:?}, got {other:?}")),
        }
    }
    Ok(())
}

/// The device engine (run here on its CPU twins) implements neither SGD nor gradient
/// accumulation yet: each is refused with a message naming it, never ignored; weight decay and
/// gradient clipping, which it has, are accepted.
fn device_engine_refuses_what_it_lacks() -> Result<(), String> {
    use lockstep_train::device::{train_device, CpuExec, DeviceOptions};
    let (tr, te) = load(16, 4);
    let base = TrainConfig {
        epochs: 1,
        batch_size: 8,
        ..TrainConfig::default()
    };
    let cases: Vec<(TrainConfig, Option<&str>)> = vec![
        (
            TrainConfig {
                optimizer: OptimizerKind::Sgd { momentum: 0.9 },
                ..base.clone()
            },
            Some("--optimizer sgd is not supported with --device cuda"),
        ),
        (
            TrainConfig {
                grad_accum: 2,
                ..base.clone()
            },
            Some("--grad-accum is not supported with --device cuda"),
        ),
        (
            TrainConfig {
                clip_grad_norm: Some(1.0),
                ..base.clone()
            },
            None,
        ),
        (
            TrainConfig {
                epochs: 0,
                ..base.clone()
            },
            Some("epochs is 0"),
        ),
        (
            TrainConfig {
                weight_decay: 0.01,
                ..base.clone()
            },
            None,
        ),
    ];
    for (cfg, want) in cases {
        let r = train_device(
            &cfg,
            &DeviceOptions::default(),
            &tr,
            &te,
            |len| Ok(CpuExec::new(len)),
            None,
            &mut Silent,
        );
        match (r, want) {
            (Err(e), Some(w)) if e.to_string().contains(w) => {}
            (Ok(out), None)
                if out.reports.len() == 1 && out.params.iter().all(|p| p.is_finite()) => {}
            (r, w) => {
                return Err(format!(
                    "want {w:?}, got {:?}",
                    r.map(|o| o.reports).map_err(|e| e.to_string())
                ))
            }
        }
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    common::run(&[
        ("clip_grad_norm_unit", clip_grad_norm_unit),
        ("config_refusals", config_refusals),
        (
            "grad_accum_equals_one_large_batch",
            grad_accum_equals_one_large_batch,
        ),
        ("trainer_with_grad_accum", trainer_with_grad_accum),
        (
            "clipping_bounds_the_update_on_three_ranks",
            clipping_bounds_the_update_on_three_ranks,
        ),
        ("sgd_step_matches_pytorch", sgd_step_matches_pytorch),
        ("sgd_learns", sgd_learns),
        (
            "device_engine_refuses_what_it_lacks",
            device_engine_refuses_what_it_lacks,
        ),
    ])
}
