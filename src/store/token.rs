//! The job token: the shared secret every connection to the rendezvous store presents.
//!
//! * [`validate_token`]: 16 to 256 bytes, no whitespace or control characters (so a token read
//!   from a file, the environment or a terminal is the same everywhere), and not one of the
//!   obvious ones a length check lets through: one character repeated, a sequence such as
//!   `0123456789abcdef`, a short pattern repeated, or only a handful of different characters.
//! * [`generate_token`]: 128 random bits from the kernel, as 32 hex digits (what `lockstep launch`
//!   on node 0 uses when no token is given).
//! * [`read_token_file`]: a token from a file, with the file's permission bits so the caller can
//!   warn when other users may read it.
//! * `tokens_equal`: the server's constant-time comparison.

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use super::StoreError;

/// Shortest token accepted: 16 bytes, so a token guessed online at the store's throttled rate is
/// out of reach (a generated token has 128 random bits).
pub const MIN_TOKEN_LEN: usize = 16;
/// Longest token accepted, so a HELLO always fits the small frame the server allows before
/// authentication ([`MAX_HELLO_FRAME`](super::MAX_HELLO_FRAME)).
pub const MAX_TOKEN_LEN: usize = 256;
/// A token file holds the token and maybe a newline; anything much larger is the wrong file.
const MAX_TOKEN_FILE: u64 = 4096;

/// Check that `token` is usable as a job token; the error says what is wrong and how to get a
/// good one.
pub fn validate_token(token: &str) -> Result<(), StoreError> {
    let how = "leave it out on node 0 and `lockstep launch` generates one, or make one with `openssl rand -hex 16`";
    if token.len() < MIN_TOKEN_LEN {
        return Err(StoreError::InvalidToken(format!(
            "the job token is {} byte(s) long, but at least {MIN_TOKEN_LEN} are required so it cannot be guessed; {how}",
            token.len()
        )));
    }
    if token.len() > MAX_TOKEN_LEN {
        return Err(StoreError::InvalidToken(format!(
            "the job token is {} bytes long, more than the limit of {MAX_TOKEN_LEN}; {how}",
            token.len()
        )));
    }
    if token.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(StoreError::InvalidToken(format!(
            "the job token contains whitespace or control characters, which get lost between shells, files and the environment; {how}"
        )));
    }
    if let Some(why) = guessable(token.as_bytes()) {
        return Err(StoreError::InvalidToken(format!(
            "the job token {why}, which anyone can guess; {how}"
        )));
    }
    Ok(())
}

/// Fewest different bytes a token must hold: 16 random hex digits (64 bits) hold fewer than
/// this with a probability below 1e-6, 32 of them (a generated token) below 1e-13.
const MIN_DISTINCT: usize = 6;

/// Why `t` (at least [`MIN_TOKEN_LEN`] bytes) is one of the tokens a person types when asked for
/// a secret, or `None`. A token of random bytes fails none of these but with negligible odds.
fn guessable(t: &[u8]) -> Option<String> {
    if t.iter().all(|&b| b == t[0]) {
        return Some(format!(
            "is one character repeated ({:?} {} times)",
            t[0] as char,
            t.len()
        ));
    }
    // A sequence: three quarters of the steps between neighbours are one same step
    // ("abcdefghijklmnop", "0123456789abcdef0123", "zyxw...", "acegikmo...").
    let steps: Vec<u8> = t.windows(2).map(|w| w[1].wrapping_sub(w[0])).collect();
    let mut counts = [0usize; 256];
    for &s in &steps {
        counts[s as usize] += 1;
    }
    if counts
        .iter()
        .max()
        .is_some_and(|&m| 4 * m >= 3 * steps.len())
    {
        return Some(format!("is a simple sequence ({})", preview(t)));
    }
    // A short pattern repeated ("passwordpassword", "abcabcabc...").
    if let Some(p) = (1..=t.len() / 2).find(|&p| t[p..].iter().zip(t).all(|(a, b)| a == b)) {
        return Some(format!(
            "repeats the {p}-character pattern {:?}",
            String::from_utf8_lossy(&t[..p])
        ));
    }
    let mut seen = [false; 256];
    t.iter().for_each(|&b| seen[b as usize] = true);
    let distinct = seen.iter().filter(|&&s| s).count();
    if distinct < MIN_DISTINCT {
        return Some(format!(
            "uses only {distinct} different characters (at least {MIN_DISTINCT} are required)"
        ));
    }
    None
}

