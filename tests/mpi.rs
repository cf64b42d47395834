//! MPI through the MPI-5 standard ABI (`lockstep::mpi`): discovery of the library pip's `mpich`
//! ships, the refusals (a missing file, Open MPI 4.1's `libmpi.so.40`, MPICH's non-ABI
//! `libmpi.so.12`), and 4 ranks under `mpiexec` seen as 2 nodes × 2 (`MPIR_CVAR_NUM_CLIQUES=2`)
//! whose node leaders exchange messages with `MPI_ERRORS_RETURN` in force; the hierarchical
//! communicator on them (`mpi_hier`), and the C ABI's `lockstepCommInitFromEnv` joining it
//! (crates/capi/tests/c/capi_test.c, mode `hier`).
//!
//! Each case that needs another `LOCKSTEP_MPI_LIBRARY` runs this binary again in a child mode
//! (`LOCKSTEP_TEST_MPI_CHILD`), since the library is loaded once per process. Without an MPI-5
//! ABI library the cases that need one print `skipped: no MPI-5 ABI library (pip install mpich)`,
//! and fail with `LOCKSTEP_REQUIRE_MPI_ABI=1`; the Open MPI refusal is skipped without Open MPI 4
//! and fails when missing with `LOCKSTEP_REQUIRE_MPI=1` (CI installs it for `mpirun`).

mod common;
#[path = "mpi_hier/mod.rs"]
mod hier;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use lockstep::mpi::{Mpi, MpiError};
use lockstep::ReduceOp;

const CHILD: &str = "LOCKSTEP_TEST_MPI_CHILD";
const REQUIRE_ABI: &str = "LOCKSTEP_REQUIRE_MPI_ABI";
const NO_ABI: &str = "no MPI-5 ABI library (pip install mpich)";
/// The refusal's words, as the issue gives them.
const NEEDS: &str = "lockstep needs MPICH ≥ 5 (pip install mpich) or Open MPI ≥ 6";

fn main() -> ExitCode {
    match std::env::var(CHILD).as_deref() {
        Ok("probe") => return child_probe(),
        Ok("ranks") => return child_ranks(),
        Ok("hier") => return hier::child(),
        _ => {}
    }
    common::run(&[
        (
            "discovery_finds_the_abi_library",
            discovery_finds_the_abi_library,
        ),
        (
            "missing_override_is_a_clear_error",
            missing_override_is_a_clear_error,
        ),
        ("folder_override", folder_override),
        (
            "found_through_python3_on_path",
            found_through_python3_on_path,
        ),
        ("open_mpi_4_is_refused", open_mpi_4_is_refused),
        (
            "mpich_non_abi_library_is_refused",
            mpich_non_abi_library_is_refused,
        ),
        (
            "two_nodes_by_two_under_mpiexec",
            two_nodes_by_two_under_mpiexec,
        ),
        (
            "hierarchical_collectives_round_robin_nodes",
            hier::collectives_round_robin,
        ),
        (
            "hierarchical_collectives_block_nodes",
            hier::collectives_blocks,
        ),
        (
            "hierarchical_collectives_single_rank_nodes",
            hier::collectives_single_rank_nodes,
        ),
        ("hierarchical_mismatch_fails_every_rank", hier::mismatch),
        ("hierarchical_timeout_names_the_stuck_rank", hier::timeout),
        ("hierarchical_killed_rank_fails_every_rank", hier::killed),
        ("c_abi_across_nodes", c_abi_across_nodes),
    ])
}

/// Child mode `probe`: print what discovery says, one `key=value` per line, or `error=...`.
fn child_probe() -> ExitCode {
    match lockstep::mpi::library() {
        Ok(l) => {
            println!("path={}", l.path);
            println!("origin={}", l.origin);
            println!("reason={}", l.reason);
            println!("abi={}.{}", l.abi_version.0, l.abi_version.1);
            println!("mpi={}.{}", l.mpi_version.0, l.mpi_version.1);
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("error={e}");
            ExitCode::from(3)
        }
    }
}

