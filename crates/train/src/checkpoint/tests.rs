//! Unit tests of the checkpoint: save and resume round trips, torn pairs, stale temporaries,
//! failed saves, links under checkpoint names, and save paths that cannot work.

use std::path::{Path, PathBuf};

use nix::sys::stat::Mode;
use safetensors::SafeTensors;

use super::super::model::Model;
use super::commit::pid_alive;
use super::format::{file_meta, serialize, Raw, SCALER_KEYS};
use super::*;
use crate::ops::optim::Adam;

/// A fresh scratch directory for one test, removed when dropped (also when the test fails).
struct TmpDir(PathBuf);

impl TmpDir {
    fn new(name: &str) -> TmpDir {
        let d =
            std::env::temp_dir().join(format!("lockstep-ckpt-unit-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        TmpDir(d)
    }
}

impl std::ops::Deref for TmpDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TmpDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A checkpoint `m.safetensors` in a fresh [`TmpDir`] saved at epochs 1 and 2: the live pair
/// holds 2, the previous pair 1.
fn saved_twice(name: &str) -> (TmpDir, PathBuf) {
    let d = TmpDir::new(name);
    let p = d.join("m.safetensors");
    save_epoch(&p, 1).unwrap();
    save_epoch(&p, 2).unwrap();
    (d, p)
}

fn model_and_opt() -> (Model, Adam) {
    let mut m = Model::fashion_cnn(1).unwrap();
    m.init(7);
    let n = m.num_params();
    (m, Adam::new(n, 0.01))
}

/// Save a state recognisable by `epoch` (in the metadata, a parameter and a moment).
fn save_epoch(path: &Path, epoch: u64) -> Result<(), CheckpointError> {
    let (mut m, mut opt) = model_and_opt();
    m.params[0] = epoch as f32;
    opt.m[0] = epoch as f32;
    save(
        path,
        &mut m,
        &opt,
        &TrainState {
            epoch,
            step: epoch * 10,
            seed: 1,
            world_size: 1,
            loss_scaler: None,
        },
    )
}

/// (source, epoch from the metadata, epoch from the parameter, epoch from the moment).
fn resumed(path: &Path) -> Result<(Source, u64, f32, f32, Vec<String>), CheckpointError> {
    let (mut m, mut opt) = model_and_opt();
    let r = resume(path, &mut m, &mut opt)?;
    Ok((
        r.source,
        r.state.epoch,
        m.params[0],
        opt.m[0],
        r.passed_over,
    ))
}

fn names(d: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

const FOUR: [&str; 4] = [
    "m.optim.safetensors",
    "m.prev.optim.safetensors",
    "m.prev.safetensors",
    "m.safetensors",
];

/// The loss scaler's state goes through a save and a resume bit for bit; a file without it
/// (fp32 runs, older files) resumes with none; a file with only some of its keys is passed
/// over like any damaged file.
#[test]
fn loss_scaler_state_round_trips_and_older_files_load_without_it() {
    let d = TmpDir::new("scaler");
    let p = d.join("m.safetensors");
    let sc = ScalerState {
        scale: 2f32.powi(-3) * 3.0,
        growth_factor: 1.7,
        backoff_factor: 0.3,
        growth_interval: 7,
        good_steps: 5,
        skipped: 11,
    };
    let (mut m, opt) = model_and_opt();
    let st = TrainState {
        epoch: 1,
        step: 9,
        seed: 1,
        world_size: 2,
        loss_scaler: Some(sc),
    };
    save(&p, &mut m, &opt, &st).unwrap();
    let (mut m2, mut opt2) = model_and_opt();
    let r = resume(&p, &mut m2, &mut opt2).unwrap();
    assert_eq!(r.state, st);
    let got = r.state.loss_scaler.unwrap();
    assert_eq!(
        (got.scale.to_bits(), got.growth_factor.to_bits()),
        (sc.scale.to_bits(), sc.growth_factor.to_bits())
    );

    // An older file: the same metadata without the scaler keys.
    save_epoch(&p, 2).unwrap();
    let r = resume(&p, &mut m2, &mut opt2).unwrap();
    assert_eq!((r.state.epoch, r.state.loss_scaler), (2, None));

    // One scaler key lost: this pair is refused (naming the key) and the previous one used.
    let opath = optim_path(&p);
    let bytes = std::fs::read(&opath).unwrap();
    let mut meta = file_meta(&opath, &bytes).unwrap();
    let st3 = TrainState {
        epoch: 3,
        step: 30,
        seed: 1,
        world_size: 1,
        loss_scaler: Some(sc),
    };
    save(&p, &mut m, &opt, &st3).unwrap();
    let bytes = std::fs::read(&opath).unwrap();
    let full = file_meta(&opath, &bytes).unwrap();
    for k in SCALER_KEYS.iter().take(5) {
        meta.insert(k.to_string(), full[*k].clone());
    }
    meta.insert("save_id".into(), full["save_id"].clone());
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let raws: Vec<(String, Raw)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| {
            (
                n,
                Raw {
                    dtype: t.dtype(),
                    shape: t.shape().to_vec(),
                    bytes: t.data().to_vec(),
                },
            )
        })
        .collect();
    std::fs::remove_file(&opath).unwrap();
    std::fs::write(&opath, serialize(&opath, &raws, meta).unwrap()).unwrap();
    let r = resume(&p, &mut m2, &mut opt2).unwrap();
    assert_eq!((r.source, r.state.epoch), (Source::Previous, 2));
    assert!(
        r.passed_over
            .iter()
            .any(|w| w.contains("metadata loss_scale_skipped")),
        "{:?}",
        r.passed_over
    );
}

#[test]
fn latest_then_previous_then_a_clear_error() {
    let (d, p) = saved_twice("order");
    assert_eq!(
        names(&d),
        FOUR,
        "the live and the previous pair, nothing else"
    );
    let (src, epoch, w, m, passed) = resumed(&p).unwrap();
    assert_eq!((src, epoch, w, m), (Source::Latest, 2, 2.0, 2.0));
    assert!(passed.is_empty(), "{passed:?}");

    // A damaged live model file: the previous pair is complete and used, and said so.
    std::fs::write(&p, b"torn").unwrap();
    let (src, epoch, w, m, passed) = resumed(&p).unwrap();
    assert_eq!((src, epoch, w, m), (Source::Previous, 1, 1.0, 1.0));
    assert!(
        passed
            .iter()
            .any(|r| r.contains("m.safetensors") && r.contains("not a valid safetensors")),
        "{passed:?}"
    );

    std::fs::remove_file(d.join("m.prev.safetensors")).unwrap();
    let e = resumed(&p).unwrap_err().to_string();
    assert!(
        e.contains("no complete checkpoint") && e.contains("m.prev.safetensors does not exist"),
        "{e}"
    );
}

#[test]
fn torn_pair_resumes_the_committed_state_and_the_next_save_keeps_it() {
    let (d, p) = saved_twice("torn");
    // The files of a third save killed right after its optimizer rename: the kept pair is
    // the live one (2), and the live optimizer file is already 3's.
    let other = d.join("other");
    std::fs::create_dir(&other).unwrap();
    save_epoch(&other.join("m.safetensors"), 3).unwrap();
    // Kept as a save keeps them: hard links.
    for (live, prev) in [
        ("m.safetensors", "m.prev.safetensors"),
        ("m.optim.safetensors", "m.prev.optim.safetensors"),
    ] {
        std::fs::remove_file(d.join(prev)).unwrap();
        std::fs::hard_link(d.join(live), d.join(prev)).unwrap();
    }
    // A new file, as the rename makes it (copying onto the name would write into the link).
    std::fs::remove_file(d.join("m.optim.safetensors")).unwrap();
    std::fs::copy(
        other.join("m.optim.safetensors"),
        d.join("m.optim.safetensors"),
    )
    .unwrap();
    std::fs::remove_dir_all(&other).unwrap();

    let (src, epoch, w, m, passed) = resumed(&p).unwrap();
    assert_eq!(
        (src, epoch, w, m),
        (Source::Latest, 2, 2.0, 2.0),
        "the committed save, with its kept optimizer file"
    );
    assert!(
        passed.iter().any(|r| r.contains("different saves")),
        "{passed:?}"
    );

    // The next save must keep (model 2, optimizer 2) as the previous pair, not the torn 3.
    save_epoch(&p, 4).unwrap();
    assert_eq!(
        names(&d),
        FOUR,
        "no temporary left (the kept model file was a link of the live one)"
    );
    assert_eq!(resumed(&p).unwrap().1, 4);
    std::fs::write(&p, b"torn").unwrap();
    let (src, epoch, w, m, _) = resumed(&p).unwrap();
    assert_eq!((src, epoch, w, m), (Source::Previous, 2, 2.0, 2.0));
}

#[test]
fn stale_temporaries_go_running_saves_and_other_files_stay() {
    let d = TmpDir::new("stale");
    let p = d.join("m.safetensors");
    let dead = (100_000..4_000_000)
        .rev()
        .find(|&pid| !pid_alive(pid))
        .expect("a free pid");
    let stale = [
        format!(".m.safetensors.tmp-{dead}-00ff00ff00ff00ff"),
        format!(".m.prev.optim.safetensors.tmp-{dead}-1"),
    ];
    // Pid 1 runs: a save there may be in progress. The last one is not ours.
    let keep = [
        ".m.optim.safetensors.tmp-1-abcdef".to_string(),
        format!(".x.safetensors.tmp-{dead}-1"),
        "notes.txt".into(),
    ];
    for n in stale.iter().chain(&keep) {
        std::fs::write(d.join(n), b"x").unwrap();
    }
    save_epoch(&p, 1).unwrap();
    let left = names(&d);
    for n in &stale {
        assert!(!left.contains(n), "{n} must be removed: {left:?}");
    }
    for n in &keep {
        assert!(left.contains(n), "{n} must stay: {left:?}");
    }
}

#[test]
fn failed_save_removes_its_temporaries_and_keeps_the_last_state() {
    let d = TmpDir::new("failed");
    let p = d.join("m.safetensors");
    save_epoch(&p, 1).unwrap();
    // A non-empty directory under the previous-model name: keeping the pair fails midway.
    std::fs::create_dir(d.join("m.prev.safetensors")).unwrap();
    std::fs::write(d.join("m.prev.safetensors").join("f"), b"x").unwrap();
    assert!(save_epoch(&p, 2).is_err());
    let left = names(&d);
    assert!(
        !left.iter().any(|n| n.contains(".tmp-")),
        "temporaries left: {left:?}"
    );
    assert_eq!(resumed(&p).unwrap().1, 1);
}

#[test]
fn links_under_checkpoint_names_are_replaced_never_followed() {
    let d = TmpDir::new("links");
    let victims = d.join("victims");
    let ck = d.join("ck");
    std::fs::create_dir_all(&victims).unwrap();
    std::fs::create_dir_all(&ck).unwrap();
    for n in FOUR {
        std::fs::write(victims.join(n), b"precious").unwrap();
        std::os::unix::fs::symlink(victims.join(n), ck.join(n)).unwrap();
    }
    let p = ck.join("m.safetensors");
    check_target(&p, 1).unwrap();
    save_epoch(&p, 1).unwrap();
    save_epoch(&p, 2).unwrap();
    for n in FOUR {
        assert_eq!(
            std::fs::read(victims.join(n)).unwrap(),
            b"precious",
            "{n} was written through"
        );
        assert!(
            std::fs::symlink_metadata(ck.join(n))
                .unwrap()
                .file_type()
                .is_file(),
            "{n} is a file now"
        );
    }
    assert_eq!(names(&ck), FOUR);
    assert_eq!(resumed(&p).unwrap().1, 2);
}

#[test]
fn check_target_refuses_paths_that_cannot_work() {
    let d = TmpDir::new("target");
    let msg = |p: &Path, need| check_target(p, need).unwrap_err().to_string();
    let e = msg(&d, 1);
    assert!(
        e.contains(&d.display().to_string()) && e.contains("is a directory"),
        "{e}"
    );
    let e = msg(&d.join("no/such/m.safetensors"), 1);
    assert!(e.contains("does not exist; create it first"), "{e}");
    nix::unistd::mkfifo(
        &d.join("m.optim.safetensors"),
        Mode::from_bits_truncate(0o600),
    )
    .unwrap();
    let e = msg(&d.join("m.safetensors"), 1);
    assert!(
        e.contains("m.optim.safetensors is not a regular file"),
        "{e}"
    );
    std::fs::remove_file(d.join("m.optim.safetensors")).unwrap();
    let e = msg(&d.join("m.safetensors"), u64::MAX);
    assert!(e.contains("MiB available"), "{e}");
    check_target(&d.join("m.safetensors"), estimate_bytes(1000)).unwrap();
    assert!(
        names(&d).is_empty(),
        "the probe file is removed: {:?}",
        names(&d)
    );
}
