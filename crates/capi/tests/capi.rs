//! The C ABI (`liblockstep.so`, `crates/capi/include/lockstep.h`) from the outside, on the library
//! of this very build:
//!
//! * checks that the checked-in `include/lockstep.h` is what cbindgen generates from `src/lib.rs`
//!   (build.rs writes it to this build's OUT_DIR), that its enums carry NCCL's values and its
//!   version macros Cargo.toml's version, and that the library has the soname
//!   `liblockstep.so.MAJOR` and exports exactly the functions the header declares;
//! * compiles `tests/c/capi_test.c` with `cc -Werror` against the header and runs it under
//!   `lockstep launch` with 2 and 3 ranks, with ranks forked after lockstepGetUniqueId, and with
//!   ranks forked into lockstepCommInitRankConfig (a config, a timeout that expires);
//! * compiles `examples/c/hello.c` and runs it under `lockstep launch` with 3 ranks;
//! * runs `tests/c/capi_ctypes.py` (Python's ctypes, no numpy) under `lockstep launch` with 2 and 3
//!   ranks.
//!
//! The C program and the Python script check every value themselves and exit non-zero on the
//! first wrong one; this driver checks their exit status and that every rank reported.
//!
//! The launcher is the `lockstep` binary of the root package, which `cargo test --release` at the
//! repository root builds in the same target directory (see [`launcher`]).

#[path = "../../../tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use common::check;

/// The repository root: the paths below are relative to it.
const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
/// The checked-in header, relative to ROOT.
const HEADER: &str = "crates/capi/include/lockstep.h";
/// Seconds one C or Python job may take (each runs in well under a second).
const JOB_LIMIT_S: &str = "120";

/// The C library and the header generated with it.
struct Built {
    /// `liblockstep.so`.
    so: PathBuf,
    /// The header cbindgen generated (build.rs, OUT_DIR).
    generated: PathBuf,
}

/// The `lockstep` launcher of this build: `target/<profile>/lockstep`, beside the `deps/` this test
/// binary runs from. Only the root package can name it with `CARGO_BIN_EXE_lockstep`; running this
/// test alone (`cargo test -p lockstep-capi`) needs it built first.
fn launcher() -> Result<String, String> {
    static BIN: OnceLock<Result<String, String>> = OnceLock::new();
    BIN.get_or_init(|| {
        let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
        let bin = exe.parent().and_then(Path::parent).map(|d| d.join("lockstep")).ok_or("the test binary has no profile directory")?;
        if !bin.is_file() {
            return Err(format!(
                "the launcher {} is missing: run `cargo test --release` at the repository root, or build it first (`cargo build --release --bin lockstep`)",
                bin.display()
            ));
        }
        Ok(bin.to_string_lossy().into_owned())
    })
    .clone()
}

/// `liblockstep.so` as this source tree builds it now (`common::capi::liblockstep`), and the header
/// generated with it.
fn built() -> Result<Built, String> {
    Ok(Built {
        so: common::capi::liblockstep(Path::new(ROOT))?,
        generated: PathBuf::from(env!("OUT_DIR")).join("lockstep.h"),
    })
}

