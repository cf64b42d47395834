//! The configuration file: written once by `lockstep config`, read by every `lockstep launch` and
//! by `train-cnn`, with command-line flags overriding it (Accelerate's `default_config.yaml`, in TOML).
//!
//! ```toml
//! num_processes = 4        # ranks of the whole job (all machines), as Accelerate counts them
//! num_machines = 1
//! machine_rank = 0
//! main_process_ip = "127.0.0.1"
//! main_process_port = 29500
//! mixed_precision = "bf16" # no | fp16 | bf16
//! backend = "auto"         # shm | nccl | auto (nccl when this machine has a GPU)
//! ```
//!
//! Every key is optional; a missing one takes its default ([`DEFAULT_NUM_PROCESSES`], one machine,
//! [`DEFAULT_MAIN_PROCESS_IP`], [`DEFAULT_MAIN_PROCESS_PORT`], `no`, `shm`). An unknown key, a
//! value of the wrong type or out of range, and a TOML syntax error are [`ConfigError::Invalid`],
//! which names the file, the line and the key: never silently ignored.
//!
//! Where the file is ([`locate`]): `--config FILE`, else `$LOCKSTEP_CONFIG`, else
//! `$XDG_CONFIG_HOME/lockstep/config.toml`, else `~/.config/lockstep/config.toml`. A file named
//! by the flag or the variable must exist; at the default location a missing file means "no
//! config" (every default). Writing ([`Config::write`]) is atomic
//! ([`write_atomic`](crate::types::write_atomic)).
//!
//! Precedence, for the tools that read it: command-line flag, then environment variable
//! (`MASTER_ADDR`, `MASTER_PORT`, `LOCKSTEP_BACKEND`), then this file, then the default.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use toml::Spanned;

use crate::types::env::{self, EnvError};
use crate::types::WriteError;

/// Ranks a job starts when neither a flag nor the configuration file says otherwise: the one
/// default of `lockstep launch`, `lockstep config` (without a GPU) and `train-cnn --nprocs`.
pub const DEFAULT_NUM_PROCESSES: usize = 2;
/// Address of the main process (node 0's launcher) when nothing else names one.
pub const DEFAULT_MAIN_PROCESS_IP: &str = "127.0.0.1";
/// Port of the rendezvous store (opened only by multi-node jobs) when nothing else names one.
pub const DEFAULT_MAIN_PROCESS_PORT: u16 = 29500;

/// The keys a configuration file may hold, in the order `lockstep config` writes them.
pub const KEYS: &[&str] = &[
    "num_processes",
    "num_machines",
    "machine_rank",
    "main_process_ip",
    "main_process_port",
    "mixed_precision",
    "backend",
];

/// `mixed_precision`: the arithmetic of training (Accelerate's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MixedPrecision {
    /// Full precision (f32).
    #[default]
    No,
    /// f16 operands with dynamic loss scaling.
    Fp16,
    /// bf16 operands.
    Bf16,
}

/// `backend`: which communicator the ranks build.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendChoice {
    /// The shared-memory CPU backend.
    #[default]
    Shm,
    /// NCCL on the GPUs.
    Nccl,
    /// NCCL when this machine has a GPU (counted by a forked probe), else shm.
    Auto,
}

impl MixedPrecision {
    /// Every value, for help texts and questions.
    pub const ALL: &'static [MixedPrecision] = &[
        MixedPrecision::No,
        MixedPrecision::Fp16,
        MixedPrecision::Bf16,
    ];

    /// The name in the file: `no`, `fp16` or `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            MixedPrecision::No => "no",
            MixedPrecision::Fp16 => "fp16",
            MixedPrecision::Bf16 => "bf16",
        }
    }
}

impl BackendChoice {
    /// Every value, for help texts and questions.
    pub const ALL: &'static [BackendChoice] =
        &[BackendChoice::Shm, BackendChoice::Nccl, BackendChoice::Auto];

    /// The name in the file: `shm`, `nccl` or `auto`.
    pub fn name(self) -> &'static str {
        match self {
            BackendChoice::Shm => "shm",
            BackendChoice::Nccl => "nccl",
            BackendChoice::Auto => "auto",
        }
    }

    /// The `LOCKSTEP_BACKEND` value for the ranks (`shm` or `nccl`), `auto` decided by `gpus`,
    /// the number of GPUs of this machine.
    pub fn resolve(self, gpus: usize) -> &'static str {
        match self {
            BackendChoice::Shm => "shm",
            BackendChoice::Nccl => "nccl",
            BackendChoice::Auto if gpus > 0 => "nccl",
            BackendChoice::Auto => "shm",
        }
    }
}

