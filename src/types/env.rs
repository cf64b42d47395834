//! Strict parsing of `LOCKSTEP_*` environment variables, for every layer.
//!
//! A malformed value is an [`EnvError`] that names the variable, the value and what is accepted:
//! never a silent fallback to the default, never a silent clamp. An unset or empty variable means
//! "use the default" (the convention of the launcher's variables).
//!
//! What each kind accepts:
//!
//! | kind | accepted | refused |
//! |---|---|---|
//! | seconds ([`parse_secs`]) | a plain decimal number greater than 0 and at most 10⁹: `30`, `2.5`, `.5` | `0` (a timeout of 0 would fail at once; there is no "wait forever": use a large value), units (`3s`), signs, exponents, `inf`, `nan` |
//! | count ([`parse_count`]) | decimal digits within the variable's range | signs, fractions, anything else |
//! | flag ([`parse_flag`]) | `1`, `0`, `true`, `false`, `yes`, `no`, `on`, `off` (any case) | anything else |
//! | choice ([`parse_choice`]) | one of the listed words, exactly | anything else |
//! | text ([`parse_text`]) | any UTF-8 text without control characters | control characters |
//!
//! Surrounding ASCII whitespace is ignored. The variables of these kinds are listed in [`CHECKED`]
//! and read through their [`Var`]; [`check_all`] checks every one that is set (the launchers and
//! `Communicator::from_env` call it before anything starts, so a typo stops the job at once
//! instead of in every rank, or halfway through it).

use std::time::Duration;

/// A `LOCKSTEP_*` variable whose value cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("environment variable {name}={value:?} is invalid: expected {expected}; fix or unset it")]
pub struct EnvError {
    /// The variable.
    pub name: String,
    /// Its value (lossily converted when it was not UTF-8).
    pub value: String,
    /// What the variable accepts.
    pub expected: String,
}

fn err(name: &str, value: &str, expected: impl Into<String>) -> EnvError {
    EnvError {
        name: name.to_string(),
        value: value.to_string(),
        expected: expected.into(),
    }
}

/// Largest accepted number of seconds (about 31 years): far beyond any real timeout, and small
/// enough that deadlines computed from it never overflow.
pub const MAX_SECS: f64 = 1e9;

/// Whether `s` is a plain decimal number: digits with at most one `.`, at least one digit.
fn is_plain_decimal(s: &str) -> bool {
    let mut dots = 0;
    let mut digits = 0;
    for c in s.chars() {
        match c {
            '0'..='9' => digits += 1,
            '.' => dots += 1,
            _ => return false,
        }
    }
    digits > 0 && dots <= 1
}

/// A timeout in seconds: a plain decimal number greater than 0 and at most [`MAX_SECS`].
pub fn parse_secs(name: &str, raw: &str) -> Result<Duration, EnvError> {
    let expected = format!("a number of seconds greater than 0 and at most {MAX_SECS:e}, without a unit, such as 30 or 2.5 (there is no \"no timeout\" value: use a large number)");
    let s = raw.trim();
    if !is_plain_decimal(s) {
        return Err(err(name, raw, expected));
    }
    match s.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= MAX_SECS => Ok(Duration::from_secs_f64(v)),
        _ => Err(err(name, raw, expected)),
    }
}

/// A non-negative integer in `min..=max`.
pub fn parse_count(name: &str, raw: &str, min: u64, max: u64) -> Result<u64, EnvError> {
    let s = raw.trim();
    let expected = || format!("a whole number from {min} to {max} (decimal digits only)");
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(err(name, raw, expected()));
    }
    match s.parse::<u64>() {
        Ok(v) if (min..=max).contains(&v) => Ok(v),
        _ => Err(err(name, raw, expected())),
    }
}

/// A switch: `1`/`true`/`yes`/`on` or `0`/`false`/`no`/`off`, in any case.
pub fn parse_flag(name: &str, raw: &str) -> Result<bool, EnvError> {
    match raw.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(err(name, raw, "1 or 0 (also true/false, yes/no, on/off)")),
    }
}

/// One of `choices`, exactly (after trimming whitespace).
pub fn parse_choice<'a>(name: &str, raw: &str, choices: &[&'a str]) -> Result<&'a str, EnvError> {
    let s = raw.trim();
    choices
        .iter()
        .find(|c| **c == s)
        .copied()
        .ok_or_else(|| err(name, raw, format!("one of: {}", choices.join(", "))))
}