fn text(o: &Output) -> String {
    format!(
        "status: {}\n--- stdout\n{}--- stderr\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Run `args` under coreutils' `timeout` (status 124 when it ran past JOB_LIMIT_S), without the
/// environment variables in `unset`.
fn run_limited(args: &[&str], unset: &[&str]) -> Result<Output, String> {
    let mut c = Command::new("timeout");
    c.args(["-k", "5", JOB_LIMIT_S])
        .args(args)
        .current_dir(ROOT);
    for k in unset {
        c.env_remove(k);
    }
    c.output()
        .map_err(|e| format!("could not run {args:?} under timeout: {e}"))
}

/// Compile the C file `src` (relative to the repository) against include/lockstep.h and
/// liblockstep.so into `out`, warnings as errors.
fn compile_c(src: &Path, out: &Path) -> Result<(), String> {
    common::capi::compile_c(Path::new(ROOT), src, out)
}

fn c_binary() -> Result<&'static PathBuf, String> {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BIN.get_or_init(|| {
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("capi_test");
        compile_c(Path::new("crates/capi/tests/c/capi_test.c"), &out)?;
        Ok(out)
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// Every rank of an `n`-rank launch printed `line(r)`.
fn every_rank(o: &Output, n: usize, line: impl Fn(usize) -> String) -> Result<(), String> {
    let out = String::from_utf8_lossy(&o.stdout);
    for r in 0..n {
        let want = format!("[rank {r}] {}", line(r));
        check(
            out.lines().any(|l| l.starts_with(&want)),
            &format!("rank {r} must report `{want}`"),
            text(o),
        )?;
    }
    Ok(())
}

/// `program` (its path and arguments) under `lockstep launch --nproc-per-node n`, within the job
/// limit; fails with `what` (what the program must do) unless it exits 0.
fn under_launch(n: usize, program: &[&str], what: &str) -> Result<Output, String> {
    let (launcher, nproc) = (launcher()?, n.to_string());
    let mut args = vec![
        launcher.as_str(),
        "launch",
        "--nproc-per-node",
        &nproc,
        "--",
    ];
    args.extend_from_slice(program);
    let o = run_limited(&args, &[])?;
    check(o.status.success(), what, text(&o))?;
    Ok(o)
}

fn header_is_current() -> Result<(), String> {
    let b = built()?;
    let generated = std::fs::read_to_string(&b.generated)
        .map_err(|e| format!("read {}: {e}", b.generated.display()))?;
    let checked_in = Path::new(ROOT).join(HEADER);
    let ours = std::fs::read_to_string(&checked_in)
        .map_err(|e| format!("read {}: {e}", checked_in.display()))?;
    if generated == ours {
        return Ok(());
    }
    let (g, c): (Vec<&str>, Vec<&str>) = (generated.lines().collect(), ours.lines().collect());
    let at = (0..g.len().max(c.len()))
        .find(|&i| g.get(i) != c.get(i))
        .unwrap_or(0);
    Err(format!(
        "include/lockstep.h is stale: crates/capi/src generates a different header ({}).\nFirst difference, line {}:\n  checked in: {:?}\n  generated:  {:?}\nRegenerate it: cp {} crates/capi/include/lockstep.h (or LOCKSTEP_UPDATE_HEADER=1 cargo build --release)",
        b.generated.display(),
        at + 1,
        c.get(at).copied().unwrap_or("<end of file>"),
        g.get(at).copied().unwrap_or("<end of file>"),
        b.generated.display(),
    ))
}

/// NCCL's values (nccl.h), which the header must carry under the `lockstep` names.
const NCCL_VALUES: &[(&str, i64)] = &[
    ("Success", 0),
    ("UnhandledCudaError", 1),
    ("SystemError", 2),
    ("InternalError", 3),
    ("InvalidArgument", 4),
    ("InvalidUsage", 5),
    ("RemoteError", 6),
    ("InProgress", 7),
    ("Timeout", 8),
    ("NumResults", 9),
    ("Int8", 0),
    ("Uint8", 1),
    ("Int32", 2),
    ("Uint32", 3),
    ("Int64", 4),
    ("Uint64", 5),
    ("Float16", 6),
    ("Float32", 7),
    ("Float64", 8),
    ("Bfloat16", 9),
    ("Float8e4m3", 10),
    ("Float8e5m2", 11),
    ("NumTypes", 12),
    ("Sum", 0),
    ("Prod", 1),
    ("Max", 2),
    ("Min", 3),
    ("Avg", 4),
    ("NumOps", 5),
];

/// NCCL's aliases of data types (`ncclChar` ...), and the enumerators they name.
const ALIASES: &[(&str, &str)] = &[
    ("Char", "Int8"),
    ("Int", "Int32"),
    ("Half", "Float16"),
    ("Float", "Float32"),
    ("Double", "Float64"),
];

/// The functions of the C ABI.
const FUNCTIONS: &[&str] = &[
    "lockstepGetVersion",
    "lockstepGetUniqueId",
    "lockstepCommInitRank",
    "lockstepCommInitRankConfig",
    "lockstepCommInitFromEnv",
    "lockstepCommFinalize",
    "lockstepCommDestroy",
    "lockstepCommAbort",
    "lockstepCommSplit",
    "lockstepCommShrink",
    "lockstepCommGrow",
    "lockstepCommDumpTrace",
    "lockstepCommSetCheckFinite",
    "lockstepCommGetCheckFinite",
    "lockstepStatusJson",
    "lockstepCommCount",
    "lockstepCommUserRank",
    "lockstepCommGetAsyncError",
    "lockstepGetErrorString",
    "lockstepGetLastError",
    "lockstepAllReduce",
    "lockstepBcast",
    "lockstepBroadcast",
    "lockstepReduce",
    "lockstepAllGather",
    "lockstepReduceScatter",
    "lockstepAlltoAll",
    "lockstepGather",
    "lockstepScatter",
    "lockstepSend",
    "lockstepRecv",
    "lockstepGroupStart",
    "lockstepGroupEnd",
    "lockstepBarrier",
    "lockstepSetLogCallback",
];

fn header_has_nccl_values_and_functions() -> Result<(), String> {
    let h = std::fs::read_to_string(Path::new(ROOT).join(HEADER)).map_err(|e| e.to_string())?;
    // Each NCCL value and alias as `(what lockstep.h must hold, what it then defines)`.
    let values = NCCL_VALUES.iter().map(|(name, v)| {
        let what = format!("lockstep{name} as {v} (nccl{name})");
        (format!("lockstep{name} = {v},"), what)
    });
    let aliases = ALIASES.iter().map(|(alias, target)| {
        let what = format!("lockstep{alias} as lockstep{target} (nccl{alias})");
        (format!("#define lockstep{alias} lockstep{target}\n"), what)
    });
    for (text, what) in values.chain(aliases) {
        check(
            h.contains(&text),
            &format!("lockstep.h must define {what}"),
            "",
        )?;
    }
    check(
        h.contains("#define LOCKSTEP_UNIQUE_ID_BYTES 128"),
        "lockstepUniqueId has 128 bytes, as ncclUniqueId",
        "",
    )?;
    // The version macros carry Cargo.toml's version (the code is what lockstepGetVersion returns).
    let (major, minor, patch): (u32, u32, u32) = (
        env!("CARGO_PKG_VERSION_MAJOR").parse().unwrap(),
        env!("CARGO_PKG_VERSION_MINOR").parse().unwrap(),
        env!("CARGO_PKG_VERSION_PATCH").parse().unwrap(),
    );
    for line in [
        format!("#define LOCKSTEP_MAJOR {major}\n"),
        format!("#define LOCKSTEP_MINOR {minor}\n"),
        format!("#define LOCKSTEP_PATCH {patch}\n"),
        format!(
            "#define LOCKSTEP_VERSION_CODE {}\n",
            major * 10000 + minor * 100 + patch
        ),
        "#define LOCKSTEP_VERSION(X, Y, Z) ((X) * 10000 + (Y) * 100 + (Z))\n".to_string(),
        "#define LOCKSTEP_CONFIG_INITIALIZER {".to_string(),
        "#define LOCKSTEP_CONFIG_UNDEF_INT INT_MIN\n".to_string(),
    ] {
        check(
            h.contains(&line),
            &format!("lockstep.h must have `{}`", line.trim_end()),
            "",
        )?;
    }
    for f in FUNCTIONS {
        check(
            h.contains(&format!(" {f}(")) || h.contains(&format!("*{f}(")),
            &format!("lockstep.h must declare {f}"),
            "",
        )?;
    }
    for t in [
        "} lockstepResult_t;",
        "} lockstepDataType_t;",
        "} lockstepRedOp_t;",
        "} lockstepUniqueId;",
        "} lockstepConfig_t;",
        "typedef lockstepComm *lockstepComm_t;",
    ] {
        check(h.contains(t), &format!("lockstep.h must define `{t}`"), "")?;
    }
    Ok(())
}

fn library_exports_every_function() -> Result<(), String> {
    let b = built()?;
    // SAFETY: loading liblockstep.so runs no initialisers of its own (a Rust cdylib); the symbols
    // are only looked up, never called.
    let lib = unsafe { libloading::Library::new(&b.so) }
        .map_err(|e| format!("dlopen {}: {e}", b.so.display()))?;
    for f in FUNCTIONS {
        // SAFETY: the symbol is only checked for presence.
        let sym = unsafe { lib.get::<*const ()>(f.as_bytes()) };
        check(
            sym.is_ok(),
            &format!("{} must export {f}", b.so.display()),
            format!("{:?}", sym.err()),
        )?;
    }
    Ok(())
}

/// Run `prog args` and return its stdout, or an error with its output.
fn tool(prog: &str, args: &[&str]) -> Result<String, String> {
    let o = Command::new(prog)
        .args(args)
        .output()
        .map_err(|e| format!("could not run {prog} (binutils): {e}"))?;
    check(
        o.status.success(),
        &format!("{prog} {args:?} must succeed"),
        text(&o),
    )?;
    Ok(String::from_utf8_lossy(&o.stdout).into_owned())
}

/// The library's soname is `liblockstep.so.MAJOR`, a link by that name sits beside it (build.rs,
/// for programs linked against the build tree), and it exports exactly the header's functions.
fn library_soname_and_exports() -> Result<(), String> {
    let b = built()?;
    let so = b.so.to_str().ok_or("the library path is not UTF-8")?;
    let soname = format!("liblockstep.so.{}", env!("CARGO_PKG_VERSION_MAJOR"));
    let dynamic = tool("readelf", &["-d", so])?;
    check(
        dynamic.contains(&format!("Library soname: [{soname}]")),
        &format!("{so} must have the soname {soname}"),
        &dynamic,
    )?;
    let link = b.so.with_file_name(&soname);
    let target = std::fs::read_link(&link).map_err(|e| {
        format!(
            "{} must link to liblockstep.so (build.rs makes it): {e}",
            link.display()
        )
    })?;
    check(
        target == Path::new("liblockstep.so"),
        &format!("{} must link to liblockstep.so", link.display()),
        format!("{target:?}"),
    )?;
    let mut exported: Vec<String> = tool("nm", &["-D", "--defined-only", so])?
        .lines()
        .filter_map(|l| l.split_whitespace().last())
        .map(str::to_string)
        .collect();
    exported.sort();
    let mut want: Vec<String> = FUNCTIONS.iter().map(|f| f.to_string()).collect();
    want.sort();
    check(
        exported == want,
        &format!("{so} must export exactly the functions of lockstep.h"),
        format!("exported: {exported:?}"),
    )
}

fn c_under_launch(n: usize) -> Result<(), String> {
    let bin = c_binary()?;
    let o = under_launch(
        n,
        &[bin.to_str().unwrap(), "env"],
        &format!("capi_test under lockstep launch with {n} ranks must pass every check"),
    )?;
    every_rank(&o, n, |r| format!("rank {r} of {n}: all checks passed"))?;
    every_rank(&o, n, |r| {
        format!("rank {r}: mismatch: code 5 (invalid usage): lockstepAllReduce: collective")
    })?;
    every_rank(&o, n, |r| format!("rank {r}: split: verified"))?;
    every_rank(&o, n, |r| {
        format!("rank {r}: bcast/alltoall/gather/scatter: verified")
    })
}

fn capi_segments() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("lockstep-capi-"))
                .collect()
        })
        .unwrap_or_default()
}