macro_rules! from_str_by_name {
    ($t:ty, $what:literal) => {
        impl std::str::FromStr for $t {
            type Err = String;
            fn from_str(s: &str) -> Result<$t, String> {
                let s = s.trim();
                <$t>::ALL
                    .iter()
                    .copied()
                    .find(|v| v.name().eq_ignore_ascii_case(s))
                    .ok_or_else(|| {
                        let names: Vec<&str> = <$t>::ALL.iter().map(|v| v.name()).collect();
                        format!("{}: {s:?} is not one of {}", $what, names.join(", "))
                    })
            }
        }
        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}
from_str_by_name!(BackendChoice, "backend");

impl std::str::FromStr for MixedPrecision {
    type Err = String;
    /// `no`, `fp16` or `bf16` (Accelerate's values), and `fp32` for `no` (train-cnn's
    /// `--precision fp32`).
    fn from_str(s: &str) -> Result<MixedPrecision, String> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("fp32") {
            return Ok(MixedPrecision::No);
        }
        MixedPrecision::ALL
            .iter()
            .copied()
            .find(|v| v.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                format!("mixed_precision: {s:?} is not a precision: use no (fp32), fp16 or bf16")
            })
    }
}

impl std::fmt::Display for MixedPrecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The contents of a configuration file: `None` where the file does not set the key.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Config {
    /// Ranks of the whole job, over all machines (at least 1, a multiple of `num_machines`).
    pub num_processes: Option<usize>,
    /// Machines (nodes) of the job, each running one `lockstep launch` (at least 1).
    pub num_machines: Option<usize>,
    /// This machine's index, `0..num_machines`.
    pub machine_rank: Option<usize>,
    /// Address of machine 0, where the rendezvous store runs.
    pub main_process_ip: Option<String>,
    /// Port of the rendezvous store (1..=65535).
    pub main_process_port: Option<u16>,
    /// Arithmetic of training.
    pub mixed_precision: Option<MixedPrecision>,
    /// Communicator backend of the ranks.
    pub backend: Option<BackendChoice>,
}

/// How the file was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// `--config FILE`.
    Flag,
    /// `$LOCKSTEP_CONFIG`.
    Env,
    /// The default location.
    Default,
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Origin::Flag => "--config",
            Origin::Env => "LOCKSTEP_CONFIG",
            Origin::Default => "the default location",
        })
    }
}

/// What went wrong with a configuration file; each message says what to do next.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A key or value of the file is wrong (or the file is not TOML).
    #[error("config file {}, line {line}{}: {message}; fix that line, or rewrite the file with `lockstep config --force` (keys: {})", .path.display(), .key.as_ref().map(|k| format!(", key `{k}`")).unwrap_or_default(), KEYS.join(", "))]
    Invalid {
        /// The file.
        path: PathBuf,
        /// 1-based line of the problem.
        line: usize,
        /// The key concerned, when there is one.
        key: Option<String>,
        /// What is wrong.
        message: String,
    },
    /// A file named by `--config` or `LOCKSTEP_CONFIG` does not exist.
    #[error("config file {} (named by {origin}) does not exist; write it with `lockstep config --path {}`, or name another file", .path.display(), .path.display())]
    Missing {
        /// The file.
        path: PathBuf,
        /// Who named it.
        origin: Origin,
    },
    /// The file exists but cannot be read.
    #[error("cannot read config file {}: {source}; check its permissions", .path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// `lockstep config` would overwrite a file.
    #[error("config file {} already exists; pass --force to overwrite it", .path.display())]
    Exists {
        /// The file.
        path: PathBuf,
    },
    /// Its directory cannot be created.
    #[error("cannot create the directory {} for the config file: {source}", .path.display())]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Writing failed.
    #[error(transparent)]
    Write(#[from] WriteError),
    /// `LOCKSTEP_CONFIG` (or another variable) is malformed.
    #[error(transparent)]
    Env(#[from] EnvError),
    /// No default location: neither `XDG_CONFIG_HOME` nor `HOME` is set.
    #[error("cannot find the default config file: neither XDG_CONFIG_HOME nor HOME is set; pass --config FILE or set LOCKSTEP_CONFIG")]
    NoHome,
}

/// The file as serde sees it: spans locate the values that later checks refuse.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    num_processes: Option<Spanned<usize>>,
    num_machines: Option<Spanned<usize>>,
    machine_rank: Option<Spanned<usize>>,
    main_process_ip: Option<Spanned<String>>,
    main_process_port: Option<Spanned<u16>>,
    mixed_precision: Option<MixedPrecision>,
    backend: Option<BackendChoice>,
}