/// Run this binary in `probe` mode with `env` changes (`None` removes a variable).
fn probe(env: &[(&str, Option<&str>)]) -> Result<String, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut cmd = Command::new(exe);
    cmd.env(CHILD, "probe").stdin(Stdio::null());
    for (k, v) in env {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    let out = cmd
        .output()
        .map_err(|e| format!("cannot run the probe: {e}"))?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The ABI library found in this process's environment, or the skip (`why`: print discovery's
/// reason first).
fn abi_library_why(why: bool) -> Result<&'static lockstep::mpi::LibraryInfo, String> {
    match lockstep::mpi::library() {
        Ok(l) => Ok(l),
        Err(e @ (MpiError::NotFound { .. } | MpiError::NotAbi { .. })) => {
            if why {
                println!("  {}", e.to_string().lines().next().unwrap_or(""));
            }
            Err(common::skip(REQUIRE_ABI, NO_ABI).unwrap_err())
        }
        Err(e) => Err(format!("discovery failed: {e}")),
    }
}

fn abi_library() -> Result<&'static lockstep::mpi::LibraryInfo, String> {
    abi_library_why(false)
}

/// The ABI library and the `mpiexec` installed beside it, or the skip.
fn abi_mpiexec() -> Result<(&'static lockstep::mpi::LibraryInfo, PathBuf), String> {
    let l = abi_library()?;
    let mpiexec = l.mpiexec.clone().ok_or_else(|| {
        common::skip(
            REQUIRE_ABI,
            &format!("no mpiexec installed beside {}", l.path),
        )
        .unwrap_err()
    })?;
    Ok((l, mpiexec))
}

fn discovery_finds_the_abi_library() -> Result<(), String> {
    let l = abi_library_why(true)?;
    println!(
        "  {} (found via {}; ABI {}.{}, MPI {}.{}, {})",
        l.path,
        l.origin,
        l.abi_version.0,
        l.abi_version.1,
        l.mpi_version.0,
        l.mpi_version.1,
        l.library_version
    );
    common::check(
        l.abi_version.0 == 1 && l.mpi_version.0 >= 5,
        "ABI 1.x of an MPI ≥ 5",
        format!("{l:?}"),
    )?;
    common::check(
        Path::new(&l.path)
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("libmpi_abi.so")),
        "the library is libmpi_abi.so*",
        &l.path,
    )?;
    let report = lockstep::report::env_report();
    common::check(
        report.contains("  mpi    : ") && report.contains("MPI_Abi_get_version = 1."),
        "lockstep env names the MPI and its ABI version",
        &report,
    )
}

fn missing_override_is_a_clear_error() -> Result<(), String> {
    let out = probe(&[("LOCKSTEP_MPI_LIBRARY", Some("/nonexistent/libmpi_abi.so.1"))])?;
    common::check(
        out.starts_with("error=no MPI-5 standard ABI library (libmpi_abi.so.1) found")
            && out.contains("/nonexistent/libmpi_abi.so.1 (LOCKSTEP_MPI_LIBRARY)")
            && out.contains(NEEDS)
            && out.contains("set LOCKSTEP_MPI_LIBRARY"),
        "a missing LOCKSTEP_MPI_LIBRARY names the file and what to install",
        &out,
    )?;
    // An empty folder: the file it would have held is named.
    let dir = common::scratch("mpi-empty");
    let out = probe(&[("LOCKSTEP_MPI_LIBRARY", Some(&dir.display().to_string()))])?;
    common::check(
        out.starts_with("error=no MPI-5 standard ABI library")
            && out.contains(&format!("{}/libmpi_abi.so.1", dir.display())),
        "an empty LOCKSTEP_MPI_LIBRARY folder is a clear error",
        &out,
    )
}

fn folder_override() -> Result<(), String> {
    let l = abi_library()?;
    let dir = Path::new(&l.path).parent().ok_or("library has no folder")?;
    let out = probe(&[("LOCKSTEP_MPI_LIBRARY", Some(&dir.display().to_string()))])?;
    common::check(
        out.contains(&format!("path={}", l.path))
            && out.contains("reason=set by LOCKSTEP_MPI_LIBRARY")
            && out.contains("abi=1."),
        "a folder in LOCKSTEP_MPI_LIBRARY finds its libmpi_abi.so.1",
        &out,
    )
}

