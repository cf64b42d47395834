//! Values more than one subcommand reads: numbers of ranks, backend and precision names, the GPU
//! count, and the launcher's `MASTER_ADDR`/`MASTER_PORT`.

use lockstep::config::{self, BackendChoice, MixedPrecision};

/// A number of ranks as torchrun takes it: a number, `auto` (one per GPU of this machine, else
/// [`config::DEFAULT_NUM_PROCESSES`]), `gpu` (one per GPU) or `cpu` (one per CPU).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Procs {
    Auto,
    Gpu,
    Cpu,
    N(usize),
}

pub(crate) fn parse_procs(s: &str) -> Result<Procs, String> {
    match s.trim() {
        "auto" => Ok(Procs::Auto),
        "gpu" => Ok(Procs::Gpu),
        "cpu" => Ok(Procs::Cpu),
        t => match t.parse::<usize>() {
            Ok(0) => Err("0 ranks cannot run anything: give at least 1, or `auto` (one per GPU, else 2), `gpu` or `cpu`".into()),
            Ok(n) => Ok(Procs::N(n)),
            Err(_) => Err(format!("{t:?} is not a number of ranks: give a whole number of at least 1, or `auto`, `gpu` or `cpu`")),
        },
    }
}

impl Procs {
    /// Ranks per machine.
    pub(crate) fn per_machine(self, gpus: &mut Gpus) -> Result<usize, String> {
        match self {
            Procs::N(n) => Ok(n),
            Procs::Auto => Ok(config::auto_processes_per_machine(gpus.get("`auto` ranks")?)),
            Procs::Gpu => match gpus.get("`gpu` ranks")? {
                0 => Err("`gpu` starts one rank per GPU, but this machine has none: give a number of ranks, or `cpu`".into()),
                n => Ok(n),
            },
            Procs::Cpu => Ok(std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)),
        }
    }
}

pub(crate) fn parse_backend(s: &str) -> Result<BackendChoice, String> {
    s.parse()
}

pub(crate) fn parse_precision(s: &str) -> Result<MixedPrecision, String> {
    s.parse()
}

/// GPUs of this machine, probed once (a forked child counts them: this process never
/// initialises CUDA, so it may still fork and exec ranks).
pub(crate) struct Gpus(pub(crate) Option<usize>);

impl Gpus {
    pub(crate) fn get(&mut self, why: &str) -> Result<usize, String> {
        if let Some(n) = self.0 {
            return Ok(n);
        }
        let n = config::count_gpus()
            .map_err(|e| format!("{why} needs the number of GPUs, but the CUDA probe failed: {e}; give the value explicitly instead"))?;
        self.0 = Some(n);
        Ok(n)
    }
}

/// `MASTER_ADDR` / `MASTER_PORT` of the launcher's environment, parsed strictly (a malformed
/// value is an error naming it, never ignored).
pub(crate) fn env_master() -> Result<(Option<String>, Option<u16>), String> {
    use lockstep::types::env;
    let addr = env::raw("MASTER_ADDR")
        .map_err(|e| e.to_string())?
        .map(|v| env::parse_text("MASTER_ADDR", &v))
        .transpose();
    let port = env::raw("MASTER_PORT")
        .map_err(|e| e.to_string())?
        .map(|v| env::parse_count("MASTER_PORT", &v, 1, 65535))
        .transpose();
    Ok((
        addr.map_err(|e| e.to_string())?,
        port.map_err(|e| e.to_string())?.map(|p| p as u16),
    ))
}
