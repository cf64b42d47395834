//! The safe CUDA layer on a real GPU: memory, kernels vs their CPU twins, the launch builder's
//! checks, the NVRTC disk cache, events, graph capture and the single-init guarantee with the
//! real driver. Prints `skipped: no CUDA driver` without one (fails under LOCKSTEP_REQUIRE_GPU=1).

#[path = "common/axpy.rs"]
mod axpy_twin;
#[path = "../../../tests/common/gpu.rs"]
mod gpu;
#[path = "../../../tests/common/runner.rs"]
mod runner;

use lockstep::cuda::{DeviceBuffer, Graph, KernelGrid, PinnedBuffer};
use lockstep_train::device::kernels::{twins, KernelId};

fn check_eq<T: PartialEq + std::fmt::Debug>(
    what: &str,
    got: &[T],
    want: &[T],
) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{what}: length {} != {}", got.len(), want.len()));
    }
    let bad: Vec<String> = got
        .iter()
        .zip(want)
        .enumerate()
        .filter(|(_, (g, w))| g != w)
        .take(5)
        .map(|(i, (g, w))| format!("  [{i}] got {g:?} want {w:?}"))
        .collect();
    if bad.is_empty() {
        Ok(())
    } else {
        Err(format!("{what}: mismatches\n{}", bad.join("\n")))
    }
}

/// Child scenario: libcuda initialised behind lockstep's back is detected with the real driver.
fn foreign_child() {
    // SAFETY: loading the real driver and calling cuInit(0) through its C prototype.
    let ok = unsafe {
        let lib = libloading::Library::new(
            std::env::var("LOCKSTEP_CUDA_LIBRARY").unwrap_or_else(|_| "libcuda.so.1".into()),
        )
        .expect("libcuda");
        let init = lib
            .get::<unsafe extern "C" fn(u32) -> i32>(b"cuInit\0")
            .unwrap();
        let rc = init(0);
        let refused =
            lockstep::cuda::init::check_fork_safe().map_err(|e| e.contains("outside lockstep"));
        std::mem::forget(lib);
        rc == 0 && refused == Err(true)
    };
    std::process::exit(if ok { 0 } else { 1 });
}

/// Child scenario: 3 ranks share device 0 through the staged shm backend (run before this
/// process initialises CUDA, since the launcher refuses to fork afterwards).
fn staged_child() {
    use lockstep::comm::ReduceOp;
    let res = lockstep::launch::launch(&lockstep::launch::LaunchConfig::new(3), |rc| {
        let ctx = lockstep::cuda::Context::new(0)?;
        let stream = ctx.stream()?;
        let mut comm = lockstep::staged::StagedBackend::new(&ctx, rc.comm)?.into_communicator();
        let r = rc.rank as f32;
        let mut x = DeviceBuffer::from_host(&stream, &vec![r + 1.0; 1000])?;
        comm.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
        let mut g = DeviceBuffer::<f32>::zeros(&stream, 3 * 10)?;
        let mine = DeviceBuffer::from_host(&stream, &[r; 10])?;
        comm.all_gather(&mine, &mut g)?;
        let mut keep = DeviceBuffer::from_host(&stream, &[-1.0f32; 30])?;
        comm.gather(&mine, &mut keep, 0)?;
        comm.synchronize()?;
        let (xs, gs, ks) = (
            x.to_vec(&stream)?,
            g.to_vec(&stream)?,
            keep.to_vec(&stream)?,
        );
        let want_g: Vec<f32> = (0..30).map(|i| (i / 10) as f32).collect();
        let want_k = if rc.rank == 0 {
            want_g.clone()
        } else {
            vec![-1.0; 30]
        };
        Ok(xs.iter().all(|v| *v == 6.0) && gs == want_g && ks == want_k)
    });
    let ok = matches!(&res, Ok(v) if v.iter().all(|b| *b));
    if !ok {
        eprintln!("staged ranks: {res:?}");
    }
    std::process::exit(if ok { 0 } else { 1 });
}

