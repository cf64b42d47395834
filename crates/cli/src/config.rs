//! `lockstep config`: write the configuration file, from the machine's defaults or Accelerate's
//! questions.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use clap::Args;
use lockstep::config::{self, BackendChoice, MixedPrecision};

use crate::args::{parse_backend, parse_precision, parse_procs, Gpus, Procs};

#[derive(Args, Debug)]
pub(crate) struct ConfigArgs {
    /// Where to write (default: --config, else $LOCKSTEP_CONFIG, else
    /// $XDG_CONFIG_HOME/lockstep/config.toml, else ~/.config/lockstep/config.toml).
    #[arg(long)]
    path: Option<PathBuf>,
    /// Overwrite an existing file.
    #[arg(long)]
    force: bool,
    /// Ask Accelerate's questions on standard input (an empty answer takes the default shown).
    #[arg(long, short = 'i')]
    interactive: bool,
    /// Ranks of the whole job, over all machines (default: GPUs of this machine, else 2, times
    /// --num-machines).
    #[arg(long, visible_alias = "num_processes", value_name = "N|auto|gpu|cpu", value_parser = parse_procs)]
    num_processes: Option<Procs>,
    /// Ranks per machine, as `lockstep launch --nproc-per-node` reads it: the job gets this
    /// times --num-machines.
    #[arg(long, visible_alias = "nproc_per_node", value_name = "N|auto|gpu|cpu", value_parser = parse_procs, conflicts_with = "num_processes")]
    nproc_per_node: Option<Procs>,
    /// Machines of the job (default 1).
    #[arg(long, visible_alias = "num_machines")]
    num_machines: Option<usize>,
    /// This machine's index (default 0).
    #[arg(long, visible_alias = "machine_rank")]
    machine_rank: Option<usize>,
    /// Address of machine 0 (default 127.0.0.1).
    #[arg(long, visible_alias = "main_process_ip")]
    main_process_ip: Option<String>,
    /// Port of the rendezvous store (default 29500).
    #[arg(long, visible_alias = "main_process_port")]
    main_process_port: Option<u16>,
    /// Backend: shm, nccl or auto (default: nccl with GPUs, else shm).
    #[arg(long, value_parser = parse_backend)]
    backend: Option<BackendChoice>,
    /// Mixed precision: no, fp16 or bf16 (default: bf16 with GPUs, else no).
    #[arg(long, visible_alias = "mixed_precision", value_parser = parse_precision)]
    mixed_precision: Option<MixedPrecision>,
}

// config

/// Questions on standard input, answers checked; a wrong answer is asked again.
struct Asker<R: BufRead> {
    input: R,
}

impl<R: BufRead> Asker<R> {
    /// Ask `question` with `default` shown; an empty answer takes it.
    fn ask<T: std::fmt::Display>(
        &mut self,
        question: &str,
        default: T,
        parse: impl Fn(&str) -> Result<T, String>,
    ) -> Result<T, String> {
        loop {
            print!("{question} [{default}]: ");
            let _ = std::io::stdout().flush();
            let mut line = String::new();
            let n = self
                .input
                .read_line(&mut line)
                .map_err(|e| format!("cannot read the answer from standard input: {e}"))?;
            if n == 0 {
                println!();
                return Err(format!(
                    "standard input ended before the answer to {question:?}; nothing was written"
                ));
            }
            let t = line.trim();
            if t.is_empty() {
                return Ok(default);
            }
            match parse(t) {
                Ok(v) => return Ok(v),
                Err(e) => println!("  {e}; try again"),
            }
        }
    }
}

fn count_at_least(min: usize) -> impl Fn(&str) -> Result<usize, String> {
    move |s| match s.parse::<usize>() {
        Ok(n) if n >= min => Ok(n),
        _ => Err(format!("{s:?} is not a whole number of at least {min}")),
    }
}