fn found_through_python3_on_path() -> Result<(), String> {
    let l = abi_library()?;
    // pip puts the library in <prefix>/lib and the interpreter in <prefix>/bin.
    let prefix = Path::new(&l.path)
        .parent()
        .and_then(Path::parent)
        .ok_or("library path too short")?;
    let bin = prefix.join("bin");
    if !bin.join("python3").exists() {
        common::skip_part(&format!(
            "{} is not in a Python environment ({} has no python3)",
            l.path,
            bin.display()
        ));
        return Ok(());
    }
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = probe(&[
        ("LOCKSTEP_MPI_LIBRARY", None),
        ("VIRTUAL_ENV", None),
        ("CONDA_PREFIX", None),
        ("LD_LIBRARY_PATH", None),
        ("PATH", Some(&path)),
    ])?;
    common::check(
        out.contains(&format!("path={}", l.path)) && out.contains("origin=Python environment"),
        "the site-packages of the python3 on PATH lead to the wheel's library",
        &out,
    )
}

/// Open MPI 4's library, where Debian and Ubuntu put it.
fn open_mpi_4() -> Option<PathBuf> {
    ["x86_64-linux-gnu", "aarch64-linux-gnu"]
        .iter()
        .map(|a| PathBuf::from(format!("/usr/lib/{a}/libmpi.so.40")))
        .chain([PathBuf::from("/usr/lib64/openmpi/lib/libmpi.so.40")])
        .find(|p| p.exists())
}

fn open_mpi_4_is_refused() -> Result<(), String> {
    let Some(lib) = open_mpi_4() else {
        return common::skip(
            "LOCKSTEP_REQUIRE_MPI",
            "Open MPI 4's libmpi.so.40 is not installed (apt-get install libopenmpi-dev)",
        );
    };
    let out = probe(&[("LOCKSTEP_MPI_LIBRARY", Some(&lib.display().to_string()))])?;
    println!("  {}", out.trim());
    common::check(
        out.starts_with(&format!(
            "error=found Open MPI's libmpi.so.40 (not the MPI-5 standard ABI); {NEEDS}: "
        )) && out.contains("Open MPI v"),
        "Open MPI 4.1 is refused by name, with what to install",
        &out,
    )
}

fn mpich_non_abi_library_is_refused() -> Result<(), String> {
    let l = abi_library()?;
    let sibling = Path::new(&l.path).with_file_name("libmpi.so.12");
    if !sibling.exists() {
        common::skip_part(&format!("no {} beside the ABI library", sibling.display()));
        return Ok(());
    }
    let out = probe(&[("LOCKSTEP_MPI_LIBRARY", Some(&sibling.display().to_string()))])?;
    common::check(
        out.starts_with(&format!(
            "error=found MPICH's libmpi.so.12 (not the MPI-5 standard ABI); {NEEDS}: "
        )),
        "MPICH's own-ABI library is refused although it exports MPI_Abi_get_version",
        &out,
    )
}

/// Run this binary as 4 ranks under `mpiexec` (with `args` before the program and `env` set),
/// ending it if it takes more than 120 s; its exit status and output.
fn mpiexec_4(
    mpiexec: &Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> Result<(std::process::ExitStatus, std::process::Output), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    mpiexec_4_program(mpiexec, args, &exe, &[], env)
}