/// 1-based line of byte `at` in `text`.
fn line_of(text: &str, at: usize) -> usize {
    text.as_bytes()[..at.min(text.len())]
        .iter()
        .filter(|b| **b == b'\n')
        .count()
        + 1
}

/// The key of the line holding byte `at`: the text before `=` (or inside `[...]` for a table).
fn key_at(text: &str, at: usize) -> Option<String> {
    let at = at.min(text.len());
    let start = text[..at].rfind('\n').map(|i| i + 1).unwrap_or(0);
    let end = text[at..].find('\n').map(|i| at + i).unwrap_or(text.len());
    let line = text[start..end].trim();
    let key = match line.split_once('=') {
        Some((k, _)) => k,
        None => line.trim_start_matches('[').split(']').next().unwrap_or(""),
    };
    let key = key.trim().trim_matches('"');
    (!key.is_empty() && !key.starts_with('#')).then(|| key.to_string())
}

impl Config {
    /// Parse the text of the file `path` (named in errors).
    pub fn from_toml(text: &str, path: &Path) -> Result<Config, ConfigError> {
        let invalid = |at: usize, key: Option<String>, message: String| ConfigError::Invalid {
            path: path.to_path_buf(),
            line: line_of(text, at),
            key,
            message,
        };
        let raw: Raw = toml::from_str(text).map_err(|e| {
            let at = e.span().map(|s| s.start).unwrap_or(0);
            let mut message = e.message().trim_end().to_string();
            let key = key_at(text, at);
            if key.as_deref() == Some("nproc_per_node") {
                message += " (`nproc_per_node` was the key of lockstep's first config files: write `num_processes`, the \
                            ranks of all machines, instead)";
            }
            invalid(at, key, message)
        })?;
        let at = |s: &std::ops::Range<usize>| s.start;
        let nonzero = |v: &Option<Spanned<usize>>, key: &str| match v {
            Some(s) if *s.get_ref() == 0 => Err(invalid(
                at(&s.span()),
                Some(key.into()),
                format!("{key} = 0: it must be at least 1"),
            )),
            _ => Ok(v.as_ref().map(|s| *s.get_ref())),
        };
        let num_processes = nonzero(&raw.num_processes, "num_processes")?;
        let num_machines = nonzero(&raw.num_machines, "num_machines")?;
        let machines = num_machines.unwrap_or(1);
        if let Some(r) = &raw.machine_rank {
            if *r.get_ref() >= machines {
                return Err(invalid(
                    at(&r.span()),
                    Some("machine_rank".into()),
                    format!(
                        "machine_rank = {} is out of range: machines are numbered 0 to {} (num_machines = {machines})",
                        r.get_ref(),
                        machines - 1
                    ),
                ));
            }
        }
        if let (Some(p), Some(n)) = (&raw.num_processes, num_machines) {
            if p.get_ref() % n != 0 {
                return Err(invalid(
                    at(&p.span()),
                    Some("num_processes".into()),
                    format!("num_processes = {} (the ranks of all machines) is not a multiple of num_machines = {n}", p.get_ref()),
                ));
            }
        }
        if let Some(p) = &raw.main_process_port {
            if *p.get_ref() == 0 {
                return Err(invalid(
                    at(&p.span()),
                    Some("main_process_port".into()),
                    "main_process_port = 0: use a port from 1 to 65535".into(),
                ));
            }
        }
        if let Some(ip) = &raw.main_process_ip {
            let v = ip.get_ref();
            if v.trim().is_empty() || v.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return Err(invalid(
                    at(&ip.span()),
                    Some("main_process_ip".into()),
                    format!("main_process_ip = {v:?} is not a host name or address"),
                ));
            }
        }
        Ok(Config {
            num_processes,
            num_machines,
            machine_rank: raw.machine_rank.map(Spanned::into_inner),
            main_process_ip: raw.main_process_ip.map(Spanned::into_inner),
            main_process_port: raw.main_process_port.map(Spanned::into_inner),
            mixed_precision: raw.mixed_precision,
            backend: raw.backend,
        })
    }

    /// Read and parse `path`.
    pub fn read(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Config::from_toml(&text, path)
    }

    /// Ranks per machine: `num_processes / num_machines`, when the file sets `num_processes`
    /// (the division is exact: [`Config::from_toml`] checks it).
    pub fn processes_per_machine(&self) -> Option<usize> {
        self.num_processes
            .map(|n| n / self.num_machines.unwrap_or(1).max(1))
    }

    /// The file's text: the keys it sets, each with a comment saying what it means.
    pub fn to_toml(&self) -> String {
        let mut s = String::from("# lockstep configuration (`lockstep config` writes it; `lockstep launch` and train-cnn read it;\n# command-line flags and MASTER_ADDR / MASTER_PORT / LOCKSTEP_BACKEND override it)\n");
        let mut line = |key: &str, value: Option<String>, what: &str| {
            if let Some(v) = value {
                s += &format!("{key} = {v:<12} # {what}\n");
            }
        };
        let quoted = |v: &str| toml::Value::String(v.to_string()).to_string();
        line(
            "num_processes",
            self.num_processes.map(|n| n.to_string()),
            "ranks of the whole job, over all machines",
        );
        line(
            "num_machines",
            self.num_machines.map(|n| n.to_string()),
            "machines, each running one `lockstep launch`",
        );
        line(
            "machine_rank",
            self.machine_rank.map(|n| n.to_string()),
            "this machine's index, from 0",
        );
        line(
            "main_process_ip",
            self.main_process_ip.as_deref().map(quoted),
            "address of machine 0 (the rendezvous store)",
        );
        line(
            "main_process_port",
            self.main_process_port.map(|n| n.to_string()),
            "port of the rendezvous store (multi-machine jobs)",
        );
        line(
            "mixed_precision",
            self.mixed_precision.map(|m| quoted(m.name())),
            "no | fp16 | bf16",
        );
        line(
            "backend",
            self.backend.map(|b| quoted(b.name())),
            "shm | nccl | auto (nccl when this machine has a GPU)",
        );
        s
    }

    /// Write the file at `path` atomically, creating its directory; an existing file is an
    /// error unless `overwrite`.
    pub fn write(&self, path: &Path, overwrite: bool) -> Result<(), ConfigError> {
        if !overwrite && std::fs::symlink_metadata(path).is_ok() {
            return Err(ConfigError::Exists {
                path: path.to_path_buf(),
            });
        }
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| ConfigError::CreateDir {
                path: dir.to_path_buf(),
                source,
            })?;
        }
        crate::types::write_atomic(path, self.to_toml().as_bytes(), 0o644)?;
        Ok(())
    }
}

