//! Build script of the C ABI: generates the C header from `src/lib.rs` with cbindgen (see
//! [`c_header`]) and gives the shared library its soname and export rule (see [`c_library`]).

use std::path::{Path, PathBuf};

/// The package version (Cargo.toml) as the C library states it: `(major, minor, patch, pre-release)`.
fn c_version() -> (u32, u32, u32, String) {
    let num = |k: &str| {
        let v = std::env::var(k).unwrap_or_else(|e| panic!("{k}: {e}"));
        v.parse::<u32>()
            .unwrap_or_else(|e| panic!("{k}={v:?}: {e}"))
    };
    let pre = std::env::var("CARGO_PKG_VERSION_PRE").unwrap_or_default();
    (
        num("CARGO_PKG_VERSION_MAJOR"),
        num("CARGO_PKG_VERSION_MINOR"),
        num("CARGO_PKG_VERSION_PATCH"),
        pre,
    )
}

/// The shared library (`liblockstep.so`, this crate's cdylib), linked through
/// `.cargo/cc-static-libgcc`, which passes shared objects' arguments on unchanged:
/// - soname `liblockstep.so.MAJOR` (MAJOR of Cargo.toml's version): a program linked against it
///   records that name and loads whichever `liblockstep.so.MAJOR.*` the soname link points to;
/// - a version script (`OUT_DIR/lockstep.map`) that exports `lockstep*` and hides everything else.
///   rustc adds its own script listing the crate's `#[no_mangle]` items (all `lockstep*`) and the
///   linker merges the two; `.ci/c-install.sh` checks the exported set with `nm -D`;
/// - a link `liblockstep.so.MAJOR -> liblockstep.so` in the target directory (see
///   [`soname_links`]), so programs linked against the build tree run from there.
fn c_library() {
    let (major, ..) = c_version();
    let soname = format!("liblockstep.so.{major}");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let map = out.join("lockstep.map");
    std::fs::write(&map, "{\n  global: lockstep*;\n  local: *;\n};\n")
        .unwrap_or_else(|e| panic!("write {}: {e}", map.display()));
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,{soname}");
    println!(
        "cargo:rustc-cdylib-link-arg=-Wl,--version-script={}",
        map.display()
    );
    soname_links(&out, &soname);
}

