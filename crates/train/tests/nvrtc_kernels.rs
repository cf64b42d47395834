//! Every kernel in `kernels/` compiles with NVRTC to PTX for sm_80 and sm_90, and to CUBIN through
//! the disk cache (second compile is a cache hit). Needs only the NVRTC library, no GPU:
//! `.ci/install-nvrtc.sh` installs wheels into `.ci-deps/`, which discovery searches.
//!
//! Every NVRTC installed under `.ci-deps/*` is checked, each in its own process (NVRTC is loaded
//! once per process): first the one discovery chooses, which must be the newest of them, then
//! every other one through `LOCKSTEP_NVRTC_LIBRARY`. CI installs 12.9 and 13.0.88; the latter's
//! `libnvrtc.so.13` has no `$ORIGIN` run path, so it compiles only because lockstep preloads its
//! `libnvrtc-builtins.so.13.0`. With `LOCKSTEP_NVRTC_LIBRARY` set by the caller (or on a machine
//! without `.ci-deps`, such as a GPU box running `benches/gpu_verify.sh`), only that NVRTC, or
//! the one discovery finds, is checked.
//!
//! Without NVRTC: one skipped test (`skipped: no NVRTC library`), unless `LOCKSTEP_REQUIRE_NVRTC=1`.
//! A failed check panics (the runner's summary line is printed only when every check passed).

#[path = "../../../tests/common/runner.rs"]
mod runner;

use std::path::{Path, PathBuf};

use lockstep::cuda::{compile_cubin_cached, compile_ptx, KernelSource, NvrtcInfo};
use lockstep_train::device::kernels::KernelId;

/// Set in the child processes that check one NVRTC each.
const CHILD: &str = "LOCKSTEP_NVRTC_KERNELS_CHILD";
/// Set (to `major.minor`) in the child that only checks which NVRTC discovery picks.
const EXPECT: &str = "LOCKSTEP_NVRTC_KERNELS_EXPECT";

/// Every `libnvrtc.so.*` under `.ci-deps/*/nvidia/*/lib` (crate root and working directory).
fn installed_wheels() -> Vec<PathBuf> {
    let mut out = Vec::new();
    for base in [
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.ci-deps"),
        PathBuf::from(".ci-deps"),
    ] {
        let Ok(deps) = std::fs::read_dir(&base) else {
            continue;
        };
        for dep in deps.flatten() {
            let Ok(pkgs) = std::fs::read_dir(dep.path().join("nvidia")) else {
                continue;
            };
            for pkg in pkgs.flatten() {
                let Ok(files) = std::fs::read_dir(pkg.path().join("lib")) else {
                    continue;
                };
                for f in files.flatten() {
                    if f.file_name().to_string_lossy().starts_with("libnvrtc.so.") {
                        let p = std::fs::canonicalize(f.path()).unwrap_or(f.path());
                        if !out.contains(&p) {
                            out.push(p);
                        }
                    }
                }
            }
        }
    }
    out.sort();
    out
}

/// The `major.minor` of an NVRTC wheel from its folder's sibling builtins (`libnvrtc-builtins.so.13.0`).
fn wheel_version(lib: &Path) -> Option<(i32, i32)> {
    let dir = lib.parent()?;
    std::fs::read_dir(dir).ok()?.flatten().find_map(|f| {
        let n = f.file_name().to_string_lossy().into_owned();
        let v = n.strip_prefix("libnvrtc-builtins.so.")?;
        let (a, b) = v.split_once('.')?;
        Some((a.parse().ok()?, b.split('.').next()?.parse().ok()?))
    })
}

/// Compile every kernel with the NVRTC this process loads; returns the number of checks.
fn check_this_nvrtc(info: &NvrtcInfo) -> usize {
    println!(
        "NVRTC {}.{} from {}",
        info.version.0, info.version.1, info.path
    );
    println!("  chosen: {}", info.reason);
    println!("  builtins: {}", info.builtins);
    // A compile error carries NVRTC's log (file, line, message) and the options used.
    const BROKEN: KernelSource = KernelSource {
        name: "broken.cu",
        source: "extern \"C\" __global__ void broken(float* x) {\n  x[0] = undefined_name;\n}\n",
        headers: &[],
        functions: &[],
    };
    let e = compile_ptx(&BROKEN, "compute_80")
        .expect_err("a broken kernel must not compile")
        .to_string();
    assert!(
        e.contains("broken.cu") && e.contains("undefined_name") && e.contains("(2)"),
        "{e}"
    );
    assert!(e.contains("--gpu-architecture=compute_80"), "{e}");
    println!("test compile_error_reports_the_nvrtc_log ... ok");
    let mut n = 1;
    for id in KernelId::ALL {
        for arch in ["compute_80", "compute_90"] {
            let ptx =
                compile_ptx(id.source(), arch).unwrap_or_else(|e| panic!("{id} for {arch}:\n{e}"));
            let target = format!(".target sm_{}", &arch[8..]);
            assert!(
                ptx.contains(&target),
                "{id} for {arch}: PTX lacks {target:?}"
            );
            for sig in id.functions() {
                assert!(
                    ptx.contains(&format!(".entry {}(", sig.name)),
                    "{id} for {arch}: PTX has no entry {}",
                    sig.name
                );
            }
            println!("test ptx {id} {arch} ... ok ({} bytes)", ptx.len());
            n += 1;
        }
    }
    // CUBIN through the disk cache, in a private cache folder: miss, then hit.
    let dir = std::env::temp_dir().join(format!("lockstep-nvrtc-cache-{}", std::process::id()));
    std::env::set_var("XDG_CACHE_HOME", &dir);
    for id in KernelId::ALL {
        let (a, hit_a) = compile_cubin_cached(id.source(), (8, 0), 12040)
            .unwrap_or_else(|e| panic!("{id} cubin sm_80:\n{e}"));
        let (b, hit_b) = compile_cubin_cached(id.source(), (8, 0), 12040).unwrap();
        assert!(
            !hit_a && hit_b,
            "{id}: expected a cache miss then a hit, got {hit_a} then {hit_b}"
        );
        assert_eq!(a, b);
        assert_eq!(&a[..4], b"\x7fELF", "{id}: CUBIN is not an ELF image");
        let (_, hit_c) = compile_cubin_cached(id.source(), (9, 0), 12040).unwrap();
        assert!(!hit_c, "{id}: another arch must not hit the sm_80 entry");
        println!("test cubin-cache {id} ... ok");
        n += 1;
    }
    let _ = std::fs::remove_dir_all(&dir);
    n
}

