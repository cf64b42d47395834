//! Rank output: the parent reads each rank's stdout and stderr pipes and re-emits them as whole
//! segments with a `[rank N] ` prefix, so two ranks' bytes never share a line.
//!
//! A segment ends at `\n` (or `\r\n`), or at a lone `\r`: progress bars redraw their line with
//! `\r`, and forwarding each redraw with its own prefix keeps a bar on one rank readable. Bytes
//! without a terminator wait for more (up to [`MAX_PENDING`], then they are emitted as a line).
//! Each batch of segments is written with one `write_all` on the locked stdout/stderr, from the
//! single supervising thread. Optional per-rank log files receive the same segments unprefixed;
//! a rank filter hides other ranks' output from the console (their logs and stderr tails are
//! still kept).
//!
//! Log files are opened without following symbolic links ([`LogDir`]): the log directory may be
//! shared with other users (a scratch directory), and a link planted under a log file's fixed
//! name must not make the launcher overwrite a file of the link's choosing.

use std::collections::VecDeque;
use std::fs::File;
use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

use super::report::LaunchError;

/// Longest unterminated output held back before it is emitted as a line.
pub(crate) const MAX_PENDING: usize = 64 << 10;
/// Lines of stderr kept per rank for the failure summary.
pub(crate) const TAIL_LINES: usize = 20;

/// Which standard stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stream {
    Out = 0,
    Err = 1,
}

/// Output state of one rank.
pub(crate) struct RankOutput {
    prefix: Vec<u8>,
    show: bool,
    log: Option<File>,
    pending: [Vec<u8>; 2],
    tail: VecDeque<String>,
}

/// A directory for per-rank log files, checked and held open: the files are created relative
/// to its descriptor.
pub(crate) struct LogDir {
    path: PathBuf,
    dir: File,
}

impl LogDir {
    /// Create `path` (mode 0700; missing parents as `mkdir -p` makes them) or check an existing
    /// one: a directory others can write to without the sticky bit is refused, since anyone
    /// could then replace the log files.
    pub fn prepare(path: &Path) -> Result<LogDir, LaunchError> {
        let setup =
            |what: String| LaunchError::Setup(format!("log directory {}: {what}", path.display()));
        if matches!(std::fs::symlink_metadata(path), Err(e) if e.kind() == std::io::ErrorKind::NotFound)
        {
            if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent)
                    .map_err(|e| setup(format!("cannot create its parent: {e}")))?;
            }
            match std::fs::DirBuilder::new().mode(0o700).create(path) {
                Ok(()) => {}
                // Another launcher made it first: it is checked like any existing one below.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(setup(format!("cannot create it: {e}"))),
            }
        }
        let dir = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY)
            .open(path)
            .map_err(|e| setup(format!("cannot open it: {e}; pass a directory")))?;
        let st = nix::sys::stat::fstat(dir.as_fd())
            .map_err(|e| setup(format!("cannot stat it: {e}")))?;
        let mode = st.st_mode & 0o7777;
        if mode & 0o022 != 0 && mode & 0o1000 == 0 {
            return Err(setup(format!(
                "it is writable by {} (mode {mode:04o}) without the sticky bit, so another user could replace the log files; \
                 run `chmod go-w {}` or choose another --log-dir",
                if mode & 0o002 != 0 { "everyone" } else { "its group" },
                path.display()
            )));
        }
        Ok(LogDir {
            path: path.to_path_buf(),
            dir,
        })
    }

    /// Open `rank-N.log` for writing, empty: a new file (`O_CREAT|O_EXCL|O_NOFOLLOW`, mode
    /// 0600), or an existing regular file of this user with no other hard link, truncated.
    /// Symbolic links, special files and other users' files are refused.
    pub fn open(&self, rank: usize) -> Result<File, LaunchError> {
        let name = format!("rank-{rank}.log");
        let p = self.path.join(&name);
        let refuse = |why: String| LaunchError::Setup(format!("log file {}: {why}", p.display()));
        let fd = self.dir.as_fd();
        let create = OFlag::O_WRONLY
            | OFlag::O_CREAT
            | OFlag::O_EXCL
            | OFlag::O_NOFOLLOW
            | OFlag::O_CLOEXEC
            | OFlag::O_NOCTTY;
        match nix::fcntl::openat(fd, name.as_str(), create, Mode::from_bits_truncate(0o600)) {
            Ok(f) => return Ok(File::from(f)),
            // Also what a symbolic link under the name gives (O_EXCL never follows one).
            Err(Errno::EEXIST) => {}
            Err(e) => return Err(refuse(format!("cannot create it: {e}"))),
        }
        // O_NONBLOCK: a FIFO under the name must not block the launcher.
        let existing = OFlag::O_WRONLY
            | OFlag::O_NOFOLLOW
            | OFlag::O_CLOEXEC
            | OFlag::O_NOCTTY
            | OFlag::O_NONBLOCK;
        let f = match nix::fcntl::openat(fd, name.as_str(), existing, Mode::empty()) {
            Ok(f) => f,
            Err(Errno::ELOOP) => return Err(refuse(
                "it is a symbolic link; lockstep does not write through links in a log directory: remove it or choose another --log-dir"
                    .into(),
            )),
            Err(e) => return Err(refuse(format!("it exists and cannot be opened ({e}); remove it or choose another --log-dir"))),
        };
        let st =
            nix::sys::stat::fstat(f.as_fd()).map_err(|e| refuse(format!("cannot stat it: {e}")))?;
        let uid = nix::unistd::geteuid().as_raw();
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(refuse(
                "it is not a regular file; remove it or choose another --log-dir".into(),
            ));
        }
        if st.st_uid != uid {
            return Err(refuse(format!(
                "it belongs to uid {}, not to this user (uid {uid}); remove it or choose another --log-dir",
                st.st_uid
            )));
        }
        if st.st_nlink > 1 {
            return Err(refuse(format!(
                "it has {} hard links, and truncating it would empty the other names too; remove it or choose another --log-dir",
                st.st_nlink
            )));
        }
        nix::unistd::ftruncate(f.as_fd(), 0)
            .map_err(|e| refuse(format!("cannot truncate it: {e}")))?;
        Ok(File::from(f))
    }
}

