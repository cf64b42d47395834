//! Single-CUDA-init guard, fork-safety check and library discovery, tested without a GPU against
//! tiny fake driver and NCCL libraries compiled from C at test time (`cc -shared -fPIC`).
//!
//! The guard's state is process-global, so every scenario runs in its own process: the test
//! binary (harness = false) re-executes itself with `LOCKSTEP_FAKE_SCENARIO=<name>`.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A fake `libcuda.so.1`: `cuDeviceGetCount` answers NOT_INITIALIZED (3) until `cuInit`.
const FAKE_CUDA_C: &str = r#"
static int initialised = 0;
static int init_calls = 0;
int cuInit(unsigned flags) { if (flags != 0) return 1; initialised = 1; init_calls++; return 0; }
int cuDeviceGetCount(int* n) { if (!initialised) return 3; *n = 2; return 0; }
#ifndef BROKEN
int cuDriverGetVersion(int* v) { *v = 12040; return 0; }
#endif
static const char* name_of(int e) {
    switch (e) { case 0: return "CUDA_SUCCESS"; case 1: return "CUDA_ERROR_INVALID_VALUE";
                 case 3: return "CUDA_ERROR_NOT_INITIALIZED"; case 100: return "CUDA_ERROR_NO_DEVICE";
                 default: return 0; }
}
int cuGetErrorName(int e, const char** s) { *s = name_of(e); return *s ? 0 : 1; }
int cuGetErrorString(int e, const char** s) {
    switch (e) { case 0: *s = "no error"; return 0; case 1: *s = "invalid argument"; return 0;
                 case 3: *s = "initialization error"; return 0; case 100: *s = "no CUDA-capable device is detected"; return 0;
                 default: *s = 0; return 1; }
}
int fake_init_calls(void) { return init_calls; }
"#;

/// A fake `libnccl.so.2` with only the calls that need no GPU.
const FAKE_NCCL_C: &str = r#"
#ifndef NCCL_CODE
#define NCCL_CODE 21803
#endif
typedef struct { char internal[128]; } ncclUniqueId;
int ncclGetVersion(int* v) { *v = NCCL_CODE; return 0; }
int ncclGetUniqueId(ncclUniqueId* id) { for (int i = 0; i < 128; i++) id->internal[i] = (char)(i * 3 + 1); return 0; }
const char* ncclGetErrorString(int r) { return r == 0 ? "no error" : "invalid argument (run with NCCL_DEBUG=WARN for details)"; }
"#;

fn cc(src: &str, out: &Path, defines: &[&str]) {
    let dir = out.parent().unwrap();
    std::fs::create_dir_all(dir).unwrap();
    let c = dir.join("src.c");
    std::fs::write(&c, src).unwrap();
    let soname = out.file_name().unwrap().to_string_lossy().to_string();
    let st = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(out)
        .arg(&c)
        .arg(format!("-Wl,-soname,{soname}"))
        .args(defines)
        .status()
        .expect("run cc (a C compiler is needed for the fake-library tests)");
    assert!(st.success(), "cc failed for {}", out.display());
}

struct Libs {
    cuda: PathBuf,
    cuda_broken: PathBuf,
    nccl: PathBuf,
    nccl_old: PathBuf,
}

fn build_libs(root: &Path) -> Libs {
    let l = Libs {
        cuda: root.join("cuda/libcuda.so.1"),
        cuda_broken: root.join("cuda-broken/libcuda.so.1"),
        nccl: root.join("nccl/libnccl.so.2"),
        nccl_old: root.join("nccl-old/libnccl.so.2"),
    };
    cc(FAKE_CUDA_C, &l.cuda, &[]);
    cc(FAKE_CUDA_C, &l.cuda_broken, &["-DBROKEN"]);
    cc(FAKE_NCCL_C, &l.nccl, &[]);
    cc(FAKE_NCCL_C, &l.nccl_old, &["-DNCCL_CODE=21505"]);
    l
}

// ---------------------------------------------------------------------------------------------
// Scenarios (each runs in its own process)

fn fake_init_calls() -> i32 {
    let path = std::env::var("LOCKSTEP_CUDA_LIBRARY").unwrap();
    // SAFETY: the fake library has no initialisers; the symbol has the declared C prototype.
    unsafe {
        let lib = libloading::Library::new(&path).unwrap();
        let f = lib.get::<unsafe extern "C" fn() -> i32>(b"fake_init_calls\0").unwrap();
        f()
    }
}

