//! The simulated GPU for tests on machines without one: `libcuda.so.1` built from
//! `tests/fake/sim_cuda.c` with the real `kernels/*.cu` compiled as host C++ under the SIMT shim
//! (`tests/simt`), and `libnvrtc.so.12` from `tests/fake/sim_nvrtc.c`.
//!
//! What [`SimGpu::build`] does, once per content (the result is cached in
//! `target/tmp/simt/<hash>`, keyed by every input: shim, driver, kernel sources, flags and the
//! compilers' versions; a test run that finds it there compiles nothing):
//! 1. writes the kernel sources the crate embeds (`KernelId::ALL`, with their headers) and the
//!    shim's own `selftest.cu` into the build folder;
//! 2. for each build variant (`tc`: tensor cores with TF32, as NVRTC compiles for an sm_80 by
//!    default; `notf32`: `-DLOCKSTEP_NO_TF32`; `fma`: `-DLOCKSTEP_NO_TENSOR_CORES`) preprocesses
//!    every file and compiles each distinct result once (most files do not depend on the
//!    variant), wrapped in its own namespace so identically named helpers of different files
//!    and variants cannot collide, with its entry points renamed apart;
//! 3. generates one trampoline per entry point (`simt::run_kernel<&kernel>`: the parameter types
//!    come from the C++ declaration) with a `static_assert` that the declaration matches the
//!    crate's signature table (`KernelSource::functions`, which build.rs parses from the same
//!    files), and a registry of variants and names the driver looks kernels up in;
//! 4. links the driver, the shim runtime, the kernels and the registry into `libcuda.so.1`.
//!
//! The flags: C++17, `-O2`, `-fno-strict-aliasing` (the GEMM core reads bf16 pairs through
//! `unsigned int*`, fine on a GPU, undefined for GCC's aliasing rules), `-ffp-contract=off` (no
//! FMA contraction: an explicit `fmaf` is one fused operation, `a * b + c` two roundings) and
//! `-mfma` where the CPU has FMA (else `fmaf` is a slow library call).
//!
//! Dynamic shared memory (`extern __shared__`) is not supported: no kernel uses it, and a kernel
//! that did would fail to link here (`--no-undefined`), naming the array.
#![allow(dead_code)]

use std::ffi::OsString;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use lockstep::comm::Dtype;
use lockstep::cuda::{ArgKind, KernelSig, KernelSource};
use lockstep_train::device::kernels::KernelId;

const SIMT_H: &str = include_str!("../../../../tests/simt/simt.h");
const SIMT_LAUNCH_H: &str = include_str!("../../../../tests/simt/simt_launch.h");
const SIMT_CPP: &str = include_str!("../../../../tests/simt/simt.cpp");
const SELFTEST_CU: &str = include_str!("../../../../tests/simt/selftest.cu");
const SIM_CUDA_C: &str = include_str!("../../../../tests/fake/sim_cuda.c");
const SIM_NVRTC_C: &str = include_str!("../../../../tests/fake/sim_nvrtc.c");

/// Argument kinds of the self-test kernels: an i32 buffer they write, an i32 scalar.
const OUT_I32: ArgKind = ArgKind::PtrMut(Dtype::I32);
const I32: ArgKind = ArgKind::Scalar(Dtype::I32);

/// The shim's self-test kernels (`tests/simt/selftest.cu`) as a kernel source the crate can
/// compile (through the simulated NVRTC) and launch.
pub static SELFTEST: KernelSource = KernelSource {
    name: "selftest.cu",
    source: SELFTEST_CU,
    headers: &[],
    functions: &[
        KernelSig {
            name: "simt_shfl",
            args: &[OUT_I32, I32, I32, I32],
        },
        KernelSig {
            name: "simt_ballot",
            args: &[OUT_I32, I32],
        },
        KernelSig {
            name: "simt_shfl_halves",
            args: &[OUT_I32, OUT_I32],
        },
        KernelSig {
            name: "simt_atomics",
            args: &[OUT_I32, ArgKind::PtrMut(Dtype::F32), OUT_I32],
        },
        KernelSig {
            name: "simt_early_exit",
            args: &[OUT_I32, I32],
        },
        KernelSig {
            name: "simt_shared_per_block",
            args: &[OUT_I32],
        },
        KernelSig {
            name: "simt_misuse",
            args: &[OUT_I32, I32],
        },
    ],
};

