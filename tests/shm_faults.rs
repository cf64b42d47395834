//! Fault tests of the shared-memory backend: a small /dev/shm, ranks waiting long at join, a
//! segment left by a killed job, a rank stuck before a collective.
//!
//! `harness = false`: the tests fork, so the process stays single-threaded; they run in turn and
//! the binary ends with `N passed, M failed`. Each bounds its time and checks that no process and
//! no `lockstep-*` segment is left behind.

mod common;
#[path = "common/launched.rs"]
mod launched;

use std::time::{Duration, Instant};

use common::forked::{all_ok, collect as fork_ranks, no_leftovers, no_new_segments, segments_in};
use common::{check, within};
use launched::cpu_time;
use lockstep::comm::{Communicator, ReduceOp};
use lockstep::launch::{launch, LaunchConfig, RankContext, RankResult};
use lockstep::shm::{ShmComm, ShmConfig, ShmJob};

// -------------------------------------------------------------------------------------------------
// Helpers

// -------------------------------------------------------------------------------------------------
// Tests

/// 15 ranks wait at join for 2 s while the 16th sleeps: together they use well under 5 % of one
/// CPU for it (they sleep on a futex, not poll).
fn t_join_wait_cpu() -> Result<(), String> {
    let before = segments_in("/dev/shm");
    let world = 16;
    let late = Duration::from_secs(2);
    let cfg = ShmConfig {
        cpu_bind: lockstep::shm::CpuBind::None,
        ..small_cfg()
    };
    let job = ShmJob::with_config(world, cfg).map_err(|e| e.to_string())?;
    let t = Instant::now();
    let out = fork_ranks(world, Duration::from_secs(20), |rank| {
        if rank == world - 1 {
            std::thread::sleep(late);
        }
        let (cpu0, t0) = (cpu_time(), Instant::now());
        let mut c = job.communicator(rank).map_err(|e| e.to_string())?;
        let (cpu, wall) = (cpu_time() - cpu0, t0.elapsed().as_secs_f64());
        c.barrier().map_err(|e| e.to_string())?;
        Ok(format!("{cpu} {wall}"))
    })?;
    drop(job);
    let took = t.elapsed();
    let mut total = 0.0;
    let mut walls = Vec::new();
    for (r, e) in out.iter().enumerate() {
        e.check_ok(&format!("rank {r} succeeded"))?;
        let v: Vec<f64> = e.msg.split(' ').filter_map(|x| x.parse().ok()).collect();
        check(v.len() == 2, "rank reported cpu and wall time", &e.msg)?;
        if r < world - 1 {
            total += v[0];
            walls.push(v[1]);
        }
    }
    let min_wall = walls.iter().cloned().fold(f64::INFINITY, f64::min);
    println!(
        "  15 ranks waiting {min_wall:.2} s or more at join used {:.1} ms of CPU in total ({:.2} % of one CPU)",
        total * 1e3,
        total / min_wall * 100.0
    );
    check(
        min_wall >= late.as_secs_f64() * 0.9,
        "the ranks waited for the late one",
        format!("{walls:?}"),
    )?;
    check(
        total < 0.05 * late.as_secs_f64(),
        "15 waiting ranks use under 5 % of one CPU",
        format!("{:.1} ms in {min_wall:.2} s", total * 1e3),
    )?;
    within(took, Duration::from_secs(10), "done within 10 s")?;
    no_new_segments("/dev/shm", &before)
}

/// Rank `rank` of the `n` ranks of the named job `job`, as a communicator.
fn join_comm(job: &str, rank: usize, n: usize, cfg: ShmConfig) -> Result<Communicator, String> {
    let backend = ShmComm::join_named(job, rank, n, cfg).map_err(|e| e.to_string())?;
    Ok(Communicator::from_backend(Box::new(backend)))
}