/// No capi segment exists that was not in `before` (`what`: what must hold).
fn no_new_segments(before: &[String], what: &str) -> Result<(), String> {
    let left: Vec<String> = capi_segments()
        .into_iter()
        .filter(|s| !before.contains(s))
        .collect();
    check(left.is_empty(), what, format!("{left:?}"))
}

/// `capi_test MODE N`, whose ranks it forks itself (`what` says how they join): it must exit 0,
/// every rank must report that all checks passed (and `rank R: ALSO` where `also` is given), and
/// the parent that every rank did; its output.
fn forked_capi_test(
    mode: &str,
    n: usize,
    what: &str,
    also: Option<&str>,
) -> Result<Output, String> {
    let bin = c_binary()?;
    let o = run_limited(&[bin.to_str().unwrap(), mode, &n.to_string()], &[])?;
    check(
        o.status.success(),
        &format!("capi_test with {n} {what} must pass"),
        text(&o),
    )?;
    let out = String::from_utf8_lossy(&o.stdout);
    for r in 0..n {
        let wants = [format!("rank {r} of {n}: all checks passed")]
            .into_iter()
            .chain(also.map(|a| format!("rank {r}: {a}")));
        for want in wants {
            check(
                out.contains(&want),
                &format!("forked rank {r} must report `{want}`"),
                text(&o),
            )?;
        }
    }
    check(
        out.contains(&format!("{mode}: {n} ranks passed")),
        "the parent must see every rank pass",
        text(&o),
    )?;
    Ok(o)
}

