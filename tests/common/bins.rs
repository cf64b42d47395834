//! The `lockstep` binary for tests outside its package (crates/cli), where cargo provides no
//! `CARGO_BIN_EXE_lockstep`: `target/<profile>/lockstep`, beside the `deps/` directory the test
//! binary runs from. `cargo test` at the repository root builds it (crates/cli is a default member
//! of the workspace); a test run alone with `-p lockstep-comm` needs it built first.

use std::path::Path;
use std::sync::OnceLock;

/// Path of the `lockstep` binary of this build; panics with what to do when it is missing.
pub fn lockstep_bin() -> &'static str {
    static BIN: OnceLock<String> = OnceLock::new();
    BIN.get_or_init(|| {
        let exe = std::env::current_exe().expect("current_exe");
        let bin = exe.parent().and_then(Path::parent).expect("the test binary runs from target/<profile>/deps").join("lockstep");
        assert!(
            bin.is_file(),
            "the lockstep binary {} is missing: run `cargo test --release` at the repository root, or build it first (`cargo build --release -p lockstep-cli`)",
            bin.display()
        );
        bin.to_string_lossy().into_owned()
    })
}
