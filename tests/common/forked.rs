//! Forked ranks for the `harness = false` tests of the shared-memory backend (`shm_faults`,
//! `shm_shrink`, `shm_grow`): fork processes that each run a closure and report one line on a
//! pipe, signal the parent when they reach a point, and collect how each ended, with a
//! deadline after which what is left is killed. Also the seeded generator of their moments and
//! victims, and the checks that nothing (process, `lockstep-*` segment) is left behind.

use std::io::Read;
use std::os::fd::{FromRawFd, RawFd};
use std::time::{Duration, Instant};

use super::check;

/// splitmix64: the moments and victims of a run, from its seed.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A seed from the variable `var` (to replay a run), else from the clock; printed first.
pub fn seed(var: &str) -> u64 {
    let s = std::env::var(var)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    println!("seed {s} (replay with {var}={s})");
    s
}

fn pipe() -> (RawFd, RawFd) {
    let mut fds = [0; 2];
    // SAFETY: valid out-array of two fds.
    let r = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(r, 0, "pipe2: {}", std::io::Error::last_os_error());
    (fds[0], fds[1])
}

fn write_all(fd: RawFd, b: &[u8]) {
    // SAFETY: writing a buffer we own to our pipe end; under PIPE_BUF, so atomic.
    unsafe { libc::write(fd, b.as_ptr() as *const libc::c_void, b.len()) };
}

/// A rank's way to tell the parent it reached a point (one byte on a pipe).
#[derive(Clone, Copy)]
pub struct Ready(RawFd);

impl Ready {
    pub fn signal(&self) {
        write_all(self.0, b"r");
    }
}

/// Forked processes: their pids (in the order they were forked: the ranks, then any
/// replacements), the read ends of their ready and result pipes, and the write ends that later
/// forks hand on.
pub struct Ranks {
    pub pids: Vec<i32>,
    ready: RawFd,
    out: std::fs::File,
    wr: RawFd,
    ready_wr: RawFd,
}

/// What a process reported: its exit status (`waitpid` form) and the line it wrote.
pub struct Ended {
    pub status: i32,
    pub msg: String,
}

impl Ended {
    pub fn killed(&self) -> bool {
        libc::WIFSIGNALED(self.status) && libc::WTERMSIG(self.status) == libc::SIGKILL
    }

    pub fn ok(&self) -> bool {
        libc::WIFEXITED(self.status) && libc::WEXITSTATUS(self.status) == 0
    }

    pub fn describe(&self) -> String {
        if libc::WIFSIGNALED(self.status) {
            format!("killed by signal {}", libc::WTERMSIG(self.status))
        } else {
            format!("exit {}", libc::WEXITSTATUS(self.status))
        }
    }

    /// `Err` naming `what` (the process and what it had to do), how it ended and its report,
    /// unless it exited 0.
    pub fn check_ok(&self, what: &str) -> Result<(), String> {
        check(
            self.status == 0,
            what,
            format!("{}: {}", self.describe(), self.msg),
        )
    }
}

/// Fork `n` ranks running `f(rank, ready)`; each writes its result (one line) to a pipe and
/// `_exit`s 0 on `Ok`, 1 on `Err`.
pub fn fork_ranks(n: usize, f: impl Fn(usize, Ready) -> Result<String, String>) -> Ranks {
    let (rd, wr) = pipe();
    let (ready_rd, ready_wr) = pipe();
    let mut ranks = Ranks {
        pids: Vec::new(),
        ready: ready_rd,
        // SAFETY: rd is our pipe end, owned from here on by the File.
        out: unsafe { std::fs::File::from_raw_fd(rd) },
        wr,
        ready_wr,
    };
    for rank in 0..n {
        ranks.fork(|ready| f(rank, ready));
    }
    ranks
}

/// Every process of `out` exited 0: else `Err` naming the first that did not, as `rank R what`.
pub fn all_ok(out: &[Ended], what: &str) -> Result<(), String> {
    for (r, e) in out.iter().enumerate() {
        e.check_ok(&format!("rank {r} {what}"))?;
    }
    Ok(())
}

/// Fork `n` ranks running `f(rank)` and collect how they ended ([`Ranks::finish`]).
pub fn collect(
    n: usize,
    deadline: Duration,
    f: impl Fn(usize) -> Result<String, String>,
) -> Result<Vec<Ended>, String> {
    fork_ranks(n, |rank, _| f(rank)).finish(deadline)
}

