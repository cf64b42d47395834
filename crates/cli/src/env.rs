//! `lockstep env`: version, OS, CPU and accelerator information, and the configuration in force.

use std::io::Write;
use std::path::Path;

use lockstep::config;

use crate::args::env_master;

/// Print the report; 1 when the configuration file cannot be used (the report says why).
pub(crate) fn run(file: Option<&Path>) -> i32 {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let os = read("/etc/os-release")
        .lines()
        .find_map(|l| {
            l.strip_prefix("PRETTY_NAME=")
                .map(|v| v.trim_matches('"').to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let kernel = read("/proc/sys/kernel/osrelease").trim().to_string();
    let cpu = read("/proc/cpuinfo")
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.into());
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let mem = read("/proc/meminfo")
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:").map(|v| v.trim().to_string()))
        .unwrap_or_default();
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "lockstep {}", env!("CARGO_PKG_VERSION"));
    let _ = writeln!(
        o,
        "os:      {os} (Linux {kernel}, {})",
        std::env::consts::ARCH
    );
    let _ = writeln!(o, "cpu:     {cpu}, {cpus} available");
    let _ = writeln!(o, "memory:  {mem}");
    let host = lockstep::rendezvous::host_id().unwrap_or_else(|e| format!("unknown: {e}"));
    let _ = writeln!(o, "host id: {host}");
    let code = match config_report(file) {
        Ok(text) => {
            let _ = write!(o, "{text}");
            0
        }
        Err(e) => {
            let _ = writeln!(o, "config:  error: {e}");
            1
        }
    };
    let _ = writeln!(o, "cuda/nccl:");
    // Library discovery and version queries only: nothing here calls cuInit or MPI_Init, so
    // `lockstep env` never leaves CUDA or MPI initialised behind a notebook's back. The MPI line
    // says which MPI-5 ABI library was found and why, or why none can be used.
    let _ = write!(o, "{}", lockstep::report::env_report());
    code
}

/// The configuration in force: the file, and each setting with where it comes from (the
/// environment overrides the file, which overrides the default).
fn config_report(file: Option<&Path>) -> Result<String, String> {
    let l = config::load(file).map_err(|e| e.to_string())?;
    let c = &l.config;
    let mut s = format!(
        "config:  {} ({}{})\n",
        l.path.display(),
        l.origin,
        if l.exists {
            ""
        } else {
            "; not found: defaults in force; write one with `lockstep config`"
        }
    );
    let (env_addr, env_port) = env_master()?;
    let env_backend = lockstep::types::env::BACKEND
        .choice()
        .map_err(|e| e.to_string())?;
    let from = |set: bool| if set { "file" } else { "default" };
    let mut row = |key: &str, value: String, source: String| {
        s += &format!("  {key:<18} = {value:<12} ({source})\n")
    };
    let per = c.processes_per_machine();
    row(
        "num_processes",
        c.num_processes
            .unwrap_or(config::DEFAULT_NUM_PROCESSES * c.num_machines.unwrap_or(1))
            .to_string(),
        format!(
            "{}; {} per machine",
            from(c.num_processes.is_some()),
            per.unwrap_or(config::DEFAULT_NUM_PROCESSES)
        ),
    );
    row(
        "num_machines",
        c.num_machines.unwrap_or(1).to_string(),
        from(c.num_machines.is_some()).into(),
    );
    row(
        "machine_rank",
        c.machine_rank.unwrap_or(0).to_string(),
        from(c.machine_rank.is_some()).into(),
    );
    let (ip, ip_from) = match (&env_addr, &c.main_process_ip) {
        (Some(e), _) => (e.clone(), "environment: MASTER_ADDR".to_string()),
        (None, Some(f)) => (f.clone(), "file".into()),
        (None, None) => (config::DEFAULT_MAIN_PROCESS_IP.into(), "default".into()),
    };
    row("main_process_ip", format!("{ip:?}"), ip_from);
    let (port, port_from) = match (env_port, c.main_process_port) {
        (Some(e), _) => (e, "environment: MASTER_PORT"),
        (None, Some(f)) => (f, "file"),
        (None, None) => (config::DEFAULT_MAIN_PROCESS_PORT, "default"),
    };
    row("main_process_port", port.to_string(), port_from.into());
    row(
        "mixed_precision",
        format!("{:?}", c.mixed_precision.unwrap_or_default().name()),
        from(c.mixed_precision.is_some()).into(),
    );
    let (b, b_from) = match (env_backend, c.backend) {
        (Some(e), _) => (e.to_string(), "environment: LOCKSTEP_BACKEND"),
        (None, Some(f)) => (f.name().to_string(), "file"),
        (None, None) => ("shm".into(), "default"),
    };
    row("backend", format!("{b:?}"), b_from.into());
    Ok(s)
}