impl RankOutput {
    /// Output of `rank`; `show` puts it on the console, `log_dir` adds `rank-N.log` there.
    pub fn new(
        rank: usize,
        show: bool,
        log_dir: Option<&LogDir>,
    ) -> Result<RankOutput, LaunchError> {
        let log = match log_dir {
            Some(d) => Some(d.open(rank)?),
            None => None,
        };
        Ok(RankOutput {
            prefix: format!("[rank {rank}] ").into_bytes(),
            show,
            log,
            pending: [Vec::new(), Vec::new()],
            tail: VecDeque::new(),
        })
    }

    /// The output of the same rank's next process (a restart): same prefix, console choice and
    /// log file (its copy of the descriptor writes on after what the earlier process wrote),
    /// nothing pending, an empty stderr tail.
    pub fn renewed(&self) -> Result<RankOutput, LaunchError> {
        let log = self
            .log
            .as_ref()
            .map(File::try_clone)
            .transpose()
            .map_err(|e| {
                LaunchError::Setup(format!(
                    "cannot reopen a rank's log file for its restart: {e}"
                ))
            })?;
        Ok(RankOutput {
            prefix: self.prefix.clone(),
            show: self.show,
            log,
            pending: [Vec::new(), Vec::new()],
            tail: VecDeque::new(),
        })
    }

    /// Print this rank's lines without the `[rank N] ` prefix (`lockstep launch --no-prefix`).
    pub fn without_prefix(mut self) -> RankOutput {
        self.prefix.clear();
        self
    }

    /// Take `data` read from `stream`; emit every complete segment.
    pub fn feed(&mut self, stream: Stream, data: &[u8]) {
        self.pending[stream as usize].extend_from_slice(data);
        self.emit(stream, false);
    }

    /// The stream ended: emit what is left (with a newline added).
    pub fn finish(&mut self, stream: Stream) {
        self.emit(stream, true);
    }

    /// The log file's descriptor, if there is one.
    pub fn log_fd(&self) -> Option<i32> {
        self.log.as_ref().map(std::os::fd::AsRawFd::as_raw_fd)
    }