fn main() {
    let info = match NvrtcInfo::load() {
        Ok(i) => i,
        Err(e) => runner::skip_all(
            "LOCKSTEP_REQUIRE_NVRTC",
            env!("CARGO_CRATE_NAME"),
            "no NVRTC library (run .ci/install-nvrtc.sh or set LOCKSTEP_NVRTC_LIBRARY)",
            &e.to_string(),
        ),
    };
    if let Ok(want) = std::env::var(EXPECT) {
        let got = format!("{}.{}", info.version.0, info.version.1);
        assert_eq!(got, want, "discovery chose {} ({})", info.path, info.reason);
        assert!(
            info.reason.contains("newest usable") && info.reason.contains("also found"),
            "{}",
            info.reason
        );
        println!("  chose NVRTC {got} ({})", info.reason);
        return;
    }
    let mut n = check_this_nvrtc(&info);
    if std::env::var_os(CHILD).is_some() {
        // The parent's summary counts this run as one check.
        println!("  {n} checks passed with this NVRTC");
        return;
    }
    if std::env::var_os("LOCKSTEP_NVRTC_LIBRARY").is_some() {
        println!("\n{n} passed, 0 skipped, 0 failed");
        return;
    }
    let wheels = installed_wheels();
    let chosen = std::fs::canonicalize(&info.path).unwrap_or_else(|_| PathBuf::from(&info.path));
    if wheels.len() >= 2 {
        // Discovery prefers the newest NVRTC (all of these are usable): never an older wheel
        // that happens to come first in the search.
        let newest = wheels.iter().filter_map(|w| wheel_version(w)).max();
        assert_eq!(
            Some(info.version),
            newest,
            "discovery chose NVRTC {:?} ({}) over a newer wheel in {wheels:?}",
            info.version,
            info.path
        );
        println!("test discovery_prefers_the_newest_nvrtc ... ok");
        n += 1;
    }
    if wheels.len() >= 2 {
        // The same wheels in one folder, named so that the oldest comes first in the search
        // order (descending names): discovery must still take the newest.
        let mut by_age: Vec<(Option<(i32, i32)>, &PathBuf)> =
            wheels.iter().map(|w| (wheel_version(w), w)).collect();
        by_age.sort();
        let dir = std::env::temp_dir().join(format!("lockstep-nvrtc-order-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for (i, (_, w)) in by_age.iter().enumerate() {
            std::os::unix::fs::symlink(w, dir.join(format!("libnvrtc.so.order{}", 9 - i))).unwrap();
        }
        let newest = by_age.last().and_then(|(v, _)| *v).expect("wheel versions");
        let st = std::process::Command::new(std::env::current_exe().expect("this test binary"))
            .env(CHILD, "1")
            .env(EXPECT, format!("{}.{}", newest.0, newest.1))
            .env("LOCKSTEP_NVRTC_LIBRARY", &dir)
            .status()
            .expect("run this test binary");
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            st.success(),
            "discovery did not prefer the newest NVRTC when an older one came first ({st})"
        );
        println!("test newest_nvrtc_wins_over_the_first_found ... ok");
        n += 1;
    }
    for w in wheels.iter().filter(|w| **w != chosen) {
        println!("\n--- NVRTC {} (LOCKSTEP_NVRTC_LIBRARY) ---", w.display());
        let st = std::process::Command::new(std::env::current_exe().expect("this test binary"))
            .env(CHILD, "1")
            .env("LOCKSTEP_NVRTC_LIBRARY", w)
            .status()
            .expect("run this test binary for another NVRTC");
        assert!(
            st.success(),
            "kernels do not compile with {} ({st})",
            w.display()
        );
        n += 1;
    }
    println!("\n{n} passed, 0 skipped, 0 failed");
}
