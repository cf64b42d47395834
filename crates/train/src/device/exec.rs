//! [`Exec`]: what the engine needs from an executor (the GPU one in `gpu.rs`, the CPU-twin one in
//! `cpu.rs`).

use super::error::DeviceError;
use super::plan::{Op, Region};
use lockstep::comm::Communicator;

/// What the engine needs from an executor: arenas laid out as [`Tensors`](super::plan::Tensors) says, kernel launches,
/// a few copies, and the two collectives of data-parallel training.
pub trait Exec {
    /// SMs of the device (sizes split-K grids; 1 for the CPU).
    fn sm_count(&self) -> usize;
    /// Upload the whole dataset once (pixels and labels, train split then test split).
    fn upload_dataset(&mut self, images: &[u8], labels: &[u8]) -> Result<(), DeviceError>;
    /// Overwrite an f32 region from host memory (waits).
    fn write_f32(&mut self, r: Region, data: &[f32]) -> Result<(), DeviceError>;
    /// Read an f32 region (waits for all queued work).
    fn read_f32(&mut self, r: Region) -> Result<Vec<f32>, DeviceError>;
    /// Read an i32 region (waits for all queued work).
    fn read_i32(&mut self, r: Region) -> Result<Vec<i32>, DeviceError>;
    /// Upload the epoch's sample ids (one copy per epoch).
    fn load_index_list(&mut self, idx: &[i32]) -> Result<(), DeviceError>;
    /// Copy `dst.len` ids starting at `start` of the index list into `dst` (in stream order).
    fn select_indices(&mut self, dst: Region, start: usize) -> Result<(), DeviceError>;
    /// Enqueue one launch.
    fn run(&mut self, op: &Op) -> Result<(), DeviceError>;
    /// Enqueue a whole step; executors that can, capture it once per `key` and replay it.
    fn run_step(&mut self, _key: u64, ops: &[Op]) -> Result<(), DeviceError> {
        ops.iter().try_for_each(|op| self.run(op))
    }
    /// Average an f32 region over ranks, in place, ordered after all queued work.
    fn all_reduce_mean(&mut self, comm: &mut Communicator, r: Region) -> Result<(), DeviceError>;
    /// Copy rank `root`'s f32 region to every rank.
    fn broadcast(
        &mut self,
        comm: &mut Communicator,
        r: Region,
        root: usize,
    ) -> Result<(), DeviceError>;
    /// Sum host values over ranks through the same communicator (device buffers when it needs them).
    fn all_reduce_sum_host(
        &mut self,
        comm: &mut Communicator,
        v: &mut [f64],
    ) -> Result<(), DeviceError> {
        comm.all_reduce_in_place(v, lockstep::comm::ReduceOp::Sum)?;
        Ok(())
    }
    /// Start reading an f32 region back without waiting (default: read now).
    fn start_read(&mut self, r: Region) -> Result<(), DeviceError> {
        let v = self.read_f32(r)?;
        self.stash(v);
        Ok(())
    }
    /// Finish the read started by [`Exec::start_read`].
    fn finish_read(&mut self) -> Result<Vec<f32>, DeviceError> {
        Ok(self.take_stash())
    }
    /// Default read-back storage (CPU).
    fn stash(&mut self, _v: Vec<f32>) {}
    /// See [`Exec::stash`].
    fn take_stash(&mut self) -> Vec<f32> {
        Vec::new()
    }
}
