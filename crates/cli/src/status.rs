//! `lockstep status [JOB] [--json]`: this user's running jobs on this machine, or one job's
//! ranks (the collective each is in, for how long, whom it waits for, who is behind), read from
//! the segments without disturbing the jobs (`lockstep::status`).

use clap::Args;

#[derive(Args, Debug)]
pub(crate) struct StatusArgs {
    /// The job: its id (LOCKSTEP_JOB_ID, as the list shows it) or the pid of any of its
    /// processes. Without it, the list of jobs.
    pub(crate) job: Option<String>,
    /// Print JSON (the same as lockstepStatusJson in C and lockstep.status() in Python).
    #[arg(long)]
    pub(crate) json: bool,
}

/// List the jobs (exit 0, with a message when none runs) or show one (exit 1 when it is not
/// found or cannot be read).
pub(crate) fn run(a: StatusArgs) -> Result<i32, String> {
    match a.job.as_deref() {
        None => {
            let list = lockstep::status::list_jobs().map_err(|e| e.to_string())?;
            if a.json {
                println!("{}", list.to_json());
            } else {
                print!("{}", list.text());
            }
        }
        Some(job) => {
            let st = lockstep::status::job_status(job).map_err(|e| e.to_string())?;
            if a.json {
                println!("{}", st.to_json());
            } else {
                print!("{}", st.text());
            }
        }
    }
    Ok(0)
}