/// Build variants: name and the defines NVRTC would get for it (sim_nvrtc.c and sim_cuda.c
/// choose among these names).
const VARIANTS: &[(&str, &[&str])] = &[
    ("tc", &[]),
    ("notf32", &["-DLOCKSTEP_NO_TF32"]),
    ("fma", &["-DLOCKSTEP_NO_TENSOR_CORES"]),
];

/// The built simulated GPU.
pub struct SimGpu {
    /// `libcuda.so.1`: the simulated driver with the kernels.
    pub cuda: PathBuf,
    /// `libnvrtc.so.12`: the simulated NVRTC.
    pub nvrtc: PathBuf,
    /// A kernel cache folder of its own (`XDG_CACHE_HOME`), so simulated images never land in
    /// the user's cache, where a real driver of the same version could pick them up.
    pub cache: PathBuf,
}

impl SimGpu {
    /// Build (or find in `target/tmp/simt`) the simulated driver and NVRTC. Panics with the
    /// compiler's output when a step fails: a test fixture that cannot be built is a test failure.
    pub fn build() -> SimGpu {
        let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("simt");
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let mut flags: Vec<String> = [
            "-std=c++17",
            "-O2",
            "-fPIC",
            "-fno-strict-aliasing",
            "-ffp-contract=off",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if cpu_has_fma() {
            flags.push("-mfma".into());
        }
        let sources = sources();
        let mut key: Vec<Vec<u8>> = vec![
            b"simt-build-2".to_vec(),
            SIMT_H.into(),
            SIMT_LAUNCH_H.into(),
            SIMT_CPP.into(),
            SIM_CUDA_C.into(),
            SIM_NVRTC_C.into(),
            flags.join(" ").into_bytes(),
            tool_version(&cxx),
            tool_version(&cc),
        ];
        for s in &sources {
            key.push(s.name.into());
            key.push(s.source.into());
            for (n, t) in s.headers {
                key.push(n.as_bytes().to_vec());
                key.push(t.as_bytes().to_vec());
            }
            for f in s.functions {
                key.push(format!("{}({})", f.name, sig_codes(f)).into_bytes());
            }
        }
        let hash = fnv1a(&key);
        let dir = root.join(format!("{hash:016x}"));
        let sim = SimGpu {
            cuda: dir.join("libcuda.so.1"),
            nvrtc: dir.join("libnvrtc.so.12"),
            cache: dir.join("xdg-cache"),
        };
        if sim.cuda.is_file() && sim.nvrtc.is_file() {
            return sim;
        }
        let tmp = root.join(format!("{hash:016x}.tmp-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        let t0 = std::time::Instant::now();
        build_into(&tmp, &cxx, &cc, &flags, &sources);
        // Publish atomically: another test process may have finished the same build first.
        if std::fs::rename(&tmp, &dir).is_err() {
            let _ = std::fs::remove_dir_all(&tmp);
            assert!(
                sim.cuda.is_file(),
                "could not publish the simulated GPU build in {}",
                dir.display()
            );
        }
        println!(
            "  built the simulated GPU (SIMT shim, {} kernel files) in {:.1} s: {}",
            sources.len(),
            t0.elapsed().as_secs_f64(),
            dir.display()
        );
        sim
    }

    /// The environment that points lockstep at the simulated GPU.
    pub fn env(&self) -> Vec<(&'static str, OsString)> {
        vec![
            ("LOCKSTEP_CUDA_LIBRARY", self.cuda.clone().into()),
            ("LOCKSTEP_NVRTC_LIBRARY", self.nvrtc.clone().into()),
            ("XDG_CACHE_HOME", self.cache.clone().into()),
        ]
    }

    /// Apply [`SimGpu::env`] to `cmd`, dropping settings that would change how the shim runs.
    pub fn apply(&self, cmd: &mut Command) {
        for v in [
            "LOCKSTEP_SIMT_SHUFFLE",
            "LOCKSTEP_SIMT_WORKERS",
            "LOCKSTEP_NCCL_LIBRARY",
        ] {
            cmd.env_remove(v);
        }
        for (k, v) in self.env() {
            cmd.env(k, v);
        }
    }
}

/// Without a CUDA driver (and without `LOCKSTEP_REQUIRE_GPU=1`), run this test binary again on
/// the simulated GPU once per `(label, LOCKSTEP_NVRTC_OPTIONS)` mode and exit with the combined
/// result; with a driver, or inside such a run, return and let the test use the real thing.
pub fn run_on_sim_without_gpu(modes: &[(&str, &str)]) {
    if std::env::var_os("LOCKSTEP_SIMT_CHILD").is_some()
        || lockstep::cuda::driver_present()
        || std::env::var("LOCKSTEP_REQUIRE_GPU").as_deref() == Ok("1")
    {
        return;
    }
    println!("no CUDA driver: running on the simulated GPU (kernels/*.cu as host C++ under the SIMT shim, tests/simt)");
    let sim = SimGpu::build();
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut failed = Vec::new();
    for (label, opts) in modes {
        println!("\n== simulated GPU, {label} (LOCKSTEP_NVRTC_OPTIONS={opts:?})");
        let mut cmd = Command::new(&exe);
        cmd.args(std::env::args_os().skip(1));
        sim.apply(&mut cmd);
        cmd.env("LOCKSTEP_SIMT_CHILD", "1")
            .env("LOCKSTEP_NVRTC_OPTIONS", opts);
        let st = cmd
            .status()
            .expect("re-run the test binary on the simulated GPU");
        if !st.success() {
            failed.push(*label);
        }
    }
    if !failed.is_empty() {
        println!("\nsimulated GPU: FAILED in mode(s) {failed:?}");
        std::process::exit(1);
    }
    std::process::exit(0);
}

/// Every kernel source of the crate, then the shim's self-test.
fn sources() -> Vec<&'static KernelSource> {
    let mut v: Vec<&'static KernelSource> = KernelId::ALL.iter().map(|k| k.source()).collect();
    v.push(&SELFTEST);
    v
}

/// The signature as simt_launch.h's `Sig::matches` spells it: "wf rf si".
fn sig_codes(f: &KernelSig) -> String {
    let dt = |d: Dtype| match d {
        Dtype::F32 => 'f',
        Dtype::F64 => 'd',
        Dtype::I32 => 'i',
        Dtype::I64 => 'l',
        Dtype::U8 => 'b',
        Dtype::I8 => 'c',
        Dtype::U32 => 'u',
        Dtype::U64 => 'q',
        Dtype::BF16 | Dtype::F16 => 'h',
        _ => '?',
    };
    f.args
        .iter()
        .map(|a| match *a {
            ArgKind::Ptr(d) => format!("r{}", dt(d)),
            ArgKind::PtrMut(d) => format!("w{}", dt(d)),
            ArgKind::Scalar(d) => format!("s{}", dt(d)),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn cpu_has_fma() -> bool {
    cfg!(target_arch = "x86_64")
        && std::fs::read_to_string("/proc/cpuinfo")
            .is_ok_and(|s| s.split_whitespace().any(|w| w == "fma"))
}

fn tool_version(tool: &str) -> Vec<u8> {
    match Command::new(tool).arg("--version").output() {
        Ok(o) => o.stdout,
        Err(e) => panic!("`{tool} --version` failed ({e}): the simulated GPU needs a C and a C++ compiler (apt-get install gcc g++)"),
    }
}

/// 64-bit FNV-1a over `parts`, each followed by a separator byte.
fn fnv1a(parts: &[Vec<u8>]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for p in parts {
        for b in p.iter().chain(&[0xffu8]) {
            h ^= *b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
    }
    h
}

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

/// Run `cmds` (program, arguments), at most as many at once as there are CPUs, and return their
/// standard outputs in order; panic with the output of those that fail.
fn run_all(cmds: Vec<(String, Vec<String>)>) -> Vec<Vec<u8>> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let jobs = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .min(cmds.len().max(1));
    let results = std::sync::Mutex::new(vec![Vec::new(); cmds.len()]);
    let errors = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..jobs {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let Some((prog, args)) = cmds.get(i) else { break };
                match Command::new(prog).args(args).output() {
                    Ok(o) if o.status.success() => results.lock().unwrap()[i] = o.stdout,
                    Ok(o) => errors.lock().unwrap().push(format!(
                        "`{prog} {}` failed ({}):\n{}",
                        args.join(" "),
                        o.status,
                        String::from_utf8_lossy(&o.stderr)
                    )),
                    Err(e) => errors.lock().unwrap().push(format!(
                        "could not run `{prog}` ({e}): the simulated GPU needs a C and a C++ compiler (apt-get install gcc g++)"
                    )),
                }
            });
        }
    });
    let errors = errors.into_inner().unwrap();
    assert!(
        errors.is_empty(),
        "building the simulated GPU failed:\n{}",
        errors.join("\n")
    );
    results.into_inner().unwrap()
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn build_into(
    dir: &Path,
    cxx: &str,
    cc: &str,
    flags: &[String],
    sources: &[&'static KernelSource],
) {
    write(&dir.join("simt/simt.h"), SIMT_H);
    write(&dir.join("simt/simt_launch.h"), SIMT_LAUNCH_H);
    write(&dir.join("simt/simt.cpp"), SIMT_CPP);
    write(&dir.join("fake/sim_cuda.c"), SIM_CUDA_C);
    write(&dir.join("fake/sim_nvrtc.c"), SIM_NVRTC_C);
    for s in sources {
        write(&dir.join("kernels").join(s.name), s.source);
        for (n, t) in s.headers {
            write(&dir.join("kernels").join(n), t);
        }
    }
    // Distinct builds: the preprocessed text of every (variant, file); files whose text does not
    // depend on the variant are compiled once.
    let mut pre = Vec::new();
    for (_, defines) in VARIANTS {
        for s in sources {
            let mut args = flags.to_vec();
            args.extend(strings(defines));
            args.extend([
                "-include".to_string(),
                dir.join("simt/simt.h").display().to_string(),
                "-E".into(),
                "-P".into(),
            ]);
            args.extend([
                "-x".to_string(),
                "c++".into(),
                dir.join("kernels").join(s.name).display().to_string(),
            ]);
            pre.push((cxx.to_string(), args));
        }
    }
    let texts = run_all(pre);
    let mut units: Vec<(usize, &[u8], usize)> = Vec::new(); // (source index, text, first variant)
    let mut unit_of = vec![vec![0usize; sources.len()]; VARIANTS.len()];
    for (vi, units_of_variant) in unit_of.iter_mut().enumerate() {
        for (si, slot) in units_of_variant.iter_mut().enumerate() {
            let text = &texts[vi * sources.len() + si][..];
            *slot = match units.iter().position(|(i, t, _)| *i == si && *t == text) {
                Some(u) => u,
                None => {
                    units.push((si, text, vi));
                    units.len() - 1
                }
            };
        }
    }
    let mut cmds = Vec::new();
    for (u, (si, _, vi)) in units.iter().enumerate() {
        let s = sources[*si];
        let ns = format!("simt_u{u}");
        let mut t = format!(
            "// @generated by tests/common/simt.rs: kernels/{} as built for variant {}\n",
            s.name, VARIANTS[*vi].0
        );
        t.push_str("#include \"simt_launch.h\"\n");
        for f in s.functions {
            writeln!(t, "#define {0} {1}__{0}", f.name, ns).unwrap();
        }
        writeln!(
            t,
            "namespace {ns} {{\n#include \"../kernels/{}\"\n}}",
            s.name
        )
        .unwrap();
        for f in s.functions {
            writeln!(t, "#undef {}", f.name).unwrap();
        }
        for f in s.functions {
            let fun = format!("&{ns}::{ns}__{}", f.name);
            let sym = format!("simt_k_u{u}__{}", f.name);
            let codes = sig_codes(f);
            writeln!(
                t,
                "static_assert(simt::Sig<decltype({fun})>::matches(\"{codes}\"), \"kernels/{file}: the C++ declaration of {name} does not match \
the crate's signature table ({codes}; build.rs parses the same declaration): fix build.rs arg_kind or the kernel\");",
                file = s.name,
                name = f.name
            )
            .unwrap();
            writeln!(t, "extern \"C\" const simt_kernel {sym};").unwrap();
            writeln!(
                t,
                "extern \"C\" const simt_kernel {sym} = {{\"{name}\", simt::Fn<decltype({fun})>::n, simt::Fn<decltype({fun})>::sizes, &simt::run_kernel<{fun}>}};",
                name = f.name
            )
            .unwrap();
        }
        let src = dir.join(format!("units/k_u{u}.cpp"));
        write(&src, &t);
        let mut args = flags.to_vec();
        args.extend(VARIANTS[*vi].1.iter().map(|d| d.to_string()));
        args.extend(
            [
                "-Wall",
                "-Wno-unknown-pragmas",
                "-Wno-unused-function",
                "-include",
            ]
            .map(String::from),
        );
        args.push(dir.join("simt/simt.h").display().to_string());
        args.push(format!("-I{}", dir.join("simt").display()));
        args.extend([
            "-c".into(),
            src.display().to_string(),
            "-o".into(),
            dir.join(format!("units/k_u{u}.o")).display().to_string(),
        ]);
        cmds.push((cxx.to_string(), args));
    }
    // The registry: every variant's kernels by name.
    let mut reg = String::from("// @generated by tests/common/simt.rs: the kernels of every build variant.\n#include \"simt_launch.h\"\n");
    for (u, (si, _, _)) in units.iter().enumerate() {
        for f in sources[*si].functions {
            writeln!(
                reg,
                "extern \"C\" const simt_kernel simt_k_u{u}__{};",
                f.name
            )
            .unwrap();
        }
    }
    let mut table = Vec::new();
    for (vi, (name, _)) in VARIANTS.iter().enumerate() {
        let mut entries = Vec::new();
        for (si, s) in sources.iter().enumerate() {
            for f in s.functions {
                entries.push(format!("&simt_k_u{}__{}", unit_of[vi][si], f.name));
            }
        }
        writeln!(
            reg,
            "static const simt_kernel* const variant_{name}[] = {{{}}};",
            entries.join(", ")
        )
        .unwrap();
        table.push(format!("{{\"{name}\", variant_{name}, {}}}", entries.len()));
    }
    writeln!(
        reg,
        "extern \"C\" const simt_variant simt_variants[] = {{{}}};",
        table.join(", ")
    )
    .unwrap();
    writeln!(
        reg,
        "extern \"C\" const int simt_nvariants = {};",
        VARIANTS.len()
    )
    .unwrap();
    write(&dir.join("units/registry.cpp"), &reg);
    let obj = |p: &str| dir.join(p).display().to_string();
    let mut cxx_args = flags.to_vec();
    cxx_args.extend(["-Wall", "-Wextra", "-Werror"].map(String::from));
    // The shim itself and the registry: C++ against the shim's headers.
    for (src, out) in [
        ("simt/simt.cpp", "simt/simt.o"),
        ("units/registry.cpp", "units/registry.o"),
    ] {
        let mut args = cxx_args.clone();
        args.extend([
            format!("-I{}", obj("simt")),
            "-c".into(),
            obj(src),
            "-o".into(),
            obj(out),
        ]);
        cmds.push((cxx.to_string(), args));
    }
    cmds.push((
        cc.to_string(),
        strings(&[
            "-fPIC",
            "-O1",
            "-c",
            &obj("fake/sim_cuda.c"),
            "-o",
            &obj("fake/sim_cuda.o"),
        ]),
    ));
    cmds.push((
        cc.to_string(),
        strings(&[
            "-shared",
            "-fPIC",
            "-O1",
            "-o",
            &obj("libnvrtc.so.12"),
            &obj("fake/sim_nvrtc.c"),
            "-Wl,-soname,libnvrtc.so.12",
        ]),
    ));
    // A real NVRTC has its builtins library beside it, and discovery refuses one without (every
    // compile would fail): an empty one, named for the version sim_nvrtc.c reports (12.4).
    write(
        &dir.join("fake/sim_nvrtc_builtins.c"),
        "/* the simulated NVRTC's builtins: nothing to provide */\n",
    );
    cmds.push((
        cc.to_string(),
        strings(&[
            "-shared",
            "-fPIC",
            "-o",
            &obj("libnvrtc-builtins.so.12.4"),
            &obj("fake/sim_nvrtc_builtins.c"),
            "-Wl,-soname,libnvrtc-builtins.so.12.4",
        ]),
    ));
    run_all(cmds);
    // --no-undefined: a kernel declaring `extern __shared__` (dynamic shared memory, which the shim
    // does not support) fails here, naming the array, instead of when the driver is loaded.
    let mut link = vec![
        "-shared".to_string(),
        "-o".into(),
        obj("libcuda.so.1"),
        "-Wl,-soname,libcuda.so.1,--no-undefined".into(),
    ];
    link.extend([
        obj("fake/sim_cuda.o"),
        obj("simt/simt.o"),
        obj("units/registry.o"),
    ]);
    link.extend((0..units.len()).map(|u| obj(&format!("units/k_u{u}.o"))));
    link.push("-pthread".into());
    run_all(vec![(cxx.to_string(), link)]);
}
