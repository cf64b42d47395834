//! `lockstep trace DIR`: read the flight recorder's files of a job (`LOCKSTEP_TRACE_DIR`) and say
//! where its ranks diverged, who never arrived at a call others are stuck in, and who arrives late
//! (`lockstep::trace::read` does the work; this prints it).

use std::path::PathBuf;

use clap::Args;
use lockstep::trace::read;

#[derive(Args, Debug)]
pub(crate) struct TraceArgs {
    /// The directory the ranks wrote their traces to (LOCKSTEP_TRACE_DIR).
    pub(crate) dir: PathBuf,
    /// Print the analysis as one JSON object (`{"comms": [...]}`) instead of text.
    #[arg(long)]
    pub(crate) json: bool,
}

pub(crate) fn run(a: TraceArgs) -> Result<i32, String> {
    let reports = read::report(&a.dir).map_err(|e| e.to_string())?;
    if a.json {
        let v = serde_json::json!({ "comms": reports });
        println!("{v}");
    } else {
        for r in &reports {
            print!("{r}");
        }
    }
    Ok(0)
}