    /// The last lines this rank wrote to stderr.
    pub fn stderr_tail(&self) -> Vec<String> {
        self.tail.iter().cloned().collect()
    }

    /// Split what is pending on `stream`, log and tail each segment, and print the prefixed batch
    /// with one write (so a reader of the launcher's output never sees half a segment).
    fn emit(&mut self, stream: Stream, at_eof: bool) {
        let buf = std::mem::take(&mut self.pending[stream as usize]);
        let segs = split_segments(&buf, at_eof);
        let mut out = Vec::with_capacity(buf.len() + segs.segments.len() * self.prefix.len());
        for seg in &segs.segments {
            if let Some(log) = &mut self.log {
                let _ = log.write_all(seg);
            }
            if stream == Stream::Err && seg.ends_with(b"\n") {
                let line = String::from_utf8_lossy(seg)
                    .trim_end_matches(['\n', '\r'])
                    .to_string();
                if self.tail.len() == TAIL_LINES {
                    self.tail.pop_front();
                }
                self.tail.push_back(line);
            }
            // A bare "\r" (the start of a redraw) carries nothing to show.
            if self.show && seg.as_slice() != b"\r" {
                // Terminal control sequences that open a segment (a progress bar's "clear line")
                // go before the prefix, or they would erase it.
                let k = leading_csi_len(seg);
                out.extend_from_slice(&seg[..k]);
                // A line that is a JSON object stays as it is, so that `--json` output parses
                // line by line under the launcher (the object says which rank wrote it, if it
                // needs to).
                if !(seg.ends_with(b"\n") && is_json_object(&seg[k..])) {
                    out.extend_from_slice(&self.prefix);
                }
                out.extend_from_slice(&seg[k..]);
            }
        }
        self.pending[stream as usize] = buf[segs.consumed..].to_vec();
        if !out.is_empty() {
            write_console(stream, &out);
        }
    }
}

/// Length of the ANSI CSI sequences (`ESC [ params final`) at the start of `seg`, e.g. the
/// `ESC[2K` (clear line) that progress bars such as indicatif write before each redraw.
pub(crate) fn leading_csi_len(seg: &[u8]) -> usize {
    let mut i = 0;
    while seg.len() > i + 1 && seg[i] == 0x1b && seg[i + 1] == b'[' {
        // Parameter and intermediate bytes are 0x20..=0x3f; the final byte is 0x40..=0x7e.
        let Some(end) = seg[i + 2..].iter().position(|b| !(0x20..=0x3f).contains(b)) else {
            break;
        };
        if !(0x40..=0x7e).contains(&seg[i + 2 + end]) {
            break;
        }
        i += 2 + end + 1;
    }
    i
}

/// Whether `line` (surrounding whitespace aside) is one JSON object: a recognizer of the JSON
/// grammar (RFC 8259), without building values. Lines longer than [`MAX_PENDING`] are cut
/// before they get here, which bounds the work.
pub(crate) fn is_json_object(line: &[u8]) -> bool {
    let mut p = Json {
        s: line,
        i: 0,
        depth: 0,
    };
    p.ws();
    if p.peek() != Some(b'{') || !p.value() {
        return false;
    }
    p.ws();
    p.i == line.len()
}

/// The state of [`is_json_object`].
struct Json<'a> {
    s: &'a [u8],
    i: usize,
    depth: usize,
}