fn c_unique_id(n: usize) -> Result<(), String> {
    let before = capi_segments();
    forked_capi_test(
        "uid",
        n,
        "forked ranks joined by lockstepGetUniqueId/lockstepCommInitRank",
        None,
    )?;
    no_new_segments(
        &before,
        "the job's shared segment must not outlive the join",
    )
}

/// `capi_test config N`: ranks forked into lockstepCommInitRankConfig run every check on a named,
/// non-blocking communicator, then wait on a communicator with a 300 ms timeout for a rank that
/// comes only once they have given up.
fn c_config(n: usize) -> Result<(), String> {
    let o = forked_capi_test(
        "config",
        n,
        "ranks joined by lockstepCommInitRankConfig",
        Some("config: verified"),
    )?;
    let out = String::from_utf8_lossy(&o.stdout);
    // The first rank to give up on the late one times out; others may see it abort first.
    check(
        out.contains(": timeout: code 8 (timeout"),
        "a waiting rank must fail with lockstepTimeout",
        text(&o),
    )?;
    check(
        out.contains(&format!("rank {}: late: code ", n - 1)),
        "the late rank's call must fail",
        text(&o),
    )
}

/// `capi_test resilience N`: forked ranks dump their flight recorders, read the job's status, see
/// rank 1's NaN named with the finite check on and pass through with it off, then the first
/// `n - 1` shrink the last rank out, go on without it, and the last rank is told it was
/// excluded; no segment outlives the job.
fn c_resilience(n: usize) -> Result<(), String> {
    let before = capi_segments();
    let bin = c_binary()?;
    let o = run_limited(&[bin.to_str().unwrap(), "resilience", &n.to_string()], &[])?;
    check(
        o.status.success(),
        &format!("capi_test resilience with {n} forked ranks must pass"),
        text(&o),
    )?;
    let out = String::from_utf8_lossy(&o.stdout);
    let mut wants: Vec<String> = (0..n)
        .map(|r| format!("rank {r}: check finite: lockstepAllReduce: rank 1 contributed NaN at element 5 of all_reduce"))
        .collect();
    wants.extend((0..n - 1).map(|r| format!("rank {r}: shrunk to rank {r} of {}", n - 1)));
    wants.push(format!("rank {}: excluded", n - 1));
    wants.push(format!("traces: {n} ranks wrote theirs"));
    wants.push(format!("resilience: {n} ranks passed"));
    for want in wants {
        check(
            out.contains(&want),
            &format!("capi_test must report `{want}`"),
            text(&o),
        )?;
    }
    no_new_segments(&before, "no shared segment may outlive the job")
}