/// Small slots (64 KiB) and heap (2 MiB): what most tests here need, quick to set up.
fn small_cfg() -> ShmConfig {
    ShmConfig {
        slot_bytes: 64 << 10,
        heap_bytes: 2 << 20,
        ..ShmConfig::default()
    }
}

/// Fails unless the file `path` exists; `what` says why it must.
fn exists(path: &str, what: &str) -> Result<(), String> {
    check(std::path::Path::new(path).exists(), what, path)
}

/// No child process of this test process is left.
fn no_children() -> Result<(), String> {
    let left = common::children_of(std::process::id() as i32);
    check(
        left.is_empty(),
        "no process left behind",
        format!("{left:?}"),
    )
}

/// A job id no other test run uses.
fn job_id(what: &str) -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("test-{what}-{}-{t:x}", std::process::id())
}

/// Bytes free in the file system holding `dir`.
fn free_bytes(dir: &str) -> u64 {
    let c = std::ffi::CString::new(dir).expect("path");
    // SAFETY: zeroed statvfs is a valid out-parameter.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid C string and out-parameter.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return 0;
    }
    st.f_bavail as u64 * st.f_frsize as u64
}

/// Mount a tmpfs of `mib` MiB on `dir`.
fn mount_tmpfs(dir: &str, mib: usize) -> Result<(), String> {
    let (src, fs, target) = (
        c"tmpfs",
        c"tmpfs",
        std::ffi::CString::new(dir).expect("path"),
    );
    let opts = std::ffi::CString::new(format!("size={mib}m,mode=1777")).expect("opts");
    // SAFETY: valid C strings; a fresh tmpfs mount.
    let r = unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            fs.as_ptr(),
            0,
            opts.as_ptr() as *const libc::c_void,
        )
    };
    if r != 0 {
        return Err(format!(
            "mount tmpfs on {dir}: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

/// Enter a mount namespace of our own, whose mounts vanish with it and do not reach the host's.
fn private_mount_namespace() -> Result<(), String> {
    // SAFETY: plain syscalls in a single-threaded child.
    unsafe {
        if libc::unshare(libc::CLONE_NEWNS) != 0 {
            return Err(format!(
                "unshare(CLONE_NEWNS): {}",
                std::io::Error::last_os_error()
            ));
        }
        if libc::mount(
            c"none".as_ptr(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        ) != 0
        {
            return Err(format!(
                "making / private: {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    Ok(())
}

/// Run `f` in a forked child inside a private mount namespace. `Ok(Some(report))`, or
/// `Ok(None)` when no mount namespace can be made here.
fn in_private_namespace(f: impl Fn() -> Result<String, String>) -> Result<Option<String>, String> {
    let out = fork_ranks(
        1,
        Duration::from_secs(40),
        |_| match private_mount_namespace() {
            Ok(()) => f(),
            Err(e) => Ok(format!("unavailable: {e}")),
        },
    )?;
    out[0].check_ok("the scenario passed")?;
    Ok(if out[0].msg.starts_with("unavailable:") {
        println!("  no private mount namespace ({})", out[0].msg);
        None
    } else {
        Some(out[0].msg.clone())
    })
}

/// Fails unless the `what` error `e` names each of `wants`.
fn names_all(what: &str, e: &str, wants: [String; 4]) -> Result<(), String> {
    for want in wants {
        check(
            e.contains(&want),
            &format!("the {what} error names '{want}'"),
            e,
        )?;
    }
    Ok(())
}

/// The small-segment scenario, in a `cap_mib` MiB tmpfs at `dir` (`None`: /dev/shm):
/// a segment whose slots do not fit fails to be created with an error that names the directory,
/// the bytes needed and the bytes free, in well under a second and with nothing left behind; a
/// job that fits runs, and a shared buffer that does not fit is refused with the same kind of
/// error instead of a SIGBUS.
fn small_shm_scenario(dir: Option<&str>, cap_mib: usize) -> Result<String, String> {
    let shown = dir.unwrap_or("/dev/shm");
    let before = segments_in(shown);
    match dir {
        // Through the environment, as a user would (this is a forked child: nobody else sees it).
        Some(d) => std::env::set_var("LOCKSTEP_SHM_DIR", d),
        None => std::env::remove_var("LOCKSTEP_SHM_DIR"),
    }
    let cfg = |slot: usize| ShmConfig {
        slot_bytes: slot,
        join_timeout: Duration::from_secs(10),
        ..ShmConfig::from_env().expect("shm settings from the environment")
    };
    // 4 ranks with 2 slots of cap/4 each need twice the room (plus the header).
    let world = 4;
    let slot = (cap_mib << 20) / 4;
    let needed = 8192 + world * 2 * slot;
    let free = free_bytes(shown);
    let t = Instant::now();
    let e = match ShmComm::join_named(&job_id("small"), 0, world, cfg(slot)) {
        Ok(_) => {
            return Err(format!(
                "a {needed}-byte segment was created in a {cap_mib} MiB {shown}"
            ))
        }
        Err(e) => e.to_string(),
    };
    let took = t.elapsed();
    let summary = format!(
        "creation refused in {:.1} ms: {e}",
        took.as_secs_f64() * 1e3
    );
    // The segment also holds per-pair point-to-point mailboxes, so the named size is at least the
    // header and slots, and more than what is free.
    let named: Option<usize> = e
        .split("cannot reserve ")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|n| n.parse().ok());
    check(
        named.is_some_and(|n| n >= needed && n as u64 > free),
        &format!("the creation error names at least {needed} bytes needed"),
        &e,
    )?;
    names_all(
        "creation",
        &e,
        [
            shown.to_string(),
            format!("{free} bytes"),
            "free".into(),
            "LOCKSTEP_SHM_SLOT_BYTES".into(),
        ],
    )?;
    within(
        took,
        Duration::from_secs(1),
        "the creation error comes at once",
    )?;
    no_new_segments(shown, &before)?;

    // A job that fits; rank 0 asks for a shared buffer twice the size of the tmpfs.
    let job = job_id("fits");
    let big = cap_mib << 21;
    let t = Instant::now();
    let out = fork_ranks(2, Duration::from_secs(20), |rank| {
        let mut c = join_comm(&job, rank, 2, cfg(1 << 20))?;
        let refused = if rank == 0 {
            match c.alloc_shared::<u8>(big) {
                Ok(_) => {
                    return Err(format!(
                        "a {big}-byte shared buffer was handed out in a {cap_mib} MiB {shown}"
                    ))
                }
                Err(e) => e.to_string(),
            }
        } else {
            String::new()
        };
        let mut x = c.alloc_shared::<f32>(100_000).map_err(|e| e.to_string())?;
        x.fill(rank as f32 + 1.0);
        c.all_reduce_in_place(&mut x, ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        if x.iter().any(|v| *v != 3.0) {
            return Err("wrong sum".into());
        }
        Ok(refused)
    })?;
    let ran = t.elapsed();
    all_ok(&out, "of the fitting job finished normally (no SIGBUS)")?;
    let e = &out[0].msg;
    names_all(
        "alloc_shared",
        e,
        [
            shown.to_string(),
            format!("{} bytes", big.next_multiple_of(4096)),
            "free".into(),
            "cannot reserve".into(),
        ],
    )?;
    within(
        ran,
        Duration::from_secs(10),
        "the fitting job ran within 10 s",
    )?;
    no_new_segments(shown, &before)?;
    Ok(format!(
        "in a {cap_mib} MiB tmpfs on {shown}: {summary}; the fitting job ran in {:.2} s, refusing a {big}-byte buffer: {e}",
        ran.as_secs_f64()
    ))
}

/// A 16 MiB /dev/shm (as Docker's 64 MiB one, smaller): clear errors naming the directory, the
/// bytes needed and free, no SIGBUS, nothing left behind.
fn t_small_dev_shm() -> Result<(), String> {
    let host_before = segments_in("/dev/shm");
    let t = Instant::now();
    match in_private_namespace(|| {
        mount_tmpfs("/dev/shm", 16)?;
        small_shm_scenario(None, 16)
    })? {
        Some(report) => println!("  {report}"),
        None => {
            common::skip_part("a small /dev/shm needs a private mount namespace; small_shm_dir covers the same with LOCKSTEP_SHM_DIR")
        }
    }
    within(t.elapsed(), Duration::from_secs(40), "done within 40 s")?;
    no_leftovers(&host_before)
}

/// The same with LOCKSTEP_SHM_DIR on a 16 MiB tmpfs of our own (named segments made with `open`
/// in that directory instead of `shm_open`): mounted in a private mount namespace, else on the
/// host (and unmounted), else skipped.
fn t_small_shm_dir() -> Result<(), String> {
    let host_before = segments_in("/dev/shm");
    let dir = common::scratch("small-shm");
    let d = dir.to_str().ok_or("scratch path")?.to_string();
    let t = Instant::now();
    let scenario = || {
        mount_tmpfs(&d, 16)?;
        small_shm_scenario(Some(&d), 16)
    };
    let r = match in_private_namespace(scenario) {
        Ok(Some(report)) => Ok(report),
        Ok(None) => match mount_tmpfs(&d, 16) {
            Ok(()) => {
                let out = fork_ranks(1, Duration::from_secs(40), |_| small_shm_scenario(Some(&d), 16));
                // SAFETY: valid C string; our own mount.
                unsafe { libc::umount2(std::ffi::CString::new(d.clone()).expect("path").as_ptr(), libc::MNT_DETACH) };
                out.and_then(|o| {
                    o[0].check_ok("the scenario passed")?;
                    Ok(format!("(on the host's mount namespace) {}", o[0].msg))
                })
            }
            Err(e) => Ok(format!("skipped: neither a private mount namespace nor a tmpfs mount is permitted here ({e})")),
        },
        Err(e) => Err(e),
    };
    let _ = std::fs::remove_dir_all(&dir);
    println!("  {}", r?);
    within(t.elapsed(), Duration::from_secs(40), "done within 40 s")?;
    no_leftovers(&host_before)
}

/// Bytes of the segment file whose name contains `needle` that this process has mapped (the
/// `Rss` of its mappings in /proc/self/smaps); `None` when it has no such mapping.
fn mapped_bytes(needle: &str) -> Option<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let (mut inside, mut total) = (false, None);
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && first.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
            inside = line.contains(needle);
        } else if let (true, Some(v)) = (inside, line.strip_prefix("Rss:")) {
            let kib: u64 = v.trim().trim_end_matches("kB").trim().parse().ok()?;
            total = Some(total.unwrap_or(0) + kib * 1024);
        }
    }
    total
}

/// A rank maps its staging slots when it first runs a collective that stages data, and a mailbox
/// when it first uses it, not when it joins: after joining and small (fast-path) collectives it
/// has mapped less than a quarter of one slot; large collectives and point-to-point messages after
/// them give exact results, and then both of its slots are mapped.
fn t_slots_mapped_on_first_use() -> Result<(), String> {
    let before = segments_in("/dev/shm");
    let job = job_id("lazy");
    let slot = 1usize << 20;
    let out = fork_ranks(2, Duration::from_secs(20), |rank| {
        // cma_bytes 0: the large message streams through the mailbox's ring.
        let cfg = ShmConfig {
            slot_bytes: slot,
            heap_bytes: 2 << 20,
            cma_bytes: 0,
            join_timeout: Duration::from_secs(10),
            ..ShmConfig::default()
        };
        let mut c = join_comm(&job, rank, 2, cfg)?;
        let mut small = [rank as i64 + 1; 64];
        c.all_reduce_in_place(&mut small, ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        c.barrier().map_err(|e| e.to_string())?;
        if small != [3; 64] {
            return Err(format!("small all_reduce gave {:?}", &small[..4]));
        }
        let early = mapped_bytes(&job).ok_or("no mapping of the segment")?;
        // 4 MiB: larger than a slot, so it streams through both slots in pieces.
        let n = 1 << 20;
        let mut big: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 + rank as f32).collect();
        c.all_reduce_in_place(&mut big, ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        if let Some(i) = (0..n).find(|&i| big[i] != 2.0 * (i % 1000) as f32 + 1.0) {
            return Err(format!("large all_reduce: element {i} is {}", big[i]));
        }
        let msg: Vec<u32> = (0..100_000u32).map(|i| i ^ 0x5a5a).collect();
        if rank == 0 {
            c.send(&msg, 1).map_err(|e| e.to_string())?;
        } else {
            let mut got = vec![0u32; msg.len()];
            c.recv(&mut got, 0).map_err(|e| e.to_string())?;
            if got != msg {
                return Err("the 400 kB message arrived changed".into());
            }
        }
        c.all_reduce_in_place(&mut small, ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        if small != [6; 64] {
            return Err(format!(
                "small all_reduce after large ones gave {:?}",
                &small[..4]
            ));
        }
        let late = mapped_bytes(&job).ok_or("no mapping of the segment")?;
        Ok(format!("{early} {late}"))
    })?;
    for (r, e) in out.iter().enumerate() {
        e.check_ok(&format!("rank {r} succeeded"))?;
        let v: Vec<u64> = e.msg.split(' ').filter_map(|x| x.parse().ok()).collect();
        check(v.len() == 2, "rank reported mapped bytes", &e.msg)?;
        println!(
            "  rank {r}: {} KiB of the segment mapped after join and small collectives, {} KiB after large ones",
            v[0] / 1024,
            v[1] / 1024
        );
        check(
            v[0] < slot as u64 / 4,
            &format!("rank {r} mapped under a quarter slot before staging anything"),
            format!("{} bytes", v[0]),
        )?;
        check(
            v[1] >= 2 * slot as u64,
            &format!("rank {r} mapped both its slots once it staged data"),
            format!("{} bytes", v[1]),
        )?;
    }
    no_leftovers(&before)
}

/// A named segment fits its tmpfs when it is created, then something else fills the tmpfs: the
/// first collective that needs a rank's slots fails on every rank with an error (the rank that
/// found no room says so), without a SIGBUS and without waiting for the timeout.
fn room_gone_scenario(dir: &str) -> Result<String, String> {
    std::env::set_var("LOCKSTEP_SHM_DIR", dir);
    let job = job_id("gone");
    let t = Instant::now();
    let out = fork_ranks(2, Duration::from_secs(20), |rank| {
        // 2 ranks × 2 slots of 2 MiB: 8 MiB and the mailboxes, which fit the 16 MiB tmpfs.
        let cfg = ShmConfig {
            slot_bytes: 2 << 20,
            heap_bytes: 2 << 20,
            join_timeout: Duration::from_secs(10),
            timeout: Duration::from_secs(30),
            ..ShmConfig::from_env().expect("shm settings from the environment")
        };
        let mut c = join_comm(&job, rank, 2, cfg)?;
        c.barrier().map_err(|e| e.to_string())?;
        if rank == 0 {
            // Another job takes all but 5 MiB: room for one rank's slots (4 MiB), not both.
            let keep = 5u64 << 20;
            let free = free_bytes(dir);
            let f = std::fs::File::create(format!("{dir}/filler")).map_err(|e| e.to_string())?;
            use std::os::fd::AsRawFd;
            // SAFETY: a descriptor we own.
            let r = unsafe {
                libc::posix_fallocate(f.as_raw_fd(), 0, free.saturating_sub(keep) as libc::off_t)
            };
            if r != 0 {
                return Err(format!("filling {dir}: error {r}"));
            }
        }
        c.barrier().map_err(|e| e.to_string())?;
        let mut big = vec![1f32; 1 << 19];
        match c.all_reduce_in_place(&mut big, ReduceOp::Sum) {
            Ok(()) => Err("the all_reduce passed with no room for both ranks' slots".into()),
            Err(e) => Ok(e.to_string()),
        }
    })?;
    let took = t.elapsed();
    let mut said = 0;
    for (r, e) in out.iter().enumerate() {
        e.check_ok(&format!("rank {r} got an error, not a signal (no SIGBUS)"))?;
        said += e.msg.contains("no room for them any more") as usize;
    }
    check(
        said >= 1,
        "a rank's error says its slots found no room",
        format!("{:?}", out.iter().map(|e| &e.msg).collect::<Vec<_>>()),
    )?;
    within(
        took,
        Duration::from_secs(10),
        "every rank failed at once, not at the timeout",
    )?;
    Ok(format!(
        "failed in {:.2} s: rank 0: {}; rank 1: {}",
        took.as_secs_f64(),
        out[0].msg,
        out[1].msg
    ))
}

/// [`room_gone_scenario`] in a 16 MiB tmpfs of a private mount namespace (skipped without one).
fn t_room_gone_after_creation() -> Result<(), String> {
    let host_before = segments_in("/dev/shm");
    let dir = common::scratch("room-gone");
    let d = dir.to_str().ok_or("scratch path")?.to_string();
    let r = in_private_namespace(|| {
        mount_tmpfs(&d, 16)?;
        room_gone_scenario(&d)
    });
    let _ = std::fs::remove_dir_all(&dir);
    match r? {
        Some(report) => println!("  {report}"),
        None => common::skip_part("needs a private mount namespace for its own small tmpfs"),
    }
    no_leftovers(&host_before)
}

/// LOCKSTEP_SHM_DIR must be an absolute path to an existing directory; anything else is refused
/// by name before any segment is made.
fn t_shm_dir_checked() -> Result<(), String> {
    let dir = common::scratch("shm-dir");
    let file = dir.join("a-file");
    std::fs::write(&file, b"").map_err(|e| e.to_string())?;
    let cases = [
        ("/nonexistent/lockstep-shm".to_string(), "cannot be used"),
        ("relative/dir".to_string(), "not an absolute path"),
        (file.display().to_string(), "not a directory"),
        (String::new(), "not an absolute path"),
    ];
    for (dir, why) in cases {
        let cfg = ShmConfig {
            shm_dir: Some(dir.clone().into()),
            ..ShmConfig::default()
        };
        let e = match ShmComm::join_named(&job_id("dir"), 0, 1, cfg) {
            Ok(_) => return Err(format!("LOCKSTEP_SHM_DIR={dir:?} was accepted")),
            Err(e) => e.to_string(),
        };
        check(
            e.contains(&format!("LOCKSTEP_SHM_DIR={dir:?}")) && e.contains(why),
            &format!("LOCKSTEP_SHM_DIR={dir:?} is refused: {why}"),
            &e,
        )?;
    }
    let _ = std::fs::remove_dir_all(file.parent().expect("parent"));
    Ok(())
}

/// A rank that dies after joining while the others still wait for a late one: the waiting ranks
/// fail within half a second naming it, instead of at the join timeout.
fn t_join_peer_death() -> Result<(), String> {
    let before = segments_in("/dev/shm");
    let cfg = ShmConfig {
        slot_bytes: 64 << 10,
        heap_bytes: 2 << 20,
        join_timeout: Duration::from_secs(30),
        ..ShmConfig::default()
    };
    let job = ShmJob::with_config(3, cfg).map_err(|e| e.to_string())?;
    let t = Instant::now();
    let out = fork_ranks(3, Duration::from_secs(10), |rank| match rank {
        // Never joins within the test.
        2 => {
            std::thread::sleep(Duration::from_secs(1));
            Ok(String::new())
        }
        _ => {
            if rank == 1 {
                // Dies 300 ms into its wait at join.
                std::thread::spawn(|| {
                    std::thread::sleep(Duration::from_millis(300));
                    // SAFETY: ends this forked rank at once, as a crash would.
                    unsafe { libc::_exit(9) };
                });
            }
            let t = Instant::now();
            match job.join(rank) {
                Ok(_) => Err("join succeeded without rank 2".into()),
                Err(e) => Ok(format!("{:.3} {e}", t.elapsed().as_secs_f64())),
            }
        }
    })?;
    drop(job);
    check(
        libc::WIFEXITED(out[1].status) && libc::WEXITSTATUS(out[1].status) == 9,
        "rank 1 died as planned",
        out[1].describe(),
    )?;
    let (secs, msg) = out[0]
        .msg
        .split_once(' ')
        .ok_or_else(|| format!("rank 0: {}", out[0].msg))?;
    let secs: f64 = secs.parse().map_err(|_| out[0].msg.clone())?;
    check(
        msg.contains("rank 1 (pid") && msg.contains("died before all ranks had joined"),
        "rank 0's error names the dead rank",
        msg,
    )?;
    check(
        (0.25..0.8).contains(&secs),
        "rank 0 noticed within 0.5 s of the death",
        format!("{secs:.3} s"),
    )?;
    within(t.elapsed(), Duration::from_secs(5), "done within 5 s")?;
    no_leftovers(&before)
}

/// Start rank 0 of a 2-rank named job in a child that waits (in vain) for rank 1; returns its
/// pid once the segment exists and its header is written.
fn creator_waiting(job: &str) -> Result<i32, String> {
    let path = format!("/dev/shm/lockstep-{job}");
    // SAFETY: single-threaded test process; the child only runs lockstep code and _exits.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let cfg = ShmConfig {
            join_timeout: Duration::from_secs(30),
            ..small_cfg()
        };
        let r = ShmComm::join_named(job, 0, 2, cfg);
        // SAFETY: leave the child without running the parent's destructors.
        unsafe { libc::_exit(r.is_err() as i32) };
    }
    // The header is written right after the file is created and reserved: give it a moment.
    if !common::wait_until(Duration::from_secs(5), || {
        std::path::Path::new(&path).exists()
    }) {
        common::signal(pid, libc::SIGKILL);
        // SAFETY: our child.
        unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
        return Err(format!("{path} did not appear"));
    }
    std::thread::sleep(Duration::from_millis(100));
    Ok(pid)
}

fn kill_and_reap(pid: i32) {
    common::signal(pid, libc::SIGKILL);
    // SAFETY: our child.
    unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
}

/// A named segment whose creator was killed is removed at once by the next launch's sweep (and
/// one whose creator lives is kept); a new rank 0 with the same job id reclaims it and runs.
fn t_stale_segment_reclaimed() -> Result<(), String> {
    let before = segments_in("/dev/shm");
    let (dead, live) = (job_id("dead"), job_id("live"));
    let (dead_path, live_path) = (
        format!("/dev/shm/lockstep-{dead}"),
        format!("/dev/shm/lockstep-{live}"),
    );
    let a = creator_waiting(&dead)?;
    let b = match creator_waiting(&live) {
        Ok(b) => b,
        Err(e) => {
            kill_and_reap(a);
            return Err(e);
        }
    };
    kill_and_reap(a);
    exists(&dead_path, "a killed creator leaves its segment behind")?;
    let t = Instant::now();
    // The fallback rule (for segments without a readable header) says "never" here, so what is
    // removed is removed on the header's word alone.
    let removed = lockstep::shm::reclaim_stale_segments(&|_, _| false);
    let took = t.elapsed();
    let (dead_gone, live_kept) = (
        !std::path::Path::new(&dead_path).exists(),
        std::path::Path::new(&live_path).exists(),
    );
    kill_and_reap(b);
    check(
        dead_gone && removed.iter().any(|p| p.display().to_string() == dead_path),
        "the dead creator's segment is removed",
        format!("{removed:?}"),
    )?;
    check(live_kept, "a running creator's segment is kept", &live_path)?;
    within(
        took,
        Duration::from_millis(500),
        "the sweep takes under 0.5 s",
    )?;

    // Same job id again: rank 0 finds the leftover of its dead creator, removes it and runs.
    exists(
        &live_path,
        "the second creator's segment is left after its kill",
    )?;
    let t = Instant::now();
    let out = fork_ranks(2, Duration::from_secs(20), |rank| {
        let cfg = ShmConfig {
            join_timeout: Duration::from_secs(10),
            ..small_cfg()
        };
        let mut c = join_comm(&live, rank, 2, cfg)?;
        let mut x = [rank as i64 + 1; 8];
        c.all_reduce_in_place(&mut x, ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
        if x != [3; 8] {
            return Err(format!("wrong sum {x:?}"));
        }
        Ok(String::new())
    })?;
    let took = t.elapsed();
    all_ok(&out, "of the rerun with the same job id succeeded")?;
    within(
        took,
        Duration::from_secs(3),
        "the rerun with the same job id took under 3 s",
    )?;
    no_leftovers(&before)
}

/// Rank 2 comes 1.5 s late to all_reduce #2 with a 0.8 s timeout: every rank's error, not only
/// that of the rank that timed out first, names rank 2 and the collective.
fn t_timeout_names_stuck_rank_everywhere() -> Result<(), String> {
    let mut cfg = LaunchConfig::new(4);
    cfg.shm = ShmConfig {
        timeout: Duration::from_millis(800),
        ..small_cfg()
    };
    cfg.fail_fast = false;
    let t = Instant::now();
    let out = launch(&cfg, |mut ctx: RankContext| -> RankResult<(f64, String)> {
        ctx.comm.barrier()?;
        if ctx.rank == 2 {
            std::thread::sleep(Duration::from_millis(1500));
        }
        let t = Instant::now();
        let e = ctx
            .comm
            .all_reduce_in_place(&mut [1f32; 4], ReduceOp::Sum)
            .err()
            .ok_or("all_reduce passed")?;
        Ok((t.elapsed().as_secs_f64(), e.to_string()))
    })
    .map_err(|e| e.to_string())?;
    let took = t.elapsed();
    for (r, (secs, msg)) in out.iter().enumerate() {
        check(
            msg.contains(
                "rank 2 is stuck before all_reduce #2 (rank 2 is at collective #1, barrier)",
            ),
            &format!("rank {r}'s error names the stuck rank and collective"),
            msg,
        )?;
        let bound = if r == 2 { 0.0..0.5 } else { 0.7..2.0 };
        check(
            bound.contains(secs),
            &format!("rank {r} failed after {bound:?} s"),
            format!("{secs:.2} s: {msg}"),
        )?;
    }
    within(took, Duration::from_secs(6), "done within 6 s")?;
    no_children()
}

fn main() -> std::process::ExitCode {
    common::run(&[
        ("join_wait_cpu", t_join_wait_cpu),
        ("join_peer_death", t_join_peer_death),
        ("small_dev_shm", t_small_dev_shm),
        ("small_shm_dir", t_small_shm_dir),
        ("shm_dir_checked", t_shm_dir_checked),
        ("slots_mapped_on_first_use", t_slots_mapped_on_first_use),
        ("room_gone_after_creation", t_room_gone_after_creation),
        ("stale_segment_reclaimed", t_stale_segment_reclaimed),
        (
            "timeout_names_stuck_rank_everywhere",
            t_timeout_names_stuck_rank_everywhere,
        ),
    ])
}
