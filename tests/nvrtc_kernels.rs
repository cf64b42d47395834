//! Every kernel in `kernels/` compiles with NVRTC to PTX for sm_80 and sm_90, and to CUBIN through
//! the disk cache (second compile is a cache hit). Needs only the NVRTC library, no GPU:
//! `.ci/install-nvrtc.sh` installs it into `.ci-deps/nvrtc`, which discovery searches.
//!
//! Without NVRTC: prints `skipped: no NVRTC library` and passes, unless `LOCKSTEP_REQUIRE_NVRTC=1`.

use lockstep::cuda::{compile_cubin_cached, compile_ptx, KernelSource, NvrtcInfo};
use lockstep::train::device::kernels::KernelId;

fn main() {
    let info = match NvrtcInfo::load() {
        Ok(i) => i,
        Err(e) => {
            if std::env::var("LOCKSTEP_REQUIRE_NVRTC").as_deref() == Ok("1") {
                eprintln!("LOCKSTEP_REQUIRE_NVRTC=1 but NVRTC could not be loaded:\n{e}");
                std::process::exit(1);
            }
            println!("skipped: no NVRTC library (run .ci/install-nvrtc.sh or set LOCKSTEP_NVRTC_LIBRARY)");
            eprintln!("{e}");
            return;
        }
    };
    println!("NVRTC {}.{} from {}", info.version.0, info.version.1, info.path);
    // A compile error carries NVRTC's log (file, line, message) and the options used.
    const BROKEN: KernelSource = KernelSource {
        name: "broken.cu",
        source: "extern \"C\" __global__ void broken(float* x) {\n  x[0] = undefined_name;\n}\n",
        headers: &[],
        functions: &[],
    };
    let e = compile_ptx(&BROKEN, "compute_80").expect_err("a broken kernel must not compile").to_string();
    assert!(e.contains("broken.cu") && e.contains("undefined_name") && e.contains("(2)"), "{e}");
    assert!(e.contains("--gpu-architecture=compute_80"), "{e}");
    println!("test compile_error_reports_the_nvrtc_log ... ok");
    let mut n = 0;
    for id in KernelId::ALL {
        for arch in ["compute_80", "compute_90"] {
            let ptx = compile_ptx(id.source(), arch).unwrap_or_else(|e| panic!("{id} for {arch}:\n{e}"));
            let target = format!(".target sm_{}", &arch[8..]);
            assert!(ptx.contains(&target), "{id} for {arch}: PTX lacks {target:?}");
            for sig in id.functions() {
                assert!(ptx.contains(&format!(".entry {}(", sig.name)), "{id} for {arch}: PTX has no entry {}", sig.name);
            }
            println!("test ptx {id} {arch} ... ok ({} bytes)", ptx.len());
            n += 1;
        }
    }
    // CUBIN through the disk cache, in a private cache folder: miss, then hit.
    let dir = std::env::temp_dir().join(format!("lockstep-nvrtc-cache-{}", std::process::id()));
    std::env::set_var("XDG_CACHE_HOME", &dir);
    for id in KernelId::ALL {
        let (a, hit_a) = compile_cubin_cached(id.source(), (8, 0), 12040).unwrap_or_else(|e| panic!("{id} cubin sm_80:\n{e}"));
        let (b, hit_b) = compile_cubin_cached(id.source(), (8, 0), 12040).unwrap();
        assert!(!hit_a && hit_b, "{id}: expected a cache miss then a hit, got {hit_a} then {hit_b}");
        assert_eq!(a, b);
        assert_eq!(&a[..4], b"\x7fELF", "{id}: CUBIN is not an ELF image");
        let (_, hit_c) = compile_cubin_cached(id.source(), (9, 0), 12040).unwrap();
        assert!(!hit_c, "{id}: another arch must not hit the sm_80 entry");
        println!("test cubin-cache {id} ... ok");
        n += 1;
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!("\ntest result: ok. {n} passed; 0 failed");
}
