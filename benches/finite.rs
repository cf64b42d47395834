//! The finite check's cost inside the ranks, paired (see `common/paired.rs`): the check on in
//! one arm and off in two (`Communicator::set_check_finite`), on finite data, which every call
//! reads whole. Off, a call runs the reduction kernel's unchecked instantiation, so the A/A
//! ratio is also what the check costs when off.
//!
//! ```sh
//! cargo bench --bench finite    # all_reduce, 8 B, 64 KiB and 1 MiB, 4 kinds of buffers, 2 ranks
//! LOCKSTEP_BENCH_BLOCKS=200 cargo bench --bench finite
//! ```

#[path = "common/paired.rs"]
mod paired;

fn main() {
    use paired::Bufs::*;
    let bufs = [Ordinary, OrdinaryInPlace, Shared, SharedInPlace];
    paired::run("check", &[8, 64 << 10, 1 << 20], &bufs, |comm, on| {
        comm.set_check_finite(on).map_err(|e| e.to_string())
    });
}