#[inline(never)]
fn init_cuda_from_here() {
    lockstep::cuda::init::ensure_init().expect("ensure_init through the fake driver");
}

fn expect_contains(what: &str, text: &str, needles: &[&str]) {
    if std::env::var_os("LOCKSTEP_FAKE_VERBOSE").is_some() {
        println!("== {what}:\n{text}\n");
    }
    for n in needles {
        assert!(text.contains(n), "{what}: expected to find {n:?} in:\n----\n{text}\n----");
    }
}

fn scenario(name: &str) {
    use lockstep::cuda::init::{check_fork_safe, init_record, probe_child};
    match name {
        "guard_records_location" => {
            assert!(check_fork_safe().is_ok(), "nothing loaded yet");
            let report = lockstep::cuda::env_report();
            expect_contains("env_report", &report, &["libcuda.so.1", "12040 (CUDA 12.4)", "initialised in this process: no"]);
            assert!(check_fork_safe().is_ok(), "loaded but not initialised must be fork-safe");
            init_cuda_from_here();
            lockstep::cuda::init::ensure_init().unwrap();
            assert_eq!(fake_init_calls(), 1, "cuInit must run once per process");
            assert_eq!(lockstep::cuda::device_count().unwrap(), 2);
            let rec = init_record().expect("record");
            assert_eq!(rec.pid, std::process::id() as i32);
            let err = check_fork_safe().unwrap_err();
            expect_contains(
                "check_fork_safe",
                &err,
                &[
                    "by lockstep",
                    &format!("pid {}", std::process::id()),
                    "init_cuda_from_here",
                    "move all CUDA work into the rank function",
                    "lockstep::launch",
                ],
            );
            let launch_err = lockstep::launch::launch(&lockstep::launch::LaunchConfig::new(2), |_ctx| Ok(0u64)).unwrap_err().to_string();
            expect_contains("launch", &launch_err, &["CUDA was already initialised", "init_cuda_from_here"]);
            expect_contains("probe_child", &probe_child().unwrap_err(), &["already initialised"]);
            expect_contains("env_report", &lockstep::cuda::env_report(), &["initialised in this process: yes, by lockstep"]);
        }
        "foreign_init_refused" => {
            let path = std::env::var("LOCKSTEP_CUDA_LIBRARY").unwrap();
            // SAFETY: the fake has no initialisers.
            let lib = unsafe { libloading::Library::new(&path) }.unwrap();
            assert!(check_fork_safe().is_ok(), "mapped but not initialised must be fork-safe");
            // Initialise behind lockstep's back, as a foreign library would.
            // SAFETY: cuInit(unsigned) of the fake.
            let rc = unsafe { lib.get::<unsafe extern "C" fn(u32) -> i32>(b"cuInit\0").unwrap()(0) };
            assert_eq!(rc, 0);
            let err = check_fork_safe().unwrap_err();
            expect_contains(
                "check_fork_safe",
                &err,
                &["outside lockstep", "libcuda.so.1", "cuDeviceGetCount succeeds", "move all CUDA work into the rank function"],
            );
            assert!(init_record().is_none());
            let launch_err = lockstep::launch::launch(&lockstep::launch::LaunchConfig::new(1), |_ctx| Ok(0u64)).unwrap_err().to_string();
            expect_contains("launch", &launch_err, &["outside lockstep"]);
        }
        "guard_is_per_process" => {
            // A child forked from an uninitialised parent initialises once itself; the parent stays clean.
            // SAFETY: the child only runs the guard and exits with _exit.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0);
            if pid == 0 {
                let ok = lockstep::cuda::init::ensure_init().is_ok()
                    && lockstep::cuda::init::ensure_init().is_ok()
                    && fake_init_calls() == 1
                    && check_fork_safe().is_err()
                    && init_record().map(|r| r.pid) == Some(std::process::id() as i32);
                // SAFETY: leave the child without running the parent's destructors.
                unsafe { libc::_exit(if ok { 0 } else { 1 }) };
            }
            let mut st = 0;
            // SAFETY: our child.
            unsafe { libc::waitpid(pid, &mut st, 0) };
            assert!(libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0, "child guard checks failed (status {st})");
            assert!(check_fork_safe().is_ok(), "the child's cuInit must not mark the parent");
            assert!(init_record().is_none());
            // Parent initialises now; a child forked afterwards does not inherit lockstep's record
            // (pid differs) but still sees the inherited driver state as foreign.
            lockstep::cuda::init::ensure_init().unwrap();
            // SAFETY: as above.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                let ok = init_record().is_none() && check_fork_safe().map_err(|e| e.contains("outside lockstep")) == Err(true);
                // SAFETY: as above.
                unsafe { libc::_exit(if ok { 0 } else { 1 }) };
            }
            // SAFETY: our child.
            unsafe { libc::waitpid(pid, &mut st, 0) };
            assert!(libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0, "post-init child checks failed (status {st})");
        }
        "probe_child_reports" => {
            let s = probe_child().expect("probe");
            expect_contains("probe_child", &s, &["2 device(s)", "CUDA 12.4", "libcuda.so.1"]);
            assert!(check_fork_safe().is_ok(), "the probe must leave the parent uninitialised");
            assert_eq!(fake_init_calls(), 0);
        }
        "missing_override" => {
            let e = lockstep::cuda::device_count().unwrap_err().to_string();
            expect_contains(
                "device_count",
                &e,
                &["CUDA driver library (libcuda) not found", "/nonexistent/libcuda.so.1", "LOCKSTEP_CUDA_LIBRARY"],
            );
            let e = lockstep::cuda::Context::new(0).unwrap_err().to_string();
            expect_contains("Context::new", &e, &["not found"]);
            assert!(check_fork_safe().is_ok());
            expect_contains("env_report", &lockstep::cuda::env_report(), &["driver : not found", "/nonexistent/libcuda.so.1"]);
        }
        "missing_default_search" => {
            if lockstep::cuda::driver_present() {
                println!("(a real driver is installed: nothing to check)");
                return;
            }
            let e = lockstep::cuda::device_count().unwrap_err().to_string();
            expect_contains(
                "device_count",
                &e,
                &[
                    "libcuda.so.1 (dynamic loader search path)",
                    "folders with no libcuda.so",
                    "/usr/lib/x86_64-linux-gnu",
                    "LOCKSTEP_CUDA_LIBRARY",
                ],
            );
        }
        "missing_symbol" => {
            let e = lockstep::cuda::device_count().unwrap_err().to_string();
            expect_contains("device_count", &e, &["no symbol `cuDriverGetVersion`", "LOCKSTEP_CUDA_LIBRARY"]);
        }
        "driver_symbols_missing_is_error" => {
            // The fake exports only the probe calls: the safe layer must fail cleanly, not panic.
            let e = lockstep::cuda::Context::new(0).unwrap_err().to_string();
            expect_contains("Context::new", &e, &["has no symbol `cuDeviceGet`", "libcuda.so.1"]);
            let e = lockstep::cuda::Context::new(5).unwrap_err().to_string();
            expect_contains("Context::new(5)", &e, &["ordinal 5 out of range", "2 device(s)"]);
        }
        "fake_nccl" => {
            assert_eq!(lockstep::nccl::version().unwrap(), 21803);
            let id = lockstep::nccl::comm::unique_id().unwrap();
            assert_eq!(id[1], 4);
            let e = lockstep::nccl::check_library().unwrap_err().to_string();
            expect_contains("check_library", &e, &["has no symbol `ncclCommInitRank`", "LOCKSTEP_NCCL_LIBRARY"]);
            expect_contains(
                "env_report",
                &lockstep::cuda::env_report(),
                &["libnccl.so.2", "ncclGetVersion = 21803 (2.18.3)", "incomplete"],
            );
        }
        "old_nccl_rejected" => {
            let e = lockstep::nccl::version().unwrap_err().to_string();
            expect_contains("nccl::version", &e, &["older than 2.18", "LOCKSTEP_NCCL_LIBRARY"]);
        }
        "missing_nccl_and_nvrtc" => {
            let e = lockstep::nccl::version().unwrap_err().to_string();
            expect_contains(
                "nccl::version",
                &e,
                &["NCCL library (libnccl) not found", "/nonexistent/libnccl.so.2", "LOCKSTEP_NCCL_LIBRARY"],
            );
            let e = lockstep::cuda::compile_ptx(lockstep::cuda::KernelId::Elementwise, "compute_80").unwrap_err().to_string();
            expect_contains("compile_ptx", &e, &["NVRTC library (libnvrtc) not found", "LOCKSTEP_NVRTC_LIBRARY", "nvidia-cuda-nvrtc"]);
        }
        "debug_probe" => {
            // LOCKSTEP_DEBUG=1: the fork check also forks a probe child that reports on stderr.
            check_fork_safe().expect("fork-safe");
            assert!(init_record().is_none());
            assert_eq!(fake_init_calls(), 0);
        }
        other => panic!("unknown scenario {other}"),
    }
}

