//! The `lockstep` command: benchmarks and (later) the launcher.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "lockstep", version, about = "Collective-communication runtime: launcher, benchmarks, diagnostics")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// nccl-tests-style collective benchmark (verifies every result).
    Bench(lockstep::bench::BenchArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Bench(a) => lockstep::bench::run(&a),
    };
    match r {
        Ok(code) => ExitCode::from(code as u8),
        Err(e) => {
            eprintln!("lockstep: {e}");
            ExitCode::from(2)
        }
    }
}
