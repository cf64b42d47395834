//! The flight recorder's cost inside the ranks, paired (see `common/paired.rs`): the recorder
//! on in one arm and paused in two (`Communicator::set_trace`).
//!
//! ```sh
//! cargo bench --bench recorder              # all_reduce, 8 B and 1 MiB, 2 ranks
//! LOCKSTEP_BENCH_BLOCKS=200 cargo bench --bench recorder
//! ```

#[path = "common/paired.rs"]
mod paired;

fn main() {
    paired::run(
        "recorder",
        &[8, 1 << 20],
        &[paired::Bufs::Ordinary],
        |comm, on| {
            if comm.trace_reader().is_none() {
                return Err(
                "the flight recorder is off (LOCKSTEP_TRACE_BUFFER=0): unset it to measure its cost"
                    .into(),
            );
            }
            comm.set_trace(on);
            Ok(())
        },
    );
}