/// `$XDG_CONFIG_HOME/lockstep/config.toml`, else `~/.config/lockstep/config.toml`.
pub fn default_path() -> Result<PathBuf, ConfigError> {
    if let Some(x) = std::env::var_os("XDG_CONFIG_HOME").filter(|x| !x.is_empty()) {
        return Ok(PathBuf::from(x).join("lockstep/config.toml"));
    }
    let home = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .ok_or(ConfigError::NoHome)?;
    Ok(PathBuf::from(home).join(".config/lockstep/config.toml"))
}

/// Where the configuration file is: `flag` (`--config`), else `$LOCKSTEP_CONFIG`, else
/// [`default_path`].
pub fn locate(flag: Option<&Path>) -> Result<(PathBuf, Origin), ConfigError> {
    if let Some(p) = flag {
        return Ok((p.to_path_buf(), Origin::Flag));
    }
    if let Some(p) = env::CONFIG.text()? {
        return Ok((PathBuf::from(p), Origin::Env));
    }
    Ok((default_path()?, Origin::Default))
}

/// The configuration in force and where it came from.
#[derive(Clone, Debug)]
pub struct Loaded {
    /// The file.
    pub path: PathBuf,
    /// Who named it.
    pub origin: Origin,
    /// Whether it exists (only the default location may be missing).
    pub exists: bool,
    /// Its contents ([`Config::default`] when it does not exist).
    pub config: Config,
}

/// Find ([`locate`]) and read the configuration file. A file named by `--config` or
/// `LOCKSTEP_CONFIG` must exist; a missing file at the default location is an empty [`Config`].
pub fn load(flag: Option<&Path>) -> Result<Loaded, ConfigError> {
    let (path, origin) = locate(flag)?;
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let config = Config::from_toml(&text, &path)?;
            Ok(Loaded {
                path,
                origin,
                exists: true,
                config,
            })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && origin == Origin::Default => {
            Ok(Loaded {
                path,
                origin,
                exists: false,
                config: Config::default(),
            })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Err(ConfigError::Missing { path, origin })
        }
        Err(source) => Err(ConfigError::Read { path, source }),
    }
}

/// GPUs of this machine, counted by a forked probe process (this one never initialises CUDA,
/// so it may still fork ranks). 0 without a driver; an error when a driver is there but fails.
pub fn count_gpus() -> Result<usize, String> {
    crate::cuda::init::probe_device_count_child()
}