impl Ranks {
    /// Fork one more process running `f(ready)` (a replacement rank, say); its report is the
    /// next entry of [`finish`](Self::finish)'s list.
    pub fn fork(&mut self, f: impl FnOnce(Ready) -> Result<String, String>) -> i32 {
        let slot = self.pids.len();
        // SAFETY: the test process is single-threaded; the child runs `f` and `_exit`s.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let (code, msg) = match f(Ready(self.ready_wr)) {
                Ok(m) => (0, m),
                Err(m) => (1, m),
            };
            let mut line = format!("{slot}\t{}", msg.replace('\n', " "));
            line.truncate(3000);
            line.push('\n');
            write_all(self.wr, line.as_bytes());
            // SAFETY: leave the child without running the parent's destructors.
            unsafe { libc::_exit(code) };
        }
        if pid < 0 {
            let e = std::io::Error::last_os_error();
            for &p in &self.pids {
                super::signal(p, libc::SIGKILL);
            }
            panic!("fork: {e}");
        }
        self.pids.push(pid);
        pid
    }

    /// Wait for `k` ready bytes, at most `timeout`.
    pub fn await_ready(&self, k: usize, timeout: Duration) -> Result<(), String> {
        let start = Instant::now();
        let mut got = 0;
        while got < k {
            let left = timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Err(format!("{got} of {k} ranks ready after {timeout:?}"));
            }
            let mut p = libc::pollfd {
                fd: self.ready,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            if unsafe { libc::poll(&mut p, 1, left.as_millis().max(1) as i32) } <= 0 {
                continue;
            }
            let mut b = [0u8; 16];
            // SAFETY: reading into a buffer we own, at most its length.
            let r = unsafe {
                libc::read(
                    self.ready,
                    b.as_mut_ptr() as *mut libc::c_void,
                    (k - got).min(16),
                )
            };
            if r == 0 {
                return Err(format!("the ranks ended with {got} of {k} ready"));
            }
            if r > 0 {
                got += r as usize;
            }
        }
        Ok(())
    }

    /// Send `sig` to the process forked `i`-th (rank `i`, for the first ones).
    pub fn signal(&self, i: usize, sig: i32) {
        super::signal(self.pids[i], sig);
    }

    /// Wait at most `deadline` for every process to end, then kill what is left (and fail).
    pub fn finish(mut self, deadline: Duration) -> Result<Vec<Ended>, String> {
        // SAFETY: our write ends; the children hold their own copies.
        unsafe {
            libc::close(self.wr);
            libc::close(self.ready_wr);
        }
        let start = Instant::now();
        let mut text = Vec::new();
        let mut late = false;
        loop {
            let left = deadline.saturating_sub(start.elapsed());
            if left.is_zero() {
                late = true;
                break;
            }
            let mut p = libc::pollfd {
                fd: std::os::fd::AsRawFd::as_raw_fd(&self.out),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            if unsafe { libc::poll(&mut p, 1, left.as_millis().max(1) as i32) } <= 0 {
                continue;
            }
            let mut buf = [0u8; 4096];
            match self.out.read(&mut buf) {
                Ok(0) => break,
                Ok(k) => text.extend_from_slice(&buf[..k]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("read: {e}")),
            }
        }
        let mut out: Vec<Ended> = self
            .pids
            .iter()
            .map(|&pid| {
                if late {
                    super::signal(pid, libc::SIGKILL);
                    // A stopped process must not keep the kill from landing.
                    super::signal(pid, libc::SIGCONT);
                }
                let mut st = 0;
                // SAFETY: our child; valid out-parameter.
                unsafe { libc::waitpid(pid, &mut st, 0) };
                Ended {
                    status: st,
                    msg: String::new(),
                }
            })
            .collect();
        // SAFETY: our pipe end, not used afterwards.
        unsafe { libc::close(self.ready) };
        for line in String::from_utf8_lossy(&text).lines() {
            if let Some((r, m)) = line.split_once('\t') {
                if let Some(e) = r.parse::<usize>().ok().and_then(|r| out.get_mut(r)) {
                    e.msg = m.to_string();
                }
            }
        }
        if late {
            let msgs: Vec<&str> = out.iter().map(|e| e.msg.as_str()).collect();
            return Err(format!(
                "ranks still running after {deadline:?} (killed); reports {msgs:?}"
            ));
        }
        Ok(out)
    }
}

/// `lockstep-*` names in `dir`.
pub fn segments_in(dir: &str) -> Vec<String> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<String> = rd
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("lockstep-"))
        .collect();
    v.sort();
    v
}

/// Whether segment `name` belongs to another run on this machine: its job id has the launchers'
/// format (`lockstep-<launcher pid>-<time>`, both hex) and names a live process that is neither
/// this test nor one of its descendants (a test suite run beside this one). Anything else counts
/// as this test's: a segment whose launcher is gone, or with a name a test chose.
fn foreign(name: &str) -> bool {
    let Some(pid) = name
        .strip_prefix("lockstep-")
        .and_then(|id| id.split_once('-'))
        .and_then(|(pid, _)| i32::from_str_radix(pid, 16).ok())
    else {
        return false;
    };
    let me = std::process::id() as i32;
    let parent = |p: i32| -> Option<i32> {
        let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
        stat.rsplit_once(')')?
            .1
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    };
    let mut p = pid;
    for _ in 0..64 {
        if p == me {
            return false;
        }
        match parent(p) {
            Some(q) if q > 1 => p = q,
            // The chain ended (or the process is gone) without meeting this test.
            Some(_) => return true,
            None => return p != pid,
        }
    }
    true
}

/// Fails when `dir` holds segment names `before` did not (other runs' segments aside, see
/// [`foreign`]).
pub fn no_new_segments(dir: &str, before: &[String]) -> Result<(), String> {
    let new: Vec<String> = segments_in(dir)
        .into_iter()
        .filter(|n| !before.contains(n) && !foreign(n))
        .collect();
    check(
        new.is_empty(),
        &format!("no segment left behind in {dir}"),
        format!("{new:?}"),
    )
}

/// No new segment in /dev/shm since `before`, and no child process of this test left.
pub fn no_leftovers(before: &[String]) -> Result<(), String> {
    no_new_segments("/dev/shm", before)?;
    let kids = super::children_of(std::process::id() as i32);
    check(kids.is_empty(), "no rank process left", format!("{kids:?}"))
}