/// Free text without control characters (names, ids).
pub fn parse_text(name: &str, raw: &str) -> Result<String, EnvError> {
    let s = raw.trim();
    if s.chars().any(char::is_control) {
        return Err(err(
            name,
            raw,
            "text without control characters (tabs, newlines, escapes)",
        ));
    }
    Ok(s.to_string())
}

/// The raw value of `name`: `None` when unset or empty (empty counts as unset), an error when it
/// is not UTF-8.
pub fn raw(name: &str) -> Result<Option<String>, EnvError> {
    match std::env::var_os(name) {
        None => Ok(None),
        Some(v) if v.is_empty() => Ok(None),
        Some(v) => match v.into_string() {
            Ok(s) if s.trim().is_empty() => Ok(None),
            Ok(s) => Ok(Some(s)),
            Err(v) => Err(err(name, &v.to_string_lossy(), "UTF-8 text")),
        },
    }
}

/// [`parse_secs`] of `name`, `None` when unset.
pub fn secs(name: &str) -> Result<Option<Duration>, EnvError> {
    raw(name)?.map(|v| parse_secs(name, &v)).transpose()
}

/// [`parse_count`] of `name`, `None` when unset.
pub fn count(name: &str, min: u64, max: u64) -> Result<Option<u64>, EnvError> {
    raw(name)?
        .map(|v| parse_count(name, &v, min, max))
        .transpose()
}

/// [`parse_flag`] of `name`, `None` when unset.
pub fn flag(name: &str) -> Result<Option<bool>, EnvError> {
    raw(name)?.map(|v| parse_flag(name, &v)).transpose()
}

/// [`parse_choice`] of `name`, `None` when unset.
pub fn choice<'a>(name: &str, choices: &[&'a str]) -> Result<Option<&'a str>, EnvError> {
    raw(name)?
        .map(|v| parse_choice(name, &v, choices))
        .transpose()
}

/// [`parse_text`] of `name`, `None` when unset.
pub fn text(name: &str) -> Result<Option<String>, EnvError> {
    raw(name)?.map(|v| parse_text(name, &v)).transpose()
}

/// What a variable in [`CHECKED`] accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// [`parse_secs`].
    Secs,
    /// [`parse_count`] within `min..=max`.
    Count {
        /// Smallest accepted value.
        min: u64,
        /// Largest accepted value.
        max: u64,
    },
    /// [`parse_flag`].
    Flag,
    /// [`parse_choice`] among these.
    Choice(&'static [&'static str]),
    /// [`parse_text`].
    Text,
}

/// A variable and what it accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Var {
    /// Its name.
    pub name: &'static str,
    /// Its kind.
    pub kind: Kind,
}

/// `LOCKSTEP_BACKEND`'s choices.
pub const BACKENDS: &[&str] = &["shm", "nccl"];