/// `auto` ranks per machine: one per GPU when there are GPUs, else [`DEFAULT_NUM_PROCESSES`].
pub fn auto_processes_per_machine(gpus: usize) -> usize {
    if gpus > 0 {
        gpus
    } else {
        DEFAULT_NUM_PROCESSES
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(t: &str) -> Result<Config, ConfigError> {
        Config::from_toml(t, Path::new("/x/config.toml"))
    }

    fn invalid(t: &str) -> (usize, Option<String>, String) {
        match parse(t) {
            Err(e @ ConfigError::Invalid { .. }) => {
                let m = e.to_string();
                let ConfigError::Invalid { line, key, .. } = e else {
                    unreachable!()
                };
                assert!(
                    m.contains("/x/config.toml") && m.contains(&format!("line {line}")),
                    "{m}"
                );
                (line, key, m)
            }
            other => panic!("{t:?}: expected Invalid, got {other:?}"),
        }
    }

    #[test]
    fn round_trip_and_comments() {
        let c = Config {
            num_processes: Some(8),
            num_machines: Some(2),
            machine_rank: Some(1),
            main_process_ip: Some("10.0.0.1".into()),
            main_process_port: Some(29600),
            mixed_precision: Some(MixedPrecision::Bf16),
            backend: Some(BackendChoice::Auto),
        };
        assert_eq!(parse(&c.to_toml()).unwrap(), c);
        assert_eq!(c.processes_per_machine(), Some(4));
        assert_eq!(parse("").unwrap(), Config::default());
        let t = "num_processes = 4 # ranks\n# a comment\nbackend = \"nccl\"   # GPUs\n";
        let c = parse(t).unwrap();
        assert_eq!(
            (c.num_processes, c.backend),
            (Some(4), Some(BackendChoice::Nccl))
        );
    }

    #[test]
    fn rejections_name_key_and_line() {
        let (line, key, m) = invalid("num_processes = 2\nnum_procs = 3\n");
        assert_eq!((line, key.as_deref()), (2, Some("num_procs")));
        assert!(m.contains("unknown field"), "{m}");
        let (line, key, m) = invalid("\n\nbackend = \"gpu\"\n");
        assert_eq!((line, key.as_deref()), (3, Some("backend")));
        assert!(m.contains("gpu") && m.contains("nccl"), "{m}");
        let (line, key, _) = invalid("mixed_precision = \"fp8\"");
        assert_eq!((line, key.as_deref()), (1, Some("mixed_precision")));
        let (line, key, m) = invalid("num_processes = \"four\"\n");
        assert_eq!((line, key.as_deref()), (1, Some("num_processes")));
        assert!(m.contains("four") || m.contains("string"), "{m}");
        // Values out of range or of the wrong form: the error names the key that holds them.
        for (text, key) in [
            ("x = 1\nnum_processes = 0\n", "x"),
            ("num_processes = 0\n", "num_processes"),
            ("num_processes = -1\n", "num_processes"),
            ("main_process_port = 70000\n", "main_process_port"),
            ("main_process_port = 0\n", "main_process_port"),
            ("num_processes = 3\nnum_machines = 2\n", "num_processes"),
            ("main_process_ip = \"a b\"\n", "main_process_ip"),
        ] {
            assert_eq!(invalid(text).1.as_deref(), Some(key), "{text:?}");
        }
        assert_eq!(invalid("num_machines = 2\nmachine_rank = 2\n").0, 2);
        let (line, key, m) = invalid("num_processes = 2\n[launch]\nx = 1\n");
        assert_eq!((line, key.as_deref()), (2, Some("launch")));
        assert!(m.contains("unknown field"), "{m}");
        let (line, _, _) = invalid("num_processes = 2\nbackend = \n");
        assert_eq!(line, 2);
        assert!(invalid("nproc_per_node = 4\n").2.contains("num_processes"));
    }

    #[test]
    fn choices_parse_by_name() {
        assert_eq!("BF16".parse::<MixedPrecision>(), Ok(MixedPrecision::Bf16));
        assert!("fp8"
            .parse::<MixedPrecision>()
            .unwrap_err()
            .contains("no (fp32), fp16 or bf16"));
        assert_eq!("auto".parse::<BackendChoice>(), Ok(BackendChoice::Auto));
        assert_eq!(
            (
                BackendChoice::Auto.resolve(0),
                BackendChoice::Auto.resolve(2),
                BackendChoice::Nccl.resolve(0)
            ),
            ("shm", "nccl", "nccl")
        );
        assert_eq!(
            (auto_processes_per_machine(0), auto_processes_per_machine(8)),
            (DEFAULT_NUM_PROCESSES, 8)
        );
    }
}
