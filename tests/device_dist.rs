//! The device engine's data-parallel path without a GPU: `train_device` on 2 forked ranks with
//! the CPU-twin executor and the shared-memory communicator. Exercises the gradient average, the
//! BatchNorm-state broadcast and the metric sums exactly as a GPU run sequences them (the GPU
//! executor routes the same calls to NCCL or the staged backend). Replicas must stay identical.
//! `harness = false`: the launcher forks, which must not happen from a multi-threaded harness.

mod common;

use lockstep::launch::{launch, LaunchConfig, RankContext};
use lockstep::train::data;
use lockstep::train::device::{train_device, CpuExec, DeviceOptions};
use lockstep::train::trainer::{Silent, TrainConfig};

fn two_ranks_stay_identical() -> Result<(), String> {
    let dir = common::scratch("device-dist");
    data::write_synthetic(&dir, 30, 11, 3).map_err(|e| e.to_string())?;
    let train = data::load_split(&dir, true).map_err(|e| e.to_string())?;
    let test = data::load_split(&dir, false).map_err(|e| e.to_string())?;
    let _ = std::fs::remove_dir_all(&dir);
    // 30 images over 2 ranks, batch 4: 15 per rank = 3 full steps and one of 3.
    let cfg = TrainConfig { epochs: 1, batch_size: 4, ..Default::default() };
    let out = launch(&LaunchConfig::new(2), |mut ctx: RankContext| {
        let opts = DeviceOptions { loss_every: 2, ..Default::default() };
        let out = train_device(&cfg, &opts, &train, &test, |len| Ok(CpuExec::new(len)), Some(&mut ctx.comm), &mut Silent)?;
        let r = &out.reports[0];
        let checksum: f64 = out.params.iter().enumerate().map(|(i, &p)| p as f64 * (1.0 + (i % 7) as f64)).sum();
        Ok((checksum, r.test_count, r.train_loss, r.steps as u64))
    })
    .map_err(|e| e.to_string())?;
    let (a, b) = (out[0], out[1]);
    common::check(a.0 == b.0, "parameters identical on both ranks", format!("checksums {} vs {}", a.0, b.0))?;
    common::check(a.1 == 11 && b.1 == 11, "each test image counted once over the ranks", format!("{a:?} {b:?}"))?;
    common::check(a.2 == b.2 && a.2.is_finite(), "the same mean training loss on both ranks", format!("{} vs {}", a.2, b.2))?;
    common::check(a.3 == 4, "4 steps per rank (15 images, batch 4)", format!("{a:?}"))
}

fn main() -> std::process::ExitCode {
    common::run(&[("two_ranks_stay_identical", two_ranks_stay_identical)])
}