/// Child scenario: 3 ranks share device 0 through the staged backend; rank 1 is `kill -9`ed
/// after an all-reduce, and ranks 0 and 2 must fail naming it, shrink to a communicator of the
/// two of them, and reduce device buffers on it (1 + 3 = 4), while the old one refuses calls.
/// Each survivor prints `survivor R ok`; the parent checks both lines.
fn staged_shrink_child() {
    use lockstep::comm::ReduceOp;
    use lockstep::CommError;
    let mut cfg = lockstep::launch::LaunchConfig::new(3);
    // The death is the test: the survivors must go on.
    cfg.fail_fast = false;
    let res = lockstep::launch::launch(&cfg, |rc| {
        let ctx = lockstep::cuda::Context::new(0)?;
        let s = ctx.stream()?;
        let mut comm = lockstep::staged::StagedBackend::new(&ctx, rc.comm)?.into_communicator();
        let me = rc.rank as f32 + 1.0;
        let mut x = DeviceBuffer::from_host(&s, &vec![me; 1 << 16])?;
        comm.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
        comm.synchronize()?;
        if rc.rank == 1 {
            let _ = std::process::Command::new("kill")
                .args(["-9", &std::process::id().to_string()])
                .status();
            std::thread::sleep(std::time::Duration::from_secs(60));
        }
        let t = std::time::Instant::now();
        let e = comm
            .all_reduce_in_place(&mut x, ReduceOp::Sum)
            .and_then(|()| comm.synchronize())
            .expect_err("rank 1 is dead");
        if !matches!(e, CommError::PeerLost { lost_rank: 1, .. }) {
            return Err(format!("expected PeerLost naming rank 1, got {e}").into());
        }
        let detected = t.elapsed();
        let mut small = comm.shrink()?;
        if (small.world_size(), small.global_ranks()) != (2, vec![0, 2]) {
            return Err(format!("shrunk to {:?}", small.global_ranks()).into());
        }
        for _ in 0..10 {
            let mut y = DeviceBuffer::from_host(&s, &vec![me; 1 << 16])?;
            small.all_reduce_in_place(&mut y, ReduceOp::Sum)?;
            small.synchronize()?;
            if y.to_vec(&s)?.iter().any(|v| *v != 4.0) {
                return Err("the survivors' sum is not 1 + 3".into());
            }
        }
        if !matches!(
            comm.all_reduce_in_place(&mut x, ReduceOp::Sum),
            Err(CommError::Shrunk { .. })
        ) {
            return Err("a call on the shrunk communicator did not fail with Shrunk".into());
        }
        println!(
            "survivor {} ok: death seen in {:.1} ms, shrink in {:.1} ms",
            rc.rank,
            detected.as_secs_f64() * 1e3,
            (t.elapsed() - detected).as_secs_f64() * 1e3
        );
        Ok(true)
    });
    // Rank 1's death makes the launch an error; what counts is the survivors' lines.
    eprintln!("launch: {:?}", res.map(|_| ()));
    std::process::exit(0);
}

/// The CPU twin of a kernel that sets `n` elements from one scalar.
type ScalarTwin = fn(&mut [f32], f32, i64);

/// Re-run this binary with `var` set (it selects one of the child scenarios above) and require a
/// clean exit.
fn run_child(var: &str) -> Result<(), String> {
    let st = std::process::Command::new(std::env::current_exe().unwrap())
        .env(var, "1")
        .status()
        .map_err(|e| e.to_string())?;
    if st.success() {
        Ok(())
    } else {
        Err(format!("child status {st}"))
    }
}