/// `examples/c/hello.c`, the example docs/c-abi.md and .ci/c-install.sh use, compiles and runs.
fn hello_example() -> Result<(), String> {
    let bin = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("hello");
    compile_c(Path::new("examples/c/hello.c"), &bin)?;
    let o = under_launch(
        3,
        &[bin.to_str().unwrap()],
        "examples/c/hello.c must run under lockstep launch with 3 ranks",
    )?;
    every_rank(&o, 3, |r| {
        format!(
            "rank {r} of 3: hello from lockstep {}, all-reduce sum 6 (checked)",
            env!("CARGO_PKG_VERSION")
        )
    })
}

fn c_init_from_env_error() -> Result<(), String> {
    let bin = c_binary()?;
    // Outside any launcher: lockstepCommInitFromEnv has no job to join.
    let launcher_vars = [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "SLURM_PROCID",
        "LOCKSTEP_JOB_ID",
    ];
    let o = run_limited(&[bin.to_str().unwrap(), "env"], &launcher_vars)?;
    let err = String::from_utf8_lossy(&o.stderr);
    check(
        !o.status.success(),
        "lockstepCommInitFromEnv must fail outside a launcher",
        text(&o),
    )?;
    check(
        err.contains("lockstepCommInitFromEnv(&comm) returned 2 (unhandled system error")
            && err.contains("lockstepCommInitFromEnv: communicator setup failed: no launcher variables found"),
        "the failure must come back as lockstepSystemError, with lockstepGetLastError saying what is missing",
        text(&o),
    )
}

