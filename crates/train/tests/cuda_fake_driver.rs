//! Single-CUDA-init guard, fork-safety check and library discovery, tested without a GPU against
//! tiny fake driver and NCCL libraries compiled from C at test time (`cc -shared -fPIC`).
//!
//! The guard's state is process-global, so every scenario runs in its own process: the test
//! binary (harness = false) re-executes itself with `LOCKSTEP_FAKE_SCENARIO=<name>`.

use lockstep_train::device::kernels::KernelId;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

#[path = "common/axpy.rs"]
mod axpy_twin;
#[path = "../../../tests/common/bins.rs"]
mod bins;
#[path = "../../../tests/common/collectives.rs"]
mod collectives;
#[path = "../../../tests/common/runner.rs"]
mod runner;
#[path = "common/simt.rs"]
mod simt;

/// Simulated NCCL: host memory stands in for device memory (see the file). The simulated driver,
/// with the real kernels under the SIMT shim, and NVRTC come from `common/simt.rs`.
const SIM_NCCL_C: &str = include_str!("../../../tests/fake/sim_nccl.c");

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
    sim_cuda: PathBuf,
    sim_nvrtc: PathBuf,
    sim_nccl: PathBuf,
    sim_nccl_no_split: PathBuf,
}

fn build_libs(root: &Path) -> Libs {
    let sim = simt::SimGpu::build();
    let l = Libs {
        cuda: root.join("cuda/libcuda.so.1"),
        cuda_broken: root.join("cuda-broken/libcuda.so.1"),
        nccl: root.join("nccl/libnccl.so.2"),
        nccl_old: root.join("nccl-old/libnccl.so.2"),
        sim_cuda: sim.cuda.clone(),
        sim_nvrtc: sim.nvrtc.clone(),
        sim_nccl: root.join("sim-nccl/libnccl.so.2"),
        sim_nccl_no_split: root.join("sim-nccl-no-split/libnccl.so.2"),
    };
    cc(SIM_NCCL_C, &l.sim_nccl, &[]);
    cc(SIM_NCCL_C, &l.sim_nccl_no_split, &["-DSIM_NO_SPLIT"]);
    cc(FAKE_CUDA_C, &l.cuda, &[]);
    cc(FAKE_CUDA_C, &l.cuda_broken, &["-DBROKEN"]);
    cc(FAKE_NCCL_C, &l.nccl, &[]);
    cc(FAKE_NCCL_C, &l.nccl_old, &["-DNCCL_CODE=21505"]);
    l
}

// ---------------------------------------------------------------------------------------------
// Scenarios (each runs in its own process)

fn fake_init_calls() -> i32 {
    counter("LOCKSTEP_CUDA_LIBRARY", "fake_init_calls")
}

/// Call an `int name(void)` counter exported by the fake library named by `var`.
fn counter(var: &str, name: &str) -> i32 {
    let path = std::env::var(var).unwrap();
    let sym = format!("{name}\0");
    // SAFETY: the fake library has no initialisers; the symbol has the declared C prototype.
    unsafe {
        let lib = libloading::Library::new(&path).unwrap();
        let f = lib
            .get::<unsafe extern "C" fn() -> i32>(sym.as_bytes())
            .unwrap();
        f()
    }
}

fn sim_nccl_comm(
    world: usize,
    opts: lockstep::nccl::NcclOptions,
) -> (
    Arc<lockstep::cuda::Context>,
    Result<lockstep::nccl::NcclComm, lockstep::nccl::NcclError>,
) {
    let ctx = lockstep::cuda::Context::new(0).unwrap();
    let mut exchange =
        |_rank: usize, id: Option<&[u8; 128]>| id.copied().ok_or_else(|| "no peer".to_string());
    let comm = lockstep::nccl::NcclComm::new(&ctx, 0, world, &mut exchange, opts);
    (ctx, comm)
}

/// A collective ordered with a caller's stream (`wait_stream`, the call, `signal_stream`), as the
/// torch backend and the Python package run device calls: the driver's call log shows an event
/// recorded on the caller's stream that the communicator's stream waits on before the
/// all-reduce, an event recorded on the communicator's stream after it that the caller's stream
/// waits on, and no synchronisation of the device, of a stream or of an event in between.
fn sim_nccl_stream_ordered() {
    let log = PathBuf::from(std::env::var("SIM_CALL_LOG").expect("SIM_CALL_LOG is set"));
    let (ctx, comm) = sim_nccl_comm(1, Default::default());
    let mut comm = comm
        .expect("NCCL init through the simulator")
        .into_communicator();
    let s = ctx.stream().unwrap();
    let d = lockstep::cuda::DeviceBuffer::from_host(&s, &[1f32, 2.0]).unwrap();
    let mut r = lockstep::cuda::DeviceBuffer::<f32>::zeros(&s, 2).unwrap();
    s.synchronize().unwrap();
    // The caller's stream, made behind lockstep's back (as torch makes its streams).
    let caller: usize = {
        let path = std::env::var("LOCKSTEP_CUDA_LIBRARY").unwrap();
        // SAFETY: the simulator's cuStreamCreate has this prototype and writes one pointer.
        unsafe {
            let lib = libloading::Library::new(&path).unwrap();
            let create = lib
                .get::<unsafe extern "C" fn(*mut usize, u32) -> i32>(b"cuStreamCreate\0")
                .unwrap();
            let mut h = 0usize;
            assert_eq!(create(&mut h, 1), 0);
            h
        }
    };
    // SAFETY: `caller` is a stream of the simulated device, never destroyed in this process.
    let fs = unsafe { lockstep::cuda::ForeignStream::new(&ctx, caller) };
    std::fs::write(&log, "").unwrap();
    comm.wait_stream(&fs).unwrap();
    comm.all_reduce(&d, &mut r, lockstep::comm::ReduceOp::Sum)
        .unwrap();
    comm.signal_stream(&fs).unwrap();
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<Vec<&str>> = text.lines().map(|l| l.split(' ').collect()).collect();
    let hex = |h: usize| format!("{h:#x}");
    let u = hex(caller);
    let at = |pred: &dyn Fn(&[&str]) -> bool| lines.iter().position(|l| pred(l));
    let ar = at(&|l| l[0] == "ncclAllReduce").unwrap_or_else(|| panic!("no all-reduce:\n{text}"));
    let own = lines[ar][1];
    let rec_in =
        at(&|l| l[0] == "cuEventRecord" && l[2] == u).expect("an event on the caller's stream");
    let ev_in = lines[rec_in][1];
    let wait_in = at(&|l| l[0] == "cuStreamWaitEvent" && l[1] == own && l[2] == ev_in)
        .unwrap_or_else(|| panic!("the communicator's stream waits for the caller's:\n{text}"));
    let rec_out = lines
        .iter()
        .rposition(|l| l[0] == "cuEventRecord" && l[2] == own)
        .unwrap_or_else(|| panic!("an event on the communicator's stream:\n{text}"));
    let ev_out = lines[rec_out][1];
    let wait_out = at(&|l| l[0] == "cuStreamWaitEvent" && l[1] == u && l[2] == ev_out)
        .unwrap_or_else(|| panic!("the caller's stream waits for the communicator's:\n{text}"));
    assert!(
        rec_in < wait_in && wait_in < ar && ar < rec_out && rec_out < wait_out,
        "order: record on caller, wait, all-reduce, record on own, caller waits:\n{text}"
    );
    assert!(
        !text.contains("Synchronize"),
        "no device, stream or event synchronisation in a stream-ordered call:\n{text}"
    );
    drop(comm);
    drop(s);
}

/// Run `body` on 3 forked ranks that share the one simulated GPU through the staged backend (each
/// gets its rank, a stream and its communicator); every rank's result, or the launch's error.
fn on_three_staged_ranks<R: serde::Serialize + serde::de::DeserializeOwned>(
    body: impl FnOnce(
        usize,
        &lockstep::cuda::Stream,
        &mut lockstep::comm::Communicator,
    ) -> lockstep::launch::RankResult<R>,
) -> Result<Vec<R>, lockstep::launch::LaunchError> {
    lockstep::launch::launch(&lockstep::launch::LaunchConfig::new(3), |rc| {
        let ctx = lockstep::cuda::Context::new(0)?;
        let s = ctx.stream()?;
        let mut comm = lockstep::staged::StagedBackend::new(&ctx, rc.comm)?.into_communicator();
        body(rc.rank, &s, &mut comm)
    })
}

/// Panic (naming `what`) unless the launch succeeded and every rank's checks held.
fn expect_every_rank(what: &str, res: Result<Vec<bool>, lockstep::launch::LaunchError>) {
    match res {
        Ok(v) if v.iter().all(|b| *b) => {}
        other => panic!("{what}: {other:?}"),
    }
}

/// A one-rank communicator on the simulated NCCL with `opts`, and 16 zeros for it to reduce on a
/// stream of its context (context and stream come along, to outlive the two).
fn one_rank_sim_nccl(
    opts: lockstep::nccl::NcclOptions,
) -> (
    Arc<lockstep::cuda::Context>,
    lockstep::comm::Communicator,
    lockstep::cuda::Stream,
    lockstep::cuda::DeviceBuffer<f32>,
) {
    let (ctx, comm) = sim_nccl_comm(1, opts);
    let comm = comm.unwrap().into_communicator();
    let s = ctx.stream().unwrap();
    let x = lockstep::cuda::DeviceBuffer::<f32>::zeros(&s, 16).unwrap();
    (ctx, comm, s, x)
}

fn short_timeout() -> lockstep::nccl::NcclOptions {
    lockstep::nccl::NcclOptions {
        timeout: Duration::from_millis(500),
        ..Default::default()
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
        assert!(
            text.contains(n),
            "{what}: expected to find {n:?} in:\n----\n{text}\n----"
        );
    }
}