/// `liblockstep.so.MAJOR -> liblockstep.so` in the profile directory and its `deps/` (where cargo
/// puts the library; OUT_DIR is `<target>/<profile>/build/<package>-<hash>/out`): a program linked
/// with `-llockstep` against the build tree needs the soname there at run time (tests/capi.rs,
/// the README's example). Made beside and renamed over, so concurrent builds never see a
/// half-made link; an unexpected layout only gets a warning.
fn soname_links(out: &Path, soname: &str) {
    let profile = match out.ancestors().nth(3) {
        Some(p) if out.ancestors().nth(2).and_then(Path::file_name) == Some("build".as_ref()) => {
            p.to_path_buf()
        }
        _ => {
            println!("cargo:warning=OUT_DIR {} is not <target>/<profile>/build/*/out: no {soname} link made; programs linked against the build tree will not find the library", out.display());
            return;
        }
    };
    for dir in [profile.clone(), profile.join("deps")] {
        let link = dir.join(soname);
        if std::fs::read_link(&link).is_ok_and(|t| t == Path::new("liblockstep.so")) {
            continue;
        }
        let tmp = dir.join(format!(".{soname}.tmp.{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        let made = std::fs::create_dir_all(&dir)
            .and_then(|()| std::os::unix::fs::symlink("liblockstep.so", &tmp))
            .and_then(|()| std::fs::rename(&tmp, &link));
        if let Err(e) = made {
            let _ = std::fs::remove_file(&tmp);
            println!(
                "cargo:warning=could not link {} -> liblockstep.so: {e}",
                link.display()
            );
        }
    }
}

/// The version macros opening the header: `LOCKSTEP_MAJOR`, `LOCKSTEP_MINOR`, `LOCKSTEP_PATCH`,
/// `LOCKSTEP_SUFFIX`, `LOCKSTEP_VERSION_CODE` and `LOCKSTEP_VERSION(X,Y,Z)`, as nccl.h's, from
/// Cargo.toml's version (the code matches what lockstepGetVersion returns).
fn version_macros() -> String {
    let (major, minor, patch, pre) = c_version();
    let code = major * 10000 + minor * 100 + patch;
    format!(
        "#define LOCKSTEP_MAJOR {major}\n#define LOCKSTEP_MINOR {minor}\n#define LOCKSTEP_PATCH {patch}\n#define LOCKSTEP_SUFFIX {pre:?}\n\n\
         // MAJOR * 10000 + MINOR * 100 + PATCH, as NCCL encodes versions since 2.9 (lockstepGetVersion).\n\
         #define LOCKSTEP_VERSION_CODE {code}\n#define LOCKSTEP_VERSION(X, Y, Z) ((X) * 10000 + (Y) * 100 + (Z))\n"
    )
}

/// Generate the C header from `src/lib.rs` with cbindgen (`cbindgen.toml`,
/// plus [`version_macros`]) into `OUT_DIR/lockstep.h`, which tests/capi.rs compares with the
/// checked-in `include/lockstep.h`. A stale checked-in copy gets a warning here, and is rewritten
/// (atomically) when `LOCKSTEP_UPDATE_HEADER=1`.
fn c_header() {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    println!("cargo:rerun-if-changed={}", root.join("src").display());
    println!(
        "cargo:rerun-if-changed={}",
        root.join("cbindgen.toml").display()
    );
    // The checked-in copy too: cargo replays a build script's warnings until it runs again, so
    // without this a header fixed by hand would go on being reported as stale.
    println!(
        "cargo:rerun-if-changed={}",
        root.join("include").join("lockstep.h").display()
    );
    println!("cargo:rerun-if-env-changed=LOCKSTEP_UPDATE_HEADER");
    let mut config = cbindgen::Config::from_file(root.join("cbindgen.toml"))
        .unwrap_or_else(|e| panic!("cbindgen.toml: {e}"));
    let rest = config.after_includes.take().unwrap_or_default();
    config.after_includes = Some(format!("\n{}\n{}", version_macros(), rest.trim_end()));
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(root.join("src/lib.rs"))
        .generate()
        .unwrap_or_else(|e| {
            panic!("cbindgen could not generate the C header from src/lib.rs: {e}")
        });
    let mut text = Vec::new();
    bindings.write(&mut text);
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("lockstep.h");
    std::fs::write(&out, &text).unwrap_or_else(|e| panic!("write {}: {e}", out.display()));
    let checked_in = root.join("include").join("lockstep.h");
    if std::fs::read(&checked_in).ok().as_deref() == Some(&text[..]) {
        return;
    }
    if std::env::var("LOCKSTEP_UPDATE_HEADER").as_deref() == Ok("1") {
        write_atomically(&checked_in, &text)
            .unwrap_or_else(|e| panic!("update {}: {e}", checked_in.display()));
    } else {
        println!(
            "cargo:warning=include/lockstep.h differs from what src/capi generates ({}): regenerate it with LOCKSTEP_UPDATE_HEADER=1 cargo build --release",
            out.display()
        );
    }
}

/// Replace `path` with `bytes`: a fresh temporary file beside it (create_new: O_CREAT|O_EXCL,
/// which also refuses a symbolic link there), synced, renamed over `path`, directory synced.
fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    let dir = path.parent().expect("a file path has a parent");
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(
        ".{}.tmp.{}",
        path.file_name().unwrap().to_string_lossy(),
        std::process::id()
    ));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)?;
    let done = f
        .write_all(bytes)
        .and_then(|()| f.sync_all())
        .and_then(|()| std::fs::rename(&tmp, path));
    if done.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    done?;
    std::fs::File::open(dir)?.sync_all()
}

fn main() {
    c_header();
    c_library();
}