/// `bin ARGS` under timeout with `LOCKSTEP_LOG` set to `log` (or removed).
fn with_log(args: &[&str], log: Option<&str>) -> Result<Output, String> {
    let mut c = Command::new("timeout");
    c.args(["-k", "5", JOB_LIMIT_S])
        .args(args)
        .current_dir(ROOT);
    match log {
        Some(v) => c.env("LOCKSTEP_LOG", v),
        None => c.env_remove("LOCKSTEP_LOG"),
    };
    c.env_remove("LOCKSTEP_LOG_TIME");
    c.output()
        .map_err(|e| format!("could not run {args:?} under timeout: {e}"))
}

/// `LOCKSTEP_LOG=info`: every rank's init line on stderr, as `NCCL_DEBUG=INFO` prints NCCL's;
/// without it, nothing.
fn c_log_stderr() -> Result<(), String> {
    let bin = c_binary()?;
    let launcher = launcher()?;
    let args = [
        launcher.as_str(),
        "launch",
        "--nproc-per-node",
        "2",
        "--",
        bin.to_str().unwrap(),
        "env",
    ];
    let o = with_log(&args, Some("info"))?;
    check(
        o.status.success(),
        "capi_test env with LOCKSTEP_LOG=info must pass",
        text(&o),
    )?;
    let err = String::from_utf8_lossy(&o.stderr);
    for r in 0..2 {
        let want = format!(
            "lockstep::init: lockstep {} init: rank {r} of 2",
            env!("CARGO_PKG_VERSION")
        );
        check(
            err.contains(&want),
            &format!("LOCKSTEP_LOG=info: the C library logs {want:?}"),
            text(&o),
        )?;
    }
    let o = with_log(&args, None)?;
    let err = String::from_utf8_lossy(&o.stderr);
    check(
        o.status.success() && !err.contains("lockstep::init"),
        "without LOCKSTEP_LOG the C library prints nothing",
        text(&o),
    )
}