fn main() {
    // The staged ranks launched below wait for their peers at most LOCKSTEP_TIMEOUT_S, 60 s
    // unless set: a hang must end as an error well inside a GPU lease of a few minutes, not
    // after the 600 s default.
    if std::env::var_os("LOCKSTEP_TIMEOUT_S").is_none() {
        std::env::set_var("LOCKSTEP_TIMEOUT_S", "60");
    }
    if std::env::var_os("LOCKSTEP_GPU_FOREIGN_CHILD").is_some() {
        foreign_child();
    }
    if std::env::var_os("LOCKSTEP_GPU_STAGED_CHILD").is_some() {
        staged_child();
    }
    if std::env::var_os("LOCKSTEP_GPU_SHRINK_CHILD").is_some() {
        staged_shrink_child();
    }
    gpu::driver_or_skip();
    let mut r = gpu::Runner::new();
    // Before anything initialises CUDA here: the probe forks a child that does.
    let cache = std::env::temp_dir().join(format!("lockstep-gpu-cache-{}", std::process::id()));
    std::env::set_var("XDG_CACHE_HOME", &cache);
    r.run("probe_child_before_init", || {
        let s = lockstep::cuda::init::probe_child()?;
        println!("  {s}");
        lockstep::cuda::init::check_fork_safe().map_err(|e| format!("parent must stay clean: {e}"))
    });
    r.run("foreign_init_detected_real_driver", || {
        run_child("LOCKSTEP_GPU_FOREIGN_CHILD")
    });
    r.run("several_ranks_one_gpu_staged_shm", || {
        run_child("LOCKSTEP_GPU_STAGED_CHILD")
    });
    r.run("staged_ranks_shrink_after_a_death", || {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .env("LOCKSTEP_GPU_SHRINK_CHILD", "1")
            .output()
            .map_err(|e| e.to_string())?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        for r in [0, 2] {
            let Some(line) = text
                .lines()
                .find(|l| l.contains(&format!("survivor {r} ok")))
            else {
                return Err(format!("no `survivor {r} ok` line:\n{text}"));
            };
            println!("  {line}");
        }
        Ok(())
    });
    let ctx = gpu::context_or_skip();
    let stream = ctx.stream().unwrap();
    println!("  device: {:?}", ctx.info().unwrap());

    r.run("memory_roundtrip", || {
        let host: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
        let d = DeviceBuffer::from_host(&stream, &host).map_err(|e| e.to_string())?;
        check_eq(
            "h2d/d2h",
            &d.to_vec(&stream).map_err(|e| e.to_string())?,
            &host,
        )?;
        let z = DeviceBuffer::<i64>::zeros(&stream, 77).map_err(|e| e.to_string())?;
        check_eq(
            "zeros",
            &z.to_vec(&stream).map_err(|e| e.to_string())?,
            &[0i64; 77],
        )?;
        let mut d2 = DeviceBuffer::<f32>::alloc(&ctx, 1000).map_err(|e| e.to_string())?;
        d2.copy_from_device_async(&stream, &d)
            .map_err(|e| e.to_string())?;
        let mut pinned = PinnedBuffer::<f32>::zeros(&ctx, 1000).map_err(|e| e.to_string())?;
        // SAFETY: `pinned` lives and is untouched until the synchronize below.
        unsafe {
            d2.copy_to_pinned_async(&stream, &mut pinned)
                .map_err(|e| e.to_string())?
        };
        stream.synchronize().map_err(|e| e.to_string())?;
        check_eq("d2d + pinned", &pinned, &host)
    });

    r.run("elementwise_kernels_match_cpu", || {
        let f = ctx
            .function(KernelId::Elementwise.source(), "axpy_f32")
            .map_err(|e| e.to_string())?;
        let n = axpy_twin::N;
        let axpy_twin::Axpy {
            mut y,
            want: mut y_cpu,
            ..
        } = axpy_twin::axpy_2x(&f, &stream).map_err(|e| e.to_string())?;
        check_eq(
            "axpy_f32",
            &y.to_vec(&stream).map_err(|e| e.to_string())?,
            &y_cpu,
        )?;
        // The two kernels that set `y` from one scalar, each against its twin.
        let set: [(&str, f32, ScalarTwin); 2] = [
            ("scale_f32", 0.5, twins::scale_f32),
            ("fill_f32", 3.0, twins::fill_f32),
        ];
        for (name, value, twin) in set {
            ctx.function(KernelId::Elementwise.source(), name)
                .map_err(|e| e.to_string())?
                .launch(KernelGrid::for_elements(n))
                .arg_mut(&mut y)
                .scalar(value)
                .scalar(n as i64)
                .run(&stream)
                .map_err(|e| e.to_string())?;
            twin(&mut y_cpu, value, n as i64);
            check_eq(name, &y.to_vec(&stream).map_err(|e| e.to_string())?, &y_cpu)?;
        }
        Ok(())
    });

    r.run("launch_builder_rejects_bad_arguments", || {
        let f = ctx
            .function(KernelId::Elementwise.source(), "axpy_f32")
            .map_err(|e| e.to_string())?;
        let mut y = DeviceBuffer::<f32>::zeros(&stream, 10).map_err(|e| e.to_string())?;
        let x64 = DeviceBuffer::<f64>::zeros(&stream, 10).map_err(|e| e.to_string())?;
        let host = vec![0f32; 10];
        let cases = [
            (
                "count",
                f.launch(KernelGrid::for_elements(10))
                    .arg_mut(&mut y)
                    .scalar(1.0f32)
                    .run(&stream),
                "arguments given",
            ),
            (
                "dtype",
                f.launch(KernelGrid::for_elements(10))
                    .arg_mut(&mut DeviceBuffer::<f32>::zeros(&stream, 10).unwrap())
                    .arg(&x64)
                    .scalar(1.0f32)
                    .scalar(10i64)
                    .run(&stream),
                "expects f32",
            ),
            (
                "host",
                f.launch(KernelGrid::for_elements(10))
                    .arg_mut(&mut DeviceBuffer::<f32>::zeros(&stream, 10).unwrap())
                    .arg(&host)
                    .scalar(1.0f32)
                    .scalar(10i64)
                    .run(&stream),
                "Host",
            ),
            (
                "short",
                f.launch(KernelGrid::for_elements(20))
                    .arg_mut(&mut DeviceBuffer::<f32>::zeros(&stream, 10).unwrap())
                    .arg(&DeviceBuffer::<f32>::zeros(&stream, 10).unwrap())
                    .scalar(1.0f32)
                    .scalar(20i64)
                    .elements(20)
                    .run(&stream),
                "holds 10 elements",
            ),
        ];
        for (name, res, needle) in cases {
            match res {
                Err(e) if e.to_string().contains(needle) => {}
                other => {
                    return Err(format!(
                        "{name}: expected an error containing {needle:?}, got {other:?}"
                    ))
                }
            }
        }
        match ctx.function(KernelId::Elementwise.source(), "nope") {
            Err(e) if e.to_string().contains("declares no entry point") => Ok(()),
            other => Err(format!("unknown entry point: {:?}", other.err())),
        }
    });

    r.run("nvrtc_disk_cache_hit", || {
        let m1 = ctx
            .module(KernelId::Elementwise.source())
            .map_err(|e| e.to_string())?;
        let ctx2 = lockstep::cuda::Context::new(0).map_err(|e| e.to_string())?;
        let m2 = ctx2
            .module(KernelId::Elementwise.source())
            .map_err(|e| e.to_string())?;
        if m1.from_cache || !m2.from_cache {
            return Err(format!(
                "expected miss then hit, got from_cache={} then {}",
                m1.from_cache, m2.from_cache
            ));
        }
        Ok(())
    });

    r.run("events_time_work", || {
        let (a, b) = (
            ctx.event().map_err(|e| e.to_string())?,
            ctx.event().map_err(|e| e.to_string())?,
        );
        let mut y = DeviceBuffer::<f32>::zeros(&stream, 1 << 20).map_err(|e| e.to_string())?;
        let fill = ctx
            .function(KernelId::Elementwise.source(), "fill_f32")
            .map_err(|e| e.to_string())?;
        a.record(&stream).map_err(|e| e.to_string())?;
        fill.launch(KernelGrid::for_elements(1 << 20))
            .arg_mut(&mut y)
            .scalar(1.0f32)
            .scalar(1i64 << 20)
            .run(&stream)
            .map_err(|e| e.to_string())?;
        b.record(&stream).map_err(|e| e.to_string())?;
        let ms = a.elapsed_ms(&b).map_err(|e| e.to_string())?;
        if ms >= 0.0 {
            Ok(())
        } else {
            Err(format!("elapsed {ms} ms"))
        }
    });

    r.run("graph_capture_replay", || {
        let n = 4096usize;
        let mut x =
            DeviceBuffer::from_host(&stream, &vec![1.0f32; n]).map_err(|e| e.to_string())?;
        let scale = ctx
            .function(KernelId::Elementwise.source(), "scale_f32")
            .map_err(|e| e.to_string())?;
        let g = Graph::capture(&stream, |s| {
            scale
                .launch(KernelGrid::for_elements(n))
                .arg_mut(&mut x)
                .scalar(2.0f32)
                .scalar(n as i64)
                .run(s)
        })
        .map_err(|e| e.to_string())?;
        for _ in 0..3 {
            g.replay(&stream).map_err(|e| e.to_string())?;
        }
        check_eq(
            "x * 2^3",
            &x.to_vec(&stream).map_err(|e| e.to_string())?,
            &vec![8.0f32; n],
        )
    });

    r.run("single_init_guard_real_driver", || {
        let e = lockstep::cuda::init::check_fork_safe()
            .err()
            .ok_or("check_fork_safe must refuse after init")?;
        if !e.contains("by lockstep") {
            return Err(e);
        }
        let l = lockstep::launch::launch(&lockstep::launch::LaunchConfig::new(1), |_| Ok(0u64))
            .err()
            .ok_or("launch must refuse")?;
        if l.to_string().contains("CUDA was already initialised") {
            Ok(())
        } else {
            Err(l.to_string())
        }
    });
    r.run("drop_errors_are_deferred_not_panicked", || {
        ctx.check().map_err(|e| e.to_string())
    });
    let _ = std::fs::remove_dir_all(&cache);
    gpu::finish(r);
}