/// Accelerate's questions (`accelerate config`), for the keys lockstep has.
fn interview(input: impl BufRead, d: config::Config) -> Result<config::Config, String> {
    let mut q = Asker { input };
    let backend = q.ask(
        "Which backend will the ranks use? (shm: CPU shared memory, nccl: GPUs, auto: nccl when the machine has a GPU)",
        d.backend.unwrap_or_default(),
        parse_backend,
    )?;
    let machines = q.ask(
        "How many different machines will you use (use more than 1 for multi-node training)?",
        d.num_machines.unwrap_or(1),
        count_at_least(1),
    )?;
    let (mut rank, mut ip, mut port) = (0, d.main_process_ip.clone(), d.main_process_port);
    if machines > 1 {
        rank = q.ask(
            "What is the rank of this machine?",
            d.machine_rank.unwrap_or(0).min(machines - 1),
            |s| match s.parse::<usize>() {
                Ok(r) if r < machines => Ok(r),
                _ => Err(format!(
                    "{s:?} is not a machine rank from 0 to {}",
                    machines - 1
                )),
            },
        )?;
        ip = Some(q.ask(
            "What is the IP address of the machine that will host the main process?",
            ip.unwrap_or_else(|| config::DEFAULT_MAIN_PROCESS_IP.into()),
            |s| {
                if s.chars().any(char::is_whitespace) {
                    Err(format!("{s:?} is not an address"))
                } else {
                    Ok(s.to_string())
                }
            },
        )?);
        port = Some(q.ask(
            "What is the port you will use to communicate with the main process?",
            port.unwrap_or(config::DEFAULT_MAIN_PROCESS_PORT),
            |s| match s.parse::<u16>() {
                Ok(p) if p > 0 => Ok(p),
                _ => Err(format!("{s:?} is not a port from 1 to 65535")),
            },
        )?);
    }
    let per_machine = d
        .processes_per_machine()
        .unwrap_or(config::DEFAULT_NUM_PROCESSES);
    let total = q.ask(
        "How many processes in total will you use (all machines together)?",
        per_machine * machines,
        move |s| match count_at_least(1)(s)? {
            n if n % machines == 0 => Ok(n),
            n => Err(format!(
                "{n} processes cannot be shared evenly by {machines} machines"
            )),
        },
    )?;
    let mp = q.ask(
        "Do you wish to use mixed precision? (no, fp16, bf16)",
        d.mixed_precision.unwrap_or_default(),
        parse_precision,
    )?;
    Ok(config::Config {
        num_processes: Some(total),
        num_machines: Some(machines),
        machine_rank: Some(rank),
        main_process_ip: Some(ip.unwrap_or_else(|| config::DEFAULT_MAIN_PROCESS_IP.into())),
        main_process_port: Some(port.unwrap_or(config::DEFAULT_MAIN_PROCESS_PORT)),
        mixed_precision: Some(mp),
        backend: Some(backend),
    })
}

/// `lockstep config`: the machine's defaults (flags override them), or the answers to the
/// questions with `--interactive` (the flags' values are the defaults offered).
pub(crate) fn run(a: ConfigArgs, file: Option<&Path>) -> Result<i32, String> {
    let path = match a.path.as_deref().or(file) {
        Some(p) => p.to_path_buf(),
        None => config::locate(None).map_err(|e| e.to_string())?.0,
    };
    if !a.force && std::fs::symlink_metadata(&path).is_ok() {
        return Err(config::ConfigError::Exists { path }.to_string());
    }
    // A forked probe counts the GPUs: this process never initialises CUDA.
    let probe = config::count_gpus();
    let gpus = *probe.as_ref().unwrap_or(&0);
    if let Err(e) = &probe {
        eprintln!("lockstep: warning: the CUDA probe failed ({e}); writing the defaults of a machine without GPUs");
    }
    let machines = a.num_machines.unwrap_or(1);
    if machines == 0 {
        return Err("--num-machines 0: a job runs on at least 1 machine".into());
    }
    let mut known = Gpus(Some(gpus));
    let total = match (a.num_processes, a.nproc_per_node) {
        (Some(Procs::N(n)), _) => n,
        (Some(p), _) | (None, Some(p)) => p.per_machine(&mut known)? * machines,
        (None, None) => config::auto_processes_per_machine(gpus) * machines,
    };
    let defaults = config::Config {
        num_processes: Some(total),
        num_machines: Some(machines),
        machine_rank: Some(a.machine_rank.unwrap_or(0)),
        main_process_ip: Some(
            a.main_process_ip
                .unwrap_or_else(|| config::DEFAULT_MAIN_PROCESS_IP.into()),
        ),
        main_process_port: Some(
            a.main_process_port
                .unwrap_or(config::DEFAULT_MAIN_PROCESS_PORT),
        ),
        mixed_precision: Some(a.mixed_precision.unwrap_or(if gpus > 0 {
            MixedPrecision::Bf16
        } else {
            MixedPrecision::No
        })),
        backend: Some(a.backend.unwrap_or(if gpus > 0 {
            BackendChoice::Nccl
        } else {
            BackendChoice::Shm
        })),
    };
    let c = if a.interactive {
        interview(std::io::stdin().lock(), defaults)?
    } else {
        defaults
    };
    // The same checks as reading it back: what is written always loads.
    let text = c.to_toml();
    config::Config::from_toml(&text, &path).map_err(|e| e.to_string())?;
    c.write(&path, a.force).map_err(|e| e.to_string())?;
    let found = match &probe {
        Ok(0) => "no GPU found".to_string(),
        Ok(n) => format!("{n} GPU(s) found"),
        Err(_) => "GPU probe failed".to_string(),
    };
    println!("wrote {} ({found}):\n{text}", path.display());
    Ok(0)
}
