//! The `lockstep` binary; everything is in the library ([`lockstep_cli::main`]), which the Python
//! package's console script runs too.

fn main() -> std::process::ExitCode {
    lockstep_cli::main()
}
