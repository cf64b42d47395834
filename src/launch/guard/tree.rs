//! The process tree under a guard: its direct children, found through `/proc`, and their
//! SIGKILL. The guard is a child subreaper, so orphans of the rank's subtree become its children;
//! killing its children until none is left reaches the whole subtree.
//!
//! Async-signal-safe system calls only (it runs in the guard): `getdents64` and `read` into
//! stack buffers, no allocation.

use super::signal_safe::close_raw;

/// SIGKILL every direct child of `me` (found in /proc); returns how many were signalled.
/// Children's children become ours when their parents die, so calling this until no child is
/// left reaches the whole subtree.
pub(super) fn kill_children(me: i32) -> usize {
    // SAFETY: open/getdents64/close on our own buffers; async-signal-safe system calls.
    let dir = unsafe {
        libc::open(
            c"/proc".as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if dir < 0 {
        return 0;
    }
    let mut killed = 0;
    let mut buf = [0u8; 4096];
    loop {
        // SAFETY: getdents64 into a valid buffer of the given length.
        let n = unsafe { libc::syscall(libc::SYS_getdents64, dir, buf.as_mut_ptr(), buf.len()) };
        if n <= 0 {
            break;
        }
        let mut off = 0usize;
        while off + 19 < n as usize {
            // struct linux_dirent64 { u64 d_ino; i64 d_off; u16 d_reclen; u8 d_type; char d_name[]; }
            let reclen = u16::from_ne_bytes([buf[off + 16], buf[off + 17]]) as usize;
            if reclen == 0 {
                break;
            }
            let name = &buf[off + 19..(off + reclen).min(n as usize)];
            if let Some(pid) = parse_pid(name) {
                if pid != me && ppid_of(pid) == Some(me) {
                    // SAFETY: kill(2); the pid is our child (a zombie at worst), so not reused.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                    killed += 1;
                }
            }
            off += reclen;
        }
    }
    close_raw(dir);
    killed
}

/// A NUL-terminated decimal pid.
fn parse_pid(name: &[u8]) -> Option<i32> {
    let mut v: i32 = 0;
    let mut any = false;
    for &b in name {
        match b {
            0 => break,
            b'0'..=b'9' => {
                v = v.checked_mul(10)?.checked_add((b - b'0') as i32)?;
                any = true;
            }
            _ => return None,
        }
    }
    any.then_some(v)
}

/// The parent pid in `/proc/<pid>/stat` (the field after the state, after the last `)`).
fn ppid_of(pid: i32) -> Option<i32> {
    let mut path = [0u8; 32];
    let prefix = b"/proc/";
    path[..prefix.len()].copy_from_slice(prefix);
    let mut i = prefix.len();
    let mut digits = [0u8; 11];
    let mut nd = 0;
    let mut p = pid;
    loop {
        digits[nd] = b'0' + (p % 10) as u8;
        nd += 1;
        p /= 10;
        if p == 0 {
            break;
        }
    }
    for k in (0..nd).rev() {
        path[i] = digits[k];
        i += 1;
    }
    path[i..i + 5].copy_from_slice(b"/stat");
    // (path[i + 5] is the terminating NUL.)
    // SAFETY: open/read/close with a NUL-terminated path and a valid buffer.
    let (n, buf) = unsafe {
        let fd = libc::open(
            path.as_ptr() as *const libc::c_char,
            libc::O_RDONLY | libc::O_CLOEXEC,
        );
        if fd < 0 {
            return None;
        }
        let mut buf = [0u8; 512];
        let n = libc::read(fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len());
        libc::close(fd);
        (n, buf)
    };
    if n <= 0 {
        return None;
    }
    let s = &buf[..n as usize];
    let close = s.iter().rposition(|&b| b == b')')?;
    // ") S 1234 ..."
    let rest = s.get(close + 4..)?;
    let end = rest.iter().position(|&b| b == b' ')?;
    parse_pid(&rest[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pids() {
        assert_eq!(parse_pid(b"1234\0junk"), Some(1234));
        assert_eq!(parse_pid(b"self\0"), None);
        assert_eq!(parse_pid(b"\0"), None);
        // SAFETY: getpid/getppid have no preconditions.
        let (me, parent) = unsafe { (libc::getpid(), libc::getppid()) };
        assert_eq!(ppid_of(me), Some(parent));
    }
}