impl Json<'_> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }
    fn eat(&mut self, b: u8) -> bool {
        let ok = self.peek() == Some(b);
        self.i += ok as usize;
        ok
    }
    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }
    fn value(&mut self) -> bool {
        self.ws();
        match self.peek() {
            Some(b'{') => self.nested(b'}', true),
            Some(b'[') => self.nested(b']', false),
            Some(b'"') => self.string(),
            Some(b't') => self.word(b"true"),
            Some(b'f') => self.word(b"false"),
            Some(b'n') => self.word(b"null"),
            Some(b'-' | b'0'..=b'9') => self.number(),
            _ => false,
        }
    }
    /// An object (`keyed`) or an array, from its opening bracket.
    fn nested(&mut self, close: u8, keyed: bool) -> bool {
        // Deep nesting is refused rather than recursed into without bound.
        if self.depth >= 128 {
            return false;
        }
        self.depth += 1;
        self.i += 1;
        self.ws();
        let ok = self.eat(close)
            || loop {
                if keyed {
                    self.ws();
                    if !(self.string() && {
                        self.ws();
                        self.eat(b':')
                    }) {
                        break false;
                    }
                }
                if !self.value() {
                    break false;
                }
                self.ws();
                if self.eat(close) {
                    break true;
                }
                if !self.eat(b',') {
                    break false;
                }
            };
        self.depth -= 1;
        ok
    }
    fn string(&mut self) -> bool {
        if !self.eat(b'"') {
            return false;
        }
        while let Some(c) = self.peek() {
            self.i += 1;
            match c {
                b'"' => return true,
                b'\\' => match self.peek() {
                    Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => self.i += 1,
                    Some(b'u')
                        if self.s.len() >= self.i + 5
                            && self.s[self.i + 1..self.i + 5]
                                .iter()
                                .all(u8::is_ascii_hexdigit) =>
                    {
                        self.i += 5
                    }
                    _ => return false,
                },
                0..=0x1f => return false,
                _ => {}
            }
        }
        false
    }
    fn word(&mut self, w: &[u8]) -> bool {
        let ok = self.s[self.i..].starts_with(w);
        self.i += if ok { w.len() } else { 0 };
        ok
    }
    fn digits(&mut self) -> usize {
        let n = self.s[self.i..]
            .iter()
            .take_while(|b| b.is_ascii_digit())
            .count();
        self.i += n;
        n
    }
    fn number(&mut self) -> bool {
        self.eat(b'-');
        if self.eat(b'0') {
            // No leading zeros.
        } else if self.digits() == 0 {
            return false;
        }
        if self.eat(b'.') && self.digits() == 0 {
            return false;
        }
        if self.eat(b'e') || self.eat(b'E') {
            let _ = self.eat(b'+') || self.eat(b'-');
            if self.digits() == 0 {
                return false;
            }
        }
        true
    }
}

/// Write a batch to the launcher's own stdout or stderr.
fn write_console(stream: Stream, bytes: &[u8]) {
    // Errors (a closed console) are ignored: the ranks must not die because nobody reads.
    match stream {
        Stream::Out => {
            let mut o = std::io::stdout().lock();
            let _ = o.write_all(bytes);
            let _ = o.flush();
        }
        Stream::Err => {
            let mut e = std::io::stderr().lock();
            let _ = e.write_all(bytes);
        }
    }
}

/// Complete segments found at the front of a buffer.
pub(crate) struct Segments {
    /// Each segment, terminator included (`\n`, or `\r` for a redraw); `\r\n` becomes `\n`.
    pub segments: Vec<Vec<u8>>,
    /// Bytes of the buffer the segments cover.
    pub consumed: usize,
}

/// Split `buf` into segments. A trailing `\r` waits for the next byte (it may start `\r\n`)
/// unless `at_eof`; at EOF an unterminated rest becomes a line with `\n` added. Unterminated
/// runs longer than [`MAX_PENDING`] are emitted as lines too.
pub(crate) fn split_segments(buf: &[u8], at_eof: bool) -> Segments {
    let mut segments = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i < buf.len() {
        match buf[i] {
            b'\n' => {
                let end = if i > start && buf[i - 1] == b'\r' {
                    i - 1
                } else {
                    i
                };
                let mut s = buf[start..end].to_vec();
                s.push(b'\n');
                segments.push(s);
                start = i + 1;
            }
            b'\r' if i + 1 < buf.len() && buf[i + 1] != b'\n' => {
                segments.push(buf[start..=i].to_vec());
                start = i + 1;
            }
            b'\r' if i + 1 == buf.len() && at_eof => {
                let mut s = buf[start..i].to_vec();
                s.push(b'\n');
                segments.push(s);
                start = i + 1;
            }
            _ => {}
        }
        i += 1;
    }
    // (A trailing CR is still waiting for its possible LF unless at EOF.)
    let cr_waits = buf.last() == Some(&b'\r') && !at_eof;
    if start < buf.len() && (at_eof || buf.len() - start > MAX_PENDING) && !cr_waits {
        let mut s = buf[start..].to_vec();
        s.push(b'\n');
        segments.push(s);
        start = buf.len();
    }
    Segments {
        segments,
        consumed: start,
    }
}

