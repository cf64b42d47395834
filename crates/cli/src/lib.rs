//! The `lockstep` command: `launch` (start a multi-process job), `selftest` (check a job's
//! communicator), `config` (write the configuration file), `env` (print the environment and the
//! configuration in force), `bench` (collective benchmark), `status` (a look at running jobs),
//! `trace` (read a job's flight-recorder files).
//!
//! [`main`] (the binary's) and [`run_args`] (the Python package's `lockstep` console script) only
//! parse arguments, run the subcommand and map the result to an exit status. Raw CLI values (the
//! clap structs) are turned into validated settings ([`lockstep::launch::JobSpec`]) before
//! anything starts. One file per subcommand beside this one (`launch`, `selftest`, `config`,
//! `env`, `bench/`, `status`), `args` for the values several of them read, and `logging` (what the user
//! sees of the library's `tracing` events).

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod args;
mod bench;
mod config;
mod env;
mod launch;
mod logging;
mod selftest;
mod status;
mod trace;

#[derive(Parser, Debug)]
#[command(
    name = "lockstep",
    version,
    about = "Collective-communication runtime: launcher and tools"
)]
struct Cli {
    /// More diagnostics (-v debug, -vv trace); LOCKSTEP_LOG=FILTER overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    /// Only errors.
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    quiet: bool,
    /// Configuration file (default: $LOCKSTEP_CONFIG, else $XDG_CONFIG_HOME/lockstep/config.toml,
    /// else ~/.config/lockstep/config.toml).
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

// Deferred: a command builds only the arguments of the subcommand it runs (and `--help` all of
// them). Every rank of `lockstep launch -- lockstep selftest` parses its command line, and
// building all five subcommands' arguments is a measurable part of a rank's start
// (`benches/baselines/startup.sh`).
#[derive(Subcommand, Debug)]
#[command(defer = true)]
enum Cmd {
    /// Start NPROC ranks of a program on this node, supervise them, exit with the first failure's code.
    Launch(launch::LaunchArgs),
    /// Join the job from the environment, run one verified all-reduce and a barrier.
    Selftest(selftest::SelftestArgs),
    /// Write the configuration file (the machine's defaults, or answers with --interactive).
    Config(config::ConfigArgs),
    /// Print version, OS, CPU and accelerator information, and the configuration in force.
    Env,
    /// nccl-tests-style collective benchmark (verifies every result); sizes take K, M and G
    /// suffixes (powers of 1024).
    Bench(bench::BenchArgs),
    /// Read a job's flight-recorder files (LOCKSTEP_TRACE_DIR): the first call where the ranks
    /// diverge, the ranks that never arrived, and who arrives late.
    Trace(trace::TraceArgs),
    /// List your running jobs on this machine, or show one job's ranks: the collective each is
    /// in, for how long, whom it waits for, who is behind (read-only; --json for scripts).
    Status(status::StatusArgs),
    // -------------------------------------------------------------------------------------------
}

pub fn main() -> ExitCode {
    ExitCode::from(run_args(std::env::args_os()))
}

/// Run the `lockstep` command with `args` (the first is the program name, as in `argv`) and return
/// its exit status: 0 on success, 2 for a usage error (clap's), 1 when the command failed, or for
/// `launch` the job's own status. It prints what the binary prints (help, reports, errors on
/// stderr) and installs the stderr log subscriber, so it is for a process that is this command:
/// the binary, or the Python package's `lockstep` console script.
pub fn run_args<I, T>(args: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version are "errors" that print to stdout and exit 0.
            let _ = e.print();
            return e.exit_code().clamp(0, 255) as u8;
        }
    };
    if let Err(e) = logging::init_logging(cli.verbose, cli.quiet) {
        eprintln!("lockstep: error: {e}");
        return 2;
    }
    match run(cli) {
        Ok(code) => code.clamp(0, 255) as u8,
        Err(e) => {
            eprintln!("lockstep: error: {e}");
            1
        }
    }
}

fn run(cli: Cli) -> Result<i32, String> {
    let file = cli.config.as_deref();
    match cli.cmd {
        Cmd::Bench(a) => bench::run(a),
        Cmd::Launch(a) => launch::run(a, file),
        Cmd::Selftest(a) => selftest::run(a),
        Cmd::Config(a) => config::run(a, file),
        Cmd::Env => Ok(env::run(file)),
        Cmd::Trace(a) => trace::run(a),
        Cmd::Status(a) => status::run(a),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// The subcommands' arguments are deferred (`#[command(defer = true)]`): each is still
    /// parsed, with its defaults, when its subcommand runs, and listed in that subcommand's help.
    #[test]
    fn deferred_subcommands_parse_and_document_their_arguments() {
        let cli = Cli::try_parse_from(["lockstep", "-q", "selftest", "--iters", "3"]).unwrap();
        assert!(cli.quiet);
        match cli.cmd {
            Cmd::Selftest(a) => assert_eq!((a.iters, a.count), (3, 1024)),
            other => panic!("parsed as {other:?}"),
        }
        let cli =
            Cli::try_parse_from(["lockstep", "launch", "--nproc-per-node", "2", "--", "true"])
                .unwrap();
        assert!(matches!(cli.cmd, Cmd::Launch(ref a) if a.program == ["true"]));
        assert!(Cli::try_parse_from(["lockstep", "selftest", "--nproc-per-node", "2"]).is_err());
        let mut cmd = Cli::command();
        cmd.build();
        let launch = cmd.find_subcommand_mut("launch").unwrap();
        let help = launch.render_help().to_string();
        assert!(help.contains("--nproc-per-node"), "{help}");
    }
}