/// lockstepSetLogCallback receives the init line (checked inside capi_test); an invalid
/// `LOCKSTEP_LOG` fails the call with lockstepInvalidArgument naming the variable.
fn c_log_callback() -> Result<(), String> {
    let bin = c_binary()?;
    let o = with_log(&[bin.to_str().unwrap(), "log"], None)?;
    check(
        o.status.success()
            && String::from_utf8_lossy(&o.stdout).contains("log: the callback saw the init line")
            && !String::from_utf8_lossy(&o.stderr).contains("lockstep::init"),
        "capi_test log: the callback sees the init line and stderr stays quiet",
        text(&o),
    )?;
    let o = with_log(&[bin.to_str().unwrap(), "log"], Some("lockstep=loud"))?;
    let err = String::from_utf8_lossy(&o.stderr);
    check(
        !o.status.success()
            && err.contains("returned 4 (invalid argument)")
            && err.contains("LOCKSTEP_LOG=\"lockstep=loud\" is not a log filter"),
        "an invalid LOCKSTEP_LOG fails the call, naming the variable",
        text(&o),
    )
}

/// The C example of the README's "From C" section compiles and runs as shown.
fn readme_example() -> Result<(), String> {
    let readme =
        std::fs::read_to_string(Path::new(ROOT).join("README.md")).map_err(|e| e.to_string())?;
    let section = readme
        .split("\n## From C\n")
        .nth(1)
        .ok_or("README.md has no `## From C` section")?;
    let code = section
        .split("```c\n")
        .nth(1)
        .and_then(|c| c.split("\n```").next())
        .ok_or("the `From C` section has no ```c block")?;
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let (src, bin) = (dir.join("readme_example.c"), dir.join("readme_example"));
    std::fs::write(&src, format!("{code}\n"))
        .map_err(|e| format!("write {}: {e}", src.display()))?;
    compile_c(&src, &bin)?;
    let o = under_launch(
        2,
        &[bin.to_str().unwrap()],
        "the README's C example must run under lockstep launch with 2 ranks",
    )?;
    every_rank(&o, 2, |r| {
        format!("rank {r} of 2: mean 0.5, from rank {}", 1 - r)
    })
}

fn ctypes_under_launch(n: usize) -> Result<(), String> {
    let b = built()?;
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let o = under_launch(
        n,
        &[
            &python,
            "crates/capi/tests/c/capi_ctypes.py",
            b.so.to_str().unwrap(),
        ],
        &format!("capi_ctypes.py under lockstep launch with {n} ranks must pass (needs python3, or set PYTHON)"),
    )?;
    every_rank(&o, n, |r| format!("rank {r} of {n}: ctypes checks passed"))?;
    every_rank(&o, n, |r| format!("rank {r}: ctypes split: verified"))?;
    every_rank(&o, n, |r| {
        format!("rank {r}: ctypes mismatch: code 5: lockstepAllReduce: collective")
    })
}

/// The tests that run once each.
const TESTS: [common::Test; 9] = [
    ("header_is_current", header_is_current),
    (
        "header_has_nccl_values_and_functions",
        header_has_nccl_values_and_functions,
    ),
    (
        "library_exports_every_function",
        library_exports_every_function,
    ),
    ("library_soname_and_exports", library_soname_and_exports),
    ("c_init_from_env_error", c_init_from_env_error),
    ("c_log_stderr", c_log_stderr),
    ("c_log_callback", c_log_callback),
    ("hello_example", hello_example),
    ("readme_example", readme_example),
];

/// A test of `n` ranks.
type WorldTest = fn(usize) -> Result<(), String>;

/// The tests that run with 2 ranks and with 3, as `NAME_2` and `NAME_3`.
const PER_WORLD: [(&str, WorldTest); 5] = [
    ("c_launch", c_under_launch),
    ("c_unique_id", c_unique_id),
    ("c_config", c_config),
    ("c_resilience", c_resilience),
    ("ctypes_launch", ctypes_under_launch),
];

fn main() -> std::process::ExitCode {
    let mut r = common::Runner::new();
    for (name, f) in TESTS {
        r.run(name, f);
    }
    for (name, f) in PER_WORLD {
        for n in [2, 3] {
            r.run(&format!("{name}_{n}"), || f(n));
        }
    }
    r.finish()
}