/// Per-rank console/log output set up for `world` ranks.
pub(crate) fn rank_outputs(
    world: usize,
    log_dir: Option<&std::path::Path>,
    filter: Option<&[usize]>,
) -> Result<Vec<RankOutput>, LaunchError> {
    let log_dir = log_dir.map(LogDir::prepare).transpose()?;
    (0..world)
        .map(|r| {
            let show = filter.is_none_or(|f| f.contains(&r));
            RankOutput::new(r, show, log_dir.as_ref())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segs(b: &[u8], eof: bool) -> (Vec<String>, usize) {
        let s = split_segments(b, eof);
        (
            s.segments
                .iter()
                .map(|x| String::from_utf8_lossy(x).into_owned())
                .collect(),
            s.consumed,
        )
    }

    #[test]
    fn lines_and_partials() {
        assert_eq!(
            segs(b"a\nbc\nde", false),
            (vec!["a\n".into(), "bc\n".into()], 5)
        );
        assert_eq!(
            segs(b"a\nbc\nde", true),
            (vec!["a\n".into(), "bc\n".into(), "de\n".into()], 7)
        );
        assert_eq!(segs(b"", true), (vec![], 0));
    }

    #[test]
    fn carriage_returns() {
        // Progress redraws are forwarded one by one; CRLF is a line end.
        assert_eq!(
            segs(b"10%\r20%\r30%\n", false),
            (vec!["10%\r".into(), "20%\r".into(), "30%\n".into()], 12)
        );
        assert_eq!(segs(b"x\r\ny", false), (vec!["x\n".into()], 3));
        // A trailing CR waits: it may be the start of CRLF.
        assert_eq!(segs(b"50%\r", false), (vec![], 0));
        assert_eq!(segs(b"50%\r", true), (vec!["50%\n".into()], 4));
    }

    #[test]
    fn progress_bar_redraws_keep_their_prefix() {
        // indicatif/console redraw a bar as "\r ESC[2K text"; the clear-line goes first.
        assert_eq!(leading_csi_len(b"\x1b[2K[===>  ] 40%\r"), 4);
        assert_eq!(leading_csi_len(b"\x1b[1A\x1b[2Kx"), 8);
        assert_eq!(leading_csi_len(b"plain\n"), 0);
        assert_eq!(leading_csi_len(b"\x1b[2"), 0);
        let (s, _) = segs(b"\r\x1b[2K10%\r\x1b[2K20%\n", false);
        assert_eq!(s, vec!["\r", "\x1b[2K10%\r", "\x1b[2K20%\n"]);
    }

    #[test]
    fn json_objects_are_recognised() {
        for ok in [
            "{}\n",
            "{\"epoch\": 1, \"loss\": 0.4384, \"acc\": -1.5e-3, \"ok\": true, \"x\": null}\n",
            "  {\"a\": [1, {\"b\": \"c\\\"\\u00e9\"}, []], \"d\": {}}  \n",
        ] {
            assert!(is_json_object(ok.as_bytes()), "{ok:?}");
        }
        for bad in [
            "[1, 2]\n",
            "{\"a\": 1} trailing\n",
            "{a: 1}\n",
            "{\"a\": 01}\n",
            "{\"a\": 1,}\n",
            "{\"a\" 1}\n",
            "{\"a\": \"unterminated}\n",
            "{\"a\": tru}\n",
            "{\"a\": 1.}\n",
            "epoch 1/4 {x}\n",
            "{\n",
            "",
        ] {
            assert!(!is_json_object(bad.as_bytes()), "{bad:?}");
        }
        let deep = format!("{}1{}", "{\"a\":".repeat(200), "}".repeat(200));
        assert!(!is_json_object(deep.as_bytes()));
    }

    #[test]
    fn long_unterminated_runs_are_cut() {
        let b = vec![b'x'; MAX_PENDING + 1];
        let (s, n) = segs(&b, false);
        assert_eq!((s.len(), n), (1, b.len()));
    }
}