fn scenario(name: &str) {
    use lockstep::cuda::init::{check_fork_safe, init_record, probe_child};
    match name {
        "guard_records_location" => {
            assert!(check_fork_safe().is_ok(), "nothing loaded yet");
            let report = lockstep::report::env_report();
            expect_contains(
                "env_report",
                &report,
                &[
                    "libcuda.so.1",
                    "12040 (CUDA 12.4)",
                    "initialised in this process: no",
                ],
            );
            assert!(
                check_fork_safe().is_ok(),
                "loaded but not initialised must be fork-safe"
            );
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
            let launch_err =
                lockstep::launch::launch(&lockstep::launch::LaunchConfig::new(2), |_ctx| Ok(0u64))
                    .unwrap_err()
                    .to_string();
            expect_contains(
                "launch",
                &launch_err,
                &["CUDA was already initialised", "init_cuda_from_here"],
            );
            expect_contains(
                "probe_child",
                &probe_child().unwrap_err(),
                &["already initialised"],
            );
            expect_contains(
                "env_report",
                &lockstep::report::env_report(),
                &["initialised in this process: yes, by lockstep"],
            );
        }
        "foreign_init_refused" => {
            let path = std::env::var("LOCKSTEP_CUDA_LIBRARY").unwrap();
            // SAFETY: the fake has no initialisers.
            let lib = unsafe { libloading::Library::new(&path) }.unwrap();
            assert!(
                check_fork_safe().is_ok(),
                "mapped but not initialised must be fork-safe"
            );
            // Initialise behind lockstep's back, as a foreign library would.
            // SAFETY: cuInit(unsigned) of the fake.
            let rc = unsafe {
                lib.get::<unsafe extern "C" fn(u32) -> i32>(b"cuInit\0")
                    .unwrap()(0)
            };
            assert_eq!(rc, 0);
            let err = check_fork_safe().unwrap_err();
            expect_contains(
                "check_fork_safe",
                &err,
                &[
                    "outside lockstep",
                    "libcuda.so.1",
                    "cuDeviceGetCount succeeds",
                    "move all CUDA work into the rank function",
                ],
            );
            assert!(init_record().is_none());
            let launch_err =
                lockstep::launch::launch(&lockstep::launch::LaunchConfig::new(1), |_ctx| Ok(0u64))
                    .unwrap_err()
                    .to_string();
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
            assert!(
                libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0,
                "child guard checks failed (status {st})"
            );
            assert!(
                check_fork_safe().is_ok(),
                "the child's cuInit must not mark the parent"
            );
            assert!(init_record().is_none());
            // Parent initialises now; a child forked afterwards does not inherit lockstep's record
            // (pid differs) but still sees the inherited driver state as foreign.
            lockstep::cuda::init::ensure_init().unwrap();
            // SAFETY: as above.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                let ok = init_record().is_none()
                    && check_fork_safe().map_err(|e| e.contains("outside lockstep")) == Err(true);
                // SAFETY: as above.
                unsafe { libc::_exit(if ok { 0 } else { 1 }) };
            }
            // SAFETY: our child.
            unsafe { libc::waitpid(pid, &mut st, 0) };
            assert!(
                libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0,
                "post-init child checks failed (status {st})"
            );
        }
        "probe_child_reports" => {
            let s = probe_child().expect("probe");
            expect_contains(
                "probe_child",
                &s,
                &["2 device(s)", "CUDA 12.4", "libcuda.so.1"],
            );
            assert!(
                check_fork_safe().is_ok(),
                "the probe must leave the parent uninitialised"
            );
            assert_eq!(fake_init_calls(), 0);
        }
        "sim_gpus_pick_defaults" => {
            // Three simulated GPUs: the forked probe counts them, this process stays uninitialised,
            // and `lockstep config` / `launch --nproc-per-node auto --backend auto` follow them.
            assert_eq!(lockstep::config::count_gpus(), Ok(3));
            assert!(
                check_fork_safe().is_ok(),
                "counting GPUs must leave the parent uninitialised"
            );
            let bin = bins::lockstep_bin();
            let dir =
                std::env::temp_dir().join(format!("lockstep-sim-gpus-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            let path = dir.join("config.toml");
            let o = std::process::Command::new(bin)
                .env("XDG_CONFIG_HOME", &dir)
                .args(["config", "--path"])
                .arg(&path)
                .output()
                .unwrap();
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            assert!(o.status.success(), "{o:?}");
            for want in [
                "num_processes = 3",
                "backend = \"nccl\"",
                "mixed_precision = \"bf16\"",
            ] {
                assert!(
                    text.contains(want),
                    "with 3 GPUs the default config has {want}:\n{text}"
                );
            }
            let o = std::process::Command::new(bin)
                .env("XDG_CONFIG_HOME", &dir)
                .env_remove("LOCKSTEP_BACKEND")
                .args([
                    "launch",
                    "--nproc-per-node",
                    "auto",
                    "--backend",
                    "auto",
                    "--",
                    "sh",
                    "-c",
                    "echo $WORLD_SIZE $LOCKSTEP_BACKEND",
                ])
                .output()
                .unwrap();
            let mut lines: Vec<String> = String::from_utf8_lossy(&o.stdout)
                .lines()
                .map(String::from)
                .collect();
            lines.sort();
            assert_eq!(
                lines,
                ["[rank 0] 3 nccl", "[rank 1] 3 nccl", "[rank 2] 3 nccl"],
                "{o:?}"
            );
            let _ = std::fs::remove_dir_all(&dir);
        }
        "missing_override" => {
            let e = lockstep::cuda::device_count().unwrap_err().to_string();
            expect_contains(
                "device_count",
                &e,
                &[
                    "CUDA driver library (libcuda) not found",
                    "/nonexistent/libcuda.so.1",
                    "LOCKSTEP_CUDA_LIBRARY",
                ],
            );
            let e = lockstep::cuda::Context::new(0).unwrap_err().to_string();
            expect_contains("Context::new", &e, &["not found"]);
            assert!(check_fork_safe().is_ok());
            expect_contains(
                "env_report",
                &lockstep::report::env_report(),
                &["driver : not found", "/nonexistent/libcuda.so.1"],
            );
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
            expect_contains(
                "device_count",
                &e,
                &["no symbol `cuDriverGetVersion`", "LOCKSTEP_CUDA_LIBRARY"],
            );
        }
        "driver_symbols_missing_is_error" => {
            // The fake exports only the probe calls: the safe layer must fail cleanly, not panic.
            let e = lockstep::cuda::Context::new(0).unwrap_err().to_string();
            expect_contains(
                "Context::new",
                &e,
                &["has no symbol `cuDeviceGet`", "libcuda.so.1"],
            );
            let e = lockstep::cuda::Context::new(5).unwrap_err().to_string();
            expect_contains(
                "Context::new(5)",
                &e,
                &["ordinal 5 out of range", "2 device(s)"],
            );
        }
        "fake_nccl" => {
            assert_eq!(lockstep::nccl::version().unwrap(), 21803);
            let id = lockstep::nccl::unique_id().unwrap();
            assert_eq!(id[1], 4);
            let e = lockstep::nccl::check_library().unwrap_err().to_string();
            expect_contains(
                "check_library",
                &e,
                &["has no symbol `ncclCommInitRank`", "LOCKSTEP_NCCL_LIBRARY"],
            );
            expect_contains(
                "env_report",
                &lockstep::report::env_report(),
                &[
                    "libnccl.so.2",
                    "ncclGetVersion = 21803 (2.18.3)",
                    "incomplete",
                ],
            );
        }
        "old_nccl_rejected" => {
            let e = lockstep::nccl::version().unwrap_err().to_string();
            expect_contains(
                "nccl::version",
                &e,
                &["older than 2.18", "LOCKSTEP_NCCL_LIBRARY"],
            );
        }
        "missing_nccl_and_nvrtc" => {
            let e = lockstep::nccl::version().unwrap_err().to_string();
            expect_contains(
                "nccl::version",
                &e,
                &[
                    "NCCL library (libnccl) not found",
                    "/nonexistent/libnccl.so.2",
                    "LOCKSTEP_NCCL_LIBRARY",
                ],
            );
            let e = lockstep::cuda::compile_ptx(KernelId::Elementwise.source(), "compute_80")
                .unwrap_err()
                .to_string();
            expect_contains(
                "compile_ptx",
                &e,
                &[
                    "NVRTC library (libnvrtc) not found",
                    "LOCKSTEP_NVRTC_LIBRARY",
                    "nvidia-cuda-nvrtc",
                ],
            );
        }
        "debug_probe" => {
            // LOCKSTEP_DEBUG=1: the fork check also forks a probe child that reports through
            // tracing; this process shows it on stderr the way the binaries do.
            tracing_subscriber::fmt()
                .with_writer(std::io::stderr)
                .without_time()
                .init();
            check_fork_safe().expect("fork-safe");
            assert!(init_record().is_none());
            assert_eq!(fake_init_calls(), 0);
        }
        "sim_memory_kernels_events" => sim_memory_kernels_events(),
        "sim_bench_device" => {
            // `lockstep bench --device cuda`, end to end on the simulator: NCCL at 1 rank, the staged
            // shared-memory backend when 2 ranks share the one simulated GPU; every result verified.
            for (nprocs, op) in [
                (1, "all_reduce"),
                (2, "all_reduce"),
                (2, "all_gather"),
                (2, "broadcast"),
            ] {
                let n = nprocs.to_string();
                let o = Command::new(bins::lockstep_bin())
                    .args([
                        "bench",
                        "--device",
                        "cuda",
                        "--nprocs",
                        &n,
                        "--op",
                        op,
                        "--sizes",
                        "8,4096,1M",
                        "-n",
                        "3",
                        "-w",
                        "1",
                    ])
                    .args(["--format", "json"])
                    .output()
                    .unwrap();
                let text = String::from_utf8_lossy(&o.stdout);
                assert!(o.status.success(), "{op} on {nprocs} ranks: {o:?}");
                let v: serde_json::Value = serde_json::from_str(&text)
                    .unwrap_or_else(|e| panic!("{op} on {nprocs} ranks: not JSON ({e}): {text}"));
                let rows = v["rows"].as_array().cloned().unwrap_or_default();
                assert_eq!(rows.len(), 3, "{op} on {nprocs} ranks: {v}");
                let ok = |t: &serde_json::Value| {
                    t["wrong"] == 0 && t["time_us"].as_f64().is_some_and(|x| x > 0.0)
                };
                assert!(
                    rows.iter()
                        .all(|r| ok(&r["out_of_place"]) && ok(&r["in_place"])),
                    "{op} on {nprocs} ranks: {v}"
                );
                // The mean on device buffers is timed as nccl-tests times it: one batch, so no
                // per-call percentile.
                assert!(
                    rows.iter().all(|r| r["out_of_place"]["p99_us"].is_null()),
                    "{op} on {nprocs} ranks: {v}"
                );
                // Each rank names the backend it ran: NCCL alone, staged when sharing the GPU.
                let want = if nprocs == 1 {
                    "backend nccl"
                } else {
                    "backend staged"
                };
                let ranks = v["rank_info"].as_array().cloned().unwrap_or_default();
                assert!(
                    ranks.len() == nprocs
                        && ranks
                            .iter()
                            .all(|r| r["device"].as_str().is_some_and(|d| d.ends_with(want))),
                    "{op} on {nprocs} ranks, want {want:?}: {v}"
                );
            }
        }
        "sim_device_engine_host_side" => sim_device_engine_host_side(),
        "sim_drop_error_is_deferred" => {
            let ctx = lockstep::cuda::Context::new(0).unwrap();
            let s = ctx.stream().unwrap();
            drop(lockstep::cuda::DeviceBuffer::<f32>::zeros(&s, 8).unwrap());
            let e = ctx.check().unwrap_err().to_string();
            expect_contains(
                "deferred",
                &e,
                &[
                    "an earlier release of a device buffer of 8 f32 elements failed",
                    "cuMemFree",
                    "CUDA_ERROR_INVALID_VALUE",
                ],
            );
            assert!(ctx.check().is_ok(), "reported once");
        }
        "sim_nccl_collectives" => {
            let (ctx, comm) = sim_nccl_comm(1, Default::default());
            let mut nc = comm.expect("NCCL init through the simulator");
            let s = ctx.stream().unwrap();
            let a = lockstep::cuda::DeviceBuffer::from_host(&s, &[1i32, 2, 3]).unwrap();
            let mut b = lockstep::cuda::DeviceBuffer::<i32>::zeros(&s, 3).unwrap();
            nc.group(|c| {
                c.send(&a, 0)?;
                c.recv(&mut b, 0)
            })
            .unwrap();
            nc.wait("send/recv").unwrap();
            assert_eq!(b.to_vec(&s).unwrap(), vec![1, 2, 3]);
            let e = nc.send(&a, 3).unwrap_err().to_string();
            expect_contains(
                "send to peer 3",
                &e,
                &["peer 3 out of range for world size 1"],
            );
            // NCCL has no receive from any source: refused, saying what to do instead.
            let mut any = [lockstep::comm::P2pOp {
                kind: lockstep::comm::CollKind::Recv,
                peer: lockstep::comm::ANY_SOURCE,
                dtype: lockstep::comm::Dtype::I32,
                mem: lockstep::comm::BufferMut::raw_mut(&mut b),
            }];
            match lockstep::comm::Backend::p2p(&mut nc, &mut any) {
                Err(e @ lockstep::CommError::Unsupported(_)) => expect_contains(
                    "recv from any source",
                    &e.to_string(),
                    &[
                        "nccl backend has no receive from any source",
                        "name the sending rank",
                    ],
                ),
                other => panic!("recv from any source on NCCL: {other:?}"),
            }
            let mut comm = nc.into_communicator();
            let (h, mut hr) = (vec![1f32; 4], vec![0f32; 4]);
            let e = comm
                .all_reduce(&h, &mut hr, lockstep::comm::ReduceOp::Sum)
                .unwrap_err()
                .to_string();
            expect_contains(
                "host buffers",
                &e,
                &["host memory", "device memory only", "DeviceBuffer"],
            );
            // A collective orders itself after the context's other streams: `s` (which wrote the
            // buffers) and `s2` each get an event the communicator's stream waits on, so callers
            // need not synchronise their producer streams first.
            let s2 = ctx.stream().unwrap();
            let d = lockstep::cuda::DeviceBuffer::from_host(&s, &[1f32, 2.0]).unwrap();
            let mut r = lockstep::cuda::DeviceBuffer::<f32>::zeros(&s2, 2).unwrap();
            let waits = counter("LOCKSTEP_CUDA_LIBRARY", "sim_stream_waits");
            comm.all_reduce(&d, &mut r, lockstep::comm::ReduceOp::Sum)
                .unwrap();
            let added = counter("LOCKSTEP_CUDA_LIBRARY", "sim_stream_waits") - waits;
            assert!(
                added >= 2,
                "the collective waited on {added} producer streams, expected at least 2 (s and s2)"
            );
            let w = comm.start(|x| x.all_reduce(&d, &mut r, lockstep::comm::ReduceOp::Sum));
            assert!(w.is_completed(), "the simulated stream is done at once");
            w.wait().unwrap();
            drop(s2);
            collectives::check_all_dtypes_world1(&mut comm, &s).unwrap();
            drop(comm);
            assert_eq!(counter("LOCKSTEP_NCCL_LIBRARY", "sim_destroy_calls"), 1);
            assert_eq!(counter("LOCKSTEP_NCCL_LIBRARY", "sim_abort_calls"), 0);
            assert!(ctx.check().is_ok());
        }
        "sim_nccl_stream_ordered" => sim_nccl_stream_ordered(),
        "sim_nccl_split" => sim_nccl_split(),
        "sim_nccl_split_missing" => {
            let (_ctx, comm) = sim_nccl_comm(1, Default::default());
            let mut comm = comm.unwrap().into_communicator();
            match comm.split(Some(0), 0) {
                Err(e @ lockstep::CommError::Unsupported(_)) => expect_contains(
                    "split without ncclCommSplit",
                    &e.to_string(),
                    &["ncclCommSplit", "2.18", "LOCKSTEP_NCCL_LIBRARY"],
                ),
                other => panic!(
                    "split without ncclCommSplit: {:?}",
                    other.map(|c| c.is_some())
                ),
            }
            comm.barrier().unwrap();
        }
        "sim_staged_split" => sim_staged_split(),
        "sim_nccl_peer_never_joins" => {
            let (_ctx, comm) = sim_nccl_comm(2, short_timeout());
            let e = comm.err().expect("init must fail").to_string();
            expect_contains(
                "init",
                &e,
                &[
                    "ncclCommInitRank(rank=0, nranks=2",
                    "did not finish within 0.5 s",
                    "aborted",
                ],
            );
            assert_eq!(counter("LOCKSTEP_NCCL_LIBRARY", "sim_abort_calls"), 1);
        }
        "sim_nccl_async_error_aborts" => {
            let (_ctx, mut comm, _s, mut x) = one_rank_sim_nccl(short_timeout());
            comm.all_reduce_in_place(&mut x, lockstep::comm::ReduceOp::Sum)
                .unwrap();
            let e = comm.synchronize().unwrap_err().to_string();
            expect_contains("synchronize", &e, &["remote process exited", "(async)"]);
            assert_eq!(counter("LOCKSTEP_NCCL_LIBRARY", "sim_abort_calls"), 1);
            let e = comm
                .all_reduce_in_place(&mut x, lockstep::comm::ReduceOp::Sum)
                .unwrap_err()
                .to_string();
            expect_contains("after abort", &e, &["aborted earlier"]);
            drop(comm);
            assert_eq!(
                counter("LOCKSTEP_NCCL_LIBRARY", "sim_destroy_calls"),
                0,
                "an aborted communicator is not destroyed again"
            );
        }
        "sim_nccl_timeout_aborts" => {
            let (_ctx, mut comm, _s, mut x) = one_rank_sim_nccl(short_timeout());
            comm.all_reduce_in_place(&mut x, lockstep::comm::ReduceOp::Max)
                .unwrap();
            let e = comm.synchronize().unwrap_err().to_string();
            expect_contains(
                "synchronize",
                &e,
                &[
                    "did not finish within 0.5 s",
                    "aborted",
                    "LOCKSTEP_TIMEOUT_S",
                ],
            );
            assert_eq!(counter("LOCKSTEP_NCCL_LIBRARY", "sim_abort_calls"), 1);
            let e = comm.barrier().unwrap_err().to_string();
            expect_contains("barrier after abort", &e, &["aborted earlier"]);
        }
        "sim_nccl_work_times_out" => {
            // A nonblocking call on a stuck stream: its Work stays pending, then times out with
            // the communicator's timeout and aborts it; later calls say so.
            let (_ctx, mut comm, _s, mut x) = one_rank_sim_nccl(short_timeout());
            let t = std::time::Instant::now();
            let w = comm.start(|c| c.all_reduce_in_place(&mut x, lockstep::comm::ReduceOp::Sum));
            assert!(!w.is_completed(), "a call on a stuck stream is pending");
            let e = w.wait().unwrap_err().to_string();
            expect_contains(
                "Work::wait",
                &e,
                &["did not finish within 0.5 s", "aborted"],
            );
            assert!(
                t.elapsed() < std::time::Duration::from_secs(3),
                "the Work waited {:?}",
                t.elapsed()
            );
            assert_eq!(counter("LOCKSTEP_NCCL_LIBRARY", "sim_abort_calls"), 1);
            let e = comm.barrier().unwrap_err().to_string();
            expect_contains("barrier after a Work's abort", &e, &["aborted earlier"]);
        }
        "sim_nccl_liveness_check_aborts" => {
            let check: lockstep::nccl::AbortCheck =
                Arc::new(|| Some("rank 1 (pid 4242) died".to_string()));
            let opts = lockstep::nccl::NcclOptions {
                abort_check: Some(check),
                ..Default::default()
            };
            let (_ctx, mut comm, _s, mut x) = one_rank_sim_nccl(opts);
            comm.all_reduce_in_place(&mut x, lockstep::comm::ReduceOp::Sum)
                .unwrap();
            let e = comm.synchronize().unwrap_err().to_string();
            expect_contains("synchronize", &e, &["rank 1 (pid 4242) died", "aborted"]);
        }
        "sim_staged_ranks_share_a_gpu" => sim_staged(),
        "unique_id_exchange_over_shm" => {
            use lockstep::nccl::UniqueIdExchange;
            // Three ranks: rank 0's id reaches everyone through the launcher's communicator.
            let ids =
                lockstep::launch::launch(&lockstep::launch::LaunchConfig::new(3), |mut rc| {
                    let mine: [u8; 128] = std::array::from_fn(|i| (i * 7 + 3) as u8);
                    let got = rc
                        .comm
                        .exchange(rc.rank, if rc.rank == 0 { Some(&mine) } else { None })?;
                    Ok(got == mine)
                })
                .unwrap();
            assert_eq!(ids, vec![true; 3]);
            // One rank, end to end: the simulated NCCL initialises with the id from the exchange.
            let ok = lockstep::launch::launch(&lockstep::launch::LaunchConfig::new(1), |mut rc| {
                let ctx = lockstep::cuda::Context::new(0)?;
                let nc = lockstep::nccl::NcclComm::new(
                    &ctx,
                    rc.rank,
                    rc.world_size,
                    &mut rc.comm,
                    Default::default(),
                )?;
                let mut comm = nc.into_communicator();
                comm.barrier()?;
                Ok(true)
            })
            .unwrap();
            assert_eq!(ok, vec![true]);
        }
        "nccl_env_rank" => {
            // One rank of the multi-node job below, started by `lockstep launch`.
            let comm =
                lockstep::Communicator::from_env().unwrap_or_else(|e| panic!("from_env: {e}"));
            assert_eq!(comm.backend_kind(), lockstep::comm::BackendKind::Nccl);
            assert_eq!(comm.world_size(), 4);
            let ctx = comm
                .device_context()
                .expect("an NCCL communicator has a device");
            // What train-cnn --device cuda does with it: 4 ranks on 2-GPU nodes keep their NCCL
            // communicator (the policy once compared the GPUs with the global 4 and staged it).
            let (mut comm, kept) = lockstep::rendezvous::device_communicator(comm, 0)
                .unwrap_or_else(|e| panic!("device_communicator: {e}"));
            assert!(
                std::sync::Arc::ptr_eq(&ctx, &kept),
                "the communicator's own context"
            );
            assert_eq!(
                (comm.backend_kind(), comm.world_size()),
                (lockstep::comm::BackendKind::Nccl, 4)
            );
            let s = ctx.stream().unwrap();
            let mut x = lockstep::cuda::DeviceBuffer::<f32>::zeros(&s, 4).unwrap();
            comm.all_reduce_in_place(&mut x, lockstep::comm::ReduceOp::Sum)
                .unwrap();
            comm.barrier().unwrap();
            comm.synchronize().unwrap();
            println!("rank {} nccl ok on device {}", comm.rank(), ctx.ordinal());
        }
        "nccl_across_nodes_via_store" => nccl_across_nodes_via_store(),
        "staged_refusal_fails_peers_fast" => staged_refusal_fails_peers_fast(),
        "device_shrink_and_grow" => device_shrink_and_grow(),
        "nccl_job_status" => nccl_job_status(),
        "nccl_job_status_rank" => nccl_job_status_rank(),
        "nccl_job_status_across_nodes" => nccl_job_status_across_nodes(),
        "device_shrink_and_grow_rank" => device_shrink_and_grow_rank(),
        "one_selection_policy" => one_selection_policy(),
        "nccl_multi_rank_gpu" => {
            // Two ranks, one GPU, NCCL_MULTI_RANK_GPU_ENABLE=1: NCCL's multi-rank mode when the
            // loaded NCCL is 2.30 or newer, staging through shared memory otherwise.
            std::fs::create_dir_all(std::env::var("SIM_NCCL_RDZV_DIR").unwrap()).unwrap();
            let new_enough =
                std::env::var("SIM_NCCL_VERSION").is_ok_and(|v| v.parse::<i32>().unwrap() >= 23000);
            let kinds = lockstep::launch::launch(&lockstep::launch::LaunchConfig::new(2), |rc| {
                let (mut comm, ctx) =
                    lockstep::rendezvous::device_communicator(rc.comm, rc.local_rank)?;
                let s = ctx.stream()?;
                let mut x = lockstep::cuda::DeviceBuffer::<f32>::zeros(&s, 8)?;
                comm.all_reduce_in_place(&mut x, lockstep::comm::ReduceOp::Sum)?;
                comm.synchronize()?;
                Ok(comm.backend_kind() == lockstep::comm::BackendKind::Nccl)
            })
            .unwrap();
            assert_eq!(
                kinds,
                vec![new_enough; 2],
                "NCCL multi-rank mode used (per rank)"
            );
        }
        "nvrtc_compile_goes_through_guard" => {
            // NVRTC 12.x dlopens libcuda.so.1 and calls cuInit while compiling: lockstep routes that
            // through the guard so the fork check can say where it happened.
            match lockstep::cuda::compile_ptx(KernelId::Elementwise.source(), "compute_80") {
                Ok(_) => {}
                Err(e) if e.to_string().contains("NVRTC library (libnvrtc) not found") => {
                    println!("(no NVRTC library: nothing to check)");
                    return;
                }
                Err(e) => panic!("{e}"),
            }
            assert!(
                init_record().is_some(),
                "compiling must initialise through the guard"
            );
            let e = check_fork_safe().unwrap_err();
            expect_contains(
                "check_fork_safe after compile",
                &e,
                &["by lockstep", "compile_ptx"],
            );
        }
        other => panic!("unknown scenario {other}"),
    }
}

/// Two launchers on loopback posing as two hosts (`LOCKSTEP_HOST_ID`), `LOCKSTEP_BACKEND=nccl`:
/// rank 0's NCCL unique id reaches the other node's ranks through the rendezvous store (the
/// simulated NCCL only finishes initialising when all four ranks present the same id), and a node
/// with more ranks than GPUs is refused with a message that says so.
/// A device job survives a death: `lockstep launch --nproc-per-node 3 --max-restarts 1
/// --restart-policy rank` of `device_shrink_and_grow_rank` with `LOCKSTEP_BACKEND=nccl`, once
/// with a simulated GPU per rank (NCCL, the simulated library's ranks meeting in
/// `SIM_NCCL_RDZV_DIR`, where a collective completes only when every rank made it) and once with
/// one GPU for all (staged through shared memory). Rank 1 is `kill -9`ed after 5 collectives;
/// the survivors' next call fails naming it, they shrink to 2 ranks and run on, then grow back to
/// 3 with the replacement the launcher starts, which joins through its ordinary `from_env`.
fn device_shrink_and_grow() {
    let rdzv = std::env::temp_dir().join(format!("lockstep-sim-shrink-{}", std::process::id()));
    for (gpus, kind) in [("3", "Nccl"), ("1", "Staged")] {
        std::fs::create_dir_all(&rdzv).unwrap();
        let t = std::time::Instant::now();
        let out = Command::new(bins::lockstep_bin())
            .args(["launch", "--nproc-per-node", "3", "--max-restarts", "1"])
            .args(["--restart-policy", "rank", "--"])
            .arg(std::env::current_exe().unwrap())
            .env("LOCKSTEP_FAKE_SCENARIO", "device_shrink_and_grow_rank")
            .env("LOCKSTEP_BACKEND", "nccl")
            .env("LOCKSTEP_TIMEOUT_S", "30")
            .env("LOCKSTEP_JOIN_TIMEOUT_S", "30")
            .env("SIM_NCCL_RDZV_DIR", &rdzv)
            .env("SIM_CUDA_DEVICES", gpus)
            .env("DEVICE_SHRINK_EXPECT", kind)
            .output()
            .unwrap();
        let text = format!(
            "{:?}\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{kind}: {text}");
        for line in [
            "rank 0 lost rank 1",
            "rank 2 lost rank 1",
            "rank 0 shrunk to 0 of 2 (global [0, 2])",
            "rank 2 shrunk to 1 of 2 (global [0, 2])",
            "rank 0 grown to 0 of 3",
            "rank 2 grown to 2 of 3",
            "rank 1 replacement joined 1 of 3",
        ] {
            assert!(text.contains(line), "{kind}: expected `{line}` in:\n{text}");
        }
        println!(
            "{kind}: kill, shrink, grow in {:.2} s",
            t.elapsed().as_secs_f64()
        );
        let _ = std::fs::remove_dir_all(&rdzv);
    }
}

/// `lockstep status` of an NCCL job: 3 ranks on 3 simulated GPUs (`lockstep launch`,
/// `LOCKSTEP_BACKEND=nccl`) reduce in a loop until rank 1 stops itself (SIGSTOP) after call 40.
/// The status, read from the host communicator's segment where each rank shows the call NCCL
/// carries, names rank 1 behind at #40 and ranks 0 and 2 waiting for it in all_reduce #41 (the
/// simulated NCCL completes a call only once every rank made it), within the reader's bound.
fn nccl_job_status() {
    let rdzv = std::env::temp_dir().join(format!("lockstep-sim-status-{}", std::process::id()));
    std::fs::create_dir_all(&rdzv).unwrap();
    let mut job = Command::new(bins::lockstep_bin())
        .args(["launch", "--nproc-per-node", "3", "--"])
        .arg(std::env::current_exe().unwrap())
        .env("LOCKSTEP_FAKE_SCENARIO", "nccl_job_status_rank")
        .env("LOCKSTEP_BACKEND", "nccl")
        .env("LOCKSTEP_TIMEOUT_S", "60")
        .env("SIM_NCCL_RDZV_DIR", &rdzv)
        .env("SIM_CUDA_DEVICES", "3")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let prefix = format!("{:x}-", job.id());
    let t = std::time::Instant::now();
    let mut last = String::new();
    let mut settled = None;
    while t.elapsed() < Duration::from_secs(30) {
        let id = lockstep::status::list_jobs()
            .ok()
            .and_then(|l| l.jobs.into_iter().find(|j| j.id.starts_with(&prefix)))
            .map(|j| j.id);
        if let Some(s) = id.and_then(|id| lockstep::status::job_status(&id).ok()) {
            last = s.text();
            let r = &s.ranks;
            if r.len() == 3
                && r[1].proc_state == Some('T')
                && r[0].waiting_for == [1]
                && r[2].waiting_for == [1]
            {
                settled = Some(s);
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // End the job: the launcher terminates its ranks (the stopped one by SIGKILL after the grace).
    let _ = Command::new("kill")
        .args(["-TERM", &job.id().to_string()])
        .status();
    let _ = job.wait();
    let _ = std::fs::remove_dir_all(&rdzv);
    let s = settled.unwrap_or_else(|| {
        panic!("ranks 0 and 2 never showed waiting for the stopped rank 1:\n{last}")
    });
    let text = s.text();
    let r = &s.ranks;
    assert!(r[1].behind && !r[0].behind && !r[2].behind, "{text}");
    assert_eq!((r[1].seq, r[0].seq, r[2].seq), (40, 41, 41), "{text}");
    assert!(
        r.iter().all(|x| x.op.as_deref() == Some("all_reduce")
            && x.count == Some(256)
            && x.dtype.as_deref() == Some("f32")),
        "{text}"
    );
    assert!(s.read_us < 100_000, "{text}");
    println!("{text}");
}

/// `lockstep status` of an NCCL job across nodes: two launchers on loopback posing as two hosts
/// (`LOCKSTEP_HOST_ID`), two ranks each on two simulated GPUs, reduce in a loop until rank 3, on
/// the second node, stops itself after call 40. Asked through either node's segment, the status
/// comes back for the whole job through the store, each launcher answering for its node: four
/// ranks numbered as in the job, rank 3 behind at #40 and stopped, ranks 0 to 2 waiting for it in
/// all_reduce #41 (the ranks of the first node across nodes), both nodes named, within the
/// reader's bound.
fn nccl_job_status_across_nodes() {
    let rdzv =
        std::env::temp_dir().join(format!("lockstep-sim-status-nodes-{}", std::process::id()));
    std::fs::create_dir_all(&rdzv).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let mut nodes: Vec<std::process::Child> = (0..2)
        .map(|node| {
            node_launcher(node, 2, &port, &rdzv, "nccl_job_status_rank")
                .env("STATUS_STOP_RANK", "3")
                .env("LOCKSTEP_TIMEOUT_S", "60")
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    let prefix = format!("{:x}-", nodes[0].id());
    let t = std::time::Instant::now();
    let mut last = String::new();
    let mut settled = Vec::new();
    'poll: while t.elapsed() < Duration::from_secs(30) {
        let ids: Vec<String> = lockstep::status::list_jobs()
            .map(|l| {
                l.jobs
                    .into_iter()
                    .map(|j| j.id)
                    .filter(|id| id.starts_with(&prefix))
                    .collect()
            })
            .unwrap_or_default();
        let mut ids = ids;
        ids.sort();
        if ids.len() == 2 {
            settled.clear();
            for id in &ids {
                let Ok(s) = lockstep::status::job_status(id) else {
                    continue 'poll;
                };
                last = s.text();
                let r = &s.ranks;
                let done = r.len() == 4
                    && r[3].proc_state == Some('T')
                    && (0..3).all(|k| r[k].waiting_for.contains(&3));
                if !done {
                    std::thread::sleep(Duration::from_millis(20));
                    continue 'poll;
                }
                settled.push((id.clone(), s));
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for n in &nodes {
        let _ = Command::new("kill")
            .args(["-TERM", &n.id().to_string()])
            .status();
    }
    for n in &mut nodes {
        let _ = n.wait();
    }
    let _ = std::fs::remove_dir_all(&rdzv);
    assert_eq!(
        settled.len(),
        2,
        "the status never showed rank 3 stopped and the others waiting for it:\n{last}"
    );
    // Asked through node 0's segment, then node 1's: the same job.
    assert!(
        settled[0].0.ends_with(".h0") && settled[1].0.ends_with(".h1"),
        "{:?}",
        settled.iter().map(|s| &s.0).collect::<Vec<_>>()
    );
    for (id, s) in &settled {
        let text = s.text();
        let r = &s.ranks;
        assert_eq!(
            s.job.id,
            id.strip_suffix(&id[id.len() - 3..]).unwrap(),
            "{text}"
        );
        assert_eq!((s.job.world, s.job.joined), (4, 4), "{text}");
        assert_eq!(
            r.iter().map(|x| x.rank).collect::<Vec<_>>(),
            [0, 1, 2, 3],
            "{text}"
        );
        assert_eq!(
            r.iter().map(|x| x.host.as_str()).collect::<Vec<_>>(),
            ["host-0", "host-0", "host-1", "host-1"],
            "{text}"
        );
        assert!(
            r[3].behind && !r[0].behind && !r[1].behind && !r[2].behind,
            "{text}"
        );
        assert_eq!(
            (r[0].seq, r[1].seq, r[2].seq, r[3].seq),
            (41, 41, 41, 40),
            "{text}"
        );
        assert!(r[3].waiting_for.is_empty(), "{text}");
        assert!(
            r.iter()
                .all(|x| x.op.as_deref() == Some("all_reduce") && x.count == Some(256)),
            "{text}"
        );
        assert_eq!(s.nodes.len(), 2, "{text}");
        assert!(s.nodes.iter().all(|n| n.error.is_none()), "{text}");
        assert_eq!(
            (s.nodes[0].ranks.clone(), s.nodes[1].ranks.clone()),
            (vec![0, 1], vec![2, 3]),
            "{text}"
        );
        assert!(
            s.summary
                .iter()
                .any(|l| l.contains("rank 3 (pid") && l.ends_with("behind")),
            "{text}"
        );
        assert!(s.read_us < 100_000, "{text}");
        println!("{text}");
    }
}

/// One rank of [`nccl_job_status`] and [`nccl_job_status_across_nodes`]: rank
/// `STATUS_STOP_RANK` (default 1) stops itself after call 40.
fn nccl_job_status_rank() {
    use lockstep::comm::ReduceOp;
    let mut comm = lockstep::Communicator::from_env().unwrap_or_else(|e| panic!("from_env: {e}"));
    assert_eq!(comm.backend_kind(), lockstep::comm::BackendKind::Nccl);
    let ctx = comm.device_context().expect("a device communicator");
    let s = ctx.stream().unwrap();
    let mut x = lockstep::cuda::DeviceBuffer::<f32>::zeros(&s, 256).unwrap();
    let stop_rank: usize = std::env::var("STATUS_STOP_RANK").map_or(1, |v| v.parse().unwrap());
    let t = std::time::Instant::now();
    for i in 1u64.. {
        comm.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap();
        comm.synchronize().unwrap();
        if i == 40 && comm.rank() == stop_rank {
            let _ = Command::new("kill")
                .args(["-STOP", &std::process::id().to_string()])
                .status();
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the test never ended this job"
        );
    }
}

/// One rank of [`device_shrink_and_grow`].
fn device_shrink_and_grow_rank() {
    use lockstep::comm::ReduceOp;
    use lockstep::cuda::DeviceBuffer;
    use lockstep::CommError;
    let want = std::env::var("DEVICE_SHRINK_EXPECT").unwrap();
    let mut comm = lockstep::Communicator::from_env().unwrap_or_else(|e| panic!("from_env: {e}"));
    let (rank, world) = (comm.rank(), comm.world_size());
    assert_eq!(format!("{:?}", comm.backend_kind()), want, "rank {rank}");
    assert_eq!(world, 3);
    let ctx = comm.device_context().expect("a device communicator");
    let s = ctx.stream().unwrap();
    // Every rank contributes rank + 1: a sum over the ranks in use says who took part (the
    // simulated NCCL only copies, so there the value is this rank's own).
    let sum_over = |comm: &mut lockstep::Communicator, ranks: &[usize]| -> Result<(), CommError> {
        let me = comm.global_rank() as f32 + 1.0;
        let mut x = DeviceBuffer::from_host(&s, &[me; 4]).unwrap();
        s.synchronize().unwrap();
        comm.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
        comm.synchronize()?;
        let got = x.to_vec(&s).unwrap();
        let all: f32 = ranks.iter().map(|r| *r as f32 + 1.0).sum();
        let ok = if want == "Staged" { all } else { me };
        assert_eq!(got, vec![ok; 4], "rank {rank} over {ranks:?}");
        Ok(())
    };
    if std::env::var("LOCKSTEP_REPLACEMENT").as_deref() == Ok("1") {
        println!(
            "rank {rank} replacement joined {} of {}",
            comm.rank(),
            comm.world_size()
        );
        for _ in 0..20 {
            sum_over(&mut comm, &[0, 1, 2]).unwrap();
        }
        return;
    }
    for _ in 0..5 {
        sum_over(&mut comm, &[0, 1, 2]).unwrap();
    }
    if rank == 1 {
        let _ = Command::new("kill")
            .args(["-9", &std::process::id().to_string()])
            .status();
        std::thread::sleep(Duration::from_secs(60));
        unreachable!("kill -9 of this rank");
    }
    let t = std::time::Instant::now();
    let e = (0..1000)
        .find_map(|_| sum_over(&mut comm, &[0, 1, 2]).err())
        .expect("a call fails once rank 1 is gone");
    match &e {
        CommError::PeerLost { lost_rank: 1, .. } => {}
        other => panic!("rank {rank}: expected PeerLost naming rank 1, got {other}"),
    }
    println!(
        "rank {rank} lost rank 1 in {:.3} s: {e}",
        t.elapsed().as_secs_f64()
    );
    let mut small = comm
        .shrink()
        .unwrap_or_else(|e| panic!("rank {rank} shrink: {e}"));
    assert_eq!(format!("{:?}", small.backend_kind()), want);
    println!(
        "rank {rank} shrunk to {} of {} (global {:?})",
        small.rank(),
        small.world_size(),
        small.global_ranks()
    );
    for _ in 0..20 {
        sum_over(&mut small, &[0, 2]).unwrap();
    }
    match sum_over(&mut comm, &[0, 2]) {
        Err(CommError::Shrunk { .. }) => {}
        other => panic!("rank {rank}: a call on the shrunk communicator: {other:?}"),
    }
    let mut full = small
        .grow()
        .unwrap_or_else(|e| panic!("rank {rank} grow: {e}"));
    assert_eq!(format!("{:?}", full.backend_kind()), want);
    println!(
        "rank {rank} grown to {} of {}",
        full.rank(),
        full.world_size()
    );
    for _ in 0..20 {
        sum_over(&mut full, &[0, 1, 2]).unwrap();
    }
}

/// Three ranks share the one simulated GPU through the staged backend; rank 1 refuses an
/// all-reduce locally (its buffers disagree in length). The refusal travels through the host
/// backend, so ranks 0 and 2 fail with `Mismatch` at once instead of waiting for rank 1.
fn staged_refusal_fails_peers_fast() {
    use lockstep::comm::ReduceOp;
    use lockstep::cuda::DeviceBuffer;
    let res = on_three_staged_ranks(|rank, s, comm| {
        assert_eq!(comm.backend_kind(), lockstep::comm::BackendKind::Staged);
        comm.barrier()?;
        let send = DeviceBuffer::from_host(s, &[1.0f32; 8])?;
        let mut recv = DeviceBuffer::<f32>::zeros(s, if rank == 1 { 4 } else { 8 })?;
        let t = std::time::Instant::now();
        let e = comm
            .all_reduce(&send, &mut recv, ReduceOp::Sum)
            .expect_err("the call must fail on every rank");
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let kind = match e {
            lockstep::CommError::Mismatch { .. } => "mismatch",
            lockstep::CommError::InvalidArgument { .. } => "invalid",
            _ => "other",
        };
        Ok((kind.to_string(), ms, e.to_string()))
    })
    .unwrap();
    for (rank, (kind, ms, msg)) in res.iter().enumerate() {
        let want = if rank == 1 { "invalid" } else { "mismatch" };
        assert_eq!(kind, want, "rank {rank}: {msg}");
        assert!(*ms < 100.0, "rank {rank} took {ms:.1} ms to fail: {msg}");
        println!("rank {rank}: {kind} after {ms:.2} ms: {msg}");
    }
}

/// `train-cnn` and `lockstep` pick the device backend through the same function: with
/// `NCCL_MULTI_RANK_GPU_ENABLE=1`, two ranks on one simulated GPU and a simulated NCCL 2.30,
/// both log NCCL's multi-rank mode at debug level (and staging with an older NCCL).
fn one_selection_policy() {
    // A small synthetic set: train-cnn trains for real on the simulated GPU now, so its
    // evaluation must stay short.
    let data =
        std::env::temp_dir().join(format!("lockstep-sim-policy-data-{}", std::process::id()));
    std::fs::create_dir_all(&data).unwrap();
    lockstep_train::data::write_synthetic(&data, 128, 64, 3).unwrap();
    let rdzv = std::env::temp_dir().join(format!("lockstep-sim-policy-{}", std::process::id()));
    for (version, want) in [
        ("23000", "choice=Nccl { multi_rank: true }"),
        ("21803", "choice=Staged"),
    ] {
        std::fs::create_dir_all(&rdzv).unwrap();
        let mut selftest = Command::new(bins::lockstep_bin());
        selftest
            .args([
                "launch",
                "--nproc-per-node",
                "2",
                "--",
                bins::lockstep_bin(),
                "selftest",
            ])
            .env("LOCKSTEP_BACKEND", "nccl");
        let mut train = Command::new(env!("CARGO_BIN_EXE_train-cnn"));
        train
            .args([
                "--device", "cuda", "--nprocs", "2", "--epochs", "1", "--data",
            ])
            .arg(&data);
        let runs = vec![
            ("lockstep launch -- lockstep selftest", selftest),
            ("train-cnn --device cuda", train),
        ];
        for (what, mut cmd) in runs {
            let out = cmd
                .env("NCCL_MULTI_RANK_GPU_ENABLE", "1")
                .env("SIM_NCCL_VERSION", version)
                .env("SIM_NCCL_RDZV_DIR", &rdzv)
                .env("SIM_CUDA_DEVICES", "1")
                .env("LOCKSTEP_LOG", "lockstep::rendezvous=debug")
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            // The choice is made and logged once per rank, before any training.
            for rank in 0..2 {
                let line =
                    format!("device backend selected rank={rank} world=2 gpus=1 device=0 {want}");
                assert!(
                    err.contains(&line),
                    "{what} with NCCL {version}: expected `{line}`:\n{err}"
                );
            }
            println!("{what}, NCCL {version}: {want} on both ranks");
        }
        let _ = std::fs::remove_dir_all(&rdzv);
    }
    let _ = std::fs::remove_dir_all(&data);
}

/// The launcher of node `node` of a two-node NCCL job on loopback, posing as host `host-<node>`
/// (`LOCKSTEP_HOST_ID`), with `per_node` ranks on two simulated GPUs running `scenario`.
fn node_launcher(
    node: usize,
    per_node: usize,
    port: &str,
    rdzv: &std::path::Path,
    scenario: &str,
) -> Command {
    let mut c = Command::new(bins::lockstep_bin());
    c.args(["launch", "--nproc-per-node", &per_node.to_string()])
        .args(["--nnodes", "2", "--node-rank", &node.to_string()])
        .args(["--master-port", port, "--"])
        .arg(std::env::current_exe().unwrap())
        .env("LOCKSTEP_TOKEN", "fake-driver-sim-token")
        .env("LOCKSTEP_FAKE_SCENARIO", scenario)
        .env("LOCKSTEP_BACKEND", "nccl")
        .env("LOCKSTEP_HOST_ID", format!("host-{node}"))
        .env("SIM_NCCL_RDZV_DIR", rdzv)
        .env("SIM_CUDA_DEVICES", "2");
    c
}

fn nccl_across_nodes_via_store() {
    let rdzv = std::env::temp_dir().join(format!("lockstep-sim-rdzv-{}", std::process::id()));
    std::fs::create_dir_all(&rdzv).unwrap();
    let run = |per_node: usize| -> Vec<std::process::Output> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
            .to_string();
        let kids: Vec<_> = (0..2)
            .map(|node| {
                node_launcher(node, per_node, &port, &rdzv, "nccl_env_rank")
                    .env("LOCKSTEP_TIMEOUT_S", "20")
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        kids.into_iter()
            .map(|k| k.wait_with_output().unwrap())
            .collect()
    };
    let show = |o: &std::process::Output| {
        format!(
            "{:?}\n{}{}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    };
    let outs = run(2);
    for o in &outs {
        assert!(o.status.success(), "{}", show(o));
    }
    let all = format!("{}{}", show(&outs[0]), show(&outs[1]));
    for r in 0..4 {
        // Local rank → device on each host.
        assert!(
            all.contains(&format!("rank {r} nccl ok on device {}", r % 2)),
            "{all}"
        );
    }
    // All four ranks met under one id: rank 0's (one file each for the init; the numbered
    // calls' files, `<id>.<rank>.op<n>`, are left out).
    let files: Vec<String> = std::fs::read_dir(&rdzv)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|f| !f.contains(".op"))
        .collect();
    let keys: std::collections::BTreeSet<&str> = files
        .iter()
        .map(|f| f.rsplit_once('.').unwrap().0)
        .collect();
    assert_eq!((files.len(), keys.len()), (4, 1), "{files:?}");
    // Three ranks per host, two simulated GPUs each: refused on every rank, no hang.
    let outs = run(3);
    let all = format!("{}{}", show(&outs[0]), show(&outs[1]));
    assert!(outs.iter().all(|o| !o.status.success()), "{all}");
    // Whichever node's rank fails first stops the other node's ranks (fail-fast), so only the
    // first failure's message is certain to appear.
    assert!(
        ["host-0", "host-1"].iter().any(|h| all.contains(&format!(
            "3 ranks run on host {h}, which has 2 visible GPU(s)"
        ))),
        "{all}"
    );
    let _ = std::fs::remove_dir_all(&rdzv);
}

fn sim_memory_kernels_events() {
    use lockstep::cuda::{Context, DeviceBuffer, KernelGrid, PinnedBuffer};
    let ctx = Context::new(0).unwrap();
    let info = ctx.info().unwrap();
    assert_eq!(
        (info.name.as_str(), info.compute_capability),
        ("Simulated GPU", (8, 0))
    );
    let s = ctx.stream().unwrap();
    {
        let host: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
        let d = DeviceBuffer::from_host(&s, &host).unwrap();
        assert_eq!(d.to_vec(&s).unwrap(), host);
        assert_eq!(
            DeviceBuffer::<i64>::zeros(&s, 77)
                .unwrap()
                .to_vec(&s)
                .unwrap(),
            vec![0i64; 77]
        );
        let mut d2 = DeviceBuffer::<f32>::alloc(&ctx, 1000).unwrap();
        d2.copy_from_device_async(&s, &d).unwrap();
        let mut pinned = PinnedBuffer::<f32>::zeros(&ctx, 1000).unwrap();
        // SAFETY: `pinned` is untouched until the synchronize below.
        unsafe { d2.copy_to_pinned_async(&s, &mut pinned).unwrap() };
        s.synchronize().unwrap();
        assert_eq!(&pinned[..], &host[..]);
        let e = d2.copy_from_host(&s, &host[..10]).unwrap_err().to_string();
        expect_contains("length check", &e, &["lengths differ", "1000", "10"]);
        let (a, b) = (ctx.event().unwrap(), ctx.event().unwrap());
        a.record(&s).unwrap();
        b.record(&s).unwrap();
        assert_eq!(a.elapsed_ms(&b).unwrap(), 0.25);
        use lockstep::comm::Buffer;
        assert_eq!(d.raw().space, lockstep::comm::MemSpace::Device(0));
    }
    assert_eq!(
        counter("LOCKSTEP_CUDA_LIBRARY", "sim_live_allocs"),
        0,
        "every device buffer is freed on drop"
    );

    // Kernels: NVRTC compiles the real source (when installed; its image loads as a foreign one);
    // the simulator runs the same source compiled under the SIMT shim, so this checks argument
    // marshalling, the launch builder's checks and graph capture.
    let axpy = match ctx.function(KernelId::Elementwise.source(), "axpy_f32") {
        Ok(f) => f,
        Err(e) if e.to_string().contains("NVRTC library (libnvrtc) not found") => {
            println!("(no NVRTC library: kernel launches not checked)");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let n = axpy_twin::N;
    let axpy_twin::Axpy { x: dx, mut y, want } = axpy_twin::axpy_2x(&axpy, &s).unwrap();
    assert_eq!(y.to_vec(&s).unwrap(), want);
    let fill = ctx
        .function(KernelId::Elementwise.source(), "fill_f32")
        .unwrap();
    fill.launch(KernelGrid::for_elements(n))
        .arg_mut(&mut y)
        .scalar(-3.5f32)
        .scalar(n as i64)
        .run(&s)
        .unwrap();
    assert_eq!(y.to_vec(&s).unwrap(), vec![-3.5f32; n]);
    let x64 = DeviceBuffer::<f64>::zeros(&s, 10).unwrap();
    let host = vec![0f32; n];
    let bad = [
        (
            axpy.launch(KernelGrid::for_elements(n))
                .arg_mut(&mut y)
                .scalar(1.0f32)
                .run(&s),
            "2 arguments given, the kernel takes 4",
        ),
        (
            axpy.launch(KernelGrid::for_elements(n))
                .arg_mut(&mut DeviceBuffer::<f32>::zeros(&s, 10).unwrap())
                .arg(&x64)
                .scalar(1.0f32)
                .scalar(10i64)
                .run(&s),
            "argument 1 is a f64 buffer, the kernel expects f32",
        ),
        (
            axpy.launch(KernelGrid::for_elements(n))
                .arg_mut(&mut DeviceBuffer::<f32>::zeros(&s, n).unwrap())
                .arg(&host)
                .scalar(1.0f32)
                .scalar(n as i64)
                .run(&s),
            "argument 1 lives in Host",
        ),
        (
            axpy.launch(KernelGrid::for_elements(n))
                .arg_mut(&mut DeviceBuffer::<f32>::zeros(&s, 10).unwrap())
                .arg(&dx)
                .scalar(1.0f32)
                .scalar(n as i64)
                .elements(n)
                .run(&s),
            "argument 0 holds 10 elements, the launch covers 1000",
        ),
        (
            axpy.launch(KernelGrid::for_elements(n))
                .arg_mut(&mut DeviceBuffer::<f32>::zeros(&s, n).unwrap())
                .arg(&dx)
                .scalar(1i32)
                .scalar(n as i64)
                .run(&s),
            "argument 2 is a i32 scalar, the kernel expects f32",
        ),
    ];
    for (r, needle) in bad {
        expect_contains(
            "launch check",
            &r.err().map(|e| e.to_string()).unwrap_or_default(),
            &[needle],
        );
    }
    let e = ctx
        .function(KernelId::Elementwise.source(), "nope")
        .err()
        .unwrap()
        .to_string();
    expect_contains(
        "unknown entry point",
        &e,
        &["declares no entry point nope", "axpy_f32"],
    );
    // Graphs: a failing body still ends the capture; a real capture records, replay runs it.
    let e = lockstep::cuda::Graph::capture(&s, |_| {
        Err(lockstep::cuda::CudaError::InvalidArgument {
            op: "body".into(),
            detail: "failed on purpose".into(),
        })
    })
    .err()
    .unwrap()
    .to_string();
    expect_contains("failing capture body", &e, &["failed on purpose"]);
    let scale = ctx
        .function(KernelId::Elementwise.source(), "scale_f32")
        .unwrap();
    let mut g = DeviceBuffer::from_host(&s, &[1.0f32; 64]).unwrap();
    let graph = lockstep::cuda::Graph::capture(&s, |st| {
        scale
            .launch(KernelGrid::for_elements(64))
            .arg_mut(&mut g)
            .scalar(2.0f32)
            .scalar(64i64)
            .run(st)
    })
    .unwrap();
    assert_eq!(
        g.to_vec(&s).unwrap(),
        vec![1.0f32; 64],
        "capturing must not run the work"
    );
    for _ in 0..3 {
        graph.replay(&s).unwrap();
    }
    assert_eq!(g.to_vec(&s).unwrap(), vec![8.0f32; 64]);
    drop(graph);
    assert_eq!(counter("LOCKSTEP_CUDA_LIBRARY", "sim_live_graphs"), 0);
    assert!(ctx.check().is_ok());
    drop((axpy, fill, scale));
    drop(ctx);
}

/// Three ranks share the one simulated GPU through the staged shm backend.
fn sim_staged() {
    use lockstep::comm::ReduceOp;
    use lockstep::cuda::DeviceBuffer;
    let res = on_three_staged_ranks(|rank, s, comm| {
        let r = rank as f32;
        let mut ok = true;
        let mut x = DeviceBuffer::from_host(s, &vec![r + 1.0; 1000])?;
        comm.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
        ok &= x.to_vec(s)?.iter().all(|v| *v == 6.0);
        let mine = DeviceBuffer::from_host(s, &[r; 10])?;
        let mut g = DeviceBuffer::<f32>::zeros(s, 30)?;
        comm.all_gather(&mine, &mut g)?;
        let want_g: Vec<f32> = (0..30).map(|i| (i / 10) as f32).collect();
        ok &= g.to_vec(s)? == want_g;
        let mut gi = DeviceBuffer::from_host(
            s,
            &(0..30)
                .map(|i| if i / 10 == rank { r } else { -9.0 })
                .collect::<Vec<f32>>(),
        )?;
        comm.all_gather_in_place(&mut gi)?;
        ok &= gi.to_vec(s)? == want_g;
        let mut keep = DeviceBuffer::from_host(s, &[-1.0f32; 30])?;
        comm.gather(&mine, &mut keep, 1)?;
        ok &= keep.to_vec(s)?
            == if rank == 1 {
                want_g.clone()
            } else {
                vec![-1.0; 30]
            };
        let mut red = DeviceBuffer::from_host(s, &[-1.0f32; 10])?;
        comm.reduce(&mine, &mut red, ReduceOp::Max, 2)?;
        ok &= red.to_vec(s)?
            == if rank == 2 {
                vec![2.0; 10]
            } else {
                vec![-1.0; 10]
            };
        let mut rs = DeviceBuffer::from_host(s, &(0..30).map(|i| i as f32).collect::<Vec<f32>>())?;
        comm.reduce_scatter_in_place(&mut rs, ReduceOp::Sum)?;
        let v = rs.to_vec(s)?;
        ok &= (0..10).all(|i| v[rank * 10 + i] == 3.0 * (rank * 10 + i) as f32);
        let mut b = DeviceBuffer::from_host(s, &[r; 5])?;
        comm.broadcast_in_place(&mut b, 2)?;
        ok &= b.to_vec(s)? == vec![2.0; 5];
        let (h, mut hr) = (vec![r; 4], vec![0f32; 4]);
        comm.all_reduce(&h, &mut hr, ReduceOp::Sum)?;
        ok &= hr == vec![3.0; 4];
        comm.barrier()?;
        comm.synchronize()?;
        Ok(ok)
    });
    expect_every_rank("staged ranks", res);
}

/// `ncclCommSplit` on the simulated NCCL (one rank): no color gives no communicator, a color a
/// working one-rank sub-communicator (created in progress and settled), `new_group` exchanges
/// through device memory; colors and keys NCCL cannot take are refused; every communicator is
/// destroyed once.
fn sim_nccl_split() {
    use lockstep::comm::{BackendKind, ReduceOp};
    use lockstep::cuda::DeviceBuffer;
    let (ctx, comm) = sim_nccl_comm(1, Default::default());
    let mut comm = comm.unwrap().into_communicator();
    let s = ctx.stream().unwrap();
    assert!(
        comm.split(None, 0).unwrap().is_none(),
        "no color: no communicator"
    );
    let mut sub = comm
        .split(Some(3), -1)
        .unwrap()
        .expect("a one-rank sub-communicator");
    assert_eq!(
        (
            sub.rank(),
            sub.world_size(),
            sub.global_ranks(),
            sub.backend_kind()
        ),
        (0, 1, vec![0], BackendKind::Nccl)
    );
    assert!(sub.is_sub_communicator() && !comm.is_sub_communicator());
    collectives::check_all_dtypes_world1(&mut sub, &s).unwrap();
    let mut g = comm.new_group(&[0]).unwrap().expect("rank 0 is a member");
    let mut x = DeviceBuffer::from_host(&s, &[2.5f32; 4]).unwrap();
    g.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap();
    g.synchronize().unwrap();
    assert_eq!(x.to_vec(&s).unwrap(), vec![2.5; 4]);
    let e = comm.split(Some(u32::MAX), 0).unwrap_err().to_string();
    expect_contains("color", &e, &["NCCL takes colors up to 2147483647"]);
    let e = comm.split(Some(0), i64::MAX).unwrap_err().to_string();
    expect_contains("key", &e, &["fit a C int"]);
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum).unwrap();
    comm.synchronize().unwrap();
    drop((sub, g, comm));
    assert_eq!(counter("LOCKSTEP_NCCL_LIBRARY", "sim_destroy_calls"), 3);
    assert_eq!(counter("LOCKSTEP_NCCL_LIBRARY", "sim_abort_calls"), 0);
    assert!(ctx.check().is_ok());
}

/// Three ranks staging through one (simulated) GPU split by parity: device collectives in each
/// subgroup, global ranks through the host communicator.
fn sim_staged_split() {
    use lockstep::comm::ReduceOp;
    use lockstep::cuda::DeviceBuffer;
    let res = on_three_staged_ranks(|me, s, comm| {
        let mut sub = comm
            .split(Some((me % 2) as u32), -(me as i64))?
            .ok_or("no sub-communicator")?;
        let want: Vec<usize> = if me % 2 == 0 { vec![2, 0] } else { vec![1] };
        let mut ok =
            sub.global_ranks() == want && sub.backend_kind() == lockstep::comm::BackendKind::Staged;
        let mut x = DeviceBuffer::from_host(s, &[me as f32; 100])?;
        sub.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
        let sum: f32 = want.iter().map(|&g| g as f32).sum();
        ok &= x.to_vec(s)?.iter().all(|v| *v == sum);
        let mut g = DeviceBuffer::<f32>::zeros(s, want.len())?;
        sub.all_gather(&DeviceBuffer::from_host(s, &[me as f32])?, &mut g)?;
        ok &= g.to_vec(s)? == want.iter().map(|&g| g as f32).collect::<Vec<_>>();
        sub.synchronize()?;
        comm.barrier()?;
        Ok(ok)
    });
    expect_every_rank("staged split", res);
}

/// The device engine's host side on the simulated driver (host memory stands in for device
/// memory): arena views and their overlap check, region copies, the asynchronous read-back,
/// parameter upload/download through `Engine`, the index list, and a step whose kernels cannot
/// compile (the simulated NVRTC fails on purpose, SIM_NVRTC_FAIL=1) failing with an error instead
/// of a panic. (Steps that run: tests/sim_gpu.rs.)
#[allow(clippy::single_range_in_vec_init)]
fn sim_device_engine_host_side() {
    use lockstep_train::device::{plan, Engine, Exec, GpuExec, Precision};
    let ctx = lockstep::cuda::Context::new(0).unwrap();
    let s = ctx.stream().unwrap();
    // views
    let mut b =
        lockstep::cuda::DeviceBuffer::from_host(&s, &[0f32, 1., 2., 3., 4., 5., 6., 7.]).unwrap();
    let refused = |r: Result<_, lockstep::cuda::CudaError>, what: &str| match r {
        Ok(_) => panic!("{what} accepted"),
        Err(e) => e.to_string(),
    };
    let e = refused(
        b.split_views(&[0..4], &[3..6]).map(|_| ()),
        "overlapping write",
    );
    expect_contains(
        "split_views overlap",
        &e,
        &["written range 3..6 overlaps 0..4"],
    );
    let e = refused(b.split_views(&[], &[6..9]).map(|_| ()), "out-of-range view");
    expect_contains(
        "split_views range",
        &e,
        &["range 6..9 is outside the buffer of 8 f32 elements"],
    );
    assert!(
        b.split_views(&[0..2, 1..3], &[4..6, 6..8]).is_ok(),
        "disjoint writes, overlapping reads"
    );
    // region copies and the read-back
    let mut dst = lockstep::cuda::DeviceBuffer::<f32>::zeros(&s, 4).unwrap();
    dst.copy_region_async(&s, 1, &b, 5, 3).unwrap();
    assert_eq!(dst.to_vec(&s).unwrap(), vec![0., 5., 6., 7.]);
    assert!(
        dst.copy_region_async(&s, 2, &b, 0, 3).is_err(),
        "destination overrun refused"
    );
    let mut rb = lockstep::cuda::HostReadback::<f32>::new(&ctx, 2).unwrap();
    rb.start(&s, &b.view(2..4).unwrap()).unwrap();
    assert_eq!(rb.wait().unwrap(), &[2., 3.]);
    assert!(
        rb.start(&s, &b.view(0..3).unwrap()).is_err(),
        "length mismatch refused"
    );
    // the engine's uploads and downloads
    let mut model = lockstep_train::model::Model::fashion_cnn(4).unwrap();
    model.init(3);
    let t = plan::Tensors::new(&model, 4, Precision::Fp32).unwrap();
    let exec = GpuExec::new(&ctx, t.arena_len, true).unwrap();
    let mut eng = Engine::new(exec, &model, 4, Precision::Fp32).unwrap();
    assert_eq!(eng.params().unwrap(), model.params);
    let st = eng.exec.read_f32(eng.t.bn_state).unwrap();
    assert!(
        st[..32].iter().all(|&v| v == 0.0) && st[32..64].iter().all(|&v| v == 1.0),
        "running mean 0, var 1"
    );
    eng.set_index_list(&[9, 8, 7, 6, 5], false).unwrap();
    eng.exec.select_indices(eng.t.indices.prefix(3), 2).unwrap();
    assert_eq!(
        eng.exec.read_i32(eng.t.indices.prefix(3)).unwrap(),
        vec![7, 6, 5]
    );
    eng.exec.write_f32(eng.t.loss.loss_sum, &[12.5]).unwrap();
    eng.exec.start_read(eng.t.loss.loss_sum).unwrap();
    assert_eq!(eng.exec.finish_read().unwrap(), vec![12.5]);
    // The step's kernels do not compile: the step fails with an error naming the cause, never a
    // panic.
    let e = match eng.train_step(0, 3, 0.01, None) {
        Ok(_) => panic!("the kernels cannot compile, yet the step succeeded"),
        Err(e) => e.to_string(),
    };
    expect_contains(
        "step without kernels",
        &e,
        &["NVRTC", "compile failure injected by SIM_NVRTC_FAIL"],
    );
    drop(eng);
    assert!(ctx.check().is_ok(), "no deferred errors");
}

fn main() {
    if let Ok(name) = std::env::var("LOCKSTEP_FAKE_SCENARIO") {
        scenario(&name);
        return;
    }
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let root = std::env::temp_dir().join(format!("lockstep-fake-libs-{}", std::process::id()));
    let libs = build_libs(&root);
    let s = |p: &PathBuf| p.display().to_string();
    // The libraries a scenario loads, by kind, and the variables some add to them.
    let cuda = ("LOCKSTEP_CUDA_LIBRARY", s(&libs.cuda));
    let sim = ("LOCKSTEP_CUDA_LIBRARY", s(&libs.sim_cuda));
    let sim_nccl = ("LOCKSTEP_NCCL_LIBRARY", s(&libs.sim_nccl));
    let sim_nvrtc = ("LOCKSTEP_NVRTC_LIBRARY", s(&libs.sim_nvrtc));
    let stuck = ("SIM_STREAM_STUCK", "1".to_string());
    let set = |k: &'static str, v: &str| (k, v.to_string());
    let cases: Vec<(&str, Vec<(&str, String)>)> = vec![
        ("guard_records_location", vec![cuda.clone()]),
        ("foreign_init_refused", vec![cuda.clone()]),
        ("guard_is_per_process", vec![cuda.clone()]),
        ("probe_child_reports", vec![cuda.clone()]),
        (
            "sim_gpus_pick_defaults",
            vec![sim.clone(), set("SIM_CUDA_DEVICES", "3")],
        ),
        (
            "missing_override",
            vec![set("LOCKSTEP_CUDA_LIBRARY", "/nonexistent/libcuda.so.1")],
        ),
        ("missing_default_search", vec![]),
        (
            "missing_symbol",
            vec![("LOCKSTEP_CUDA_LIBRARY", s(&libs.cuda_broken))],
        ),
        ("driver_symbols_missing_is_error", vec![cuda.clone()]),
        (
            "fake_nccl",
            vec![("LOCKSTEP_NCCL_LIBRARY", s(&libs.nccl)), cuda.clone()],
        ),
        (
            "old_nccl_rejected",
            vec![("LOCKSTEP_NCCL_LIBRARY", s(&libs.nccl_old))],
        ),
        ("sim_memory_kernels_events", vec![sim.clone()]),
        ("sim_bench_device", vec![sim.clone(), sim_nccl.clone()]),
        (
            "sim_device_engine_host_side",
            vec![sim.clone(), sim_nvrtc.clone(), set("SIM_NVRTC_FAIL", "1")],
        ),
        (
            "sim_drop_error_is_deferred",
            vec![sim.clone(), set("SIM_FAIL_FREE", "1")],
        ),
        ("sim_nccl_collectives", vec![sim.clone(), sim_nccl.clone()]),
        (
            "sim_nccl_stream_ordered",
            vec![
                sim.clone(),
                sim_nccl.clone(),
                ("SIM_CALL_LOG", s(&root.join("calls.log"))),
            ],
        ),
        ("sim_nccl_split", vec![sim.clone(), sim_nccl.clone()]),
        (
            "sim_nccl_split_missing",
            vec![
                sim.clone(),
                ("LOCKSTEP_NCCL_LIBRARY", s(&libs.sim_nccl_no_split)),
            ],
        ),
        ("sim_staged_split", vec![sim.clone()]),
        (
            "sim_nccl_peer_never_joins",
            vec![sim.clone(), sim_nccl.clone()],
        ),
        (
            "sim_nccl_async_error_aborts",
            vec![
                sim.clone(),
                sim_nccl.clone(),
                set("SIM_NCCL_ASYNC_ERROR", "1"),
                stuck.clone(),
            ],
        ),
        (
            "sim_nccl_timeout_aborts",
            vec![sim.clone(), sim_nccl.clone(), stuck.clone()],
        ),
        (
            "sim_nccl_work_times_out",
            vec![sim.clone(), sim_nccl.clone(), stuck.clone()],
        ),
        (
            "sim_nccl_liveness_check_aborts",
            vec![sim.clone(), sim_nccl.clone(), stuck.clone()],
        ),
        ("sim_staged_ranks_share_a_gpu", vec![sim.clone()]),
        (
            "unique_id_exchange_over_shm",
            vec![sim.clone(), sim_nccl.clone()],
        ),
        (
            "nccl_across_nodes_via_store",
            vec![sim.clone(), sim_nccl.clone()],
        ),
        ("staged_refusal_fails_peers_fast", vec![sim.clone()]),
        (
            "device_shrink_and_grow",
            vec![sim.clone(), sim_nccl.clone()],
        ),
        ("nccl_job_status", vec![sim.clone(), sim_nccl.clone()]),
        (
            "nccl_job_status_across_nodes",
            vec![sim.clone(), sim_nccl.clone()],
        ),
        (
            "one_selection_policy",
            vec![sim.clone(), sim_nccl.clone(), sim_nvrtc.clone()],
        ),
        (
            "nccl_multi_rank_gpu",
            vec![
                sim.clone(),
                sim_nccl.clone(),
                set("NCCL_MULTI_RANK_GPU_ENABLE", "1"),
                set("SIM_NCCL_VERSION", "23000"),
                ("SIM_NCCL_RDZV_DIR", s(&root.join("rdzv-multi-rank"))),
            ],
        ),
        (
            "nccl_multi_rank_gpu",
            vec![
                sim.clone(),
                sim_nccl.clone(),
                set("NCCL_MULTI_RANK_GPU_ENABLE", "1"),
                ("SIM_NCCL_RDZV_DIR", s(&root.join("rdzv-multi-rank-old"))),
            ],
        ),
        ("nvrtc_compile_goes_through_guard", vec![sim.clone()]),
        (
            "debug_probe",
            vec![cuda.clone(), set("LOCKSTEP_DEBUG", "1")],
        ),
        (
            "missing_nccl_and_nvrtc",
            vec![
                set("LOCKSTEP_NCCL_LIBRARY", "/nonexistent/libnccl.so.2"),
                set("LOCKSTEP_NVRTC_LIBRARY", "/nonexistent/libnvrtc.so.12"),
            ],
        ),
    ];
    let exe = std::env::current_exe().unwrap();
    let mut r = runner::Runner::new();
    for (name, env) in &cases {
        if !filter.is_empty() && !filter.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        r.run(name, || {
            let mut cmd = Command::new(&exe);
            cmd.env("LOCKSTEP_FAKE_SCENARIO", name);
            for v in [
                "LOCKSTEP_CUDA_LIBRARY",
                "LOCKSTEP_NCCL_LIBRARY",
                "LOCKSTEP_NVRTC_LIBRARY",
                "LOCKSTEP_DEBUG",
                "LOCKSTEP_TIMEOUT_S",
                "XDG_CACHE_HOME",
            ] {
                cmd.env_remove(v);
            }
            // A private kernel cache, so runs do not depend on (or fill) the user's cache.
            cmd.env("XDG_CACHE_HOME", root.join("cache"));
            for (k, v) in env {
                cmd.env(k, v);
            }
            let out = cmd
                .output()
                .map_err(|e| format!("re-run the test binary: {e}"))?;
            let stderr = String::from_utf8_lossy(&out.stderr);
            let stderr_ok = *name != "debug_probe"
                || stderr.contains("CUDA probe: a rank can initialise CUDA: 2 device(s)");
            if out.status.success() && stderr_ok {
                if std::env::var_os("LOCKSTEP_FAKE_VERBOSE").is_some() {
                    print!("{}", String::from_utf8_lossy(&out.stdout));
                }
                Ok(())
            } else {
                Err(format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ))
            }
        });
    }
    let _ = std::fs::remove_dir_all(&root);
    if r.finish() != std::process::ExitCode::SUCCESS {
        std::process::exit(1);
    }
}