/// The first characters of a token, for a message about a token too obvious to be secret.
fn preview(t: &[u8]) -> String {
    let s = String::from_utf8_lossy(&t[..t.len().min(12)]);
    if t.len() > 12 {
        format!("\"{s}...\"")
    } else {
        format!("\"{s}\"")
    }
}

/// A fresh token: 16 bytes from `/dev/urandom` as 32 lowercase hex digits.
pub fn generate_token() -> Result<String, StoreError> {
    let mut b = [0u8; 16];
    let read = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b));
    read.map_err(|e| StoreError::TokenSource {
        what: "read 16 random bytes from /dev/urandom for the job token".into(),
        source: e,
    })?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// A token read from a file, and who else may read that file.
pub struct TokenFile {
    /// The token (surrounding whitespace, such as the trailing newline, removed), validated.
    pub token: String,
    /// The file's permission bits (`st_mode & 0o7777`).
    pub mode: u32,
}

impl std::fmt::Debug for TokenFile {
    // The token is a secret: keep it out of debug output and logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenFile")
            .field("token", &"<hidden>")
            .field("mode", &format_args!("{:o}", self.mode))
            .finish()
    }
}

impl TokenFile {
    /// Whether users other than the owner may read or write the file (any group or other
    /// permission bit); callers should warn, as `ssh` does for private keys.
    pub fn accessible_by_others(&self) -> bool {
        self.mode & 0o077 != 0
    }
}

/// Read and validate the token in `path` (`lockstep launch --token-file PATH`).
pub fn read_token_file(path: &Path) -> Result<TokenFile, StoreError> {
    let err = |what: &str, e: std::io::Error| StoreError::TokenSource {
        what: format!("{what} token file {}", path.display()),
        source: e,
    };
    let f = std::fs::File::open(path).map_err(|e| err("open", e))?;
    let meta = f.metadata().map_err(|e| err("inspect", e))?;
    if !meta.is_file() {
        return Err(StoreError::InvalidToken(format!(
            "token file {} is not a regular file",
            path.display()
        )));
    }
    let mut raw = Vec::new();
    f.take(MAX_TOKEN_FILE + 1)
        .read_to_end(&mut raw)
        .map_err(|e| err("read", e))?;
    if raw.len() as u64 > MAX_TOKEN_FILE {
        return Err(StoreError::InvalidToken(format!(
            "token file {} is larger than {MAX_TOKEN_FILE} bytes; it should hold only the token",
            path.display()
        )));
    }
    let text = String::from_utf8(raw).map_err(|_| {
        StoreError::InvalidToken(format!(
            "token file {} is not UTF-8 text; it should hold only the token",
            path.display()
        ))
    })?;
    let token = text.trim().to_string();
    validate_token(&token).map_err(|e| match e {
        StoreError::InvalidToken(m) => {
            StoreError::InvalidToken(format!("{} (in token file {})", m, path.display()))
        }
        other => other,
    })?;
    Ok(TokenFile {
        token,
        mode: meta.permissions().mode() & 0o7777,
    })
}