/// Run `program` with `program_args` as 4 ranks under `mpiexec`, as [`mpiexec_4`] does.
fn mpiexec_4_program(
    mpiexec: &Path,
    args: &[&str],
    program: &Path,
    program_args: &[&str],
    env: &[(&str, &str)],
) -> Result<(std::process::ExitStatus, std::process::Output), String> {
    let mut cmd = Command::new(mpiexec);
    cmd.args(["-n", "4"])
        .args(args)
        .arg(program)
        .args(program_args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", mpiexec.display()))?;
    let t = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().map_err(|e| e.to_string())? {
            break st;
        }
        if t.elapsed() > Duration::from_secs(120) {
            // SIGTERM first: mpiexec then ends its proxies and ranks, which SIGKILL would orphan.
            common::signal(child.id() as i32, libc::SIGTERM);
            let ended = common::wait_until(Duration::from_secs(10), || {
                matches!(child.try_wait(), Ok(Some(_)))
            });
            if !ended {
                let _ = child.kill();
            }
            let _ = child.wait();
            return Err("mpiexec -n 4 did not finish within 120 s".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    Ok((status, out))
}

fn two_nodes_by_two_under_mpiexec() -> Result<(), String> {
    let (l, mpiexec) = abi_mpiexec()?;
    let (status, out) = mpiexec_4(
        &mpiexec,
        &[],
        &[
            (CHILD, "ranks"),
            ("MPIR_CVAR_NUM_CLIQUES", "2"),
            ("LOCKSTEP_MPI_LIBRARY", &l.path),
            ("LOCKSTEP_TIMEOUT_S", "60"),
        ],
    )?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let both = format!("{stdout}\n--- stderr ---\n{stderr}");
    common::check(status.success(), "mpiexec -n 4 succeeds", &both)?;
    let mut lines: Vec<&str> = stdout.lines().filter(|l| l.starts_with("rank ")).collect();
    lines.sort();
    for l in &lines {
        println!("  {l}");
    }
    // Which ranks share a simulated node is MPICH's choice: check the shape, not the layout.
    let mut seen: Vec<(String, String)> = Vec::new();
    for l in &lines {
        let parts: Vec<&str> = l.split(", ").collect();
        let node = parts
            .first()
            .and_then(|p| p.split(": ").nth(1))
            .unwrap_or("");
        let local = parts.get(1).copied().unwrap_or("");
        let leader = parts.get(2) == Some(&"leader");
        common::check(
            (node == "node 0 of 2" || node == "node 1 of 2")
                && (local == "local 0 of 2" || local == "local 1 of 2")
                && leader == (local == "local 0 of 2"),
            "each rank is on node 0 or 1 of 2, local 0 or 1 of 2, the leader being local 0",
            &both,
        )?;
        seen.push((node.to_string(), local.to_string()));
    }
    seen.sort();
    seen.dedup();
    common::check(
        lines.len() == 4 && seen.len() == 4,
        "4 ranks: 2 nodes × 2 local ranks, each (node, local rank) once",
        &both,
    )?;
    common::check(
        lines
            .iter()
            .filter(|l| l.contains("all-reduce 10 ok"))
            .count()
            == 4
            && lines
                .iter()
                .filter(|l| l.contains("truncation returned"))
                .count()
                == 1
            && lines
                .iter()
                .filter(|l| l.contains("leaders exchanged"))
                .count()
                == 2,
        "every rank reduced; leaders exchanged and one saw MPI_ERR_TRUNCATE returned",
        &both,
    )
}

/// Child mode `ranks`, one of `mpiexec -n 4`: print one `rank R: ...` line, or the error.
fn child_ranks() -> ExitCode {
    match ranks() {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("error: {e}");
            ExitCode::from(3)
        }
    }
}

fn ranks() -> Result<String, String> {
    let mpi = Mpi::init().map_err(|e| e.to_string())?;
    let world = mpi.world().map_err(|e| e.to_string())?;
    let node = world.split_shared().map_err(|e| e.to_string())?;
    let leader = node.rank() == 0;
    let leaders = world
        .split(leader.then_some(0), world.rank() as i32)
        .map_err(|e| e.to_string())?;
    // Each node learns its index and the number of nodes from its leader (local rank 0).
    let mine: [u32; 2] = leaders
        .as_ref()
        .map_or([0, 0], |l| [l.rank() as u32, l.size() as u32]);
    let mut bytes = mine[0].to_le_bytes().to_vec();
    bytes.extend_from_slice(&mine[1].to_le_bytes());
    let all = node.all_gather_bytes(&bytes).map_err(|e| e.to_string())?;
    let word = |i: usize| u32::from_le_bytes([all[i], all[i + 1], all[i + 2], all[i + 3]]);
    let mut line = format!(
        "rank {}: node {} of {}, local {} of {}",
        world.rank(),
        word(0),
        word(4),
        node.rank(),
        node.size()
    );
    if let Some(l) = &leaders {
        line.push_str(", leader");
        let peer = 1 - l.rank();
        let text = format!("hello from node {}", l.rank());
        let mut reqs = vec![
            l.isend(peer, 7, text.into_bytes())
                .map_err(|e| e.to_string())?,
            l.irecv(peer, 7, 64).map_err(|e| e.to_string())?,
        ];
        l.wait_all("leader exchange", &mut reqs)
            .map_err(|e| e.to_string())?;
        let got = reqs.pop().map(|r| r.into_data()).unwrap_or_default();
        let got = String::from_utf8_lossy(&got).into_owned();
        if got != format!("hello from node {peer}") {
            return Err(format!("leader got {got:?}"));
        }
        line.push_str(&format!(", leaders exchanged {got:?}"));
        // MPI_ERRORS_RETURN: a message longer than its receive buffer is an error value here,
        // not an abort of the job.
        if l.rank() == 0 {
            let mut r = [l.isend(1, 8, vec![1u8; 16]).map_err(|e| e.to_string())?];
            l.wait_all("long send", &mut r).map_err(|e| e.to_string())?;
        } else {
            let mut r = [l.irecv(0, 8, 8).map_err(|e| e.to_string())?];
            match l.wait_all("short receive", &mut r) {
                Err(MpiError::Call { class: 15, .. }) => {
                    line.push_str(", truncation returned MPI_ERR_TRUNCATE")
                }
                other => return Err(format!("a truncated receive gave {other:?}")),
            }
        }
    }
    let mut x = [world.rank() as f64 + 1.0];
    world
        .all_reduce(&mut x, ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    if x[0] != 10.0 {
        return Err(format!("all-reduce gave {}", x[0]));
    }
    line.push_str(", all-reduce 10 ok");
    world.barrier().map_err(|e| e.to_string())?;
    Ok(line)
}

/// The C ABI across nodes: `capi_test hier` (crates/capi/tests/c/capi_test.c) as 4 ranks under
/// `mpiexec`, 2 simulated nodes × 2 (`MPIR_CVAR_NUM_CLIQUES=2`, `LOCKSTEP_MPI=on`): every rank's
/// `lockstepCommInitFromEnv` gives the hierarchical backend, and every collective, dtype and op
/// the program checks is correct.
fn c_abi_across_nodes() -> Result<(), String> {
    let (l, mpiexec) = abi_mpiexec()?;
    let bin = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("capi_test_mpi");
    common::capi::compile_c(
        Path::new(env!("CARGO_MANIFEST_DIR")),
        Path::new("crates/capi/tests/c/capi_test.c"),
        &bin,
    )?;
    let (status, out) = mpiexec_4_program(
        &mpiexec,
        &[],
        &bin,
        &["hier"],
        &[
            ("MPIR_CVAR_NUM_CLIQUES", "2"),
            ("LOCKSTEP_MPI", "on"),
            ("LOCKSTEP_MPI_LIBRARY", &l.path),
            ("LOCKSTEP_TIMEOUT_S", "60"),
        ],
    )?;
    let both = common::show(&out);
    common::check(
        status.success(),
        "mpiexec -n 4 capi_test hier succeeds",
        &both,
    )?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    for r in 0..4 {
        for want in [
            format!("rank {r} of 4: backend hier"),
            format!("rank {r}: hier: bcast verified"),
            format!("rank {r} of 4: all checks passed"),
        ] {
            common::check(
                stdout.lines().any(|l| l.starts_with(&want)),
                &format!("rank {r} reports `{want}`"),
                &both,
            )?;
        }
    }
    println!(
        "  4 ranks (2 nodes × 2) through lockstepCommInitFromEnv: backend hier, all checks passed"
    );
    Ok(())
}
