//! The C library `liblockstep.so` (crates/capi) for tests that run C programs against it, in
//! any package of the workspace: [`liblockstep`] builds it and [`compile_c`] compiles a program
//! against it and `crates/capi/include/lockstep.h`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use super::{check, show};

/// `liblockstep.so` as the source tree under `root` (the repository) builds it now. cargo builds
/// a cdylib-only crate's library for integration tests only when it sees fit, so a test that
/// trusted whatever sits in the target directory could check a stale library: the library is
/// built here (`cargo build -p lockstep-capi`, a no-op when it is current, in this test's
/// profile and target directory) and its path read from cargo's own report.
pub fn liblockstep(root: &Path) -> Result<PathBuf, String> {
    static SO: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    SO.get_or_init(|| {
        let mut c = Command::new(env!("CARGO"));
        c.args([
            "build",
            "-p",
            "lockstep-capi",
            "--message-format=json-render-diagnostics",
        ])
        .current_dir(root);
        if !cfg!(debug_assertions) {
            c.arg("--release");
        }
        let o = c
            .output()
            .map_err(|e| format!("could not run cargo: {e}"))?;
        if !o.status.success() {
            return Err(format!(
                "cargo build -p lockstep-capi failed:\n{}",
                show(&o)
            ));
        }
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["reason"] == "compiler-artifact" && v["target"]["kind"][0] == "cdylib")
            .find_map(|v| v["filenames"][0].as_str().map(PathBuf::from))
            .ok_or_else(|| format!("cargo reported no cdylib for lockstep-capi:\n{}", show(&o)))
    })
    .clone()
}

/// Compile the C file `src` (relative to `root`, the repository) against
/// `crates/capi/include/lockstep.h` and [`liblockstep`] into `out`, warnings as errors.
pub fn compile_c(root: &Path, src: &Path, out: &Path) -> Result<(), String> {
    let so = liblockstep(root)?;
    let lib_dir = so.parent().ok_or("liblockstep.so has no directory")?;
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let o: Output = Command::new(&cc)
        .current_dir(root)
        .args([
            "-std=c11",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-pedantic",
            "-I",
            "crates/capi/include",
        ])
        .arg(src)
        .arg("-o")
        .arg(out)
        .arg("-L")
        .arg(lib_dir)
        .arg("-llockstep")
        // DT_RPATH (not RUNPATH) is searched before LD_LIBRARY_PATH, which cargo points at
        // target/release too: the program loads this build's library, not a stale copy.
        .arg(format!(
            "-Wl,--disable-new-dtags,-rpath,{}",
            lib_dir.display()
        ))
        .output()
        .map_err(|e| {
            format!("could not run the C compiler {cc:?} (install gcc, or set CC): {e}")
        })?;
    check(
        o.status.success(),
        &format!(
            "{} must compile cleanly (-Wall -Wextra -Werror -pedantic) against include/lockstep.h",
            src.display()
        ),
        show(&o),
    )
}