/// Whether the token a peer `given` equals the `expected` one, in time that depends only on
/// `expected.len()` (the server's own token length), never on where the first difference is: a
/// byte-by-byte early exit would let a peer recover the token one byte at a time by timing.
pub(crate) fn tokens_equal(expected: &[u8], given: &[u8]) -> bool {
    let mut diff = u8::from(expected.len() != given.len());
    for (i, e) in expected.iter().enumerate() {
        // Past the end of `given` compare with 0; the length mismatch already made `diff` non-zero.
        let g = given.get(i).copied().unwrap_or(0);
        diff |= e ^ g;
    }
    // Keep the optimiser from turning the accumulation into an early-exit comparison.
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_equal_is_correct() {
        let t = b"0123456789abcdef0123";
        assert!(tokens_equal(t, t));
        assert!(tokens_equal(b"", b""));
        // Differences at the first, a middle and the last byte.
        assert!(!tokens_equal(t, b"X123456789abcdef0123"));
        assert!(!tokens_equal(t, b"0123456789Xbcdef0123"));
        assert!(!tokens_equal(t, b"0123456789abcdef012X"));
        // Different lengths: prefixes, extensions, and a given token padded with zero bytes
        // (past its end the loop compares with 0, so the length check must catch it).
        assert!(!tokens_equal(t, b"0123456789abcdef012"));
        assert!(!tokens_equal(t, b"0123456789abcdef01234"));
        assert!(!tokens_equal(t, b""));
        assert!(!tokens_equal(b"", t));
        assert!(!tokens_equal(b"ab\0", b"ab"));
        assert!(!tokens_equal(b"ab", b"ab\0"));
    }

    #[test]
    fn short_long_and_blank_tokens_are_refused() {
        for bad in [
            "",
            "t",
            "fifteen-bytes!!",
            "sixteen bytes ok",
            "tab\there-and-more-bytes",
        ] {
            let e = validate_token(bad).unwrap_err();
            assert!(matches!(e, StoreError::InvalidToken(_)), "{bad:?}: {e}");
        }
        let e = validate_token("short").unwrap_err().to_string();
        assert!(
            e.contains("5 byte(s) long")
                && e.contains("at least 16")
                && e.contains("openssl rand -hex 16"),
            "{e}"
        );
        assert!(validate_token(&"x".repeat(MAX_TOKEN_LEN + 1)).is_err());
        validate_token("sixteen-bytes-ok").unwrap();
        let long: String = (0..MAX_TOKEN_LEN)
            .map(|i| char::from(b"q7Zk2fX9aLm4Pw0s"[(i * 7 + i / 16) % 16]))
            .collect();
        validate_token(&long).unwrap();
    }

    #[test]
    fn obvious_tokens_are_refused_with_the_reason() {
        let why = |t: &str| validate_token(t).unwrap_err().to_string();
        let e = why("aaaaaaaaaaaaaaaa");
        assert!(
            e.contains(
                "the job token is one character repeated ('a' 16 times), which anyone can guess"
            ) && e.contains("openssl rand -hex 16"),
            "{e}"
        );
        assert!(why("0123456789abcdef")
            .contains("the job token is a simple sequence (\"0123456789ab...\")"));
        assert!(why("abcdefghijklmnopqrstuvwxyz").contains("is a simple sequence"));
        assert!(why("zyxwvutsrqponmlk").contains("is a simple sequence"));
        assert!(why("passwordpassword")
            .contains("the job token repeats the 8-character pattern \"password\""));
        assert!(why("abcabcabcabcabcabc").contains("repeats the 3-character pattern"));
        assert!(why("aabbaabbaabbaabbxy")
            .contains("uses only 4 different characters (at least 6 are required)"));
        // What people should use passes: generated, `openssl rand -hex 16`, a passphrase.
        for ok in [
            "3f9a0c7e51b2d846a1e07c3b9f25d468",
            "launch-cli-test-token-0123",
            "correct-horse-battery-staple",
        ] {
            validate_token(ok).unwrap();
        }
        for _ in 0..1000 {
            validate_token(&generate_token().unwrap()).unwrap();
        }
    }

    #[test]
    fn generated_tokens_are_valid_and_differ() {
        let (a, b) = (generate_token().unwrap(), generate_token().unwrap());
        assert_eq!(a.len(), 32);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()), "{a}");
        validate_token(&a).unwrap();
        assert_ne!(a, b);
    }

    #[test]
    fn token_file_is_trimmed_validated_and_reports_its_mode() {
        use std::os::unix::fs::OpenOptionsExt;
        let dir = std::env::temp_dir().join(format!("lockstep-token-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let write = |name: &str, text: &str, mode: u32| {
            let p = dir.join(name);
            let _ = std::fs::remove_file(&p);
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(mode)
                .open(&p)
                .unwrap();
            std::io::Write::write_all(&mut f, text.as_bytes()).unwrap();
            // The umask may have cleared bits; set exactly what the test wants.
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
            p
        };
        let p = write("private", "f3a9c07d2b6e1548aa91\n", 0o600);
        let f = read_token_file(&p).unwrap();
        assert_eq!(f.token, "f3a9c07d2b6e1548aa91");
        assert!(!f.accessible_by_others(), "{f:?}");
        assert!(
            !format!("{f:?}").contains("f3a9c07d2b"),
            "the token must not show in Debug output"
        );
        let p = write("shared", "f3a9c07d2b6e1548aa91", 0o644);
        assert!(read_token_file(&p).unwrap().accessible_by_others());
        let p = write("short", "abc\n", 0o600);
        let e = read_token_file(&p).unwrap_err().to_string();
        assert!(e.contains("at least 16") && e.contains("short"), "{e}");
        let e = read_token_file(&dir.join("missing"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("open token file") && e.contains("missing"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