fn main() {
    if let Ok(name) = std::env::var("LOCKSTEP_FAKE_SCENARIO") {
        scenario(&name);
        return;
    }
    let filter: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let root = std::env::temp_dir().join(format!("lockstep-fake-libs-{}", std::process::id()));
    let libs = build_libs(&root);
    let s = |p: &PathBuf| p.display().to_string();
    let cases: Vec<(&str, Vec<(&str, String)>)> = vec![
        ("guard_records_location", vec![("LOCKSTEP_CUDA_LIBRARY", s(&libs.cuda))]),
        ("foreign_init_refused", vec![("LOCKSTEP_CUDA_LIBRARY", s(&libs.cuda))]),
        ("guard_is_per_process", vec![("LOCKSTEP_CUDA_LIBRARY", s(&libs.cuda))]),
        ("probe_child_reports", vec![("LOCKSTEP_CUDA_LIBRARY", s(&libs.cuda))]),
        ("missing_override", vec![("LOCKSTEP_CUDA_LIBRARY", "/nonexistent/libcuda.so.1".into())]),
        ("missing_default_search", vec![]),
        ("missing_symbol", vec![("LOCKSTEP_CUDA_LIBRARY", s(&libs.cuda_broken))]),
        ("driver_symbols_missing_is_error", vec![("LOCKSTEP_CUDA_LIBRARY", s(&libs.cuda))]),
        ("fake_nccl", vec![("LOCKSTEP_NCCL_LIBRARY", s(&libs.nccl)), ("LOCKSTEP_CUDA_LIBRARY", s(&libs.cuda))]),
        ("old_nccl_rejected", vec![("LOCKSTEP_NCCL_LIBRARY", s(&libs.nccl_old))]),
        ("debug_probe", vec![("LOCKSTEP_CUDA_LIBRARY", s(&libs.cuda)), ("LOCKSTEP_DEBUG", "1".into())]),
        (
            "missing_nccl_and_nvrtc",
            vec![
                ("LOCKSTEP_NCCL_LIBRARY", "/nonexistent/libnccl.so.2".into()),
                ("LOCKSTEP_NVRTC_LIBRARY", "/nonexistent/libnvrtc.so.12".into()),
            ],
        ),
    ];
    let exe = std::env::current_exe().unwrap();
    let (mut passed, mut failed) = (0, Vec::new());
    for (name, env) in &cases {
        if !filter.is_empty() && !filter.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        let mut cmd = Command::new(&exe);
        cmd.env("LOCKSTEP_FAKE_SCENARIO", name);
        for v in ["LOCKSTEP_CUDA_LIBRARY", "LOCKSTEP_NCCL_LIBRARY", "LOCKSTEP_NVRTC_LIBRARY", "LOCKSTEP_DEBUG"] {
            cmd.env_remove(v);
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = cmd.output().expect("re-run the test binary");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stderr_ok = *name != "debug_probe" || stderr.contains("lockstep: CUDA probe: a rank can initialise CUDA: 2 device(s)");
        if out.status.success() && stderr_ok {
            if std::env::var_os("LOCKSTEP_FAKE_VERBOSE").is_some() {
                print!("{}", String::from_utf8_lossy(&out.stdout));
            }
            println!("test {name} ... ok");
            passed += 1;
        } else {
            println!("test {name} ... FAILED\n{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            failed.push(*name);
        }
    }
    let _ = std::fs::remove_dir_all(&root);
    println!("\ntest result: {}. {passed} passed; {} failed", if failed.is_empty() { "ok" } else { "FAILED" }, failed.len());
    if !failed.is_empty() {
        println!("failed: {failed:?}");
        std::process::exit(1);
    }
}
