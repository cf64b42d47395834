//! In-process tests of the training engine (no forking): IDX validation, checkpoints, resume,
//! determinism. Runs single-rank through a one-rank shared-memory communicator.

#[path = "../../../tests/common/mod.rs"]
mod common;
#[path = "common/train.rs"]
mod train;

use std::path::{Path, PathBuf};

use lockstep::shm::ShmJob;
use lockstep_train::checkpoint;
use lockstep_train::data::{self, DataError, Dataset};
use lockstep_train::model::Model;
use lockstep_train::ops::optim::Adam;
use lockstep_train::trainer::{self, Silent, TrainConfig};

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("lockstep-train-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// Small train/test sets: the real dataset when installed, else synthetic IDX files.
fn small_data(n_train: usize, n_test: usize) -> (Dataset, Dataset) {
    let real = Path::new(data::DEFAULT_DATA_DIR);
    let dir = if real.join("train-images-idx3-ubyte.gz").exists() {
        real.to_path_buf()
    } else {
        let d = tmpdir("synth");
        data::write_synthetic(&d, n_train, n_test, 1).expect("write synthetic data");
        d
    };
    train::load_splits(&dir, n_train, n_test)
}

fn msg(e: DataError) -> String {
    e.to_string()
}

#[test]
fn idx_reader_rejects_corrupt_files_with_named_errors() {
    let d = common::scratch("train-idx");
    let imgs = data::encode_idx(&[3, 28, 28], &vec![7u8; 3 * 784]);
    let labels = data::encode_idx(&[3], &[1, 2, 3]);
    let write = |name: &str, bytes: &[u8]| {
        let p = d.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    };
    // Valid pair loads, raw and gzipped.
    let (ip, lp) = (write("ok-images", &imgs), write("ok-labels", &labels));
    let ds = data::load_pair(&ip, &lp).expect("valid files load");
    assert_eq!((ds.len(), ds.rows, ds.cols), (3, 28, 28));
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut gz, &imgs).unwrap();
    let gzp = write("gz-images", &gz.finish().unwrap());
    assert_eq!(data::load_pair(&gzp, &lp).unwrap().images, ds.images);

    // Wrong magic (labels file given as images).
    let e = msg(data::load_pair(&lp, &lp).unwrap_err());
    assert!(e.contains("ok-labels") && e.contains("magic"), "{e}");
    // Truncated data.
    let t = write("trunc-images", &imgs[..imgs.len() - 100]);
    let e = msg(data::load_pair(&t, &lp).unwrap_err());
    assert!(e.contains("trunc-images") && e.contains("truncated"), "{e}");
    // Truncated header.
    let t = write("short-images", &imgs[..6]);
    let e = msg(data::load_pair(&t, &lp).unwrap_err());
    assert!(e.contains("short-images") && e.contains("truncated"), "{e}");
    // Count mismatch.
    let l2 = write("two-labels", &data::encode_idx(&[2], &[1, 2]));
    let e = msg(data::load_pair(&ip, &l2).unwrap_err());
    assert!(
        e.contains("ok-images")
            && e.contains("two-labels")
            && e.contains("3 images")
            && e.contains("2 labels"),
        "{e}"
    );
    // Label out of range.
    let bad = write("bad-labels", &data::encode_idx(&[3], &[1, 12, 3]));
    let e = msg(data::load_pair(&ip, &bad).unwrap_err());
    assert!(e.contains("bad-labels") && e.contains("12"), "{e}");
    // Corrupt gzip.
    let g = write("broken.gz-images", &[0x1f, 0x8b, 8, 0, 1, 2, 3]);
    let e = msg(data::load_pair(&g, &lp).unwrap_err());
    assert!(e.contains("broken.gz-images"), "{e}");
    // Missing directory: install hint.
    let e = msg(data::load_split(&d.join("nope"), true).unwrap_err());
    assert!(
        e.contains("apt-get install dataset-fashion-mnist") && e.contains("--data"),
        "{e}"
    );
}

fn run(cfg: &TrainConfig, tr: &Dataset, te: &Dataset) -> trainer::TrainOutcome {
    let job = ShmJob::new(1).expect("one-rank job");
    let mut comm = job.communicator(0).expect("one-rank communicator");
    trainer::train(cfg, tr, te, &mut comm, &mut Silent).expect("training runs")
}

#[test]
fn checkpoint_round_trip_and_resume_equality() {
    let (tr, te) = small_data(640, 300);
    let d = common::scratch("train-ckpt");
    let ck = d.join("model.safetensors");
    let base = TrainConfig {
        epochs: 2,
        batch_size: 64,
        ..TrainConfig::default()
    };

    let straight = run(&base, &tr, &te);
    let again = run(&base, &tr, &te);
    assert_eq!(
        straight.reports[1].train_loss, again.reports[1].train_loss,
        "same seed, same losses"
    );
    assert_eq!(straight.params, again.params, "same seed, same parameters");

    let (save_cfg, resume_cfg) = train::save_then_resume(&base, &ck);
    let first = run(&save_cfg, &tr, &te);
    assert!(ck.exists() && checkpoint::optim_path(&ck).exists());
    assert_eq!(first.reports.len(), 1);

    // Round trip: loading the file reproduces the parameters and BN state exactly.
    let mut m = Model::fashion_cnn(1).unwrap();
    checkpoint::load_model(&ck, &mut m).expect("load model");
    assert_eq!(m.params, first.params);
    let mut opt = Adam::new(m.num_params(), 0.005);
    let st = checkpoint::load(&ck, &mut m, &mut opt).expect("load with optimizer");
    assert_eq!((st.epoch, st.step, st.seed, st.world_size), (1, 10, 42, 1));
    assert!(opt.m.iter().any(|&x| x != 0.0) && opt.v.iter().any(|&x| x != 0.0));

    // The file uses PyTorch names and dtypes.
    let bytes = std::fs::read(&ck).unwrap();
    let stf = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names = stf.names();
    names.sort();
    for n in [
        "module1.0.weight",
        "module1.1.running_var",
        "module2.1.num_batches_tracked",
        "linear1.weight",
        "linear2.bias",
    ] {
        assert!(names.contains(&n), "missing {n} in {names:?}");
    }
    let nbt = stf.tensor("module1.1.num_batches_tracked").unwrap();
    assert_eq!(nbt.dtype(), safetensors::Dtype::I64);
    assert_eq!(i64::from_le_bytes(nbt.data().try_into().unwrap()), 10);
    assert_eq!(stf.tensor("linear1.weight").unwrap().shape(), &[64, 3136]);

    // Resume continues exactly where the first run stopped.
    let resumed = run(&resume_cfg, &tr, &te);
    assert_eq!(resumed.reports.len(), 1);
    assert_eq!(resumed.reports[0].epoch, 2);
    assert_eq!(
        resumed.reports[0].train_loss,
        straight.reports[1].train_loss
    );
    assert_eq!(resumed.reports[0].test_acc, straight.reports[1].test_acc);
    assert_eq!(
        resumed.params, straight.params,
        "resumed run must match the straight run bit for bit"
    );
}

#[test]
fn corrupt_checkpoint_is_a_clear_error() {
    let d = common::scratch("train-badck");
    let p = d.join("m.safetensors");
    std::fs::write(&p, b"not a checkpoint").unwrap();
    let mut m = Model::fashion_cnn(1).unwrap();
    let e = checkpoint::load_model(&p, &mut m).unwrap_err().to_string();
    assert!(
        e.contains("m.safetensors") && e.contains("not a valid safetensors"),
        "{e}"
    );
}