/// Declares each variable as a [`Var`] constant and lists them all, in table order, in a slice
/// constant: one table, so a variable cannot be declared and left out of [`check_all`].
macro_rules! checked_vars {
    (
        $(#[$list_doc:meta])*
        $list:ident;
        $($(#[$doc:meta])* $id:ident = $name:literal, $kind:expr;)*
    ) => {
        $($(#[$doc])* pub const $id: Var = Var { name: $name, kind: $kind };)*

        $(#[$list_doc])*
        pub const $list: &[Var] = &[$($id),*];
    };
}

checked_vars! {
    /// The `LOCKSTEP_*` variables of a simple kind, with what each accepts; each reader parses its
    /// variable through the same [`Var`], so this table and the readers cannot disagree. Free-form
    /// ones are not listed: library paths (`LOCKSTEP_CUDA_LIBRARY`, `LOCKSTEP_NVRTC_LIBRARY`,
    /// `LOCKSTEP_NCCL_LIBRARY`, `LOCKSTEP_MPI_LIBRARY`: a file or a folder, read through [`raw`] so
    /// that a value that is not UTF-8 is an error), `LOCKSTEP_SHM_DIR` (checked where
    /// a named segment is made: an absolute path to a directory), `LOCKSTEP_TRACE_DIR` (any directory), NVRTC options, the log filter
    /// (`LOCKSTEP_LOG`, checked by every embedding: `logging`), the token (`LOCKSTEP_TOKEN`, which has its own
    /// rules), and the checkpoint fault injection (`LOCKSTEP_FAULT_SAVE`).
    CHECKED;

    /// Collective timeout of the shared-memory backend and of the NCCL communicator.
    TIMEOUT_S = "LOCKSTEP_TIMEOUT_S", Kind::Secs;
    /// How long a rank of a multi-node job waits in the rendezvous (set by `lockstep launch`).
    RDZV_TIMEOUT_S = "LOCKSTEP_RDZV_TIMEOUT_S", Kind::Secs;
    /// The backend `Communicator::from_env` builds.
    BACKEND = "LOCKSTEP_BACKEND", Kind::Choice(BACKENDS);
    /// CUDA initialisation probe logging.
    DEBUG = "LOCKSTEP_DEBUG", Kind::Flag;
    /// Nodes of a `lockstep launch` job (set by the launcher).
    NNODES = "LOCKSTEP_NNODES", Kind::Count { min: 1, max: 1 << 20 };
    /// This host's identity in a multi-node rendezvous.
    HOST_ID = "LOCKSTEP_HOST_ID", Kind::Text;
    /// The job's identity (set by `lockstep launch`; the shared segment's name is derived from it).
    JOB_ID = "LOCKSTEP_JOB_ID", Kind::Text;
    /// Port of lockstep's rendezvous store under torchrun, mpirun and srun.
    STORE_PORT = "LOCKSTEP_STORE_PORT", Kind::Count { min: 1, max: 65535 };
    /// Set by the launcher for its ranks' programs (progress bars may draw).
    CONSOLE_TTY = "LOCKSTEP_CONSOLE_TTY", Kind::Flag;
    /// Bytes of each staging slot of the shared-memory backend (rounded up to a multiple of 4096).
    SHM_SLOT_BYTES = "LOCKSTEP_SHM_SLOT_BYTES", Kind::Count { min: 4096, max: 1 << 30 };
    /// Largest message of the one-phase all-reduce path (used up to the slot size).
    SHM_SMALL_BYTES = "LOCKSTEP_SHM_SMALL_BYTES", Kind::Count { min: 0, max: 1 << 30 };
    /// Address space of each rank's shared heap (rounded up to a multiple of 2 MiB).
    SHM_HEAP_BYTES = "LOCKSTEP_SHM_HEAP_BYTES", Kind::Count { min: 2 << 20, max: 1 << 44 };
    /// Output size from which staged data is written with streaming stores.
    SHM_NT_BYTES = "LOCKSTEP_SHM_NT_BYTES", Kind::Count { min: 0, max: 1 << 48 };
    /// Point-to-point messages from this size are copied directly (`process_vm_readv`); 0 turns it off.
    SHM_CMA_BYTES = "LOCKSTEP_SHM_CMA_BYTES", Kind::Count { min: 0, max: 1 << 48 };
    /// How staged data is written into the slots.
    SHM_STAGE = "LOCKSTEP_SHM_STAGE", Kind::Choice(&["auto", "cached", "streaming", "nt"]);
    /// Collectives on ordinary buffers: a single copy between the ranks' buffers, staging, or timed (auto).
    SHM_SINGLE_COPY = "LOCKSTEP_SHM_SINGLE_COPY", Kind::Choice(&["auto", "always", "never"]);
    /// How often a waiting rank checks that its peers live, in milliseconds.
    PEER_CHECK_MS = "LOCKSTEP_PEER_CHECK_MS", Kind::Count { min: 1, max: 3_600_000 };
    /// Microseconds a waiting rank spins before yielding (0: yield at once).
    SPIN_US = "LOCKSTEP_SPIN_US", Kind::Count { min: 0, max: 1_000_000 };
    /// How each rank is bound to CPUs (`shm::CpuBind`).
    CPU_BIND = "LOCKSTEP_CPU_BIND", Kind::Choice(&["block", "core", "none"]);
    /// How long the ranks of a shared segment wait for each other to join.
    JOIN_TIMEOUT_S = "LOCKSTEP_JOIN_TIMEOUT_S", Kind::Secs;
    /// `1` in a replacement that `lockstep launch --restart-policy rank` started for a lost rank:
    /// `Communicator::from_env` then joins the communicator the survivors grow (`shm::grow`).
    REPLACEMENT = "LOCKSTEP_REPLACEMENT", Kind::Choice(&["0", "1"]);
    /// Restarts of the job before this start, including a replacement's own (`lockstep launch`):
    /// which grow a replacement joins.
    RESTART_COUNT = "LOCKSTEP_RESTART_COUNT", Kind::Count { min: 0, max: 1 << 32 };
    /// Whether reductions of floating-point data fail on a NaN or an infinity in any rank's input
    /// (`shm::ShmConfig::check_finite`): `1` on, `0` off (the default). Strictly `0` or `1`.
    CHECK_FINITE = "LOCKSTEP_CHECK_FINITE", Kind::Choice(&["0", "1"]);
    /// Path of the configuration file (`lockstep::config`; `lockstep launch` passes the file it read
    /// on to its ranks).
    CONFIG = "LOCKSTEP_CONFIG", Kind::Text;
    /// Timestamps on the diagnostics an embedding writes to stderr (`logging`).
    LOG_TIME = "LOCKSTEP_LOG_TIME", Kind::Flag;
    /// Whether `Communicator::from_env` joins a CPU job through MPI (`hier`): `auto` (across hosts,
    /// under an MPI launcher), `on` (always), `off` (never).
    MPI = "LOCKSTEP_MPI", Kind::Choice(&["auto", "on", "off"]);
    /// Ranks per node of a job joined through MPI: blocks of this many consecutive ranks instead of
    /// MPI's shared-memory split (each block must share memory).
    MPI_NODE_SIZE = "LOCKSTEP_MPI_NODE_SIZE", Kind::Count { min: 1, max: 1 << 20 };
    /// Calls each communicator's flight recorder keeps (`lockstep::trace`); 0 turns it off.
    TRACE_BUFFER = "LOCKSTEP_TRACE_BUFFER", Kind::Count { min: 0, max: 1 << 24 };
}

impl Var {
    /// The error for a reader that asks this variable for the wrong kind (a lockstep bug, named
    /// as such rather than a panic).
    fn wrong_kind(&self, wanted: &str) -> EnvError {
        err(
            self.name,
            "",
            format!(
                "{wanted} (lockstep bug: the variable is declared as {:?})",
                self.kind
            ),
        )
    }

    /// [`secs`] of a [`Kind::Secs`] variable.
    pub fn secs(&self) -> Result<Option<Duration>, EnvError> {
        match self.kind {
            Kind::Secs => secs(self.name),
            _ => Err(self.wrong_kind("seconds")),
        }
    }

    /// [`count`] of a [`Kind::Count`] variable, within its range.
    pub fn count(&self) -> Result<Option<u64>, EnvError> {
        match self.kind {
            Kind::Count { min, max } => count(self.name, min, max),
            _ => Err(self.wrong_kind("a count")),
        }
    }

    /// [`parse_count`] of `raw`, a value of this [`Kind::Count`] variable obtained elsewhere (a
    /// lookup table in tests, another process's environment).
    pub fn parse_count(&self, raw: &str) -> Result<u64, EnvError> {
        match self.kind {
            Kind::Count { min, max } => parse_count(self.name, raw, min, max),
            _ => Err(self.wrong_kind("a count")),
        }
    }

    /// [`flag`] of a [`Kind::Flag`] variable.
    pub fn flag(&self) -> Result<Option<bool>, EnvError> {
        match self.kind {
            Kind::Flag => flag(self.name),
            _ => Err(self.wrong_kind("a flag")),
        }
    }

    /// [`choice`] of a [`Kind::Choice`] variable.
    pub fn choice(&self) -> Result<Option<&'static str>, EnvError> {
        match self.kind {
            Kind::Choice(c) => choice(self.name, c),
            _ => Err(self.wrong_kind("a choice")),
        }
    }

    /// [`text`] of a [`Kind::Text`] variable.
    pub fn text(&self) -> Result<Option<String>, EnvError> {
        match self.kind {
            Kind::Text => text(self.name),
            _ => Err(self.wrong_kind("text")),
        }
    }
}

/// Check one value against `kind`.
pub fn check_value(name: &str, raw: &str, kind: Kind) -> Result<(), EnvError> {
    match kind {
        Kind::Secs => parse_secs(name, raw).map(drop),
        Kind::Count { min, max } => parse_count(name, raw, min, max).map(drop),
        Kind::Flag => parse_flag(name, raw).map(drop),
        Kind::Choice(c) => parse_choice(name, raw, c).map(drop),
        Kind::Text => parse_text(name, raw).map(drop),
    }
}

/// Check every variable of [`CHECKED`] that is set in this process's environment.
pub fn check_all() -> Result<(), EnvError> {
    for v in CHECKED {
        if let Some(r) = raw(v.name)? {
            check_value(v.name, &r, v.kind)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `LOCKSTEP_CHECK_FINITE` takes exactly 0 or 1: the flag words other switches accept are
    /// refused, with what it takes.
    #[test]
    fn check_finite_is_0_or_1() {
        for ok in ["0", "1", " 1 "] {
            assert!(
                check_value(CHECK_FINITE.name, ok, CHECK_FINITE.kind).is_ok(),
                "{ok}"
            );
        }
        for bad in ["true", "on", "yes", "2", "01", "-1"] {
            let e = check_value(CHECK_FINITE.name, bad, CHECK_FINITE.kind).unwrap_err();
            assert!(
                e.to_string().contains("expected one of: 0, 1"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn seconds() {
        assert_eq!(parse_secs("T", "30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_secs("T", " 2.5 "), Ok(Duration::from_millis(2500)));
        assert_eq!(parse_secs("T", ".5"), Ok(Duration::from_millis(500)));
        assert_eq!(
            parse_secs("T", "1e9"),
            Err(err("T", "1e9", parse_secs("T", "x").unwrap_err().expected))
        );
        for bad in [
            "3s",
            "-1",
            "abc",
            "0",
            "0.0",
            "",
            "inf",
            "NaN",
            "+3",
            "1.2.3",
            ".",
            "2000000000",
            "3 s",
        ] {
            let e = parse_secs("LOCKSTEP_TIMEOUT_S", bad).unwrap_err();
            assert_eq!(
                (e.name.as_str(), e.value.as_str()),
                ("LOCKSTEP_TIMEOUT_S", bad)
            );
            let m = e.to_string();
            assert!(
                m.contains(&format!("LOCKSTEP_TIMEOUT_S={bad:?}"))
                    && m.contains("number of seconds greater than 0"),
                "{m}"
            );
        }
    }

    #[test]
    fn counts_flags_choices_text() {
        assert_eq!(parse_count("N", "4", 1, 8), Ok(4));
        for bad in ["0", "9", "-1", "1.0", "x", "", "+2"] {
            let e = parse_count("N", bad, 1, 8).unwrap_err();
            assert!(e.to_string().contains("a whole number from 1 to 8"), "{e}");
        }
        assert_eq!(parse_flag("F", "1"), Ok(true));
        assert_eq!(parse_flag("F", "Off"), Ok(false));
        assert!(parse_flag("F", "2")
            .unwrap_err()
            .to_string()
            .contains("1 or 0"));
        assert_eq!(parse_choice("B", "nccl", BACKENDS), Ok("nccl"));
        let e = parse_choice("B", "carrier-pigeon", BACKENDS).unwrap_err();
        assert!(e.to_string().contains("one of: shm, nccl"), "{e}");
        assert_eq!(parse_text("H", " node-a ").as_deref(), Ok("node-a"));
        assert!(parse_text("H", "a\nb").is_err());
    }

    #[test]
    fn a_reader_of_the_wrong_kind_gets_an_error() {
        let e = TIMEOUT_S.count().unwrap_err();
        assert!(
            e.name == "LOCKSTEP_TIMEOUT_S" && e.expected.contains("lockstep bug"),
            "{e}"
        );
        assert!(
            BACKEND.secs().is_err()
                && SPIN_US.flag().is_err()
                && HOST_ID.choice().is_err()
                && DEBUG.text().is_err()
        );
        let names: std::collections::HashSet<&str> = CHECKED.iter().map(|v| v.name).collect();
        assert_eq!(names.len(), CHECKED.len(), "each variable once");
    }

    #[test]
    fn every_checked_variable_refuses_garbage() {
        for v in CHECKED {
            let bad = if v.kind == Kind::Text {
                "bad\u{1b}[0m"
            } else {
                "3 s?"
            };
            let e = check_value(v.name, bad, v.kind).unwrap_err();
            assert_eq!(e.name, v.name);
        }
    }
}
